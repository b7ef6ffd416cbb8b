//! The dashboard's history: every `STEP` the gateway samples itself (tokens generated, latency
//! quantiles of that step, admission, the prefix caches' share of the prompts that ended) and its swarm (each worker's load from its heartbeats), and
//! keeps the last `WINDOW`, so the charts show the last 15 minutes without a time-series database.

use crate::service::Gateway;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One sample this often.
pub const STEP: Duration = Duration::from_secs(2);
/// Samples kept: 15 minutes of them.
const WINDOW: usize = 450;
/// Latency observations kept for one step's quantiles; past it a step's quantiles are those of
/// its first observations (far more than a 2-core gateway streams in two seconds).
const LATENCY_CAP: usize = 1 << 17;

/// What the request path feeds the history between samples.
#[derive(Default)]
pub struct Feed {
    tokens: AtomicU64,
    /// Prompt tokens of the requests that ended, and of those the prefix caches held.
    prompt: AtomicU64,
    cached: AtomicU64,
    ttft: Mutex<Vec<f32>>,
    itl: Mutex<Vec<f32>>,
}

impl Feed {
    /// A token reached its request, `since` after the request's previous token (or, for its
    /// first, after the request started).
    pub fn token(&self, since: Duration, first: bool) {
        self.tokens.fetch_add(1, Relaxed);
        let mut v = if first { &self.ttft } else { &self.itl }.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() < LATENCY_CAP {
            v.push(since.as_secs_f32());
        }
    }

    /// A request ended: its prompt's tokens, and how many of them the route's caches held.
    pub fn ended(&self, prompt: usize, cached: usize) {
        self.prompt.fetch_add(prompt as u64, Relaxed);
        self.cached.fetch_add(cached as u64, Relaxed);
    }

    fn take(m: &Mutex<Vec<f32>>) -> Vec<f32> {
        std::mem::take(&mut *m.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// One worker's load at a sample, from its last heartbeat.
#[derive(Clone, Debug, PartialEq)]
struct WorkerPoint {
    sessions: u32,
    queue_depth: u32,
    kv_used: u64,
    kv_tokens: u64,
    step_us: f64,
}

#[derive(Clone, Debug, PartialEq)]
struct Sample {
    unix_s: f64,
    tokens_per_s: f64,
    /// Seconds; `None` when the step saw no such latency.
    ttft: Option<(f64, f64)>,
    itl: Option<(f64, f64)>,
    queued: usize,
    running: usize,
    /// The share of the prompt tokens of the requests that ended in the step that came from the
    /// prefix caches; `None` when none ended.
    cache_hit: Option<f64>,
    /// By worker id; absent when the tracker was not reachable.
    workers: Option<BTreeMap<String, WorkerPoint>>,
}

#[derive(Default)]
pub struct History {
    samples: Mutex<VecDeque<Sample>>,
}

impl History {
    fn push(&self, s: Sample) {
        let mut v = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() == WINDOW {
            v.pop_front();
        }
        v.push_back(s);
    }

    /// Tokens per second over the last `steps` samples (0 before the first).
    pub fn tokens_per_s(&self, steps: usize) -> f64 {
        let v = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let n = v.len().min(steps.max(1));
        if n == 0 {
            return 0.0;
        }
        v.iter().rev().take(n).map(|s| s.tokens_per_s).sum::<f64>() / n as f64
    }

    /// The window as the charts read it: one array per series, aligned with `t` (unix seconds),
    /// `null` where a step had no value (no latency observed, a worker not yet registered, the
    /// tracker unreachable). Latencies in milliseconds, KV use as a fraction of capacity.
    pub fn json(&self) -> Value {
        let v = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let col = |f: &dyn Fn(&Sample) -> Value| Value::Array(v.iter().map(f).collect());
        let ms = |x: Option<(f64, f64)>, hi: bool| x.map_or(Value::Null, |(p50, p99)| json!(1e3 * if hi { p99 } else { p50 }));
        let ids: std::collections::BTreeSet<&String> = v.iter().filter_map(|s| s.workers.as_ref()).flat_map(|w| w.keys()).collect();
        let workers: Vec<Value> = ids
            .into_iter()
            .map(|id| {
                let of = |f: &dyn Fn(&WorkerPoint) -> Value| col(&|s| s.workers.as_ref().and_then(|w| w.get(id)).map_or(Value::Null, f));
                json!({
                    "id": id,
                    "sessions": of(&|w| json!(w.sessions)),
                    "queue_depth": of(&|w| json!(w.queue_depth)),
                    "kv_used_frac": of(&|w| if w.kv_tokens == 0 { Value::Null } else { json!(w.kv_used as f64 / w.kv_tokens as f64) }),
                    "step_ms": of(&|w| json!(w.step_us / 1e3)),
                })
            })
            .collect();
        let kv = |s: &Sample| {
            let w = s.workers.as_ref()?;
            let (used, cap) = w.values().fold((0u64, 0u64), |(u, c), p| (u + p.kv_used, c + p.kv_tokens));
            (cap > 0).then(|| used as f64 / cap as f64)
        };
        json!({
            "step_s": STEP.as_secs_f64(),
            "t": col(&|s| json!(s.unix_s)),
            "tokens_per_s": col(&|s| json!(s.tokens_per_s)),
            "ttft_p50_ms": col(&|s| ms(s.ttft, false)),
            "ttft_p99_ms": col(&|s| ms(s.ttft, true)),
            "itl_p50_ms": col(&|s| ms(s.itl, false)),
            "itl_p99_ms": col(&|s| ms(s.itl, true)),
            "queued": col(&|s| json!(s.queued)),
            "running": col(&|s| json!(s.running)),
            "kv_used_frac": col(&|s| kv(s).map_or(Value::Null, |x| json!(x))),
            "cache_hit_frac": col(&|s| s.cache_hit.map_or(Value::Null, |x| json!(x))),
            "workers": workers,
        })
    }
}

/// The 50th and 99th percentiles (nearest rank) of `v`; `None` if it is empty.
fn quantiles(mut v: Vec<f32>) -> Option<(f64, f64)> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable_by(f32::total_cmp);
    let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1] as f64;
    Some((at(0.50), at(0.99)))
}

/// Samples `gw` every `STEP` until the task is dropped.
pub async fn run(gw: Arc<Gateway>) {
    let mut tick = tokio::time::interval(STEP);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = Instant::now();
    tick.tick().await;
    loop {
        tick.tick().await;
        let swarm = gw.swarm().await;
        let now = Instant::now();
        let feed = &gw.metrics.feed;
        let tokens = feed.tokens.swap(0, Relaxed);
        let (prompt, cached) = (feed.prompt.swap(0, Relaxed), feed.cached.swap(0, Relaxed));
        let workers = swarm.map(|r| {
            r.workers
                .iter()
                .filter_map(|w| {
                    let reg = w.registration.as_ref()?;
                    let load = w.load.unwrap_or_default();
                    let p = WorkerPoint {
                        sessions: load.sessions,
                        queue_depth: load.queue_depth,
                        kv_used: load.kv_used_tokens,
                        kv_tokens: reg.kv_tokens,
                        step_us: load.recent_step_us,
                    };
                    Some((w.worker_id.clone(), p))
                })
                .collect()
        });
        gw.history.push(Sample {
            unix_s: dgr_telemetry::unix_ms() as f64 / 1e3,
            tokens_per_s: tokens as f64 / now.duration_since(last).as_secs_f64().max(1e-3),
            ttft: quantiles(Feed::take(&feed.ttft)),
            itl: quantiles(Feed::take(&feed.itl)),
            queued: gw.admission.waiting(),
            running: gw.admission.running(gw.cfg.max_running),
            cache_hit: (prompt > 0).then(|| cached as f64 / prompt as f64),
            workers,
        });
        last = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t: f64, tps: f64, workers: Option<Vec<(&str, u64, u64)>>) -> Sample {
        Sample {
            unix_s: t,
            tokens_per_s: tps,
            ttft: None,
            itl: Some((0.010, 0.030)),
            queued: 1,
            running: 2,
            cache_hit: (tps > 15.0).then_some(0.5),
            workers: workers.map(|ws| {
                ws.into_iter()
                    .map(|(id, used, cap)| {
                        (id.to_string(), WorkerPoint { sessions: 1, queue_depth: 0, kv_used: used, kv_tokens: cap, step_us: 1500.0 })
                    })
                    .collect()
            }),
        }
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        assert_eq!(quantiles(vec![]), None);
        assert_eq!(quantiles(vec![3.0]), Some((3.0, 3.0)));
        let v: Vec<f32> = (1..=200).rev().map(|i| i as f32).collect();
        assert_eq!(quantiles(v), Some((100.0, 198.0)));
    }

    #[test]
    fn feed_counts_tokens_and_splits_first_from_later() {
        let f = Feed::default();
        f.token(Duration::from_millis(250), true);
        f.token(Duration::from_millis(20), false);
        f.token(Duration::from_millis(30), false);
        assert_eq!(f.tokens.load(Relaxed), 3);
        f.ended(100, 64);
        f.ended(20, 0);
        assert_eq!((f.prompt.load(Relaxed), f.cached.load(Relaxed)), (120, 64));
        assert_eq!(Feed::take(&f.ttft), vec![0.25]);
        assert_eq!(Feed::take(&f.itl), vec![0.02, 0.03]);
        assert!(Feed::take(&f.itl).is_empty(), "taking empties the step");
    }

    #[test]
    fn json_aligns_every_series_with_time_and_keeps_the_window() {
        let h = History::default();
        h.push(sample(1.0, 10.0, None));
        h.push(sample(3.0, 20.0, Some(vec![("a", 10, 100)])));
        h.push(sample(5.0, 30.0, Some(vec![("a", 30, 100), ("b", 50, 100)])));
        let j = h.json();
        assert_eq!(j["t"], json!([1.0, 3.0, 5.0]));
        assert_eq!(j["tokens_per_s"], json!([10.0, 20.0, 30.0]));
        assert_eq!(j["ttft_p50_ms"], json!([null, null, null]));
        assert_eq!(j["itl_p50_ms"], json!([10.0, 10.0, 10.0]));
        assert_eq!(j["kv_used_frac"], json!([null, 0.1, 0.4]));
        assert_eq!(j["cache_hit_frac"], json!([null, 0.5, 0.5]));
        assert_eq!(j["workers"][0]["id"], "a");
        assert_eq!(j["workers"][0]["kv_used_frac"], json!([null, 0.1, 0.3]));
        assert_eq!(j["workers"][1]["queue_depth"], json!([null, null, 0]));
        assert_eq!(h.tokens_per_s(2), 25.0);
        for i in 0..WINDOW {
            h.push(sample(10.0 + i as f64, 1.0, None));
        }
        let j = h.json();
        assert_eq!(j["t"].as_array().unwrap().len(), WINDOW);
        assert_eq!(j["t"][0], json!(10.0), "the oldest samples leave first");
    }
}

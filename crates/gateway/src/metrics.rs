//! What the gateway reports at /metrics, as Prometheus text: requests and tokens by model and
//! key, time to first token and inter-token latency histograms, errors by kind, the queue.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 14] = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, f64::INFINITY];

#[derive(Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, secs: f64) {
        let i = BUCKETS.iter().position(|b| secs <= *b).unwrap_or(BUCKETS.len() - 1);
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_micros.fetch_add((secs * 1e6) as u64, Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        let mut acc = 0;
        for (b, c) in BUCKETS.iter().zip(&self.counts) {
            acc += c.load(Relaxed);
            let le = if b.is_infinite() { "+Inf".to_string() } else { b.to_string() };
            out.push_str(&format!("{name}_bucket{{le=\"{le}\"}} {acc}\n"));
        }
        out.push_str(&format!("{name}_sum {}\n{name}_count {acc}\n", self.sum_micros.load(Relaxed) as f64 / 1e6));
    }
}

#[derive(Default, Clone, Copy)]
pub struct Tally {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

#[derive(Default)]
pub struct HttpMetrics {
    pub ttft: Histogram,
    pub itl: Histogram,
    /// Per (model, key).
    tallies: Mutex<BTreeMap<(String, String), Tally>>,
    errors: Mutex<BTreeMap<String, u64>>,
    /// Spot checks by result (agree, quarantined, undecided, ...).
    checks: Mutex<BTreeMap<String, u64>>,
    /// Completion tokens in the last seconds, for the dashboard's tokens/s: (unix second, tokens).
    recent: Mutex<Vec<(u64, u64)>>,
}

fn unix_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl HttpMetrics {
    pub fn error(&self, kind: &str) {
        *self.errors.lock().unwrap_or_else(|p| p.into_inner()).entry(kind.to_string()).or_default() += 1;
    }

    pub fn check(&self, result: &str) {
        *self.checks.lock().unwrap_or_else(|p| p.into_inner()).entry(result.to_string()).or_default() += 1;
    }

    pub fn finished(&self, model: &str, key: &str, prompt: usize, completion: usize, error: Option<&str>) {
        {
            let mut t = self.tallies.lock().unwrap_or_else(|p| p.into_inner());
            let e = t.entry((model.to_string(), key.to_string())).or_default();
            e.requests += 1;
            e.prompt_tokens += prompt as u64;
            e.completion_tokens += completion as u64;
        }
        if let Some(kind) = error {
            self.error(kind);
        }
        let now = unix_secs();
        let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        r.retain(|(t, _)| now.saturating_sub(*t) < 60);
        r.push((now, completion as u64));
    }

    /// Completion tokens per second over the last `window` seconds.
    pub fn tokens_per_s(&self, window: u64) -> f64 {
        let now = unix_secs();
        let r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        r.iter().filter(|(t, _)| now.saturating_sub(*t) < window).map(|(_, n)| *n).sum::<u64>() as f64 / window as f64
    }

    pub fn tallies(&self) -> Vec<((String, String), Tally)> {
        self.tallies.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    pub fn render(&self, queue_depth: usize, running: usize) -> String {
        let mut out = String::new();
        let tallies = self.tallies();
        for (name, help, f) in [
            ("dgr_gateway_requests_total", "Requests finished, by model and key.", (|t: &Tally| t.requests) as fn(&Tally) -> u64),
            ("dgr_gateway_prompt_tokens_total", "Prompt tokens, by model and key.", |t: &Tally| t.prompt_tokens),
            ("dgr_gateway_completion_tokens_total", "Completion tokens, by model and key.", |t: &Tally| t.completion_tokens),
        ] {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} counter\n"));
            for ((model, key), t) in &tallies {
                out.push_str(&format!("{name}{{model=\"{}\",key=\"{}\"}} {}\n", escape(model), escape(key), f(t)));
            }
        }
        self.ttft.render("dgr_gateway_ttft_seconds", "Time to first token.", &mut out);
        self.itl.render("dgr_gateway_inter_token_seconds", "Time between successive tokens of a stream.", &mut out);
        out.push_str("# HELP dgr_gateway_errors_total Requests refused or failed, by kind.\n# TYPE dgr_gateway_errors_total counter\n");
        for (kind, n) in self.errors.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            out.push_str(&format!("dgr_gateway_errors_total{{kind=\"{}\"}} {n}\n", escape(kind)));
        }
        out.push_str("# HELP dgr_gateway_spot_checks_total Stage spot checks, by result.\n# TYPE dgr_gateway_spot_checks_total counter\n");
        for (result, n) in self.checks.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            out.push_str(&format!("dgr_gateway_spot_checks_total{{result=\"{}\"}} {n}\n", escape(result)));
        }
        out.push_str(&format!(
            "# HELP dgr_gateway_queue_depth Requests waiting for admission.\n# TYPE dgr_gateway_queue_depth gauge\ndgr_gateway_queue_depth {queue_depth}\n"
        ));
        out.push_str(&format!(
            "# HELP dgr_gateway_running Generations running.\n# TYPE dgr_gateway_running gauge\ndgr_gateway_running {running}\n"
        ));
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

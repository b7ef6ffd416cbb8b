//! Live state, in memory: which workers are connected, their last heartbeat and load, and the
//! routes issued to them in the last moments. Planning a route reads it; nothing here is
//! durable (a restarted tracker learns it again as workers re-join).

use crate::plan::{plan, Candidate};
use dgr_proto::{Load, Registration, RouteStage, TrackerFrame};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Per-hop cost of a route, in ms: a seam's loopback latency and framing, so that of two
/// equally fast chains the one with fewer hops wins.
const HOP_MS: f64 = 0.2;
/// How long a driver may take from getting a route to opening its session on a worker.
const OPEN_GRACE: Duration = Duration::from_millis(250);

pub struct LiveWorker {
    pub id: String,
    pub reg: Registration,
    /// Where clients dial it: its address, or the relay's address for it.
    pub addr: String,
    pub relayed: bool,
    /// Which control connection registered it: a late close of an older one must not remove a
    /// worker that has re-joined since.
    pub conn: u64,
    pub last_heartbeat: Instant,
    pub load: Load,
    /// When routes naming it were issued, newest last, kept for `recent_window`.
    pub issued: VecDeque<Instant>,
    pub routes_total: u64,
    /// Frames to its control connection (relay dial requests).
    pub control: mpsc::Sender<TrackerFrame>,
}

pub struct Registry {
    pub workers: HashMap<String, LiveWorker>,
    /// Workers a spot check caught, with the evidence: never routed to.
    pub quarantined: HashMap<String, String>,
    pub heartbeat: Duration,
    /// Jitter state for breaking ties between equal chains.
    rng: u64,
}

/// A planned route: the chain, and the model's shape as the workers registered it.
pub struct Planned {
    pub stages: Vec<RouteStage>,
    pub hidden: u32,
    pub n_layers: u32,
    pub vocab: u32,
}

impl LiveWorker {
    /// Heard from within three heartbeat intervals.
    pub fn alive(&self, heartbeat: Duration, now: Instant) -> bool {
        now.duration_since(self.last_heartbeat) <= 3 * heartbeat
    }

    /// Routes issued to it that its last heartbeat may not show yet: those issued since, and
    /// those issued just before it whose sessions may not have opened in time to be counted.
    pub fn unseen_routes(&self) -> usize {
        let since = self.last_heartbeat.checked_sub(OPEN_GRACE).unwrap_or(self.last_heartbeat);
        self.issued.iter().filter(|t| **t >= since).count()
    }
}

impl Registry {
    pub fn new(heartbeat: Duration) -> Registry {
        let mut seed = [0u8; 8];
        let _ = getrandom::fill(&mut seed);
        Registry { workers: HashMap::new(), quarantined: HashMap::new(), heartbeat, rng: u64::from_le_bytes(seed) | 1 }
    }

    fn jitter(&mut self) -> f64 {
        // xorshift64: only to break exact ties, so equal replicas share arrivals in any order.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Drops issue times older than the window they can matter in.
    fn forget_old(&mut self, now: Instant) {
        let window = 4 * self.heartbeat;
        for w in self.workers.values_mut() {
            while w.issued.front().is_some_and(|t| now.duration_since(*t) > window) {
                w.issued.pop_front();
            }
        }
    }

    /// The cheapest chain of live workers of `model_id` (and `engine`, unless empty) covering
    /// every layer exactly once, avoiding `exclude`. A stage's expected time is its measured time
    /// per layer × layers served × (1 + its load: sessions it reported plus routes issued to it
    /// since), plus a per-hop latency. Records the issue on each chosen worker.
    pub fn plan_route(&mut self, model_id: &str, engine: &str, exclude: &[String]) -> Option<Planned> {
        let now = Instant::now();
        self.forget_old(now);
        let hb = self.heartbeat;
        let mut ids: Vec<&String> = self
            .workers
            .values()
            .filter(|w| {
                w.reg.model_id == model_id
                    && (engine.is_empty() || w.reg.engine == engine)
                    && w.alive(hb, now)
                    && !exclude.contains(&w.id)
                    && !self.quarantined.contains_key(&w.id)
                    && (w.load.sessions as usize + w.unseen_routes()) < w.reg.max_sessions.max(1) as usize
            })
            .map(|w| &w.id)
            .collect();
        ids.sort();
        let ids: Vec<String> = ids.into_iter().cloned().collect();
        let first = self.workers.get(ids.first()?)?;
        let (n_layers, hidden, vocab, engine) = (first.reg.n_layers, first.reg.hidden, first.reg.vocab, first.reg.engine.clone());
        let ids: Vec<String> = ids
            .into_iter()
            .filter(|id| {
                let r = &self.workers[id].reg;
                (r.n_layers, r.hidden, r.engine.as_str()) == (n_layers, hidden, engine.as_str())
            })
            .collect();
        let mut candidates = Vec::with_capacity(ids.len());
        for id in &ids {
            let tie = 1.0 + 1e-9 * self.jitter();
            let w = &self.workers[id];
            let load = w.load.sessions as f64 + w.unseen_routes() as f64;
            let per_layer = w.reg.step_us_per_layer.max(1.0) / 1e3 * (1.0 + load);
            candidates.push(Candidate { start: w.reg.layer_start, end: w.reg.layer_end, per_layer: per_layer * tie, fixed: HOP_MS });
        }
        let hops = plan(n_layers, &candidates)?;
        let mut stages = Vec::with_capacity(hops.len());
        for h in hops {
            let w = self.workers.get_mut(&ids[h.candidate])?;
            w.issued.push_back(now);
            w.routes_total += 1;
            stages.push(RouteStage { worker_id: w.id.clone(), addr: w.addr.clone(), layer_start: h.start, layer_end: h.end });
        }
        Some(Planned { stages, hidden, n_layers, vocab })
    }

    /// A route with exactly the stages `fixed` names: each segment served by its named worker
    /// (which must be live and hold it), or by a live one that holds it and is not excluded: the
    /// one issued the fewest routes, then the cheapest. Spot checks swap stages this way, so they
    /// reach the replicas the planner seldom picks (a slow one still serves under load, and must
    /// have been checked). None when a segment cannot be served or the segments do not cover the
    /// model.
    pub fn plan_fixed(&mut self, model_id: &str, fixed: &[RouteStage], exclude: &[String]) -> Option<Planned> {
        let now = Instant::now();
        let hb = self.heartbeat;
        let usable = |w: &LiveWorker, s: &RouteStage| {
            w.reg.model_id == model_id
                && w.alive(hb, now)
                && !self.quarantined.contains_key(&w.id)
                && w.reg.layer_start <= s.layer_start
                && s.layer_end <= w.reg.layer_end
                && s.layer_start < s.layer_end
        };
        let mut ids = Vec::with_capacity(fixed.len());
        for s in fixed {
            let id = if s.worker_id.is_empty() {
                let cost = |w: &LiveWorker| w.reg.step_us_per_layer * (1.0 + w.load.sessions as f64 + w.unseen_routes() as f64);
                self.workers
                    .values()
                    .filter(|w| usable(w, s) && !exclude.contains(&w.id) && !ids.contains(&w.id))
                    .min_by(|a, b| a.routes_total.cmp(&b.routes_total).then(cost(a).total_cmp(&cost(b))))?
                    .id
                    .clone()
            } else {
                self.workers.get(&s.worker_id).filter(|w| usable(w, s))?.id.clone()
            };
            ids.push(id);
        }
        let first = self.workers.get(ids.first()?)?;
        let (n_layers, hidden, vocab) = (first.reg.n_layers, first.reg.hidden, first.reg.vocab);
        let covers = fixed.first()?.layer_start == 0
            && fixed.last()?.layer_end == n_layers
            && fixed.windows(2).all(|p| p[0].layer_end == p[1].layer_start);
        if !covers {
            return None;
        }
        let mut stages = Vec::with_capacity(fixed.len());
        for (id, s) in ids.iter().zip(fixed) {
            let w = self.workers.get_mut(id)?;
            w.issued.push_back(now);
            w.routes_total += 1;
            stages.push(RouteStage { worker_id: id.clone(), addr: w.addr.clone(), layer_start: s.layer_start, layer_end: s.layer_end });
        }
        Some(Planned { stages, hidden, n_layers, vocab })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(id: &str, range: (u32, u32), step_us: f64) -> LiveWorker {
        let reg = Registration {
            engine: "dgr".into(),
            model_id: "m".into(),
            n_layers: 4,
            layer_start: range.0,
            layer_end: range.1,
            max_sessions: 8,
            step_us_per_layer: step_us,
            ..Default::default()
        };
        let (control, _) = mpsc::channel(1);
        let (issued, last_heartbeat) = (VecDeque::new(), Instant::now());
        LiveWorker {
            id: id.into(),
            reg,
            addr: id.into(),
            relayed: false,
            conn: 0,
            last_heartbeat,
            load: Load::default(),
            issued,
            routes_total: 0,
            control,
        }
    }

    #[test]
    fn swapped_stages_reach_the_replicas_the_planner_passes_over() {
        let mut r = Registry::new(Duration::from_secs(1));
        // "fast" wins every plan; the two slow replicas of [0,2) are only ever reached by swaps.
        for w in [worker("fast", (0, 2), 10.0), worker("slow1", (0, 2), 50.0), worker("slow2", (0, 2), 90.0), worker("tail", (2, 4), 10.0)]
        {
            r.workers.insert(w.id.clone(), w);
        }
        let stage = |id: &str, s: u32, e: u32| RouteStage { worker_id: id.into(), addr: String::new(), layer_start: s, layer_end: e };
        let mut swapped_in = Vec::new();
        for _ in 0..4 {
            assert_eq!(r.plan_route("m", "", &[]).unwrap().stages[0].worker_id, "fast");
            let fixed = [stage("", 0, 2), stage("tail", 2, 4)];
            let p = r.plan_fixed("m", &fixed, &["fast".to_string()]).unwrap();
            assert_eq!(p.stages[1].worker_id, "tail");
            swapped_in.push(p.stages[0].worker_id.clone());
        }
        assert_eq!(swapped_in, ["slow1", "slow2", "slow1", "slow2"]);
        // A named stage must hold the range; an excluded or uncovered segment has no route.
        assert!(r.plan_fixed("m", &[stage("tail", 0, 2), stage("tail", 2, 4)], &[]).is_none());
        assert!(r.plan_fixed("m", &[stage("", 0, 2), stage("tail", 2, 4)], &["fast".into(), "slow1".into(), "slow2".into()]).is_none());
        assert!(r.plan_fixed("m", &[stage("", 0, 2)], &[]).is_none());
    }
}

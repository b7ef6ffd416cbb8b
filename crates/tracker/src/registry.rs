//! Live state, in memory: which workers are connected, their last heartbeat and load, and the
//! routes issued to them in the last moments. Planning a route reads it; nothing here is
//! durable (a restarted tracker learns it again as workers re-join).
//!
//! Planning reads an index kept up to date as workers join, heartbeat, leave and are routed to,
//! not the whole registry: per group (model, engine and shape) and per registered layer range
//! (a *cell*), the cell's workers ordered by their current cost per layer. Every hop costs the
//! same, so of the workers holding one range the cheapest serves any hop at least as cheaply as
//! the others: a plan offers the planner one usable worker per cell, the first in its order,
//! however many replicas registered that range.

use crate::plan::{plan, shortest, Candidate, Hop, Shortest};
use dgr_proto::{Load, Registration, RouteStage, TrackerFrame};
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Per-hop cost of a route, in ms: a seam's loopback latency and framing, so that of two
/// equally fast chains the one with fewer hops wins.
const HOP_MS: f64 = 0.2;
/// How long a driver may take from getting a route to opening its session on a worker.
const OPEN_GRACE: Duration = Duration::from_millis(250);
/// Workers per cell offered when the shortest path over one worker per cell uses one twice,
/// where a second replica of its range would do: a route uses more replicas of one range than
/// this only in contrived layouts.
const REPAIR_DEPTH: usize = 4;

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
    /// When routes naming it were issued, newest last, kept for four heartbeat intervals.
    issued: VecDeque<Instant>,
    /// How many of `issued` its last heartbeat may not show yet.
    unseen: usize,
    pub routes_total: u64,
    /// Frames to its control connection (relay dial requests).
    pub control: mpsc::Sender<TrackerFrame>,
    /// Its place in the index: group, cell, and its key in the cell's order.
    group: usize,
    cell: usize,
    rank: Rank,
}

/// A worker's place in its cell's order: cost per layer (a non-negative finite f64's bits order
/// as the number does), then a random draw renewed on every change, so equal replicas take
/// turns in no fixed order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Rank {
    per_layer: u64,
    tie: u64,
    slot: u32,
}

/// Workers that may share a route: one model, one engine, one shape.
#[derive(Clone, PartialEq, Eq, Hash)]
struct GroupKey {
    model_id: String,
    engine: String,
    n_layers: u32,
    hidden: u32,
    vocab: u32,
}

struct Group {
    key: GroupKey,
    cells: Vec<Cell>,
    cell_of: HashMap<(u32, u32), usize>,
}

/// The workers registered for exactly `[start, end)`, cheapest first.
struct Cell {
    start: u32,
    end: u32,
    order: BTreeSet<Rank>,
    /// The first of `order` as of its last change, so that a plan reads the cells in a row
    /// without visiting their trees and workers unless the first cannot serve.
    head: Option<Head>,
}

/// What a plan needs to know of a cell's first worker: its rank, its last heartbeat, and whether
/// it had room (which changes only with its rank).
#[derive(Clone, Copy)]
struct Head {
    rank: Rank,
    beat: Instant,
    room: bool,
}

pub struct Registry {
    /// Live records by slot; a slot is reused after its worker leaves.
    slots: Vec<Option<LiveWorker>>,
    free: Vec<u32>,
    by_id: HashMap<String, u32>,
    groups: Vec<Group>,
    /// Workers a spot check caught, with the evidence: never routed to.
    pub quarantined: HashMap<String, String>,
    pub heartbeat: Duration,
    /// Jitter state for breaking ties between equal chains.
    rng: u64,
}

/// A planned route: the chain, and the model's shape and engine as the workers registered them.
pub struct Planned {
    pub stages: Vec<RouteStage>,
    pub engine: String,
    pub hidden: u32,
    pub n_layers: u32,
    pub vocab: u32,
}

/// What a worker's control connection brings to its record.
pub struct Joining {
    pub id: String,
    pub reg: Registration,
    pub addr: String,
    pub relayed: bool,
    pub conn: u64,
    pub control: mpsc::Sender<TrackerFrame>,
}

/// A route found in one group: its cost, and each hop as (worker slot, start, end).
struct Chain {
    cost: f64,
    hops: Vec<(u32, u32, u32)>,
}

impl LiveWorker {
    /// Heard from within three heartbeat intervals.
    pub fn alive(&self, heartbeat: Duration, now: Instant) -> bool {
        now.duration_since(self.last_heartbeat) <= 3 * heartbeat
    }

    /// Routes issued to it that its last heartbeat may not show yet: those issued since, and
    /// those issued just before it whose sessions may not have opened in time to be counted.
    pub fn unseen_routes(&self) -> usize {
        self.unseen
    }

    fn load_factor(&self) -> f64 {
        1.0 + self.load.sessions as f64 + self.unseen as f64
    }

    /// Its expected time per layer, in ms, under its current load.
    fn per_layer_ms(&self) -> f64 {
        self.reg.step_us_per_layer.max(1.0) / 1e3 * self.load_factor()
    }

    fn has_room(&self) -> bool {
        (self.load.sessions as usize + self.unseen) < self.reg.max_sessions.max(1) as usize
    }

    /// Drops issue times older than the window they can matter in.
    fn forget_old(&mut self, heartbeat: Duration, now: Instant) {
        while self.issued.front().is_some_and(|t| now.duration_since(*t) > 4 * heartbeat) {
            self.issued.pop_front();
        }
        let since = self.last_heartbeat.checked_sub(OPEN_GRACE).unwrap_or(self.last_heartbeat);
        self.unseen = self.issued.len() - self.issued.partition_point(|t| *t < since);
    }
}

/// xorshift64: only to break exact ties, so equal replicas share arrivals in any order.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

impl Registry {
    pub fn new(heartbeat: Duration) -> Registry {
        let mut seed = [0u8; 8];
        let _ = getrandom::fill(&mut seed);
        Registry {
            slots: Vec::new(),
            free: Vec::new(),
            by_id: HashMap::new(),
            groups: Vec::new(),
            quarantined: HashMap::new(),
            heartbeat,
            rng: u64::from_le_bytes(seed) | 1,
        }
    }

    pub fn workers(&self) -> impl Iterator<Item = &LiveWorker> {
        self.slots.iter().flatten()
    }

    pub fn worker(&self, id: &str) -> Option<&LiveWorker> {
        self.by_id.get(id).and_then(|&slot| self.slots[slot as usize].as_ref())
    }

    /// Records a worker that joined, replacing its older record under the same identity (never
    /// listed twice). A quarantined worker is listed but never indexed for planning.
    pub fn join(&mut self, j: Joining) {
        self.remove(&j.id);
        let key = GroupKey {
            model_id: j.reg.model_id.clone(),
            engine: j.reg.engine.clone(),
            n_layers: j.reg.n_layers,
            hidden: j.reg.hidden,
            vocab: j.reg.vocab,
        };
        let group = match self.groups.iter().position(|g| g.key == key) {
            Some(g) => g,
            None => {
                self.groups.push(Group { key, cells: Vec::new(), cell_of: HashMap::new() });
                self.groups.len() - 1
            }
        };
        let g = &mut self.groups[group];
        let range = (j.reg.layer_start, j.reg.layer_end);
        let cell = *g.cell_of.entry(range).or_insert_with(|| {
            g.cells.push(Cell { start: range.0, end: range.1, order: BTreeSet::new(), head: None });
            g.cells.len() - 1
        });
        let slot = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            (self.slots.len() - 1) as u32
        });
        let rank = Rank { per_layer: 0, tie: 0, slot };
        let quarantined = self.quarantined.contains_key(&j.id);
        self.by_id.insert(j.id.clone(), slot);
        self.slots[slot as usize] = Some(LiveWorker {
            id: j.id,
            reg: j.reg,
            addr: j.addr,
            relayed: j.relayed,
            conn: j.conn,
            last_heartbeat: Instant::now(),
            load: Load::default(),
            issued: VecDeque::new(),
            unseen: 0,
            routes_total: 0,
            control: j.control,
            group,
            cell,
            rank,
        });
        if !quarantined {
            self.groups[group].cells[cell].order.insert(rank);
            self.rerank(slot);
        }
    }

    /// Removes the worker if `conn` is still the connection that registered it.
    pub fn leave(&mut self, id: &str, conn: u64) {
        if self.worker(id).is_some_and(|w| w.conn == conn) {
            self.remove(id);
        }
    }

    /// A heartbeat: the worker is live, with this load, and the routes issued before it (less
    /// those that may not have opened yet) are counted in it.
    pub fn heartbeat(&mut self, id: &str, load: Load) {
        let Some(&slot) = self.by_id.get(id) else { return };
        let (hb, now) = (self.heartbeat, Instant::now());
        if let Some(w) = self.slots[slot as usize].as_mut() {
            w.last_heartbeat = now;
            w.load = load;
            w.forget_old(hb, now);
        }
        self.rerank(slot);
    }

    /// Takes a worker out of every route from now on.
    pub fn quarantine(&mut self, id: String, evidence: String) {
        if let Some(&slot) = self.by_id.get(&id) {
            if let Some(w) = &self.slots[slot as usize] {
                let (group, cell) = (w.group, w.cell);
                self.groups[group].cells[cell].order.remove(&w.rank);
                self.refresh_head(group, cell);
            }
        }
        self.quarantined.insert(id, evidence);
    }

    fn remove(&mut self, id: &str) {
        let Some(slot) = self.by_id.remove(id) else { return };
        let Some(w) = self.slots[slot as usize].take() else { return };
        self.free.push(slot);
        let g = &mut self.groups[w.group];
        g.cells[w.cell].order.remove(&w.rank);
        self.refresh_head(w.group, w.cell);
        if self.groups[w.group].cells[w.cell].order.is_empty() {
            self.drop_cell(w.group, w.cell);
        }
    }

    /// Removes an empty cell (and its group, once empty), keeping every worker's place right.
    /// A cell whose only workers are quarantined is empty too, and is kept until they leave.
    fn drop_cell(&mut self, group: usize, cell: usize) {
        let g = &mut self.groups[group];
        if self.slots.iter().flatten().any(|w| w.group == group && w.cell == cell) {
            return;
        }
        let c = g.cells.swap_remove(cell);
        g.cell_of.remove(&(c.start, c.end));
        if let Some(moved) = g.cells.get(cell) {
            g.cell_of.insert((moved.start, moved.end), cell);
            let old = g.cells.len();
            for w in self.slots.iter_mut().flatten().filter(|w| w.group == group && w.cell == old) {
                w.cell = cell;
            }
        }
        if !self.groups[group].cells.is_empty() {
            return;
        }
        self.groups.swap_remove(group);
        let old = self.groups.len();
        for w in self.slots.iter_mut().flatten().filter(|w| w.group == old) {
            w.group = group;
        }
    }

    /// Puts the worker in its place in its cell's order after its cost changed.
    fn rerank(&mut self, slot: u32) {
        let Some(w) = self.slots[slot as usize].as_mut() else { return };
        let order = &mut self.groups[w.group].cells[w.cell].order;
        if !order.remove(&w.rank) {
            // Quarantined: out of the index.
            return;
        }
        w.rank = Rank { per_layer: w.per_layer_ms().to_bits(), tie: next_random(&mut self.rng), slot };
        order.insert(w.rank);
        let (group, cell) = (w.group, w.cell);
        self.refresh_head(group, cell);
    }

    fn refresh_head(&mut self, group: usize, cell: usize) {
        let c = &mut self.groups[group].cells[cell];
        c.head = c.order.first().and_then(|&rank| {
            let w = self.slots[rank.slot as usize].as_ref()?;
            Some(Head { rank, beat: w.last_heartbeat, room: w.has_room() })
        });
    }

    fn usable(&self, slot: u32, excluded: &HashSet<u32>, now: Instant) -> bool {
        let w = self.slots[slot as usize].as_ref().expect("indexed workers are live");
        w.alive(self.heartbeat, now) && w.has_room() && !excluded.contains(&slot)
    }

    /// The cheapest chain of live workers of `model_id` (and `engine`, unless empty) covering
    /// every layer exactly once, avoiding `exclude`. A stage's expected time is its measured time
    /// per layer × layers served × (1 + its load: sessions it reported plus routes issued to it
    /// since), plus a per-hop latency. Records the issue on each chosen worker.
    pub fn plan_route(&mut self, model_id: &str, engine: &str, exclude: &[String]) -> Option<Planned> {
        let now = Instant::now();
        let excluded: HashSet<u32> = exclude.iter().filter_map(|id| self.by_id.get(id).copied()).collect();
        let mut best: Option<(usize, Chain)> = None;
        for group in 0..self.groups.len() {
            let key = &self.groups[group].key;
            if key.model_id != model_id || !(engine.is_empty() || key.engine == engine) {
                continue;
            }
            let Some(found) = self.plan_in(group, &excluded, now) else { continue };
            if best.as_ref().is_none_or(|(_, b)| found.cost < b.cost) {
                best = Some((group, found));
            }
        }
        let (group, Chain { hops, .. }) = best?;
        let mut stages = Vec::with_capacity(hops.len());
        for (slot, layer_start, layer_end) in hops {
            let w = self.issue(slot, now);
            stages.push(RouteStage { worker_id: w.id.clone(), addr: w.addr.clone(), layer_start, layer_end });
        }
        let key = &self.groups[group].key;
        Some(Planned { stages, engine: key.engine.clone(), hidden: key.hidden, n_layers: key.n_layers, vocab: key.vocab })
    }

    /// The cheapest route in one group. One usable worker per cell first; if the shortest path
    /// over those uses one twice, the first `REPAIR_DEPTH` of each cell and the planner's search
    /// (a second replica of that range usually serves). Those are a superset of the first, so
    /// the search's route is no dearer than a repair of the first would be.
    fn plan_in(&mut self, group: usize, excluded: &HashSet<u32>, now: Instant) -> Option<Chain> {
        let (candidates, slots) = self.offer(group, 1, excluded, now);
        let n_layers = self.groups[group].key.n_layers;
        let (candidates, slots, hops) = match shortest(n_layers, &candidates) {
            Shortest::Route(hops) => (candidates, slots, hops),
            Shortest::Uncovered => return None,
            Shortest::Repeats => {
                let (candidates, slots) = self.offer(group, REPAIR_DEPTH, excluded, now);
                let hops = plan(n_layers, &candidates)?;
                (candidates, slots, hops)
            }
        };
        let cost = hops.iter().map(|h: &Hop| candidates[h.candidate].cost(h.start, h.end)).sum();
        Some(Chain { cost, hops: hops.iter().map(|h| (slots[h.candidate], h.start, h.end)).collect() })
    }

    /// The first `depth` usable workers of each cell of the group as candidates, and their slots.
    fn offer(&mut self, group: usize, depth: usize, excluded: &HashSet<u32>, now: Instant) -> (Vec<Candidate>, Vec<u32>) {
        let g = &self.groups[group];
        let (mut candidates, mut slots) = (Vec::new(), Vec::new());
        let mut rng = self.rng;
        let hb = self.heartbeat;
        let mut offer = |cell: &Cell, rank: &Rank| {
            // Jitter below any real difference breaks ties between equal chains at random.
            let tie = 1.0 + 1e-9 * (next_random(&mut rng) >> 11) as f64 / (1u64 << 53) as f64;
            let per_layer = f64::from_bits(rank.per_layer) * tie;
            candidates.push(Candidate { start: cell.start, end: cell.end, per_layer, fixed: HOP_MS });
            slots.push(rank.slot);
        };
        for cell in &g.cells {
            match cell.head {
                Some(h) if depth == 1 && h.room && now.duration_since(h.beat) <= 3 * hb && !excluded.contains(&h.rank.slot) => {
                    offer(cell, &h.rank)
                }
                _ => cell.order.iter().filter(|r| self.usable(r.slot, excluded, now)).take(depth).for_each(|r| offer(cell, r)),
            }
        }
        self.rng = rng;
        (candidates, slots)
    }

    /// Counts a route issued to the worker in `slot` in its load.
    fn issue(&mut self, slot: u32, now: Instant) -> &LiveWorker {
        let hb = self.heartbeat;
        if let Some(w) = self.slots[slot as usize].as_mut() {
            w.issued.push_back(now);
            w.routes_total += 1;
            w.forget_old(hb, now);
        }
        self.rerank(slot);
        self.slots[slot as usize].as_ref().expect("issued to a live worker")
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
        let exclude: HashSet<&str> = exclude.iter().map(String::as_str).collect();
        let usable = |w: &LiveWorker, s: &RouteStage| {
            w.reg.model_id == model_id
                && w.alive(hb, now)
                && !self.quarantined.contains_key(&w.id)
                && w.reg.layer_start <= s.layer_start
                && s.layer_end <= w.reg.layer_end
                && s.layer_start < s.layer_end
        };
        let mut ids: Vec<&str> = Vec::with_capacity(fixed.len());
        for s in fixed {
            let w = if s.worker_id.is_empty() {
                // Rare (spot checks): a scan over the registry is fine here.
                self.workers()
                    .filter(|w| usable(w, s) && !exclude.contains(w.id.as_str()) && !ids.contains(&w.id.as_str()))
                    .min_by(|a, b| a.routes_total.cmp(&b.routes_total).then(a.per_layer_ms().total_cmp(&b.per_layer_ms())))?
            } else {
                self.worker(&s.worker_id).filter(|w| usable(w, s))?
            };
            ids.push(&w.id);
        }
        let slots: Vec<u32> = ids.iter().map(|id| self.by_id[*id]).collect();
        let first = self.slots[*slots.first()? as usize].as_ref()?;
        let (n_layers, hidden, vocab, engine) = (first.reg.n_layers, first.reg.hidden, first.reg.vocab, first.reg.engine.clone());
        let covers = fixed.first()?.layer_start == 0
            && fixed.last()?.layer_end == n_layers
            && fixed.windows(2).all(|p| p[0].layer_end == p[1].layer_start);
        if !covers {
            return None;
        }
        let mut stages = Vec::with_capacity(fixed.len());
        for (&slot, s) in slots.iter().zip(fixed) {
            let w = self.issue(slot, now);
            stages.push(RouteStage { worker_id: w.id.clone(), addr: w.addr.clone(), layer_start: s.layer_start, layer_end: s.layer_end });
        }
        Some(Planned { stages, engine, hidden, n_layers, vocab })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(range: (u32, u32), step_us: f64) -> Registration {
        Registration {
            engine: "dgr".into(),
            model_id: "m".into(),
            n_layers: 4,
            layer_start: range.0,
            layer_end: range.1,
            max_sessions: 8,
            step_us_per_layer: step_us,
            ..Default::default()
        }
    }

    fn join(r: &mut Registry, id: &str, reg: Registration) {
        let (control, _) = mpsc::channel(1);
        r.join(Joining { id: id.into(), reg, addr: id.into(), relayed: false, conn: 0, control });
    }

    fn route(r: &mut Registry) -> Vec<(String, u32, u32)> {
        let p = r.plan_route("m", "", &[]).expect("a route");
        p.stages.into_iter().map(|s| (s.worker_id, s.layer_start, s.layer_end)).collect()
    }

    fn stage(id: &str, s: u32, e: u32) -> RouteStage {
        RouteStage { worker_id: id.into(), addr: String::new(), layer_start: s, layer_end: e }
    }

    #[test]
    fn swapped_stages_reach_the_replicas_the_planner_passes_over() {
        let mut r = Registry::new(Duration::from_secs(1));
        // "fast" wins every plan; the two slow replicas of [0,2) are only ever reached by swaps.
        for (id, range, us) in [("fast", (0, 2), 10.0), ("slow1", (0, 2), 50.0), ("slow2", (0, 2), 90.0), ("tail", (2, 4), 10.0)] {
            join(&mut r, id, reg(range, us));
        }
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

    #[test]
    fn replicas_of_one_range_take_turns_as_their_load_grows() {
        let mut r = Registry::new(Duration::from_secs(60));
        for id in ["a", "b", "c"] {
            join(&mut r, id, reg((0, 4), 100.0));
        }
        // Each route counts in its worker's load until a heartbeat shows it: the least loaded
        // serves next, until all three are at capacity (8 sessions).
        let mut n: HashMap<String, usize> = HashMap::new();
        for i in 0..24 {
            *n.entry(route(&mut r)[0].0.clone()).or_default() += 1;
            assert!(n.values().max().unwrap() - n.values().min().unwrap() <= 1 || i < 2, "{n:?}");
        }
        assert_eq!(n.values().copied().collect::<Vec<_>>(), [8, 8, 8]);
        assert!(r.plan_route("m", "", &[]).is_none());
        // Equal replicas are chosen in no fixed order.
        let mut seen = std::collections::HashSet::new();
        for _ in 0..64 {
            join(&mut r, "x", reg((0, 4), 100.0));
            join(&mut r, "y", reg((0, 4), 100.0));
            seen.insert(route(&mut r)[0].0.clone());
        }
        assert_eq!(seen.len(), 2, "always {seen:?}");
    }

    #[test]
    fn a_second_replica_of_a_range_serves_when_one_worker_would_repeat() {
        let mut r = Registry::new(Duration::from_secs(60));
        // x and y hold all four layers, z is very cheap in the middle: x, z, y beats x alone.
        join(&mut r, "x", reg((0, 4), 1000.0));
        join(&mut r, "y", reg((0, 4), 1000.0));
        join(&mut r, "z", reg((1, 3), 10.0));
        let got = route(&mut r);
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!((got[1].0.as_str(), got[1].1, got[1].2), ("z", 1, 3), "{got:?}");
        assert!(got[0].0 != got[2].0 && (got[0].1, got[0].2, got[2].1, got[2].2) == (0, 1, 3, 4), "{got:?}");
    }

    #[test]
    fn leaving_quarantined_and_excluded_workers_are_not_routed() {
        let mut r = Registry::new(Duration::from_secs(60));
        join(&mut r, "head", reg((0, 2), 10.0));
        join(&mut r, "tail", reg((2, 4), 10.0));
        join(&mut r, "whole", reg((0, 4), 1000.0));
        assert_eq!(route(&mut r).len(), 2);
        let without_tail = r.plan_route("m", "", &["tail".into()]).unwrap().stages;
        assert_eq!((without_tail[1].worker_id.as_str(), without_tail[1].layer_start), ("whole", 2));
        r.quarantine("whole".into(), "caught".into());
        assert!(r.plan_route("m", "", &["tail".into()]).is_none());
        // A re-join under a quarantined identity is listed, never routed.
        join(&mut r, "whole", reg((0, 4), 1000.0));
        assert_eq!(r.workers().count(), 3);
        assert!(r.plan_route("m", "", &["tail".into()]).is_none());
        // A late close of an older connection leaves the record; the current one removes it.
        r.leave("tail", 7);
        assert!(r.worker("tail").is_some());
        r.leave("tail", 0);
        assert!(r.worker("tail").is_none() && r.plan_route("m", "", &[]).is_none());
        join(&mut r, "tail2", reg((2, 4), 10.0));
        assert_eq!(route(&mut r), [("head".to_string(), 0, 2), ("tail2".to_string(), 2, 4)]);
        // Another model, or another engine asked for, has no route.
        assert!(r.plan_route("other", "", &[]).is_none() && r.plan_route("m", "gguf", &[]).is_none());
        for id in ["head", "tail2", "whole"] {
            r.leave(id, 0);
        }
        assert!(r.groups.is_empty() && r.workers().count() == 0);
    }
}

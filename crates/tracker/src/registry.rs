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
//!
//! A route may chain groups of one model and shape that run different engines (CPU layers, then
//! GPU layers): asked for any engine, the plan runs over all of the model's groups at once, so a
//! mixed route serves where it is the cheapest or the only cover. A recovery asks for the mixed
//! route's engines by layer (`Want::Spans`), and each worker is offered only the layers its
//! engine computed before.
//!
//! Cache-aware routing: workers report the route digests of the prefix blocks they hold, and the
//! registry indexes them (digest → a few holders), so a plan looks up the holders of a request's
//! prompt blocks (at most `MAX_PREFIX_PROBES` lookups) instead of scanning workers. A holder is
//! offered besides its cell's head, its expected time divided by up to `PREFIX_FAVOUR`: the
//! holder of the deepest match gets all of it, a shallower one a share in proportion to its
//! depth. So, of two replicas, the holder serves unless its load is at least `PREFIX_FAVOUR`
//! times the other's, and a hot prefix spreads once its holders are that loaded.
//!
//! A worker is offered only with room for the request's session: a session slot, and KV room
//! for its budget of positions (what its heartbeat says its sessions reserved, plus the budgets
//! of routes issued since whose sessions it has not named as opened, off its registered KV
//! budget). A worker started without a layer range is given one (`placement`, then `hold`),
//! counted as held until it joins with it.

use crate::place::{rate, Held, Placement};
use crate::plan::{plan, shortest, Candidate, Hop, Shortest};
use dgr_proto::{EngineSpan, Load, Registration, RouteStage, TrackerFrame, MAX_PLACE_LAYERS};
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
/// How much cheaper a stage holding the request's (deepest matched) prefix counts: its expected
/// time is divided by this, so it loses only at this many times another's load.
const PREFIX_FAVOUR: f64 = 2.0;
/// Workers listed per digest: enough replicas of a hot prefix to spread over; a worker that
/// reports it past that replaces the one listed longest.
const HOLDERS_PER_DIGEST: usize = 32;
/// (holder, depth) pairs a plan reads from the index at most, deepest probes first.
const MAX_HOLDER_READS: usize = 256;
/// How long a range handed to a starting worker counts as held without the worker joining with
/// it: loading a large model from disk takes a while, and a worker that never comes must not
/// keep others off those layers for long.
const PLACING_TTL: Duration = Duration::from_secs(120);
/// Ranges handed out and not yet joined with, at most (the oldest is forgotten first).
const MAX_PLACINGS: usize = 1024;

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
    /// Routes naming it, newest last, kept for four heartbeat intervals.
    issued: VecDeque<Issued>,
    /// How many of `issued` its last heartbeat may not show yet, and their KV budgets summed.
    unseen: usize,
    unseen_kv: u64,
    pub routes_total: u64,
    /// The route digests of the prefix blocks it last said it holds, sorted.
    held: Vec<u64>,
    /// Frames to its control connection (relay dial requests).
    pub control: mpsc::Sender<TrackerFrame>,
    /// Its place in the index: group, cell, and its key in the cell's order.
    group: usize,
    cell: usize,
    rank: Rank,
}

/// A route issued to a worker: when, its session's KV budget, and the session's tag
/// (`dgr_proto::session_tag`), which the worker's heartbeat names once the session is open there
/// (so counted in its reservations).
struct Issued {
    at: Instant,
    kv: u64,
    tag: u64,
    opened: bool,
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

/// What a plan needs to know of a cell's first worker: its rank, its last heartbeat, whether it
/// had room for another session and the KV positions it had free (which change only with its
/// rank).
#[derive(Clone, Copy)]
struct Head {
    rank: Rank,
    beat: Instant,
    room: bool,
    kv_room: u64,
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
    /// Route digest → slots of workers holding that prefix block, longest listed first.
    holders: HashMap<u64, Vec<u32>>,
    /// Ranges handed to starting workers that have not joined with them yet, oldest first.
    placing: Vec<Placing>,
}

/// A range handed to a starting worker, counted as held until it joins or `until`.
struct Placing {
    model_id: String,
    held: Held,
    until: Instant,
}

/// Whom a plan may offer: live workers not `excluded`, with room for another session and for
/// its `kv` positions of KV cache.
struct Ask<'a> {
    excluded: &'a HashSet<u32>,
    now: Instant,
    kv: u64,
}

/// The engines a route may run: any (mixed along the route where that is cheapest), one, or the
/// engines of a route engine's spans, each at its layers (a recovery's).
pub enum Want {
    Any,
    One(String),
    Spans(Vec<EngineSpan>),
}

impl Want {
    /// What a route request's `engine` asks for; a malformed route engine is an error.
    pub fn parse(engine: &str) -> Result<Want, dgr_proto::ProtoError> {
        Ok(match dgr_proto::parse_route_engine(engine)? {
            Some(spans) => Want::Spans(spans),
            None if engine.is_empty() => Want::Any,
            None => Want::One(engine.into()),
        })
    }

    fn admits(&self, engine: &str) -> bool {
        match self {
            Want::Any => true,
            Want::One(e) => e == engine,
            Want::Spans(spans) => spans.iter().any(|s| s.engine == engine),
        }
    }

    /// The part of `[start, end)` a worker of `engine` may compute: all of it, or, for spans,
    /// its overlap with the first span of its engine (a worker serves one hop of a route).
    fn clip(&self, engine: &str, start: u32, end: u32) -> Option<(u32, u32)> {
        let Want::Spans(spans) = self else { return self.admits(engine).then_some((start, end)) };
        spans.iter().filter(|s| s.engine == engine).map(|s| (start.max(s.start), end.min(s.end))).find(|(a, b)| a < b)
    }
}

/// A planned route: the chain, and the model's shape as the workers registered it.
pub struct Planned {
    pub stages: Vec<RouteStage>,
    /// The route engine (`dgr_proto::route_engine`): one engine id, or a mixed route's spans.
    pub engine: String,
    pub hidden: u32,
    pub n_layers: u32,
    pub vocab: u32,
    /// Stages served by a worker holding (part of) the request's prefix.
    pub prefix_stages: usize,
}

/// A request's prompt blocks as the index names them: (blocks up to it, route digest), blocks
/// ascending.
pub type Probe = (u32, u64);

/// What a worker's control connection brings to its record.
pub struct Joining {
    pub id: String,
    pub reg: Registration,
    pub addr: String,
    pub relayed: bool,
    pub conn: u64,
    pub control: mpsc::Sender<TrackerFrame>,
}

/// A route found: its cost, and each hop as (worker slot, start, end).
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
    /// those issued just before it whose sessions it did not name as opened.
    pub fn unseen_routes(&self) -> usize {
        self.unseen
    }

    /// How many prefix blocks it said it holds.
    pub fn prefix_blocks(&self) -> usize {
        self.held.len()
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

    /// KV positions a new session may still reserve here: its budget less what its sessions
    /// reserved and what routes issued since its heartbeat will.
    fn kv_room(&self) -> u64 {
        self.reg.kv_tokens.saturating_sub(self.load.kv_reserved_tokens.saturating_add(self.unseen_kv))
    }

    /// Where in `issued` the routes its last heartbeat may not show begin: those issued less
    /// than `OPEN_GRACE` before it, or since.
    fn unseen_from(&self) -> usize {
        let since = self.last_heartbeat.checked_sub(OPEN_GRACE).unwrap_or(self.last_heartbeat);
        self.issued.partition_point(|i| i.at < since)
    }

    /// Marks the routes that may be unseen whose sessions are among `opened` (tags).
    fn mark_opened(&mut self, opened: &[u64]) {
        let first = self.unseen_from();
        if opened.is_empty() || self.issued.range(first..).all(|i| i.opened) {
            return;
        }
        let mut tags = opened.to_vec();
        tags.sort_unstable();
        for i in self.issued.range_mut(first..) {
            i.opened |= tags.binary_search(&i.tag).is_ok();
        }
    }

    /// Drops issue times older than the window they can matter in.
    fn forget_old(&mut self, heartbeat: Duration, now: Instant) {
        while self.issued.front().is_some_and(|i| now.duration_since(i.at) > 4 * heartbeat) {
            self.issued.pop_front();
        }
        let first = self.unseen_from();
        let unseen = self.issued.range(first..).filter(|i| !i.opened);
        (self.unseen, self.unseen_kv) = unseen.fold((0, 0u64), |(n, kv), i| (n + 1, kv.saturating_add(i.kv)));
    }
}

/// Takes `slot` off the holders of `digest`.
fn unlist(holders: &mut HashMap<u64, Vec<u32>>, digest: u64, slot: u32) {
    if let Some(list) = holders.get_mut(&digest) {
        list.retain(|&s| s != slot);
        if list.is_empty() {
            holders.remove(&digest);
        }
    }
}

/// The divisors of the holders `held` (slot, blocks) that `ours` accepts, by slot: the deepest
/// gets `PREFIX_FAVOUR`, a shallower one in proportion to its depth. Set just past it, so that
/// exactly `PREFIX_FAVOUR` times another's load loses (the tie jitter is far smaller).
fn favour(held: &[(u32, u32)], ours: impl Fn(u32) -> bool) -> Vec<(u32, f64)> {
    let mine: Vec<(u32, u32)> = held.iter().copied().filter(|&(slot, _)| ours(slot)).collect();
    let Some(deepest) = mine.iter().map(|h| h.1).max() else { return Vec::new() };
    let most = PREFIX_FAVOUR * (1.0 - 1e-6);
    mine.into_iter().map(|(slot, blocks)| (slot, 1.0 + (most - 1.0) * f64::from(blocks) / f64::from(deepest))).collect()
}

/// The route engine of planned stages (`dgr_proto::route_engine`).
fn route_engine(stages: &[RouteStage]) -> String {
    dgr_proto::route_engine(stages.iter().map(|s| (s.engine.as_str(), s.layer_start, s.layer_end)))
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
            holders: HashMap::new(),
            placing: Vec::new(),
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
        let placed = self
            .placing
            .iter()
            .position(|p| p.model_id == j.reg.model_id && (p.held.start, p.held.end) == (j.reg.layer_start, j.reg.layer_end));
        if let Some(i) = placed {
            self.placing.remove(i);
        }
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
            unseen_kv: 0,
            routes_total: 0,
            held: Vec::new(),
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

    /// What placing a starting worker of `model_id` (`n` layers) that holds at most
    /// `max_layers` weighs (`place::Placement`): the live workers of the model and the ranges
    /// handed out before whose workers have not joined yet. The window itself is worked out
    /// without the registry (`Placement::best`), then `hold` counts it.
    pub fn placement(&mut self, model_id: &str, n: u32, max_layers: u32, now: Instant) -> Result<Placement, String> {
        if n == 0 || n > MAX_PLACE_LAYERS || max_layers == 0 {
            return Err(format!("placing {max_layers} of {n} layers: a model of 1 to {MAX_PLACE_LAYERS} layers, at least one held"));
        }
        self.placing.retain(|p| p.until > now);
        let live: Vec<&LiveWorker> = self
            .workers()
            .filter(|w| w.reg.model_id == model_id && w.alive(self.heartbeat, now) && !self.quarantined.contains_key(&w.id))
            .collect();
        if let Some(w) = live.iter().find(|w| w.reg.n_layers != n) {
            return Err(format!("model {model_id} has {} layers in this swarm, not {n}", w.reg.n_layers));
        }
        let mut held: Vec<Held> = live
            .iter()
            .map(|w| Held {
                start: w.reg.layer_start,
                end: w.reg.layer_end,
                rate: rate(w.reg.step_us_per_layer, w.reg.layer_end - w.reg.layer_start),
            })
            .collect();
        held.extend(self.placing.iter().filter(|p| p.model_id == model_id).map(|p| p.held));
        // Its own time per layer is measured only once it has loaded: the swarm's median stands in.
        let mut steps: Vec<f64> = live.iter().map(|w| w.reg.step_us_per_layer).filter(|s| s.is_finite()).collect();
        steps.sort_by(f64::total_cmp);
        let k = max_layers.min(n);
        Ok(Placement { n, k, held, rate: rate(steps.get(steps.len() / 2).copied().unwrap_or(1000.0), k) })
    }

    /// Counts `held`, a range handed to a starting worker of `model_id`, as held until that
    /// worker joins with it or `PLACING_TTL` passes.
    pub fn hold(&mut self, model_id: &str, held: Held, now: Instant) {
        if self.placing.len() >= MAX_PLACINGS {
            self.placing.remove(0);
        }
        self.placing.push(Placing { model_id: model_id.to_string(), held, until: now + PLACING_TTL });
    }

    /// Removes the worker if `conn` is still the connection that registered it.
    pub fn leave(&mut self, id: &str, conn: u64) {
        if self.worker(id).is_some_and(|w| w.conn == conn) {
            self.remove(id);
        }
    }

    /// A heartbeat: the worker is live, with this load, and the routes issued before it are
    /// counted in it, less those issued just before it (`OPEN_GRACE`) whose sessions are not
    /// among the tags of sessions it has `opened` lately. `held`, when given, replaces the prefix
    /// blocks it holds (the caller bounds both lists' lengths).
    pub fn heartbeat(&mut self, id: &str, load: Load, opened: &[u64], held: Option<Vec<u64>>) {
        let Some(&slot) = self.by_id.get(id) else { return };
        let (hb, now) = (self.heartbeat, Instant::now());
        if let Some(w) = self.slots[slot as usize].as_mut() {
            w.last_heartbeat = now;
            w.load = load;
            w.mark_opened(opened);
            w.forget_old(hb, now);
        }
        if let Some(mut held) = held {
            held.sort_unstable();
            held.dedup();
            self.reindex(slot, held);
        }
        self.rerank(slot);
    }

    /// Replaces the worker's held digests, indexing only the difference.
    fn reindex(&mut self, slot: u32, held: Vec<u64>) {
        let Some(w) = self.slots[slot as usize].as_mut() else { return };
        let old = std::mem::replace(&mut w.held, held);
        let new = &w.held;
        // Both sorted: one merge walk.
        let (mut i, mut j) = (0, 0);
        loop {
            match (old.get(i).copied(), new.get(j).copied()) {
                (Some(a), Some(b)) if a == b => (i, j) = (i + 1, j + 1),
                (Some(a), b) if b.is_none_or(|b| a < b) => {
                    unlist(&mut self.holders, a, slot);
                    i += 1;
                }
                (_, Some(b)) => {
                    let list = self.holders.entry(b).or_default();
                    if list.len() >= HOLDERS_PER_DIGEST {
                        list.remove(0);
                    }
                    list.push(slot);
                    j += 1;
                }
                _ => break,
            }
        }
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
        for &d in &w.held {
            unlist(&mut self.holders, d, slot);
        }
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
            Some(Head { rank, beat: w.last_heartbeat, room: w.has_room(), kv_room: w.kv_room() })
        });
    }

    /// Whether the worker in `slot` may take the session `ask` describes.
    fn usable(&self, slot: u32, ask: &Ask) -> bool {
        let w = self.slots[slot as usize].as_ref().expect("indexed workers are live");
        w.alive(self.heartbeat, ask.now) && w.has_room() && ask.kv <= w.kv_room() && !ask.excluded.contains(&slot)
    }

    /// The cheapest chain of live workers of `model_id` that `want` admits, covering every layer
    /// exactly once, avoiding `exclude`. A stage's expected time is its measured time per layer ×
    /// layers served × (1 + its load: sessions it reported plus routes issued to it since), plus
    /// a per-hop latency; a stage holding the prompt's `prefix` counts cheaper (see
    /// `PREFIX_FAVOUR`). Records the issue of a session of `kv` positions tagged `session`
    /// (`dgr_proto::session_tag`) on each chosen worker.
    pub fn plan_route(
        &mut self,
        model_id: &str,
        want: &Want,
        exclude: &[String],
        prefix: &[Probe],
        kv: u64,
        session: u64,
    ) -> Option<Planned> {
        let now = Instant::now();
        let excluded: HashSet<u32> = exclude.iter().filter_map(|id| self.by_id.get(id).copied()).collect();
        let ask = Ask { excluded: &excluded, now, kv };
        let held = self.holders_of(prefix, &ask);
        let mut best: Option<(usize, Chain)> = None;
        for groups in self.shapes(model_id, want) {
            let favoured = favour(&held, |slot| self.slots[slot as usize].as_ref().is_some_and(|w| groups.contains(&w.group)));
            let Some(found) = self.plan_over(&groups, want, &ask, &favoured) else { continue };
            if best.as_ref().is_none_or(|(_, b)| found.cost < b.cost) {
                best = Some((groups[0], found));
            }
        }
        let (group, Chain { hops, .. }) = best?;
        let mut stages = Vec::with_capacity(hops.len());
        let mut prefix_stages = 0;
        for (slot, layer_start, layer_end) in hops {
            prefix_stages += usize::from(held.binary_search_by_key(&slot, |h| h.0).is_ok());
            let w = self.issue(slot, now, kv, session);
            stages.push(RouteStage { worker_id: w.id.clone(), addr: w.addr.clone(), layer_start, layer_end, engine: w.reg.engine.clone() });
        }
        let key = &self.groups[group].key;
        Some(Planned { engine: route_engine(&stages), stages, hidden: key.hidden, n_layers: key.n_layers, vocab: key.vocab, prefix_stages })
    }

    /// The groups of `model_id` whose engine `want` admits, by shape: the workers one route may
    /// chain (a model's groups normally share its one shape).
    fn shapes(&self, model_id: &str, want: &Want) -> Vec<Vec<usize>> {
        let mut shapes: Vec<Vec<usize>> = Vec::new();
        for (i, g) in self.groups.iter().enumerate() {
            if g.key.model_id != model_id || !want.admits(&g.key.engine) {
                continue;
            }
            let shape = |k: &GroupKey| (k.n_layers, k.hidden, k.vocab);
            match shapes.iter_mut().find(|s| shape(&self.groups[s[0]].key) == shape(&g.key)) {
                Some(s) => s.push(i),
                None => shapes.push(vec![i]),
            }
        }
        shapes
    }

    /// Whether live workers of `model_id` that `want` admits, not excluded, cover every layer,
    /// with room or not: when `plan_route` found nothing, whether it was for want of room (which
    /// frees as sessions end) rather than of workers.
    pub fn covered_but_full(&self, model_id: &str, want: &Want, exclude: &[String], kv: u64) -> bool {
        let now = Instant::now();
        let excluded: HashSet<u32> = exclude.iter().filter_map(|id| self.by_id.get(id).copied()).collect();
        // A worker whose whole KV budget is smaller than the session never makes room for it.
        let live = |r: &Rank| {
            !excluded.contains(&r.slot)
                && self.slots[r.slot as usize].as_ref().is_some_and(|w| w.alive(self.heartbeat, now) && kv <= w.reg.kv_tokens)
        };
        self.shapes(model_id, want).iter().any(|groups| {
            let mut ranges: Vec<(u32, u32)> = groups
                .iter()
                .flat_map(|&g| {
                    let g = &self.groups[g];
                    g.cells.iter().filter(|c| c.order.iter().any(live)).filter_map(|c| want.clip(&g.key.engine, c.start, c.end))
                })
                .collect();
            ranges.sort_unstable();
            // Layer boundaries a chain of these ranges reaches from 0, taken in start order.
            let mut reached = HashSet::from([0]);
            for (start, end) in ranges {
                if reached.contains(&start) {
                    reached.insert(end);
                }
            }
            reached.contains(&self.groups[groups[0]].key.n_layers)
        })
    }

    /// The usable workers holding some of `prefix`, each with the most blocks it holds, by slot.
    /// Deepest probes first, and at most `MAX_HOLDER_READS` index entries read.
    fn holders_of(&self, prefix: &[Probe], ask: &Ask) -> Vec<(u32, u32)> {
        let mut held: Vec<(u32, u32)> = Vec::new();
        for &(blocks, digest) in prefix.iter().rev() {
            if held.len() >= MAX_HOLDER_READS {
                break;
            }
            let Some(list) = self.holders.get(&digest) else { continue };
            held.extend(list.iter().map(|&slot| (slot, blocks)));
        }
        // Deepest per worker: sorted by slot, then blocks descending, the first of each slot kept.
        held.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        held.dedup_by_key(|h| h.0);
        held.retain(|&(slot, _)| {
            self.usable(slot, ask) && self.slots[slot as usize].as_ref().is_some_and(|w| !self.quarantined.contains_key(&w.id))
        });
        held
    }

    /// The cheapest route over `groups` (one shape). One usable worker per cell first; if the
    /// shortest path over those uses one twice, the first `REPAIR_DEPTH` of each cell and the
    /// planner's search (a second replica of that range usually serves). Those are a superset of
    /// the first, so the search's route is no dearer than a repair of the first would be.
    fn plan_over(&mut self, groups: &[usize], want: &Want, ask: &Ask, favoured: &[(u32, f64)]) -> Option<Chain> {
        let (candidates, slots) = self.offer_over(groups, 1, want, ask, favoured);
        let n_layers = self.groups[groups[0]].key.n_layers;
        let (candidates, slots, hops) = match shortest(n_layers, &candidates) {
            Shortest::Route(hops) => (candidates, slots, hops),
            Shortest::Uncovered => return None,
            Shortest::Repeats => {
                let (candidates, slots) = self.offer_over(groups, REPAIR_DEPTH, want, ask, favoured);
                let hops = plan(n_layers, &candidates)?;
                (candidates, slots, hops)
            }
        };
        let cost = hops.iter().map(|h: &Hop| candidates[h.candidate].cost(h.start, h.end)).sum();
        Some(Chain { cost, hops: hops.iter().map(|h| (slots[h.candidate], h.start, h.end)).collect() })
    }

    /// `offer` over several groups, each candidate's range cut to the layers `want` lets its
    /// engine compute (and dropped where there are none).
    fn offer_over(
        &mut self,
        groups: &[usize],
        depth: usize,
        want: &Want,
        ask: &Ask,
        favoured: &[(u32, f64)],
    ) -> (Vec<Candidate>, Vec<u32>) {
        // The common case, one engine's group, needs no cutting: its candidates as offered, on
        // the hot path without a copy.
        if let [group] = groups {
            if !matches!(want, Want::Spans(_)) {
                return self.offer(*group, depth, ask, favoured);
            }
        }
        let (mut candidates, mut slots) = (Vec::new(), Vec::new());
        for &group in groups {
            let mine: Vec<(u32, f64)> = favoured
                .iter()
                .copied()
                .filter(|&(slot, _)| self.slots[slot as usize].as_ref().is_some_and(|w| w.group == group))
                .collect();
            let (c, s) = self.offer(group, depth, ask, &mine);
            let engine = &self.groups[group].key.engine;
            for (mut c, s) in c.into_iter().zip(s) {
                if let Some((start, end)) = want.clip(engine, c.start, c.end) {
                    (c.start, c.end) = (start, end);
                    candidates.push(c);
                    slots.push(s);
                }
            }
        }
        (candidates, slots)
    }

    /// The first `depth` workers of each cell of the group usable for `ask` as candidates, and
    /// their slots; then the `favoured` ones (usable, by slot, with their divisors) not offered
    /// yet. A favoured worker's time per layer is divided by its divisor.
    fn offer(&mut self, group: usize, depth: usize, ask: &Ask, favoured: &[(u32, f64)]) -> (Vec<Candidate>, Vec<u32>) {
        let g = &self.groups[group];
        let room = g.cells.len() * depth + favoured.len();
        let (mut candidates, mut slots) = (Vec::with_capacity(room), Vec::with_capacity(room));
        let mut rng = self.rng;
        // A head is live if it beat since then (`LiveWorker::alive`, without a subtraction a cell).
        let since = ask.now.checked_sub(3 * self.heartbeat);
        let mut offered = vec![false; favoured.len()];
        let mut offer = |cell: &Cell, rank: &Rank, offered: &mut [bool]| {
            // Jitter below any real difference breaks ties between equal chains at random.
            let tie = 1.0 + 1e-9 * (next_random(&mut rng) >> 11) as f64 / (1u64 << 53) as f64;
            let mut per_layer = f64::from_bits(rank.per_layer) * tie;
            if let Ok(i) = favoured.binary_search_by_key(&rank.slot, |f| f.0) {
                per_layer /= favoured[i].1;
                offered[i] = true;
            }
            candidates.push(Candidate { start: cell.start, end: cell.end, per_layer, fixed: HOP_MS });
            slots.push(rank.slot);
        };
        for cell in &g.cells {
            match cell.head {
                Some(h)
                    if depth == 1
                        && h.room
                        && ask.kv <= h.kv_room
                        && since.is_none_or(|t| h.beat >= t)
                        && !ask.excluded.contains(&h.rank.slot) =>
                {
                    offer(cell, &h.rank, &mut offered)
                }
                _ => cell.order.iter().filter(|r| self.usable(r.slot, ask)).take(depth).for_each(|r| offer(cell, r, &mut offered)),
            }
        }
        for (i, &(slot, _)) in favoured.iter().enumerate() {
            let w = self.slots[slot as usize].as_ref().expect("favoured workers are live");
            if !offered[i] {
                offer(&g.cells[w.cell], &w.rank, &mut offered);
            }
        }
        self.rng = rng;
        (candidates, slots)
    }

    /// Counts a route issued to the worker in `slot`, its session of `kv` positions tagged
    /// `session`, in its load.
    fn issue(&mut self, slot: u32, now: Instant, kv: u64, session: u64) -> &LiveWorker {
        let hb = self.heartbeat;
        if let Some(w) = self.slots[slot as usize].as_mut() {
            w.issued.push_back(Issued { at: now, kv, tag: session, opened: false });
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
    /// have been checked). Every stage runs one engine (numerics and KV dtype included), the
    /// named workers': another engine computes other bits. None when a segment cannot be served or
    /// the segments do not cover the model.
    pub fn plan_fixed(&mut self, model_id: &str, fixed: &[RouteStage], exclude: &[String], kv: u64, session: u64) -> Option<Planned> {
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
        // A stage's engine as asked, else the named workers' engine, or else the first pick's.
        let mut engine = fixed.iter().find_map(|s| self.worker(&s.worker_id)).map(|w| w.reg.engine.as_str());
        for s in fixed {
            let want = if s.engine.is_empty() { engine } else { Some(s.engine.as_str()) };
            let fits = |w: &LiveWorker| usable(w, s) && want.is_none_or(|e| w.reg.engine == e);
            let w = if s.worker_id.is_empty() {
                // Rare (spot checks): a scan over the registry is fine here.
                self.workers()
                    .filter(|w| fits(w) && !exclude.contains(w.id.as_str()) && !ids.contains(&w.id.as_str()))
                    .min_by(|a, b| a.routes_total.cmp(&b.routes_total).then(a.per_layer_ms().total_cmp(&b.per_layer_ms())))?
            } else {
                self.worker(&s.worker_id).filter(|w| fits(w))?
            };
            if s.engine.is_empty() {
                engine = Some(&w.reg.engine);
            }
            ids.push(&w.id);
        }
        let slots: Vec<u32> = ids.iter().map(|id| self.by_id[*id]).collect();
        let first = self.slots[*slots.first()? as usize].as_ref()?;
        let (n_layers, hidden, vocab) = (first.reg.n_layers, first.reg.hidden, first.reg.vocab);
        let covers = fixed.first()?.layer_start == 0
            && fixed.last()?.layer_end == n_layers
            && fixed.windows(2).all(|p| p[0].layer_end == p[1].layer_start);
        if !covers {
            return None;
        }
        let mut stages = Vec::with_capacity(fixed.len());
        for (&slot, s) in slots.iter().zip(fixed) {
            let w = self.issue(slot, now, kv, session);
            let (layer_start, layer_end) = (s.layer_start, s.layer_end);
            stages.push(RouteStage { worker_id: w.id.clone(), addr: w.addr.clone(), layer_start, layer_end, engine: w.reg.engine.clone() });
        }
        Some(Planned { engine: route_engine(&stages), stages, hidden, n_layers, vocab, prefix_stages: 0 })
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
            kv_tokens: 1000,
            ..Default::default()
        }
    }

    fn join(r: &mut Registry, id: &str, reg: Registration) {
        let (control, _) = mpsc::channel(1);
        r.join(Joining { id: id.into(), reg, addr: id.into(), relayed: false, conn: 0, control });
    }

    fn route(r: &mut Registry) -> Vec<(String, u32, u32)> {
        let p = r.plan_route("m", &Want::Any, &[], &[], 1, 0).expect("a route");
        p.stages.into_iter().map(|s| (s.worker_id, s.layer_start, s.layer_end)).collect()
    }

    fn stage(id: &str, s: u32, e: u32) -> RouteStage {
        RouteStage { worker_id: id.into(), addr: String::new(), layer_start: s, layer_end: e, engine: String::new() }
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
            assert_eq!(r.plan_route("m", &Want::Any, &[], &[], 1, 0).unwrap().stages[0].worker_id, "fast");
            let fixed = [stage("", 0, 2), stage("tail", 2, 4)];
            let p = r.plan_fixed("m", &fixed, &["fast".to_string()], 1, 0).unwrap();
            assert_eq!(p.stages[1].worker_id, "tail");
            swapped_in.push(p.stages[0].worker_id.clone());
        }
        assert_eq!(swapped_in, ["slow1", "slow2", "slow1", "slow2"]);
        // A named stage must hold the range; an excluded or uncovered segment has no route.
        assert!(r.plan_fixed("m", &[stage("tail", 0, 2), stage("tail", 2, 4)], &[], 1, 0).is_none());
        assert!(r
            .plan_fixed("m", &[stage("", 0, 2), stage("tail", 2, 4)], &["fast".into(), "slow1".into(), "slow2".into()], 1, 0)
            .is_none());
        assert!(r.plan_fixed("m", &[stage("", 0, 2)], &[], 1, 0).is_none());
    }

    #[test]
    fn a_route_of_one_engine_stays_within_it_and_any_engine_may_mix() {
        let mut r = Registry::new(Duration::from_secs(60));
        let of = |engine: &str, range, us| Registration { engine: engine.into(), ..reg(range, us) };
        join(&mut r, "head", of("cpu", (0, 2), 10.0));
        join(&mut r, "tail-gpu", of("gpu", (2, 4), 10.0));
        // Only a mix covers the model: asked for one engine, none; asked for any, the mix.
        assert!(r.plan_route("m", &Want::One("cpu".into()), &[], &[], 1, 0).is_none());
        assert!(!r.covered_but_full("m", &Want::One("cpu".into()), &[], 1) && r.covered_but_full("m", &Want::Any, &[], 1));
        let p = r.plan_route("m", &Want::Any, &[], &[], 1, 0).unwrap();
        assert_eq!(p.engine, "cpu@0..2+gpu@2..4");
        let engines: Vec<&str> = p.stages.iter().map(|s| s.engine.as_str()).collect();
        assert_eq!(engines, ["cpu", "gpu"]);
        // A swap keeps each stage's engine: the one asked for, else the named workers'.
        assert!(r.plan_fixed("m", &[stage("head", 0, 2), stage("", 2, 4)], &[], 1, 0).is_none(), "no cpu worker holds 2..4");
        let gpu = RouteStage { engine: "gpu".into(), ..stage("", 2, 4) };
        assert_eq!(r.plan_fixed("m", &[stage("head", 0, 2), gpu], &[], 1, 0).unwrap().engine, "cpu@0..2+gpu@2..4");
        // Once one engine covers the model, asking for it gives that engine's route alone.
        join(&mut r, "whole-cpu", of("cpu", (0, 4), 50.0));
        let p = r.plan_route("m", &Want::One("cpu".into()), &[], &[], 1, 0).unwrap();
        assert_eq!((p.engine.as_str(), p.stages[0].worker_id.as_str()), ("cpu", "whole-cpu"));
        assert!(r.plan_route("m", &Want::One("gpu".into()), &[], &[], 1, 0).is_none());
    }

    #[test]
    fn a_recovery_computes_each_layer_on_the_engine_that_computed_it() {
        let mut r = Registry::new(Duration::from_secs(60));
        // The cheapest mix: the GPU computes 0..3, the CPU 3..6.
        let workers = [
            ("gpu-head", "gpu", (0, 3), 1.0),
            ("gpu-all", "gpu", (0, 6), 50.0),
            ("cpu-all", "cpu", (0, 6), 100.0),
            ("cpu-tail", "cpu", (3, 6), 1.0),
        ];
        for (id, engine, range, us) in workers {
            join(&mut r, id, Registration { engine: engine.into(), n_layers: 6, ..reg(range, us) });
        }
        let p = r.plan_route("m", &Want::Any, &[], &[], 1, 0).unwrap();
        let hops: Vec<(&str, u32, u32)> = p.stages.iter().map(|s| (s.worker_id.as_str(), s.layer_start, s.layer_end)).collect();
        assert_eq!((p.engine.as_str(), hops.as_slice()), ("gpu@0..3+cpu@3..6", &[("gpu-head", 0, 3), ("cpu-tail", 3, 6)][..]));
        // The CPU stage is lost: its replacement computes 3..6 on the CPU again, though a GPU
        // worker would be cheaper there.
        let want = Want::parse(&p.engine).unwrap();
        let again = r.plan_route("m", &want, &["cpu-tail".into()], &[], 1, 0).unwrap();
        let hops: Vec<(&str, u32, u32)> = again.stages.iter().map(|s| (s.worker_id.as_str(), s.layer_start, s.layer_end)).collect();
        assert_eq!((again.engine.as_str(), hops.as_slice()), ("gpu@0..3+cpu@3..6", &[("gpu-head", 0, 3), ("cpu-all", 3, 6)][..]));
        assert_eq!(r.plan_route("m", &Want::Any, &["cpu-tail".into()], &[], 1, 0).unwrap().engine, "gpu");
        // With no CPU worker for 3..6 the recovery has no route, and says it is not for room.
        let lost = ["cpu-tail".to_string(), "cpu-all".to_string()];
        assert!(r.plan_route("m", &want, &lost, &[], 1, 0).is_none() && !r.covered_but_full("m", &want, &lost, 1));
        assert!(matches!(Want::parse("gpu@0..3+cpu@4..6"), Err(dgr_proto::ProtoError::BadInput(_))));
    }

    #[test]
    fn a_worker_without_kv_room_for_the_session_is_passed_over() {
        let mut r = Registry::new(Duration::from_secs(1));
        join(&mut r, "big", Registration { kv_tokens: 1000, ..reg((0, 4), 200.0) });
        join(&mut r, "small", Registration { kv_tokens: 300, ..reg((0, 4), 100.0) });
        let to =
            |r: &mut Registry, kv: u64, tag: u64| r.plan_route("m", &Want::Any, &[], &[], kv, tag).map(|p| p.stages[0].worker_id.clone());
        // The faster worker has room for 200 positions; once it is routed that session, not again.
        assert_eq!(to(&mut r, 200, 1).as_deref(), Some("small"));
        assert_eq!(to(&mut r, 200, 2).as_deref(), Some("big"));
        // A heartbeat says what the sessions reserved; a route issued just before it whose
        // session it does not name as opened may not be in it yet, and still counts: 1000 - 250 -
        // 200 leave 550.
        r.heartbeat("big", Load { kv_reserved_tokens: 250, ..Default::default() }, &[], None);
        assert_eq!(to(&mut r, 600, 3), None);
        assert!(r.covered_but_full("m", &Want::Any, &[], 600), "room frees as sessions end");
        // Once a heartbeat names the session as opened, its 200 are in the 250, counted once.
        r.heartbeat("big", Load { kv_reserved_tokens: 250, ..Default::default() }, &[9, 2], None);
        assert_eq!(to(&mut r, 700, 3).as_deref(), Some("big"));
        assert_eq!(to(&mut r, 200, 4), None, "1000 - 250 - 700 leave 50; the small one 100");
        // A session larger than any worker's whole budget never fits: not a matter of waiting.
        assert_eq!(to(&mut r, 2000, 5), None);
        assert!(!r.covered_but_full("m", &Want::Any, &[], 2000));
    }

    #[test]
    fn starting_workers_are_placed_apart_until_they_join_or_their_ranges_expire() {
        let mut r = Registry::new(Duration::from_secs(1));
        // What the tracker does for a request: weigh, work out the window, hold it.
        let place = |r: &mut Registry, n: u32, max: u32, now: Instant| {
            let best = r.placement("m", n, max, now)?.best();
            r.hold("m", best, now);
            Ok::<_, String>((best.start, best.end))
        };
        let now = Instant::now();
        // Two workers asking before either joins get different halves.
        assert_eq!(place(&mut r, 4, 2, now).unwrap(), (0, 2));
        assert_eq!(place(&mut r, 4, 2, now).unwrap(), (2, 4));
        // The first joins with its range: held by a worker now, not twice.
        join(&mut r, "a", reg((0, 2), 100.0));
        assert_eq!(r.placing.len(), 1);
        // A third doubles up the half still to come: counted at a default speed (no worker had
        // measured one), it is far thinner than the first's.
        assert_eq!(place(&mut r, 4, 2, now).unwrap(), (2, 4));
        // A count the swarm contradicts, no layers, or nothing to hold, is refused.
        assert!(place(&mut r, 5, 2, now).is_err());
        assert!(place(&mut r, 0, 2, now).is_err());
        assert!(place(&mut r, 4, 0, now).is_err());
        // Ranges never joined with expire: then layers 2..4 are uncovered again.
        r.placing.iter_mut().for_each(|p| p.until = now);
        assert_eq!(place(&mut r, 4, 1, Instant::now()).unwrap(), (2, 3));
        assert_eq!(r.placing.len(), 1);
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
        assert!(r.plan_route("m", &Want::Any, &[], &[], 1, 0).is_none());
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
        let without_tail = r.plan_route("m", &Want::Any, &["tail".into()], &[], 1, 0).unwrap().stages;
        assert_eq!((without_tail[1].worker_id.as_str(), without_tail[1].layer_start), ("whole", 2));
        r.quarantine("whole".into(), "caught".into());
        assert!(r.plan_route("m", &Want::Any, &["tail".into()], &[], 1, 0).is_none());
        // A re-join under a quarantined identity is listed, never routed.
        join(&mut r, "whole", reg((0, 4), 1000.0));
        assert_eq!(r.workers().count(), 3);
        assert!(r.plan_route("m", &Want::Any, &["tail".into()], &[], 1, 0).is_none());
        // A late close of an older connection leaves the record; the current one removes it.
        r.leave("tail", 7);
        assert!(r.worker("tail").is_some());
        r.leave("tail", 0);
        assert!(r.worker("tail").is_none() && r.plan_route("m", &Want::Any, &[], &[], 1, 0).is_none());
        join(&mut r, "tail2", reg((2, 4), 10.0));
        assert_eq!(route(&mut r), [("head".to_string(), 0, 2), ("tail2".to_string(), 2, 4)]);
        // Another model, or another engine asked for, has no route.
        assert!(
            r.plan_route("other", &Want::Any, &[], &[], 1, 0).is_none()
                && r.plan_route("m", &Want::One("gguf".into()), &[], &[], 1, 0).is_none()
        );
        for id in ["head", "tail2", "whole"] {
            r.leave(id, 0);
        }
        assert!(r.groups.is_empty() && r.workers().count() == 0);
    }

    /// A prompt's probes as the tracker makes them: blocks 1..=n, digest = prompt tag and block.
    fn probes(tag: u64, n: u32) -> Vec<Probe> {
        (1..=n).map(|b| (b, tag << 32 | u64::from(b))).collect()
    }

    fn holds(r: &mut Registry, id: &str, sessions: u32, held: &[Probe]) {
        let load = Load { sessions, ..Default::default() };
        r.heartbeat(id, load, &[], Some(held.iter().map(|p| p.1).collect()));
    }

    fn whole(max_sessions: u32) -> Registration {
        Registration { max_sessions, ..reg((0, 4), 100.0) }
    }

    #[test]
    fn the_prefix_holder_serves_unless_twice_as_loaded() {
        let p = probes(7, 6);
        for holder_sessions in 0..7 {
            for other_sessions in 0..7 {
                let mut r = Registry::new(Duration::from_secs(60));
                join(&mut r, "holder", whole(64));
                join(&mut r, "other", whole(64));
                holds(&mut r, "holder", holder_sessions, &p);
                holds(&mut r, "other", other_sessions, &probes(8, 6));
                let got = r.plan_route("m", &Want::Any, &[], &p, 1, 0).unwrap();
                // The rule: load is 1 + sessions (the planner's load factor); the holder loses
                // at twice the other's.
                let want = if 1 + holder_sessions < 2 * (1 + other_sessions) { "holder" } else { "other" };
                assert_eq!(got.stages[0].worker_id, want, "holder {holder_sessions} sessions, other {other_sessions}");
                assert_eq!(got.prefix_stages, usize::from(want == "holder"));
            }
        }
        // No probes, or probes nobody holds: load alone decides (the other, even with the
        // routes it is issued still counted).
        let mut r = Registry::new(Duration::from_secs(60));
        join(&mut r, "holder", whole(64));
        join(&mut r, "other", whole(64));
        holds(&mut r, "holder", 5, &p);
        holds(&mut r, "other", 0, &[]);
        for ask in [vec![], probes(9, 6)] {
            let got = r.plan_route("m", &Want::Any, &[], &ask, 1, 0).unwrap();
            assert_eq!((got.stages[0].worker_id.as_str(), got.prefix_stages), ("other", 0));
            holds(&mut r, "other", 0, &[]);
        }
        // Excluded, quarantined or full, a holder is not favoured.
        assert_eq!(r.plan_route("m", &Want::Any, &["other".into()], &p, 1, 0).unwrap().stages[0].worker_id, "holder");
        holds(&mut r, "holder", 0, &p);
        assert_eq!(r.plan_route("m", &Want::Any, &["holder".into()], &p, 1, 0).unwrap().stages[0].worker_id, "other");
        holds(&mut r, "holder", 64, &p);
        holds(&mut r, "other", 0, &[]);
        assert_eq!(r.plan_route("m", &Want::Any, &[], &p, 1, 0).unwrap().stages[0].worker_id, "other");
        holds(&mut r, "holder", 0, &p);
        r.quarantine("holder".into(), "caught".into());
        assert_eq!(r.plan_route("m", &Want::Any, &[], &p, 1, 0).unwrap().stages[0].worker_id, "other");
    }

    #[test]
    fn a_deeper_match_beats_a_shallower_one_on_every_stage() {
        let p = probes(3, 8);
        // Two replicas of a two-stage chain: a holds all 8 blocks on both stages, b the first 4.
        let chains = |a_sessions: u32, b_sessions: u32| {
            let mut r = Registry::new(Duration::from_secs(60));
            for (id, range) in [("a0", (0, 2)), ("a1", (2, 4)), ("b0", (0, 2)), ("b1", (2, 4))] {
                join(&mut r, id, reg(range, 100.0));
            }
            for (id, sessions, n) in [("a0", a_sessions, 8), ("a1", a_sessions, 8), ("b0", b_sessions, 4), ("b1", b_sessions, 4)] {
                holds(&mut r, id, sessions, &p[..n]);
            }
            r
        };
        for a_sessions in 0..5 {
            for b_sessions in 0..5 {
                let (la, lb) = (1 + a_sessions, 1 + b_sessions);
                // a's time counts 1 / 2, b's 1 / 1.5 (half as deep): a serves while its load is
                // under 4 / 3 of b's (an exact tie left out).
                if 3 * la != 4 * lb {
                    let want = if 3 * la < 4 * lb { ["a0", "a1"] } else { ["b0", "b1"] };
                    assert_eq!(route_with(&mut chains(a_sessions, b_sessions), &p), want, "a at {la}, b at {lb}");
                }
                // Probes that stop at block 4 match both alike: the less loaded serves.
                if la != lb {
                    let want = if la < lb { ["a0", "a1"] } else { ["b0", "b1"] };
                    assert_eq!(route_with(&mut chains(a_sessions, b_sessions), &p[..4]), want, "4 blocks asked, a at {la}, b at {lb}");
                }
            }
        }
    }

    fn route_with(r: &mut Registry, p: &[Probe]) -> Vec<String> {
        r.plan_route("m", &Want::Any, &[], p, 1, 0).unwrap().stages.into_iter().map(|s| s.worker_id).collect()
    }

    #[test]
    fn a_hot_prefix_spreads_to_the_other_replica_by_the_rule() {
        let p = probes(5, 4);
        let mut r = Registry::new(Duration::from_secs(60));
        join(&mut r, "holder", whole(1000));
        join(&mut r, "other", whole(1000));
        holds(&mut r, "holder", 0, &p);
        // Routes issued since the last heartbeat count in the load: each one follows the rule.
        let (mut h, mut o) = (0u32, 0u32);
        for _ in 0..60 {
            let want = if 1 + h < 2 * (1 + o) { "holder" } else { "other" };
            assert_eq!(route_with(&mut r, &p), [want], "after {h} to the holder and {o} to the other");
            *(if want == "holder" { &mut h } else { &mut o }) += 1;
        }
        assert!(o >= 15 && h > o, "holder {h}, other {o}");
    }

    #[test]
    fn the_index_follows_reports_and_stays_bounded() {
        let p = probes(1, 2);
        let mut r = Registry::new(Duration::from_secs(60));
        for i in 0..HOLDERS_PER_DIGEST + 8 {
            join(&mut r, &format!("w{i}"), whole(64));
            holds(&mut r, &format!("w{i}"), 0, &p);
        }
        // Each digest lists the latest reporters, at most HOLDERS_PER_DIGEST.
        assert_eq!(r.holders.len(), 2);
        assert!(r.holders.values().all(|l| l.len() == HOLDERS_PER_DIGEST));
        assert!(r.holders.values().all(|l| !l.contains(&r.by_id["w0"])), "the longest listed made room");
        // A report replaces the last: a dropped digest leaves the index, a repeat is listed once.
        let last = format!("w{}", HOLDERS_PER_DIGEST + 7);
        r.heartbeat(&last, Load::default(), &[], Some(vec![p[0].1, p[0].1, 99]));
        let slot = r.by_id[&last];
        assert_eq!(r.holders[&p[0].1].iter().filter(|&&s| s == slot).count(), 1);
        assert!(!r.holders[&p[1].1].contains(&slot) && r.holders[&99] == [slot]);
        assert_eq!(r.worker(&last).unwrap().prefix_blocks(), 2);
        // No report (None) keeps what it had; leaving takes it out.
        r.heartbeat(&last, Load::default(), &[], None);
        assert_eq!(r.holders[&99], [slot]);
        for i in 0..HOLDERS_PER_DIGEST + 8 {
            r.leave(&format!("w{i}"), 0);
        }
        assert!(r.holders.is_empty());
    }
}

//! Route planning: the cheapest chain of workers that covers a model's layers `[0, n_layers)`
//! exactly once, in order, using each worker at most once.
//!
//! The chain is a shortest path over the layer boundaries `0..=n_layers`. For each boundary `e`,
//! every candidate `w` whose range reaches `e` keeps `m_w = min over s of (dist[s] − per_layer_w·s)`
//! for the starts `s` seen so far, so `dist[e] = min_w (m_w + per_layer_w·e + fixed_w)` costs O(1)
//! per (candidate, layer): one plan is linear in the sum of the range lengths. With many
//! candidates, those another candidate beats outright are dropped first (`undominated`).
//!
//! That shortest path may use a worker twice (X, a much cheaper Y, X again), which a session
//! cannot do. Such a path is a lower bound, and a best-first branch and bound over the layers each
//! worker may serve repairs it. In random layouts like the benchmark's, 1 plan in 30 (100 workers)
//! to 1 in 400 (1,000 workers) needs that, and it pops at most three search nodes.

/// One worker able to serve any contiguous sub-range of `[start, end)`: serving `[s, e)` costs
/// `per_layer·(e − s) + fixed`. The caller folds measured time per layer, load and hop latency
/// into the two numbers. Empty or out-of-bounds ranges and costs that are negative or not finite
/// make the candidate ignored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub start: u32,
    pub end: u32,
    pub per_layer: f64,
    pub fixed: f64,
}

impl Candidate {
    /// The cost of serving `[start, end)`, `start <= end`.
    pub fn cost(&self, start: u32, end: u32) -> f64 {
        self.per_layer * f64::from(end - start) + self.fixed
    }

    fn usable(&self, n_layers: u32) -> bool {
        let cost_ok = |x: f64| x.is_finite() && x >= 0.0;
        self.start < self.end && self.end <= n_layers && cost_ok(self.per_layer) && cost_ok(self.fixed)
    }
}

/// One stage of a route: `candidates[candidate]` serves layers `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hop {
    pub candidate: usize,
    pub start: u32,
    pub end: u32,
}

/// Search nodes expanded before settling for the cheapest valid route found so far, so that no
/// layout can stall the tracker. Each costs up to three shortest paths; random layouts need at
/// most three, and only many interlocking repeats get near this.
const MAX_EXPANSIONS: usize = 64;

/// The cheapest route over `[0, n_layers)`, its hops in layer order, each candidate (worker) used
/// at most once; `None` when the usable candidates do not cover every layer. Exact unless the
/// repair of repeated workers outgrows `MAX_EXPANSIONS` search nodes. Equal-cost choices are settled
/// deterministically (of identical candidates, the lowest index serves), so the caller adds its own
/// jitter to the costs to spread load.
pub fn plan(n_layers: u32, candidates: &[Candidate]) -> Option<Vec<Hop>> {
    // If the lower bound repeats no worker, it is the answer. Otherwise search all of them.
    let (root, dp, bound, route) = lower_bound(n_layers, candidates)?;
    if repeat(&route).is_none() {
        return Some(route);
    }
    let mut search = Search { n: n_layers, cands: candidates, dp, open: Vec::new(), best: None };
    search.add_solved(root, bound, route);
    for _ in 0..MAX_EXPANSIONS {
        // Best first: every route a node allows costs at least its bound.
        let Some(i) = (0..search.open.len()).min_by(|&a, &b| search.open[a].bound.total_cmp(&search.open[b].bound)) else {
            break;
        };
        let node = search.open.swap_remove(i);
        if search.best.as_ref().is_some_and(|(cost, _)| *cost <= node.bound) {
            break;
        }
        let Some((w, e1, s2)) = repeat(&node.route) else {
            return Some(node.route);
        };
        // w's one hop [s, e) of a valid route ends by s2, starts from e1, or spans [e1 − 1, s2 + 1).
        // Each child drops a (worker, layer) pair the node's path used, so the search ends.
        for (lo, hi, force) in [(0, s2, false), (e1, n_layers, false), (e1 - 1, s2 + 1, true)] {
            search.add(branch(&node.pieces, w, lo, hi, force));
        }
    }
    search.best.map(|(_, route)| route)
}

/// What the shortest path ignoring repeats found.
pub enum Shortest {
    /// A route that repeats no worker: the cheapest route.
    Route(Vec<Hop>),
    /// A path that uses some worker twice: only `plan`'s search finds the cheapest route.
    Repeats,
    /// Some layer has no usable candidate.
    Uncovered,
}

/// The shortest path ignoring repeats, without the search that repairs a repeat: a caller that
/// passed one of several equal workers may rather pass more and `plan` with them.
pub fn shortest(n_layers: u32, candidates: &[Candidate]) -> Shortest {
    match lower_bound(n_layers, candidates) {
        None => Shortest::Uncovered,
        Some((_, _, _, route)) if repeat(&route).is_none() => Shortest::Route(route),
        Some(_) => Shortest::Repeats,
    }
}

/// The usable candidates as whole pieces, the scratch, and the shortest path ignoring repeats
/// with its cost (a lower bound on every route).
fn lower_bound(n_layers: u32, candidates: &[Candidate]) -> Option<(Vec<Piece>, Dp, f64, Vec<Hop>)> {
    let root: Vec<Piece> = (0..candidates.len() as u32)
        .filter(|&id| candidates[id as usize].usable(n_layers))
        .map(|id| Piece { id, start: candidates[id as usize].start, end: candidates[id as usize].end })
        .collect();
    // The sweep's work. Too little to cover the model is an early None that also bounds the
    // scratch by the input's size.
    let layers: u64 = root.iter().map(|p| u64::from(p.end - p.start)).sum();
    if layers < u64::from(n_layers) {
        return None;
    }
    // Dropping dominated candidates keeps that path.
    let mut dp = Dp::default();
    let (bound, route) = dp.run(n_layers, candidates, &undominated(n_layers, candidates, &root, layers))?;
    Some((root, dp, bound, route))
}

/// Branch and bound over what each worker may serve.
struct Search<'a> {
    n: u32,
    cands: &'a [Candidate],
    dp: Dp,
    open: Vec<Node>,
    /// The cheapest valid route seen, and its cost.
    best: Option<(f64, Vec<Hop>)>,
}

impl Search<'_> {
    /// Solves `pieces` ignoring repeats; keeps the node open if it may beat the best valid route,
    /// and offers its route, made valid, as a new best. The shortest path ignoring repeats runs
    /// over the node's undominated pieces (the same cost), while the node keeps all of them: a
    /// child that cuts a worker's range may need one its parent could do without.
    fn add(&mut self, pieces: Vec<Piece>) {
        let layers = pieces.iter().map(|p| u64::from(p.end - p.start)).sum();
        let kept = undominated(self.n, self.cands, &pieces, layers);
        if let Some((bound, route)) = self.dp.run(self.n, self.cands, &kept) {
            self.add_solved(pieces, bound, route);
        }
    }

    /// `add` for pieces whose shortest path ignoring repeats is known: `route`, of cost `bound`.
    fn add_solved(&mut self, pieces: Vec<Piece>, bound: f64, route: Vec<Hop>) {
        let valid = collapse(&route);
        let cost = valid.iter().map(|h| self.cands[h.candidate].cost(h.start, h.end)).sum();
        if self.best.as_ref().is_none_or(|(best, _)| cost < *best) {
            self.best = Some((cost, valid));
        }
        if self.best.as_ref().is_some_and(|(best, _)| bound < *best) {
            self.open.push(Node { bound, pieces, route });
        }
    }
}

/// Layers `[start, end)` that candidate `id` may serve in one search node; branching cuts a
/// candidate's range into disjoint, never adjacent pieces.
#[derive(Clone, Copy, Debug)]
struct Piece {
    id: u32,
    start: u32,
    end: u32,
}

/// A branch-and-bound node: what each candidate may serve, and the unconstrained shortest path
/// under that (its cost is the node's lower bound).
struct Node {
    bound: f64,
    pieces: Vec<Piece>,
    route: Vec<Hop>,
}

/// The first worker used twice: `(candidate, end of its first hop, start of its next hop)`.
fn repeat(route: &[Hop]) -> Option<(u32, u32, u32)> {
    route.iter().enumerate().find_map(|(j, later)| {
        let first = route[..j].iter().rfind(|h| h.candidate == later.candidate)?;
        Some((later.candidate as u32, first.end, later.start))
    })
}

/// The route with each repeated worker taking over everything from its first hop to its last:
/// valid, since a worker's range holds the span between two of its hops.
fn collapse(route: &[Hop]) -> Vec<Hop> {
    let mut out: Vec<Hop> = Vec::with_capacity(route.len());
    for &h in route {
        match out.iter().position(|g| g.candidate == h.candidate) {
            Some(i) => {
                out.truncate(i + 1);
                out[i].end = h.end;
            }
            None => out.push(h),
        }
    }
    out
}

/// The pieces (whole candidates) that no other candidate beats outright, holding their range and
/// no dearer for any hop in it (nor, on a full tie, of higher index): a shortest path ignoring
/// repeats can swap those in. Each piece meets one challenger, a cheap candidate holding its range.
fn undominated(n: u32, cands: &[Candidate], pieces: &[Piece], layers: u64) -> Vec<Piece> {
    let w = n as usize + 1;
    // The table costs (n + 1)² cells, the sweep it spares the sum of the pieces' lengths.
    if (u64::from(n) + 1).saturating_mul(u64::from(n) + 1) > layers {
        return pieces.to_vec();
    }
    // champion[a·w + b]: of the candidates seen holding [a, b), the cheapest there, the first seen
    // on a tie (`none`, of infinite cost: none yet). The costs are copied into one table with that
    // sentinel, so a duel is two lookups and a select, without a branch on either side's presence.
    let none = cands.len() as u32;
    let costs: Vec<(f64, f64)> = cands.iter().map(|c| (c.per_layer, c.fixed)).chain([(f64::INFINITY, f64::INFINITY)]).collect();
    let cheaper = |x: u32, y: u32, len: u32| {
        let cost = |id: u32| {
            let (per, fixed) = costs[id as usize];
            per * f64::from(len) + fixed
        };
        if cost(y) < cost(x) {
            y
        } else {
            x
        }
    };
    let mut champion = vec![none; w * w];
    for p in pieces {
        let cell = p.start as usize * w + p.end as usize;
        champion[cell] = cheaper(champion[cell], p.id, p.end - p.start);
    }
    // Whatever holds [a, b + 1), then whatever holds [a − 1, b), holds [a, b) too. The inner loops
    // carry no dependency from one step to the next.
    for b in (1..n as usize).rev() {
        for a in 0..b {
            champion[a * w + b] = cheaper(champion[a * w + b], champion[a * w + b + 1], (b - a) as u32);
        }
    }
    for a in 1..n as usize {
        for b in a + 1..w {
            champion[a * w + b] = cheaper(champion[a * w + b], champion[(a - 1) * w + b], (b - a) as u32);
        }
    }
    let beaten = |p: &Piece| {
        // q won p's own cell, which pieces entered in index order: it is no dearer over p's whole
        // range (of lower index on a tie). Costs are linear in the length, so if it is no dearer
        // for one layer too, it is for any hop p could serve.
        let q = champion[p.start as usize * w + p.end as usize];
        q != p.id && cands[q as usize].cost(0, 1) <= cands[p.id as usize].cost(0, 1)
    };
    pieces.iter().filter(|p| !beaten(p)).copied().collect()
}

/// The pieces with `w` limited to `[lo, hi)`, or with `force`, with `w` made the only one able to
/// serve `[lo, hi)`: other candidates lose those layers, `w` keeps only the piece holding them.
fn branch(pieces: &[Piece], w: u32, lo: u32, hi: u32, force: bool) -> Vec<Piece> {
    let mut out = Vec::with_capacity(pieces.len() + 1);
    for &p in pieces {
        let cuts = if p.id == w {
            match force {
                false => [(p.start.max(lo), p.end.min(hi)), (0, 0)],
                true if p.start <= lo && hi <= p.end => [(p.start, p.end), (0, 0)],
                true => continue,
            }
        } else if force {
            [(p.start, p.end.min(lo)), (p.start.max(hi), p.end)]
        } else {
            [(p.start, p.end), (0, 0)]
        };
        out.extend(cuts.into_iter().filter(|(s, e)| s < e).map(|(start, end)| Piece { id: p.id, start, end }));
    }
    out
}

/// A piece whose range has begun, while the boundary sweeps over it.
#[derive(Clone, Copy)]
struct Active {
    /// `min over the starts s seen so far of dist[s] − per·s`.
    m: f64,
    per: f64,
    fixed: f64,
    end: u32,
    /// Index into the pieces, which are in candidate order: the lower one wins a tie.
    piece: u32,
}

/// Scratch for the shortest path, reused across the nodes of one search.
#[derive(Default)]
struct Dp {
    dist: Vec<f64>,
    /// For each boundary e, the piece serving the last hop of the best path to e.
    via: Vec<u32>,
    /// Pieces bucketed by start (counting sort): bucket s is `order[head[s]..head[s + 1]]`.
    head: Vec<usize>,
    order: Vec<u32>,
    active: Vec<Active>,
}

impl Dp {
    /// The cheapest path through `pieces` (each in bounds, non-empty, sorted by candidate)
    /// ignoring repeats, and its cost; `None` if some layer has no piece.
    fn run(&mut self, n: u32, cands: &[Candidate], pieces: &[Piece]) -> Option<(f64, Vec<Hop>)> {
        let n_us = n as usize;
        self.head.clear();
        self.head.resize(n_us + 2, 0);
        for p in pieces {
            self.head[p.start as usize + 2] += 1;
        }
        for s in 2..self.head.len() {
            self.head[s] += self.head[s - 1];
        }
        self.order.resize(pieces.len(), 0);
        for (i, p) in pieces.iter().enumerate() {
            let slot = &mut self.head[p.start as usize + 1];
            self.order[*slot] = i as u32;
            *slot += 1;
        }

        self.dist.clear();
        self.dist.resize(n_us + 1, f64::INFINITY);
        self.dist[0] = 0.0;
        self.via.clear();
        self.via.resize(n_us + 1, u32::MAX);
        self.active.clear();
        for e in 1..=n_us {
            let s = e - 1;
            for &i in &self.order[self.head[s]..self.head[s + 1]] {
                let p = &pieces[i as usize];
                let c = &cands[p.id as usize];
                self.active.push(Active { m: f64::INFINITY, per: c.per_layer, fixed: c.fixed, end: p.end, piece: i });
            }
            let (d, sf, ef) = (self.dist[s], s as f64, e as f64);
            let (mut best, mut via) = (f64::INFINITY, u32::MAX);
            // One pass updates every piece and drops those ending at e.
            let mut kept = 0;
            for i in 0..self.active.len() {
                let mut a = self.active[i];
                let from_s = d - a.per * sf;
                if from_s < a.m {
                    a.m = from_s;
                }
                let cost = a.m + a.per * ef + a.fixed;
                if cost < best || (cost == best && a.piece < via) {
                    best = cost;
                    via = a.piece;
                }
                self.active[kept] = a;
                kept += usize::from(a.end as usize != e);
            }
            self.active.truncate(kept);
            self.dist[e] = best;
            self.via[e] = via;
        }
        let total = self.dist[n_us];
        if !total.is_finite() {
            return None;
        }

        let mut route: Vec<Hop> = Vec::new();
        let mut e = n_us;
        while e > 0 {
            let p = &pieces[self.via[e] as usize];
            let per = cands[p.id as usize].per_layer;
            // The start the sweep's m came from: its first argmin.
            let from = |s: usize| self.dist[s] - per * s as f64;
            let s = (p.start as usize..e).reduce(|a, b| if from(b) < from(a) { b } else { a }).expect("non-empty hop");
            match route.last_mut() {
                // Two hops of one piece back to back (a tie when fixed = 0): one hop is no dearer.
                Some(next) if next.candidate == p.id as usize => next.start = s as u32,
                _ => route.push(Hop { candidate: p.id as usize, start: s as u32, end: e as u32 }),
            }
            e = s;
        }
        route.reverse();
        Some((total, route))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(start: u32, end: u32, per_layer: f64, fixed: f64) -> Candidate {
        Candidate { start, end, per_layer, fixed }
    }

    fn hop(candidate: usize, start: u32, end: u32) -> Hop {
        Hop { candidate, start, end }
    }

    /// Asserts `route` is a valid route and returns its cost.
    fn check(n: u32, cands: &[Candidate], route: &[Hop]) -> f64 {
        let mut at = 0;
        for (i, h) in route.iter().enumerate() {
            let c = &cands[h.candidate];
            assert!(c.usable(n), "{route:?}");
            assert!(h.start == at && h.start < h.end && c.start <= h.start && h.end <= c.end, "{route:?}");
            assert!(route[..i].iter().all(|g| g.candidate != h.candidate), "worker repeated: {route:?}");
            at = h.end;
        }
        assert_eq!(at, n, "{route:?}");
        route.iter().map(|h| cands[h.candidate].cost(h.start, h.end)).sum()
    }

    /// Exhaustive search; with `repeats`, a worker may serve several hops.
    fn brute(n: u32, cands: &[Candidate], repeats: bool) -> Option<f64> {
        fn go(at: u32, n: u32, cands: &[Candidate], used: u32, repeats: bool) -> f64 {
            if at == n {
                return 0.0;
            }
            let mut best = f64::INFINITY;
            for (i, c) in cands.iter().enumerate() {
                if !c.usable(n) || c.start > at || at >= c.end || (!repeats && used & 1 << i != 0) {
                    continue;
                }
                for e in at + 1..=c.end {
                    best = best.min(c.cost(at, e) + go(e, n, cands, used | 1 << i, repeats));
                }
            }
            best
        }
        Some(go(0, n, cands, 0, repeats)).filter(|c| c.is_finite())
    }

    struct SplitMix(crate::splitmix::SplitMix64);

    impl SplitMix {
        fn new(seed: u64) -> SplitMix {
            SplitMix(crate::splitmix::SplitMix64(seed))
        }

        fn below(&mut self, n: u32) -> u32 {
            self.0.below(n)
        }

        fn pick(&mut self, xs: &[f64]) -> f64 {
            xs[self.below(xs.len() as u32) as usize]
        }
    }

    #[test]
    fn matches_exhaustive_search() {
        let mut rng = SplitMix::new(7);
        let (mut routed, mut uncoverable, mut repaired) = (0, 0, 0);
        for _ in 0..20_000 {
            let n = 1 + rng.below(8);
            let cands: Vec<Candidate> = (0..rng.below(7))
                .map(|_| {
                    let start = rng.below(n);
                    let end = start + 1 + rng.below(n - start);
                    // Round costs make ties and cheap middles (worth a repeat) common.
                    let (any_per, any_fixed) = (1.0 + rng.below(1000) as f64 / 997.0, rng.below(1000) as f64 / 991.0);
                    let per = rng.pick(&[0.0, 0.1, 0.5, 1.0, 2.0, 3.0, any_per]);
                    let fixed = rng.pick(&[0.0, 0.0, 0.1, 1.0, any_fixed]);
                    cand(start, end, per, fixed)
                })
                .collect();
            let got = plan(n, &cands);
            assert_eq!(got, plan(n, &cands), "deterministic");
            match (got, brute(n, &cands, false)) {
                (Some(route), Some(want)) => {
                    let cost = check(n, &cands, &route);
                    assert!((cost - want).abs() < 1e-9, "{n} {cands:?}: {route:?} costs {cost}, best {want}");
                    routed += 1;
                    if brute(n, &cands, true).unwrap() < want - 1e-9 {
                        repaired += 1;
                    }
                }
                (None, None) => uncoverable += 1,
                (got, want) => panic!("{n} {cands:?}: got {got:?}, want {want:?}"),
            }
        }
        // The generator must exercise every path.
        assert!(routed > 5_000 && uncoverable > 1_000 && repaired > 100, "{routed} {uncoverable} {repaired}");
    }

    #[test]
    fn pieces_dominated_at_the_root_serve_where_a_repair_needs_them() {
        // X everywhere and Y very cheap in the middle make the shortest path X, Y, X; X beats
        // most others outright, yet once the search cuts X's range they may be the best left.
        // Enough candidates for the layers that every search node drops its dominated pieces.
        let mut rng = SplitMix::new(13);
        let (mut routed, mut repaired) = (0, 0);
        for _ in 0..3_000 {
            let n = 3;
            let mut cands = vec![cand(0, 3, 1.0, 0.1), cand(1, 2, 0.1, 0.1)];
            cands.extend((0..12 + rng.below(5)).map(|_| {
                let start = rng.below(n);
                let end = start + 1 + rng.below(n - start);
                cand(start, end, rng.pick(&[1.0, 1.5, 2.0, 3.0]), rng.pick(&[0.1, 0.1, 1.0]))
            }));
            // (n + 1)² = 16 layers at least: `undominated` drops pieces.
            assert!(cands.iter().map(|c| c.end - c.start).sum::<u32>() >= 16);
            let route = plan(n, &cands).expect("X covers the model");
            let want = brute(n, &cands, false).unwrap();
            let cost = check(n, &cands, &route);
            assert!((cost - want).abs() < 1e-9, "{cands:?}: {route:?} costs {cost}, best {want}");
            routed += 1;
            repaired += usize::from(brute(n, &cands, true).unwrap() < want - 1e-9);
        }
        assert!(repaired > 200, "{repaired} of {routed}");
    }

    #[test]
    fn dropping_dominated_candidates_keeps_the_shortest_path() {
        let mut rng = SplitMix::new(11);
        let (mut dropped, mut total) = (0, 0);
        for _ in 0..5_000 {
            let n = 1 + rng.below(12);
            let cands: Vec<Candidate> = (0..1 + rng.below(40))
                .map(|_| {
                    let start = rng.below(n);
                    let end = start + 1 + rng.below(n - start);
                    let (per, fixed) = (rng.below(4) as f64 / 2.0, rng.below(4) as f64 / 2.0);
                    cand(start, end, per, fixed)
                })
                .collect();
            let all: Vec<Piece> = cands.iter().enumerate().map(|(i, c)| Piece { id: i as u32, start: c.start, end: c.end }).collect();
            let kept = undominated(n, &cands, &all, u64::MAX);
            let mut dp = Dp::default();
            let (want, _) = dp.run(n, &cands, &all).unwrap_or((f64::INFINITY, vec![]));
            let (got, _) = dp.run(n, &cands, &kept).unwrap_or((f64::INFINITY, vec![]));
            assert!(got == want || (got - want).abs() < 1e-9, "{n} {cands:?}: {got} vs {want}");
            (dropped, total) = (dropped + all.len() - kept.len(), total + all.len());
        }
        assert!(dropped > total / 4, "{dropped} of {total}");
    }

    #[test]
    fn overlapping_ranges_compose_by_cost() {
        // [0,20), [10,30), [16,30) on 30 layers: the switch point follows the per-layer costs.
        let route = |a: f64, b: f64, c: f64| plan(30, &[cand(0, 20, a, 0.5), cand(10, 30, b, 0.5), cand(16, 30, c, 0.5)]);
        assert_eq!(route(1.0, 0.5, 2.0), Some(vec![hop(0, 0, 10), hop(1, 10, 30)]));
        assert_eq!(route(1.0, 1.1, 0.5), Some(vec![hop(0, 0, 16), hop(2, 16, 30)]));
        assert_eq!(route(1.0, 0.7, 0.5), Some(vec![hop(0, 0, 10), hop(1, 10, 16), hop(2, 16, 30)]));
        assert_eq!(route(0.5, 1.0, 0.9), Some(vec![hop(0, 0, 20), hop(2, 20, 30)]));
        assert_eq!(route(0.5, 0.9, 1.0), Some(vec![hop(0, 0, 20), hop(1, 20, 30)]));
        // Nothing but [0,20) serves layer 0; nothing serves layer 30 of a 31-layer model.
        assert_eq!(plan(30, &[cand(10, 30, 1.0, 0.0), cand(16, 30, 1.0, 0.0)]), None);
        assert_eq!(plan(31, &[cand(0, 20, 1.0, 0.0), cand(10, 30, 1.0, 0.0)]), None);
    }

    #[test]
    fn never_reuses_a_worker() {
        // X everywhere, Y very cheap in the middle: X, Y, X would cost 21.3, but X may serve one hop.
        let x = cand(0, 30, 1.0, 0.1);
        let y = cand(10, 20, 0.1, 0.1);
        assert_eq!(plan(30, &[x, y]), Some(vec![hop(0, 0, 30)]));
        // With Z for the tail, X, Y, Z (23.3) beats W, Y, X (24.3) and X alone (30.1).
        let (z, w) = (cand(20, 30, 1.2, 0.1), cand(0, 10, 1.3, 0.1));
        assert_eq!(plan(30, &[x, y, z, w]), Some(vec![hop(0, 0, 10), hop(1, 10, 20), hop(2, 20, 30)]));
        // Free hops too: a zero fixed cost must not split X into back-to-back hops.
        assert_eq!(plan(30, &[cand(0, 30, 1.0, 0.0)]), Some(vec![hop(0, 0, 30)]));
    }

    #[test]
    fn ties_go_to_the_lowest_index() {
        let c = cand(0, 8, 1.0, 1.0);
        assert_eq!(plan(8, &[c, c, c]), Some(vec![hop(0, 0, 8)]));
        assert_eq!(plan(8, &[cand(0, 8, 2.0, 0.0), c, c]), Some(vec![hop(1, 0, 8)]));
        // Enough of them to drop the dominated ones first.
        assert_eq!(plan(2, &[cand(0, 2, 1.0, 1.0); 5]), Some(vec![hop(0, 0, 2)]));
    }

    #[test]
    fn ignores_garbage() {
        let bad = [
            cand(5, 5, 1.0, 1.0),
            cand(6, 2, 1.0, 1.0),
            cand(0, 9, 1.0, 1.0),
            cand(0, 8, f64::NAN, 0.0),
            cand(0, 8, 0.0, f64::INFINITY),
            cand(0, 8, -1.0, 0.0),
            cand(0, 8, 0.0, -1.0),
            cand(u32::MAX, u32::MAX, 0.0, 0.0),
        ];
        assert_eq!(plan(8, &bad), None);
        let mut with_good = bad.to_vec();
        with_good.push(cand(0, 8, 5.0, 5.0));
        assert_eq!(plan(8, &with_good), Some(vec![hop(bad.len(), 0, 8)]));
    }

    #[test]
    fn empty_inputs() {
        assert_eq!(plan(8, &[]), None);
        assert_eq!(plan(0, &[]), Some(vec![]));
        // Rejected before any scratch the size of the claimed model is made.
        assert_eq!(plan(u32::MAX, &[cand(0, 8, 1.0, 1.0)]), None);
    }
}

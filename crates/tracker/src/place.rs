//! Where a new worker adds most: of the model's windows of as many layers as it holds, the one
//! that leaves the swarm's capacity per layer the most even, judged from the thinnest layer up.
//!
//! A layer's capacity is the sum of the rates of the workers holding it, a worker's rate the
//! steps a second it computes its whole range at (its measured time per layer times its layer
//! count). A route is as fast as its slowest stage and a layer nobody holds stops every route,
//! so windows compare by their layers' capacities after the new worker is added, sorted from
//! the least (leximin): an uncovered layer is covered first, then the thinnest capacity raised.
//! Equal windows go to the lowest start, so an empty swarm is tiled from layer 0 upward.

/// A range of layers held, and its holder's rate.
#[derive(Clone, Copy, Debug)]
pub struct Held {
    pub start: u32,
    pub end: u32,
    pub rate: f64,
}

/// What a placement weighs: the model's `n` layers, the `k` the new worker holds, the ranges held
/// already, and the new worker's rate.
pub struct Placement {
    pub n: u32,
    pub k: u32,
    pub held: Vec<Held>,
    pub rate: f64,
}

impl Placement {
    /// The new worker's range (`best_window`), as held at its rate.
    pub fn best(&self) -> Held {
        let (start, end) = best_window(self.n, self.k, &self.held, self.rate);
        Held { start, end, rate: self.rate }
    }
}

/// The rate of a worker holding `layers` layers at `step_us_per_layer` each: steps a second.
pub fn rate(step_us_per_layer: f64, layers: u32) -> f64 {
    1e6 / (step_us_per_layer.max(1.0) * f64::from(layers.max(1)))
}

/// The window of `k` of the `n` layers (`k` ≤ `n` ≤ `dgr_proto::MAX_PLACE_LAYERS`) where a
/// worker of `rate` leaves the capacities most even, as the module says.
pub fn best_window(n: u32, k: u32, held: &[Held], rate: f64) -> (u32, u32) {
    let k = k.clamp(1, n.max(1));
    let mut capacity = vec![0.0f64; n as usize];
    for h in held {
        for c in &mut capacity[h.start.min(n) as usize..h.end.min(n) as usize] {
            *c += h.rate;
        }
    }
    let mut best: Option<(Vec<f64>, u32)> = None;
    for start in 0..=n - k {
        let mut after = capacity.clone();
        for c in &mut after[start as usize..(start + k) as usize] {
            *c += rate;
        }
        after.sort_by(f64::total_cmp);
        // Strictly better only, so ties keep the lower start.
        if best.as_ref().is_none_or(|(b, _)| leximin_better(&after, b)) {
            best = Some((after, start));
        }
    }
    let start = best.map_or(0, |(_, s)| s);
    (start, start + k)
}

/// Whether sorted capacities `a` beat `b`: larger at the first place they differ.
fn leximin_better(a: &[f64], b: &[f64]) -> bool {
    a.iter().zip(b).find(|(x, y)| x != y).is_some_and(|(x, y)| x > y)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(start: u32, end: u32, step_us: f64) -> Held {
        Held { start, end, rate: rate(step_us, end - start) }
    }

    #[test]
    fn an_empty_swarm_is_tiled_from_layer_zero_and_its_gaps_are_filled_first() {
        let r = rate(100.0, 12);
        assert_eq!(best_window(30, 12, &[], r), (0, 12));
        assert_eq!(best_window(30, 12, &[held(0, 12, 100.0)], r), (12, 24));
        // Only 18..30 covers what is left, though it overlaps the second worker.
        assert_eq!(best_window(30, 12, &[held(0, 12, 100.0), held(12, 24, 100.0)], r), (18, 30));
        // A gap in the middle is covered, whatever the ends hold.
        assert_eq!(best_window(30, 6, &[held(0, 10, 100.0), held(16, 30, 100.0)], rate(100.0, 6)), (10, 16));
        // A worker that can hold the model holds all of it; one that can hold more, too.
        assert_eq!(best_window(30, 30, &[held(0, 12, 100.0)], rate(100.0, 30)), (0, 30));
        assert_eq!(best_window(30, 40, &[], rate(100.0, 30)), (0, 30));
    }

    #[test]
    fn on_a_covered_model_the_thinnest_layers_get_the_new_worker() {
        // Two halves, the second computed four times slower: the new worker doubles it up.
        let swarm = [held(0, 15, 100.0), held(15, 30, 400.0)];
        assert_eq!(best_window(30, 15, &swarm, rate(100.0, 15)), (15, 30));
        // Three stages, the middle one the slow one: a window of 10 goes exactly on it.
        let swarm = [held(0, 10, 100.0), held(10, 20, 300.0), held(20, 30, 100.0)];
        assert_eq!(best_window(30, 10, &swarm, rate(100.0, 10)), (10, 20));
        // A replica of the whole model already: a half goes on the slower half.
        let swarm = [held(0, 30, 100.0), held(0, 15, 100.0), held(15, 30, 150.0)];
        assert_eq!(best_window(30, 15, &swarm, rate(100.0, 15)), (15, 30));
    }
}

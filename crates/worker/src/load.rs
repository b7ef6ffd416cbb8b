//! How busy the stage is: the share of recent time it spent computing. A ring's first stage
//! reads it to tell whether draft rows are cheap (`ring`): on a stage busy with other sessions'
//! steps, a rejected draft's row delays them.

use std::time::{Duration, Instant};

/// Compute time over `WINDOW`, decayed exponentially since the last step.
#[derive(Debug, Default)]
pub struct Load {
    busy: f64,
    at: Option<Instant>,
}

/// The time constant: some cycles of a route over slow links.
const WINDOW: f64 = 0.25;

impl Load {
    /// A step that ended at `now` after computing for `took`.
    pub fn step(&mut self, took: Duration, now: Instant) {
        self.busy = self.share(now) + took.as_secs_f64() / WINDOW;
        self.at = Some(now);
    }

    /// The share of recent time the stage computed (1: always busy).
    pub fn share(&self, now: Instant) -> f64 {
        self.at.map_or(0.0, |at| self.busy * (-now.saturating_duration_since(at).as_secs_f64() / WINDOW).exp())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_is_the_busy_part_of_recent_time() {
        let (mut l, t0) = (Load::default(), Instant::now());
        assert_eq!(l.share(t0), 0.0);
        let ms = Duration::from_millis;
        let at = |i: u64| t0 + ms(10 * i);
        // 2 ms of compute every 10 ms, then 9 ms of every 10, for a few windows each.
        (1..=200).for_each(|i| l.step(ms(2), at(i)));
        assert!((l.share(at(200)) - 0.2).abs() < 0.02, "{}", l.share(at(200)));
        (201..=400).for_each(|i| l.step(ms(9), at(i)));
        assert!((l.share(at(400)) - 0.9).abs() < 0.05, "{}", l.share(at(400)));
        // Idle for a second: it decays.
        assert!(l.share(at(500)) < 0.02);
    }
}

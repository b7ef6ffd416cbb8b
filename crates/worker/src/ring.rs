//! A ring session's two ends (`dgr_proto::Ring`). The last stage sends each step's last token
//! straight to the first stage instead of waiting for the driver to send it back; the first
//! stage, which sees every token, drafts the next step itself. Both ends decide what the
//! driver would have: the same drafts, and no step past the session's positions or a stop
//! token — so the tokens are the driver-driven ones, bit for bit.

use crate::scheduler::Outbox;
use dgr_proto::{Drafter, Forward, Ring, Sampled};
use std::time::Instant;

/// The last stage's end: where the step's last token goes.
pub(crate) struct RingOut {
    /// The first stage's connection; None when this stage is the first too.
    pub to: Option<Outbox>,
    stop: Vec<u32>,
    /// The session's positions: a token there would take a position past them.
    end: u64,
}

impl RingOut {
    pub fn new(r: &Ring, to: Option<Outbox>, end: u64) -> RingOut {
        RingOut { to, stop: r.stop.clone(), end }
    }

    /// The frame that starts the next step after a step gave `tokens` (in position order) and
    /// its stages computed for `compute_us` in all, or None when the generation ends with them.
    pub fn next(&self, session_id: &[u8], tokens: &[Sampled], step_compute_us: u64) -> Option<Forward> {
        let last = tokens.last()?;
        if last.position + 1 >= self.end || tokens.iter().any(|t| self.stop.contains(&t.token)) {
            return None;
        }
        let (position, tokens) = (last.position, vec![last.token]);
        Some(Forward { session_id: session_id.to_vec(), position, tokens, ring: true, sample: true, step_compute_us, ..Default::default() })
    }
}

/// The first stage's end: the session's tokens so far, and its drafting.
pub(crate) struct RingIn {
    drafter: Option<Drafter>,
    /// The prompt and every token generated so far.
    tokens: Vec<u32>,
    /// The last step's drafts and the position of the first.
    drafted: Option<(usize, Vec<u32>)>,
    end: usize,
    /// When the last ring token arrived: the time between two is the ring's cycle.
    arrived: Option<Instant>,
}

/// A step whose stages computed for less than this part of the ring's cycle waited on its links
/// for the rest: draft rows cost it almost nothing, so drafting does not pause after misses —
/// unless the first stage is busy for as large a part of its time with other sessions' steps,
/// which its drafts' rows would then delay.
const CHEAP_ROWS: u32 = 4;

impl RingIn {
    pub fn new(r: &Ring, end: u64) -> RingIn {
        RingIn { drafter: Drafter::new(r.speculate as usize), tokens: r.prompt.clone(), drafted: None, end: end as usize, arrived: None }
    }

    /// Turns the last stage's token `f`, arrived `at`, into the next step: the token and its
    /// drafts. The token's position says how many of the last step's drafts were accepted.
    /// `load`: the share of recent time this stage computed.
    pub fn step(&mut self, f: &mut Forward, at: Instant, load: f64) -> Result<(), String> {
        let p = f.position as usize;
        if f.tokens.len() != 1 || !f.draft.is_empty() || !f.hidden.is_empty() {
            return Err("a ring's frame holds one token and nothing else".into());
        }
        let cycle = self.arrived.replace(at).map(|t| at.saturating_duration_since(t));
        let cheap = load * (CHEAP_ROWS as f64) < 1.0
            && cycle.is_some_and(|c| f.step_compute_us.saturating_mul(CHEAP_ROWS as u64) < c.as_micros() as u64);
        if let Some((start, draft)) = self.drafted.take() {
            let accepted = p.checked_sub(start).filter(|&a| a <= draft.len());
            let accepted =
                accepted.ok_or_else(|| format!("a ring token at position {p} after drafts at {start}..{}", start + draft.len()))?;
            self.tokens.truncate(start);
            self.tokens.extend_from_slice(&draft[..accepted]);
            if let Some(d) = self.drafter.as_mut() {
                d.verified(draft.len(), accepted, cheap);
            }
        }
        if self.tokens.len() != p || p + 1 >= self.end {
            return Err(format!("a ring token at position {p} after {} tokens of {}", self.tokens.len(), self.end));
        }
        self.tokens.push(f.tokens[0]);
        // Drafts leave room for the token the step gives after them.
        let room = self.end - p - 2;
        let draft = self.drafter.as_mut().map_or_else(Vec::new, |d| d.propose(&self.tokens, room));
        f.tokens.extend_from_slice(&draft);
        if !draft.is_empty() {
            self.drafted = Some((p + 1, draft.clone()));
        }
        f.draft = draft;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(position: u64, token: u32) -> Sampled {
        Sampled { position, token, ..Default::default() }
    }

    #[test]
    fn the_last_stage_stops_at_the_positions_and_the_stop_tokens() {
        let out = RingOut::new(&Ring { stop: vec![2], ..Default::default() }, None, 10);
        let f = out.next(&[1; 16], &[token(5, 7), token(6, 8)], 0).unwrap();
        assert_eq!((f.position, f.tokens, f.ring, f.sample), (6, vec![8], true, true));
        assert!(out.next(&[1; 16], &[token(9, 7)], 0).is_none(), "the session's last position");
        assert!(out.next(&[1; 16], &[token(8, 7)], 0).is_some());
        assert!(out.next(&[1; 16], &[token(5, 2), token(6, 8)], 0).is_none(), "a stop token among the step's");
    }

    #[test]
    fn the_first_stage_drafts_from_the_prompt_and_learns_what_was_accepted() {
        let prompt = vec![1, 2, 3, 4, 1, 2];
        let mut ring = RingIn::new(&Ring { speculate: 4, prompt: prompt.clone(), ..Default::default() }, 20);
        let mut f = Forward { position: 6, tokens: vec![3], ring: true, sample: true, ..Default::default() };
        ring.step(&mut f, Instant::now(), 0.0).unwrap();
        // "1 2 3" occurred at the start: 4 1 2 3 followed it.
        assert_eq!((f.tokens.clone(), f.draft.clone()), (vec![3, 4, 1, 2, 3], vec![4, 1, 2, 3]));
        // Two drafts accepted: the next token is at 6 + 1 + 2.
        let mut f = Forward { position: 9, tokens: vec![9], ring: true, sample: true, ..Default::default() };
        ring.step(&mut f, Instant::now(), 0.0).unwrap();
        assert_eq!(ring.tokens, [1, 2, 3, 4, 1, 2, 3, 4, 1, 9]);
        // A position the drafts cannot explain, or a frame with more than its token.
        for bad in [
            Forward { position: 16, tokens: vec![1], ..Default::default() },
            Forward { position: 10, tokens: vec![1, 2], ..Default::default() },
        ] {
            let mut again = RingIn::new(&Ring { speculate: 4, prompt: prompt.clone(), ..Default::default() }, 20);
            again.drafted = Some((7, vec![4, 1, 2]));
            again.tokens.push(3);
            assert!(again.step(&mut bad.clone(), Instant::now(), 0.0).is_err(), "{bad:?}");
        }
        // No drafts past the room the positions leave.
        let mut short = RingIn::new(&Ring { speculate: 4, prompt: prompt.clone(), ..Default::default() }, 9);
        let mut f = Forward { position: 6, tokens: vec![3], ..Default::default() };
        short.step(&mut f, Instant::now(), 0.0).unwrap();
        assert_eq!(f.draft, [4]);
    }

    #[test]
    fn a_miss_pauses_drafting_only_where_the_route_waits_on_its_compute() {
        let ring = Ring { speculate: 4, prompt: vec![1, 2, 3, 4, 1, 2], ..Default::default() };
        let t0 = Instant::now();
        let cycle = std::time::Duration::from_millis(100);
        // After a step of 4 drafts that accepted none, the next step's drafts, when the step
        // computed for `compute_us` of the 100 ms between two ring tokens, the first stage busy for
        // `load` of its time.
        let after_a_miss = |compute_us: u64, load: f64| {
            let mut r = RingIn::new(&ring, 32);
            r.step(&mut Forward { position: 6, tokens: vec![3], ..Default::default() }, t0, load).unwrap();
            let mut f = Forward { position: 7, tokens: vec![1], step_compute_us: compute_us, ..Default::default() };
            r.step(&mut f, t0 + cycle, load).unwrap();
            f.draft
        };
        assert_eq!(after_a_miss(1_000, 0.05), [2], "1 ms of 100: drafting goes on (one draft: the miss's allowance)");
        assert!(after_a_miss(90_000, 0.05).is_empty(), "90 ms of 100: drafting pauses");
        assert!(after_a_miss(1_000, 0.6).is_empty(), "the stage busy with other sessions: drafting pauses");
    }
}

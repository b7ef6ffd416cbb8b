//! Speculative decoding's drafts: tokens guessed from the session's own text (prompt lookup),
//! which the route verifies in one step. A guess changes no token — the last stage keeps only
//! the drafts it samples itself — so the drafter is free to be wrong; it only costs rows. A
//! ring's first stage drafts (it sees every token); the rules live here so any part may.

use crate::MAX_DRAFT;

/// The longest n-gram tried first; shorter ones down to one token follow.
const NGRAM: usize = 3;

/// The tokens that followed the most recent earlier occurrence of the sequence's last `n`
/// tokens, for the largest `n` from `NGRAM` down to 1 that occurs, at most `max` of them.
pub fn propose(tokens: &[u32], max: usize) -> Vec<u32> {
    let len = tokens.len();
    if max == 0 {
        return Vec::new();
    }
    for n in (1..=NGRAM.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Earlier starts only, the latest first: the text's most recent pattern.
        if let Some(j) = (0..len - n).rev().find(|&j| &tokens[j..j + n] == suffix) {
            return tokens[j + n..(j + n + max).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// One session's drafting: how many drafts to send next, adapted to how many were accepted.
/// A step whose drafts were all accepted doubles the next step's allowance (up to the
/// maximum); one with a rejection sets it to what was accepted plus one; and after a step that
/// accepted none, the session drafts nothing for 1, 2, 4 … (at most `MAX_PAUSE`) steps, so text
/// that does not repeat costs few rows — unless rows are cheap (the route's steps wait on slow
/// links far longer than they compute), when a miss costs nothing worth saving.
#[derive(Debug)]
pub struct Drafter {
    max: usize,
    next: usize,
    /// Steps in a row whose drafts were all rejected, and steps left to draft nothing.
    misses: u32,
    pause: usize,
}

/// The most steps a session goes without drafting after rejections.
const MAX_PAUSE: usize = 16;

impl Drafter {
    /// A drafter of at most `max` drafts a step (at most `MAX_DRAFT`); None for 0.
    pub fn new(max: usize) -> Option<Drafter> {
        let max = max.min(MAX_DRAFT);
        (max > 0).then_some(Drafter { max, next: max, misses: 0, pause: 0 })
    }

    /// Drafts to follow `tokens` (the prompt and the tokens so far), at most `room`.
    pub fn propose(&mut self, tokens: &[u32], room: usize) -> Vec<u32> {
        if self.pause > 0 {
            self.pause -= 1;
            return Vec::new();
        }
        propose(tokens, self.next.min(room))
    }

    /// A step with `drafted` drafts of which `accepted` were; `cheap`: its rows cost the route
    /// little next to its wait.
    pub fn verified(&mut self, drafted: usize, accepted: usize, cheap: bool) {
        if drafted == 0 {
            return;
        }
        self.next = if accepted == drafted { (2 * self.next).min(self.max) } else { (accepted + 1).min(self.max) };
        if accepted == 0 && !cheap {
            self.pause = (1usize << self.misses.min(8)).min(MAX_PAUSE);
            self.misses += 1;
        } else {
            self.misses = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_follow_the_latest_longest_match() {
        // "1 2 3 4 5 | 9 2 3 7 | 1 2 3": the trigram 1 2 3 occurred at the start, followed by 4 5 9.
        let t = [1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3];
        assert_eq!(propose(&t, 3), [4, 5, 9]);
        assert_eq!(propose(&t, 1), [4]);
        assert_eq!(propose(&t, 0), Vec::<u32>::new());
        // No earlier "8 2 3" nor "8"... but "2 3" occurred latest before 7.
        assert_eq!(propose(&[1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3], 2), [7, 8]);
        // Only a unigram: the latest earlier 5, then what followed up to the end.
        assert_eq!(propose(&[5, 1, 5, 2, 6, 5], 8), [2, 6, 5]);
        // Nothing repeats, or too little text.
        assert!(propose(&[1, 2, 3, 4], 4).is_empty() && propose(&[7], 4).is_empty() && propose(&[], 4).is_empty());
        // A repeating run proposes its own continuation.
        assert_eq!(propose(&[4, 4, 4, 4], 5), [4]);
        assert_eq!(propose(&[1, 2, 1, 2, 1, 2], 4), [1, 2]);
    }

    #[test]
    fn the_allowance_grows_with_acceptance_and_shrinks_with_rejection() {
        let mut d = Drafter::new(8).unwrap();
        let t: Vec<u32> = (0..20).chain(0..20).collect();
        assert_eq!(d.propose(&t[..25], 100).len(), 8);
        assert_eq!(d.propose(&t[..25], 3).len(), 3, "no more than the room left");
        d.verified(8, 2, false);
        assert_eq!(d.propose(&t[..25], 100).len(), 3);
        d.verified(3, 3, false);
        d.verified(6, 6, false);
        assert_eq!(d.propose(&t[..25], 100).len(), 8, "doubled up to the maximum");
        d.verified(8, 0, false);
        // A step that accepted nothing pauses drafting for one step, the next such for two.
        assert!(d.propose(&t[..25], 100).is_empty());
        assert_eq!(d.propose(&t[..25], 100).len(), 1);
        d.verified(1, 0, false);
        assert!(d.propose(&t[..25], 100).is_empty() && d.propose(&t[..25], 100).is_empty());
        assert_eq!(d.propose(&t[..25], 100).len(), 1);
        d.verified(1, 1, false);
        assert_eq!(d.propose(&t[..25], 100).len(), 2, "an accepted draft ends the pauses");
        // Where rows are cheap a miss shrinks the allowance but pauses nothing.
        d.verified(2, 0, true);
        assert_eq!(d.propose(&t[..25], 100).len(), 1);
        assert!(Drafter::new(0).is_none());
        assert_eq!(Drafter::new(MAX_DRAFT + 5).unwrap().max, MAX_DRAFT);
    }
}

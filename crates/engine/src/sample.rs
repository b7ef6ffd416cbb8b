//! Token choice and log-probabilities from a row of logits.
//!
//! Randomness is a pure function of (seed, position), so a session replayed on another route,
//! or batched with other sessions, draws the same tokens.

/// How the next token is chosen. `temperature <= 0` is greedy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches top_p; 1 keeps all.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 }
    }
}

/// A uniform draw in [0, 1) from (seed, position): SplitMix64 of the pair.
fn uniform(seed: u64, position: u64) -> f64 {
    let mut z = seed ^ position.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(0x632B_E59B_D9B4_E019);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The first index of the largest logit (NaN never wins; a row with no number at all gives
/// its last index). The largest value first, then where it is: two loops the compiler
/// vectorizes, where one that kept the best index walked the vocabulary one compare at a time.
pub fn argmax(logits: &[f32]) -> u32 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    logits.iter().position(|&l| l == max).unwrap_or(logits.len().saturating_sub(1)) as u32
}

/// Chooses the token at `position` (the position the chosen token will occupy).
pub fn sample(logits: &[f32], p: &SamplingParams, position: u64) -> u32 {
    if p.temperature <= 0.0 || logits.is_empty() {
        return argmax(logits);
    }
    let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (i as u32, l)).collect();
    if cand.is_empty() {
        return argmax(logits);
    }
    // Most likely first, ties by lower id: a total order, so the k best found without sorting
    // the whole vocabulary, then sorted, are the k a full sort puts first.
    let rank = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if p.top_k > 0 && p.top_k < cand.len() {
        cand.select_nth_unstable_by(p.top_k - 1, rank);
        cand.truncate(p.top_k);
    }
    cand.sort_by(rank);
    let max = cand[0].1 as f64;
    let t = p.temperature as f64;
    let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 as f64 - max) / t).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|q| *q /= total);
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let keep = probs.iter().position(|q| {
            acc += q;
            acc >= p.top_p as f64
        });
        let keep = keep.map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
    }
    let u = uniform(p.seed, position);
    let mut acc = 0.0;
    for (i, q) in probs.iter().enumerate() {
        acc += q;
        if u < acc {
            return cand[i].0;
        }
    }
    cand[probs.len() - 1].0
}

/// The accept rule of a speculative step. `logits` holds `vocab` logits for each of the step's
/// rows: row 0 after the last token already accepted, row r after `drafts[r - 1]`; the token
/// sampled from row r takes position `position + r`. Each row is sampled exactly as a step of its
/// own would be (the draw is a function of (seed, position) alone), and the step keeps those
/// tokens up to and including the first that differs from its draft: the accepted drafts and
/// one more, exactly the tokens one-at-a-time decoding would have produced. Rows past the first
/// rejected draft are not sampled (their logits saw a token that is not the sequence's).
pub fn accept(logits: &[f32], vocab: usize, drafts: &[u32], p: &SamplingParams, position: u64) -> Vec<u32> {
    let mut out = Vec::new();
    for (r, row) in logits.chunks_exact(vocab.max(1)).enumerate() {
        let token = sample(row, p, position + r as u64);
        out.push(token);
        if drafts.get(r) != Some(&token) {
            break;
        }
    }
    out
}

/// Why a mask of allowed tokens cannot constrain a row.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MaskError {
    #[error("the allowed-token mask is {got} bytes; this vocabulary of {vocab} takes at most {max}")]
    TooLong { got: usize, vocab: usize, max: usize },
    #[error("the allowed-token mask allows no token of the vocabulary")]
    Empty,
}

/// Keeps only the tokens `allowed` has a bit for (bit `i % 8` of byte `i / 8`; ids past the
/// mask are excluded), setting the others' logits to −∞ — a grammar's constraint, applied before
/// sampling and log-probabilities so both see the constrained distribution. An empty mask allows
/// every token.
pub fn mask_logits(logits: &mut [f32], allowed: &[u8]) -> Result<(), MaskError> {
    if allowed.is_empty() {
        return Ok(());
    }
    let max = logits.len().div_ceil(8);
    if allowed.len() > max {
        return Err(MaskError::TooLong { got: allowed.len(), vocab: logits.len(), max });
    }
    let is_allowed = |i: usize| allowed.get(i / 8).is_some_and(|b| b >> (i % 8) & 1 == 1);
    if !(0..logits.len()).any(is_allowed) {
        return Err(MaskError::Empty);
    }
    for (i, l) in logits.iter_mut().enumerate() {
        if !is_allowed(i) {
            *l = f32::NEG_INFINITY;
        }
    }
    Ok(())
}

/// Natural-log softmax over the whole row, computed in f64: (logprob of `token`, top `k` as
/// (id, logprob), most likely first, ties by lower id).
pub fn logprobs(logits: &[f32], token: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l)) as f64;
    let lse = crate::softmax::log_sum_exp(logits, max);
    let lp = |i: usize| (logits[i] as f64 - lse) as f32;
    let mut top: Vec<u32> = Vec::with_capacity(k + 1);
    if k > 0 {
        for i in 0..logits.len() as u32 {
            let better = |a: u32, b: u32| logits[a as usize] > logits[b as usize] || (logits[a as usize] == logits[b as usize] && a < b);
            if top.len() < k || better(i, top[top.len() - 1]) {
                let at = top.iter().position(|&j| better(i, j)).unwrap_or(top.len());
                top.insert(at, i);
                top.truncate(k);
            }
        }
    }
    let token_lp = logits.get(token as usize).map_or(f32::NEG_INFINITY, |_| lp(token as usize));
    (token_lp, top.into_iter().map(|i| (i, lp(i as usize))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(sample(&[1.0, 3.0, 3.0, -1.0], &SamplingParams::default(), 0), 1);
        let nan = f32::NAN;
        let inf = f32::NEG_INFINITY;
        for (row, best) in [
            (vec![], 0),
            (vec![nan, nan, nan], 2),
            (vec![nan, 1.0, nan, 2.0, 2.0], 3),
            (vec![nan, inf, inf], 1),
            (vec![inf, nan], 0),
            (vec![-0.0, 0.0], 0),
        ] {
            assert_eq!(argmax(&row), best, "{row:?}");
        }
    }

    #[test]
    fn the_k_best_are_those_a_full_sort_puts_first() {
        let logits: Vec<f32> = (0..5000).map(|i| ((i * 31 % 97) as f32 * 0.05).cos()).collect();
        for top_k in [1, 2, 40, 4999, 5000, 6000] {
            let p = SamplingParams { temperature: 0.7, top_k, top_p: 0.9, seed: 11 };
            let all = SamplingParams { top_k: 0, ..p };
            // The same draws as the full sort's k best: the k best of a sorted copy, kept by mask.
            let mut sorted: Vec<u32> = (0..logits.len() as u32).collect();
            sorted.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
            let mut masked = vec![f32::NEG_INFINITY; logits.len()];
            for &i in sorted.iter().take(top_k) {
                masked[i as usize] = logits[i as usize];
            }
            for pos in 0..30 {
                assert_eq!(sample(&logits, &p, pos), sample(&masked, &all, pos), "top_k {top_k}, position {pos}");
            }
        }
    }

    #[test]
    fn sampling_is_a_function_of_seed_and_position() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = SamplingParams { temperature: 0.9, top_k: 40, top_p: 0.95, seed: 42 };
        let a: Vec<u32> = (0..50).map(|pos| sample(&logits, &p, pos)).collect();
        let b: Vec<u32> = (0..50).map(|pos| sample(&logits, &p, pos)).collect();
        assert_eq!(a, b);
        let other = SamplingParams { seed: 43, ..p };
        assert_ne!(a, (0..50).map(|pos| sample(&logits, &other, pos)).collect::<Vec<_>>());
    }

    #[test]
    fn accepted_tokens_are_those_one_at_a_time_sampling_draws() {
        // Five rows of a vocabulary of 50; the sequence one-at-a-time decoding draws from them.
        let vocab = 50;
        let logits: Vec<f32> = (0..5 * vocab).map(|i| ((i * 7919 % 97) as f32 * 0.11).sin() * 3.0).collect();
        for p in [SamplingParams::default(), SamplingParams { temperature: 0.8, top_k: 20, top_p: 0.9, seed: 5 }] {
            let truth: Vec<u32> = (0..5).map(|r| sample(&logits[r * vocab..(r + 1) * vocab], &p, 10 + r as u64)).collect();
            // Every draft right: all five rows' tokens (four drafts and the one after).
            assert_eq!(accept(&logits, vocab, &truth[..4], &p, 10), truth);
            for wrong in 0..4 {
                let mut drafts = truth[..4].to_vec();
                drafts[wrong] = (drafts[wrong] + 1) % vocab as u32;
                // Up to the first wrong draft, and the token sampled in its place.
                assert_eq!(accept(&logits, vocab, &drafts, &p, 10), truth[..=wrong], "{p:?}, draft {wrong} wrong");
            }
            assert_eq!(accept(&logits[..vocab], vocab, &[], &p, 10), truth[..1], "no drafts: one step");
        }
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = [0.1f32, 2.0, 0.5];
        let p = SamplingParams { temperature: 1.5, top_k: 1, top_p: 1.0, seed: 7 };
        assert!((0..20).all(|pos| sample(&logits, &p, pos) == 1));
    }

    #[test]
    fn a_mask_keeps_only_its_tokens() {
        let mut logits = [5.0f32, 1.0, 3.0, 4.0, 0.5, 0.0, 0.0, 0.0, 9.0];
        // Tokens 2 and 4 of nine (token 8, the best, is past the one-byte mask).
        mask_logits(&mut logits, &[0b0001_0100]).unwrap();
        assert_eq!(sample(&logits, &SamplingParams::default(), 0), 2);
        let p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 3 };
        assert!((0..50).map(|pos| sample(&logits, &p, pos)).all(|t| t == 2 || t == 4));
        let (lp, top) = logprobs(&logits, 2, 3);
        assert!((top[0].1.exp() + top[1].1.exp() - 1.0).abs() < 1e-6 && lp == top[0].1, "{top:?}");
        assert_eq!(mask_logits(&mut [0.0; 9], &[0, 0]), Err(MaskError::Empty));
        assert_eq!(mask_logits(&mut [0.0; 9], &[1, 1, 1]), Err(MaskError::TooLong { got: 3, vocab: 9, max: 2 }));
        let mut all = [1.0f32, 2.0];
        mask_logits(&mut all, &[]).unwrap();
        assert_eq!(all, [1.0, 2.0]);
    }

    #[test]
    fn logprobs_normalise_and_rank() {
        let logits = [0.0f32, 1.0, 1.0, -2.0];
        let (lp, top) = logprobs(&logits, 3, 3);
        let total: f64 = logits.iter().map(|&l| ((l as f64) - 1.0).exp()).sum::<f64>();
        assert!((lp as f64 - (-3.0 - total.ln())).abs() < 1e-6);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2, 0]);
    }
}

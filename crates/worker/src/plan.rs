//! Planning one scheduler step: which rows of which sessions run, in which batches.
//!
//! Decode rows come first (every session that waits for its next token, oldest first); then
//! chunks of waiting prompts, each capped so that a long prompt cannot stall decoding (and, while
//! nothing decodes, sharing one chunk), while the step's token budget lasts. Sessions are grouped into one batch per compatibility key.

use crate::compat::{CompatKey, Phase};
use dgr_proto::SessionId;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct Policy {
    /// Rows one step may compute in all.
    pub step_tokens: usize,
    /// The largest prompt chunk when no session is decoding ...
    pub prefill_chunk: usize,
    /// ... and the compute time one chunk aims at: as a long prompt's attention grows, its chunks
    /// shrink, so its progress reaches the driver (restarting the step deadline) this often.
    pub chunk_time: std::time::Duration,
    /// The largest prompt chunk in a step that also decodes ...
    pub busy_chunk: usize,
    /// ... except that a prompt of at most this many rows runs whole: a short prompt's first
    /// token comes in one step (as llama.cpp's server does), while a long one cannot stall
    /// decoding (vLLM's long-prefill threshold).
    pub whole_prompt: usize,
    /// Decode sessions are spread over this many consecutive steps, so that on a multi-stage
    /// route the next stage computes one micro-batch while this one computes the next.
    pub micro_batches: usize,
    /// How long a step may wait for more of the decoding sessions to arrive, so that sessions
    /// driven independently still meet in one batch instead of trickling in one by one.
    pub batch_wait: std::time::Duration,
}

impl Policy {
    /// Decode rows one step aims at when `decoding` sessions are past their prompts.
    pub fn decode_target(&self, decoding: usize) -> usize {
        decoding.div_ceil(self.micro_batches.max(1)).max(1)
    }

    /// The rows of a prompt chunk that fit `chunk_time` when the session's last chunk took
    /// `row_time` a row (None before its first: `prefill_chunk` alone caps it).
    pub fn fit(&self, row_time: Option<std::time::Duration>) -> usize {
        match row_time {
            Some(t) if !t.is_zero() => (self.chunk_time.as_secs_f64() / t.as_secs_f64()).max(1.0) as usize,
            _ => usize::MAX,
        }
    }
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            step_tokens: 8192,
            prefill_chunk: 512,
            chunk_time: std::time::Duration::from_secs(1),
            busy_chunk: 4,
            whole_prompt: 256,
            micro_batches: 1,
            batch_wait: std::time::Duration::from_millis(2),
        }
    }
}

/// A session with rows waiting.
#[derive(Clone, Debug)]
pub struct Ready {
    pub id: SessionId,
    pub key: CompatKey,
    /// Rows of the waiting frame in all, and those not yet run.
    pub rows: usize,
    pub rows_left: usize,
    /// The most rows of a prompt's next chunk that fit `chunk_time` at the session's last rate.
    pub fit: usize,
    pub since: Instant,
}

/// One forward: sessions with equal keys, and how many of their waiting rows each runs.
#[derive(Debug)]
pub struct Batch {
    pub key: CompatKey,
    pub items: Vec<(SessionId, usize)>,
}

/// Plans a step over the sessions with rows waiting; `decoding` counts every session past its
/// prompt, waiting or not (it sets the micro-batch size).
pub fn plan(mut ready: Vec<Ready>, decoding: usize, p: &Policy) -> Vec<Batch> {
    ready.sort_by_key(|r| r.since);
    let (decode, prefill): (Vec<Ready>, Vec<Ready>) = ready.into_iter().partition(|r| r.key.phase == Phase::Decode);
    let mut budget = p.step_tokens.max(1);
    let mut take: Vec<(Ready, usize)> = Vec::new();
    let per_step = p.decode_target(decoding.max(decode.len()));
    // A decode frame runs whole: one token, or a speculative step's token and drafts (which the
    // last stage samples together).
    for r in decode.into_iter().take(per_step) {
        if budget == 0 {
            break;
        }
        budget = budget.saturating_sub(r.rows_left);
        let n = r.rows_left;
        take.push((r, n));
    }
    let busy = !take.is_empty();
    // With nothing decoding, the prompts waiting share one chunk (oldest first), so that the step
    // still takes about `chunk_time` however many arrived together and each one's progress
    // reaches its driver before the step deadline; every prompt past that chunk runs
    // `busy_chunk` rows, so it progresses too.
    // `fit` is the rows of `chunk_time` at each one's rate, so a chunk of n takes n / fit of it.
    let (mut shared_rows, mut shared_time) = (p.prefill_chunk, 1.0f64);
    for r in prefill {
        let chunk = match (busy, r.rows <= p.whole_prompt) {
            (false, _) => shared_rows.min((shared_time * r.fit as f64) as usize).max(p.busy_chunk),
            (true, true) => r.rows,
            (true, false) => p.busy_chunk,
        };
        let n = r.rows_left.min(chunk.max(1)).min(budget);
        if n == 0 {
            break;
        }
        budget -= n;
        shared_rows = shared_rows.saturating_sub(n);
        shared_time = (shared_time - n as f64 / r.fit as f64).max(0.0);
        take.push((r, n));
    }
    let mut batches: Vec<Batch> = Vec::new();
    for (r, n) in take {
        match batches.iter_mut().find(|b| b.key == r.key) {
            Some(b) => b.items.push((r.id, n)),
            None => batches.push(Batch { key: r.key, items: vec![(r.id, n)] }),
        }
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;
    use dgr_engine::{BackendKind, EngineId, Format, KvDtype, Numerics};
    use dgr_proto::SeamDtype;
    use std::time::Duration;

    const GGUF_EXACT: EngineId =
        EngineId { format: Format::Gguf, backend: BackendKind::Cpu, numerics: Numerics::Exact, kv: KvDtype::F32, adapter: None };

    fn key(phase: Phase, seam_dtype: SeamDtype) -> CompatKey {
        CompatKey { engine: GGUF_EXACT, model_id: "m".into(), layers: (0, 15), phase, hidden: 576, seam_dtype }
    }

    fn ready(i: u8, phase: Phase, dtype: SeamDtype, rows: usize, age_ms: u64) -> Ready {
        let since = Instant::now() - Duration::from_millis(age_ms);
        Ready { id: [i; 16], key: key(phase, dtype), rows, rows_left: rows, fit: usize::MAX, since }
    }

    #[test]
    fn sessions_with_different_keys_never_share_a_batch() {
        let r = vec![
            ready(1, Phase::Decode, SeamDtype::F32, 1, 5),
            ready(2, Phase::Decode, SeamDtype::F16, 1, 4),
            ready(3, Phase::Decode, SeamDtype::F32, 1, 3),
            ready(4, Phase::Prefill, SeamDtype::F32, 100, 2),
            ready(5, Phase::Decode, SeamDtype::Bf16, 1, 1),
        ];
        let b = plan(r, 4, &Policy::default());
        assert_eq!(b.len(), 4);
        for batch in &b {
            let keys: Vec<_> = batch.items.iter().map(|(id, _)| (id[0] == 2, id[0] == 5, id[0] == 4)).collect();
            assert!(keys.windows(2).all(|w| w[0] == w[1]), "{batch:?}");
        }
        assert_eq!(b[0].items, vec![([1; 16], 1), ([3; 16], 1)]);
    }

    #[test]
    fn sessions_of_two_engines_or_kv_dtypes_never_share_a_batch() {
        let other_format = EngineId { format: Format::Transformers, ..GGUF_EXACT };
        let other_numerics = EngineId { numerics: Numerics::Fast, ..GGUF_EXACT };
        let other_kv = [KvDtype::F16, KvDtype::Q8_0].map(|kv| EngineId { kv, ..GGUF_EXACT });
        let other_gpus = [1, 2].map(|a| EngineId { backend: BackendKind::Gpu, adapter: Some(a), ..GGUF_EXACT });
        for other in [other_format, other_numerics].into_iter().chain(other_kv).chain(other_gpus) {
            let mut r = vec![ready(1, Phase::Decode, SeamDtype::F32, 1, 3), ready(2, Phase::Decode, SeamDtype::F32, 1, 2)];
            r[1].key.engine = other;
            r.push(ready(3, Phase::Decode, SeamDtype::F32, 1, 1));
            let b = plan(r, 3, &Policy::default());
            let ids: Vec<Vec<u8>> = b.iter().map(|b| b.items.iter().map(|(id, _)| id[0]).collect()).collect();
            assert_eq!(ids, vec![vec![1, 3], vec![2]], "{other}");
        }
    }

    #[test]
    fn decode_first_then_capped_prompt_chunks_within_the_budget() {
        let p = Policy { step_tokens: 16, prefill_chunk: 512, busy_chunk: 4, ..Policy::default() };
        let mut r: Vec<Ready> = (0..8).map(|i| ready(i, Phase::Decode, SeamDtype::F32, 1, 10)).collect();
        r.push(ready(100, Phase::Prefill, SeamDtype::F32, 1500, 20));
        r.push(ready(101, Phase::Prefill, SeamDtype::F32, 1500, 5));
        let b = plan(r, 8, &p);
        let rows: usize = b.iter().flat_map(|b| &b.items).map(|i| i.1).sum();
        assert!(rows <= 16);
        assert_eq!(b[0].items.len(), 8, "every decode row runs");
        assert_eq!(b[1].items, vec![([100; 16], 4), ([101; 16], 4)], "older prompt first, each chunk capped");
        // A short prompt runs whole beside decoding, within the budget.
        let mut r: Vec<Ready> = (0..4).map(|i| ready(i, Phase::Decode, SeamDtype::F32, 1, 10)).collect();
        r.push(ready(102, Phase::Prefill, SeamDtype::F32, 12, 5));
        let b = plan(r, 4, &p);
        assert_eq!(b[1].items, vec![([102; 16], 12)]);
        // Alone, a prompt gets the large chunk, still within the budget.
        let b = plan(vec![ready(9, Phase::Prefill, SeamDtype::F32, 1500, 1)], 0, &p);
        assert_eq!(b[0].items, vec![([9; 16], 16)]);
    }

    #[test]
    fn a_prompt_chunk_shrinks_to_the_chunk_time_at_its_last_rate() {
        let p = Policy { chunk_time: Duration::from_secs(1), ..Policy::default() };
        assert_eq!(p.fit(None), usize::MAX);
        assert_eq!(p.fit(Some(Duration::from_millis(10))), 100);
        assert_eq!(p.fit(Some(Duration::from_secs(3))), 1, "at least one row a step");
        let mut r = ready(9, Phase::Prefill, SeamDtype::F32, 7000, 1);
        r.fit = p.fit(Some(Duration::from_millis(20)));
        assert_eq!(plan(vec![r.clone()], 0, &p)[0].items, vec![([9; 16], 50)]);
        // Beside decoding, the busy chunk caps it as before.
        let b = plan(vec![ready(1, Phase::Decode, SeamDtype::F32, 1, 2), r.clone()], 1, &p);
        assert_eq!(b[1].items, vec![([9; 16], 4)]);
        // Prompts that arrive together share one chunk's time, the oldest first, whatever their
        // rate and count; the others still progress by the busy chunk.
        for (n, fit, want) in [(8, usize::MAX, 512), (8, 50, 50), (3, 100, 100), (1, usize::MAX, 512)] {
            let r: Vec<Ready> = (0..n).map(|i| Ready { fit, ..ready(i, Phase::Prefill, SeamDtype::F32, 1100, 10 - i as u64) }).collect();
            let b = plan(r, 0, &p);
            let mut items = b[0].items.clone();
            items.sort();
            let expect: Vec<(SessionId, usize)> = (0..n).map(|i| ([i; 16], if i == 0 { want } else { p.busy_chunk })).collect();
            assert_eq!(items, expect, "{n} prompts at fit {fit}");
        }
        // Short prompts arriving together fill the chunk whole, then progress by the busy chunk.
        let r: Vec<Ready> = (0..6).map(|i| ready(i, Phase::Prefill, SeamDtype::F32, 200, 10 - i as u64)).collect();
        assert_eq!(plan(r, 0, &p)[0].items.iter().map(|i| i.1).collect::<Vec<_>>(), vec![200, 200, 112, 4, 4, 4]);
    }

    #[test]
    fn micro_batches_spread_decode_over_steps() {
        let p = Policy { micro_batches: 2, ..Policy::default() };
        let r: Vec<Ready> = (0..8).map(|i| ready(i, Phase::Decode, SeamDtype::F32, 1, 10 - i as u64)).collect();
        let b = plan(r, 8, &p);
        assert_eq!(b[0].items.iter().map(|i| i.0[0]).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        // A micro-batch's size follows the sessions decoding, not how many happen to be waiting.
        let r: Vec<Ready> = (0..4).map(|i| ready(i, Phase::Decode, SeamDtype::F32, 1, 10 - i as u64)).collect();
        assert_eq!(plan(r, 8, &p)[0].items.len(), 4);
    }
}

//! What a batched forward takes and gives, per sequence.

use crate::KvCache;

/// What a sequence brings to a forward: token ids (when its layers start at 0) or hidden rows.
#[derive(Clone, Copy)]
pub enum Input<'a> {
    Tokens(&'a [u32]),
    Hidden(&'a [f32]),
}

/// Which rows of a sequence want logits, when its layers end at the model's last.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    None,
    Last,
    All,
    /// No logits: every row after the final norm (what the head would read), in `hidden`, for
    /// an embedding.
    Normed,
}

/// One sequence's part of a batched forward. Its rows take positions `kv.len()..`. `K` is the
/// engine's per-sequence state (a [`KvCache`] for what `open_engine` opens).
pub struct SeqInput<'a, K = KvCache> {
    pub kv: &'a mut K,
    pub input: Input<'a>,
    pub logits: LogitRows,
}

/// One sequence's result: hidden rows for the next stage (every row, when the sequence's layers
/// end before the model's last) or logits (`vocab` floats per requested row, otherwise), or
/// every row final-normed (`LogitRows::Normed`).
#[derive(Debug, Default)]
pub struct SeqOutput {
    pub hidden: Vec<f32>,
    pub logits: Vec<f32>,
}

//! Per-sequence state: the keys and values a sequence has cached in one stage's layers.

use std::ops::Range;

/// The KV cache of one sequence for one stage, over the layers the sequence runs there (all of
/// the stage's, or a contiguous part). It belongs to exactly one sequence and is only reachable
/// through that sequence's handle, never shared.
#[derive(Debug)]
pub struct KvCache {
    /// Per layer of `layers`: keys transposed, `kv_dim` rows of `capacity` positions, so that a
    /// head's scores are sums of contiguous runs. Sized at creation; the zeroed pages become
    /// resident only as positions are written.
    pub(crate) k: Vec<Vec<f32>>,
    /// Per layer: values, `len` rows of `kv_dim` floats.
    pub(crate) v: Vec<Vec<f32>>,
    pub(crate) len: usize,
    pub(crate) capacity: usize,
    pub(crate) kv_dim: usize,
    pub(crate) stage_id: u64,
    /// The model's layers this sequence runs on the stage; a forward runs exactly these.
    pub(crate) layers: Range<usize>,
}

impl KvCache {
    /// Positions already cached (the next token's position).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The model's layers this sequence runs on its stage.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// Bytes held for the cached positions.
    pub fn bytes(&self) -> usize {
        2 * self.k.len() * self.len * self.kv_dim * std::mem::size_of::<f32>()
    }

    /// Stores layer `layer`'s keys and values of `rows` new positions, from `len` on (the caller
    /// advances `len` once every layer has its rows).
    pub(crate) fn append(&mut self, layer: usize, keys: &[f32], values: &[f32]) {
        let (d, cap) = (self.kv_dim, self.capacity);
        let kt = &mut self.k[layer];
        for (r, row) in keys.chunks_exact(d).enumerate() {
            let p = self.len + r;
            for (c, x) in row.iter().enumerate() {
                kt[c * cap + p] = *x;
            }
        }
        self.v[layer].extend_from_slice(values);
    }
}

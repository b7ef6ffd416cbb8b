//! Per-sequence state: the keys and values a sequence has cached in one stage's layers.

use std::ops::Range;

/// The KV cache of one sequence for one stage, over the layers the sequence runs there (all of
/// the stage's, or a contiguous part). It belongs to exactly one sequence and is only reachable
/// through that sequence's handle, never shared.
#[derive(Debug)]
pub struct KvCache {
    /// Per layer of `layers`: keys transposed, `kv_dim` rows of the layer's slots (`capacity`,
    /// or the window's `slots`), so that a head's scores are sums of contiguous runs. Sized at
    /// creation; the zeroed pages become resident only as positions are written.
    pub(crate) k: Vec<Vec<f32>>,
    /// Per layer: values, one row of `kv_dim` floats per slot in use.
    pub(crate) v: Vec<Vec<f32>>,
    pub(crate) len: usize,
    pub(crate) capacity: usize,
    pub(crate) kv_dim: usize,
    pub(crate) stage_id: u64,
    /// The model's layers this sequence runs on the stage; a forward runs exactly these.
    pub(crate) layers: Range<usize>,
    /// Whether each layer of `layers` attends through the sliding window.
    pub(crate) windowed: Vec<bool>,
    /// The sliding-window layers' state, when any of `layers` is one.
    pub(crate) window: Option<Window>,
}

/// What the sliding-window layers hold: positions `start..len` in slots `0..len - start`. They
/// all see the same appends, so they share it. Older positions are dropped when the slots run
/// out, so they hold at most `max(base, window - 1 + rows of one forward)` positions.
#[derive(Debug)]
pub(crate) struct Window {
    pub size: usize,
    pub start: usize,
    pub slots: usize,
    /// The slots to fall back to when the positions are moved down: room for a window and as
    /// many again (or the capacity, if smaller), so moving costs about one copy per position.
    pub base: usize,
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
        let positions: usize = (0..self.k.len()).map(|li| self.len - self.span(li).0).sum();
        2 * positions * self.kv_dim * std::mem::size_of::<f32>()
    }

    /// Whether its positions can be copied out and in as blocks (`read_block`, `write_block`):
    /// not while a layer keeps only a sliding window, whose older positions are gone.
    pub fn blockable(&self) -> bool {
        self.window.is_none()
    }

    /// Floats in a block of `n` positions: keys then values of every layer, a row per position.
    pub fn block_len(&self, n: usize) -> usize {
        2 * self.k.len() * n * self.kv_dim
    }

    /// A copy of positions `at..at + n` of every layer (keys untransposed), or None when they
    /// are not all held or the cache is not `blockable`.
    pub fn read_block(&self, at: usize, n: usize) -> Option<Vec<f32>> {
        if !self.blockable() || at + n > self.len {
            return None;
        }
        let d = self.kv_dim;
        let mut out = Vec::with_capacity(self.block_len(n));
        for li in 0..self.k.len() {
            let kt = &self.k[li];
            for p in at..at + n {
                out.extend((0..d).map(|c| kt[c * self.capacity + p]));
            }
            out.extend_from_slice(&self.v[li][at * d..(at + n) * d]);
        }
        Some(out)
    }

    /// Appends `n` positions copied by `read_block` from a cache over the same layers, as if
    /// they had been computed here: the same bits in the same places.
    pub fn write_block(&mut self, n: usize, block: &[f32]) -> Result<(), crate::EngineError> {
        if !self.blockable() {
            return Err(crate::EngineError::BadInput("a sliding-window cache takes no copied blocks".into()));
        }
        if block.len() != self.block_len(n) {
            return Err(crate::EngineError::BadInput(format!(
                "a block of {} floats for {n} positions (want {})",
                block.len(),
                self.block_len(n)
            )));
        }
        if self.len + n > self.capacity {
            return Err(crate::EngineError::ContextFull { needed: self.len + n, capacity: self.capacity });
        }
        let d = self.kv_dim;
        for (li, layer) in block.chunks_exact(2 * n * d).enumerate() {
            let (keys, values) = layer.split_at(n * d);
            self.append(li, keys, values);
        }
        self.len += n;
        Ok(())
    }

    /// Layer `li`'s first held position and its slots per key row.
    pub(crate) fn span(&self, li: usize) -> (usize, usize) {
        match &self.window {
            Some(w) if self.windowed[li] => (w.start, w.slots),
            _ => (0, self.capacity),
        }
    }

    /// Makes room in the sliding-window layers for `rows` new positions, keeping every
    /// position those rows can see (the `size - 1` before the first of them). Called before a
    /// forward's first append; the positions keep their order, so results do not depend on it.
    pub(crate) fn reserve(&mut self, rows: usize) {
        let Some(w) = &mut self.window else { return };
        if self.len + rows - w.start <= w.slots {
            return;
        }
        let keep = self.len.saturating_sub(w.size - 1).max(w.start);
        let (held, drop) = (self.len - keep, keep - w.start);
        let slots = w.base.max(held + rows);
        let d = self.kv_dim;
        for (li, _) in self.windowed.iter().enumerate().filter(|&(_, &on)| on) {
            let k = &mut self.k[li];
            if slots == w.slots {
                for c in 0..d {
                    k.copy_within(c * slots + drop..c * slots + drop + held, c * slots);
                }
            } else {
                let mut moved = vec![0f32; d * slots];
                for c in 0..d {
                    moved[c * slots..c * slots + held].copy_from_slice(&k[c * w.slots + drop..c * w.slots + drop + held]);
                }
                *k = moved;
            }
            self.v[li].drain(..drop * d);
        }
        w.start = keep;
        w.slots = slots;
    }

    /// Stores layer `layer`'s keys and values of `rows` new positions, from `len` on (the caller
    /// advances `len` once every layer has its rows, and reserved room for them first).
    pub(crate) fn append(&mut self, layer: usize, keys: &[f32], values: &[f32]) {
        let (start, slots) = self.span(layer);
        let d = self.kv_dim;
        let kt = &mut self.k[layer];
        for (r, row) in keys.chunks_exact(d).enumerate() {
            let slot = self.len + r - start;
            for (c, x) in row.iter().enumerate() {
                kt[c * slots + slot] = *x;
            }
        }
        self.v[layer].extend_from_slice(values);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache over three layers, the middle one windowed, of one float per position.
    fn cache(size: usize, capacity: usize) -> KvCache {
        let base = capacity.min(2 * size);
        KvCache {
            k: vec![vec![0.0; capacity], vec![0.0; base], vec![0.0; capacity]],
            v: vec![Vec::new(); 3],
            len: 0,
            capacity,
            kv_dim: 1,
            stage_id: 0,
            layers: 0..3,
            windowed: vec![false, true, false],
            window: Some(Window { size, start: 0, slots: base, base }),
        }
    }

    /// Appends positions as their own keys and values, `rows` at a time.
    fn push(kv: &mut KvCache, rows: usize) {
        kv.reserve(rows);
        let new: Vec<f32> = (kv.len..kv.len + rows).map(|p| p as f32).collect();
        for li in 0..3 {
            kv.append(li, &new, &new);
        }
        kv.len += rows;
    }

    /// The positions layer `li` holds, in slot order, read from keys and values alike.
    fn held(kv: &KvCache, li: usize) -> Vec<f32> {
        let (start, _) = kv.span(li);
        let keys = kv.k[li][..kv.len - start].to_vec();
        assert_eq!(keys, kv.v[li]);
        keys
    }

    #[test]
    fn a_block_read_out_and_written_into_a_fresh_cache_is_the_same_bits() {
        let layers = 2;
        let mut a = KvCache {
            k: vec![vec![0.0; 3 * 8]; layers],
            v: vec![Vec::new(); layers],
            len: 0,
            capacity: 8,
            kv_dim: 3,
            stage_id: 0,
            layers: 0..layers,
            windowed: vec![false; layers],
            window: None,
        };
        for p in 0..6 {
            for li in 0..layers {
                let row: Vec<f32> = (0..3).map(|c| (100 * li + 10 * p + c) as f32).collect();
                a.append(li, &row, &row.iter().map(|x| -x).collect::<Vec<_>>());
            }
            a.len += 1;
        }
        let mut b = KvCache { k: vec![vec![0.0; 3 * 8]; layers], v: vec![Vec::new(); layers], len: 0, ..a.clone_shape() };
        b.write_block(4, &a.read_block(0, 4).unwrap()).unwrap();
        assert_eq!(b.read_block(0, 4), a.read_block(0, 4));
        assert!(b.write_block(2, &[0.0; 5]).is_err(), "a block of the wrong size");
        assert!(a.read_block(4, 4).is_none(), "positions not held");
        for li in 0..layers {
            assert_eq!(b.v[li], a.v[li][..12]);
            for c in 0..3 {
                assert_eq!(b.k[li][c * 8..c * 8 + 4], a.k[li][c * 8..c * 8 + 4]);
            }
        }
        assert!(cache(4, 64).read_block(0, 0).is_none() && !cache(4, 64).blockable(), "windowed caches are not copied");
    }

    impl KvCache {
        fn clone_shape(&self) -> KvCache {
            KvCache {
                k: Vec::new(),
                v: Vec::new(),
                len: 0,
                capacity: self.capacity,
                kv_dim: self.kv_dim,
                stage_id: self.stage_id,
                layers: self.layers.clone(),
                windowed: self.windowed.clone(),
                window: None,
            }
        }
    }

    #[test]
    fn the_window_keeps_what_the_next_rows_see_in_order_and_stays_bounded() {
        for chunks in [vec![1; 40], vec![3, 7, 1, 1, 20, 2, 1, 5], vec![25, 1, 1, 13]] {
            let mut kv = cache(4, 64);
            let mut most = 0;
            for rows in chunks {
                push(&mut kv, rows);
                most = most.max(rows);
                let (start, slots) = kv.span(1);
                let all: Vec<f32> = (0..kv.len).map(|p| p as f32).collect();
                assert_eq!(held(&kv, 0), all);
                assert_eq!(held(&kv, 1), all[start..], "positions {start}.. of {}", kv.len);
                assert!(start + 3 <= kv.len.max(3), "a window of 4 keeps the last 3 positions at least");
                assert!(slots <= 8.max(3 + most), "{slots} slots after forwards of at most {most} rows");
            }
        }
    }
}

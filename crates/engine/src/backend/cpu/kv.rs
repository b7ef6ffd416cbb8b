//! The CPU backend's per-sequence state (its `Backend::Kv`): the keys and values a sequence
//! has cached in one stage's layers, stored in the stage's KV dtype.

use crate::backend::KvShape;
use crate::KvDtype;
use half::f16;
use std::ops::Range;

/// The KV cache of one sequence for one stage, over the layers the sequence runs there (all of
/// the stage's, or a contiguous part). It belongs to exactly one sequence and is only reachable
/// through that sequence's handle, never shared.
#[derive(Debug)]
pub struct KvCache {
    /// Per layer of `layers`: its keys and values as the KV dtype stores them. Key rows are
    /// sized at creation; the zeroed pages become resident only as positions are written.
    pub(crate) store: Vec<Store>,
    pub(crate) len: usize,
    pub(crate) capacity: usize,
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

/// One array of a layer's cache: keys transposed, `width` rows of `stride` elements holding the
/// layer's slots, so that a head's scores are sums of contiguous runs; values one row of `width`
/// per position held.
#[derive(Debug)]
pub(crate) struct Plane<T> {
    pub k: Vec<T>,
    pub v: Vec<T>,
    pub width: usize,
    pub stride: usize,
}

/// One layer's keys and values as its KV dtype stores them. Each position is stored on its own
/// (a q8_0 block never spans two positions or two heads), so appending never rewrites an
/// earlier position and a position's bits never depend on what else was computed with it.
#[derive(Debug)]
pub(crate) enum Store {
    F32(Plane<f32>),
    /// f16 bits, rounded to nearest even.
    F16(Plane<u16>),
    /// Values `q * scale`: int8 `q`, and one f16 scale (bits) per `block` values of a row.
    Q8_0 {
        q: Plane<i8>,
        scale: Plane<u16>,
        block: usize,
    },
}

/// An element of a plane, written little-endian in copied blocks.
pub(crate) trait Elem: Copy + Default {
    const SIZE: usize;
    fn put(self, out: &mut Vec<u8>);
    fn get(b: &[u8]) -> Self;
}

macro_rules! elem {
    ($($t:ty),+) => {$(
        impl Elem for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(&b[..Self::SIZE]);
                <$t>::from_le_bytes(a)
            }
        }
    )+};
}
elem!(f32, u16, i8);

/// Elements per key row for `slots` slots: whole 64-byte lines, an odd number of them. A score
/// sums one line of each key row in turn, and rows a multiple of 4 KiB apart would all fall in
/// one set of the L1 cache and miss it every time (measured: a 512-position prefill's attention
/// 1.5× slower with 1,024 slots than with 1,040); an odd number of lines spreads them over all.
fn stride<T: Elem>(slots: usize) -> usize {
    let per_line = 64 / T::SIZE;
    let lines = slots.div_ceil(per_line);
    (lines | 1) * per_line
}

impl<T: Elem> Plane<T> {
    fn new(width: usize, slots: usize) -> Plane<T> {
        let stride = stride::<T>(slots);
        Plane { k: vec![T::default(); width * stride], v: Vec::new(), width, stride }
    }

    fn position_bytes(&self) -> usize {
        2 * self.width * T::SIZE
    }

    /// Stores the key and value rows of positions from slot `slot0` on.
    fn put(&mut self, slot0: usize, keys: &[T], values: &[T]) {
        for (r, row) in keys.chunks_exact(self.width).enumerate() {
            for (c, x) in row.iter().enumerate() {
                self.k[c * self.stride + slot0 + r] = *x;
            }
        }
        self.v.extend_from_slice(values);
    }

    /// Moves `held` positions, from slot `drop`, down to slot 0 of a layer of `slots`, and drops
    /// the values of the first `drop`.
    fn shift(&mut self, slots: usize, drop: usize, held: usize) {
        let (w, old, new) = (self.width, self.stride, stride::<T>(slots));
        if new == old {
            for c in 0..w {
                self.k.copy_within(c * old + drop..c * old + drop + held, c * old);
            }
        } else {
            let mut moved = vec![T::default(); w * new];
            for c in 0..w {
                moved[c * new..c * new + held].copy_from_slice(&self.k[c * old + drop..c * old + drop + held]);
            }
            self.k = moved;
            self.stride = new;
        }
        self.v.drain(..drop * w);
    }

    /// Keeps the values of the first `held` positions (keys past them are overwritten by appends).
    fn truncate(&mut self, held: usize) {
        self.v.truncate(held * self.width);
    }

    /// Positions `at..at + n` (slot = position): keys untransposed, then values.
    fn read(&self, at: usize, n: usize, out: &mut Vec<u8>) {
        for p in at..at + n {
            (0..self.width).for_each(|c| self.k[c * self.stride + p].put(out));
        }
        self.v[at * self.width..(at + n) * self.width].iter().for_each(|x| x.put(out));
    }

    /// Appends `n` positions `read` wrote, from the front of `bytes`; returns the rest.
    fn write<'b>(&mut self, len: usize, n: usize, bytes: &'b [u8]) -> &'b [u8] {
        let (mine, rest) = bytes.split_at(self.position_bytes() * n);
        let elems: Vec<T> = mine.chunks_exact(T::SIZE).map(T::get).collect();
        let (keys, values) = elems.split_at(n * self.width);
        self.put(len, keys, values);
        rest
    }
}

impl Store {
    /// An empty layer of `slots` key slots of `width` floats each, in `dtype`, with q8_0
    /// scales per `block` values.
    pub(crate) fn new(dtype: KvDtype, width: usize, slots: usize, block: usize) -> Store {
        match dtype {
            KvDtype::F32 => Store::F32(Plane::new(width, slots)),
            KvDtype::F16 => Store::F16(Plane::new(width, slots)),
            KvDtype::Q8_0 => Store::Q8_0 { q: Plane::new(width, slots), scale: Plane::new(width / block, slots), block },
        }
    }

    /// Floats of one position's keys (and values).
    fn width(&self) -> usize {
        match self {
            Store::F32(p) => p.width,
            Store::F16(p) => p.width,
            Store::Q8_0 { q, .. } => q.width,
        }
    }

    /// Bytes one position takes, keys and values.
    pub(crate) fn position_bytes(&self) -> usize {
        match self {
            Store::F32(p) => p.position_bytes(),
            Store::F16(p) => p.position_bytes(),
            Store::Q8_0 { q, scale, .. } => q.position_bytes() + scale.position_bytes(),
        }
    }

    /// Stores the keys and values of positions from slot `slot0` on, rounded to the dtype.
    pub(crate) fn append(&mut self, slot0: usize, keys: &[f32], values: &[f32]) {
        match self {
            Store::F32(p) => p.put(slot0, keys, values),
            Store::F16(p) => {
                let half = |x: &[f32]| x.iter().map(|&x| f16::from_f32(x).to_bits()).collect::<Vec<_>>();
                p.put(slot0, &half(keys), &half(values))
            }
            Store::Q8_0 { q, scale, block } => {
                let (kq, ks) = quantize(&rotated(keys, *block), *block);
                let (vq, vs) = quantize(&rotated(values, *block), *block);
                q.put(slot0, &kq, &vq);
                scale.put(slot0, &ks, &vs);
            }
        }
    }

    fn shift(&mut self, slots: usize, drop: usize, held: usize) {
        match self {
            Store::F32(p) => p.shift(slots, drop, held),
            Store::F16(p) => p.shift(slots, drop, held),
            Store::Q8_0 { q, scale, .. } => {
                q.shift(slots, drop, held);
                scale.shift(slots, drop, held);
            }
        }
    }

    fn truncate(&mut self, held: usize) {
        match self {
            Store::F32(p) => p.truncate(held),
            Store::F16(p) => p.truncate(held),
            Store::Q8_0 { q, scale, .. } => {
                q.truncate(held);
                scale.truncate(held);
            }
        }
    }

    fn read(&self, at: usize, n: usize, out: &mut Vec<u8>) {
        match self {
            Store::F32(p) => p.read(at, n, out),
            Store::F16(p) => p.read(at, n, out),
            Store::Q8_0 { q, scale, .. } => {
                q.read(at, n, out);
                scale.read(at, n, out);
            }
        }
    }

    fn write<'b>(&mut self, len: usize, n: usize, bytes: &'b [u8]) -> &'b [u8] {
        match self {
            Store::F32(p) => p.write(len, n, bytes),
            Store::F16(p) => p.write(len, n, bytes),
            Store::Q8_0 { q, scale, .. } => {
                let rest = q.write(len, n, bytes);
                scale.write(len, n, rest)
            }
        }
    }
}

#[cfg(test)]
impl Store {
    /// The f32 store of the values this one stands for.
    pub(crate) fn dequantized(&self) -> Store {
        // Key rows as long as the original's: a stride counts elements, whatever their size.
        let f32s = |k: Vec<f32>, v: Vec<f32>, width, stride| Store::F32(Plane { k, v, width, stride });
        match self {
            Store::F32(p) => f32s(p.k.clone(), p.v.clone(), p.width, p.stride),
            Store::F16(p) => {
                f32s(p.k.iter().map(|&h| f16_value(h)).collect(), p.v.iter().map(|&h| f16_value(h)).collect(), p.width, p.stride)
            }
            Store::Q8_0 { q, scale, block } => {
                // The codes' rows may run past the scales' (whole lines of each): those slots
                // are padding, never a position.
                let slots = q.stride;
                let key = |i: usize| match i % slots {
                    j if j < scale.stride => q.k[i] as f32 * f16_value(scale.k[(i / slots / block) * scale.stride + j]),
                    _ => 0.0,
                };
                let mut k: Vec<f32> = (0..q.k.len()).map(key).collect();
                let mut v: Vec<f32> =
                    (0..q.v.len()).map(|i| q.v[i] as f32 * f16_value(scale.v[i / q.width * scale.width + i % q.width / block])).collect();
                // Rotated back: H·H = block·I.
                if block.is_power_of_two() {
                    let back = |x: &mut [f32]| {
                        hadamard(x);
                        x.iter_mut().for_each(|x| *x /= *block as f32);
                    };
                    v.chunks_exact_mut(*block).for_each(back);
                    for j in 0..slots {
                        for b in 0..q.width / block {
                            let mut col: Vec<f32> = (b * block..(b + 1) * block).map(|c| k[c * slots + j]).collect();
                            back(&mut col);
                            (b * block..(b + 1) * block).zip(col).for_each(|(c, x)| k[c * slots + j] = x);
                        }
                    }
                }
                f32s(k, v, q.width, slots)
            }
        }
    }
}

/// Each `block` values of `x` times the Walsh–Hadamard matrix of that size, where it is a power
/// of two (q8_0 stores keys and values so): an outlier is spread over its block, so that the
/// block's one scale fits all of its values (SmolLM2's keys have such outliers). The matrix is
/// ±1 and `H·H = block·I`, so attention undoes it up to one power-of-two scale.
pub(crate) fn rotated(x: &[f32], block: usize) -> Vec<f32> {
    let mut x = x.to_vec();
    if block.is_power_of_two() {
        x.chunks_exact_mut(block).for_each(hadamard);
    }
    x
}

/// `x` times the Walsh–Hadamard matrix of its length (a power of two), in place: butterflies
/// in a fixed order, so the same bits everywhere.
#[inline(always)]
pub(crate) fn hadamard(x: &mut [f32]) {
    let mut h = 1;
    while h < x.len() {
        for i in (0..x.len()).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
}

/// Each `block` values of `x` as int8 with one f16 scale: scale = f16(max |x| / 127), rounded
/// first so that the ints are chosen against the scale that is stored; q = round(x / scale),
/// so a stored value `q * scale` is within half a scale of x.
fn quantize(x: &[f32], block: usize) -> (Vec<i8>, Vec<u16>) {
    let (mut q, mut scales) = (Vec::with_capacity(x.len()), Vec::with_capacity(x.len() / block));
    for b in x.chunks_exact(block) {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = f16::from_f32((amax / 127.0).min(f16::MAX.to_f32()));
        let d = scale.to_f32();
        scales.push(scale.to_bits());
        q.extend(b.iter().map(|v| if d == 0.0 { 0 } else { (v / d).round().clamp(-127.0, 127.0) as i8 }));
    }
    (q, scales)
}

/// The f32 value of f16 bits, exactly (subnormals, infinities and NaN included), in plain
/// integer and float operations and selects, so that it vectorizes and is the same everywhere.
#[inline(always)]
pub(crate) fn f16_value(h: u16) -> f32 {
    const SHIFTED_EXP: u32 = 0x7c00 << 13;
    let magnitude = ((h & 0x7fff) as u32) << 13;
    let exp = magnitude & SHIFTED_EXP;
    let normal = magnitude + ((127 - 15) << 23);
    let bits = if exp == SHIFTED_EXP {
        normal + ((128 - 16) << 23)
    } else if exp == 0 {
        // A subnormal (or zero): its mantissa read as a float of exponent -14, less that float's 1.
        (f32::from_bits(normal + (1 << 23)) - f32::from_bits(113 << 23)).to_bits()
    } else {
        normal
    };
    f32::from_bits(bits | ((h & 0x8000) as u32) << 16)
}

impl KvCache {
    /// An empty cache as `shape` says. Its sliding-window layers start with room for a window
    /// and as many positions again (or the capacity, if smaller).
    pub(crate) fn new(shape: KvShape) -> KvCache {
        let KvShape { capacity, layers, windowed, window, width, dtype, block, owner } = shape;
        let window = window.filter(|_| windowed.contains(&true)).map(|size| {
            let base = capacity.min(2 * size);
            Window { size, start: 0, slots: base, base }
        });
        let slots = |on: bool| window.as_ref().filter(|_| on).map_or(capacity, |w| w.slots);
        KvCache {
            store: windowed.iter().map(|&on| Store::new(dtype, width, slots(on), block)).collect(),
            len: 0,
            capacity,
            stage_id: owner,
            layers,
            windowed,
            window,
        }
    }

    /// Floats of one position's keys (and values) in each layer.
    pub(crate) fn width(&self) -> usize {
        self.store.first().map_or(0, Store::width)
    }

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

    /// Bytes held for the cached positions, as stored.
    pub fn bytes(&self) -> usize {
        self.store.iter().enumerate().map(|(li, s)| (self.len - self.first_held(li)) * s.position_bytes()).sum()
    }

    /// Whether its positions can be copied out and in as blocks (`read_block`, `write_block`):
    /// not while a layer keeps only a sliding window, whose older positions are gone.
    pub fn blockable(&self) -> bool {
        self.window.is_none()
    }

    /// Bytes in a block of `n` positions: every layer's keys and values as stored.
    pub fn block_bytes(&self, n: usize) -> usize {
        n * self.store.iter().map(Store::position_bytes).sum::<usize>()
    }

    /// A copy of positions `at..at + n` of every layer, as stored (keys untransposed), or None
    /// when they are not all held or the cache is not `blockable`.
    pub fn read_block(&self, at: usize, n: usize) -> Option<Vec<u8>> {
        if !self.blockable() || at + n > self.len {
            return None;
        }
        let mut out = Vec::with_capacity(self.block_bytes(n));
        for s in &self.store {
            s.read(at, n, &mut out);
        }
        Some(out)
    }

    /// Appends `n` positions copied by `read_block` from a cache over the same layers in the
    /// same KV dtype, as if they had been computed here: the same bits in the same places.
    pub fn write_block(&mut self, n: usize, block: &[u8]) -> Result<(), crate::EngineError> {
        if !self.blockable() {
            return Err(crate::EngineError::BadInput("a sliding-window cache takes no copied blocks".into()));
        }
        if block.len() != self.block_bytes(n) {
            return Err(crate::EngineError::BadInput(format!(
                "a block of {} bytes for {n} positions (want {})",
                block.len(),
                self.block_bytes(n)
            )));
        }
        if self.len + n > self.capacity {
            return Err(crate::EngineError::ContextFull { needed: self.len + n, capacity: self.capacity });
        }
        let mut rest = block;
        for s in &mut self.store {
            rest = s.write(self.len, n, rest);
        }
        self.len += n;
        Ok(())
    }

    /// Drops every position from `len` on, as if they had never been computed (a speculative
    /// step's rejected drafts): later appends store the same bits a run that never held them
    /// stores. Refused when `len` is past what is held, or when a sliding-window layer no longer
    /// holds a position the next row at `len` would attend to.
    pub fn truncate(&mut self, len: usize) -> Result<(), crate::EngineError> {
        if len > self.len {
            return Err(crate::EngineError::BadInput(format!("cannot keep {len} positions of {}", self.len)));
        }
        if let Some(w) = &self.window {
            if (len + 1).saturating_sub(w.size) < w.start {
                return Err(crate::EngineError::BadInput(format!(
                    "the sliding window holds positions from {} on; a row at {len} sees earlier ones",
                    w.start
                )));
            }
        }
        for li in 0..self.store.len() {
            let start = self.first_held(li);
            self.store[li].truncate(len - start);
        }
        self.len = len;
        Ok(())
    }

    /// Layer `li`'s first held position (in its slot 0).
    pub(crate) fn first_held(&self, li: usize) -> usize {
        match &self.window {
            Some(w) if self.windowed[li] => w.start,
            _ => 0,
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
        for (store, _) in self.store.iter_mut().zip(&self.windowed).filter(|&(_, &on)| on) {
            store.shift(slots, drop, held);
        }
        w.start = keep;
        w.slots = slots;
    }

    /// Stores layer `layer`'s keys and values of `rows` new positions, from `len` on (the caller
    /// advances `len` once every layer has its rows, and reserved room for them first).
    pub(crate) fn append(&mut self, layer: usize, keys: &[f32], values: &[f32]) {
        let start = self.first_held(layer);
        self.store[layer].append(self.len - start, keys, values);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache over three layers, the middle one windowed, of one float per position.
    fn cache(dtype: KvDtype, size: usize, capacity: usize) -> KvCache {
        let base = capacity.min(2 * size);
        KvCache {
            store: [capacity, base, capacity].map(|slots| Store::new(dtype, 1, slots, 1)).into(),
            len: 0,
            capacity,
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

    impl Store {
        /// Column `c` of the key and the value in slot `slot` (of `slots`), as the attention reads them.
        fn at(&self, slot: usize, c: usize) -> (f32, f32) {
            match self {
                Store::F32(p) => (p.k[c * p.stride + slot], p.v[slot * p.width + c]),
                Store::F16(p) => (f16_value(p.k[c * p.stride + slot]), f16_value(p.v[slot * p.width + c])),
                Store::Q8_0 { q, scale, block } => {
                    let b = c / block;
                    let (ks, vs) = (f16_value(scale.k[b * scale.stride + slot]), f16_value(scale.v[slot * scale.width + b]));
                    (q.k[c * q.stride + slot] as f32 * ks, q.v[slot * q.width + c] as f32 * vs)
                }
            }
        }
    }

    /// What `dtype` stores for the value `x` (one value a row).
    fn stored(dtype: KvDtype, x: f32) -> f32 {
        let mut s = Store::new(dtype, 1, 1, 1);
        s.append(0, &[x], &[x]);
        s.at(0, 0).0
    }

    /// The positions layer `li` holds, in slot order, read from keys and values alike.
    fn held(kv: &KvCache, li: usize) -> Vec<f32> {
        let start = kv.first_held(li);
        let (keys, values): (Vec<f32>, Vec<f32>) = (0..kv.len - start).map(|slot| kv.store[li].at(slot, 0)).unzip();
        assert_eq!(keys, values);
        keys
    }

    #[test]
    fn key_rows_are_an_odd_number_of_whole_lines_holding_every_slot() {
        for slots in [1, 8, 15, 16, 17, 64, 512, 1000, 1024, 4096] {
            for (elems, size) in [(stride::<f32>(slots), 4), (stride::<u16>(slots), 2), (stride::<i8>(slots), 1)] {
                assert!(elems >= slots && (elems * size) % 64 == 0 && (elems * size / 64) % 2 == 1, "{slots} slots of {size} bytes");
            }
        }
    }

    #[test]
    fn a_block_read_out_and_written_into_a_fresh_cache_is_the_same_bits() {
        for &dtype in KvDtype::ALL {
            let (layers, d, block) = (2, 64, 32);
            let fresh = || KvCache {
                store: (0..layers).map(|_| Store::new(dtype, d, 8, block)).collect(),
                len: 0,
                capacity: 8,
                stage_id: 0,
                layers: 0..layers,
                windowed: vec![false; layers],
                window: None,
            };
            let mut a = fresh();
            for p in 0..6 {
                for li in 0..layers {
                    let row: Vec<f32> = (0..d).map(|c| ((100 * li + 10 * p + c) as f32 * 0.37).sin() * (1 + c % 5) as f32).collect();
                    a.append(li, &row, &row.iter().map(|x| -x).collect::<Vec<_>>());
                }
                a.len += 1;
            }
            let mut b = fresh();
            let block4 = a.read_block(0, 4).unwrap();
            assert_eq!(block4.len(), 4 * layers * a.store[0].position_bytes());
            b.write_block(4, &block4).unwrap();
            assert_eq!(b.read_block(0, 4), a.read_block(0, 4));
            assert!(b.write_block(2, &[0; 5]).is_err(), "a block of the wrong size");
            assert!(a.read_block(4, 4).is_none(), "positions not held");
            for li in 0..layers {
                for p in 0..4 {
                    for c in 0..d {
                        let (x, y) = (a.store[li].at(p, c), b.store[li].at(p, c));
                        assert_eq!(
                            (x.0.to_bits(), x.1.to_bits()),
                            (y.0.to_bits(), y.1.to_bits()),
                            "{dtype} layer {li} position {p} column {c}"
                        );
                    }
                }
            }
            assert!(cache(dtype, 4, 64).read_block(0, 0).is_none() && !cache(dtype, 4, 64).blockable(), "windowed caches are not copied");
        }
    }

    #[test]
    fn the_window_keeps_what_the_next_rows_see_in_order_and_stays_bounded() {
        for &dtype in KvDtype::ALL {
            for chunks in [vec![1; 40], vec![3, 7, 1, 1, 20, 2, 1, 5], vec![25, 1, 1, 13]] {
                let mut kv = cache(dtype, 4, 64);
                let mut most = 0;
                for rows in chunks {
                    push(&mut kv, rows);
                    most = most.max(rows);
                    let (start, slots) = (kv.first_held(1), kv.window.as_ref().map_or(0, |w| w.slots));
                    let all: Vec<f32> = (0..kv.len).map(|p| stored(dtype, p as f32)).collect();
                    assert_eq!(held(&kv, 0), all);
                    assert_eq!(held(&kv, 1), all[start..], "{dtype}: positions {start}.. of {}", kv.len);
                    assert!(start + 3 <= kv.len.max(3), "a window of 4 keeps the last 3 positions at least");
                    assert!(slots <= 8.max(3 + most), "{slots} slots after forwards of at most {most} rows");
                }
            }
        }
    }

    #[test]
    fn a_truncated_cache_appends_as_if_it_never_held_the_dropped_positions() {
        for &dtype in KvDtype::ALL {
            // Positions 0..10 one at a time, against 0..6, then 6..10 appended as drafts 6..9
            // (four more rows), truncated back to 8 and 8..10 computed again.
            let mut straight = cache(dtype, 4, 64);
            push(&mut straight, 10);
            let mut spec = cache(dtype, 4, 64);
            push(&mut spec, 6);
            push(&mut spec, 5);
            spec.truncate(8).unwrap();
            assert_eq!(spec.len, 8);
            push(&mut spec, 2);
            for li in 0..3 {
                let (a, b) = (held(&straight, li), held(&spec, li));
                let n = a.len().min(b.len());
                assert_eq!(a[a.len() - n..], b[b.len() - n..], "{dtype} layer {li}");
                assert!(b.len() >= 3, "the window keeps what the next row sees");
            }
            assert!(spec.truncate(11).is_err(), "past what is held");
            // A window of 4 after 10 positions holds what a row at 9 sees, not at 3.
            assert!(spec.truncate(3).is_err() && spec.truncate(spec.first_held(1) + 3).is_ok());
        }
    }

    #[test]
    fn f16_bits_read_back_exactly() {
        for h in 0..=u16::MAX {
            let (got, want) = (f16_value(h), f16::from_bits(h).to_f32());
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{h:#06x}: {got} vs {want}");
        }
    }

    #[test]
    fn q8_0_keeps_each_value_within_half_a_scale_and_zero_blocks_zero() {
        let x: Vec<f32> = (0..96).map(|i| if i < 32 { 0.0 } else { ((i * 7919 % 101) as f32 - 50.0) * 0.013 }).collect();
        let (q, scales) = quantize(&x, 32);
        assert_eq!((q.len(), scales.len()), (96, 3));
        for (b, xs) in x.chunks(32).enumerate() {
            let d = f16_value(scales[b]);
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!((d - amax / 127.0).abs() <= amax / 127.0 * 1e-3, "block {b}: scale {d}");
            for (i, v) in xs.iter().enumerate() {
                assert!((q[b * 32 + i] as f32 * d - v).abs() <= d / 2.0 + 1e-7, "block {b} value {i}");
            }
        }
        assert!(q[..32].iter().all(|&q| q == 0));
    }
}

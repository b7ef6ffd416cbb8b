//! Weight matrices as views into the mapped file, and the threaded matrix product over them.

use crate::backend::cpu::kernels::int::{self, Activations, Packed};
use crate::backend::cpu::kernels::{self, Columns, FastType, Isa, Line, Rows};
use crate::backend::cpu::pool::{Disjoint, ThreadPool};
use crate::backend::cpu::Cpu;
use crate::backend::Product;
use crate::{EngineError, Numerics};
use dgr_gguf::{GgmlType, Gguf};
use std::sync::Arc;

/// A `rows × k` weight matrix stored row-major in the GGUF file (ggml dims `[k, rows]`).
#[derive(Clone, Debug)]
pub struct Matrix {
    ty: GgmlType,
    fast: FastType,
    pub rows: usize,
    pub k: usize,
    /// Where the rows lie: a mapped region of the file, and the offset into it.
    region: usize,
    offset: usize,
    row_bytes: usize,
    /// The rows repacked for the integer kernels (fast numerics on AVX-512), which then read
    /// them instead of the file's.
    packed: Option<Arc<Packed>>,
}

impl Matrix {
    pub fn load(g: &Gguf, name: &str, k: usize, rows: usize) -> Result<Matrix, EngineError> {
        let t = g.tensor(name).ok_or_else(|| EngineError::MissingTensor(name.into()))?;
        if t.dims != [k as u64, rows as u64] {
            return Err(EngineError::BadShape { name: name.into(), expected: vec![k as u64, rows as u64], found: t.dims.clone() });
        }
        let fast = FastType::of(t.ty).ok_or_else(|| EngineError::UnsupportedType { name: name.into(), ty: t.ty.name() })?;
        let row_bytes = t.ty.row_bytes(k as u64).ok_or_else(|| EngineError::BadShape {
            name: name.into(),
            expected: vec![k as u64, rows as u64],
            found: t.dims.clone(),
        })? as usize;
        let (region, offset) = g.tensor_location(t).ok_or_else(|| EngineError::MissingTensor(name.into()))?;
        Ok(Matrix { ty: t.ty, fast, rows, k, region, offset, row_bytes, packed: None })
    }

    /// Repacks the rows for the integer kernels of `isa`, where they have a packed form, on
    /// `threads` threads.
    pub fn pack(&mut self, g: &Gguf, isa: Isa, threads: usize) {
        let w = Rows { ty: self.fast, bytes: self.rows(g, 0..self.rows), row_bytes: self.row_bytes, n_rows: self.rows };
        self.packed = Packed::new(isa, &w, self.k, threads).map(Arc::new);
        if let Some(p) = &self.packed {
            // Only the rows past the last whole tile (and a tied head's embedding table, the
            // rows of the tokens looked up) are read from the file again.
            g.release(self.region, self.offset..self.offset + p.tiles() * int::packed::TILE * self.row_bytes);
        }
    }

    /// Rows `rows` of the matrix, in the mapped region `g` holds them in.
    fn rows<'f>(&self, g: &'f Gguf, rows: std::ops::Range<usize>) -> &'f [u8] {
        &g.region(self.region)[self.offset + rows.start * self.row_bytes..self.offset + rows.end * self.row_bytes]
    }

    /// Row `r` as f32 (for embeddings).
    pub fn dequantize_row(&self, g: &Gguf, r: usize, out: &mut [f32]) -> Result<(), EngineError> {
        Ok(dgr_gguf::quant::dequantize_row(self.ty, self.rows(g, r..r + 1), out)?)
    }

    pub fn bytes(&self) -> usize {
        self.row_bytes * self.rows
    }
}

/// Computes every product for the `n` columns of `x` (each `k` floats, contiguous, where every
/// product has `k` columns) in one pool job over the products' rows, handed out in chunks. Each
/// row is computed completely by one thread, so a result depends on neither the thread count nor
/// the other columns. In fast numerics, block-type weights meet the columns quantized once for
/// every product and thread (`kernels::int`); float weights stay exact.
pub(crate) fn matmul(pool: &ThreadPool, isa: Isa, numerics: Numerics, g: &Gguf, x: &[f32], n: usize, products: &mut [Product<Cpu>]) {
    // At most three products share a job (q, k, v); held in an array, not allocated per call.
    assert!(products.len() <= 3);
    // No columns, no outputs (a last stage's step whose rows need no logits).
    if n == 0 {
        return;
    }
    let k = products.first().map_or(0, |p| p.w.k);
    for p in products.iter() {
        assert!(p.w.k == k && x.len() >= n * k && p.out.len() >= n * p.w.rows);
    }
    let fast = |w: &Matrix| numerics == Numerics::Fast && int::has_int(w.fast);
    let mut acts = ACTIVATIONS.take();
    if products.iter().any(|p| fast(p.w)) {
        acts.quantize(pool, isa, &(0..n).map(|c| &x[c * k..][..k]).collect::<Vec<_>>(), k);
    }
    let mut lines = ALIGNED.take();
    let exact = products.iter().any(|p| !fast(p.w));
    let (x, stride) = if exact && aligned(x, n, k, &mut lines) { (Line::floats(&lines), k.next_multiple_of(16)) } else { (x, k) };
    // Columns only the exact kernels read are laid out only when one of them will.
    let cols = Columns::new(isa, if exact { (0..n).map(|c| &x[c * stride..][..k]).collect() } else { Vec::new() }, k);
    let mut jobs: [Option<(&Matrix, Disjoint)>; 3] = [None, None, None];
    for (j, p) in jobs.iter_mut().zip(products.iter_mut()) {
        *j = Some((p.w, Disjoint::new(p.out)));
    }
    let total: usize = jobs.iter().flatten().map(|(w, _)| w.rows).sum();
    // Several chunks per thread, so a late or descheduled thread's share is picked up by others.
    // Whole tiles of 16 rows, so that packed matrices' chunks start on a tile.
    let grain = (total / (pool.threads() * 8)).clamp(16, 256).next_multiple_of(int::packed::TILE);
    pool.run(total, grain, &|items| {
        let mut base = 0;
        for (w, out) in jobs.iter().flatten() {
            let (lo, hi) = (items.start.max(base), items.end.min(base + w.rows));
            if lo < hi {
                rows(isa, g, if fast(w) { Kind::Int(&acts) } else { Kind::Exact(&cols) }, w, out, lo - base..hi - base);
            }
            base += w.rows;
        }
    });
    drop(cols);
    ALIGNED.set(lines);
    ACTIVATIONS.set(acts);
}

/// Which kernels a product's rows meet the columns with.
#[derive(Clone, Copy)]
enum Kind<'a, 'c> {
    Exact(&'a Columns<'c>),
    Int(&'a Activations),
}

/// Copies the `n` columns of `x` (`k` floats each) into `lines` so each starts on a cache line,
/// unless they already do (then returns false): a 16-float load that straddles two lines costs
/// the kernels twice as much.
fn aligned(x: &[f32], n: usize, k: usize, lines: &mut Vec<Line>) -> bool {
    if (x.as_ptr() as usize).is_multiple_of(64) && k.is_multiple_of(16) {
        return false;
    }
    let stride = k.next_multiple_of(16);
    kernels::grow(lines, n * stride / 16);
    for (dst, col) in Line::floats_mut(lines).chunks_exact_mut(stride).zip(x.chunks_exact(k)) {
        dst[..k].copy_from_slice(col);
    }
    true
}

thread_local! {
    /// The buffer of the thread's last aligned copy of columns, for its next: a fresh one would
    /// be mapped and faulted in for every product.
    static ALIGNED: std::cell::Cell<Vec<Line>> = const { std::cell::Cell::new(Vec::new()) };
    /// The thread's last quantized columns' buffers, for its next product, likewise.
    static ACTIVATIONS: std::cell::Cell<Activations> = std::cell::Cell::new(Activations::default());
}

/// Rows `rows` of `w` for every column: the unit of work one thread does without a break.
fn rows(isa: Isa, model: &Gguf, kind: Kind, w: &Matrix, out: &Disjoint, rows: std::ops::Range<usize>) {
    if let (Kind::Int(acts), Some(p)) = (kind, &w.packed) {
        const TILE: usize = int::packed::TILE;
        let tiles = rows.start.div_ceil(TILE)..(rows.end / TILE).min(p.tiles());
        if !tiles.is_empty() {
            // SAFETY: the kernel writes `dst[c * w.rows + r]` for c < n and the tiles' rows,
            // which lie inside `rows`: outputs this call alone owns (below).
            unsafe { int::packed::gemv(p, tiles.clone(), acts, out.at(tiles.start * TILE), w.rows) };
            let (lo, hi) = (rows.start..tiles.start * TILE, tiles.end * TILE..rows.end);
            for part in [lo, hi] {
                if !part.is_empty() {
                    unpacked(isa, model, kind, w, out, part);
                }
            }
            return;
        }
    }
    unpacked(isa, model, kind, w, out, rows)
}

/// `rows`, reading `w`'s rows from the file.
fn unpacked(isa: Isa, model: &Gguf, kind: Kind, w: &Matrix, out: &Disjoint, rows: std::ops::Range<usize>) {
    let m = Rows { ty: w.fast, bytes: w.rows(model, rows.clone()), row_bytes: w.row_bytes, n_rows: rows.len() };
    // This call alone writes rows `rows` of every column of `out` (`matmul` hands each row to
    // one chunk), and `matmul`'s assert keeps them inside the buffer.
    let dst = out.at(rows.start);
    // SAFETY: the kernel writes `dst[c * w.rows + r]` for c < n and r < rows.len(): exactly the
    // outputs this call alone owns (above).
    unsafe {
        match kind {
            Kind::Exact(cols) => kernels::gemv(isa, &m, w.k, cols, dst, w.rows),
            Kind::Int(acts) => int::gemv(isa, &m, w.k, acts, dst, w.rows),
        }
    }
}

//! Weight matrices as views into the mapped file, and the threaded matrix product over them.

use crate::kernels::{self, FastType, Isa, Rows};
use crate::pool::{Disjoint, ThreadPool};
use crate::EngineError;
use dgr_gguf::{GgmlType, Gguf};

/// A `rows × k` weight matrix stored row-major in the GGUF file (ggml dims `[k, rows]`).
#[derive(Clone, Debug)]
pub(crate) struct Matrix {
    ty: GgmlType,
    fast: Option<FastType>,
    pub rows: usize,
    pub k: usize,
    /// Where the rows lie: a mapped region of the file, and the offset into it.
    region: usize,
    offset: usize,
    row_bytes: usize,
}

impl Matrix {
    pub fn load(g: &Gguf, name: &str, k: usize, rows: usize) -> Result<Matrix, EngineError> {
        let t = g.tensor(name).ok_or_else(|| EngineError::MissingTensor(name.into()))?;
        if t.dims != [k as u64, rows as u64] {
            return Err(EngineError::BadShape { name: name.into(), expected: vec![k as u64, rows as u64], found: t.dims.clone() });
        }
        let fast = FastType::of(t.ty);
        let dequantizable = matches!(
            t.ty,
            GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K
        );
        if fast.is_none() && !dequantizable {
            return Err(EngineError::UnsupportedType { name: name.into(), ty: t.ty.name() });
        }
        let row_bytes = t.ty.row_bytes(k as u64).ok_or_else(|| EngineError::BadShape {
            name: name.into(),
            expected: vec![k as u64, rows as u64],
            found: t.dims.clone(),
        })? as usize;
        let (region, offset) = g.tensor_location(t).ok_or_else(|| EngineError::MissingTensor(name.into()))?;
        Ok(Matrix { ty: t.ty, fast, rows, k, region, offset, row_bytes })
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

/// One product of a batch: `out[c * w.rows + r] = w.row(r) · x[c]` for every column `c`.
pub(crate) struct Product<'a> {
    pub w: &'a Matrix,
    pub out: &'a mut [f32],
}

/// Columns per tile: as many as keep the tile of activations in L1 (at most a kernel's width),
/// so each weight block is dequantized once per tile and multiplied from registers and L1.
fn tile_cols(k: usize) -> usize {
    match (24 * 1024) / (4 * k.max(1)) {
        n if n >= 8 => 8,
        n if n >= 4 => 4,
        n if n >= 2 => 2,
        _ => 1,
    }
}

/// Computes every product for the `n` columns of `x` (each `k` floats, contiguous) in one pool
/// job over the products' rows, handed out in chunks. Each row is computed completely by one
/// thread, so a result depends on neither the thread count nor the other columns.
pub(crate) fn matmul(pool: &ThreadPool, isa: Isa, g: &Gguf, x: &[f32], n: usize, products: &mut [Product]) {
    // At most three products share a job (q, k, v); held in an array, not allocated per call.
    assert!(products.len() <= 3);
    for p in products.iter() {
        assert!(x.len() >= n * p.w.k && p.out.len() >= n * p.w.rows);
    }
    let mut jobs: [Option<(&Matrix, Disjoint)>; 3] = [None, None, None];
    for (j, p) in jobs.iter_mut().zip(products.iter_mut()) {
        *j = Some((p.w, Disjoint::new(p.out)));
    }
    let total: usize = jobs.iter().flatten().map(|(w, _)| w.rows).sum();
    // Several chunks per thread, so a late or descheduled thread's share is picked up by others.
    let grain = (total / (pool.threads() * 8)).clamp(16, 256);
    pool.run(total, grain, &|items| {
        let mut base = 0;
        for (w, out) in jobs.iter().flatten() {
            let (lo, hi) = (items.start.max(base), items.end.min(base + w.rows));
            if lo < hi {
                rows(isa, g, x, n, w, out, lo - base..hi - base);
            }
            base += w.rows;
        }
    });
}

/// Rows `rows` of `w` for every column: the unit of work one thread does without a break.
fn rows(isa: Isa, model: &Gguf, x: &[f32], n: usize, w: &Matrix, out: &Disjoint, rows: std::ops::Range<usize>) {
    let k = w.k;
    let tile = tile_cols(k);
    let mut scratch = Vec::new();
    let mut c0 = 0;
    while c0 < n {
        let g = kernels::group((n - c0).min(tile));
        let xs: [&[f32]; kernels::MAX_COLS] = std::array::from_fn(|j| if j < g { &x[(c0 + j) * k..(c0 + j + 1) * k] } else { &[] });
        // This call alone writes rows `rows` of columns c0..c0 + g of `out` (`matmul` hands each
        // row to one chunk), and `matmul`'s assert keeps them inside the buffer.
        let dst = out.at(c0 * w.rows + rows.start);
        match w.fast {
            Some(ty) => {
                let bytes = w.rows(model, rows.clone());
                // SAFETY: the kernel writes `dst[c * w.rows + r]` for c < g and r < rows.len():
                // exactly the outputs this call alone owns (above).
                unsafe { kernels::gemv(isa, &Rows { ty, bytes, row_bytes: w.row_bytes, n_rows: rows.len() }, k, &xs[..g], dst, w.rows) };
            }
            None => {
                // Types without a SIMD dequantizer: one row at a time through f32.
                scratch.resize(k, 0f32);
                for r in rows.clone() {
                    if dgr_gguf::quant::dequantize_row(w.ty, w.rows(model, r..r + 1), &mut scratch).is_err() {
                        scratch.iter_mut().for_each(|v| *v = f32::NAN); // unreachable: checked at load
                    }
                    let f = Rows { ty: FastType::F32, bytes: as_bytes(&scratch), row_bytes: 4 * k, n_rows: 1 };
                    // SAFETY: one row: the kernel writes `dst[(r - rows.start) + c * w.rows]` for
                    // c < g, outputs of row `r`, which this call alone owns (above).
                    unsafe { kernels::gemv(isa, &f, k, &xs[..g], dst.add(r - rows.start), w.rows) };
                }
            }
        }
        c0 += g;
    }
}

fn as_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: the bytes of `v` are initialized (f32 has no padding), every byte pattern is a
    // valid u8, u8 has alignment 1, and the slice borrows `v` for its lifetime.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

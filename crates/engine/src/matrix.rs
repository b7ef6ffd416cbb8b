//! Weight matrices as views into the mapped file, and the threaded matrix product over them.

use crate::kernels::{self, FastType, Isa};
use crate::pool::{share, ThreadPool};
use crate::EngineError;
use dgr_gguf::{GgmlType, Gguf};

/// A `rows × k` weight matrix stored row-major in the GGUF file (ggml dims `[k, rows]`).
#[derive(Clone, Debug)]
pub(crate) struct Matrix {
    ty: GgmlType,
    fast: Option<FastType>,
    pub rows: usize,
    pub k: usize,
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
        let data = g.tensor_data(t);
        let offset = data.as_ptr() as usize - g.file_bytes().as_ptr() as usize;
        Ok(Matrix { ty: t.ty, fast, rows, k, offset, row_bytes })
    }

    fn row<'f>(&self, file: &'f [u8], r: usize) -> &'f [u8] {
        let start = self.offset + r * self.row_bytes;
        &file[start..start + self.row_bytes]
    }

    /// Row `r` as f32 (for embeddings).
    pub fn dequantize_row(&self, file: &[u8], r: usize, out: &mut [f32]) -> Result<(), EngineError> {
        Ok(dgr_gguf::quant::dequantize_row(self.ty, self.row(file, r), out)?)
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

struct SendPtr(*mut f32);
// SAFETY: participants write disjoint rows of each output (see `matmul`).
unsafe impl Sync for SendPtr {}
unsafe impl Send for SendPtr {}

/// Columns per tile: the tile of activations stays in L2 while the weight rows stream by.
fn tile_cols(k: usize) -> usize {
    ((128 * 1024) / (4 * k.max(1))).clamp(kernels::MAX_COLS, 256) / kernels::MAX_COLS * kernels::MAX_COLS
}

/// Computes every product for the `n` columns of `x` (each `k` floats, contiguous) in one pool
/// job. Each participant owns a contiguous share of every matrix's rows and computes each of its
/// rows completely, so a result depends on neither the thread count nor the other columns.
pub(crate) fn matmul(pool: &ThreadPool, isa: Isa, file: &[u8], x: &[f32], n: usize, products: &mut [Product]) {
    for p in products.iter() {
        assert!(x.len() >= n * p.w.k && p.out.len() >= n * p.w.rows);
    }
    let outs: Vec<SendPtr> = products.iter_mut().map(|p| SendPtr(p.out.as_mut_ptr())).collect();
    let ws: Vec<&Matrix> = products.iter().map(|p| p.w).collect();
    pool.run(&|i, threads| {
        let mut scratch = Vec::new();
        let mut sums = [0f32; kernels::MAX_COLS];
        for (w, out) in ws.iter().zip(&outs) {
            let k = w.k;
            let tile = tile_cols(k);
            let rows = share(w.rows, i, threads);
            for c0 in (0..n).step_by(tile) {
                let c1 = (c0 + tile).min(n);
                for r in rows.clone() {
                    let (ty, row) = match w.fast {
                        Some(ty) => (ty, w.row(file, r)),
                        None => {
                            scratch.resize(k, 0f32);
                            // Checked at load: the row length is whole blocks of this type.
                            if dgr_gguf::quant::dequantize_row(w.ty, w.row(file, r), &mut scratch).is_err() {
                                scratch.iter_mut().for_each(|v| *v = f32::NAN);
                            }
                            (FastType::F32, as_bytes(&scratch))
                        }
                    };
                    for g0 in (c0..c1).step_by(kernels::MAX_COLS) {
                        let g1 = (g0 + kernels::MAX_COLS).min(c1);
                        let xs: [&[f32]; kernels::MAX_COLS] =
                            std::array::from_fn(|j| if g0 + j < g1 { &x[(g0 + j) * k..(g0 + j + 1) * k] } else { &[] });
                        kernels::dot_row(isa, ty, row, k, &xs[..g1 - g0], &mut sums[..g1 - g0]);
                        for (j, s) in sums[..g1 - g0].iter().enumerate() {
                            // SAFETY: row r of column g0 + j is inside `out` (asserted above) and
                            // only this participant owns row r.
                            unsafe { *out.0.add((g0 + j) * w.rows + r) = *s };
                        }
                    }
                }
            }
        }
    });
}

fn as_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding or invalid bit patterns, and u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

//! Weight matrices on the GPU: the rows as the file stores them, in chunks of whole rows that a
//! binding can span, and the matrix product kernel of each type over them.

use super::device::Ctx;
use super::GpuBuf;
use crate::EngineError;
use dgr_gguf::{GgmlType, Gguf};
use std::ops::Range;

/// Columns one matmul workgroup takes (`COLS` in matmul.wgsl).
const COLS: usize = 16;

/// The types the kernels read, with their `deq32_*` function in quant.wgsl.
fn kernel_of(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "deq32_f32",
        GgmlType::F16 => "deq32_f16",
        GgmlType::BF16 => "deq32_bf16",
        GgmlType::Q4_0 => "deq32_q4_0",
        GgmlType::Q4_1 => "deq32_q4_1",
        GgmlType::Q5_0 => "deq32_q5_0",
        GgmlType::Q5_1 => "deq32_q5_1",
        GgmlType::Q8_0 => "deq32_q8_0",
        GgmlType::Q2_K => "deq32_q2_k",
        GgmlType::Q3_K => "deq32_q3_k",
        GgmlType::Q4_K => "deq32_q4_k",
        GgmlType::Q5_K => "deq32_q5_k",
        GgmlType::Q6_K => "deq32_q6_k",
        _ => return None,
    })
}

/// Elements and bytes of the blocks the kernel steps through: the file's blocks, or runs of
/// 32 values of a float type.
fn kernel_block(ty: GgmlType) -> (usize, usize) {
    match ty.block_size() {
        1 => (32, 32 * ty.type_size()),
        bs => (bs, ty.type_size()),
    }
}

/// A `rows × k` matrix (ggml dims `[k, rows]`): in device memory in chunks of whole rows, or
/// (an embedding table) left in the mapped file for the host to look rows up in.
pub struct GpuMatrix {
    ty: GgmlType,
    k: usize,
    rows: usize,
    row_bytes: usize,
    name: String,
    chunks: Vec<(wgpu::Buffer, Range<usize>)>,
}

/// Checks tensor `name` is a `rows × k` matrix of a type the kernels read; its row bytes.
fn check(g: &Gguf, name: &str, k: usize, rows: usize) -> Result<(GgmlType, usize), EngineError> {
    let t = g.tensor(name).filter(|t| g.is_mapped(t)).ok_or_else(|| EngineError::MissingTensor(name.into()))?;
    let shape = || EngineError::BadShape { name: name.into(), expected: vec![k as u64, rows as u64], found: t.dims.clone() };
    if t.dims != [k as u64, rows as u64] {
        return Err(shape());
    }
    if kernel_of(t.ty).is_none() {
        return Err(EngineError::UnsupportedType { name: name.into(), ty: t.ty.name() });
    }
    if !k.is_multiple_of(32) {
        return Err(EngineError::Unsupported(format!("tensor {name:?}: rows of {k} values on the GPU (it reads runs of 32)")));
    }
    let row_bytes = t.ty.row_bytes(k as u64).ok_or_else(shape)? as usize;
    if g.tensor_data(t).len() != rows * row_bytes {
        return Err(shape());
    }
    Ok((t.ty, row_bytes))
}

impl GpuMatrix {
    /// Uploads tensor `name`'s rows as stored.
    pub(crate) fn upload(ctx: &Ctx, g: &Gguf, name: &str, k: usize, rows: usize) -> Result<GpuMatrix, EngineError> {
        let (ty, row_bytes) = check(g, name, k, rows)?;
        let data = g.tensor_data(g.tensor(name).expect("checked"));
        let per_chunk = (ctx.max_binding() as usize / row_bytes).max(1);
        let chunks = (0..rows)
            .step_by(per_chunk)
            .map(|r0| {
                let r1 = (r0 + per_chunk).min(rows);
                (ctx.buffer_with(&data[r0 * row_bytes..r1 * row_bytes]), r0..r1)
            })
            .collect();
        Ok(GpuMatrix { ty, k, rows, row_bytes, name: name.into(), chunks })
    }

    /// Tensor `name` as an embedding table, left in the file.
    pub fn host(g: &Gguf, name: &str, k: usize, rows: usize) -> Result<GpuMatrix, EngineError> {
        let (ty, row_bytes) = check(g, name, k, rows)?;
        Ok(GpuMatrix { ty, k, rows, row_bytes, name: name.into(), chunks: Vec::new() })
    }

    pub fn bytes(&self) -> usize {
        self.rows * self.row_bytes
    }

    /// The rows of `tokens`, dequantized on the host, each times `scale` in f64 when set.
    pub fn lookup(&self, g: &Gguf, tokens: &[u32], scale: Option<f64>) -> Result<Vec<f32>, EngineError> {
        let data = g.tensor(&self.name).map(|t| g.tensor_data(t)).unwrap_or(&[]);
        let mut x = vec![0f32; tokens.len() * self.k];
        for (row, &tok) in x.chunks_exact_mut(self.k).zip(tokens) {
            let at = tok as usize * self.row_bytes;
            let src = data.get(at..at + self.row_bytes).ok_or(EngineError::TokenOutOfRange { token: tok, vocab: self.rows })?;
            dgr_gguf::quant::dequantize_row(self.ty, src, row)?;
            if let Some(scale) = scale {
                row.iter_mut().for_each(|v| *v = (*v as f64 * scale) as f32);
            }
        }
        Ok(x)
    }

    /// `out[c * rows + r] = row r · x[c]` for the `n` columns of `x`: a dispatch per chunk of
    /// rows and per group of columns that the bindings can span.
    pub(crate) fn matmul(&self, ctx: &Ctx, x: &GpuBuf, n: usize, out: &mut GpuBuf) {
        let deq = kernel_of(self.ty).expect("checked at load");
        let (bs, bb) = kernel_block(self.ty);
        let kernel = ctx.kernel(&format!("matmul_{deq}"), || {
            format!(
                "{}\nconst BS: u32 = {bs}u;\nconst BB: u32 = {bb}u;\nfn deq32(o: u32, s: u32) {{ {deq}(o, s); }}\n{}\n{}",
                include_str!("shaders/common.wgsl"),
                include_str!("shaders/quant.wgsl"),
                include_str!("shaders/matmul.wgsl"),
            )
        });
        // Columns per dispatch: all of them where the bindings allow, else whole groups of 64
        // (so every binding's offset is a multiple of 256 bytes).
        let widest = self.rows.max(self.k) as u64 * 4;
        let fits = (ctx.max_binding() / widest) as usize;
        let per = if fits >= n { n } else { (fits / 64 * 64).max(64) };
        let mut c0 = 0;
        while c0 < n {
            let cols = per.min(n - c0);
            let xb = (&x.buf, (c0 * self.k * 4) as u64, (cols * self.k * 4) as u64);
            let ob = (&out.buf, (c0 * self.rows * 4) as u64, (cols * self.rows * 4) as u64);
            for (buf, rows) in &self.chunks {
                let groups = rows.len().div_ceil(64) as u32;
                let gx = groups.min(32768);
                let params =
                    [self.k as u32, rows.len() as u32, cols as u32, self.row_bytes as u32, rows.start as u32, self.rows as u32, gx];
                ctx.dispatch(&kernel, &params, &[(buf, 0, buf.size()), xb, ob], [gx, groups.div_ceil(gx), cols.div_ceil(COLS) as u32]);
            }
            c0 += cols;
        }
    }
}

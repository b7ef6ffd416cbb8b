//! The GPU backend on wgpu (Vulkan, Metal, DX12): weights as the file stores them in device
//! buffers, read block by block by WGSL kernels (`shaders/`); activations, rotations and every
//! sequence's KV cache in device memory; only hidden rows and logits read back. Every kernel
//! reduces in a fixed order that depends only on the shapes (a row's width, the positions
//! attended), so a batch equals each sequence alone and a split route equals the unsplit
//! model, bitwise, on one adapter and driver (which the engine id names).

pub(crate) mod device;
mod kv;
mod matrix;

pub use device::{adapter_memory, adapters, AdapterIdentity, DeviceMemory};
pub use kv::GpuKv;

use crate::backend::cpu::ops;
use crate::backend::{Backend, Heads, KvShape, Product};
use crate::{Activation, BackendKind, EngineError, EngineSpec, KvDtype, Numerics, RopeStyle, SeqState};
use device::Ctx;
use dgr_gguf::Gguf;
use matrix::GpuMatrix;
use std::ops::Range;
use std::sync::Arc;

/// Exact only: f32 activations against the stored blocks.
pub(crate) const NUMERICS: &[Numerics] = &[Numerics::Exact];
/// The attention kernel's private copies of a head: the longest head it takes.
const MAX_HEAD_DIM: usize = 256;

/// Floats in device memory: whole rows of a width the operation knows.
pub struct GpuBuf {
    buf: wgpu::Buffer,
    len: usize,
}

impl GpuBuf {
    fn bytes(&self) -> u64 {
        4 * self.len as u64
    }
}

/// A forward's rows: row t is sequence `seq_of[t]`'s at position `pos_of[t]`; a sequence's rows
/// lie together, in order.
pub struct GpuRows {
    seq_of: Vec<usize>,
    pos_of: Vec<usize>,
}

/// Per row, the (cos, sin) of each rotated pair, as f32 in device memory.
pub struct GpuRope {
    table: GpuBuf,
    pairs: usize,
}

/// One stage's GPU: the shared device of its adapter, and the mapped model (embedding rows are
/// looked up from the file on the host: a few rows a step, no table in device memory).
pub struct Gpu {
    ctx: Arc<Ctx>,
    gguf: Arc<Gguf>,
}

impl Gpu {
    pub(crate) fn identity(&self) -> &AdapterIdentity {
        &self.ctx.identity
    }

    pub(crate) fn memory(&self) -> Option<DeviceMemory> {
        self.ctx.memory()
    }

    pub(crate) fn lose_device(&self) {
        self.ctx.device.destroy();
    }

    fn kernel(&self, name: &str, source: &str) -> Arc<wgpu::ComputePipeline> {
        self.ctx.kernel(name, || format!("{}\n{source}", include_str!("shaders/common.wgsl")))
    }

    /// `n` invocations in workgroups of `size`, over a 2-D grid where one dimension is too few.
    fn grid(n: usize, size: usize) -> [u32; 3] {
        let groups = n.div_ceil(size) as u32;
        let x = groups.min(65535);
        [x, groups.div_ceil(x.max(1)), 1]
    }

    fn whole(b: &GpuBuf) -> (&wgpu::Buffer, u64, u64) {
        (&b.buf, 0, b.bytes())
    }
}

impl Backend for Gpu {
    type Matrix = GpuMatrix;
    type Vector = GpuBuf;
    type Buf = GpuBuf;
    type Kv = GpuKv;
    type Rows = GpuRows;
    type Rope = GpuRope;

    const KIND: BackendKind = BackendKind::Gpu;

    fn adapter(&self) -> Option<u32> {
        Some(self.ctx.identity.digest())
    }

    fn open(model: &Arc<Gguf>, spec: &EngineSpec) -> Result<Gpu, EngineError> {
        Ok(Gpu { ctx: Ctx::open(spec.adapter)?, gguf: model.clone() })
    }

    fn check_config(&self, cfg: &crate::ModelConfig) -> Result<(), EngineError> {
        if cfg.head_dim > MAX_HEAD_DIM {
            return Err(EngineError::Unsupported(format!("heads of {} values on the GPU (at most {MAX_HEAD_DIM})", cfg.head_dim)));
        }
        Ok(())
    }

    /// Uploads the matrix; a device that ran out of memory (or failed otherwise) refuses it
    /// here, while the model opens.
    fn matrix(&self, name: &str, k: usize, rows: usize) -> Result<GpuMatrix, EngineError> {
        let m = GpuMatrix::upload(&self.ctx, &self.gguf, name, k, rows)?;
        self.ctx.check()?;
        Ok(m)
    }

    fn table(&self, name: &str, k: usize, rows: usize) -> Result<GpuMatrix, EngineError> {
        GpuMatrix::host(&self.gguf, name, k, rows)
    }

    fn matrix_bytes(&self, m: &GpuMatrix) -> usize {
        m.bytes()
    }

    fn vector(&self, values: Vec<f32>) -> GpuBuf {
        self.upload(values)
    }

    fn alloc(&self, len: usize) -> GpuBuf {
        GpuBuf { buf: self.ctx.buffer(4 * len as u64), len }
    }

    fn upload(&self, data: Vec<f32>) -> GpuBuf {
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        GpuBuf { buf: self.ctx.buffer_with(&bytes), len: data.len() }
    }

    fn read(&self, buf: &GpuBuf, at: Range<usize>, out: &mut Vec<f32>) -> Result<(), EngineError> {
        if at.start > at.end || at.end > buf.len {
            return Err(EngineError::BadInput(format!("reading floats {at:?} of {}", buf.len)));
        }
        let bytes = self.ctx.read(&buf.buf, 4 * at.start as u64, 4 * at.len() as u64)?;
        out.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        Ok(())
    }

    fn gather(&self, x: &GpuBuf, width: usize, rows: &[usize]) -> GpuBuf {
        let out = self.alloc(rows.len() * width);
        let rb = 4 * width as u64;
        self.ctx.record(|enc| {
            for (i, &t) in rows.iter().enumerate() {
                enc.copy_buffer_to_buffer(&x.buf, t as u64 * rb, &out.buf, i as u64 * rb, rb);
            }
        });
        out
    }

    fn embed(&self, table: &GpuMatrix, tokens: &[u32], scale: Option<f64>) -> Result<GpuBuf, EngineError> {
        Ok(self.upload(table.lookup(&self.gguf, tokens, scale)?))
    }

    fn matmul(&self, x: &GpuBuf, n: usize, products: &mut [Product<'_, Gpu>]) {
        for p in products.iter_mut() {
            p.w.matmul(&self.ctx, x, n, p.out);
        }
    }

    fn rms_norm(&self, x: &GpuBuf, w: &GpuBuf, eps: f32, out: &mut GpuBuf) {
        let k = self.kernel("rms_norm", include_str!("shaders/rms_norm.wgsl"));
        let rows = x.len / w.len;
        self.ctx.dispatch(
            &k,
            &[w.len as u32, eps.to_bits(), rows as u32],
            &[Self::whole(x), Self::whole(w), Self::whole(out)],
            Self::grid(rows, 64),
        );
    }

    fn rms_norm_heads(&self, x: &mut GpuBuf, w: &GpuBuf, eps: f32) {
        let k = self.kernel("rms_norm_heads", include_str!("shaders/rms_norm_heads.wgsl"));
        let heads = x.len / w.len;
        self.ctx.dispatch(&k, &[w.len as u32, eps.to_bits(), heads as u32], &[Self::whole(x), Self::whole(w)], Self::grid(heads, 64));
    }

    fn add_bias(&self, x: &mut GpuBuf, b: &GpuBuf) {
        self.add(x, b, b.len);
    }

    fn residual(&self, x: &mut GpuBuf, o: &GpuBuf, norm: Option<(&GpuBuf, f32)>, width: usize, _scratch: &mut GpuBuf) {
        let Some((w, eps)) = norm else { return self.add(x, o, x.len) };
        let k = self.kernel("residual_norm", include_str!("shaders/residual_norm.wgsl"));
        let rows = x.len / width;
        self.ctx.dispatch(
            &k,
            &[width as u32, eps.to_bits(), rows as u32],
            &[Self::whole(x), Self::whole(o), Self::whole(w)],
            Self::grid(rows, 64),
        );
    }

    fn activate(&self, act: Activation, gate: &mut GpuBuf, up: &GpuBuf, _width: usize) {
        let k = self.kernel("activate", include_str!("shaders/activate.wgsl"));
        let kind = match act {
            Activation::Silu => 0,
            Activation::GeluTanh => 1,
        };
        self.ctx.dispatch(&k, &[gate.len as u32, kind], &[Self::whole(gate), Self::whole(up)], Self::grid(gate.len, 256));
    }

    fn softcap(&self, logits: &mut GpuBuf, cap: f32) {
        let k = self.kernel("softcap", include_str!("shaders/softcap.wgsl"));
        // In pieces a binding can span, each a whole number of 64 floats (offsets stay aligned).
        let piece = (self.ctx.max_binding() / 4 / 64 * 64) as usize;
        let mut at = 0;
        while at < logits.len {
            let len = piece.min(logits.len - at);
            let binding = (&logits.buf, 4 * at as u64, 4 * len as u64);
            self.ctx.dispatch(&k, &[len as u32, cap.to_bits()], &[binding], Self::grid(len, 256));
            at += len;
        }
    }

    fn rows(&self, seq_of: Vec<usize>, pos_of: Vec<usize>) -> GpuRows {
        GpuRows { seq_of, pos_of }
    }

    fn rope_table(&self, rows: &GpuRows, rope_dim: usize, base: f32, scale: f64) -> GpuRope {
        let mut angles = Vec::new();
        let mut table = Vec::with_capacity(rows.pos_of.len() * rope_dim);
        for &p in &rows.pos_of {
            ops::rope_angles(p, rope_dim, base, scale, &mut angles);
            table.extend(angles.iter().flat_map(|&(c, s)| [c as f32, s as f32]));
        }
        GpuRope { table: self.upload(table), pairs: rope_dim / 2 }
    }

    fn rope(&self, x: &mut GpuBuf, width: usize, head_dim: usize, table: &GpuRope, style: RopeStyle) {
        let k = self.kernel("rope", include_str!("shaders/rope.wgsl"));
        let style = match style {
            RopeStyle::Adjacent => 0,
            RopeStyle::Halves => 1,
        };
        let total = x.len / width * (width / head_dim) * table.pairs;
        let params = [width as u32, head_dim as u32, table.pairs as u32, style, total as u32];
        self.ctx.dispatch(&k, &params, &[Self::whole(x), Self::whole(&table.table)], Self::grid(total, 256));
    }

    fn new_kv(&self, shape: KvShape) -> GpuKv {
        GpuKv::new(self.ctx.clone(), shape)
    }

    fn kv_row_bytes(&self, dtype: KvDtype, width: usize, block: usize) -> usize {
        4 * kv::row_words(dtype, width, block)
    }

    fn kv_reserve(&self, kv: &mut GpuKv, rows: usize) {
        kv.reserve(rows)
    }

    fn kv_append(&self, kv: &mut GpuKv, li: usize, k: &GpuBuf, v: &GpuBuf, rows: Range<usize>) {
        let (kernel, grid) = match kv.dtype() {
            KvDtype::F32 => return kv.append(li, &k.buf, &v.buf, rows),
            // An invocation a word.
            KvDtype::F16 => (
                self.kernel("kv_store", concat!(include_str!("shaders/half.wgsl"), include_str!("shaders/kv_store.wgsl"))),
                Self::grid(rows.len() * kv.row_words(), 256),
            ),
            // An invocation a row.
            KvDtype::Q8_0 => (
                self.kernel(
                    "kv_store_q8",
                    concat!(
                        include_str!("shaders/half.wgsl"),
                        include_str!("shaders/hadamard.wgsl"),
                        include_str!("shaders/kv_store_q8.wgsl")
                    ),
                ),
                Self::grid(rows.len(), 64),
            ),
        };
        let (kc, vc) = kv.layer(li);
        let params = [rows.start as u32, kv.width() as u32, rows.len() as u32, kv.positions() as u32, kv.block() as u32];
        for (src, dst) in [(k, kc), (v, vc)] {
            self.ctx.dispatch(&kernel, &params, &[Self::whole(src), (dst, 0, dst.size())], grid);
        }
    }

    fn kv_advance(&self, kv: &mut GpuKv, rows: usize) {
        kv.advance(rows)
    }

    /// One dispatch per sequence (its rows lie together), an invocation per (query head, row).
    fn attend(&self, kvs: &[&GpuKv], li: usize, rows: &GpuRows, heads: Heads, q: &GpuBuf, out: &mut GpuBuf) {
        let Heads { n_head, n_kv, dim, scale, window } = heads;
        let Some(first) = kvs.first() else { return };
        let k = match first.dtype() {
            KvDtype::F32 => self.kernel(
                "attend",
                concat!(include_str!("shaders/kv_f32.wgsl"), include_str!("shaders/kv_plain.wgsl"), include_str!("shaders/attend.wgsl")),
            ),
            KvDtype::F16 => self.kernel(
                "attend_f16",
                concat!(
                    include_str!("shaders/half.wgsl"),
                    include_str!("shaders/kv_f16.wgsl"),
                    include_str!("shaders/kv_plain.wgsl"),
                    include_str!("shaders/attend.wgsl")
                ),
            ),
            KvDtype::Q8_0 => self.kernel(
                "attend_q8",
                concat!(
                    include_str!("shaders/half.wgsl"),
                    include_str!("shaders/hadamard.wgsl"),
                    include_str!("shaders/kv_q8.wgsl"),
                    include_str!("shaders/attend.wgsl")
                ),
            ),
        };
        let mut t0 = 0;
        while t0 < rows.seq_of.len() {
            let seq = rows.seq_of[t0];
            let n = rows.seq_of[t0..].iter().take_while(|&&s| s == seq).count();
            let kv = kvs[seq];
            let (kc, vc) = kv.layer(li);
            let window = window.unwrap_or(0) as u32;
            let params = [
                t0 as u32,
                n_head as u32,
                (n_head / n_kv) as u32,
                dim as u32,
                rows.pos_of[t0] as u32,
                window,
                scale.to_bits(),
                kv.row_words() as u32,
                n as u32,
                kv.block() as u32,
                kv.width() as u32,
            ];
            let bindings = [Self::whole(q), (kc, 0, kc.size()), (vc, 0, vc.size()), Self::whole(out)];
            self.ctx.dispatch(&k, &params, &bindings, Self::grid(n_head * n, 64));
            t0 += n;
        }
    }
}

impl Gpu {
    /// `x[i] += y[i % width]` over all of `x`.
    fn add(&self, x: &mut GpuBuf, y: &GpuBuf, width: usize) {
        let k = self.kernel("add", include_str!("shaders/add.wgsl"));
        self.ctx.dispatch(&k, &[x.len as u32, width as u32], &[Self::whole(x), Self::whole(y)], Self::grid(x.len, 256));
    }
}

#[cfg(test)]
mod tests;

//! The CPU backend: SIMD kernels chosen at run time, the thread pool, weights as views into the
//! mapped file, activations in `Vec<f32>`, and the per-row operations (norms, RoPE, attention,
//! activations) over the [`KvCache`].

pub(crate) mod kernels;
pub(crate) mod kv;
pub(crate) mod matrix;
pub(crate) mod ops;
pub(crate) mod pages;
pub(crate) mod pool;

use crate::backend::{Backend, Heads, KvShape, KvStore, Product};
use crate::{Activation, BackendKind, EngineError, EngineSpec, Numerics, RopeStyle};
use dgr_gguf::Gguf;
use kernels::Isa;
use kv::{KvCache, Store};
use matrix::Matrix;
use pool::{Disjoint, ThreadPool};
use std::ops::Range;
use std::sync::Arc;

/// The numerics these kernels compute: exact (f32 activations) and fast (integer activations
/// for block-type weights, `kernels::int`), branched on in `matrix::matmul`.
pub(crate) const NUMERICS: &[crate::Numerics] = &[crate::Numerics::Exact, crate::Numerics::Fast];

/// One stage's CPU: the mapped model its matrices are views into, the instruction set, the
/// numerics and the stage's own thread pool.
pub struct Cpu {
    gguf: Arc<Gguf>,
    isa: Isa,
    numerics: Numerics,
    pool: ThreadPool,
}

impl Cpu {
    pub(crate) fn isa(&self) -> Isa {
        self.isa
    }

    pub(crate) fn threads(&self) -> usize {
        self.pool.threads()
    }
}

/// A forward's rows: row t is sequence `seq_of[t]`'s, at position `pos_of[t]`.
pub struct BatchRows {
    seq_of: Vec<usize>,
    pos_of: Vec<usize>,
}

impl KvStore for KvCache {
    fn owner(&self) -> u64 {
        self.stage_id
    }
}

impl Backend for Cpu {
    type Matrix = Matrix;
    type Vector = Vec<f32>;
    type Buf = Vec<f32>;
    type Kv = KvCache;
    type Rows = BatchRows;
    /// Per row, the (cos, sin) of each rotated pair.
    type Rope = Vec<Vec<(f64, f64)>>;

    const KIND: BackendKind = BackendKind::Cpu;

    fn open(model: &Arc<Gguf>, spec: &EngineSpec) -> Result<Cpu, EngineError> {
        let isa = spec.isa.unwrap_or_else(Isa::detect);
        Ok(Cpu { gguf: model.clone(), isa, numerics: spec.numerics, pool: ThreadPool::new(spec.threads) })
    }

    fn matrix(&self, name: &str, k: usize, rows: usize) -> Result<Matrix, EngineError> {
        let mut m = Matrix::load(&self.gguf, name, k, rows)?;
        if self.numerics == Numerics::Fast {
            m.pack(&self.gguf, self.isa, self.threads());
        }
        Ok(m)
    }

    fn table(&self, name: &str, k: usize, rows: usize) -> Result<Matrix, EngineError> {
        Matrix::load(&self.gguf, name, k, rows)
    }

    fn matrix_bytes(&self, m: &Matrix) -> usize {
        m.bytes()
    }

    fn vector(&self, values: Vec<f32>) -> Vec<f32> {
        values
    }

    fn alloc(&self, len: usize) -> Vec<f32> {
        vec![0f32; len]
    }

    fn upload(&self, data: Vec<f32>) -> Vec<f32> {
        data
    }

    fn read(&self, buf: &Vec<f32>, at: Range<usize>, out: &mut Vec<f32>) -> Result<(), EngineError> {
        out.extend_from_slice(&buf[at]);
        Ok(())
    }

    fn gather(&self, x: &Vec<f32>, width: usize, rows: &[usize]) -> Vec<f32> {
        let mut out = Vec::with_capacity(rows.len() * width);
        rows.iter().for_each(|&t| out.extend_from_slice(&x[t * width..(t + 1) * width]));
        out
    }

    fn embed(&self, table: &Matrix, tokens: &[u32], scale: Option<f64>) -> Result<Vec<f32>, EngineError> {
        let h = table.k;
        let mut x = vec![0f32; tokens.len() * h];
        for (row, &tok) in x.chunks_exact_mut(h).zip(tokens) {
            table.dequantize_row(&self.gguf, tok as usize, row)?;
            if let Some(scale) = scale {
                row.iter_mut().for_each(|v| *v = (*v as f64 * scale) as f32);
            }
        }
        Ok(x)
    }

    fn matmul(&self, x: &Vec<f32>, n: usize, products: &mut [Product<'_, Cpu>]) {
        matrix::matmul(&self.pool, self.isa, self.numerics, &self.gguf, x, n, products)
    }

    fn rms_norm(&self, x: &Vec<f32>, w: &Vec<f32>, eps: f32, out: &mut Vec<f32>) {
        for (xt, ot) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
            ops::rms_norm(xt, w, eps, ot);
        }
    }

    fn rms_norm_heads(&self, x: &mut Vec<f32>, w: &Vec<f32>, eps: f32) {
        ops::rms_norm_heads(x, w, eps);
    }

    fn add_bias(&self, x: &mut Vec<f32>, b: &Vec<f32>) {
        x.chunks_exact_mut(b.len()).for_each(|xt| add(xt, b));
    }

    fn residual(&self, x: &mut Vec<f32>, o: &Vec<f32>, norm: Option<(&Vec<f32>, f32)>, width: usize, scratch: &mut Vec<f32>) {
        let Some((w, eps)) = norm else { return add(x, o) };
        for ((xt, ot), st) in x.chunks_exact_mut(width).zip(o.chunks_exact(width)).zip(scratch.chunks_exact_mut(width)) {
            ops::rms_norm(ot, w, eps, st);
            add(xt, st);
        }
    }

    /// Row by row, spread over the pool (GELU's tanh is dear).
    fn activate(&self, act: Activation, gate: &mut Vec<f32>, up: &Vec<f32>, width: usize) {
        let rows = gate.len() / width;
        let out = Disjoint::new(gate);
        let grain = (rows / (4 * self.pool.threads())).max(4);
        self.pool.run(rows, grain, &|r| {
            // SAFETY: the pool hands each row to one chunk, so these rows are this call's alone.
            let g = unsafe { out.slice(r.start * width, r.len() * width) };
            let u = &up[r.start * width..r.end * width];
            ops::activate(self.isa, act, g, u)
        });
    }

    fn softcap(&self, logits: &mut Vec<f32>, cap: f32) {
        let cap = cap as f64;
        logits.iter_mut().for_each(|l| *l = (cap * (*l as f64 / cap).tanh()) as f32);
    }

    fn rows(&self, seq_of: Vec<usize>, pos_of: Vec<usize>) -> BatchRows {
        BatchRows { seq_of, pos_of }
    }

    fn rope_table(&self, rows: &BatchRows, rope_dim: usize, base: f32, scale: f64) -> Self::Rope {
        let mut angles = Vec::new();
        rows.pos_of
            .iter()
            .map(|&p| {
                ops::rope_angles(p, rope_dim, base, scale, &mut angles);
                angles.clone()
            })
            .collect()
    }

    fn rope(&self, x: &mut Vec<f32>, width: usize, head_dim: usize, table: &Self::Rope, style: RopeStyle) {
        for (row, angles) in x.chunks_exact_mut(width).zip(table) {
            ops::rope(row, head_dim, angles, style);
        }
    }

    fn new_kv(&self, shape: KvShape) -> KvCache {
        KvCache::new(shape)
    }

    fn kv_reserve(&self, kv: &mut KvCache, rows: usize) {
        kv.reserve(rows)
    }

    fn kv_append(&self, kv: &mut KvCache, li: usize, k: &Vec<f32>, v: &Vec<f32>, rows: Range<usize>) {
        let w = kv.width();
        kv.append(li, &k[rows.start * w..rows.end * w], &v[rows.start * w..rows.end * w]);
    }

    fn kv_advance(&self, kv: &mut KvCache, rows: usize) {
        kv.len += rows;
    }

    /// Every (row, KV head) a job, spread over the pool: the query heads sharing a KV head go
    /// together, so each key and value read serves them all and their chains of adds overlap —
    /// unless that leaves the pool too few jobs (a decode step's few rows), when each query head
    /// is a job of its own. A head's bits are the same either way. Row t's sequence has already
    /// cached its keys and values up to and including position pos_of[t].
    fn attend(&self, kvs: &[&KvCache], li: usize, rows: &BatchRows, heads: Heads, q: &Vec<f32>, att: &mut Vec<f32>) {
        let Heads { n_head, n_kv, dim: hd, scale, window } = heads;
        let qd = n_head * hd;
        let group = n_head / n_kv;
        let BatchRows { seq_of, pos_of } = rows;
        let together = if seq_of.len() * n_kv >= 4 * self.pool.threads() { group } else { 1 };
        let per_row = n_head / together;
        let jobs = seq_of.len() * per_row;
        let out = Disjoint::new(att);
        // Per sequence: the layer's keys and values, and the position in slot 0.
        let caches: Vec<(&Store, usize)> = kvs.iter().map(|kv| (&kv.store[li], kv.first_held(li))).collect();
        self.pool.run(jobs, 1, &|chunk| {
            SCRATCH.with_borrow_mut(|scratch| {
                for job in chunk {
                    let (t, head) = (job / per_row, job % per_row * together);
                    let (store, start) = caches[seq_of[t]];
                    let first = window.map_or(0, |w| (pos_of[t] + 1).saturating_sub(w));
                    let at = t * qd + head * hd;
                    // SAFETY: job (t, head) alone touches att[at..][..together * hd] (the heads
                    // head..head + together of row t: heads are `hd` apart and rows `qd = n_head *
                    // hd` apart), and `slice` checks the bounds.
                    let dst = unsafe { out.slice(at, together * hd) };
                    let qh = &q[at..at + together * hd];
                    let ctx = first - start..pos_of[t] + 1 - start;
                    ops::attend(self.isa, qh, hd, store, ctx, (head / group) * hd, scale, scratch, dst);
                }
            })
        });
    }
}

thread_local! {
    /// The attention scratch of the job at hand, kept per thread so that no job allocates.
    static SCRATCH: std::cell::RefCell<ops::Scratch> = std::cell::RefCell::new(ops::Scratch::default());
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

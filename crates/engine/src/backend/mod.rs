//! Where the model's operations run. The model (`crate::model`) writes each architecture's
//! forward once over the [`Backend`] trait; a backend holds the weights, the activations and
//! every sequence's KV cache in its own memory and computes the operations below on them.
//! `cpu`: SIMD kernels chosen at run time, a thread pool, weights as views into the mapped file.
//! `gpu`: WGSL kernels on wgpu (Vulkan, Metal, DX12) reading the file's blocks in device memory,
//! activations and KV caches there too.
//!
//! # What a backend implements
//! Every associated type is the backend's own: `Matrix` and `Vector` are weights it holds
//! (uploaded once when the model opens), `Buf` a buffer of f32 activations (rows of a width the
//! caller knows), `Kv` one sequence's KV cache over the layers it runs, `Rows` and `Rope` a
//! forward's per-row positions and rotations. The model never reads a `Buf` but through
//! [`Backend::read`] (hidden rows for the next stage, logits, normed rows) nor writes one but
//! through [`Backend::upload`] and [`Backend::embed`], so a GPU backend keeps activations and
//! the KV cache in device memory and copies only those.
//!
//! # What a backend guarantees
//! - **Fixed reduction order.** Every result element is computed by one reduction whose order
//!   depends only on the shapes (the row's width, the head, the positions attended), never on
//!   how many rows or sequences share the call, where a row lies in the buffer, or how the work
//!   is split over threads, workgroups or devices. Every operation is per row (norms, RoPE,
//!   bias, residual, activation, embedding, softcap), per (row, head) (attention over that
//!   row's own sequence) or per (row, output) (matmul). That is what makes a batch equal each
//!   sequence alone and a split route equal the unsplit model, bitwise: the invariance suites
//!   check it on every registered engine.
//! - **The same bits on every code path of one numerics**: a backend that chooses kernels at
//!   run time (instruction sets, subgroup sizes) gives the same bits from each, or keeps the
//!   choice in the engine's id.
//! - **KV as computed**: a position's stored keys and values depend only on that position's
//!   rows, and `Kv` copies blocks out and in as stored ([`crate::SeqState`]), never re-rounded.
//! - Its errors are typed ([`EngineError`]); nothing the model passes it in range panics.
//!
//! # Adding one
//! Implement [`Backend`] beside `cpu` and `gpu` (every architecture in `crate::model` then runs
//! on it, and `Model<NewBackend>` is an [`crate::Engine`]), add its [`crate::BackendKind`] (it
//! is part of the engine's id, so no batch mixes backends unknowingly), its numerics to
//! [`crate::available_numerics`] (it stores every KV dtype), and a variant to
//! [`crate::Stage`] that [`crate::open_engine`] opens: the suites that run one body over
//! [`crate::registered_specs`] then test it too.

pub(crate) mod cpu;
pub(crate) mod gpu;

use crate::{Activation, EngineError, EngineSpec, KvDtype, RopeStyle, SeqState};
use dgr_gguf::Gguf;
use std::ops::Range;
use std::sync::Arc;

/// One product of a batched matrix multiplication: `out[c * rows + r] = w.row(r) · x[c]` for
/// every column `c` of the input.
pub struct Product<'a, B: Backend> {
    pub w: &'a B::Matrix,
    pub out: &'a mut B::Buf,
}

/// A sequence's KV cache as the model sees it: the [`SeqState`] a worker reads, and the stage
/// that made it (a cache is only ever used by that stage).
pub trait KvStore: SeqState {
    fn owner(&self) -> u64;
}

/// What the model asks of a new KV cache.
#[derive(Clone, Debug)]
pub struct KvShape {
    /// Most positions it holds.
    pub capacity: usize,
    /// The model's layers the sequence runs.
    pub layers: Range<usize>,
    /// Per layer of `layers`: whether it attends through the sliding window of `window`.
    pub windowed: Vec<bool>,
    pub window: Option<usize>,
    /// Floats of one position's keys (and values) per layer.
    pub width: usize,
    pub dtype: KvDtype,
    /// q8_0's values per scale.
    pub block: usize,
    /// The stage that makes it ([`KvStore::owner`]).
    pub owner: u64,
}

/// How attention's heads lie in a row: `n_head` query heads of `dim` floats, sharing `n_kv` KV
/// heads in groups, scores scaled by `scale`, over the last `window` positions when set.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub n_head: usize,
    pub n_kv: usize,
    pub dim: usize,
    pub scale: f32,
    pub window: Option<usize>,
}

/// The operations a model's forward is written over (see the module's documentation for the
/// contract). Widths are in floats; a `Buf` holds whole rows of the width its operation names.
pub trait Backend: Send + Sized + 'static {
    type Matrix: Send + Sync + 'static;
    type Vector: Send + Sync + 'static;
    type Buf;
    type Kv: KvStore;
    type Rows;
    type Rope;

    const KIND: crate::BackendKind;

    /// The digest of the device's identity where the same kernels may give other bits on
    /// another device of the same kind (a GPU adapter and driver); part of the engine id.
    fn adapter(&self) -> Option<u32> {
        None
    }

    /// The backend for `spec` over `model` (its numerics already checked).
    fn open(model: &Arc<Gguf>, spec: &EngineSpec) -> Result<Self, EngineError>;

    /// Refuses a model whose shapes this backend's kernels cannot run.
    fn check_config(&self, _cfg: &crate::ModelConfig) -> Result<(), EngineError> {
        Ok(())
    }

    /// Holds tensor `name` of the model, a `rows × k` matrix (ggml dims `[k, rows]`), for
    /// products (as stored, or laid out anew for the backend's kernels).
    fn matrix(&self, name: &str, k: usize, rows: usize) -> Result<Self::Matrix, EngineError>;
    /// Holds tensor `name` as an embedding table: as stored, its rows only looked up by `embed`.
    fn table(&self, name: &str, k: usize, rows: usize) -> Result<Self::Matrix, EngineError>;
    /// Bytes of `m` as stored, which a forward reads.
    fn matrix_bytes(&self, m: &Self::Matrix) -> usize;
    /// Holds a weight vector (a norm's or a bias's).
    fn vector(&self, values: Vec<f32>) -> Self::Vector;

    /// A zeroed buffer of `len` floats.
    fn alloc(&self, len: usize) -> Self::Buf;
    /// A buffer holding `data`.
    fn upload(&self, data: Vec<f32>) -> Self::Buf;
    /// Appends floats `at` of `buf` to `out`: the only way activations come back.
    fn read(&self, buf: &Self::Buf, at: Range<usize>, out: &mut Vec<f32>) -> Result<(), EngineError>;
    /// Rows `rows` of `x` (rows of `width`), in that order, as a new buffer.
    fn gather(&self, x: &Self::Buf, width: usize, rows: &[usize]) -> Self::Buf;

    /// Rows of `table` (a `rows × width` matrix) for `tokens`, each times `scale` in f64 when set.
    fn embed(&self, table: &Self::Matrix, tokens: &[u32], scale: Option<f64>) -> Result<Self::Buf, EngineError>;

    /// Every product's rows for the `n` columns of `x` (each `k` floats, every product's `k`), at
    /// most three products in one call (they share its work and its quantized columns).
    fn matmul(&self, x: &Self::Buf, n: usize, products: &mut [Product<'_, Self>]);

    /// `out = x / rms(x) * w` for each row of `x` (rows of `w`'s width).
    fn rms_norm(&self, x: &Self::Buf, w: &Self::Vector, eps: f32, out: &mut Self::Buf);
    /// `rms_norm` in place on each head (of `w`'s width) of every row.
    fn rms_norm_heads(&self, x: &mut Self::Buf, w: &Self::Vector, eps: f32);
    /// Adds `b` to every row of `x` (rows of `b`'s width).
    fn add_bias(&self, x: &mut Self::Buf, b: &Self::Vector);
    /// `x += o`, with `o` normed by `norm` first when given (gemma3's post-norms; `scratch` takes
    /// the normed rows). Rows of `width`.
    fn residual(&self, x: &mut Self::Buf, o: &Self::Buf, norm: Option<(&Self::Vector, f32)>, width: usize, scratch: &mut Self::Buf);
    /// `gate = act(gate) * up`, rows of `width`.
    fn activate(&self, act: Activation, gate: &mut Self::Buf, up: &Self::Buf, width: usize);
    /// Every logit `l` becomes `cap * tanh(l / cap)`.
    fn softcap(&self, logits: &mut Self::Buf, cap: f32);

    /// A forward's rows: row `t` belongs to sequence `seq_of[t]` (its index in the batch) at
    /// position `pos_of[t]`.
    fn rows(&self, seq_of: Vec<usize>, pos_of: Vec<usize>) -> Self::Rows;
    /// Each row's rotation angles over `rope_dim` dimensions: position × `scale` ×
    /// `base^(-2i / rope_dim)` for pair `i`, computed in f64.
    fn rope_table(&self, rows: &Self::Rows, rope_dim: usize, base: f32, scale: f64) -> Self::Rope;
    /// Rotates the first `rope_dim` dimensions of each head (of `head_dim`) of every row (of
    /// `width`) by the row's angles, pairing dimensions as `style` says.
    fn rope(&self, x: &mut Self::Buf, width: usize, head_dim: usize, table: &Self::Rope, style: RopeStyle);

    /// A fresh, empty KV cache.
    fn new_kv(&self, shape: KvShape) -> Self::Kv;
    /// Bytes one position's keys (or values) of `width` floats take in this backend's caches.
    fn kv_row_bytes(&self, dtype: KvDtype, width: usize, block: usize) -> usize {
        dtype.row_bytes(width, block)
    }
    /// Makes room for `rows` new positions (before a forward's first append).
    fn kv_reserve(&self, kv: &mut Self::Kv, rows: usize);
    /// Stores layer `li`'s (an index into the cache's layers) keys and values of the sequence's
    /// new rows, rows `rows` of `k` and `v`, at the positions after those the cache holds.
    fn kv_append(&self, kv: &mut Self::Kv, li: usize, k: &Self::Buf, v: &Self::Buf, rows: Range<usize>);
    /// Counts `rows` new positions as held, once every layer has stored them.
    fn kv_advance(&self, kv: &mut Self::Kv, rows: usize);
    /// Causal attention of every row's query heads in `q` over its own sequence's layer `li`
    /// (`kvs[seq_of[t]]`), which already holds the row's own position, into `out`.
    fn attend(&self, kvs: &[&Self::Kv], li: usize, rows: &Self::Rows, heads: Heads, q: &Self::Buf, out: &mut Self::Buf);
}

//! The CPU backend: SIMD kernels chosen at run time, the thread pool, weights as views into the
//! mapped file, and the per-row operations (norms, RoPE, attention, activations).

pub(crate) mod kernels;
pub(crate) mod matrix;
pub(crate) mod ops;
pub(crate) mod pool;

/// The numerics these kernels compute: exact (f32 activations) and fast (integer activations
/// for block-type weights, `kernels::int`), branched on in `matrix::matmul`.
pub(crate) const NUMERICS: &[crate::Numerics] = &[crate::Numerics::Exact, crate::Numerics::Fast];

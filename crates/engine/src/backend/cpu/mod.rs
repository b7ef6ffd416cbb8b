//! The CPU backend: SIMD kernels chosen at run time, the thread pool, weights as views into the
//! mapped file, and the per-row operations (norms, RoPE, attention, activations).

pub(crate) mod kernels;
pub(crate) mod matrix;
pub(crate) mod ops;
pub(crate) mod pool;

/// The numerics these kernels compute. Fast (integer activations) goes here once its kernels
/// do, with the branch on the stage's numerics in `matrix::matmul`.
pub(crate) const NUMERICS: &[crate::Numerics] = &[crate::Numerics::Exact];

//! The CPU backend: SIMD kernels chosen at run time, the thread pool, weights as views into the
//! mapped file, and the per-row operations (norms, RoPE, attention, activations).

pub(crate) mod denormal;
pub(crate) mod kernels;
pub(crate) mod matrix;
pub(crate) mod ops;
pub(crate) mod pool;

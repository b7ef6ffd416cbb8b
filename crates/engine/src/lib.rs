//! dgr's compute engine: the llama-family decoders (llama, mistral, qwen2, qwen3, gemma3) written
//! once in `model` over the `backend` trait's operations, the CPU backend (kernels over GGUF's
//! quantized blocks), a [`Stage`] (one contiguous layer range of a model on the CPU) with
//! per-sequence KV state kept apart from the weights, one batched forward over many sequences at
//! their own positions, and the [`Engine`] trait a worker drives any engine through.

mod backend;
mod config;
mod embed;
mod engine;
mod error;
mod id;
mod model;
mod open;
mod sample;
mod softmax;
pub mod synth;

pub use backend::cpu::kernels::Isa;
pub use backend::cpu::kv::KvCache;
pub use config::{Activation, Arch, ModelConfig, RopeStyle, SlidingWindow};
pub use embed::{Pooler, Pooling};
pub use engine::{Engine, SeqState};
pub use error::EngineError;
pub use id::{BackendKind, EngineId, Format, KvDtype, Numerics, UnknownName};
pub use model::{Input, LogitRows, SeqInput, SeqOutput};
pub use open::{available_numerics, check_numerics, open_engine, registered_specs, EngineSpec, Stage};
pub use sample::{accept, argmax, logprobs, mask_logits, sample, MaskError, SamplingParams};

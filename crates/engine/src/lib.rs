//! dgr's compute engine: CPU kernels over GGUF's quantized blocks, a `Stage` holding the weights
//! of one contiguous layer range of a llama-family decoder (llama, mistral, qwen2, qwen3,
//! gemma3), per-sequence KV state kept apart from the weights, and one batched forward over many
//! sequences at their own positions; the [`Engine`] trait a worker drives any engine through.

mod backend;
mod config;
mod embed;
mod engine;
mod error;
mod id;
mod kv;
mod model;
mod open;
mod sample;
mod stage;
pub mod synth;

pub use backend::cpu::kernels::Isa;
pub use config::{Activation, Arch, ModelConfig, RopeStyle, SlidingWindow};
pub use embed::{Pooler, Pooling};
pub use engine::{Engine, SeqState};
pub use error::EngineError;
pub use id::{BackendKind, EngineId, Format, KvDtype, Numerics, UnknownName};
pub use kv::KvCache;
pub use open::{available_numerics, check_numerics, open_engine, registered_specs, EngineSpec};
pub use sample::{argmax, logprobs, mask_logits, sample, MaskError, SamplingParams};
pub use stage::{Input, LogitRows, SeqInput, SeqOutput, Stage};

//! dgr's compute engine: the llama-family decoders (llama, mistral, qwen2, qwen3, gemma3) written
//! once in `model` over the `backend` trait's operations, the CPU backend (kernels over GGUF's
//! quantized blocks) and the GPU backend (wgpu), a [`Stage`] (one contiguous layer range of a
//! model on either) with
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
mod stage;
pub mod synth;

pub use backend::cpu::kernels::Isa;
pub use backend::gpu::{adapter_memory, adapters, AdapterIdentity, DeviceMemory};
pub use config::{Activation, Arch, ModelConfig, RopeStyle, SlidingWindow};
pub use embed::{Pooler, Pooling};
pub use engine::{Engine, SeqState};
pub use error::EngineError;
pub use id::{BackendKind, EngineId, Format, KvDtype, Numerics, UnknownName};
pub use model::{Input, LogitRows, SeqInput, SeqOutput};
pub use open::{available_numerics, check_numerics, open_engine, registered_specs, Device, EngineSpec};
pub use sample::{accept, argmax, logprobs, mask_logits, sample, MaskError, SamplingParams};
pub use stage::{KvCache, Stage};

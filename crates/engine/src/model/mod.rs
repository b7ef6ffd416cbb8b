//! The models: the llama-family forward, written once over the backend's operations
//! (`forward`, over the tensors `weights` reads), and the architectures, one module per family:
//! what each changes in that forward (its RoPE pairing, norms, activation, attention window,
//! scales) and the metadata only it reads. Adding an architecture is a variant here and a
//! module beside these; no backend changes.

mod batch;
mod forward;
mod gemma3;
mod llama;
mod qwen;
mod weights;

pub use batch::{Input, LogitRows, SeqInput, SeqOutput};
pub use forward::Model;

use crate::{EngineError, ModelConfig};
use dgr_gguf::Gguf;

/// The architectures the engine computes, by their GGUF `general.architecture` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    Llama,
    /// Mistral's files usually say llama; the few that say mistral compute as llama does.
    Mistral,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Arch {
    pub const ALL: [Arch; 5] = [Arch::Llama, Arch::Mistral, Arch::Qwen2, Arch::Qwen3, Arch::Gemma3];

    /// The name in `general.architecture`, and the prefix of the architecture's metadata keys.
    pub fn as_str(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
        }
    }
}

impl std::str::FromStr for Arch {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Arch, EngineError> {
        Arch::ALL.into_iter().find(|a| a.as_str() == s).ok_or_else(|| EngineError::UnsupportedArch(s.into()))
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Turns `cfg`, read as a llama (adjacent RoPE pairs, SiLU, no extra norms, scores scaled by
/// 1/√head_dim), into its architecture's, reading what else that architecture's file says.
pub(crate) fn adapt(cfg: &mut ModelConfig, g: &Gguf) -> Result<(), EngineError> {
    match cfg.arch {
        Arch::Llama | Arch::Mistral => llama::adapt(cfg),
        Arch::Qwen2 | Arch::Qwen3 => qwen::adapt(cfg),
        Arch::Gemma3 => gemma3::adapt(cfg, g),
    }
}

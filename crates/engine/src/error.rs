use crate::Numerics;
use dgr_gguf::GgufError;
use std::ops::Range;

/// Why a model could not be opened or a forward could not run. Inputs are checked before any
/// computation starts, so an error never leaves a sequence's state half-updated.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported architecture {0:?} (supported: llama, mistral, qwen2, qwen3, gemma3)")]
    UnsupportedArch(String),
    #[error("invalid model hyperparameters: {0}")]
    BadConfig(String),
    #[error("tensor {0:?} is missing")]
    MissingTensor(String),
    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    BadShape { name: String, expected: Vec<u64>, found: Vec<u64> },
    #[error("tensor {name:?} has type {ty}, which this engine cannot use there")]
    UnsupportedType { name: String, ty: &'static str },
    #[error("layer range {start}..{end} is not a non-empty part of 0..{n_layers}")]
    BadLayerRange { start: usize, end: usize, n_layers: usize },
    #[error("layers {sub:?} are not a non-empty part of the stage's layers {held:?}")]
    BadSubRange { sub: Range<usize>, held: Range<usize> },
    #[error("sequences over layers {a:?} and {b:?} cannot share a forward")]
    MixedLayerRanges { a: Range<usize>, b: Range<usize> },
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("sequence would hold {needed} positions, past its capacity of {capacity}")]
    ContextFull { needed: usize, capacity: usize },
    #[error("numerics {asked} is not available on this engine; available: {}", names(available))]
    NumericsUnavailable { asked: Numerics, available: &'static [Numerics] },
    #[error("bad input: {0}")]
    BadInput(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The GPU refused or failed (no adapter, a missing feature, out of memory, lost).
    #[error("GPU: {0}")]
    Device(String),
}

fn names(n: &[Numerics]) -> String {
    n.iter().map(|n| n.name()).collect::<Vec<_>>().join(", ")
}

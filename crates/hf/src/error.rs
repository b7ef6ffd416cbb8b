//! The crate's error type: what was wrong, and in which file.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("cannot read {path:?}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path:?} is not valid JSON of the expected shape: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path:?} is larger than {max} bytes")]
    TooLarge { path: PathBuf, max: u64 },
    #[error("config.json: {0}")]
    BadConfig(String),
    #[error("model type {0:?} is not supported (llama, mistral, qwen2, qwen3, gemma3_text)")]
    UnsupportedModel(String),
    #[error("{path:?}: bad safetensors header: {reason}")]
    BadHeader { path: PathBuf, reason: String },
    #[error("tensor {name:?}: dtype {dtype} is not supported (F32, F16, BF16)")]
    UnsupportedDtype { name: String, dtype: String },
    #[error("tensor {name:?}: shape {found:?}, but the config says {expected:?}")]
    BadShape { name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("tensor {0:?} is missing from the checkpoint")]
    MissingTensor(String),
    #[error("tensor {name:?} appears in both {first:?} and {second:?}")]
    DuplicateTensor { name: String, first: PathBuf, second: PathBuf },
    #[error("tensor {0:?} is not one this model type has")]
    UnexpectedTensor(String),
    #[error(transparent)]
    Gguf(#[from] dgr_gguf::GgufError),
}

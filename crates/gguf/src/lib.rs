//! GGUF (v2/v3) reading, zero-copy over a memory map, with every count, length, offset and type
//! validated at open; GGUF writing for fixtures; reference scalar (de)quantization of ggml blocks.

mod error;
mod gguf;
mod identity;
mod paths;
pub mod quant;
mod read;
mod tensor;
mod types;
mod value;
mod write;

pub use error::GgufError;
pub use gguf::Gguf;
pub use identity::model_id;
pub use paths::{default_model_path, DEFAULT_MODEL_FILE};
pub use tensor::{TensorInfo, MAX_DIMS};
pub use types::GgmlType;
pub use value::{Value, MAX_ARRAY_DEPTH};
pub use write::GgufWriter;

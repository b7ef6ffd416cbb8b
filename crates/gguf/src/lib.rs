//! GGUF (v2/v3) reading, zero-copy over a memory map (of the whole file or of the tensors a
//! process keeps), with every count, length, offset and type validated at open; GGUF writing
//! for fixtures; model identities built from tensor hashes; slices (files holding some layers
//! and the whole model's identity); reference scalar (de)quantization of ggml blocks.

mod assemble;
mod error;
mod gguf;
mod identity;
mod mapping;
mod paths;
pub mod quant;
mod read;
mod sidecar;
mod slice;
mod slice_write;
mod temp;
mod tensor;
mod types;
mod value;
mod write;

pub use assemble::{Part, PartBytes};
pub use error::GgufError;
pub use gguf::Gguf;
pub use identity::{cached_tensor_hashes, file_sha256, identity, model_identity, sha256_range, ModelIdentity, TensorHash};
pub use paths::{default_model_path, DEFAULT_MODEL_FILE};
pub use slice::{needed_by_stage, per_layer, SliceInfo};
pub use slice_write::{slice_metadata, write_slice, SliceLayout};
pub use tensor::{TensorInfo, MAX_DIMS};
pub use types::GgmlType;
pub use value::{Value, MAX_ARRAY_DEPTH};
pub use write::GgufWriter;

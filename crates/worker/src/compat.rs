//! Which sessions may share a forward. Within one worker most of the key is the same for every
//! session, but it is still the whole key that decides, as a type, not a convention.

use dgr_engine::EngineId;
use dgr_proto::SeamDtype;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Prefill,
    Decode,
}

/// Sessions share a batch only when their keys are equal.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CompatKey {
    /// The compute engine: its numerics and its KV layout (the dtype keys and values are
    /// stored in) among the rest, so sessions of different KV dtypes never share a forward.
    pub engine: EngineId,
    /// The recipe: model identity and layer range.
    pub model_id: Arc<str>,
    pub layers: (u32, u32),
    pub phase: Phase,
    /// The boundary schema.
    pub hidden: u32,
    pub seam_dtype: SeamDtype,
}

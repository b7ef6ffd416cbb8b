//! Llama and Mistral: the forward as `ModelConfig` reads it, unchanged.

use crate::{EngineError, ModelConfig};

pub(super) fn adapt(_cfg: &mut ModelConfig) -> Result<(), EngineError> {
    Ok(())
}

//! Qwen2 and Qwen3: RoPE over the two halves of each head ("neox"); Qwen3 also norms each
//! query and key head before rotating, and rotates whole heads.

use crate::{Arch, EngineError, ModelConfig, RopeStyle};

pub(super) fn adapt(cfg: &mut ModelConfig) -> Result<(), EngineError> {
    cfg.rope_style = RopeStyle::Halves;
    if cfg.arch == Arch::Qwen3 {
        // llama.cpp's qwen3 graph insists on rotating whole heads.
        if cfg.rope_dim != cfg.head_dim {
            return Err(EngineError::BadConfig(format!("qwen3 rotates whole heads, not {} of {}", cfg.rope_dim, cfg.head_dim)));
        }
        cfg.qk_norm = true;
    }
    Ok(())
}

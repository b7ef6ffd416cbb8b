//! Gemma 3: halves RoPE, per-head query/key norms, norms after attention and FFN, embeddings
//! scaled by √hidden, GELU, interleaved sliding-window attention with its own RoPE base, and
//! an optional logit softcap.

use crate::config::MAX_CONTEXT;
use crate::{Activation, Arch, EngineError, ModelConfig, RopeStyle, SlidingWindow};
use dgr_gguf::{Gguf, Value};

pub(super) fn adapt(cfg: &mut ModelConfig, g: &Gguf) -> Result<(), EngineError> {
    let arch = cfg.arch;
    let key = |k: &str| format!("{arch}.{k}");
    cfg.rope_style = RopeStyle::Halves;
    cfg.qk_norm = true;
    cfg.post_norms = true;
    cfg.embed_scale = Some((cfg.hidden as f64).sqrt());
    cfg.activation = Activation::GeluTanh;
    cfg.sliding_window = sliding_window(g, arch, cfg.n_layers)?;
    cfg.logit_softcap = match g.get(&key("final_logit_softcapping")) {
        Some(_) => Some(g.get_f32(&key("final_logit_softcapping"))?).filter(|&c| c != 0.0),
        None => None,
    };
    if cfg.logit_softcap.is_some_and(|c| !c.is_finite()) {
        return Err(EngineError::BadConfig("the logit softcap must be finite".into()));
    }
    if cfg.n_layers == GEMMA3_27B_LAYERS {
        let (hidden, n_head) = (cfg.hidden, cfg.n_head);
        if hidden % n_head != 0 {
            return Err(EngineError::BadConfig(format!("{n_head} heads do not divide hidden size {hidden}")));
        }
        cfg.attn_scale = 1.0 / ((hidden / n_head) as f32).sqrt();
    }
    Ok(())
}

/// llama.cpp's defaults for gemma3's window: every sixth layer global, RoPE base 10000.
const GEMMA3_SWA_PERIOD: u64 = 6;
const GEMMA3_SWA_ROPE_BASE: f32 = 10000.0;
/// llama.cpp tells gemma3-27B by its layer count; it scales attention by 1/√(hidden / heads).
const GEMMA3_27B_LAYERS: usize = 62;

/// gemma3's window as llama.cpp reads it: none when the size is absent or 0; the layers it
/// applies to from `sliding_window_pattern`, a per-layer array or a period (all but the last
/// layer of each period; 0: every layer); its own RoPE base.
fn sliding_window(g: &Gguf, arch: Arch, n_layers: usize) -> Result<Option<SlidingWindow>, EngineError> {
    let key = |k: &str| format!("{arch}.{k}");
    let window = match g.get(&key("attention.sliding_window")) {
        Some(_) => g.get_u64(&key("attention.sliding_window"))?,
        None => 0,
    };
    if window == 0 {
        return Ok(None);
    }
    if window > MAX_CONTEXT {
        return Err(EngineError::BadConfig(format!("a sliding window of {window} exceeds {MAX_CONTEXT}")));
    }
    let pattern = key("attention.sliding_window_pattern");
    let layers = match g.get(&pattern) {
        Some(Value::Array(items)) => {
            if items.len() != n_layers {
                return Err(EngineError::BadConfig(format!("{pattern} has {} entries for {n_layers} layers", items.len())));
            }
            let on = |v: &Value| v.as_bool().or_else(|| v.as_i64().map(|i| i != 0));
            items.iter().map(on).collect::<Option<Vec<bool>>>().ok_or_else(|| EngineError::BadConfig(format!("{pattern} is not flags")))?
        }
        Some(_) => period(g.get_u64(&pattern)?, n_layers),
        None => period(GEMMA3_SWA_PERIOD, n_layers),
    };
    let rope_base = match g.get(&key("rope.freq_base_swa")) {
        Some(_) => g.get_f32(&key("rope.freq_base_swa"))?,
        None => GEMMA3_SWA_ROPE_BASE,
    };
    if !(rope_base.is_finite() && rope_base > 0.0) {
        return Err(EngineError::BadConfig(format!("{} = {rope_base} must be positive", key("rope.freq_base_swa"))));
    }
    Ok(Some(SlidingWindow { window: window as usize, layers, rope_base }))
}

/// llama.cpp's `set_swa_pattern`: all but the last layer of every `n`; every layer for 0.
fn period(n: u64, n_layers: usize) -> Vec<bool> {
    (0..n_layers as u64).map(|il| n == 0 || il % n < n - 1).collect()
}

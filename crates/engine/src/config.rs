//! Hyperparameters of a llama-family decoder, read from GGUF metadata and checked.

use crate::EngineError;
use dgr_gguf::Gguf;

/// How RoPE pairs up dimensions: adjacent pairs (llama) or the two halves (qwen2, "neox").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    Adjacent,
    Halves,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: String,
    pub n_layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub rope_base: f32,
    pub rope_style: RopeStyle,
    pub rms_eps: f32,
    pub vocab: usize,
    pub context: usize,
}

/// Bounds that keep a hostile header from asking for absurd buffers.
const MAX_DIM: u64 = 1 << 20;
const MAX_LAYERS: u64 = 4096;

impl ModelConfig {
    pub fn from_gguf(g: &Gguf) -> Result<ModelConfig, EngineError> {
        let arch = g.get_str("general.architecture")?.to_string();
        let rope_style = match arch.as_str() {
            "llama" | "mistral" => RopeStyle::Adjacent,
            "qwen2" => RopeStyle::Halves,
            _ => return Err(EngineError::UnsupportedArch(arch)),
        };
        let key = |k: &str| format!("{arch}.{k}");
        let dim = |k: &str, max: u64| -> Result<usize, EngineError> {
            let v = g.get_u64(&key(k))?;
            if v == 0 || v > max {
                return Err(EngineError::BadConfig(format!("{} = {v} is out of range 1..={max}", key(k))));
            }
            Ok(v as usize)
        };
        let n_layers = dim("block_count", MAX_LAYERS)?;
        let hidden = dim("embedding_length", MAX_DIM)?;
        let ffn = dim("feed_forward_length", MAX_DIM)?;
        let n_head = dim("attention.head_count", MAX_DIM)?;
        let n_head_kv = match g.get(&key("attention.head_count_kv")) {
            Some(_) => dim("attention.head_count_kv", MAX_DIM)?,
            None => n_head,
        };
        if hidden % n_head != 0 || n_head % n_head_kv != 0 {
            return Err(EngineError::BadConfig(format!(
                "{n_head} heads ({n_head_kv} for keys and values) do not divide hidden size {hidden}"
            )));
        }
        let head_dim = hidden / n_head;
        let rope_dim = match g.get(&key("rope.dimension_count")) {
            Some(_) => dim("rope.dimension_count", MAX_DIM)?,
            None => head_dim,
        };
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(EngineError::BadConfig(format!("rope dimension {rope_dim} for head size {head_dim}")));
        }
        let float = |k: &str, default: f32| -> Result<f32, EngineError> {
            match g.get(&key(k)) {
                None => Ok(default),
                Some(_) => {
                    let v = g.get_f32(&key(k))?;
                    if v.is_finite() && v > 0.0 {
                        Ok(v)
                    } else {
                        Err(EngineError::BadConfig(format!("{} = {v} must be positive", key(k))))
                    }
                }
            }
        };
        let rope_base = float("rope.freq_base", 10000.0)?;
        let rms_eps = float("attention.layer_norm_rms_epsilon", 1e-5)?;
        let context = match g.get(&key("context_length")) {
            Some(_) => dim("context_length", 1 << 24)?,
            None => 4096,
        };
        // A slice may not hold the embedding; its table still says the whole model's shape.
        let embd = g.model_tensor_dims("token_embd.weight").ok_or_else(|| EngineError::MissingTensor("token_embd.weight".into()))?;
        let vocab = match embd {
            [h, v] if *h as usize == hidden && *v > 0 && *v <= 1 << 24 => *v as usize,
            _ => {
                return Err(EngineError::BadShape {
                    name: "token_embd.weight".into(),
                    expected: vec![hidden as u64, 0],
                    found: embd.to_vec(),
                })
            }
        };
        Ok(ModelConfig {
            arch,
            n_layers,
            hidden,
            ffn,
            n_head,
            n_head_kv,
            head_dim,
            rope_dim,
            rope_base,
            rope_style,
            rms_eps,
            vocab,
            context,
        })
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}

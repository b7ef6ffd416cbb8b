//! Hyperparameters of a llama-family decoder, read from GGUF metadata and checked; what each
//! architecture changes is in `model`.

pub use crate::model::Arch;
use crate::{EngineError, Pooling};
use dgr_gguf::Gguf;

/// How RoPE pairs up dimensions: adjacent pairs (llama) or the two halves (qwen2, "neox").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    Adjacent,
    Halves,
}

/// The gated FFN's activation: SiLU (llama, qwen) or GELU's tanh form (gemma).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    GeluTanh,
}

/// Gemma 3's interleaved attention: the layers `layers` marks see only the last `window`
/// positions (the query's own included) and rotate with base `rope_base`, unscaled.
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    pub window: usize,
    /// Per layer of the model: whether it attends through the window.
    pub layers: Vec<bool>,
    pub rope_base: f32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Per query/key/value head; `n_head * head_dim` may differ from `hidden` (gemma3, qwen3).
    pub head_dim: usize,
    pub rope_dim: usize,
    pub rope_base: f32,
    /// Positions are multiplied by this before rotating (linear RoPE scaling: 1 / factor).
    pub rope_scale: f64,
    pub rope_style: RopeStyle,
    pub rms_eps: f32,
    pub vocab: usize,
    pub context: usize,
    /// Attention scores are multiplied by this (1/√head_dim but for gemma3-27B).
    pub attn_scale: f32,
    /// Per-head RMSNorm of queries and keys before RoPE (qwen3, gemma3).
    pub qk_norm: bool,
    /// RMSNorm of the attention's and the FFN's outputs before each residual add (gemma3).
    pub post_norms: bool,
    /// Embeddings are multiplied by this (gemma3: √hidden).
    pub embed_scale: Option<f64>,
    pub activation: Activation,
    pub sliding_window: Option<SlidingWindow>,
    /// Logits become `cap * tanh(logit / cap)` (gemma3, when its file asks for it).
    pub logit_softcap: Option<f32>,
    /// How an embedding pools the rows: `{arch}.pooling_type`, mean when absent.
    pub pooling: Pooling,
}

/// Bounds that keep a hostile header from asking for absurd buffers.
const MAX_DIM: u64 = 1 << 20;
const MAX_LAYERS: u64 = 4096;
pub(crate) const MAX_CONTEXT: u64 = 1 << 24;

impl ModelConfig {
    pub fn from_gguf(g: &Gguf) -> Result<ModelConfig, EngineError> {
        let arch: Arch = g.get_str("general.architecture")?.parse()?;
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
        if n_head % n_head_kv != 0 {
            return Err(EngineError::BadConfig(format!("{n_head_kv} key/value heads do not divide {n_head} heads")));
        }
        // As llama.cpp: the key length when given, else hidden / heads.
        let head_dim = match g.get(&key("attention.key_length")) {
            Some(_) => dim("attention.key_length", MAX_DIM)?,
            None if hidden % n_head == 0 => hidden / n_head,
            None => return Err(EngineError::BadConfig(format!("{n_head} heads do not divide hidden size {hidden}"))),
        };
        if g.get(&key("attention.value_length")).is_some() && dim("attention.value_length", MAX_DIM)? != head_dim {
            return Err(EngineError::BadConfig("value heads of another size than key heads".into()));
        }
        if (n_head * head_dim) as u64 > MAX_DIM {
            return Err(EngineError::BadConfig(format!("{n_head} heads of {head_dim} exceed {MAX_DIM}")));
        }
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
        let rope_scale = rope_scale(g, arch)?;
        let context = match g.get(&key("context_length")) {
            Some(_) => dim("context_length", MAX_CONTEXT)?,
            None => 4096,
        };
        let pooling = match g.get(&key("pooling_type")) {
            Some(_) => Pooling::from_llama(g.get_u64(&key("pooling_type"))?)?,
            None => Pooling::Mean,
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
        // The llama forward; the architecture's module (see `model`) says what it changes.
        let mut cfg = ModelConfig {
            n_layers,
            hidden,
            ffn,
            n_head,
            n_head_kv,
            head_dim,
            rope_dim,
            rope_base,
            rope_scale,
            rms_eps,
            vocab,
            context,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            qk_norm: false,
            post_norms: false,
            embed_scale: None,
            activation: Activation::Silu,
            sliding_window: None,
            logit_softcap: None,
            rope_style: RopeStyle::Adjacent,
            pooling,
            arch,
        };
        crate::model::adapt(&mut cfg, g)?;
        Ok(cfg)
    }

    /// Floats of one position's keys (or values) in one layer.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Floats of one position's queries (and of the attention's output).
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// The window of positions layer `layer` (the model's index) attends to, if it is limited.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.as_ref().filter(|s| s.layers.get(layer) == Some(&true)).map(|s| s.window)
    }
}

/// llama.cpp's reading of RoPE scaling: the factor (under either key name) divides positions
/// unless the type is "none"; the types that change more than that are refused.
fn rope_scale(g: &Gguf, arch: Arch) -> Result<f64, EngineError> {
    let kind = match g.get(&format!("{arch}.rope.scaling.type")) {
        Some(_) => g.get_str(&format!("{arch}.rope.scaling.type"))?,
        None => "linear",
    };
    let factor_key = [format!("{arch}.rope.scaling.factor"), format!("{arch}.rope.scale_linear")].into_iter().find(|k| g.get(k).is_some());
    let factor = match factor_key {
        Some(k) => g.get_f32(&k)?,
        None => 0.0,
    };
    match kind {
        "none" => Ok(1.0),
        "linear" if factor == 0.0 => Ok(1.0),
        "linear" if factor.is_finite() && factor > 0.0 => Ok(1.0 / factor as f64),
        "linear" => Err(EngineError::BadConfig(format!("RoPE scaling factor {factor} must be positive"))),
        other => Err(EngineError::BadConfig(format!("RoPE scaling {other:?} is not supported (only linear)"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dgr_gguf::{GgmlType, GgufWriter, Value};

    /// A header of `arch` with 12 layers, hidden 64, 4 heads sharing one key/value head, and
    /// `extra` keys (under `arch.`).
    fn config(arch: &str, extra: &[(&str, Value)]) -> Result<ModelConfig, EngineError> {
        let mut w = GgufWriter::new();
        w.add_metadata("general.architecture", Value::String(arch.into())).unwrap();
        let dims = [("block_count", 12), ("embedding_length", 64), ("feed_forward_length", 128), ("attention.head_count", 4)];
        for (k, v) in dims.into_iter().chain([("attention.head_count_kv", 1)]) {
            w.add_metadata(&format!("{arch}.{k}"), Value::U32(v)).unwrap();
        }
        for (k, v) in extra {
            w.add_metadata(&format!("{arch}.{k}"), v.clone()).unwrap();
        }
        w.add_tensor("token_embd.weight", GgmlType::F32, &[64, 8], vec![0; 64 * 8 * 4]).unwrap();
        ModelConfig::from_gguf(&Gguf::from_bytes(w.to_bytes()).unwrap())
    }

    #[test]
    fn architectures_read_by_name_and_an_unknown_one_is_refused() {
        for a in Arch::ALL {
            assert_eq!(a.as_str().parse::<Arch>().ok(), Some(a));
            assert_eq!(config(a.as_str(), &[("attention.key_length", Value::U32(16))]).map(|c| c.arch).ok(), Some(a));
        }
        let names: Vec<&str> = Arch::ALL.iter().map(|a| a.as_str()).collect();
        assert_eq!(names, ["llama", "mistral", "qwen2", "qwen3", "gemma3"]);
        assert!(matches!("Llama".parse::<Arch>(), Err(EngineError::UnsupportedArch(n)) if n == "Llama"));
        assert!(matches!(config("gpt2", &[]), Err(EngineError::UnsupportedArch(n)) if n == "gpt2"));
    }

    #[test]
    fn gemma3_has_wide_heads_and_a_window_on_five_layers_in_six() {
        let c = config("gemma3", &[("attention.key_length", Value::U32(32)), ("attention.sliding_window", Value::U32(16))]).unwrap();
        assert_eq!((c.head_dim, c.q_dim(), c.kv_dim(), c.rope_style), (32, 128, 32, RopeStyle::Halves));
        let global: Vec<usize> = (0..12).filter(|&il| c.window(il).is_none()).collect();
        assert_eq!(global, [5, 11]);
        assert_eq!(c.window(0), Some(16));
        assert_eq!((c.attn_scale, c.embed_scale, c.activation), (1.0 / 32f32.sqrt(), Some(8.0), Activation::GeluTanh));
        assert!(c.qk_norm && c.post_norms && c.logit_softcap.is_none());
        assert_eq!(c.sliding_window.as_ref().map(|s| s.rope_base), Some(10000.0));
        // As llama.cpp: no window (or 0) means every layer sees everything.
        for extra in [&[][..], &[("attention.sliding_window", Value::U32(0))]] {
            assert_eq!(config("gemma3", extra).unwrap().window(0), None);
        }
    }

    #[test]
    fn gemma3_takes_the_pattern_rope_base_and_softcap_its_file_gives() {
        let window = || ("attention.sliding_window", Value::U32(16));
        let windowed = |extra: &[(&str, Value)]| {
            let c = config("gemma3", extra).unwrap();
            (0..12).filter(|&il| c.window(il).is_some()).collect::<Vec<usize>>()
        };
        assert_eq!(windowed(&[window(), ("attention.sliding_window_pattern", Value::U32(4))]), [0, 1, 2, 4, 5, 6, 8, 9, 10]);
        assert_eq!(windowed(&[window(), ("attention.sliding_window_pattern", Value::U32(0))]), (0..12).collect::<Vec<_>>());
        let flags = Value::Array((0..12).map(|il| Value::Bool(il % 5 == 0)).collect());
        assert_eq!(windowed(&[window(), ("attention.sliding_window_pattern", flags)]), [0, 5, 10]);
        let short = Value::Array(vec![Value::Bool(true); 3]);
        assert!(config("gemma3", &[window(), ("attention.sliding_window_pattern", short)]).is_err());
        let c =
            config("gemma3", &[window(), ("rope.freq_base_swa", Value::F32(5e4)), ("final_logit_softcapping", Value::F32(30.0))]).unwrap();
        assert_eq!((c.sliding_window.map(|s| s.rope_base), c.logit_softcap), (Some(5e4), Some(30.0)));
    }

    #[test]
    fn qwen3_norms_heads_and_the_others_do_not() {
        let q = config("qwen3", &[("attention.key_length", Value::U32(32))]).unwrap();
        assert_eq!((q.q_dim(), q.qk_norm, q.post_norms, q.sliding_window, q.activation), (128, true, false, None, Activation::Silu));
        let l = config("llama", &[]).unwrap();
        assert_eq!((l.head_dim, l.q_dim(), l.qk_norm, l.embed_scale, l.rope_scale), (16, 64, false, None, 1.0));
        assert_eq!(l.attn_scale, 1.0 / 16f32.sqrt());
    }

    #[test]
    fn pooling_is_the_files_or_mean() {
        let pooling = |extra: &[(&str, Value)]| config("llama", extra).map(|c| c.pooling);
        assert_eq!(pooling(&[]).unwrap(), Pooling::Mean);
        assert_eq!(pooling(&[("pooling_type", Value::U32(3))]).unwrap(), Pooling::Last);
        assert_eq!(pooling(&[("pooling_type", Value::U32(4))]).unwrap(), Pooling::Rank);
        assert!(pooling(&[("pooling_type", Value::U32(9))]).is_err());
    }

    #[test]
    fn rope_scaling_is_linear_or_refused() {
        let scale = |extra: &[(&str, Value)]| config("qwen3", extra).map(|c| c.rope_scale);
        let factor = || ("rope.scaling.factor", Value::F32(8.0));
        let kind = |k: &str| ("rope.scaling.type", Value::String(k.into()));
        assert_eq!(scale(&[factor()]).unwrap(), 0.125);
        assert_eq!(scale(&[factor(), kind("linear")]).unwrap(), 0.125);
        assert_eq!(scale(&[factor(), kind("none")]).unwrap(), 1.0);
        assert!(scale(&[factor(), kind("yarn")]).is_err());
        assert!(scale(&[("rope.scaling.factor", Value::F32(-1.0))]).is_err());
    }

    #[test]
    fn hostile_head_sizes_are_refused() {
        let window = ("attention.sliding_window", Value::U32(16));
        let wide = ("attention.key_length", Value::U32(1 << 19));
        let empty = ("attention.key_length", Value::U32(0));
        let huge = ("attention.sliding_window", Value::U64(u64::MAX));
        for extra in [&[wide, window.clone()][..], &[empty, window], &[huge]] {
            assert!(config("gemma3", extra).is_err(), "{extra:?}");
        }
        let mismatched = [("attention.key_length", Value::U32(32)), ("attention.value_length", Value::U32(16))];
        assert!(config("qwen3", &mismatched).is_err());
    }
}

//! `config.json` of a Transformers checkpoint, read into the hyperparameters dgr's engine takes
//! (expressed as the GGUF metadata keys llama.cpp's converter would write, so one reading of
//! them serves both formats). Sizes are bounded before anything is allocated from them.

use crate::HfError;
use dgr_gguf::Value;
use serde::Deserialize;
use serde_json::Value as Json;

/// The model families this loader reads, by `model_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Family {
    fn of(model_type: &str) -> Result<Family, HfError> {
        Ok(match model_type {
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "gemma3_text" => Family::Gemma3,
            other => return Err(HfError::UnsupportedModel(other.into())),
        })
    }

    /// The GGUF architecture the engine computes it as.
    pub fn arch(self) -> &'static str {
        match self {
            Family::Llama | Family::Mistral => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
        }
    }

    /// llama.cpp rotates llama's pairs of adjacent dimensions, Transformers the two halves of
    /// each head: the loader reorders the rows of Q and K as llama.cpp's converter does, so the
    /// engine computes the same rotation on either format.
    pub fn permutes_qk(self) -> bool {
        matches!(self, Family::Llama | Family::Mistral)
    }

    /// Gemma's RMSNorm multiplies by (1 + w): the loader adds the 1 (in f32, as Transformers).
    pub fn norms_add_one(self) -> bool {
        self == Family::Gemma3
    }
}

/// The fields dgr reads; the rest of config.json is ignored.
#[derive(Deserialize)]
struct Raw {
    model_type: String,
    hidden_size: u64,
    intermediate_size: u64,
    num_hidden_layers: u64,
    num_attention_heads: u64,
    num_key_value_heads: Option<u64>,
    head_dim: Option<u64>,
    vocab_size: u64,
    max_position_embeddings: Option<u64>,
    rms_norm_eps: Option<f64>,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    attention_bias: bool,
    rope_theta: Option<f64>,
    rope_scaling: Option<Json>,
    rope_parameters: Option<Json>,
    partial_rotary_factor: Option<f64>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    // Gemma 3 and Mistral.
    sliding_window: Option<u64>,
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<u64>,
    rope_local_base_freq: Option<f64>,
    query_pre_attn_scalar: Option<f64>,
    final_logit_softcapping: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    use_sliding_window: Option<bool>,
}

/// The checkpoint's shape, validated.
#[derive(Clone, Debug)]
pub struct Config {
    pub family: Family,
    pub n_layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub tied: bool,
    /// Biases on Q, K and V (qwen2 always; llama when `attention_bias`).
    pub qkv_bias: bool,
    /// The GGUF metadata the engine reads its hyperparameters from.
    pub metadata: Vec<(String, Value)>,
}

/// Bounds that keep a hostile config from asking for absurd buffers (as for GGUF headers).
const MAX_DIM: u64 = 1 << 20;
const MAX_LAYERS: u64 = 4096;
const MAX_CONTEXT: u64 = 1 << 24;
const MAX_VOCAB: u64 = 1 << 24;

fn bounded(what: &str, v: u64, max: u64) -> Result<usize, HfError> {
    if v == 0 || v > max {
        return Err(HfError::BadConfig(format!("{what} = {v} is out of range 1..={max}")));
    }
    Ok(v as usize)
}

fn positive(what: &str, v: f64) -> Result<f32, HfError> {
    if v.is_finite() && v > 0.0 && v <= f32::MAX as f64 {
        Ok(v as f32)
    } else {
        Err(HfError::BadConfig(format!("{what} = {v} must be positive and finite")))
    }
}

/// A RoPE section (`rope_scaling`, or one of `rope_parameters`): its theta, if it gives one, and
/// its linear factor; the types that change more than positions are refused.
fn rope_section(what: &str, section: &Json) -> Result<(Option<f64>, Option<f64>), HfError> {
    let Some(obj) = section.as_object() else {
        return if section.is_null() { Ok((None, None)) } else { Err(HfError::BadConfig(format!("{what} is not an object"))) };
    };
    let kind = obj.get("rope_type").or_else(|| obj.get("type")).and_then(Json::as_str).unwrap_or("default");
    let theta = obj.get("rope_theta").map(|v| v.as_f64().ok_or_else(|| HfError::BadConfig(format!("{what}.rope_theta is not a number"))));
    let factor = match kind {
        "default" => None,
        "linear" => Some(
            obj.get("factor")
                .and_then(Json::as_f64)
                .ok_or_else(|| HfError::BadConfig(format!("{what}: linear scaling without a factor")))?,
        ),
        other => return Err(HfError::BadConfig(format!("{what}: RoPE type {other:?} is not supported (default, linear)"))),
    };
    Ok((theta.transpose()?, factor))
}

impl Config {
    pub fn parse(text: &[u8], path: &std::path::Path) -> Result<Config, HfError> {
        let raw: Raw = serde_json::from_slice(text).map_err(|source| HfError::Json { path: path.to_owned(), source })?;
        let family = Family::of(&raw.model_type)?;
        let n_layers = bounded("num_hidden_layers", raw.num_hidden_layers, MAX_LAYERS)?;
        let hidden = bounded("hidden_size", raw.hidden_size, MAX_DIM)?;
        let ffn = bounded("intermediate_size", raw.intermediate_size, MAX_DIM)?;
        let n_head = bounded("num_attention_heads", raw.num_attention_heads, MAX_DIM)?;
        let n_head_kv = bounded("num_key_value_heads", raw.num_key_value_heads.unwrap_or(n_head as u64), MAX_DIM)?;
        if n_head % n_head_kv != 0 {
            return Err(HfError::BadConfig(format!("{n_head_kv} key/value heads do not divide {n_head} heads")));
        }
        let head_dim = match raw.head_dim {
            Some(d) => bounded("head_dim", d, MAX_DIM)?,
            None if hidden % n_head == 0 => hidden / n_head,
            None => return Err(HfError::BadConfig(format!("{n_head} heads do not divide hidden_size {hidden}"))),
        };
        if (n_head * head_dim) as u64 > MAX_DIM || head_dim % 2 != 0 {
            return Err(HfError::BadConfig(format!("{n_head} heads of {head_dim}")));
        }
        let vocab = bounded("vocab_size", raw.vocab_size, MAX_VOCAB)?;
        let context = bounded("max_position_embeddings", raw.max_position_embeddings.unwrap_or(4096), MAX_CONTEXT)?;
        let rms_eps = positive("rms_norm_eps", raw.rms_norm_eps.unwrap_or(1e-6))?;
        let act = raw.hidden_activation.as_deref().or(raw.hidden_act.as_deref()).unwrap_or("silu");
        let want_act = if family == Family::Gemma3 { "gelu_pytorch_tanh" } else { "silu" };
        if act != want_act {
            return Err(HfError::BadConfig(format!("activation {act:?} (dgr computes {want_act} for this model type)")));
        }
        if raw.attn_logit_softcapping.is_some_and(|c| c != 0.0) {
            return Err(HfError::BadConfig("attention logit softcapping is not supported".into()));
        }
        let rope_dim = match raw.partial_rotary_factor {
            None => head_dim,
            Some(f) if f > 0.0 && f <= 1.0 && ((head_dim as f64 * f) as usize).is_multiple_of(2) => (head_dim as f64 * f) as usize,
            Some(f) => return Err(HfError::BadConfig(format!("partial_rotary_factor {f}"))),
        };

        // RoPE: version 4's rope_theta and rope_scaling, or version 5's rope_parameters (per
        // attention kind for Gemma 3).
        let params = raw.rope_parameters.as_ref();
        let (global, local) = match params.and_then(Json::as_object) {
            Some(p) if p.contains_key("full_attention") => {
                (rope_section("rope_parameters.full_attention", &p["full_attention"])?, p.get("sliding_attention"))
            }
            Some(_) => (rope_section("rope_parameters", params.unwrap_or(&Json::Null))?, None),
            None => (rope_section("rope_scaling", raw.rope_scaling.as_ref().unwrap_or(&Json::Null))?, None),
        };
        let default_theta = if family == Family::Gemma3 { 1e6 } else { 1e4 };
        let rope_base = positive("rope_theta", global.0.or(raw.rope_theta).unwrap_or(default_theta))?;
        let arch = family.arch();
        let key = |k: &str| format!("{arch}.{k}");
        let mut md: Vec<(String, Value)> = vec![
            ("general.architecture".into(), Value::String(arch.into())),
            (key("block_count"), Value::U32(n_layers as u32)),
            (key("embedding_length"), Value::U32(hidden as u32)),
            (key("feed_forward_length"), Value::U32(ffn as u32)),
            (key("attention.head_count"), Value::U32(n_head as u32)),
            (key("attention.head_count_kv"), Value::U32(n_head_kv as u32)),
            (key("attention.key_length"), Value::U32(head_dim as u32)),
            (key("attention.value_length"), Value::U32(head_dim as u32)),
            (key("rope.dimension_count"), Value::U32(rope_dim as u32)),
            (key("rope.freq_base"), Value::F32(rope_base)),
            (key("attention.layer_norm_rms_epsilon"), Value::F32(rms_eps)),
            (key("context_length"), Value::U32(context as u32)),
            (key("vocab_size"), Value::U32(vocab as u32)),
        ];
        if let Some(f) = global.1 {
            md.push((key("rope.scaling.type"), Value::String("linear".into())));
            md.push((key("rope.scaling.factor"), Value::F32(positive("the RoPE scaling factor", f)?)));
        }
        match family {
            Family::Gemma3 => {
                let window = bounded("sliding_window", raw.sliding_window.unwrap_or(4096), MAX_CONTEXT)?;
                let flags: Vec<bool> = match (&raw.layer_types, raw.sliding_window_pattern) {
                    (Some(types), _) => {
                        if types.len() != n_layers {
                            return Err(HfError::BadConfig(format!("layer_types has {} entries for {n_layers} layers", types.len())));
                        }
                        types
                            .iter()
                            .map(|t| match t.as_str() {
                                "sliding_attention" => Ok(true),
                                "full_attention" => Ok(false),
                                other => Err(HfError::BadConfig(format!("layer type {other:?}"))),
                            })
                            .collect::<Result<_, _>>()?
                    }
                    // Transformers 4: every `pattern`-th layer is global.
                    (None, p) => {
                        let p = p.unwrap_or(6).max(1);
                        (0..n_layers as u64).map(|i| (i + 1) % p != 0).collect()
                    }
                };
                md.push((key("attention.sliding_window"), Value::U32(window as u32)));
                md.push((key("attention.sliding_window_pattern"), Value::Array(flags.into_iter().map(Value::Bool).collect())));
                let local = match local {
                    Some(s) => rope_section("rope_parameters.sliding_attention", s)?,
                    None => (raw.rope_local_base_freq, None),
                };
                if local.1.is_some() {
                    return Err(HfError::BadConfig("RoPE scaling on sliding-window layers is not supported".into()));
                }
                md.push((key("rope.freq_base_swa"), Value::F32(positive("the local RoPE base", local.0.unwrap_or(1e4))?)));
                if let Some(c) = raw.final_logit_softcapping.filter(|&c| c != 0.0) {
                    md.push((key("final_logit_softcapping"), Value::F32(positive("final_logit_softcapping", c)?)));
                }
                // dgr scales attention by 1/√head_dim (and gemma3-27B's 1/√(hidden/heads)), as
                // llama.cpp; Transformers by 1/√query_pre_attn_scalar. Refuse where they differ.
                let expected = if n_layers == 62 { hidden / n_head } else { head_dim };
                if let Some(q) = raw.query_pre_attn_scalar.filter(|&q| q != expected as f64) {
                    return Err(HfError::BadConfig(format!("query_pre_attn_scalar {q} (dgr scales attention by 1/√{expected})")));
                }
            }
            Family::Mistral | Family::Qwen2 => {
                // Served only as far as the window reaches, where a window hides nothing.
                let window = raw.sliding_window.filter(|_| family == Family::Mistral || raw.use_sliding_window == Some(true));
                if let Some(w) = window.filter(|&w| w < context as u64) {
                    let w = bounded("sliding_window", w, MAX_CONTEXT)?;
                    md.iter_mut().filter(|(k, _)| *k == key("context_length")).for_each(|(_, v)| *v = Value::U32(w as u32));
                }
            }
            Family::Llama | Family::Qwen3 => {}
        }
        let tied = raw.tie_word_embeddings.unwrap_or(family == Family::Gemma3);
        let qkv_bias = family == Family::Qwen2 || raw.attention_bias;
        Ok(Config { family, n_layers, hidden, ffn, n_head, n_head_kv, head_dim, vocab, tied, qkv_bias, metadata: md })
    }
}

//! Transformers tensor names and shapes against GGUF's, and the rewrites llama.cpp's converter
//! applies (which the loader repeats, so either format computes the same numbers).

use crate::config::{Config, Family};
use dgr_gguf::GgmlType;
use std::collections::HashMap;

/// Per-layer names: (Transformers suffix after `model.layers.N.`, GGUF suffix after `blk.N.`).
/// Gemma 3 names its norms differently (below).
const LAYER: [(&str, &str); 13] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
];

/// The norm after attention: the FFN's input norm for most, a post-attention norm for Gemma 3
/// (whose FFN input norm is `pre_feedforward_layernorm`).
fn norms(family: Family) -> &'static [(&'static str, &'static str)] {
    if family == Family::Gemma3 {
        &[
            ("post_attention_layernorm.weight", "post_attention_norm.weight"),
            ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
            ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
        ]
    } else {
        &[("post_attention_layernorm.weight", "ffn_norm.weight")]
    }
}

const GLOBAL: [(&str, &str); 3] =
    [("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"), ("lm_head.weight", "output.weight")];

/// The GGUF name of a Transformers tensor, if it is one dgr knows.
pub(crate) fn gguf_name(hf: &str, family: Family) -> Option<String> {
    if let Some(&(_, g)) = GLOBAL.iter().find(|(h, _)| *h == hf) {
        return Some(g.into());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (index, suffix) = rest.split_once('.')?;
    // Digits only, no sign or leading zeros: one spelling per layer.
    if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) || (index.len() > 1 && index.starts_with('0')) {
        return None;
    }
    let (_, g) = LAYER.iter().chain(norms(family)).find(|(h, _)| *h == suffix)?;
    Some(format!("blk.{index}.{g}"))
}

/// The Transformers name of a GGUF tensor (for messages).
pub(crate) fn hf_name(gguf: &str, family: Family) -> String {
    if let Some(&(h, _)) = GLOBAL.iter().find(|(_, g)| *g == gguf) {
        return h.into();
    }
    let Some((index, suffix)) = gguf.strip_prefix("blk.").and_then(|r| r.split_once('.')) else { return gguf.into() };
    match LAYER.iter().chain(norms(family)).find(|(_, g)| *g == suffix) {
        Some((h, _)) => format!("model.layers.{index}.{h}"),
        None => gguf.into(),
    }
}

/// Every tensor the config calls for, by GGUF name, with its Transformers shape.
pub(crate) fn expected(c: &Config) -> HashMap<String, Vec<usize>> {
    let (h, f, hd) = (c.hidden, c.ffn, c.head_dim);
    let (q, kv) = (c.n_head * hd, c.n_head_kv * hd);
    let mut m = HashMap::new();
    m.insert("token_embd.weight".to_string(), vec![c.vocab, h]);
    m.insert("output_norm.weight".to_string(), vec![h]);
    if !c.tied {
        m.insert("output.weight".to_string(), vec![c.vocab, h]);
    }
    let qk_norm = matches!(c.family, Family::Qwen3 | Family::Gemma3);
    for i in 0..c.n_layers {
        let mut add = |s: &str, shape: Vec<usize>| m.insert(format!("blk.{i}.{s}"), shape);
        add("attn_norm.weight", vec![h]);
        add("attn_q.weight", vec![q, h]);
        add("attn_k.weight", vec![kv, h]);
        add("attn_v.weight", vec![kv, h]);
        add("attn_output.weight", vec![h, q]);
        if c.qkv_bias {
            add("attn_q.bias", vec![q]);
            add("attn_k.bias", vec![kv]);
            add("attn_v.bias", vec![kv]);
        }
        if qk_norm {
            add("attn_q_norm.weight", vec![hd]);
            add("attn_k_norm.weight", vec![hd]);
        }
        for (_, g) in norms(c.family) {
            add(g, vec![h]);
        }
        add("ffn_gate.weight", vec![f, h]);
        add("ffn_up.weight", vec![f, h]);
        add("ffn_down.weight", vec![h, f]);
    }
    m
}

/// How a tensor's bytes change at load.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Rewrite {
    None,
    /// llama.cpp's `permute`: within each of `heads` heads, rows `[first half; second half]`
    /// interleaved, so adjacent-pair RoPE rotates what Transformers' half-split RoPE rotates.
    Interleave {
        heads: usize,
    },
    /// Gemma's norm weight w becomes 1 + w, in f32.
    AddOne,
}

pub(crate) fn rewrite(gguf: &str, c: &Config) -> Rewrite {
    let suffix = gguf.strip_prefix("blk.").and_then(|r| r.split_once('.')).map_or(gguf, |(_, s)| s);
    if c.family.permutes_qk() {
        match suffix {
            "attn_q.weight" | "attn_q.bias" => return Rewrite::Interleave { heads: c.n_head },
            "attn_k.weight" | "attn_k.bias" => return Rewrite::Interleave { heads: c.n_head_kv },
            _ => {}
        }
    }
    if c.family.norms_add_one() && gguf.ends_with("norm.weight") {
        return Rewrite::AddOne;
    }
    Rewrite::None
}

/// `raw` (a tensor of type `ty` and Transformers shape `shape`, its size already checked)
/// rewritten.
pub(crate) fn apply(r: Rewrite, ty: GgmlType, raw: Vec<u8>, shape: &[usize]) -> Result<Vec<u8>, dgr_gguf::GgufError> {
    Ok(match r {
        Rewrite::None => raw,
        Rewrite::Interleave { heads } => {
            let rows = shape[0];
            let row_bytes = raw.len() / rows;
            let half = rows / heads / 2;
            let mut out = vec![0u8; raw.len()];
            for h in 0..heads {
                for j in 0..half {
                    for s in 0..2 {
                        let (to, from) = (h * 2 * half + 2 * j + s, h * 2 * half + s * half + j);
                        out[to * row_bytes..][..row_bytes].copy_from_slice(&raw[from * row_bytes..][..row_bytes]);
                    }
                }
            }
            out
        }
        Rewrite::AddOne => {
            let mut w = vec![0f32; shape[0]];
            dgr_gguf::quant::dequantize_row(ty, &raw, &mut w)?;
            w.iter().flat_map(|v| (1.0 + v).to_le_bytes()).collect()
        }
    })
}

//! Checkpoints the tests write: dgr's synthetic GGUF models as Transformers checkpoints.
#![allow(dead_code)]

use dgr_engine::ModelConfig;
use dgr_gguf::{GgmlType, Gguf};
use dgr_hf::Family;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;
use std::path::{Path, PathBuf};

pub struct TempDir(pub PathBuf);
impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let p = std::env::temp_dir().join(format!("dgr-hf-test-{}-{tag}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn family(arch: &str) -> Family {
    match arch {
        "llama" => Family::Llama,
        "mistral" => Family::Mistral,
        "qwen2" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        _ => Family::Gemma3,
    }
}

/// Undoes llama.cpp's `permute` of Q/K rows: interleaved pairs back to halves, per head.
fn halves(raw: &[u8], rows: usize, heads: usize) -> Vec<u8> {
    let row = raw.len() / rows;
    let half = rows / heads / 2;
    let mut out = vec![0u8; raw.len()];
    for h in 0..heads {
        for j in 0..half {
            for s in 0..2 {
                let (interleaved, split) = (h * 2 * half + 2 * j + s, h * 2 * half + s * half + j);
                out[split * row..][..row].copy_from_slice(&raw[interleaved * row..][..row]);
            }
        }
    }
    out
}

/// Writes the checkpoint of `g` (a synthetic model of `arch`) into `dir`; sharded in two files
/// when `sharded`.
pub fn write_checkpoint(g: &Gguf, arch: &str, dir: &Path, sharded: bool) {
    let c = ModelConfig::from_gguf(g).unwrap();
    let fam = family(arch);
    // As llama.cpp's converter: llama's (and Mistral's) Q/K rows permuted, Gemma's norms + 1.
    let (permuted, plus_one) = (matches!(arch, "llama" | "mistral"), arch == "gemma3");
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for t in g.tensors() {
        let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
        let mut bytes = g.tensor_data(t).to_vec();
        let name = t.name.as_str();
        if permuted && (name.ends_with("attn_q.weight") || name.ends_with("attn_q.bias")) {
            bytes = halves(&bytes, shape[0], c.n_head);
        }
        if permuted && (name.ends_with("attn_k.weight") || name.ends_with("attn_k.bias")) {
            bytes = halves(&bytes, shape[0], c.n_head_kv);
        }
        if plus_one && t.name.ends_with("norm.weight") {
            // Exact: synthetic norms lie in [0.5, 16), where w - 1 and 1 + (w - 1) round nowhere.
            bytes = bytes.chunks_exact(4).flat_map(|b| (f32::from_le_bytes(b.try_into().unwrap()) - 1.0).to_le_bytes()).collect();
        }
        let dtype = match t.ty {
            GgmlType::F32 => Dtype::F32,
            GgmlType::F16 => Dtype::F16,
            GgmlType::BF16 => Dtype::BF16,
            other => panic!("{other:?}"),
        };
        tensors.push((dgr_hf::transformers_name(&t.name, fam), dtype, shape, bytes));
    }
    let model_type = if arch == "gemma3" { "gemma3_text" } else { arch };
    let mut cfg = json!({
        "model_type": model_type,
        "hidden_size": c.hidden, "intermediate_size": c.ffn, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_head, "num_key_value_heads": c.n_head_kv, "head_dim": c.head_dim,
        "vocab_size": c.vocab, "max_position_embeddings": c.context,
        "rms_norm_eps": c.rms_eps as f64, "rope_theta": c.rope_base as f64,
        "tie_word_embeddings": !g.tensors().iter().any(|t| t.name == "output.weight"),
    });
    if let Some(w) = &c.sliding_window {
        let types: Vec<&str> = w.layers.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
        cfg["sliding_window"] = json!(w.window);
        cfg["layer_types"] = json!(types);
        cfg["rope_local_base_freq"] = json!(w.rope_base as f64);
        cfg["query_pre_attn_scalar"] = json!(c.head_dim);
        cfg["hidden_activation"] = json!("gelu_pytorch_tanh");
    }
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    let write = |file: &str, part: &[(String, Dtype, Vec<usize>, Vec<u8>)]| {
        let views: Vec<(String, TensorView)> =
            part.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
        safetensors::serialize_to_file(views, None, &dir.join(file)).unwrap();
    };
    if sharded {
        let (a, b) = tensors.split_at(tensors.len() / 2);
        let (fa, fb) = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors");
        write(fa, a);
        write(fb, b);
        let map: serde_json::Map<String, serde_json::Value> =
            a.iter().map(|t| (t.0.clone(), json!(fa))).chain(b.iter().map(|t| (t.0.clone(), json!(fb)))).collect();
        std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_vec(&json!({ "weight_map": map })).unwrap()).unwrap();
    } else {
        write("model.safetensors", &tensors);
    }
}

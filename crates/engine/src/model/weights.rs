//! The tensors of one layer range, read from the GGUF file by their llama-family names and held
//! by the backend.

use crate::backend::Backend;
use crate::{EngineError, ModelConfig};
use dgr_gguf::{GgmlType, Gguf};
use std::ops::Range;

pub(super) struct Layer<B: Backend> {
    pub attn_norm: B::Vector,
    pub wq: B::Matrix,
    pub wk: B::Matrix,
    pub wv: B::Matrix,
    pub bias: Option<[B::Vector; 3]>,
    /// Per-head norms of queries and keys (qwen3, gemma3).
    pub qk_norm: Option<[B::Vector; 2]>,
    pub wo: B::Matrix,
    /// Norms of the attention's and the FFN's outputs, before each residual add (gemma3).
    pub post_norms: Option<[B::Vector; 2]>,
    pub ffn_norm: B::Vector,
    pub gate: B::Matrix,
    pub up: B::Matrix,
    pub down: B::Matrix,
}

pub(super) struct Head<B: Backend> {
    pub norm: B::Vector,
    pub w: B::Matrix,
}

pub(super) struct Weights<B: Backend> {
    /// The token embedding, when the range starts at layer 0.
    pub embed: Option<B::Matrix>,
    pub layers: Vec<Layer<B>>,
    /// The final norm and the head, when the range ends at the model's last layer.
    pub head: Option<Head<B>>,
    /// Bytes a forward over every layer reads: the matrices as stored, the norms as f32, and a
    /// head tied to the embedding once.
    pub bytes: usize,
}

/// A weight vector of `len` floats, as f32.
fn vector(g: &Gguf, name: &str, len: usize) -> Result<Vec<f32>, EngineError> {
    let t = g.tensor(name).filter(|t| g.is_mapped(t)).ok_or_else(|| EngineError::MissingTensor(name.into()))?;
    if t.dims != [len as u64] {
        return Err(EngineError::BadShape { name: name.into(), expected: vec![len as u64], found: t.dims.clone() });
    }
    if !matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        return Err(EngineError::UnsupportedType { name: name.into(), ty: t.ty.name() });
    }
    let mut out = vec![0f32; len];
    dgr_gguf::quant::dequantize_row(t.ty, g.tensor_data(t), &mut out)?;
    Ok(out)
}

/// Reads layers `range` of the model in `g` (and the embedding, the final norm and the head
/// where the range holds them) into `b`.
pub(super) fn load<B: Backend>(b: &B, g: &Gguf, cfg: &ModelConfig, range: Range<usize>) -> Result<Weights<B>, EngineError> {
    let (h, kvd, qd, f) = (cfg.hidden, cfg.kv_dim(), cfg.q_dim(), cfg.ffn);
    let mut bytes = 0;
    let embed = if range.start == 0 {
        let t = b.table("token_embd.weight", h, cfg.vocab)?;
        bytes += b.matrix_bytes(&t);
        Some(t)
    } else {
        None
    };
    let mut matrix = |name: &str, k: usize, rows: usize| -> Result<B::Matrix, EngineError> {
        let m = b.matrix(name, k, rows)?;
        bytes += b.matrix_bytes(&m);
        Ok(m)
    };
    let mut norm_floats = 0;
    let mut norm = |name: &str, len: usize| -> Result<B::Vector, EngineError> {
        norm_floats += len;
        Ok(b.vector(vector(g, name, len)?))
    };
    let mut layers = Vec::with_capacity(range.len());
    for i in range.clone() {
        let n = |s: &str| format!("blk.{i}.{s}");
        let bias = if g.tensor(&n("attn_q.bias")).is_some() {
            let v = |name: &str, len| vector(g, name, len).map(|v| b.vector(v));
            Some([v(&n("attn_q.bias"), qd)?, v(&n("attn_k.bias"), kvd)?, v(&n("attn_v.bias"), kvd)?])
        } else {
            None
        };
        let qk_norm = if cfg.qk_norm {
            Some([norm(&n("attn_q_norm.weight"), cfg.head_dim)?, norm(&n("attn_k_norm.weight"), cfg.head_dim)?])
        } else {
            None
        };
        let post_norms =
            if cfg.post_norms { Some([norm(&n("post_attention_norm.weight"), h)?, norm(&n("post_ffw_norm.weight"), h)?]) } else { None };
        layers.push(Layer {
            attn_norm: norm(&n("attn_norm.weight"), h)?,
            wq: matrix(&n("attn_q.weight"), h, qd)?,
            wk: matrix(&n("attn_k.weight"), h, kvd)?,
            wv: matrix(&n("attn_v.weight"), h, kvd)?,
            bias,
            qk_norm,
            wo: matrix(&n("attn_output.weight"), qd, h)?,
            post_norms,
            ffn_norm: norm(&n("ffn_norm.weight"), h)?,
            gate: matrix(&n("ffn_gate.weight"), h, f)?,
            up: matrix(&n("ffn_up.weight"), h, f)?,
            down: matrix(&n("ffn_down.weight"), f, h)?,
        });
    }
    let head = if range.end == cfg.n_layers {
        let norm = b.vector(vector(g, "output_norm.weight", h)?);
        let untied = g.tensor("output.weight").is_some();
        let w = b.matrix(if untied { "output.weight" } else { "token_embd.weight" }, h, cfg.vocab)?;
        if embed.is_none() || untied {
            bytes += b.matrix_bytes(&w);
        }
        Some(Head { norm, w })
    } else {
        None
    };
    Ok(Weights { embed, layers, head, bytes: bytes + 4 * norm_floats })
}

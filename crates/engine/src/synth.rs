//! Random-weight llama-shaped models, written as GGUF: fixtures for tests and for benchmarking
//! shapes other than the default model's.

use dgr_gguf::{GgmlType, GgufError, GgufWriter, Value};

/// The shape and storage type of a synthetic model.
#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// At least 258: the 256 byte tokens plus BOS and EOS.
    pub vocab: usize,
    /// Type of the matrices (norms stay F32).
    pub ty: GgmlType,
    pub seed: u64,
    pub context: usize,
    /// "llama" (adjacent-pair RoPE, no biases) or "qwen2" (half-split RoPE, q/k/v biases).
    pub arch: &'static str,
}

impl Default for SynthSpec {
    fn default() -> Self {
        SynthSpec {
            layers: 4,
            hidden: 64,
            ffn: 128,
            heads: 4,
            kv_heads: 2,
            vocab: 320,
            ty: GgmlType::Q4_1,
            seed: 1,
            context: 512,
            arch: "llama",
        }
    }
}

struct Rng(u64);
impl Rng {
    fn normalish(&mut self) -> f32 {
        // Sum of uniforms: cheap, bounded, close enough to normal for weights.
        let mut s = 0f32;
        for _ in 0..4 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            s += (self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        }
        s
    }
}

/// GPT-2's printable stand-in for each byte, so a byte-level vocabulary covers every input.
fn byte_token(b: u8) -> String {
    let printable = |c: u32| (33..=126).contains(&c) || (161..=172).contains(&c) || (174..=255).contains(&c);
    if printable(b as u32) {
        return char::from_u32(b as u32).map(String::from).unwrap_or_default();
    }
    let rank = (0..b as u32).filter(|c| !printable(*c)).count() as u32;
    char::from_u32(256 + rank).map(String::from).unwrap_or_default()
}

impl SynthSpec {
    pub fn to_gguf(&self) -> Result<Vec<u8>, GgufError> {
        let mut rng = Rng(self.seed);
        let mut w = GgufWriter::new();
        let u32v = |v: usize| Value::U32(v as u32);
        let a = self.arch;
        w.add_metadata("general.architecture", Value::String(a.into()))?;
        w.add_metadata("general.name", Value::String(format!("dgr-synth-{}", self.seed)))?;
        w.add_metadata(&format!("{a}.block_count"), u32v(self.layers))?;
        w.add_metadata(&format!("{a}.context_length"), u32v(self.context))?;
        w.add_metadata(&format!("{a}.embedding_length"), u32v(self.hidden))?;
        w.add_metadata(&format!("{a}.feed_forward_length"), u32v(self.ffn))?;
        w.add_metadata(&format!("{a}.attention.head_count"), u32v(self.heads))?;
        w.add_metadata(&format!("{a}.attention.head_count_kv"), u32v(self.kv_heads))?;
        w.add_metadata(&format!("{a}.rope.freq_base"), Value::F32(10000.0))?;
        w.add_metadata(&format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(1e-5))?;
        let vocab = self.vocab.max(258);
        let tokens: Vec<Value> = (0..vocab)
            .map(|i| match i {
                0..=255 => byte_token(i as u8),
                256 => "<s>".into(),
                257 => "</s>".into(),
                _ => format!("<extra_{i}>"),
            })
            .map(Value::String)
            .collect();
        let types = (0..vocab).map(|i| Value::I32(if i < 256 { 1 } else { 3 })).collect();
        w.add_metadata("tokenizer.ggml.model", Value::String("gpt2".into()))?;
        w.add_metadata("tokenizer.ggml.pre", Value::String("gpt2".into()))?;
        w.add_metadata("tokenizer.ggml.tokens", Value::Array(tokens))?;
        w.add_metadata("tokenizer.ggml.token_type", Value::Array(types))?;
        w.add_metadata("tokenizer.ggml.merges", Value::Array(Vec::new()))?;
        w.add_metadata("tokenizer.ggml.bos_token_id", Value::U32(256))?;
        w.add_metadata("tokenizer.ggml.eos_token_id", Value::U32(257))?;
        w.add_metadata("tokenizer.ggml.add_bos_token", Value::Bool(false))?;

        let (h, f, kvd) = (self.hidden, self.ffn, self.hidden / self.heads * self.kv_heads);
        let mut matrix = |w: &mut GgufWriter, name: &str, k: usize, rows: usize, ty: GgmlType| -> Result<(), GgufError> {
            let scale = 1.0 / (k as f32).sqrt();
            let vals: Vec<f32> = (0..k * rows).map(|_| rng.normalish() * 2.0 * scale).collect();
            let mut data = Vec::new();
            for row in vals.chunks(k) {
                dgr_gguf::quant::quantize_row(ty, row, &mut data)?;
            }
            w.add_tensor(name, ty, &[k as u64, rows as u64], data)
        };
        let vector = |w: &mut GgufWriter, name: &str, len: usize, base: f32| -> Result<(), GgufError> {
            let data: Vec<u8> = (0..len).flat_map(|i| (base + 0.01 * (i % 7) as f32).to_le_bytes()).collect();
            w.add_tensor(name, GgmlType::F32, &[len as u64], data)
        };
        let norm = |w: &mut GgufWriter, name: &str| vector(w, name, h, 1.0);
        matrix(&mut w, "token_embd.weight", h, vocab, GgmlType::Q8_0)?;
        for i in 0..self.layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            norm(&mut w, &n("attn_norm.weight"))?;
            matrix(&mut w, &n("attn_q.weight"), h, h, self.ty)?;
            matrix(&mut w, &n("attn_k.weight"), h, kvd, self.ty)?;
            matrix(&mut w, &n("attn_v.weight"), h, kvd, self.ty)?;
            if a == "qwen2" {
                vector(&mut w, &n("attn_q.bias"), h, -0.02)?;
                vector(&mut w, &n("attn_k.bias"), kvd, 0.03)?;
                vector(&mut w, &n("attn_v.bias"), kvd, -0.01)?;
            }
            matrix(&mut w, &n("attn_output.weight"), h, h, self.ty)?;
            norm(&mut w, &n("ffn_norm.weight"))?;
            matrix(&mut w, &n("ffn_gate.weight"), h, f, self.ty)?;
            matrix(&mut w, &n("ffn_up.weight"), h, f, self.ty)?;
            matrix(&mut w, &n("ffn_down.weight"), f, h, self.ty)?;
        }
        norm(&mut w, "output_norm.weight")?;
        Ok(w.to_bytes())
    }
}

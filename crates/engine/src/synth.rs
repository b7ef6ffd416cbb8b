//! Random-weight models of each architecture dgr runs, written as GGUF files that llama.cpp
//! loads too: fixtures for tests, for holding dgr against llama.cpp, and for benchmarking shapes
//! other than the default model's. A spec and its seed always give the same bytes.

mod mixture;
mod vocab;

pub use mixture::{q4_k_m_type, use_more_bits, Mixture};

use crate::{Arch, EngineError};
use dgr_gguf::{GgmlType, GgufWriter, Value};

/// The smallest vocabulary: 256 byte tokens, then BOS, EOS and UNK (SentencePiece) or BOS, EOS
/// and one merge (BPE: an empty merges array would carry no element type, and llama.cpp wants
/// strings there).
pub const MIN_VOCAB: usize = 259;

/// Gemma 3's sliding window, shorter than the sequences the tests run so that it matters.
const GEMMA3_WINDOW: u32 = 16;

/// The shape and storage type of a synthetic model.
#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Width of each attention head; None: hidden / heads. Only qwen3 and gemma3 record it
    /// (`key_length`), so only they may make it differ.
    pub head_dim: Option<usize>,
    /// At least [`MIN_VOCAB`].
    pub vocab: usize,
    /// Type of the matrices, the embedding included (norms and biases stay F32).
    pub ty: GgmlType,
    /// Whether `ty` is every matrix's type or the base of a mixture.
    pub mixture: Mixture,
    /// A head of its own (`output.weight`) even where the architecture's small models tie it
    /// to the embedding (Qwen2.5-7B's is its own; its 0.5B's is tied).
    pub untied_head: bool,
    pub seed: u64,
    pub context: usize,
    pub arch: Arch,
}

impl Default for SynthSpec {
    fn default() -> Self {
        SynthSpec {
            layers: 4,
            hidden: 64,
            ffn: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: None,
            vocab: 320,
            ty: GgmlType::Q4_1,
            mixture: Mixture::Pure,
            untied_head: false,
            seed: 1,
            context: 512,
            arch: Arch::Llama,
        }
    }
}

/// What sets an architecture's files apart, as llama.cpp's converter writes the real models'.
struct Family {
    /// `general.architecture`: Mistral's files say llama.
    gguf_arch: Arch,
    rope_base: f32,
    rms_eps: f32,
    tokenizer: Tokenizer,
    /// A head of its own (`output.weight`) rather than the embedding's transpose.
    untied_head: bool,
    qkv_bias: bool,
    /// RMS norms over each head's queries and keys, and `key_length`.
    qk_norm: bool,
    /// Gemma 3: norms after attention and after the FFN, a scaled embedding, GELU, and a
    /// sliding window on five layers in six.
    gemma: bool,
}

enum Tokenizer {
    /// Byte-level BPE with this pre-tokenizer.
    Bpe(&'static str),
    /// SentencePiece; whether it prefixes a space.
    Spm(bool),
}

fn family(arch: Arch) -> Family {
    let llama = Family {
        gguf_arch: Arch::Llama,
        rope_base: 10000.0,
        rms_eps: 1e-5,
        tokenizer: Tokenizer::Bpe("smollm"),
        untied_head: false,
        qkv_bias: false,
        qk_norm: false,
        gemma: false,
    };
    let qwen = Family { gguf_arch: Arch::Qwen2, rope_base: 1e6, rms_eps: 1e-6, tokenizer: Tokenizer::Bpe("qwen2"), ..llama };
    match arch {
        Arch::Llama => llama,
        Arch::Mistral => Family { rope_base: 1e6, tokenizer: Tokenizer::Spm(true), untied_head: true, ..llama },
        Arch::Qwen2 => Family { qkv_bias: true, ..qwen },
        Arch::Qwen3 => Family { gguf_arch: Arch::Qwen3, qk_norm: true, ..qwen },
        Arch::Gemma3 => Family { gguf_arch: Arch::Gemma3, tokenizer: Tokenizer::Spm(false), qk_norm: true, gemma: true, ..qwen },
    }
}

/// A linear congruential generator: the weights depend on the seed alone.
#[derive(Clone, Copy)]
struct Rng(u64);
impl Rng {
    const A: u64 = 6364136223846793005;
    const C: u64 = 1442695040888963407;
    /// Draws one `normalish` value takes.
    const DRAWS: u64 = 4;

    fn normalish(&mut self) -> f32 {
        // Sum of uniforms: cheap, bounded, close enough to normal for weights.
        let mut s = 0f32;
        for _ in 0..Self::DRAWS {
            self.0 = self.0.wrapping_mul(Self::A).wrapping_add(Self::C);
            s += (self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        }
        s
    }

    /// The generator `n` draws on, in O(log n): a step is x → A·x + C, and steps compose as
    /// affine maps, so the map of n steps is built by squaring.
    fn skip(self, mut n: u64) -> Rng {
        let (mut a, mut c) = (Self::A, Self::C);
        let (mut acc_a, mut acc_c) = (1u64, 0u64);
        while n > 0 {
            if n & 1 == 1 {
                (acc_a, acc_c) = (acc_a.wrapping_mul(a), acc_c.wrapping_mul(a).wrapping_add(c));
            }
            (a, c) = (a.wrapping_mul(a), c.wrapping_mul(a).wrapping_add(c));
            n >>= 1;
        }
        Rng(acc_a.wrapping_mul(self.0).wrapping_add(acc_c))
    }
}

/// Rows below which a matrix is not worth another thread.
const MIN_PART_ROWS: usize = 256;

/// The file being written and the generator its tensors draw from, in the order they are added.
struct Tensors {
    w: GgufWriter,
    rng: Rng,
}

impl Tensors {
    /// `rows` rows of `k` weights, scaled so each output has about unit variance, of the type
    /// `ty_of` gives its name and row length.
    fn matrix(&mut self, name: &str, k: usize, rows: usize, ty_of: &impl Fn(&str, usize) -> GgmlType) -> Result<(), EngineError> {
        let ty = ty_of(name, k);
        let scale = 2.0 / (k as f32).sqrt();
        // The rows in parallel, each part's generator skipped to its first row: the same bytes as
        // one pass, in a fraction of the time (a 7B-shaped file is billions of draws).
        let per_row = Rng::DRAWS * k as u64;
        let parts = std::thread::available_parallelism().map_or(1, |n| n.get()).min(rows.div_ceil(MIN_PART_ROWS)).max(1);
        let part_rows = rows.div_ceil(parts);
        let first = self.rng;
        let quantize = |lo: usize, hi: usize| -> Result<Vec<u8>, EngineError> {
            let mut rng = first.skip(per_row * lo as u64);
            let (mut data, mut row) = (Vec::new(), vec![0f32; k]);
            for _ in lo..hi {
                row.iter_mut().for_each(|x| *x = rng.normalish() * scale);
                dgr_gguf::quant::quantize_row(ty, &row, &mut data)?;
            }
            Ok(data)
        };
        let done: Vec<Result<Vec<u8>, EngineError>> = std::thread::scope(|s| {
            let quantize = &quantize;
            let handles: Vec<_> = (0..parts).map(|p| s.spawn(move || quantize(p * part_rows, ((p + 1) * part_rows).min(rows)))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
        });
        let data = done.into_iter().collect::<Result<Vec<_>, _>>()?.concat();
        self.rng = first.skip(per_row * rows as u64);
        Ok(self.w.add_tensor(name, ty, &[k as u64, rows as u64], data)?)
    }

    /// An F32 vector spread around `base`: distinct per tensor, so mixing two up shows.
    fn vector(&mut self, name: &str, len: usize, base: f32, spread: f32) -> Result<(), EngineError> {
        let data: Vec<u8> = (0..len).flat_map(|_| (base + spread * self.rng.normalish()).to_le_bytes()).collect();
        Ok(self.w.add_tensor(name, GgmlType::F32, &[len as u64], data)?)
    }

    fn norm(&mut self, name: &str, len: usize) -> Result<(), EngineError> {
        self.vector(name, len, 1.0, 0.2)
    }
}

impl SynthSpec {
    pub fn to_gguf(&self) -> Result<Vec<u8>, EngineError> {
        Ok(self.writer()?.to_bytes())
    }

    /// The model ready to write: `write_to_path` streams a large one to disk.
    pub fn writer(&self) -> Result<GgufWriter, EngineError> {
        let fam = family(self.arch);
        let tied = !(fam.untied_head || self.untied_head);
        if self.mixture == Mixture::Q4KM && self.ty != GgmlType::Q4_K {
            return Err(EngineError::BadConfig(format!("the Q4_K_M mixture is built on Q4_K, not {}", self.ty.name())));
        }
        let n_layers = self.layers;
        let ty_of = |name: &str, row_len: usize| match self.mixture {
            Mixture::Pure => self.ty,
            Mixture::Q4KM => q4_k_m_type(name, row_len as u64, n_layers, tied),
        };
        let (h, f) = (self.hidden, self.ffn);
        let hd = self.head_dim.unwrap_or(h / self.heads.max(1));
        if self.vocab < MIN_VOCAB {
            return Err(EngineError::BadConfig(format!("a vocabulary of {} is below the {MIN_VOCAB} a synthetic model needs", self.vocab)));
        }
        if !fam.qk_norm && hd * self.heads != h {
            return Err(EngineError::BadConfig(format!("{} records no key_length, so its heads are hidden / heads wide", self.arch)));
        }
        let (qd, kvd) = (self.heads * hd, self.kv_heads * hd);
        let mut t = Tensors { w: GgufWriter::new(), rng: Rng(self.seed) };
        let a = fam.gguf_arch.as_str();
        let mut meta = |key: &str, v: Value| t.w.add_metadata(key, v);
        let u32v = |v: usize| Value::U32(v as u32);
        meta("general.architecture", Value::String(a.into()))?;
        meta("general.name", Value::String(format!("dgr-synth-{}-{}", self.arch, self.seed)))?;
        meta(&format!("{a}.block_count"), u32v(self.layers))?;
        meta(&format!("{a}.context_length"), u32v(self.context))?;
        meta(&format!("{a}.embedding_length"), u32v(h))?;
        meta(&format!("{a}.feed_forward_length"), u32v(f))?;
        meta(&format!("{a}.attention.head_count"), u32v(self.heads))?;
        meta(&format!("{a}.attention.head_count_kv"), u32v(self.kv_heads))?;
        if fam.qk_norm {
            meta(&format!("{a}.attention.key_length"), u32v(hd))?;
            meta(&format!("{a}.attention.value_length"), u32v(hd))?;
        }
        if fam.gemma {
            meta(&format!("{a}.attention.sliding_window"), Value::U32(GEMMA3_WINDOW))?;
        }
        meta(&format!("{a}.rope.freq_base"), Value::F32(fam.rope_base))?;
        meta(&format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(fam.rms_eps))?;
        if self.mixture == Mixture::Q4KM {
            // As llama.cpp's quantizer records it, so its tools name the file Q4_K - Medium.
            meta("general.quantization_version", Value::U32(2))?;
            meta("general.file_type", Value::U32(mixture::Q4_K_M_FILE_TYPE))?;
        }
        let keys = match fam.tokenizer {
            Tokenizer::Bpe(pre) => vocab::bpe(self.vocab, pre),
            Tokenizer::Spm(space_prefix) => vocab::spm(self.vocab, space_prefix),
        };
        for (key, v) in keys {
            meta(key, v)?;
        }

        t.matrix("token_embd.weight", h, self.vocab, &ty_of)?;
        for i in 0..self.layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            t.norm(&n("attn_norm.weight"), h)?;
            t.matrix(&n("attn_q.weight"), h, qd, &ty_of)?;
            t.matrix(&n("attn_k.weight"), h, kvd, &ty_of)?;
            t.matrix(&n("attn_v.weight"), h, kvd, &ty_of)?;
            if fam.qkv_bias {
                t.vector(&n("attn_q.bias"), qd, 0.0, 0.2)?;
                t.vector(&n("attn_k.bias"), kvd, 0.0, 0.2)?;
                t.vector(&n("attn_v.bias"), kvd, 0.0, 0.2)?;
            }
            if fam.qk_norm {
                t.norm(&n("attn_q_norm.weight"), hd)?;
                t.norm(&n("attn_k_norm.weight"), hd)?;
            }
            t.matrix(&n("attn_output.weight"), qd, h, &ty_of)?;
            // Gemma 3 adds each block's output, normed, to the embedding scaled by √hidden; post
            // norms well above 1 (as the real ones are) keep the residual from being mostly the
            // input token, which the tied head would then repeat forever.
            if fam.gemma {
                t.vector(&n("post_attention_norm.weight"), h, 8.0, 2.0)?;
            }
            t.norm(&n("ffn_norm.weight"), h)?;
            t.matrix(&n("ffn_gate.weight"), h, f, &ty_of)?;
            t.matrix(&n("ffn_up.weight"), h, f, &ty_of)?;
            t.matrix(&n("ffn_down.weight"), f, h, &ty_of)?;
            if fam.gemma {
                t.vector(&n("post_ffw_norm.weight"), h, 8.0, 2.0)?;
            }
        }
        t.norm("output_norm.weight", h)?;
        if !tied {
            t.matrix("output.weight", h, self.vocab, &ty_of)?;
        }
        Ok(t.w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skipped_generator_is_where_stepping_gets() {
        let mut stepped = Rng(12345);
        for n in 0..300u64 {
            assert_eq!(Rng(12345).skip(n).0, stepped.0, "after {n} draws");
            stepped.0 = stepped.0.wrapping_mul(Rng::A).wrapping_add(Rng::C);
        }
    }

    #[test]
    fn a_matrix_made_in_parts_is_the_one_made_in_one_pass() {
        // 1,000 rows: several parts wherever there are several cores, the last one short.
        let (k, rows) = (64, 1000);
        let mut t = Tensors { w: GgufWriter::new(), rng: Rng(7) };
        t.matrix("m", k, rows, &|_, _| GgmlType::Q8_0).unwrap();
        let (mut rng, mut want, mut row) = (Rng(7), Vec::new(), vec![0f32; k]);
        for _ in 0..rows {
            row.iter_mut().for_each(|x| *x = rng.normalish() * 2.0 / (k as f32).sqrt());
            dgr_gguf::quant::quantize_row(GgmlType::Q8_0, &row, &mut want).unwrap();
        }
        let g = dgr_gguf::Gguf::from_bytes(t.w.to_bytes()).unwrap();
        assert!(g.tensor_data(g.tensor("m").unwrap()) == want, "the parts' bytes differ from one pass");
        assert_eq!(t.rng.0, rng.0, "the generator goes on from where one pass leaves it");
    }
}

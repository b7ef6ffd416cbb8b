//! The tokenizer-related GGUF metadata as plain data, so the tokenizer can be
//! built (and unit-tested) without a model file.

/// Ids of the special tokens the metadata names explicitly; `None` means the
/// key is absent and llama.cpp's per-model default (or text detection) applies.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub sep: Option<u32>,
    pub pad: Option<u32>,
    pub fim_pre: Option<u32>,
    pub fim_suf: Option<u32>,
    pub fim_mid: Option<u32>,
    pub fim_pad: Option<u32>,
    pub fim_rep: Option<u32>,
    pub fim_sep: Option<u32>,
}

/// Raw `tokenizer.*` metadata of a model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizerConfig {
    /// `tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "llama" (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: selects the BPE pre-tokenizer regexes.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type` (llama.cpp's `llama_token_type` values).
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`, each "left right", lowest rank first.
    pub merges: Option<Vec<String>>,
    pub special: SpecialIds,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    pub chat_template: Option<String>,
}

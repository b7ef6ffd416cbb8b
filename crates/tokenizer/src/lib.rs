//! Tokenization of GGUF models, reproducing llama.cpp's `llama_tokenize`
//! exactly, and of Transformers checkpoints through Hugging Face's own
//! `tokenizers`; plus chat-template rendering.
//!
//! Supported GGUF vocabularies: byte-level BPE (`tokenizer.ggml.model =
//! "gpt2"`) with the common pre-tokenizers, and SentencePiece (`"llama"`).

mod bpe;
mod chat;
mod config;
mod error;
mod gguf;
mod hf;
mod pretokenize;
mod special;
mod spm;
mod unicode;
mod unicode_data;
mod utf8;
mod vocab;

pub use chat::ChatMessage;
pub use config::{SpecialIds, TokenizerConfig};
pub use error::TokenizerError;
pub use utf8::Utf8Stream;

use special::Fragment;
use vocab::{Kind, Vocab};

/// A model's tokenizer. Immutable, so it can be shared across threads.
#[derive(Debug)]
pub struct Tokenizer {
    backend: Backend,
    chat_template: Option<String>,
}

#[derive(Debug)]
enum Backend {
    /// A GGUF file's vocabulary, tokenized as llama.cpp does.
    Gguf(Box<Vocab>),
    /// A Transformers checkpoint's tokenizer.json, tokenized by `tokenizers`.
    Hf(Box<hf::HfTokenizer>),
}

impl Tokenizer {
    /// Builds the tokenizer from a model's `tokenizer.*` metadata.
    pub fn from_gguf(g: &dgr_gguf::Gguf) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_config(TokenizerConfig::from_gguf(g)?)
    }

    pub fn from_config(cfg: TokenizerConfig) -> Result<Tokenizer, TokenizerError> {
        Ok(Tokenizer { backend: Backend::Gguf(Box::new(Vocab::new(&cfg)?)), chat_template: cfg.chat_template })
    }

    /// The tokenizer of the model at `path`, opened as `g`: a Transformers checkpoint
    /// directory's own, or the GGUF file's.
    pub fn for_model(path: &std::path::Path, g: &dgr_gguf::Gguf) -> Result<Tokenizer, TokenizerError> {
        if path.is_dir() {
            Tokenizer::from_hf_dir(path)
        } else {
            Tokenizer::from_gguf(g)
        }
    }

    /// The tokenizer of the Transformers checkpoint in `dir` (its tokenizer.json, and
    /// tokenizer_config.json and generation_config.json where present).
    pub fn from_hf_dir(dir: &std::path::Path) -> Result<Tokenizer, TokenizerError> {
        let t = hf::HfTokenizer::from_dir(dir)?;
        Ok(Tokenizer { chat_template: t.chat_template.clone(), backend: Backend::Hf(Box::new(t)) })
    }

    /// Tokenizes `text`. With `parse_special`, control tokens written in the
    /// text (e.g. `<|im_start|>`) become their ids; user-defined tokens always do.
    /// (A Transformers tokenizer always recognizes its added tokens, and adds
    /// its post-processor's special tokens for `add_bos`.)
    pub fn encode(&self, text: &str, add_bos: bool, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        match &self.backend {
            Backend::Gguf(vocab) => self.tokenize(vocab, text, add_bos, false, parse_special),
            Backend::Hf(t) => t.encode(text, add_bos),
        }
    }

    /// Tokenizes a completion prompt as llama.cpp does: special tokens parsed,
    /// BOS/EOS added as the model's `add_bos_token`/`add_eos_token` say; for a
    /// Transformers tokenizer, as `tokenizer(text)` does.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match &self.backend {
            Backend::Gguf(vocab) => self.tokenize(vocab, text, vocab.add_bos, vocab.add_eos, true),
            Backend::Hf(t) => t.encode(text, true),
        }
    }

    /// Tokenizes a rendered chat template: for a GGUF model as a completion prompt (as
    /// llama.cpp's server does); for a Transformers tokenizer as `apply_chat_template` does,
    /// adding no special tokens (the template writes its own BOS).
    pub fn encode_chat(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match &self.backend {
            Backend::Gguf(_) => self.encode_prompt(text),
            Backend::Hf(t) => t.encode(text, false),
        }
    }

    fn tokenize(&self, vocab: &Vocab, text: &str, add_bos: bool, add_eos: bool, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        if add_bos {
            out.push(vocab.bos.ok_or(TokenizerError::MissingBos)?);
        }
        let fragments = special::partition(vocab, text, parse_special);
        match &vocab.kind {
            Kind::Spm => {
                // SentencePiece's dummy prefix goes before the text and after
                // every special token.
                let mut prev_special = true;
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(t) => {
                            let prefix = if vocab.add_space_prefix && prev_special { " " } else { "" };
                            let escaped = format!("{prefix}{t}").replace(' ', "\u{2581}");
                            spm::tokenize(vocab, &escaped, &mut out)?;
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Kind::Bpe(pre) => {
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(t) => {
                            for word in pre.split(t) {
                                bpe::tokenize_word(vocab, &word, pre.ignore_merges, &mut out);
                            }
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if add_eos {
            out.push(vocab.eos.ok_or(TokenizerError::MissingEos)?);
        }
        Ok(out)
    }

    /// The bytes token `id` stands for, as llama.cpp's `token_to_piece` with
    /// `special = true` renders it (control tokens as their text); `None` if
    /// `id` is out of range.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        match &self.backend {
            Backend::Gguf(vocab) => vocab.piece(id).map(<[u8]>::to_vec),
            Backend::Hf(t) => t.token_bytes(id),
        }
    }

    /// Concatenates the tokens' bytes and decodes them as lossy UTF-8;
    /// out-of-range ids contribute nothing.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().filter_map(|&id| self.token_bytes(id)).flatten().collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Gguf(vocab) => vocab.len(),
            Backend::Hf(t) => t.vocab_size(),
        }
    }

    pub fn bos(&self) -> Option<u32> {
        match &self.backend {
            Backend::Gguf(vocab) => vocab.bos,
            Backend::Hf(t) => t.bos,
        }
    }

    pub fn eos(&self) -> Option<u32> {
        match &self.backend {
            Backend::Gguf(vocab) => vocab.eos,
            Backend::Hf(t) => t.eos,
        }
    }

    /// Whether `id` ends generation (EOS, end-of-turn and similar), as
    /// llama.cpp's `llama_vocab_is_eog`; for a Transformers tokenizer, its EOS
    /// and the ids generation_config.json lists.
    pub fn is_eog(&self, id: u32) -> bool {
        match &self.backend {
            Backend::Gguf(vocab) => vocab.is_eog(id),
            Backend::Hf(t) => t.eog.contains(&id),
        }
    }

    /// Every id that ends generation (`is_eog`), in ascending order.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = match &self.backend {
            Backend::Gguf(vocab) => vocab.eog_ids().collect(),
            Backend::Hf(t) => t.eog.iter().copied().collect(),
        };
        ids.sort_unstable();
        ids
    }

    /// Whether `id` is a control token (BOS, end of turn, unknown, unused and the like) rather
    /// than text: a grammar never produces one as text.
    pub fn is_control(&self, id: u32) -> bool {
        match &self.backend {
            Backend::Gguf(vocab) => vocab.is_control(id),
            Backend::Hf(t) => t.special.contains(&id),
        }
    }

    /// Renders the model's chat template over `messages`, with `bos_token`
    /// and `eos_token` set to those tokens' texts.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizerError> {
        let template = self.chat_template.as_deref().ok_or(TokenizerError::NoChatTemplate)?;
        chat::render(template, messages, add_generation_prompt, &self.text_of(self.bos()), &self.text_of(self.eos()))
    }

    /// Renders the chat template over OpenAI-shaped messages (with `tool_calls` and `tool`
    /// turns) and the request's `tools`, as Transformers' `apply_chat_template(tools=...)`.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = self.chat_template.as_deref().ok_or(TokenizerError::NoChatTemplate)?;
        chat::render_with(template, messages, tools, add_generation_prompt, &self.text_of(self.bos()), &self.text_of(self.eos()))
    }

    /// A token's text, for the chat template's `bos_token`/`eos_token`.
    fn text_of(&self, id: Option<u32>) -> String {
        let Some(id) = id else { return String::new() };
        match &self.backend {
            Backend::Gguf(vocab) => vocab.text(id).unwrap_or("").to_owned(),
            Backend::Hf(t) => t.text(id).unwrap_or_default(),
        }
    }

    /// The chat template's text, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }
}

// The tokenizer is shared between request threads.
const _: fn() = || {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
};

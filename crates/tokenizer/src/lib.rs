//! Tokenization of GGUF models, reproducing llama.cpp's `llama_tokenize`
//! exactly, plus chat-template rendering.
//!
//! Supported vocabularies: byte-level BPE (`tokenizer.ggml.model = "gpt2"`)
//! with the common pre-tokenizers, and SentencePiece (`"llama"`).

mod bpe;
mod chat;
mod config;
mod error;
mod gguf;
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
    vocab: Vocab,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Builds the tokenizer from a model's `tokenizer.*` metadata.
    pub fn from_gguf(g: &dgr_gguf::Gguf) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_config(TokenizerConfig::from_gguf(g)?)
    }

    pub fn from_config(cfg: TokenizerConfig) -> Result<Tokenizer, TokenizerError> {
        Ok(Tokenizer { vocab: Vocab::new(&cfg)?, chat_template: cfg.chat_template })
    }

    /// Tokenizes `text`. With `parse_special`, control tokens written in the
    /// text (e.g. `<|im_start|>`) become their ids; user-defined tokens always do.
    pub fn encode(&self, text: &str, add_bos: bool, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.tokenize(text, add_bos, false, parse_special)
    }

    /// Tokenizes a completion prompt as llama.cpp does: special tokens parsed,
    /// BOS/EOS added as the model's `add_bos_token`/`add_eos_token` say.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.tokenize(text, self.vocab.add_bos, self.vocab.add_eos, true)
    }

    fn tokenize(&self, text: &str, add_bos: bool, add_eos: bool, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let vocab = &self.vocab;
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
        self.vocab.piece(id).map(<[u8]>::to_vec)
    }

    /// Concatenates the tokens' bytes and decodes them as lossy UTF-8;
    /// out-of-range ids contribute nothing.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().filter_map(|&id| self.vocab.piece(id)).flatten().copied().collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    pub fn bos(&self) -> Option<u32> {
        self.vocab.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.vocab.eos
    }

    /// Whether `id` ends generation (EOS, end-of-turn and similar), as
    /// llama.cpp's `llama_vocab_is_eog`.
    pub fn is_eog(&self, id: u32) -> bool {
        self.vocab.is_eog(id)
    }

    /// Renders the model's chat template over `messages`, with `bos_token`
    /// and `eos_token` set to those tokens' texts.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizerError> {
        let template = self.chat_template.as_deref().ok_or(TokenizerError::NoChatTemplate)?;
        let text = |id: Option<u32>| id.and_then(|id| self.vocab.text(id)).unwrap_or("");
        chat::render(template, messages, add_generation_prompt, text(self.vocab.bos), text(self.vocab.eos))
    }
}

// The tokenizer is shared between request threads.
const _: fn() = || {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
};

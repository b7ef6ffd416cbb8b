//! A Transformers checkpoint's tokenizer: `tokenizer.json` computed by Hugging Face's own
//! `tokenizers` crate, special tokens and the chat template from `tokenizer_config.json`, the
//! end-of-generation ids from `generation_config.json` where it lists them.

use crate::TokenizerError;
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// A JSON side file is a few MB at most; a vocabulary file can be tens.
const MAX_JSON: u64 = 256 << 20;

pub(crate) struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// Token strings in GPT-2's byte-to-character alphabet (a byte-level decoder).
    byte_level: bool,
    /// Added tokens (special or not) by id: rendered as their text.
    added: HashMap<u32, String>,
    /// The added tokens marked special (control tokens, not text).
    pub special: HashSet<u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eog: HashSet<u32>,
    pub chat_template: Option<String>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer").field("vocab", &self.inner.get_vocab_size(true)).field("eos", &self.eos).finish()
    }
}

/// The bytes of a JSON side file, refusing one past `MAX_JSON`; None if it does not exist.
fn read_bounded(path: &Path) -> Result<Option<Vec<u8>>, TokenizerError> {
    let bad = |reason: String| TokenizerError::HfFile { path: path.display().to_string(), reason };
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(bad(e.to_string())),
        Ok(m) if m.len() > MAX_JSON => Err(bad(format!("larger than {MAX_JSON} bytes"))),
        Ok(_) => std::fs::read(path).map(Some).map_err(|e| bad(e.to_string())),
    }
}

fn read_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    let Some(text) = read_bounded(path)? else { return Ok(None) };
    serde_json::from_slice(&text).map(Some).map_err(|e| TokenizerError::HfFile { path: path.display().to_string(), reason: e.to_string() })
}

/// A special token named in tokenizer_config.json: a string, or an object with `content`.
fn token_text(v: Option<&Value>) -> Option<&str> {
    match v? {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content")?.as_str(),
        _ => None,
    }
}

/// GPT-2's byte-level alphabet, reversed: the character each byte is written as, to the byte.
fn byte_of(c: char) -> Option<u8> {
    let c = c as u32;
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    if c < 256 && printable(c) {
        return Some(c as u8);
    }
    // The others take 256, 257, ... in byte order.
    let n = c.checked_sub(256)?;
    (0u32..256).filter(|&b| !printable(b)).nth(n as usize).map(|b| b as u8)
}

impl HfTokenizer {
    pub fn from_dir(dir: &Path) -> Result<HfTokenizer, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let bad = |reason: String| TokenizerError::HfFile { path: path.display().to_string(), reason };
        // Read once: for `tokenizers`, and for the decoder's kind, which it does not expose.
        let text = read_bounded(&path)?.ok_or_else(|| bad("not found".into()))?;
        let inner = tokenizers::Tokenizer::from_bytes(&text).map_err(|e| bad(e.to_string()))?;
        let json: Value = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
        let byte_level = {
            let d = &json["decoder"];
            d["type"] == "ByteLevel" || d["decoders"].as_array().is_some_and(|ds| ds.iter().any(|d| d["type"] == "ByteLevel"))
        };
        let decoder = inner.get_added_tokens_decoder();
        let special = decoder.iter().filter(|(_, t)| t.special).map(|(id, _)| *id).collect();
        let added = decoder.into_iter().map(|(id, t)| (id, t.content)).collect();
        let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let id = |name: &str| token_text(config.get(name)).and_then(|t| inner.token_to_id(t));
        let (bos, eos) = (id("bos_token"), id("eos_token"));
        let chat_template = match config.get("chat_template") {
            Some(Value::String(t)) => Some(t.clone()),
            // A list of named templates: the default one.
            Some(Value::Array(ts)) => ts.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str()).map(str::to_owned),
            _ => None,
        };
        let mut eog: HashSet<u32> = eos.into_iter().collect();
        if let Some(g) = read_json(&dir.join("generation_config.json"))? {
            match &g["eos_token_id"] {
                Value::Number(n) => eog.extend(n.as_u64().and_then(|n| u32::try_from(n).ok())),
                Value::Array(ns) => eog.extend(ns.iter().filter_map(|n| n.as_u64().and_then(|n| u32::try_from(n).ok()))),
                _ => {}
            }
        }
        Ok(HfTokenizer { inner, byte_level, added, special, bos, eos, eog, chat_template })
    }

    /// Tokenizes as Transformers' `tokenizer(text)` does: with the post-processor's special
    /// tokens (BOS where the model adds one) when `add_special`.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self.inner.encode(text, add_special).map_err(|e| TokenizerError::HfEncode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The bytes of token `id`: an added token's text, a byte-level token's bytes, a
    /// SentencePiece piece with `▁` as a space and `<0xNN>` as that byte.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        if let Some(text) = self.added.get(&id) {
            return Some(text.as_bytes().to_vec());
        }
        let piece = self.inner.id_to_token(id)?;
        if self.byte_level {
            return piece.chars().map(byte_of).collect();
        }
        let hex = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')).filter(|h| h.len() == 2);
        if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
            return Some(vec![b]);
        }
        Some(piece.replace('\u{2581}', " ").into_bytes())
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The text of token `id`, for the chat template's `bos_token`/`eos_token`.
    pub fn text(&self, id: u32) -> Option<String> {
        self.added.get(&id).cloned().or_else(|| self.inner.id_to_token(id))
    }
}

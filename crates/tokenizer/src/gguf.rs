//! Reading [`TokenizerConfig`] from GGUF metadata.

use dgr_gguf::{Gguf, Value};

use crate::config::{SpecialIds, TokenizerConfig};
use crate::error::TokenizerError;

impl TokenizerConfig {
    pub fn from_gguf(g: &Gguf) -> Result<TokenizerConfig, TokenizerError> {
        let get = |key: &'static str| g.get(key);
        let wrong = |key, expected| TokenizerError::WrongType { key, expected };
        let string = |key: &'static str| -> Result<Option<String>, TokenizerError> {
            get(key).map(|v| v.as_str().map(str::to_owned).ok_or(wrong(key, "string"))).transpose()
        };
        let boolean = |key: &'static str| -> Result<Option<bool>, TokenizerError> {
            get(key).map(|v| v.as_bool().ok_or(wrong(key, "bool"))).transpose()
        };
        let id = |key: &'static str| -> Result<Option<u32>, TokenizerError> {
            let Some(v) = get(key) else { return Ok(None) };
            let id = v.as_u64().ok_or(wrong(key, "unsigned integer"))?;
            // an id beyond u32 is out of range for any vocabulary
            u32::try_from(id).map(Some).map_err(|_| TokenizerError::TokenIdOutOfRange { key, id, n_tokens: 0 })
        };
        fn array<'a, T>(
            v: Option<&'a Value>,
            key: &'static str,
            expected: &'static str,
            item: impl Fn(&'a Value) -> Option<T>,
        ) -> Result<Option<Vec<T>>, TokenizerError> {
            let wrong = || TokenizerError::WrongType { key, expected };
            let Some(v) = v else { return Ok(None) };
            let items = v.as_array().ok_or_else(wrong)?;
            items.iter().map(|x| item(x).ok_or_else(wrong)).collect::<Result<_, _>>().map(Some)
        }

        let model = string("tokenizer.ggml.model")?.ok_or(TokenizerError::MissingKey("tokenizer.ggml.model"))?;
        let tokens = array(get("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens", "array of strings", |v| v.as_str().map(str::to_owned))?
            .ok_or(TokenizerError::MissingKey("tokenizer.ggml.tokens"))?;
        let n_tokens = tokens.len();
        let id = |key: &'static str| {
            id(key).map_err(|e| match e {
                TokenizerError::TokenIdOutOfRange { key, id, .. } => TokenizerError::TokenIdOutOfRange { key, id, n_tokens },
                e => e,
            })
        };

        Ok(TokenizerConfig {
            model,
            pre: string("tokenizer.ggml.pre")?,
            tokens,
            scores: array(get("tokenizer.ggml.scores"), "tokenizer.ggml.scores", "array of numbers", Value::as_f32)?,
            token_types: array(get("tokenizer.ggml.token_type"), "tokenizer.ggml.token_type", "array of i32", |v| {
                v.as_i64().and_then(|t| i32::try_from(t).ok())
            })?,
            merges: array(get("tokenizer.ggml.merges"), "tokenizer.ggml.merges", "array of strings", |v| v.as_str().map(str::to_owned))?,
            special: SpecialIds {
                bos: id("tokenizer.ggml.bos_token_id")?,
                eos: id("tokenizer.ggml.eos_token_id")?,
                eot: id("tokenizer.ggml.eot_token_id")?,
                eom: id("tokenizer.ggml.eom_token_id")?,
                unk: id("tokenizer.ggml.unknown_token_id")?,
                // sic: llama.cpp's key name
                sep: id("tokenizer.ggml.seperator_token_id")?,
                pad: id("tokenizer.ggml.padding_token_id")?,
                // the deprecated keys win, as llama.cpp reads them last
                fim_pre: id("tokenizer.ggml.prefix_token_id")?.or(id("tokenizer.ggml.fim_pre_token_id")?),
                fim_suf: id("tokenizer.ggml.suffix_token_id")?.or(id("tokenizer.ggml.fim_suf_token_id")?),
                fim_mid: id("tokenizer.ggml.middle_token_id")?.or(id("tokenizer.ggml.fim_mid_token_id")?),
                fim_pad: id("tokenizer.ggml.fim_pad_token_id")?,
                fim_rep: id("tokenizer.ggml.fim_rep_token_id")?,
                fim_sep: id("tokenizer.ggml.fim_sep_token_id")?,
            },
            add_bos: boolean("tokenizer.ggml.add_bos_token")?,
            add_eos: boolean("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: boolean("tokenizer.ggml.add_space_prefix")?,
            chat_template: string("tokenizer.chat_template")?,
        })
    }
}

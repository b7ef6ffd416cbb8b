//! `/v1/embeddings`: each input's pooled final hidden state, computed on the swarm as an
//! embedding session (its prompt prefilled through a route like any other, batched with other
//! sessions by the workers' schedulers) and returned in OpenAI's shape, as floats or as base64 of
//! little-endian f32. Each input is a request of its own to the tracker (routed, ticketed and
//! billed its prompt tokens to the key), and the inputs run concurrently under the admission.

use crate::api_error::ApiError;
use crate::service::{Gateway, ServedModel};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// Most inputs in one request (OpenAI's own limit).
pub const MAX_INPUTS: usize = 2048;
/// Most tokens over all of a request's inputs (OpenAI's own limit).
pub const MAX_TOTAL_TOKENS: usize = 300_000;
/// Inputs of one request in flight at once; the rest wait their turn, so a large request takes
/// at most this many of the admission's places.
const IN_FLIGHT: usize = 32;

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

impl Input {
    /// `input` in one of the shapes OpenAI takes, or a 400 naming them.
    fn read(v: Value) -> Result<Input, ApiError> {
        serde_json::from_value(v)
            .map_err(|_| bad("input", "input must be a string, a list of strings, a list of token ids or a list of lists of token ids"))
    }
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct Body {
    pub model: String,
    pub input: Value,
    pub encoding_format: Option<String>,
    pub dimensions: Option<u64>,
    /// The caller's end-user id: accepted as metadata, not used.
    #[serde(default, rename = "user")]
    _user: Option<serde::de::IgnoredAny>,
}

/// A checked request: the model, each input's tokens, and how to write the vectors.
pub struct Embeds {
    pub model: Arc<ServedModel>,
    pub inputs: Vec<Vec<u32>>,
    pub base64: bool,
}

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg).param(param)
}

/// Everything that can be checked before any worker is asked: the body, the model, the inputs
/// (each non-empty, within the model's context and the gateway's prompt limit, all within
/// `MAX_TOTAL_TOKENS`), the encoding and the dimensions.
pub fn prepare(gw: &Gateway, bytes: &[u8]) -> Result<Embeds, ApiError> {
    let body: Body = serde_json::from_slice(bytes).map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))?;
    let model = gw.model(&body.model)?;
    let base64 = match body.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => return Err(bad("encoding_format", format!("encoding_format {other:?} is not float or base64"))),
    };
    if let Some(d) = body.dimensions.filter(|&d| d != model.hidden as u64) {
        return Err(bad("dimensions", format!("dimensions {d}: this model's embeddings have {} (no truncation)", model.hidden)));
    }
    let tok = &model.tokenizer;
    // An empty string is refused as OpenAI refuses it, not embedded as its BOS token alone.
    let encode = |t: &str| match t {
        "" => Err(bad("input", "an input is an empty string")),
        t => tok.encode_prompt(t).map_err(|e| bad("input", e.to_string())),
    };
    let input = Input::read(body.input)?;
    let count = match &input {
        Input::Text(_) | Input::Tokens(_) => 1,
        Input::Texts(v) => v.len(),
        Input::TokenLists(v) => v.len(),
    };
    if count == 0 {
        return Err(bad("input", "input is empty"));
    }
    if count > MAX_INPUTS {
        return Err(bad("input", format!("{count} inputs; at most {MAX_INPUTS} per request")));
    }
    let inputs: Vec<Vec<u32>> = match input {
        Input::Text(t) => vec![encode(&t)?],
        Input::Texts(v) => v.iter().map(|t| encode(t)).collect::<Result<_, _>>()?,
        Input::Tokens(ids) => vec![ids],
        Input::TokenLists(v) => v,
    };
    let limit = model.context.min(gw.cfg.max_prompt_tokens);
    for (i, ids) in inputs.iter().enumerate() {
        if ids.is_empty() {
            return Err(bad("input", format!("input {i} is empty")));
        }
        if ids.len() > limit {
            return Err(bad("input", format!("input {i} has {} tokens; at most {limit} here", ids.len())).code("context_length_exceeded"));
        }
        if let Some(t) = ids.iter().find(|&&t| t as usize >= tok.vocab_size()) {
            return Err(bad("input", format!("input {i}: token id {t} is outside the vocabulary")));
        }
    }
    let total: usize = inputs.iter().map(Vec::len).sum();
    if total > MAX_TOTAL_TOKENS {
        return Err(bad("input", format!("{total} tokens in all; at most {MAX_TOTAL_TOKENS} per request")));
    }
    Ok(Embeds { model, inputs, base64 })
}

/// Embeds every input (at most `IN_FLIGHT` at once) and answers in OpenAI's shape; the first
/// input that failed (in input order) is the request's error.
pub async fn run(gw: &Arc<Gateway>, e: Embeds, api_key: &str) -> Result<Value, ApiError> {
    use futures::StreamExt;
    let tokens: usize = e.inputs.iter().map(Vec::len).sum();
    let n = e.inputs.len();
    let results: Vec<Result<(Vec<f32>, String), ApiError>> =
        futures::stream::iter(e.inputs).map(|p| gw.embed(&e.model, p, api_key)).buffered(IN_FLIGHT).collect().await;
    let key = results.iter().find_map(|r| r.as_ref().ok().map(|(_, k)| k.clone())).unwrap_or_else(|| "anonymous".into());
    let mut data = Vec::with_capacity(n);
    let mut failed = None;
    for (index, r) in results.into_iter().enumerate() {
        match r {
            Ok((v, _)) => {
                let embedding = if e.base64 { json!(base64(&v)) } else { json!(v) };
                data.push(json!({ "object": "embedding", "index": index, "embedding": embedding }));
            }
            Err(err) => {
                failed.get_or_insert(err);
            }
        }
    }
    gw.metrics.embedded(&e.model.name, n, tokens, failed.is_none());
    gw.metrics.finished(&e.model.name, &key, tokens, 0, failed.as_ref().map(|e| e.metric_kind()));
    if let Some(err) = failed {
        return Err(err);
    }
    Ok(json!({
        "object": "list",
        "data": data,
        "model": e.model.name,
        "usage": { "prompt_tokens": tokens, "total_tokens": tokens },
    }))
}

/// Standard base64 (with padding) of the values' little-endian f32 bytes, as OpenAI sends them.
fn base64(values: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_the_standard_alphabet_with_padding() {
        // 1.0f32 is 00 00 80 3f; 2.5 is 00 00 20 40.
        assert_eq!(base64(&[1.0]), "AACAPw==");
        assert_eq!(base64(&[1.0, 2.5]), "AACAPwAAIEA=");
        assert_eq!(base64(&[]), "");
    }

    #[test]
    fn inputs_read_as_each_shape_openai_sends() {
        let input = |j: &str| Input::read(serde_json::from_str::<Body>(&format!(r#"{{"model":"m","input":{j}}}"#)).unwrap().input);
        assert!(matches!(input(r#""hi""#), Ok(Input::Text(_))));
        assert!(matches!(input(r#"["a","b"]"#), Ok(Input::Texts(v)) if v.len() == 2));
        assert!(matches!(input("[1,2]"), Ok(Input::Tokens(v)) if v == [1, 2]));
        assert!(matches!(input("[[1],[2,3]]"), Ok(Input::TokenLists(v)) if v.len() == 2));
        for bad in [r#"[1,"a"]"#, "[-1]", "{}", "null", "[[1],\"a\"]"] {
            assert_eq!(input(bad).err().and_then(|e| e.param).as_deref(), Some("input"), "{bad}");
        }
        assert!(serde_json::from_str::<Body>(r#"{"model":"m","input":"x","extra":1}"#).is_err());
    }
}

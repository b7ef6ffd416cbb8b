//! The OpenAI request bodies dgr accepts, and what each asks of a generation. Unknown fields and
//! unsupported values are refused with a 400 that names them, never ignored.

use crate::api_error::ApiError;
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize, Debug)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: String,
}

#[derive(Deserialize, Debug)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    /// A participant's name: accepted, and not part of what the model sees.
    #[serde(default, rename = "name")]
    _name: Option<serde::de::IgnoredAny>,
    /// An assistant turn's calls (`tools`).
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` turn's answer to this call.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default, rename = "include_usage")]
    _include_usage: Option<bool>,
}

/// The body of /v1/completions and /v1/chat/completions.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct Body {
    pub model: String,
    pub prompt: Option<Prompt>,
    pub messages: Option<Vec<Message>>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    /// An integer (completions: how many top alternatives) or a bool (chat).
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub ignore_eos: Option<bool>,
    pub n: Option<u32>,
    /// The caller's end-user id: accepted as metadata, not used.
    #[serde(rename = "user")]
    _user: Option<serde::de::IgnoredAny>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub echo: Option<bool>,
    pub best_of: Option<u32>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    pub suffix: Option<String>,
    /// `text`, `json_object` or `json_schema` (see `structured`).
    pub response_format: Option<Value>,
    /// A Lark grammar the completion must follow (llguidance's dialect).
    pub grammar: Option<String>,
    /// Functions the model may call (chat), and whether and which it must (see `tools`).
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// Accepted; a constrained call (`required`, a named function) is one call.
    #[serde(rename = "parallel_tool_calls")]
    _parallel_tool_calls: Option<bool>,
}

/// Most alternatives per token a request may ask for (OpenAI's own limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Most stop strings (OpenAI's own limit).
const MAX_STOPS: usize = 4;

/// What a request asks of the generation, checked.
#[derive(Debug, Clone)]
pub struct Params {
    pub max_tokens: Option<u64>,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub seed: Option<u64>,
    pub stops: Vec<String>,
    /// None: no logprobs; Some(k): the chosen token's and k alternatives.
    pub logprobs: Option<u32>,
    /// Streams always end with a usage chunk, asked for (stream_options.include_usage) or not.
    pub stream: bool,
    pub ignore_eos: bool,
    /// The request's tools, read against the model's template (chat only).
    pub tools: Option<crate::tools::Tools>,
}

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg).param(param)
}

impl Body {
    pub fn parse(bytes: &[u8]) -> Result<Body, ApiError> {
        serde_json::from_slice(bytes).map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
    }

    /// Checks everything but the prompt; `chat` picks how `logprobs` is read.
    pub fn params(&self, chat: bool) -> Result<Params, ApiError> {
        if self.n.unwrap_or(1) != 1 {
            return Err(bad("n", "n > 1 is not supported: send one request per completion"));
        }
        if self.best_of.unwrap_or(1) != 1 {
            return Err(bad("best_of", "best_of is not supported"));
        }
        if self.echo == Some(true) {
            return Err(bad("echo", "echo is not supported"));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(bad("suffix", "suffix is not supported"));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if v.is_some_and(|v| v != 0.0) {
                return Err(bad(name, format!("{name} is not supported (only 0)")));
            }
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(bad("logit_bias", "logit_bias is not supported"));
        }
        let max_tokens = match (self.max_tokens, self.max_completion_tokens) {
            (Some(a), Some(b)) if a != b => return Err(bad("max_tokens", "max_tokens and max_completion_tokens disagree")),
            (a, b) => a.or(b),
        };
        if max_tokens == Some(0) {
            return Err(bad("max_tokens", "max_tokens must be at least 1"));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(bad("temperature", "temperature must be in [0, 2]"));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(bad("top_p", "top_p must be in (0, 1]"));
        }
        let top_k = self.top_k.unwrap_or(0);
        if !(0..=100_000).contains(&top_k) {
            return Err(bad("top_k", "top_k must be in [0, 100000] (0: no limit)"));
        }
        let stops = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stops.len() > MAX_STOPS || stops.iter().any(|s| s.is_empty() || s.len() > 256) {
            return Err(bad("stop", format!("at most {MAX_STOPS} stop strings of 1 to 256 bytes")));
        }
        let logprobs = match (&self.logprobs, chat) {
            (None | Some(Value::Null), _) => None,
            (Some(Value::Bool(false)), true) => None,
            (Some(Value::Bool(true)), true) => Some(self.top_logprobs.unwrap_or(0)),
            (Some(Value::Number(n)), false) => {
                Some(n.as_u64().filter(|k| *k <= 5).ok_or_else(|| bad("logprobs", "logprobs must be 0..=5"))? as u32)
            }
            _ => return Err(bad("logprobs", if chat { "logprobs must be a boolean" } else { "logprobs must be an integer" })),
        };
        if self.top_logprobs.is_some() && (!chat || logprobs.is_none()) {
            return Err(bad("top_logprobs", "top_logprobs needs logprobs: true (chat completions)"));
        }
        if logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            return Err(bad("top_logprobs", format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}")));
        }
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(bad("stream_options", "stream_options needs stream: true"));
        }
        Ok(Params {
            max_tokens,
            temperature,
            top_p,
            top_k: top_k as u32,
            seed: self.seed.map(|s| s as u64),
            stops,
            logprobs,
            stream,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            tools: None,
        })
    }
}

impl Message {
    pub fn text(&self) -> Result<String, ApiError> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(t)) => Ok(t.clone()),
            Some(Content::Parts(parts)) => {
                if let Some(p) = parts.iter().find(|p| p.kind != "text") {
                    return Err(bad("messages", format!("content parts of type {:?} are not supported", p.kind)));
                }
                Ok(parts.iter().map(|p| p.text.as_str()).collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Params, ApiError> {
        Body::parse(json.as_bytes())?.params(json.contains("messages"))
    }

    #[test]
    fn defaults_and_accepted_values() {
        let p = parse(r#"{"model":"m","prompt":"hi"}"#).unwrap();
        assert_eq!((p.temperature, p.top_p, p.top_k, p.stream, p.logprobs), (1.0, 1.0, 0, false, None));
        let p = parse(r#"{"model":"m","prompt":"hi","max_tokens":5,"stop":["a","b"],"logprobs":2,"seed":-1,"top_k":40,"ignore_eos":true}"#)
            .unwrap();
        assert_eq!((p.max_tokens, p.stops.len(), p.logprobs, p.top_k, p.ignore_eos), (Some(5), 2, Some(2), 40, true));
        let p =
            parse(r#"{"model":"m","messages":[],"logprobs":true,"top_logprobs":3,"stream":true,"stream_options":{"include_usage":true}}"#)
                .unwrap();
        assert_eq!((p.logprobs, p.stream), (Some(3), true));
    }

    #[test]
    fn unsupported_and_unknown_are_refused_by_name() {
        for (json, param) in [
            (r#"{"model":"m","prompt":"x","n":2}"#, "n"),
            (r#"{"model":"m","prompt":"x","echo":true}"#, "echo"),
            (r#"{"model":"m","prompt":"x","presence_penalty":0.5}"#, "presence_penalty"),
            (r#"{"model":"m","prompt":"x","max_tokens":0}"#, "max_tokens"),
            (r#"{"model":"m","prompt":"x","temperature":3}"#, "temperature"),
            (r#"{"model":"m","prompt":"x","stop":["a","b","c","d","e"]}"#, "stop"),
            (r#"{"model":"m","prompt":"x","logprobs":true}"#, "logprobs"),
            (r#"{"model":"m","messages":[],"logprobs":true,"top_logprobs":21}"#, "top_logprobs"),
        ] {
            let e = parse(json).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{json}: {e:?}");
        }
        let e = parse(r#"{"model":"m","prompt":"x","functions":[]}"#).unwrap_err();
        assert!(e.message.contains("functions"), "{e:?}");
        assert!(parse(r#"{"prompt":"x"}"#).is_err());
        assert!(parse("not json").is_err());
    }
}

//! Structured output: `response_format` (`json_object`, `json_schema` with `strict`) and a Lark
//! `grammar` compiled by llguidance against the model's own vocabulary. The compiled grammar is
//! the session's [`Constraint`]: the driver asks it for each step's token mask, which the last
//! stage's sampler applies, and tells it each token chosen.

use crate::api_error::ApiError;
use dgr_driver::{Constraint, SharedConstraint};
use dgr_tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};

/// A model's grammar compiler: its vocabulary as llguidance sees it (control tokens marked, so
/// no grammar writes one as text), built once when the gateway opens the model.
pub struct Grammars {
    factory: Result<ParserFactory, String>,
    vocab: usize,
}

impl Grammars {
    pub fn new(tok: &Tokenizer) -> Grammars {
        let vocab = tok.vocab_size();
        Grammars { factory: factory(tok), vocab }
    }

    /// The request's grammar compiled into a constraint; a grammar or schema that does not
    /// compile is the request's fault, named in the 400.
    pub fn compile(&self, grammar: TopLevelGrammar, param: &str) -> Result<SharedConstraint, ApiError> {
        let factory =
            self.factory.as_ref().map_err(|e| ApiError::bad_request(format!("this model cannot be constrained: {e}")).param(param))?;
        let parser = llguidance::panic_utils::catch_unwind(std::panic::AssertUnwindSafe(|| factory.create_parser(grammar)));
        let parser = parser.map_err(|e| ApiError::bad_request(format!("invalid {param}: {e}")).param(param))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ApiError::bad_request(format!("invalid {param}: {e}")).param(param));
        }
        Ok(Arc::new(Mutex::new(Grammar { matcher, vocab: self.vocab })))
    }
}

fn factory(tok: &Tokenizer) -> Result<ParserFactory, String> {
    let eos = tok.eos().ok_or("its vocabulary has no end-of-sequence token")?;
    let words: Vec<Vec<u8>> = (0..tok.vocab_size() as u32)
        .map(|id| {
            let bytes = tok.token_bytes(id).unwrap_or_default();
            if tok.is_control(id) {
                [&[TokTrie::SPECIAL_TOKEN_MARKER][..], &bytes].concat()
            } else {
                bytes
            }
        })
        .collect();
    let info = TokRxInfo::new(words.len() as u32, eos);
    let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
    let mut f = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    f.quiet();
    Ok(f)
}

/// One session's grammar state.
struct Grammar {
    matcher: Matcher,
    vocab: usize,
}

impl Constraint for Grammar {
    fn allowed(&mut self) -> Result<Option<Vec<u8>>, String> {
        if self.matcher.is_stopped() {
            return match self.matcher.get_error() {
                Some(e) => Err(e),
                None => Ok(None),
            };
        }
        let mask = self.matcher.compute_mask().map_err(|e| e.to_string())?;
        let mut bytes: Vec<u8> = mask.as_slice().iter().flat_map(|w| w.to_le_bytes()).collect();
        bytes.truncate(self.vocab.div_ceil(8));
        Ok(Some(bytes))
    }

    fn advance(&mut self, token: u32) -> Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }
}

/// The grammar a request asks for: `response_format` (either endpoint) or `grammar` (Lark), at
/// most one of them.
pub fn requested(response_format: Option<&Value>, grammar: Option<&str>) -> Result<Option<(TopLevelGrammar, &'static str)>, ApiError> {
    let bad = |msg: String| ApiError::bad_request(msg).param("response_format");
    let from_format = match response_format {
        None | Some(Value::Null) => None,
        Some(f) => match f.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(json_schema(json!({ "type": "object" }), false)?),
            Some("json_schema") => {
                let spec = f.get("json_schema").ok_or_else(|| bad("response_format json_schema needs a json_schema object".into()))?;
                let name = spec.get("name").and_then(Value::as_str).unwrap_or("");
                if name.is_empty() || name.len() > 64 || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
                    return Err(bad("json_schema.name must be 1 to 64 letters, digits, '_' or '-'".into()));
                }
                let strict = match spec.get("strict") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(_) => return Err(bad("json_schema.strict must be a boolean".into())),
                };
                let schema = spec.get("schema").cloned().unwrap_or_else(|| json!({}));
                Some(json_schema(schema, strict)?)
            }
            _ => return Err(bad("response_format.type must be text, json_object or json_schema".into())),
        },
    };
    match (from_format, grammar) {
        (Some(_), Some(_)) => Err(ApiError::bad_request("give response_format or grammar, not both").param("grammar")),
        (Some(g), None) => Ok(Some((g, "response_format"))),
        (None, Some(lark)) => Ok(Some((TopLevelGrammar::from_lark(lark.to_string()), "grammar"))),
        (None, None) => Ok(None),
    }
}

/// A JSON schema as a grammar of compact JSON (one space after `,` and `:`, no other
/// whitespace, so a model cannot pad forever). `strict` refuses keywords the compiler does not
/// enforce; otherwise they are ignored, as a loose validator would.
pub fn json_schema(schema: Value, strict: bool) -> Result<TopLevelGrammar, ApiError> {
    if !schema.is_object() {
        return Err(ApiError::bad_request("the JSON schema must be an object").param("response_format"));
    }
    Ok(TopLevelGrammar::from_json_schema(json_schema_value(schema, strict)))
}

/// An object schema with the compiler's options for compact JSON added (unless it has its own).
pub fn json_schema_value(mut schema: Value, strict: bool) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance")
            .or_insert_with(|| json!({ "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": !strict }));
    }
    schema
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_grammars_are_read_and_refused_by_name() {
        assert!(requested(None, None).unwrap().is_none());
        assert!(requested(Some(&json!({"type": "text"})), None).unwrap().is_none());
        let (_, param) = requested(Some(&json!({"type": "json_object"})), None).unwrap().unwrap();
        assert_eq!(param, "response_format");
        let ok = json!({"type": "json_schema", "json_schema": {"name": "p", "strict": true, "schema": {"type": "object"}}});
        assert!(requested(Some(&ok), None).unwrap().is_some());
        assert_eq!(requested(None, Some("start: \"a\"")).unwrap().unwrap().1, "grammar");
        for (format, grammar, param) in [
            (json!({"type": "xml"}), None, "response_format"),
            (json!({"type": "json_schema"}), None, "response_format"),
            (json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}), None, "response_format"),
            (json!({"type": "json_schema", "json_schema": {"name": "a", "strict": 1}}), None, "response_format"),
            (json!({"type": "json_schema", "json_schema": {"name": "a", "schema": true}}), None, "response_format"),
            (json!({"type": "json_object"}), Some("start: \"a\""), "grammar"),
        ] {
            let e = requested(Some(&format), grammar).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{format}: {e:?}");
        }
    }
}

//! Tool calls on chat completions: the request's `tools` and `tool_choice`, the conversation
//! (assistant `tool_calls`, `tool` turns) rendered through the model's own chat template, and
//! the model's answer parsed back into `tool_calls`. Two formats, picked by the template: Qwen's
//! (Hermes) `<tool_call>{"name": …, "arguments": …}</tool_call>`, and Llama 3's bare JSON
//! `{"name": …, "parameters": …}`, which is also what a template that knows no tools is told to
//! answer with (in a system turn listing the functions). `required` and a named function put the
//! call under a grammar (see `structured`), so its arguments always match the function's schema.

use crate::api_error::ApiError;
use crate::openai::Message;
use crate::structured;
use llguidance::api::TopLevelGrammar;
use serde_json::{json, Map, Value};

/// How the model writes a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Qwen2/3 (Hermes): `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`.
    Hermes,
    /// Llama 3: `{"name": …, "parameters": {…}}`.
    LlamaJson,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    Auto,
    None,
    Required,
    Named(String),
}

#[derive(Clone, Debug)]
pub struct Function {
    pub name: String,
    pub parameters: Value,
}

/// A request's tools, checked.
#[derive(Clone, Debug)]
pub struct Tools {
    pub functions: Vec<Function>,
    pub choice: Choice,
    pub format: Format,
    /// The template has a `tools` variable of its own; otherwise a system turn lists them.
    pub native: bool,
    /// The `tools` array as the client sent it, for the template.
    raw: Value,
}

/// One parsed call.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub name: String,
    pub arguments: Value,
}

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg).param(param)
}

/// OpenAI's rule for function names, which also keeps them safe inside a grammar's strings.
fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= 64 && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Reads `tools` and `tool_choice` against the model's chat template.
pub fn requested(tools: Option<&Vec<Value>>, choice: Option<&Value>, template: &str) -> Result<Option<Tools>, ApiError> {
    let Some(list) = tools.filter(|t| !t.is_empty()) else {
        return match choice {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s == "none" || s == "auto" => Ok(None),
            Some(_) => Err(bad("tool_choice", "tool_choice needs tools")),
        };
    };
    let mut functions = Vec::with_capacity(list.len());
    for t in list {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad("tools", "every tool must be of type \"function\""));
        }
        let f = t.get("function").ok_or_else(|| bad("tools", "a tool needs a function object"))?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or("");
        if !valid_name(name) {
            return Err(bad("tools", format!("function name {name:?} must be 1 to 64 letters, digits, '_' or '-'")));
        }
        if functions.iter().any(|g: &Function| g.name == name) {
            return Err(bad("tools", format!("function {name:?} is given twice")));
        }
        let parameters = f.get("parameters").cloned().unwrap_or_else(|| json!({ "type": "object", "properties": {} }));
        if !parameters.is_object() {
            return Err(bad("tools", format!("the parameters of {name:?} must be a JSON schema object")));
        }
        functions.push(Function { name: name.to_string(), parameters });
    }
    let choice = match choice {
        None | Some(Value::Null) => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Choice::Auto,
            "none" => Choice::None,
            "required" => Choice::Required,
            other => return Err(bad("tool_choice", format!("tool_choice {other:?} is not auto, none, required or a function"))),
        },
        Some(v) => {
            let name = v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            match (v.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) if functions.iter().any(|f| f.name == n) => Choice::Named(n.to_string()),
                (Some("function"), Some(n)) => return Err(bad("tool_choice", format!("tool_choice names {n:?}, which is not in tools"))),
                _ => {
                    return Err(bad("tool_choice", "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": …}}"))
                }
            }
        }
    };
    let format = if template.contains("<tool_call>") { Format::Hermes } else { Format::LlamaJson };
    Ok(Some(Tools { functions, choice, format, native: template.contains("tools"), raw: Value::Array(list.clone()) }))
}

impl Tools {
    /// Whether the answer is read for calls.
    pub fn parses(&self) -> bool {
        self.choice != Choice::None
    }

    /// The `tools` variable for a template that has one.
    pub fn template_tools(&self) -> Option<&Value> {
        self.native.then_some(&self.raw)
    }

    /// The system text that tells a template without tools what it may call.
    fn instructions(&self) -> String {
        let mut s = String::from(
            "You have access to the following functions. To call a function, respond with only a JSON object of the form \
             {\"name\": function name, \"parameters\": dictionary of argument names and their values}.\n",
        );
        for t in self.raw.as_array().into_iter().flatten() {
            s.push('\n');
            s.push_str(&t.get("function").unwrap_or(t).to_string());
        }
        s
    }

    /// The grammar a call must follow under `required` or a named function; None otherwise.
    pub fn grammar(&self) -> Result<Option<TopLevelGrammar>, ApiError> {
        let allowed: Vec<&Function> = match &self.choice {
            Choice::Auto | Choice::None => return Ok(None),
            Choice::Required => self.functions.iter().collect(),
            Choice::Named(n) => self.functions.iter().filter(|f| &f.name == n).collect(),
        };
        let (open, args_key, close) = match self.format {
            Format::Hermes => ("\"<tool_call>\\n\" ", "arguments", " \"\\n</tool_call>\""),
            Format::LlamaJson => ("", "parameters", ""),
        };
        let mut lark = format!("start: {open}call{close}\ncall: ");
        lark.push_str(&(0..allowed.len()).map(|i| format!("call_{i}")).collect::<Vec<_>>().join(" | "));
        lark.push('\n');
        for (i, f) in allowed.iter().enumerate() {
            let schema = structured::json_schema_value(f.parameters.clone(), false);
            // Name first, as the models write it; the arguments under the function's schema.
            lark.push_str(&format!("call_{i}: \"{{\\\"name\\\": \\\"{}\\\", \\\"{args_key}\\\": \" args_{i} \"}}\"\n", f.name));
            lark.push_str(&format!("args_{i}: %json {schema}\n"));
        }
        Ok(Some(TopLevelGrammar::from_lark(lark)))
    }

    /// The calls in a finished answer, and the text beside them; no calls: all of it is text.
    pub fn parse(&self, text: &str) -> (Option<String>, Vec<Call>) {
        let known = |c: &Call| self.functions.iter().any(|f| f.name == c.name);
        let calls: Vec<Call> = match self.format {
            Format::Hermes => {
                let mut calls = Vec::new();
                let mut rest = text;
                let mut before = None;
                while let Some(at) = rest.find("<tool_call>") {
                    before.get_or_insert_with(|| text[..text.len() - rest.len() + at].trim().to_string());
                    let body = &rest[at + "<tool_call>".len()..];
                    let (inner, next) = match body.find("</tool_call>") {
                        Some(end) => (&body[..end], &body[end + "</tool_call>".len()..]),
                        None => (body, ""),
                    };
                    calls.extend(call_of(inner, "arguments"));
                    rest = next;
                }
                if calls.is_empty() || !calls.iter().all(known) {
                    return (Some(text.to_string()), Vec::new());
                }
                return (before.filter(|b| !b.is_empty()), calls);
            }
            Format::LlamaJson => {
                let body = text.trim().trim_start_matches("<|python_tag|>").trim();
                call_of(body, "parameters").into_iter().collect()
            }
        };
        if calls.is_empty() || !calls.iter().all(known) {
            (Some(text.to_string()), Vec::new())
        } else {
            (None, calls)
        }
    }

    /// The conversation as the template takes it: arguments as objects, and for a template
    /// that knows no tools, the functions in a system turn and earlier calls as their JSON.
    pub fn messages(&self, messages: Vec<Value>) -> Vec<Value> {
        let mut out = messages;
        if self.native {
            return out;
        }
        for m in &mut out {
            if let Some(calls) = m.get("tool_calls").and_then(Value::as_array).cloned() {
                let text: Vec<String> = calls
                    .iter()
                    .map(|c| json!({ "name": c["function"]["name"], "parameters": c["function"]["arguments"] }).to_string())
                    .collect();
                m["content"] = Value::String(text.join("\n"));
                if let Some(o) = m.as_object_mut() {
                    o.remove("tool_calls");
                }
            }
        }
        if !self.parses() {
            return out;
        }
        match out.first_mut() {
            Some(first) if first["role"] == "system" => {
                let content = first["content"].as_str().unwrap_or("").to_string();
                first["content"] = Value::String(format!("{content}\n\n{}", self.instructions()));
            }
            _ => out.insert(0, json!({ "role": "system", "content": self.instructions() })),
        }
        out
    }
}

/// The conversation in OpenAI's shape for a template: each turn's role and text, an assistant's
/// `tool_calls` with their arguments parsed into objects (as Transformers' templates take them),
/// a tool turn's `tool_call_id`.
pub fn turns(messages: &[Message]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        let role = match m.role.as_str() {
            "developer" => "system",
            r @ ("system" | "user" | "assistant" | "tool") => r,
            r => return Err(bad("messages", format!("message role {r:?} is not supported"))),
        };
        let mut turn = json!({ "role": role, "content": m.text()? });
        if let Some(calls) = &m.tool_calls {
            let mut parsed = Vec::with_capacity(calls.len());
            for c in calls {
                let f = c.get("function").ok_or_else(|| bad("messages", "a tool call needs a function"))?;
                let name = f.get("name").and_then(Value::as_str).ok_or_else(|| bad("messages", "a tool call needs a function name"))?;
                let arguments = match f.get("arguments") {
                    Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                        .map_err(|e| bad("messages", format!("the arguments of a call to {name:?} are not JSON: {e}")))?,
                    Some(v @ Value::Object(_)) => v.clone(),
                    _ => json!({}),
                };
                parsed.push(json!({ "id": c.get("id").cloned().unwrap_or(Value::Null), "type": "function",
                    "function": { "name": name, "arguments": arguments } }));
            }
            turn["tool_calls"] = Value::Array(parsed);
        }
        if let Some(id) = &m.tool_call_id {
            turn["tool_call_id"] = json!(id);
        }
        out.push(turn);
    }
    Ok(out)
}

/// `{"name": …, "<args_key>": {…}}` (or "arguments" either way) as a call.
fn call_of(text: &str, args_key: &str) -> Option<Call> {
    let v: Map<String, Value> = serde_json::from_str(text.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = v.get(args_key).or_else(|| v.get("arguments")).or_else(|| v.get("parameters"))?.clone();
    arguments.is_object().then_some(Call { name, arguments })
}

/// A fresh call id, as OpenAI writes them.
pub fn call_id() -> String {
    let mut b = [0u8; 12];
    let _ = getrandom::fill(&mut b);
    format!("call_{}", hex::encode(b))
}

/// The calls as the response's `tool_calls` (with `index` for a stream's deltas).
pub fn tool_calls_json(calls: &[Call], indexed: bool) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v =
                json!({ "id": call_id(), "type": "function", "function": { "name": c.name, "arguments": c.arguments.to_string() } });
            if indexed {
                v["index"] = json!(i);
            }
            v
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Vec<Value> {
        vec![json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}}, "required": ["city"]}}})]
    }

    #[test]
    fn choices_are_read_and_refused_by_name() {
        let t = weather();
        let qwen = "{% if tools %}<tool_call>{% endif %}";
        assert_eq!(requested(Some(&t), None, qwen).unwrap().unwrap().format, Format::Hermes);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        assert_eq!(requested(Some(&t), Some(&named), "").unwrap().unwrap().choice, Choice::Named("get_weather".into()));
        assert_eq!(requested(Some(&t), Some(&json!("required")), "").unwrap().unwrap().format, Format::LlamaJson);
        assert!(requested(None, Some(&json!("auto")), "").unwrap().is_none());
        for (tools, choice, param) in [
            (Some(t.clone()), Some(json!("sometimes")), "tool_choice"),
            (Some(t.clone()), Some(json!({"type": "function", "function": {"name": "other"}})), "tool_choice"),
            (None, Some(json!("required")), "tool_choice"),
            (Some(vec![json!({"type": "retrieval"})]), None, "tools"),
            (Some(vec![json!({"type": "function", "function": {"name": "a b"}})]), None, "tools"),
        ] {
            let e = requested(tools.as_ref(), choice.as_ref(), "").unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{e:?}");
        }
    }

    #[test]
    fn both_formats_parse_back_into_calls() {
        let t = weather();
        let hermes = requested(Some(&t), None, "<tool_call>").unwrap().unwrap();
        let (content, calls) =
            hermes.parse("Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>");
        assert_eq!((content.as_deref(), calls.len()), (Some("Let me look."), 1));
        assert_eq!(calls[0].arguments, json!({"city": "Oslo"}));
        let llama = requested(Some(&t), None, "").unwrap().unwrap();
        let (content, calls) = llama.parse(" {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}");
        assert_eq!((content, calls[0].name.as_str()), (None, "get_weather"));
        // Not a call of a known function: text.
        let (content, calls) = llama.parse("{\"name\": \"launch\", \"parameters\": {}}");
        assert!(calls.is_empty() && content.is_some());
        assert!(llama.parse("It is sunny.").1.is_empty());
    }

    #[test]
    fn a_template_without_tools_is_told_them_in_a_system_turn() {
        let t = weather();
        let tools = requested(Some(&t), None, "{{ messages }}").unwrap().unwrap();
        let call = json!({"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}});
        let m = tools.messages(vec![
            json!({"role": "user", "content": "Weather?"}),
            json!({"role": "assistant", "content": "", "tool_calls": [call]}),
            json!({"role": "tool", "content": "sunny", "tool_call_id": "c"}),
        ]);
        assert_eq!(m[0]["role"], "system");
        assert!(m[0]["content"].as_str().unwrap().contains("get_weather"));
        assert_eq!(m[2]["content"], "{\"name\":\"get_weather\",\"parameters\":{\"city\":\"Oslo\"}}");
        assert!(tools.grammar().unwrap().is_none());
    }
}

//! Chat templates (`tokenizer.chat_template`) rendered with minijinja.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::TokenizerError;

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// Renders `template` the way Hugging Face's `apply_chat_template` sets up Jinja.
pub(crate) fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, TokenizerError> {
    render_with(template, &messages, None, add_generation_prompt, bos_token, eos_token)
}

/// Renders `template` over messages of any shape (OpenAI's: `tool_calls`, `tool_call_id`) and,
/// when given, the `tools` variable.
pub(crate) fn render_with(
    template: &str,
    messages: &impl Serialize,
    tools: Option<&serde_json::Value>,
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, TokenizerError> {
    let mut env = Environment::new();
    env.add_filter("tojson", tojson);
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // templates call Python string methods such as `.strip()`
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> { Err(Error::new(ErrorKind::InvalidOperation, msg)) });
    let tmpl = env.template_from_str(template)?;
    Ok(tmpl.render(context! {
        messages => messages,
        tools => tools,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
    })?)
}

/// Transformers' `tojson`: Python's `json.dumps` with `ensure_ascii=False` (", " and ": "
/// separators, nothing escaped for HTML), keys in their order.
fn tojson(v: minijinja::Value) -> Result<String, Error> {
    let v = serde_json::to_value(&v).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&v, &mut out);
    Ok(out)
}

fn python_json(v: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match v {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_json(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                python_json(item, out);
            }
            out.push('}');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gemma 3's template (its tokenizer_config.json; gemma-3-270m's GGUF carries none, so a
    /// gemma3 GGUF that does carries this): system text folded into the first user turn,
    /// "assistant" renamed "model", contents trimmed, alternation enforced.
    const GEMMA3: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '

' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"#;

    #[test]
    fn tools_and_tool_calls_reach_the_template() {
        let t = "{% for t in tools %}{{ t | tojson }}|{% endfor %}{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}\
                 {{ m.tool_calls[0].function.arguments | tojson }}{% else %}{{ m.content }}{% endif %}|{% endfor %}";
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {"b": [1, "<x>"]}}}]);
        let messages = serde_json::json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": {"city": "Zürich"}}}]},
        ]);
        // Keys come sorted (serde_json's map), which Python's json.dumps would keep in order.
        assert_eq!(
            render_with(t, &messages, Some(&tools), false, "", "").unwrap(),
            "{\"function\": {\"name\": \"f\", \"parameters\": {\"b\": [1, \"<x>\"]}}, \"type\": \"function\"}|user:hi|assistant:{\"city\": \"Zürich\"}|"
        );
    }

    #[test]
    fn gemma3_template_renders_its_turns() {
        let user = [ChatMessage::new("user", "What is the tallest mountain in the world?")];
        assert_eq!(
            render(GEMMA3, &user, true, "<bos>", "<eos>").unwrap(),
            "<bos><start_of_turn>user\nWhat is the tallest mountain in the world?<end_of_turn>\n<start_of_turn>model\n"
        );
        let chat = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", " Hi "), ChatMessage::new("assistant", "Hello.")];
        assert_eq!(
            render(GEMMA3, &chat, false, "<bos>", "<eos>").unwrap(),
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        );
        let unordered = [ChatMessage::new("assistant", "Hello.")];
        let err = render(GEMMA3, &unordered, true, "<bos>", "<eos>").unwrap_err();
        assert!(err.to_string().contains("alternate"), "{err}");
    }
}

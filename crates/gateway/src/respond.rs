//! Turning a generation's pieces into an OpenAI response: one JSON body, or a stream of
//! server-sent events ending with a usage chunk and `[DONE]`.

use crate::openai::Params;
use crate::service::{Piece, ServedModel};
use crate::tools;
use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use dgr_driver::{DraftStats, FinishReason};
use serde_json::{json, Value};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;

pub struct Shape {
    pub chat: bool,
    pub model: Arc<ServedModel>,
    pub params: Params,
    pub created: u64,
    pub prompt_tokens: usize,
}

fn new_id(chat: bool) -> String {
    let mut b = [0u8; 12];
    let _ = getrandom::fill(&mut b);
    let hex = hex::encode(b);
    if chat {
        format!("chatcmpl-{hex}")
    } else {
        format!("cmpl-{hex}")
    }
}

/// OpenAI's usage object; `cached` prompt tokens came from the workers' prefix caches. Draft
/// tokens of speculative decoding are OpenAI's predicted-output counts (accepted and
/// rejected), and `speculation` (dgr's) says in how many verification steps.
fn usage(prompt: usize, completion: usize, cached: usize, drafts: DraftStats) -> Value {
    json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": { "cached_tokens": cached },
            "completion_tokens_details": { "accepted_prediction_tokens": drafts.accepted,
                                           "rejected_prediction_tokens": drafts.drafted - drafts.accepted },
            "speculation": drafts })
}

/// A sampled token, its logprob, and the most likely alternatives with theirs.
type Scored = (u32, f32, Vec<(u32, f32)>);

/// Logprobs of a run of tokens in the shape each endpoint uses.
struct Logprobs<'a> {
    shape: &'a Shape,
    tokens: Vec<Scored>,
}

impl Logprobs<'_> {
    fn token_text(&self, id: u32) -> String {
        String::from_utf8_lossy(&self.shape.model.tokenizer.token_bytes(id).unwrap_or_default()).into_owned()
    }

    /// `offset`: the text's length before the first of the tokens.
    fn render(&self, offset: usize) -> Value {
        if self.shape.params.logprobs.is_none() {
            return Value::Null;
        }
        if self.shape.chat {
            let entry = |id: u32, lp: f32| {
                let bytes = self.shape.model.tokenizer.token_bytes(id).unwrap_or_default();
                json!({ "token": self.token_text(id), "logprob": lp, "bytes": bytes })
            };
            let content: Vec<Value> = self
                .tokens
                .iter()
                .map(|(id, lp, top)| {
                    let mut e = entry(*id, *lp);
                    e["top_logprobs"] = top.iter().map(|(t, l)| entry(*t, *l)).collect();
                    e
                })
                .collect();
            return json!({ "content": content });
        }
        let mut at = offset;
        let mut text_offset = Vec::new();
        for (id, _, _) in &self.tokens {
            text_offset.push(at);
            at += self.token_text(*id).len();
        }
        json!({
            "tokens": self.tokens.iter().map(|(id, _, _)| self.token_text(*id)).collect::<Vec<_>>(),
            "token_logprobs": self.tokens.iter().map(|(_, lp, _)| *lp).collect::<Vec<_>>(),
            "top_logprobs": self.tokens.iter().map(|(_, _, top)| {
                top.iter().map(|(t, l)| (self.token_text(*t), json!(l))).collect::<serde_json::Map<String, Value>>()
            }).collect::<Vec<_>>(),
            "text_offset": text_offset,
        })
    }
}

/// The API's finish_reason.
fn finish(reason: FinishReason) -> &'static str {
    match reason {
        // A cancelled generation had no client left to tell.
        FinishReason::Cancelled => "stop",
        r => r.as_str(),
    }
}

/// Waits for the whole generation and answers with one body.
pub async fn whole(shape: Shape, mut rx: UnboundedReceiver<Piece>) -> Response {
    let mut text = String::new();
    let mut lp = Logprobs { shape: &shape, tokens: Vec::new() };
    let (reason, completion, (cached, drafts)) = loop {
        match rx.recv().await {
            Some(Piece::Token { id, text: t, logprob, top }) => {
                text.push_str(&t);
                lp.tokens.push((id, logprob, top));
            }
            Some(Piece::Done { text: tail, end, completion_tokens, cached_tokens, drafts, .. }) => {
                let reason = match end {
                    Ok(r) => r,
                    Err(e) => return e.into_response(),
                };
                text.push_str(&tail);
                break (reason, completion_tokens, (cached_tokens, drafts));
            }
            None => return (StatusCode::INTERNAL_SERVER_ERROR, "the generation ended without a result").into_response(),
        }
    };
    let logprobs = lp.render(0);
    let choice = if shape.chat {
        let (content, calls) = split_calls(&shape, text);
        let (message, reason) = if calls.is_empty() {
            (json!({ "role": "assistant", "content": content }), finish(reason))
        } else {
            (json!({ "role": "assistant", "content": content, "tool_calls": tools::tool_calls_json(&calls, false) }), "tool_calls")
        };
        json!({ "index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason })
    } else {
        json!({ "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish(reason) })
    };
    let object = if shape.chat { "chat.completion" } else { "text_completion" };
    axum::Json(json!({
        "id": new_id(shape.chat),
        "object": object,
        "created": shape.created,
        "model": shape.model.name,
        "choices": [choice],
        "usage": usage(shape.prompt_tokens, completion, cached, drafts),
    }))
    .into_response()
}

/// The answer's tool calls and the text beside them, when the request has tools to call.
fn split_calls(shape: &Shape, text: String) -> (Option<String>, Vec<tools::Call>) {
    match shape.params.tools.as_ref().filter(|t| t.parses()) {
        Some(t) => t.parse(&text),
        None => (Some(text), Vec::new()),
    }
}

/// Whether a stream holds its text back until the end, to send it as calls if it is any.
fn holds_for_calls(shape: &Shape) -> bool {
    shape.chat && shape.params.tools.as_ref().is_some_and(|t| t.parses())
}

fn event(v: &Value) -> axum::body::Bytes {
    axum::body::Bytes::from(format!("data: {v}\n\n"))
}

/// Streams the generation as server-sent events. Dropping the stream (the client left) drops
/// the receiver, which cancels the session on every stage.
pub fn stream(shape: Shape, rx: UnboundedReceiver<Piece>) -> Response {
    let id = new_id(shape.chat);
    let object = if shape.chat { "chat.completion.chunk" } else { "text_completion" };
    let chunk = move |shape: &Shape, choice: Value| json!({ "id": id, "object": object, "created": shape.created, "model": shape.model.name, "choices": [choice] });
    struct St<F> {
        shape: Shape,
        rx: UnboundedReceiver<Piece>,
        chunk: F,
        started: bool,
        text_len: usize,
        done: bool,
        /// The text so far, while it may turn out to be tool calls.
        held: String,
    }
    let st = St { shape, rx, chunk, started: false, text_len: 0, done: false, held: String::new() };
    let body = futures::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let mut out: Vec<u8> = Vec::new();
        if st.shape.chat && !st.started {
            let first = json!({ "index": 0, "delta": { "role": "assistant", "content": "" }, "logprobs": null, "finish_reason": null });
            out.extend_from_slice(&event(&(st.chunk)(&st.shape, first)));
        }
        st.started = true;
        // Tokens whose text is held back (a possible stop string, a split character) make no
        // chunk: wait for one that does.
        while out.is_empty() && !st.done {
            match st.rx.recv().await {
                Some(Piece::Token { text, .. }) if holds_for_calls(&st.shape) => st.held.push_str(&text),
                Some(Piece::Token { id, text, logprob, top }) => {
                    let lp = Logprobs { shape: &st.shape, tokens: vec![(id, logprob, top)] }.render(st.text_len);
                    st.text_len += text.len();
                    if !text.is_empty() || !lp.is_null() {
                        let choice = if st.shape.chat {
                            json!({ "index": 0, "delta": { "content": text }, "logprobs": lp, "finish_reason": null })
                        } else {
                            json!({ "index": 0, "text": text, "logprobs": lp, "finish_reason": null })
                        };
                        out.extend_from_slice(&event(&(st.chunk)(&st.shape, choice)));
                    }
                }
                Some(Piece::Done { text, end, prompt_tokens, completion_tokens, cached_tokens, drafts }) => {
                    st.done = true;
                    match end {
                        Err(e) => out.extend_from_slice(&event(&e.body())),
                        Ok(finish_reason) => {
                            let (text, calls) = if holds_for_calls(&st.shape) {
                                let held = std::mem::take(&mut st.held) + &text;
                                let (content, calls) = split_calls(&st.shape, held);
                                (content.unwrap_or_default(), calls)
                            } else {
                                (text, Vec::new())
                            };
                            let choice = if !calls.is_empty() {
                                if !text.is_empty() {
                                    let c = json!({ "index": 0, "delta": { "content": text }, "logprobs": null, "finish_reason": null });
                                    out.extend_from_slice(&event(&(st.chunk)(&st.shape, c)));
                                }
                                let c = json!({ "index": 0, "delta": { "tool_calls": tools::tool_calls_json(&calls, true) },
                                    "logprobs": null, "finish_reason": null });
                                out.extend_from_slice(&event(&(st.chunk)(&st.shape, c)));
                                json!({ "index": 0, "delta": {}, "logprobs": null, "finish_reason": "tool_calls" })
                            } else if st.shape.chat {
                                json!({ "index": 0, "delta": if text.is_empty() { json!({}) } else { json!({ "content": text }) },
                                "logprobs": null, "finish_reason": finish(finish_reason) })
                            } else {
                                json!({ "index": 0, "text": text, "logprobs": null, "finish_reason": finish(finish_reason) })
                            };
                            out.extend_from_slice(&event(&(st.chunk)(&st.shape, choice)));
                            // The usage chunk (no choices), as OpenAI sends it with include_usage; dgr
                            // always sends it, so every stream ends with its usage.
                            let mut u = (st.chunk)(&st.shape, Value::Null);
                            u["choices"] = json!([]);
                            u["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens, drafts);
                            out.extend_from_slice(&event(&u));
                        }
                    }
                    out.extend_from_slice(b"data: [DONE]\n\n");
                }
                None => {
                    st.done = true;
                    out.extend_from_slice(b"data: [DONE]\n\n");
                }
            }
        }
        Some((Ok::<_, std::convert::Infallible>(axum::body::Bytes::from(out)), st))
    });
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], Body::from_stream(body)).into_response()
}

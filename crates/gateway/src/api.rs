//! The HTTP routes: the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions, streamed
//! as server-sent events or not, /v1/embeddings), /health, /metrics, and the dashboard.

use crate::api_error::ApiError;
use crate::openai::{Body as ReqBody, Params, Prompt};
use crate::respond;
use crate::service::{Gateway, Job};
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dgr_proto::Sampling;
use dgr_tokenizer::ChatMessage;
use serde_json::json;
use std::sync::Arc;

pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/", get(dashboard))
        .route("/dashboard/state", get(dashboard_state))
        .route("/dashboard/series", get(dashboard_series))
        .route("/dashboard/uplot.js", get(|| asset("text/javascript; charset=utf-8", include_str!("vendor/uplot/uPlot.iife.min.js"))))
        .route("/dashboard/uplot.css", get(|| asset("text/css; charset=utf-8", include_str!("vendor/uplot/uPlot.min.css"))))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/embeddings", post(embeddings))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", "no such route").code("not_found") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "this route does not take that method")
                .code("method_not_allowed")
        })
        .with_state(gw)
}

async fn dashboard() -> Html<&'static str> {
    Html(include_str!("dashboard.html"))
}

/// The dashboard's chart library (uPlot, MIT, vendored: the page needs no network beyond the
/// gateway).
async fn asset(mime: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, mime), (header::CACHE_CONTROL, "max-age=3600")], body).into_response()
}

async fn dashboard_series(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    Json(gw.history.json())
}

async fn dashboard_state(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    Json(crate::dashboard::state(&gw).await)
}

async fn health(State(gw): State<Arc<Gateway>>) -> Response {
    let covered = match gw.swarm().await {
        Some(s) => gw.models.iter().filter(|m| Gateway::covered(&s, &m.model_id)).map(|m| m.name.clone()).collect(),
        None => Vec::new(),
    };
    let status = if covered.is_empty() { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
    (status, Json(json!({ "status": if covered.is_empty() { "unavailable" } else { "ok" }, "models": covered }))).into_response()
}

async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
    let mut body = gw.metrics.render(gw.admission.waiting(), gw.admission.running(gw.cfg.max_running));
    body.push_str(&crate::metrics::render_reports(gw.report_stats()));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

async fn models(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    let swarm = gw.swarm().await;
    let created = gw.created();
    let data: Vec<serde_json::Value> = gw
        .models
        .iter()
        .filter(|m| swarm.as_ref().is_some_and(|s| Gateway::covered(s, &m.model_id)))
        .map(|m| json!({ "id": m.name, "object": "model", "created": created, "owned_by": "dgr", "model_id": m.model_id }))
        .collect();
    Json(json!({ "object": "list", "data": data }))
}

async fn completions(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    serve(gw, req, false).await
}

async fn chat_completions(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    serve(gw, req, true).await
}

async fn embeddings(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let headers = req.headers().clone();
    let result = match body(&gw, req).await {
        Ok(b) => match crate::embeddings::prepare(&gw, &b) {
            Ok(e) => crate::embeddings::run(&gw, e, &api_key(&headers)).await,
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    match result {
        Ok(json) => Json(json).into_response(),
        Err(e) => {
            gw.metrics.error(e.metric_kind());
            e.into_response()
        }
    }
}

/// The request's bearer token (empty when it sends none).
fn api_key(headers: &HeaderMap) -> String {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
        .trim()
        .to_string()
}

/// A client has this long to send a request's body.
const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The request's body, read within the size limit and the body deadline.
async fn body(gw: &Gateway, req: Request) -> Result<Bytes, ApiError> {
    let limit = gw.cfg.max_body_bytes;
    match tokio::time::timeout(BODY_TIMEOUT, axum::body::to_bytes(req.into_body(), limit)).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(_)) => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is larger than {limit} bytes (or broken)"),
        )
        .code("body_too_large")),
        Err(_) => {
            Err(ApiError::new(StatusCode::REQUEST_TIMEOUT, "invalid_request_error", "the request body took too long").code("body_timeout"))
        }
    }
}

async fn serve(gw: Arc<Gateway>, req: Request, chat: bool) -> Response {
    let headers = req.headers().clone();
    let prepared = match body(&gw, req).await {
        Ok(b) => prepare(&gw, &headers, &b, chat),
        Err(e) => Err(e),
    };
    let (job, params) = match prepared {
        Ok(v) => v,
        Err(e) => {
            gw.metrics.error(e.metric_kind());
            return e.into_response();
        }
    };
    let model = job.model.clone();
    let prompt_tokens = job.prompt.len();
    match gw.start(job).await {
        Err(e) => {
            gw.metrics.error(e.metric_kind());
            e.into_response()
        }
        Ok((rx, _)) => {
            let shape = respond::Shape { chat, model: model.clone(), params, created: gw.created_now(), prompt_tokens };
            if shape.params.stream {
                respond::stream(shape, rx)
            } else {
                respond::whole(shape, rx).await
            }
        }
    }
}

/// Everything about a request that can be checked before any worker is asked: the body, the
/// model, the prompt and the limits.
fn prepare(gw: &Gateway, headers: &HeaderMap, bytes: &[u8], chat: bool) -> Result<(Job, Params), ApiError> {
    let body = ReqBody::parse(bytes)?;
    let mut params = body.params(chat)?;
    let model = gw.model(&body.model)?;
    let tok = &model.tokenizer;
    if !chat && (body.tools.is_some() || body.tool_choice.is_some()) {
        return Err(ApiError::bad_request("tools are for chat completions").param("tools"));
    }
    params.tools = crate::tools::requested(body.tools.as_ref(), body.tool_choice.as_ref(), tok.chat_template().unwrap_or(""))?;
    let asked = crate::structured::requested(body.response_format.as_ref(), body.grammar.as_deref())?;
    let call_grammar = match &params.tools {
        Some(t) => t.grammar()?,
        None => None,
    };
    let constraint = match (asked, call_grammar) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request("a required or named tool call cannot also take a response_format").param("tool_choice"))
        }
        (Some((grammar, param)), None) => Some(model.grammars.compile(grammar, param)?),
        (None, Some(grammar)) => Some(model.grammars.compile(grammar, "tools")?),
        (None, None) => None,
    };
    let prompt = if chat {
        if body.prompt.is_some() {
            return Err(ApiError::bad_request("chat completions take messages, not a prompt").param("prompt"));
        }
        let messages = body.messages.as_ref().ok_or_else(|| ApiError::bad_request("messages is required").param("messages"))?;
        if messages.is_empty() {
            return Err(ApiError::bad_request("messages must not be empty").param("messages"));
        }
        let with_tools = params.tools.is_some() || messages.iter().any(|m| m.role == "tool" || m.tool_calls.is_some());
        let text = if with_tools {
            let turns = crate::tools::turns(messages)?;
            let turns = match &params.tools {
                Some(t) => t.messages(turns),
                None => turns,
            };
            let tools = params.tools.as_ref().and_then(|t| t.template_tools());
            tok.apply_chat_template_with_tools(&serde_json::Value::Array(turns), tools, true)
        } else {
            let mut chat_messages = Vec::with_capacity(messages.len());
            for m in messages {
                if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "developer") {
                    return Err(ApiError::bad_request(format!("message role {:?} is not supported", m.role)).param("messages"));
                }
                let role = if m.role == "developer" { "system" } else { m.role.as_str() };
                chat_messages.push(ChatMessage::new(role, m.text()?));
            }
            tok.apply_chat_template(&chat_messages, true)
        };
        let text = text.map_err(|e| ApiError::bad_request(format!("the chat template failed: {e}")).param("messages"))?;
        tok.encode_chat(&text).map_err(|e| ApiError::bad_request(e.to_string()).param("messages"))?
    } else {
        if body.messages.is_some() {
            return Err(ApiError::bad_request("completions take a prompt, not messages").param("messages"));
        }
        match body.prompt.as_ref().ok_or_else(|| ApiError::bad_request("prompt is required").param("prompt"))? {
            Prompt::Text(t) => tok.encode_prompt(t).map_err(|e| ApiError::bad_request(e.to_string()).param("prompt"))?,
            Prompt::Texts(v) if v.is_empty() => return Err(ApiError::bad_request("the prompt is empty").param("prompt")),
            Prompt::Texts(v) if v.len() == 1 => {
                tok.encode_prompt(&v[0]).map_err(|e| ApiError::bad_request(e.to_string()).param("prompt"))?
            }
            Prompt::Texts(_) => return Err(ApiError::bad_request("one prompt per request (n = 1)").param("prompt")),
            Prompt::Tokens(ids) => {
                if let Some(bad) = ids.iter().find(|&&t| t as usize >= tok.vocab_size()) {
                    return Err(ApiError::bad_request(format!("token id {bad} is outside the vocabulary")).param("prompt"));
                }
                ids.clone()
            }
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty").param("prompt"));
    }
    let limits = &gw.cfg;
    if prompt.len() > limits.max_prompt_tokens {
        return Err(ApiError::bad_request(format!(
            "the prompt has {} tokens; this gateway takes at most {}",
            prompt.len(),
            limits.max_prompt_tokens
        ))
        .code("context_length_exceeded"));
    }
    let room = model.context.saturating_sub(prompt.len());
    let max_tokens = match params.max_tokens {
        Some(n) if n as usize > limits.max_tokens_limit => {
            return Err(ApiError::bad_request(format!("max_tokens {n} is over this gateway's limit of {}", limits.max_tokens_limit))
                .param("max_tokens"))
        }
        Some(n) if n as usize > room => {
            return Err(ApiError::bad_request(format!(
                "{} prompt tokens + max_tokens {n} exceed the model's context of {}",
                prompt.len(),
                model.context
            ))
            .param("max_tokens")
            .code("context_length_exceeded"))
        }
        Some(n) => n as usize,
        // OpenAI's default for completions is 16; a chat runs until it ends or fills the room.
        None if !chat => 16.min(room),
        None => limits.max_tokens_limit.min(room),
    };
    if max_tokens == 0 {
        return Err(ApiError::bad_request("the prompt fills the model's context").code("context_length_exceeded"));
    }
    let seed = params.seed.unwrap_or_else(|| {
        let mut b = [0u8; 8];
        let _ = getrandom::fill(&mut b);
        u64::from_le_bytes(b)
    });
    let api_key = api_key(headers);
    let job = Job {
        model,
        prompt,
        max_tokens,
        sampling: Sampling { temperature: params.temperature, top_k: params.top_k, top_p: params.top_p, seed },
        logprobs: params.logprobs,
        stops: params.stops.clone(),
        ignore_eos: params.ignore_eos,
        api_key,
        constraint,
    };
    Ok((job, params))
}

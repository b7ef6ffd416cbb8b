//! The client side of `dgr bench serve`: one streamed completion request on hyper's HTTP/1.1
//! client (a connection of its own, every wait under the request's deadline), its body parsed
//! as server-sent events as it arrives, bounded, and each token's arrival timed.

use crate::BenchError;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{ACCEPT, AUTHORIZATION, CONNECTION, CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// Bounds on what a server may send: more than this is not the protocol being measured, and no
/// buffer grows past them whatever the server says (hyper bounds the head and chunk framing).
const MAX_SSE_LINE: usize = 1 << 20;
const MAX_ERROR_BODY: usize = 64 << 10;
const MAX_JSON_BODY: usize = 1 << 20;
/// A response's content kept for the next turn of a chat: past this it is cut.
const MAX_TEXT: usize = 1 << 20;

/// Why a request failed; `kind` is what the report counts errors by.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    Connect(String),
    Timeout,
    /// The connection broke or closed before the response ended.
    Broken(String),
    /// Bad HTTP framing, SSE or JSON.
    Protocol(String),
    /// A non-200 status, with the error message of its body.
    Status(u16, String),
    /// An error the server reported inside the stream.
    Server(String),
}

impl Failure {
    pub fn kind(&self) -> String {
        match self {
            Failure::Connect(_) => "connect".into(),
            Failure::Timeout => "timeout".into(),
            Failure::Broken(_) => "broken_stream".into(),
            Failure::Protocol(_) => "protocol".into(),
            Failure::Status(s, _) => format!("http_{s}"),
            Failure::Server(_) => "server_error".into(),
        }
    }

    pub fn message(&self) -> String {
        match self {
            Failure::Timeout => "no complete response before the deadline".into(),
            Failure::Connect(m) | Failure::Broken(m) | Failure::Protocol(m) | Failure::Status(_, m) | Failure::Server(m) => m.clone(),
        }
    }
}

/// Where requests go: `http://host[:port][/prefix]` (a trailing `/v1` is dropped, since the
/// request paths carry it).
#[derive(Clone, Debug)]
pub struct Endpoint {
    host: String,
    port: u16,
    /// The `Host` header: the authority as given.
    authority: String,
    prefix: String,
    api_key: Option<String>,
}

impl Endpoint {
    pub fn parse(url: &str, api_key: Option<String>) -> crate::Result<Endpoint> {
        let bad = || BenchError::Usage(format!("{url}: expected http://HOST[:PORT][/PATH]"));
        let uri: hyper::Uri = url.parse().map_err(|_| bad())?;
        if uri.scheme_str() != Some("http") {
            return Err(BenchError::Usage(format!("{url}: only http:// URLs are supported")));
        }
        let authority = uri.authority().ok_or_else(bad)?;
        // An IPv6 literal comes bracketed, as in the URL; a socket address wants it bare.
        let host = authority.host().trim_start_matches('[').trim_end_matches(']');
        // The Uri keeps a port it cannot read as a number; a port must be one.
        let port = match authority.as_str().rsplit_once(authority.host()).map(|(_, r)| r) {
            Some("") => 80,
            Some(r) => r.strip_prefix(':').and_then(|p| p.parse().ok()).ok_or_else(bad)?,
            None => return Err(bad()),
        };
        if host.is_empty() {
            return Err(bad());
        }
        let path = uri.path().trim_end_matches('/');
        let prefix = path.strip_suffix("/v1").unwrap_or(path).to_string();
        Ok(Endpoint { host: host.into(), port, authority: authority.as_str().into(), prefix, api_key: api_key.filter(|k| !k.is_empty()) })
    }
}

/// One server-sent event: its data, and whether the server marked it an error (`event: error`,
/// or llama.cpp's `error: {...}` line).
#[derive(Debug, PartialEq)]
pub enum SseEvent {
    Data(String),
    Error(String),
}

/// Parses a server-sent-events stream incrementally, from input split anywhere. Lines end in
/// "\n", "\r\n" or "\r"; an event ends at a blank line.
#[derive(Default)]
pub struct Sse {
    line: Vec<u8>,
    after_cr: bool,
    data: Vec<u8>,
    has_data: bool,
    is_error: bool,
}

impl Sse {
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<SseEvent>) -> Result<(), String> {
        for &b in input {
            if std::mem::take(&mut self.after_cr) && b == b'\n' {
                continue;
            }
            if b == b'\n' || b == b'\r' {
                self.after_cr = b == b'\r';
                self.end_line(out)?;
            } else if self.line.len() >= MAX_SSE_LINE {
                return Err(format!("event-stream line longer than {MAX_SSE_LINE} bytes"));
            } else {
                self.line.push(b);
            }
        }
        Ok(())
    }

    /// At the end of the stream: dispatches an event the server did not end with a blank line.
    pub fn finish(&mut self, out: &mut Vec<SseEvent>) -> Result<(), String> {
        if !self.line.is_empty() {
            self.end_line(out)?;
        }
        self.end_line(out)
    }

    fn end_line(&mut self, out: &mut Vec<SseEvent>) -> Result<(), String> {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            if std::mem::take(&mut self.has_data) {
                let data = String::from_utf8_lossy(&std::mem::take(&mut self.data)).into_owned();
                out.push(if self.is_error { SseEvent::Error(data) } else { SseEvent::Data(data) });
            }
            self.is_error = false;
            return Ok(());
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(0) => return Ok(()), // a comment
            Some(i) => (&line[..i], line[i + 1..].strip_prefix(b" ").unwrap_or(&line[i + 1..])),
            None => (&line[..], &[][..]),
        };
        match field {
            b"data" | b"error" => {
                if self.has_data {
                    self.data.push(b'\n');
                }
                if self.data.len() + value.len() > MAX_SSE_LINE {
                    return Err(format!("event data longer than {MAX_SSE_LINE} bytes"));
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
                self.is_error |= field == b"error";
            }
            b"event" => self.is_error |= value == b"error",
            _ => {} // id, retry and unknown fields
        }
        Ok(())
    }
}

/// A response whose head has arrived; its body is read piece by piece.
pub struct Response {
    pub status: u16,
    body: Incoming,
    /// The task driving the connection, ended with the response.
    _conn: ConnTask,
}

struct ConnTask(tokio::task::JoinHandle<()>);

impl Drop for ConnTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A hyper error with its causes, which say what actually broke.
fn describe(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s = format!("{s}: {c}");
        cause = c.source();
    }
    s
}

fn failure(e: hyper::Error) -> Failure {
    if e.is_parse() || e.is_parse_status() {
        Failure::Protocol(describe(&e))
    } else {
        Failure::Broken(describe(&e))
    }
}

/// Sends one request on a connection of its own (`Connection: close`, as a client without a
/// pool would) and waits for the response head.
pub async fn send(ep: &Endpoint, method: &str, path: &str, body: Option<&[u8]>, deadline: Instant) -> Result<Response, Failure> {
    let connect = TcpStream::connect((ep.host.as_str(), ep.port));
    let stream = tokio::time::timeout_at(deadline.into(), connect)
        .await
        .map_err(|_| Failure::Timeout)?
        .map_err(|e| Failure::Connect(format!("{}:{}: {e}", ep.host, ep.port)))?;
    stream.set_nodelay(true).ok();
    let handshake = hyper::client::conn::http1::handshake(TokioIo::new(stream));
    let (mut sender, conn) = tokio::time::timeout_at(deadline.into(), handshake).await.map_err(|_| Failure::Timeout)?.map_err(failure)?;
    let conn = ConnTask(tokio::spawn(async move {
        let _ = conn.await;
    }));
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(format!("{}{path}", ep.prefix))
        .header(HOST, &ep.authority)
        .header(CONNECTION, "close")
        .header(ACCEPT, "application/json, text/event-stream");
    if let Some(k) = &ep.api_key {
        req = req.header(AUTHORIZATION, format!("Bearer {k}"));
    }
    if body.is_some() {
        req = req.header(CONTENT_TYPE, "application/json");
    }
    let req = req
        .body(Full::new(Bytes::copy_from_slice(body.unwrap_or_default())))
        .map_err(|e| Failure::Protocol(format!("building the request: {e}")))?;
    let sent = tokio::time::timeout_at(deadline.into(), sender.send_request(req)).await.map_err(|_| Failure::Timeout)?;
    let resp = sent.map_err(failure)?;
    Ok(Response { status: resp.status().as_u16(), body: resp.into_body(), _conn: conn })
}

impl Response {
    /// The next piece of the body, or None at its end.
    pub async fn next(&mut self, deadline: Instant) -> Result<Option<Bytes>, Failure> {
        loop {
            let frame = tokio::time::timeout_at(deadline.into(), self.body.frame()).await.map_err(|_| Failure::Timeout)?;
            match frame {
                None => return Ok(None),
                Some(Err(e)) => return Err(failure(e)),
                // Trailers and empty pieces carry nothing to measure.
                Some(Ok(f)) => match f.into_data() {
                    Ok(data) if !data.is_empty() => return Ok(Some(data)),
                    _ => {}
                },
            }
        }
    }

    /// The whole body, failing past `cap` bytes.
    pub async fn read_all(&mut self, deadline: Instant, cap: usize) -> Result<Vec<u8>, Failure> {
        let mut body = Vec::new();
        while let Some(p) = self.next(deadline).await? {
            if body.len() + p.len() > cap {
                return Err(Failure::Protocol(format!("response body longer than {cap} bytes")));
            }
            body.extend_from_slice(&p);
        }
        Ok(body)
    }
}

/// The message of an OpenAI-style error value (`{"message": ...}` or a string), shortened.
fn error_message(e: &Value) -> String {
    let m = e["message"].as_str().map(str::to_string).or_else(|| e.as_str().map(str::to_string)).unwrap_or_else(|| e.to_string());
    shorten(&m)
}

fn shorten(s: &str) -> String {
    if s.chars().count() > 300 {
        s.chars().take(300).collect::<String>() + "..."
    } else {
        s.to_string()
    }
}

/// What a non-200 response's body says went wrong.
async fn status_failure(mut r: Response, deadline: Instant) -> Failure {
    let body = r.read_all(deadline, MAX_ERROR_BODY).await.unwrap_or_default();
    let msg = match serde_json::from_slice::<Value>(&body) {
        Ok(v) if !v["error"].is_null() => error_message(&v["error"]),
        Ok(v) if v["message"].is_string() => error_message(&v),
        _ => shorten(String::from_utf8_lossy(&body).trim()),
    };
    Failure::Status(r.status, msg)
}

/// GET `path` and parse its JSON body.
pub async fn get_json(ep: &Endpoint, path: &str, timeout: Duration) -> Result<Value, Failure> {
    let deadline = Instant::now() + timeout;
    let mut r = send(ep, "GET", path, None, deadline).await?;
    if r.status != 200 {
        return Err(status_failure(r, deadline).await);
    }
    let body = r.read_all(deadline, MAX_JSON_BODY).await?;
    serde_json::from_slice(&body).map_err(|e| Failure::Protocol(format!("bad JSON from {path}: {e}")))
}

/// One streamed completion request to measure.
pub struct RequestSpec {
    pub path: &'static str,
    pub body: Vec<u8>,
    /// Content arrives in `choices[0].delta.content` (chat) rather than `choices[0].text`.
    pub chat: bool,
    pub timeout: Duration,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct SampleError {
    pub kind: String,
    pub message: String,
}

/// What one request measured. Times are milliseconds; a chunk is an SSE event carrying
/// non-empty content (a server may put more than one token in one).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    pub id: usize,
    /// When the request was sent, after its phase began.
    pub start_ms: f64,
    /// From sending the request to the first content chunk.
    pub ttft_ms: Option<f64>,
    /// From sending the request to the end of its stream (or its failure).
    pub total_ms: f64,
    /// Gaps between successive content chunks.
    pub itl_ms: Vec<f64>,
    pub chunks: usize,
    /// The server's own counts, from the stream's `usage`.
    pub prompt_tokens: Option<u64>,
    /// Prompt tokens the server answered from its cache (`usage.prompt_tokens_details.
    /// cached_tokens`, or llama-server's `timings.cache_n`).
    pub cached_tokens: Option<u64>,
    pub completion_tokens: u64,
    /// The content streamed (up to MAX_TEXT bytes), for a chat's next turn.
    #[serde(skip)]
    pub text: String,
    /// False when the stream carried no usage and `completion_tokens` counts chunks instead.
    pub tokens_from_usage: bool,
    pub error: Option<SampleError>,
}

pub fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// What a stream has shown so far.
#[derive(Default)]
struct Progress {
    first: Option<Instant>,
    last: Option<Instant>,
    itl_ms: Vec<f64>,
    chunks: usize,
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    text: String,
    finished: bool,
}

impl Progress {
    /// Takes one event's data; true at `[DONE]`.
    fn on_data(&mut self, data: &str, chat: bool, now: Instant) -> Result<bool, Failure> {
        if data.trim() == "[DONE]" {
            return Ok(true);
        }
        let v: Value = serde_json::from_str(data).map_err(|e| Failure::Protocol(format!("bad JSON in the stream: {e}")))?;
        if !v["error"].is_null() {
            return Err(Failure::Server(error_message(&v["error"])));
        }
        if let Some(c) = v["choices"].get(0) {
            let text = if chat { c["delta"]["content"].as_str() } else { c["text"].as_str() };
            if let Some(t) = text.filter(|t| !t.is_empty()) {
                if self.text.len() + t.len() <= MAX_TEXT {
                    self.text.push_str(t);
                }
                if let Some(last) = self.last {
                    self.itl_ms.push(ms(now - last));
                }
                self.first.get_or_insert(now);
                self.last = Some(now);
                self.chunks += 1;
            }
            self.finished |= c["finish_reason"].is_string();
        }
        if v["usage"].is_object() {
            self.prompt_tokens = v["usage"]["prompt_tokens"].as_u64().or(self.prompt_tokens);
            self.completion_tokens = v["usage"]["completion_tokens"].as_u64().or(self.completion_tokens);
            self.cached_tokens = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().or(self.cached_tokens);
        }
        self.cached_tokens = self.cached_tokens.or(v["timings"]["cache_n"].as_u64());
        Ok(false)
    }
}

async fn stream(ep: &Endpoint, spec: &RequestSpec, sent: Instant, p: &mut Progress) -> Result<(), Failure> {
    let deadline = sent + spec.timeout;
    let mut r = send(ep, "POST", spec.path, Some(&spec.body), deadline).await?;
    if r.status != 200 {
        return Err(status_failure(r, deadline).await);
    }
    let (mut sse, mut events) = (Sse::default(), Vec::new());
    loop {
        let piece = r.next(deadline).await?;
        let now = Instant::now();
        let fed = match &piece {
            Some(bytes) => sse.feed(bytes, &mut events),
            None => sse.finish(&mut events),
        };
        fed.map_err(Failure::Protocol)?;
        for e in events.drain(..) {
            match e {
                SseEvent::Data(d) => {
                    if p.on_data(&d, spec.chat, now)? {
                        return Ok(());
                    }
                }
                SseEvent::Error(d) => {
                    let msg = serde_json::from_str::<Value>(&d).map(|v| error_message(if v["error"].is_null() { &v } else { &v["error"] }));
                    return Err(Failure::Server(msg.unwrap_or_else(|_| shorten(&d))));
                }
            }
        }
        if piece.is_none() {
            // Some servers end the body without `[DONE]`; a stream that said how it finished is whole.
            return if p.finished { Ok(()) } else { Err(Failure::Broken("the stream ended before [DONE]".into())) };
        }
    }
}

/// Sends one request and measures its stream. Never fails: a failure is part of the sample.
pub async fn measure(ep: &Endpoint, spec: &RequestSpec, id: usize, phase_start: Instant) -> Sample {
    let sent = Instant::now();
    let mut p = Progress::default();
    let result = stream(ep, spec, sent, &mut p).await;
    let end = Instant::now();
    Sample {
        id,
        start_ms: ms(sent - phase_start),
        ttft_ms: p.first.map(|t| ms(t - sent)),
        total_ms: ms(end - sent),
        itl_ms: p.itl_ms,
        chunks: p.chunks,
        prompt_tokens: p.prompt_tokens,
        cached_tokens: p.cached_tokens,
        completion_tokens: p.completion_tokens.unwrap_or(p.chunks as u64),
        text: p.text,
        tokens_from_usage: p.completion_tokens.is_some(),
        error: result.err().map(|f| SampleError { kind: f.kind(), message: f.message() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_survives_random_garbage() {
        const ALPHABET: &[u8] = b"data:event error\r\n[DONE]{}";
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        for _ in 0..2000 {
            let len = (x % 64) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    ALPHABET[(x % ALPHABET.len() as u64) as usize]
                })
                .collect();
            let (mut p, mut events) = (Sse::default(), Vec::new());
            p.feed(&bytes, &mut events).unwrap();
            p.finish(&mut events).unwrap();
            let data: usize = events
                .iter()
                .map(|e| match e {
                    SseEvent::Data(d) | SseEvent::Error(d) => d.len(),
                })
                .sum();
            assert!(data <= bytes.len());
        }
    }

    /// A server that answers every connection with `reply` and then holds it open.
    async fn raw_server(reply: &'static [u8]) -> Endpoint {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buf = [0u8; 4096];
                    let _ = s.read(&mut buf).await;
                    let _ = s.write_all(reply).await;
                    let _ = s.read(&mut buf).await; // until the client goes
                });
            }
        });
        Endpoint::parse(&format!("http://{addr}"), None).unwrap()
    }

    #[tokio::test]
    async fn hostile_responses_fail_by_kind_and_in_time() {
        let soon = || Instant::now() + Duration::from_millis(500);
        let not_http = raw_server(b"SSH-2.0 hi\r\n\r\n").await;
        let e = send(&not_http, "GET", "/", None, soon()).await.err().unwrap();
        assert_eq!(e.kind(), "protocol", "{e:?}");
        let silent = raw_server(b"").await;
        assert_eq!(send(&silent, "GET", "/", None, soon()).await.err(), Some(Failure::Timeout));
        // A head, then a body that never ends, then a chunk size that is not hex.
        let stalls = raw_server(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n").await;
        let mut r = send(&stalls, "GET", "/", None, soon()).await.unwrap();
        assert_eq!(r.next(soon()).await.unwrap().as_deref(), Some(&b"abc"[..]));
        assert_eq!(r.next(soon()).await.err(), Some(Failure::Timeout));
        let bad_chunk = raw_server(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n").await;
        let mut r = send(&bad_chunk, "GET", "/", None, soon()).await.unwrap();
        assert!(matches!(r.next(soon()).await, Err(Failure::Protocol(_) | Failure::Broken(_))));
        // A body past the cap fails without being kept.
        let big = raw_server(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789012345678901234567890123456789").await;
        let mut r = send(&big, "GET", "/", None, soon()).await.unwrap();
        assert!(matches!(r.read_all(soon(), 16).await, Err(Failure::Protocol(_))));
    }

    fn sse_split(wire: &[u8], at: usize) -> Vec<SseEvent> {
        let (mut p, mut events) = (Sse::default(), Vec::new());
        p.feed(&wire[..at], &mut events).unwrap();
        p.feed(&wire[at..], &mut events).unwrap();
        p.finish(&mut events).unwrap();
        events
    }

    #[test]
    fn sse_parses_at_every_split() {
        let wire = b": comment\r\nevent: message\r\ndata: {\"a\":1}\r\n\r\ndata:x\rdata: y\r\rid: 3\n\nerror: {\"message\":\"boom\"}\n\ndata: [DONE]\n\n";
        let want = vec![
            SseEvent::Data("{\"a\":1}".into()),
            SseEvent::Data("x\ny".into()),
            SseEvent::Error("{\"message\":\"boom\"}".into()),
            SseEvent::Data("[DONE]".into()),
        ];
        for i in 0..=wire.len() {
            assert_eq!(sse_split(wire, i), want, "split at {i}");
        }
        // An event the server did not end with a blank line is still delivered at the end.
        assert_eq!(sse_split(b"data: last", 3), vec![SseEvent::Data("last".into())]);
        assert_eq!(sse_split(b"event: error\ndata: e\n\n", 5), vec![SseEvent::Error("e".into())]);
    }

    #[test]
    fn sse_caps_lines_and_events() {
        let mut events = Vec::new();
        let long = vec![b'a'; MAX_SSE_LINE + 1];
        assert!(Sse::default().feed(&long, &mut events).is_err());
        let mut p = Sse::default();
        let line = [b"data: ".to_vec(), vec![b'a'; MAX_SSE_LINE / 2], b"\n".to_vec()].concat();
        let r: Result<Vec<()>, String> = (0..3).map(|_| p.feed(&line, &mut events)).collect();
        assert!(r.is_err() && events.is_empty());
    }

    #[test]
    fn endpoints_parse() {
        let e = Endpoint::parse("http://127.0.0.1:8080/", None).unwrap();
        assert_eq!((e.host.as_str(), e.port, e.prefix.as_str()), ("127.0.0.1", 8080, ""));
        let e = Endpoint::parse("http://[::1]:9000/api/v1", Some("k".into())).unwrap();
        assert_eq!((e.host.as_str(), e.port, e.prefix.as_str(), e.authority.as_str()), ("::1", 9000, "/api", "[::1]:9000"));
        assert_eq!(Endpoint::parse("http://example", None).unwrap().port, 80);
        for bad in ["https://x", "http://:80", "http://h:port", "http://[::1", "ftp://h"] {
            assert!(Endpoint::parse(bad, None).is_err(), "{bad}");
        }
    }

    #[test]
    fn progress_counts_content_chunks_and_usage() {
        let (mut p, t) = (Progress::default(), Instant::now());
        let role = r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#;
        assert!(!p.on_data(role, true, t).unwrap());
        assert!(p.first.is_none(), "an empty first delta is not a token");
        p.on_data(r#"{"choices":[{"delta":{"content":"Hi"}}]}"#, true, t + Duration::from_millis(5)).unwrap();
        p.on_data(r#"{"choices":[{"delta":{"content":" there"},"finish_reason":"length"}]}"#, true, t + Duration::from_millis(8)).unwrap();
        p.on_data(
            r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}"#,
            true,
            t,
        )
        .unwrap();
        assert!(p.on_data(" [DONE]", true, t).unwrap());
        assert_eq!(
            (p.chunks, p.itl_ms.clone(), p.prompt_tokens, p.cached_tokens, p.completion_tokens, p.finished, p.text.as_str()),
            (2, vec![3.0], Some(12), Some(8), Some(3), true, "Hi there")
        );
        // llama-server's own count of the prompt tokens its slot cache held.
        let mut q = Progress::default();
        q.on_data(r#"{"choices":[{"text":"a"}],"timings":{"cache_n":1000}}"#, false, t).unwrap();
        assert_eq!((q.cached_tokens, q.text.as_str()), (Some(1000), "a"));
        for bad in ["{", "[1,2]x", r#"{"error":{"message":"overloaded"}}"#] {
            assert!(p.on_data(bad, false, t).is_err());
        }
        // Odd but valid JSON is no failure and no token.
        for odd in ["null", "[]", r#"{"choices":7}"#, r#"{"choices":[{"text":5}],"usage":"x"}"#] {
            assert!(!p.on_data(odd, false, t).unwrap());
        }
        assert_eq!(p.chunks, 2);
    }
}

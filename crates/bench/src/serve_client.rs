//! The client side of `dgr bench serve`: just enough HTTP/1.1 to stream one response (a
//! chunked-transfer decoder and a server-sent-events parser, both bounded, every read under a
//! deadline) and one measured streamed completion request.

use crate::BenchError;
use serde_json::Value;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bounds on what a server may send: more than this is not the protocol being measured, and no
/// buffer grows past them whatever the server says.
const MAX_HEAD: usize = 64 << 10;
const MAX_SIZE_LINE: usize = 1024;
const MAX_TRAILERS: usize = 16 << 10;
const MAX_CHUNK: u64 = 16 << 20;
const MAX_SSE_LINE: usize = 1 << 20;
const MAX_ERROR_BODY: usize = 64 << 10;
const MAX_JSON_BODY: usize = 1 << 20;

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
        let rest = url.strip_prefix("http://").ok_or_else(|| BenchError::Usage(format!("{url}: only http:// URLs are supported")))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let bad = || BenchError::Usage(format!("{url}: expected http://HOST[:PORT][/PATH]"));
        let (host, port) = if let Some(r) = authority.strip_prefix('[') {
            let (h, after) = r.split_once(']').ok_or_else(bad)?;
            (h, if after.is_empty() { "80" } else { after.strip_prefix(':').ok_or_else(bad)? })
        } else {
            authority.rsplit_once(':').unwrap_or((authority, "80"))
        };
        let port = port.parse().map_err(|_| bad())?;
        if host.is_empty() {
            return Err(bad());
        }
        let path = path.trim_end_matches('/');
        let prefix = path.strip_suffix("/v1").unwrap_or(path).to_string();
        Ok(Endpoint { host: host.into(), port, authority: authority.into(), prefix, api_key: api_key.filter(|k| !k.is_empty()) })
    }
}

/// Decodes `Transfer-Encoding: chunked` incrementally, from input split anywhere.
#[derive(Default)]
pub struct Chunked {
    state: ChunkState,
    line: Vec<u8>,
    trailer_bytes: usize,
}

#[derive(Default, Clone, Copy, PartialEq, Debug)]
enum ChunkState {
    #[default]
    Size,
    Data(u64),
    DataEnd,
    Trailer,
    Done,
}

/// Moves input up to the next '\n' into `line` (without it); returns the bytes consumed and
/// whether the line is complete. Fails rather than let `line` pass `cap`.
fn take_line(line: &mut Vec<u8>, input: &[u8], cap: usize) -> Result<(usize, bool), String> {
    let (piece, complete) = match input.iter().position(|&b| b == b'\n') {
        Some(i) => (&input[..i], true),
        None => (input, false),
    };
    if line.len() + piece.len() > cap {
        return Err(format!("line longer than {cap} bytes"));
    }
    line.extend_from_slice(piece);
    Ok((piece.len() + complete as usize, complete))
}

fn without_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

fn parse_chunk_size(line: &[u8]) -> Result<u64, String> {
    let line = without_cr(line);
    let digits = line.split(|&b| b == b';').next().unwrap_or_default();
    let digits = digits.strip_suffix(b" ").unwrap_or(digits); // some servers pad the size
    let bad = || format!("bad chunk size line {:?}", String::from_utf8_lossy(&line[..line.len().min(40)]));
    if digits.is_empty() || digits.len() > 16 || !digits.iter().all(u8::is_ascii_hexdigit) {
        return Err(bad());
    }
    let size = u64::from_str_radix(std::str::from_utf8(digits).map_err(|_| bad())?, 16).map_err(|_| bad())?;
    if size > MAX_CHUNK {
        return Err(format!("chunk of {size} bytes is over the {MAX_CHUNK}-byte limit"));
    }
    Ok(size)
}

impl Chunked {
    pub fn is_done(&self) -> bool {
        self.state == ChunkState::Done
    }

    /// Appends the body bytes in `input` to `out`. Anything after the last chunk is ignored.
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        while !input.is_empty() {
            match self.state {
                ChunkState::Size => {
                    let (n, complete) = take_line(&mut self.line, input, MAX_SIZE_LINE)?;
                    input = &input[n..];
                    if complete {
                        let size = parse_chunk_size(&self.line)?;
                        self.line.clear();
                        self.state = if size == 0 { ChunkState::Trailer } else { ChunkState::Data(size) };
                    }
                }
                ChunkState::Data(left) => {
                    let n = left.min(input.len() as u64) as usize;
                    out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    self.state = if left == n as u64 { ChunkState::DataEnd } else { ChunkState::Data(left - n as u64) };
                }
                ChunkState::DataEnd => {
                    // Only "\r\n" (or a bare "\n") may follow a chunk's data.
                    let (n, complete) = take_line(&mut self.line, input, 1).map_err(|_| "no CRLF after chunk data".to_string())?;
                    input = &input[n..];
                    if self.line.first().is_some_and(|&b| b != b'\r') {
                        return Err("no CRLF after chunk data".into());
                    }
                    if complete {
                        self.line.clear();
                        self.state = ChunkState::Size;
                    }
                }
                ChunkState::Trailer => {
                    let (n, complete) = take_line(&mut self.line, input, MAX_SIZE_LINE)?;
                    input = &input[n..];
                    self.trailer_bytes += n;
                    if self.trailer_bytes > MAX_TRAILERS {
                        return Err("trailers too long".into());
                    }
                    if complete {
                        let empty = without_cr(&self.line).is_empty();
                        self.line.clear();
                        if empty {
                            self.state = ChunkState::Done;
                        }
                    }
                }
                ChunkState::Done => return Ok(()),
            }
        }
        Ok(())
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

enum Framing {
    Chunked(Chunked),
    Length(u64),
    Close,
}

/// A response whose head has been read; its body is read piece by piece.
pub struct Response {
    pub status: u16,
    stream: TcpStream,
    buf: Vec<u8>,
    framing: Framing,
    done: bool,
}

fn find_head_end(buf: &[u8]) -> Option<(usize, usize)> {
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, i + 4));
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, i + 2));
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

fn parse_head(head: &[u8]) -> Result<(u16, Framing), Failure> {
    let text = String::from_utf8_lossy(head);
    let mut lines = text.lines();
    let status_line = lines.next().unwrap_or_default();
    let bad = || Failure::Protocol(format!("bad status line {:?}", &status_line.chars().take(60).collect::<String>()));
    let mut parts = status_line.split_whitespace();
    if !parts.next().is_some_and(|v| v.starts_with("HTTP/1.")) {
        return Err(bad());
    }
    let status: u16 = parts.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let mut framing = Framing::Close;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        if name == "transfer-encoding" && value.rsplit(',').next().is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked")) {
            framing = Framing::Chunked(Chunked::default());
        } else if name == "content-length" && !matches!(framing, Framing::Chunked(_)) {
            framing = Framing::Length(value.parse().map_err(|_| Failure::Protocol(format!("bad content-length {value:?}")))?);
        }
    }
    Ok((status, framing))
}

async fn read_some(stream: &mut TcpStream, deadline: Instant, buf: &mut Vec<u8>) -> Result<usize, Failure> {
    let mut tmp = [0u8; 16 << 10];
    let read = tokio::time::timeout_at(deadline.into(), stream.read(&mut tmp)).await.map_err(|_| Failure::Timeout)?;
    let n = read.map_err(|e| Failure::Broken(e.to_string()))?;
    buf.extend_from_slice(&tmp[..n]);
    Ok(n)
}

/// Sends one request (`Connection: close`, so each request has its own connection, as a
/// client without a pool would) and reads the response head.
pub async fn send(ep: &Endpoint, method: &str, path: &str, body: Option<&[u8]>, deadline: Instant) -> Result<Response, Failure> {
    let connect = TcpStream::connect((ep.host.as_str(), ep.port));
    let mut stream = tokio::time::timeout_at(deadline.into(), connect)
        .await
        .map_err(|_| Failure::Timeout)?
        .map_err(|e| Failure::Connect(format!("{}:{}: {e}", ep.host, ep.port)))?;
    stream.set_nodelay(true).ok();
    let mut req = format!("{method} {}{path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n", ep.prefix, ep.authority);
    req += "Accept: application/json, text/event-stream\r\n";
    if let Some(k) = &ep.api_key {
        req += &format!("Authorization: Bearer {k}\r\n");
    }
    if let Some(b) = body {
        req += &format!("Content-Type: application/json\r\nContent-Length: {}\r\n", b.len());
    }
    let mut bytes = (req + "\r\n").into_bytes();
    bytes.extend_from_slice(body.unwrap_or_default());
    let write = tokio::time::timeout_at(deadline.into(), stream.write_all(&bytes)).await.map_err(|_| Failure::Timeout)?;
    write.map_err(|e| Failure::Broken(format!("sending the request: {e}")))?;

    let mut buf = Vec::new();
    let (head_len, body_start) = loop {
        if let Some(end) = find_head_end(&buf) {
            break end;
        }
        if buf.len() > MAX_HEAD {
            return Err(Failure::Protocol(format!("response head longer than {MAX_HEAD} bytes")));
        }
        if read_some(&mut stream, deadline, &mut buf).await? == 0 {
            return Err(Failure::Broken("connection closed before the response head".into()));
        }
    };
    let (status, framing) = parse_head(&buf[..head_len])?;
    buf.drain(..body_start);
    let done = matches!(framing, Framing::Length(0));
    Ok(Response { status, stream, buf, framing, done })
}

impl Response {
    /// The next piece of the body, or None at its end.
    pub async fn next(&mut self, deadline: Instant) -> Result<Option<Vec<u8>>, Failure> {
        loop {
            if self.done {
                return Ok(None);
            }
            if !self.buf.is_empty() {
                let input = std::mem::take(&mut self.buf);
                let piece = match &mut self.framing {
                    Framing::Chunked(d) => {
                        let mut out = Vec::new();
                        d.feed(&input, &mut out).map_err(Failure::Protocol)?;
                        self.done = d.is_done();
                        out
                    }
                    Framing::Length(left) => {
                        let n = (*left).min(input.len() as u64) as usize;
                        *left -= n as u64;
                        self.done = *left == 0;
                        input[..n].to_vec()
                    }
                    Framing::Close => input,
                };
                if !piece.is_empty() {
                    return Ok(Some(piece));
                }
                continue;
            }
            if read_some(&mut self.stream, deadline, &mut self.buf).await? == 0 {
                if matches!(self.framing, Framing::Close) {
                    self.done = true;
                    return Ok(None);
                }
                return Err(Failure::Broken("connection closed in the middle of the body".into()));
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
    pub completion_tokens: u64,
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
    completion_tokens: Option<u64>,
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
            if text.is_some_and(|t| !t.is_empty()) {
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
        }
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
        completion_tokens: p.completion_tokens.unwrap_or(p.chunks as u64),
        tokens_from_usage: p.completion_tokens.is_some(),
        error: result.err().map(|f| SampleError { kind: f.kind(), message: f.message() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &[u8] = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n";

    fn chunked(body: &[u8], sizes: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut rest = body;
        for &s in sizes.iter().chain(std::iter::repeat(&7)) {
            if rest.is_empty() {
                break;
            }
            let (c, r) = rest.split_at(s.min(rest.len()));
            out.extend_from_slice(format!("{:x};ext=1\r\n", c.len()).as_bytes());
            out.extend_from_slice(c);
            out.extend_from_slice(b"\r\n");
            rest = r;
        }
        out.extend_from_slice(b"0\r\nX-Trailer: 1\r\n\r\nleftover ignored");
        out
    }

    fn decode_split(wire: &[u8], at: &[usize]) -> Result<(Vec<u8>, bool), String> {
        let (mut d, mut out, mut prev) = (Chunked::default(), Vec::new(), 0);
        for &i in at.iter().chain([wire.len()].iter()) {
            d.feed(&wire[prev..i], &mut out)?;
            prev = i;
        }
        Ok((out, d.is_done()))
    }

    #[test]
    fn chunked_decodes_at_every_split() {
        let wire = chunked(BODY, &[1, 3, 20]);
        for i in 0..=wire.len() {
            for j in i..=wire.len() {
                assert_eq!(decode_split(&wire, &[i, j]).unwrap(), (BODY.to_vec(), true), "split at {i},{j}");
            }
        }
        // One byte at a time, and bare LF line ends.
        let bytewise: Vec<usize> = (0..wire.len()).collect();
        assert_eq!(decode_split(&wire, &bytewise).unwrap().0, BODY);
        assert_eq!(decode_split(b"3\nabc\n0\n\n", &[]).unwrap(), (b"abc".to_vec(), true));
    }

    #[test]
    fn chunked_rejects_hostile_input() {
        for bad in [
            &b"ffffffffffffffffff\r\n"[..], // more than 16 hex digits
            b"1000001\r\n",                 // over the chunk cap
            b"zz\r\n",
            b"\r\n",
            b"-1\r\n",
            b" 5\r\n",
            b"3\r\nabcXY",    // no CRLF after the data
            b"3\r\nabc\rX\n", // CR then garbage
        ] {
            assert!(decode_split(bad, &[]).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        // A size line that never ends fails at the cap, without growing past it.
        let long = vec![b'1'; MAX_SIZE_LINE + 1];
        assert!(decode_split(&long, &[MAX_SIZE_LINE / 2]).is_err());
        // A trailer section that never ends.
        let mut t = b"0\r\n".to_vec();
        t.extend(std::iter::repeat_n(b"X: y\r\n".to_vec(), MAX_TRAILERS).flatten());
        assert!(decode_split(&t, &[]).is_err());
        // A huge declared chunk within the cap is streamed, not allocated up front.
        let (out, done) = decode_split(b"fffff\r\nabc", &[]).unwrap();
        assert_eq!((out, done), (b"abc".to_vec(), false));
    }

    #[test]
    fn chunked_survives_random_garbage() {
        const ALPHABET: &[u8] = b"0123456789abcdefXZ\r\n; ";
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
            let (mut d, mut out) = (Chunked::default(), Vec::new());
            let _ = d.feed(&bytes, &mut out);
            assert!(out.len() <= bytes.len());
            let mut events = Vec::new();
            let _ = Sse::default().feed(&bytes, &mut events);
        }
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
    fn heads_parse() {
        let (s, f) = parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, Chunked\r\nContent-Length: 5").unwrap();
        assert!(s == 200 && matches!(f, Framing::Chunked(_)));
        assert!(matches!(parse_head(b"HTTP/1.0 503 x\r\ncontent-length: 12").unwrap(), (503, Framing::Length(12))));
        assert!(matches!(parse_head(b"HTTP/1.1 200 OK").unwrap().1, Framing::Close));
        for bad in [&b"SSH-2.0 hi"[..], b"HTTP/1.1 abc", b"", b"HTTP/1.1 200\r\ncontent-length: -1"] {
            assert!(parse_head(bad).is_err());
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
        p.on_data(r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3}}"#, true, t).unwrap();
        assert!(p.on_data(" [DONE]", true, t).unwrap());
        assert_eq!((p.chunks, p.itl_ms.clone(), p.prompt_tokens, p.completion_tokens, p.finished), (2, vec![3.0], Some(12), Some(3), true));
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

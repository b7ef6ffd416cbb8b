//! Driving one session along a route: open it on every stage, prefill, decode token by token,
//! and close it — or fail with a structured error naming the stage, within a deadline.

use crate::draft::{DraftStats, Speculate};
use crate::links::{Event, Link, Links};
use crate::report::{quantile, Completion, FinishReason, SeamReport, StageReport, UsageReport};
use crate::{DriveError, FailKind, Route, SharedConstraint};
use dgr_proto::{
    Body, BoundarySchema, Embed, Forward, Frame, Hop, OpenSession, Ping, Pooling, Ring, Sampling, SeamDtype, SessionRef, SignedTicket,
    TokenOut, MAX_STOP_TOKENS, PREFIX_BLOCK, STAGE_UNKNOWN,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

pub struct GenRequest {
    pub prompt_tokens: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub top_logprobs: u32,
    pub seam_dtype: SeamDtype,
    /// A tracker's signed route and the session id it names; None on a ticketless route.
    pub ticket: Option<(SignedTicket, [u8; 16])>,
    /// Have every stage report a hash of each step's last output row (for spot checks).
    pub hash_rows: bool,
    /// A grammar the tokens must follow: its mask goes to the last stage with every step.
    pub constraint: Option<SharedConstraint>,
    /// Tokens that end the generation (the model's end-of-generation tokens): the route stops
    /// on them by itself. A generation the caller stops on others may run a step past them.
    pub stop_tokens: Vec<u32>,
}

/// A prompt to embed: its final hidden states pooled into one vector on the route's last stage.
pub struct EmbedRequest {
    pub prompt_tokens: Vec<u32>,
    /// `Pooling::Model`: as the model's metadata says.
    pub pooling: Pooling,
    pub seam_dtype: SeamDtype,
    /// A tracker's signed route and the session id it names; None on a ticketless route.
    pub ticket: Option<(SignedTicket, [u8; 16])>,
}

impl EmbedRequest {
    /// The session's request: the prompt and no tokens to generate.
    pub(crate) fn session(&self) -> GenRequest {
        GenRequest {
            prompt_tokens: self.prompt_tokens.clone(),
            max_tokens: 0,
            sampling: Sampling::default(),
            top_logprobs: 0,
            seam_dtype: self.seam_dtype,
            ticket: self.ticket.clone(),
            hash_rows: false,
            constraint: None,
            stop_tokens: Vec::new(),
        }
    }

    pub(crate) fn embed(&self) -> Embed {
        Embed { pooling: self.pooling as i32 }
    }
}

#[derive(Clone, Debug)]
pub struct DriveOptions {
    /// Longest wait for any one step (the first token, or each next one).
    pub step_timeout: Duration,
    /// A route quiet this long is pinged; a stage that does not answer within `probe_wait` is
    /// silent.
    pub probe_after: Duration,
    pub probe_wait: Duration,
    pub connect_timeout: Duration,
    pub max_frame: usize,
    /// Draft tokens a decode step may carry (prompt lookup on the route's first stage, verified
    /// by the route). Requests under a grammar or spot-checked run one token a step.
    pub speculate: Speculate,
}

impl Default for DriveOptions {
    fn default() -> Self {
        DriveOptions {
            step_timeout: Duration::from_secs(5),
            probe_after: Duration::from_millis(500),
            probe_wait: Duration::from_millis(500),
            connect_timeout: Duration::from_secs(5),
            max_frame: dgr_proto::DEFAULT_MAX_FRAME,
            speculate: Speculate::DEFAULT,
        }
    }
}

/// What the caller wants after seeing a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// This token ends the generation (an end-of-generation token): finish with "stop".
    Stop,
    /// Stop now and free the session on every stage: finish with "cancelled".
    Cancel,
}

struct Session<'r> {
    route: &'r Route,
    id: [u8; 16],
    links: Vec<Arc<Link>>,
    events: mpsc::UnboundedReceiver<Event>,
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        for l in &self.links {
            l.unsubscribe(&self.id);
        }
    }
}

impl Session<'_> {
    fn err(&self, kind: FailKind, stage: u32, message: impl Into<String>) -> DriveError {
        let addr = self.route.stages.get(stage as usize).map(|s| s.addr.as_str());
        DriveError::new(kind, Some(stage), addr, message)
    }

    async fn send(&mut self, stage: u32, body: Body) -> Result<(), DriveError> {
        let r = self.links[stage as usize].send(&Frame::new(body)).await;
        r.map_err(|e| self.err(FailKind::ConnectionLost, stage, e))
    }

    /// The next event, turned into an error unless it is a frame this session expects. While
    /// the route is quiet for `probe_after`, every stage is pinged; one that does not answer
    /// within `probe_wait` is reported silent (a stopped process), long before `timeout`. The
    /// deadline measures progress: each `Progress` of the session (a prompt chunk through the
    /// whole route) restarts it, so a long prefill is given `timeout` per chunk, not in all.
    async fn next(&mut self, timeout: Duration, opts: &DriveOptions) -> Result<(u32, Body), DriveError> {
        let mut deadline = tokio::time::Instant::now() + timeout;
        let mut probe: Option<(tokio::time::Instant, Vec<bool>)> = None;
        loop {
            let wake = match &probe {
                None => tokio::time::Instant::now() + opts.probe_after,
                Some((sent, _)) => *sent + opts.probe_wait,
            };
            let event = match tokio::time::timeout_at(wake.min(deadline), self.events.recv()).await {
                Ok(ev) => ev,
                Err(_) if tokio::time::Instant::now() >= deadline => {
                    let msg = format!("the route made no progress within {timeout:?}");
                    return Err(DriveError::new(FailKind::Timeout, None, None, msg));
                }
                Err(_) => match probe.take() {
                    None => {
                        for i in 0..self.links.len() as u32 {
                            self.send(i, Body::Ping(Ping { nonce: 0 })).await?;
                        }
                        probe = Some((tokio::time::Instant::now(), vec![false; self.links.len()]));
                        continue;
                    }
                    Some((_, answered)) => match answered.iter().position(|a| !a) {
                        Some(i) => {
                            let msg = format!("no answer to a ping within {:?}: the worker is stopped or unreachable", opts.probe_wait);
                            return Err(self.err(FailKind::Silent, i as u32, msg));
                        }
                        // Every stage is there, only busy: keep waiting.
                        None => continue,
                    },
                },
            };
            match event {
                None => return Err(DriveError::new(FailKind::ConnectionLost, None, None, "every connection closed")),
                Some(Event::Lost(stage, kind, why)) => return Err(self.err(kind, stage, why)),
                Some(Event::Frame(stage, Body::Pong(_))) => {
                    if let Some(a) = probe.as_mut().and_then(|(_, answered)| answered.get_mut(stage as usize)) {
                        *a = true;
                    }
                }
                Some(Event::Frame(_, Body::Ping(_))) => {}
                Some(Event::Frame(_, Body::Progress(_))) => deadline = tokio::time::Instant::now() + timeout,
                Some(Event::Frame(stage, Body::Error(e))) => {
                    let at = if e.stage == STAGE_UNKNOWN { stage } else { e.stage };
                    return Err(self.err(FailKind::Worker(e.error_kind()), at, e.message));
                }
                Some(Event::Frame(stage, body)) => return Ok((stage, body)),
            }
        }
    }

    /// Tells every stage to free the session (best effort: a dead stage frees it by dying); a
    /// close names the blocks of `sequence` (prompt and generated tokens) for the stages to cache.
    async fn finish(&mut self, cancel: bool, sequence: &[u32]) {
        let prefix_blocks = if cancel { Vec::new() } else { dgr_proto::prefix_chain_bytes(sequence) };
        // Every token but the last was fed: the stages hold those positions (and maybe a last
        // step's rejected drafts past them, which they drop).
        let positions = sequence.len().saturating_sub(1) as u64;
        let r = SessionRef { session_id: self.id.to_vec(), prefix_blocks, positions, ..Default::default() };
        for l in &self.links {
            let body = if cancel { Body::Cancel(r.clone()) } else { Body::Close(r.clone()) };
            let _ = l.send(&Frame::new(body)).await;
        }
    }

    /// Each stage's usage report for the session, in route order, waiting at most `timeout`.
    async fn usage(&mut self, timeout: Duration) -> Vec<UsageReport> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut got: Vec<UsageReport> = Vec::new();
        while got.len() < self.links.len() {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(Event::Frame(stage, Body::Usage(u)))) if u.session_id == self.id => got.push(UsageReport {
                    stage,
                    tokens_prefilled: u.tokens_prefilled,
                    tokens_decoded: u.tokens_decoded,
                    layer_tokens: u.layer_tokens,
                }),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        got.sort_by_key(|u| u.stage);
        got
    }
}

/// Generates along `route` on connections of its own. `on_token` sees every token as it arrives
/// and may cancel.
pub async fn generate(
    route: &Route,
    req: &GenRequest,
    opts: &DriveOptions,
    on_token: impl FnMut(&TokenOut) -> Flow,
) -> Result<Completion, DriveError> {
    generate_on(&Links::new(), route, req, opts, on_token).await
}

/// Generates along `route` over `links`, the driver's warm connections.
pub async fn generate_on(
    links: &Links,
    route: &Route,
    req: &GenRequest,
    opts: &DriveOptions,
    on_token: impl FnMut(&TokenOut) -> Flow,
) -> Result<Completion, DriveError> {
    run_session(links, route, req, None, opts, on_token).await
}

/// Embeds `req`'s prompt along `route` over `links`: the completion's `embedding` holds the
/// vector (no tokens). The prompt runs as any prefill does, chunked and batched by the workers.
pub async fn embed_on(links: &Links, route: &Route, req: &EmbedRequest, opts: &DriveOptions) -> Result<Completion, DriveError> {
    run_session(links, route, &req.session(), Some(req.embed()), opts, |_| Flow::Continue).await
}

/// One session along `route`: a generation, or with `embed` an embedding of the prompt.
pub(crate) async fn run_session(
    links: &Links,
    route: &Route,
    req: &GenRequest,
    embed: Option<Embed>,
    opts: &DriveOptions,
    mut on_token: impl FnMut(&TokenOut) -> Flow,
) -> Result<Completion, DriveError> {
    if req.prompt_tokens.is_empty() || (req.max_tokens == 0 && embed.is_none()) {
        return Err(DriveError::new(FailKind::BadRequest, None, None, "need a non-empty prompt and max_tokens ≥ 1"));
    }
    let id = match &req.ticket {
        Some((_, id)) => *id,
        None => {
            let mut id = [0u8; 16];
            getrandom::fill(&mut id).map_err(|e| DriveError::new(FailKind::Internal, None, None, e.to_string()))?;
            id
        }
    };
    let n = route.stages.len() as u32;
    let connects = route.stages.iter().enumerate().map(|(i, s)| links.get(&s.addr, i as u32, opts.connect_timeout, opts.max_frame));
    let (tx, events) = mpsc::unbounded_channel();
    let mut linked = Vec::new();
    for (i, r) in futures::future::join_all(connects).await.into_iter().enumerate() {
        let link = r?;
        let info = &link.info;
        // The route may run any part of the layers the worker holds.
        let want = &route.stages[i].info;
        if info.model_id != want.model_id || want.layer_start < info.layer_start || want.layer_end > info.layer_end {
            return Err(DriveError::new(
                FailKind::Route,
                Some(i as u32),
                Some(&route.stages[i].addr),
                "the worker changed since the route was planned",
            ));
        }
        // A tracker's route names each stage by its key: the worker at that address must have
        // proven that key in the secure channel's handshake (a plaintext link proves none). A
        // ticketless route's stages are known by the keys pinned or first seen at their addresses.
        let (named, addr) = (&route.stages[i].worker_id, &route.stages[i].addr);
        if let Some(peer) = &link.peer {
            let checked = match named.is_empty() {
                true => dgr_proto::check_peer(addr, peer),
                false if peer != named => Err(format!("the worker there proved key {peer}, the route names {named}")),
                false => Ok(()),
            };
            checked.map_err(|msg| DriveError::new(FailKind::WrongPeer, Some(i as u32), Some(addr), msg))?;
        }
        link.subscribe(id, i as u32, tx.clone());
        linked.push(link);
    }
    drop(tx);
    let mut s = Session { route, id, links: linked, events };
    let mut generated = 0;
    let mut result = drive(&mut s, req, embed, opts, n, &mut generated, &mut on_token).await;
    let sequence: Vec<u32> = match &result {
        Ok(c) if embed.is_none() => req.prompt_tokens.iter().chain(&c.tokens).copied().collect(),
        _ => Vec::new(),
    };
    s.finish(!matches!(&result, Ok(c) if c.finish_reason != FinishReason::Cancelled), &sequence).await;
    match &mut result {
        Ok(c) => c.usage = s.usage(opts.connect_timeout).await,
        // A ledger wants what the surviving stages computed; they answer at once or never.
        Err(e) if req.ticket.is_some() => {
            e.generated = generated;
            e.usage = s.usage(FAILED_USAGE_WAIT).await;
        }
        Err(_) => {}
    }
    result
}

/// How long a failed session waits for the surviving stages' usage reports.
const FAILED_USAGE_WAIT: Duration = Duration::from_millis(300);

async fn drive(
    s: &mut Session<'_>,
    req: &GenRequest,
    embed: Option<Embed>,
    opts: &DriveOptions,
    n: u32,
    generated: &mut usize,
    on_token: &mut impl FnMut(&TokenOut) -> Flow,
) -> Result<Completion, DriveError> {
    let max_positions = (req.prompt_tokens.len() + req.max_tokens) as u64;
    // An embedding pools every prompt row, so it computes them all: it names no prefix.
    let prefix_blocks = if embed.is_some() { Vec::new() } else { dgr_proto::prefix_chain_bytes(&req.prompt_tokens) };
    // The steps go round the route by themselves, unless the driver must see each token before
    // the next step: a grammar's mask, a spot check's row hashes.
    let ring = embed.is_none() && req.constraint.is_none() && !req.hash_rows;
    for i in 0..n {
        let info = &s.route.stages[i as usize].info;
        let open = OpenSession {
            session_id: s.id.to_vec(),
            schema: Some(BoundarySchema {
                protocol_version: dgr_proto::PROTOCOL_VERSION,
                model_id: info.model_id.clone(),
                layer_start: info.layer_start,
                layer_end: info.layer_end,
                hidden: info.hidden,
                seam_dtype: req.seam_dtype as i32,
                engine: info.engine.clone(),
            }),
            stage_index: i,
            n_stages: n,
            next: s.route.stages.get(i as usize + 1).map(|x| x.addr.clone()).unwrap_or_default(),
            sampling: Some(req.sampling),
            top_logprobs: req.top_logprobs,
            max_positions,
            ticket: req.ticket.as_ref().map(|(t, _)| t.clone()),
            hash_rows: req.hash_rows,
            embed,
            prefix_blocks: prefix_blocks.clone(),
            ring: ring.then(|| ring_part(s.route, req, opts, i)).flatten(),
        };
        s.send(i, Body::Open(open)).await?;
    }
    // The prefill starts past the blocks every stage holds, leaving at least one prompt token
    // to compute (its row gives the first token's logits).
    let mut cached = (req.prompt_tokens.len() - 1) / PREFIX_BLOCK;
    let mut opened = 0;
    while opened < n {
        match s.next(opts.connect_timeout, opts).await? {
            (_, Body::Opened(r)) => {
                cached = cached.min(r.cached_blocks as usize);
                opened += 1;
            }
            (stage, _) => return Err(s.err(FailKind::Protocol, stage, "expected Opened")),
        }
    }
    if embed.is_some() {
        return drive_embedding(s, req, opts).await;
    }
    let start = Instant::now();
    let cached_tokens = cached * PREFIX_BLOCK;
    let mut out = Completion { finish_reason: FinishReason::Length, cached_tokens, ..Default::default() };
    let mut traces: Vec<Vec<Hop>> = Vec::new();
    let mut position = cached_tokens as u64;
    let mut input = req.prompt_tokens[cached_tokens..].to_vec();
    let mut decode_start = start;
    // The position of the next token to arrive.
    let mut expect = req.prompt_tokens.len() as u64;
    'steps: loop {
        // A ring's steps after its first go round the route without the driver.
        if !ring || out.tokens.is_empty() {
            let allowed = match constrain(req, |c| c.allowed())? {
                Some(Some(mask)) => mask,
                None => Vec::new(),
                // The grammar is complete: the generation ends here.
                Some(None) => {
                    out.finish_reason = FinishReason::Stop;
                    break;
                }
            };
            let tokens = std::mem::take(&mut input);
            let f = Forward { session_id: s.id.to_vec(), position, tokens, sample: true, allowed, ..Default::default() };
            s.send(0, Body::Forward(f)).await?;
        }
        let mut t = match s.next(opts.step_timeout, opts).await? {
            (_, Body::Token(t)) if t.session_id == s.id => t,
            (stage, _) => return Err(s.err(FailKind::Protocol, stage, "unexpected frame while waiting for a token")),
        };
        let last = s.route.stages.len() as u32 - 1;
        let steps = accepted(&mut t, expect, ring).map_err(|m| s.err(FailKind::Protocol, last, m))?;
        if t.drafted > 0 {
            out.drafts.add(&DraftStats { steps: 1, drafted: t.drafted as u64, accepted: steps.len() as u64 - 1 });
        }
        if out.tokens.is_empty() {
            out.timings.first_token(start, req.prompt_tokens.len());
            decode_start = Instant::now();
        }
        traces.push(t.trace.clone());
        for step in steps {
            constrain(req, |c| c.advance(step.token))?;
            out.tokens.push(step.token);
            *generated = out.tokens.len();
            out.logprobs.push(step.logprob);
            out.top_logprobs.push(step.top.iter().map(|e| (e.id, e.logprob)).collect());
            // The next step starts with this token, at its position.
            position = step.position;
            expect = step.position + 1;
            input = vec![step.token];
            match on_token(&step) {
                Flow::Cancel => {
                    out.finish_reason = FinishReason::Cancelled;
                    break 'steps;
                }
                Flow::Stop => {
                    out.finish_reason = FinishReason::Stop;
                    break 'steps;
                }
                Flow::Continue => {}
            }
            if out.tokens.len() >= req.max_tokens {
                break 'steps;
            }
        }
    }
    out.timings.decoded(decode_start, out.tokens.len().saturating_sub(1));
    report(s.route, &traces, &mut out);
    Ok(out)
}

/// Stage `i`'s part in a ring session (`Ring`): the first drafts, the last sends round.
fn ring_part(route: &Route, req: &GenRequest, opts: &DriveOptions, i: u32) -> Option<Ring> {
    let (first, last) = (i == 0, i as usize + 1 == route.stages.len());
    (first || last).then(|| Ring {
        to: if last && !first { route.stages[0].addr.clone() } else { String::new() },
        // More stop tokens than a ring takes only cost a step past the last one named.
        stop: if last { req.stop_tokens.iter().take(MAX_STOP_TOKENS).copied().collect() } else { Vec::new() },
        speculate: if first { opts.speculate.max() as u32 } else { 0 },
        prompt: if first { req.prompt_tokens.clone() } else { Vec::new() },
    })
}

/// The tokens of a step whose first token takes position `first`, each as a `TokenOut` of its
/// own (the step's trace on the first), checked: one token, or on a ring the accepted drafts
/// and one more, at consecutive positions.
fn accepted(t: &mut TokenOut, first: u64, ring: bool) -> Result<Vec<TokenOut>, String> {
    let more = std::mem::take(&mut t.more);
    let n = more.len() + 1;
    let one = |position, token, logprob, top, trace| TokenOut {
        session_id: t.session_id.clone(),
        position,
        token,
        logprob,
        top,
        trace,
        more: Vec::new(),
        drafted: 0,
    };
    let mut steps = vec![one(t.position, t.token, t.logprob, std::mem::take(&mut t.top), t.trace.clone())];
    steps.extend(more.into_iter().map(|m| one(m.position, m.token, m.logprob, m.top, Vec::new())));
    let in_place = steps.iter().enumerate().all(|(i, s)| s.position == first + i as u64);
    let drafted = t.drafted as usize;
    if (drafted > 0 && !ring) || drafted > dgr_proto::MAX_DRAFT || n > drafted + 1 || !in_place {
        return Err(format!("a step of {drafted} drafts answered with {n} tokens at positions that do not follow {first}"));
    }
    Ok(steps)
}

/// Sends the prompt of an open embedding session and waits for its vector, checked: the model's
/// hidden size of finite values, one per prompt position pooled.
async fn drive_embedding(s: &mut Session<'_>, req: &GenRequest, opts: &DriveOptions) -> Result<Completion, DriveError> {
    let start = Instant::now();
    let f = Forward { session_id: s.id.to_vec(), tokens: req.prompt_tokens.clone(), sample: true, ..Default::default() };
    s.send(0, Body::Forward(f)).await?;
    let (stage, e) = match s.next(opts.step_timeout, opts).await? {
        (stage, Body::Embedding(e)) if e.session_id == s.id => (stage, e),
        (stage, _) => return Err(s.err(FailKind::Protocol, stage, "unexpected frame while waiting for the embedding")),
    };
    let hidden = s.route.stages.last().map_or(0, |x| x.info.hidden as usize);
    if e.values.len() != 4 * hidden || e.n_tokens != req.prompt_tokens.len() as u64 {
        let msg = format!(
            "an embedding of {} bytes over {} positions, not {hidden} floats over {}",
            e.values.len(),
            e.n_tokens,
            req.prompt_tokens.len()
        );
        return Err(s.err(FailKind::Protocol, stage, msg));
    }
    let values: Vec<f32> = e.values.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    if values.iter().any(|v| !v.is_finite()) {
        return Err(s.err(FailKind::Protocol, stage, "an embedding holding a NaN or an infinity"));
    }
    let mut out = Completion { finish_reason: FinishReason::Stop, embedding: values, ..Default::default() };
    out.timings.first_token(start, req.prompt_tokens.len());
    report(s.route, &[e.trace], &mut out);
    Ok(out)
}

/// Calls the request's constraint, if it has one; its refusal is the request's fault.
fn constrain<T>(req: &GenRequest, f: impl FnOnce(&mut dyn crate::Constraint) -> Result<T, String>) -> Result<Option<T>, DriveError> {
    let Some(c) = &req.constraint else { return Ok(None) };
    let mut c = c.lock().unwrap_or_else(|p| p.into_inner());
    f(&mut *c).map(Some).map_err(|e| DriveError::new(FailKind::BadRequest, None, None, format!("the grammar: {e}")))
}

/// Per seam bytes and latency, per stage queue wait and compute, from the steps' traces. A step
/// whose prompt ran in chunks holds several hops per stage: all count for bytes and compute;
/// latency pairs a stage's hop with the next stage's only where each stage has exactly one.
fn report(route: &Route, traces: &[Vec<Hop>], out: &mut Completion) {
    let n = route.stages.len() as u32;
    let of = |t: &[Hop], i: u32| t.iter().filter(|h| h.stage == i).copied().collect::<Vec<Hop>>();
    for i in 0..n {
        let hops: Vec<Hop> = traces.iter().flat_map(|t| of(t, i)).collect();
        let queue: Vec<f64> = hops.iter().map(|h| h.queue_us as f64 / 1e3).collect();
        out.stages.push(StageReport {
            stage: i,
            addr: route.stages[i as usize].addr.clone(),
            queue_wait_ms_p50: quantile(&queue, 0.5),
            queue_wait_ms_max: queue.iter().cloned().fold(0.0, f64::max),
            compute_ms_total: hops.iter().map(|h| h.compute_us as f64 / 1e3).sum(),
        });
        if i + 1 < n {
            let bytes = hops.iter().map(|h| h.bytes_out).sum();
            let lat: Vec<f64> = traces
                .iter()
                .filter_map(|t| match (of(t, i).as_slice(), of(t, i + 1).as_slice()) {
                    ([a], [b]) => Some(b.recv_unix_us.saturating_sub(a.sent_unix_us) as f64 / 1e3),
                    _ => None,
                })
                .collect();
            out.seams.push(SeamReport { from: i, bytes, latency_ms_p50: quantile(&lat, 0.5), latency_ms_p99: quantile(&lat, 0.99) });
        }
    }
}

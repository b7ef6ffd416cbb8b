//! Recovery by replay. A session's tokens so far are its whole state, and sampling depends only
//! on (seed, position), so when a stage fails (its connection drops, it goes silent, it refuses)
//! the driver asks for a route that avoids the failed worker, replays the prompt and the tokens
//! generated so far as a prefill on it, and goes on: the client's stream is the same token for
//! token as without the fault.

use crate::driver::run_session;
use crate::{Completion, DriveError, DriveOptions, EmbedRequest, FailKind, Flow, GenRequest, Links, Route, UsageReport};
use dgr_proto::{Embed, ErrorKind, SignedTicket, TokenOut};
use serde::Serialize;
use std::future::Future;
use std::time::Instant;

/// One session of a request: its route, its id, and what its stages reported computing.
#[derive(Clone, Debug)]
pub struct Attempt {
    pub route: Route,
    pub session: [u8; 16],
    pub usage: Vec<UsageReport>,
}

/// A failure the request got past.
#[derive(Clone, Debug, Serialize)]
pub struct Recovery {
    pub kind: FailKind,
    pub stage: Option<u32>,
    pub addr: Option<String>,
    pub worker_id: Option<String>,
    /// Tokens already delivered when it failed (replayed as a prefill).
    pub at_token: usize,
    /// From the failure's detection to the replacement route's first token (an embedding's: its
    /// vector); None while no replacement has delivered one (it failed too, or the request
    /// ended first).
    pub stall_ms: Option<f64>,
    #[serde(skip)]
    detected: Instant,
}

pub struct Recovered {
    pub result: Result<Completion, DriveError>,
    pub attempts: Vec<Attempt>,
    pub recoveries: Vec<Recovery>,
}

/// Failures a fresh route gets past: the stage is gone (its GPU lost, too), silent, will not take
/// the session, or is not the worker the route names.
fn recoverable(e: &DriveError) -> bool {
    e.kind.is_overloaded()
        || matches!(
            e.kind,
            FailKind::ConnectionLost
                | FailKind::ConnectFailed
                | FailKind::Silent
                | FailKind::Timeout
                | FailKind::WrongPeer
                | FailKind::Worker(ErrorKind::NextStage | ErrorKind::ShuttingDown | ErrorKind::DeviceLost)
        )
}

/// A route and the ticket for one session on it.
pub type Ticketed = (Route, Option<(SignedTicket, [u8; 16])>);

/// Generates along `first`, recovering from up to `max_replays` stage failures with routes from
/// `replan(workers to avoid, token budget)`.
pub async fn generate_recovering<F, Fut>(
    links: &Links,
    first: Ticketed,
    req: &GenRequest,
    opts: &DriveOptions,
    on_token: impl FnMut(&TokenOut) -> Flow,
    replan: F,
    max_replays: usize,
) -> Recovered
where
    F: FnMut(Vec<String>, u64, String) -> Fut,
    Fut: Future<Output = Result<Ticketed, DriveError>>,
{
    recovering(links, first, req, None, opts, on_token, replan, max_replays).await
}

/// Embeds `req`'s prompt along `first`, recovering as a generation does: a failed stage's
/// replacement route prefills the prompt again. The completion's `embedding` holds the vector.
pub async fn embed_recovering<F, Fut>(
    links: &Links,
    first: Ticketed,
    req: &EmbedRequest,
    opts: &DriveOptions,
    replan: F,
    max_replays: usize,
) -> Recovered
where
    F: FnMut(Vec<String>, u64, String) -> Fut,
    Fut: Future<Output = Result<Ticketed, DriveError>>,
{
    recovering(links, first, &req.session(), Some(req.embed()), opts, |_| Flow::Continue, replan, max_replays).await
}

#[allow(clippy::too_many_arguments)]
async fn recovering<F, Fut>(
    links: &Links,
    first: Ticketed,
    req: &GenRequest,
    embed: Option<Embed>,
    opts: &DriveOptions,
    mut on_token: impl FnMut(&TokenOut) -> Flow,
    mut replan: F,
    max_replays: usize,
) -> Recovered
where
    F: FnMut(Vec<String>, u64, String) -> Fut,
    Fut: Future<Output = Result<Ticketed, DriveError>>,
{
    let started = Instant::now();
    let mut merged = Completion::default();
    let mut first_token: Option<Instant> = None;
    let (mut attempts, mut recoveries) = (Vec::new(), Vec::<Recovery>::new());
    let mut exclude: Vec<String> = Vec::new();
    let (mut route, mut ticket) = first;
    // A replay computes each layer on the engine that computed it first: another engine
    // computes other bits.
    let engine = route.engine();
    loop {
        let session = ticket.as_ref().map(|(_, id)| *id).unwrap_or_default();
        let mut prompt = req.prompt_tokens.clone();
        prompt.extend_from_slice(&merged.tokens);
        let sub = GenRequest {
            prompt_tokens: prompt,
            max_tokens: req.max_tokens - merged.tokens.len(),
            sampling: req.sampling,
            top_logprobs: req.top_logprobs,
            seam_dtype: req.seam_dtype,
            ticket: ticket.take(),
            hash_rows: req.hash_rows,
            constraint: req.constraint.clone(),
            stop_tokens: req.stop_tokens.clone(),
        };
        let result = run_session(links, &route, &sub, embed, opts, |t| {
            let now = Instant::now();
            first_token.get_or_insert(now);
            if let Some(r) = recoveries.last_mut().filter(|r| r.stall_ms.is_none()) {
                r.stall_ms = Some((now - r.detected).as_secs_f64() * 1e3);
            }
            merged.tokens.push(t.token);
            merged.logprobs.push(t.logprob);
            merged.top_logprobs.push(t.top.iter().map(|e| (e.id, e.logprob)).collect());
            on_token(t)
        })
        .await;
        match result {
            Ok(c) => {
                // An embedding delivers no token: its replacement's stall ends with its vector.
                if let Some(r) = recoveries.last_mut().filter(|r| r.stall_ms.is_none() && embed.is_some()) {
                    r.stall_ms = Some(r.detected.elapsed().as_secs_f64() * 1e3);
                }
                attempts.push(Attempt { route, session, usage: c.usage.clone() });
                let decoded = merged.tokens.len().saturating_sub(1);
                let (tokens, logprobs, top) = (merged.tokens, merged.logprobs, merged.top_logprobs);
                // A replay's prompt holds the tokens generated so far: only the request's own count.
                let cached_tokens = c.cached_tokens.min(req.prompt_tokens.len());
                let mut out = Completion { tokens, logprobs, top_logprobs: top, cached_tokens, ..c };
                if let Some(ft) = first_token {
                    out.timings.first_token(started, req.prompt_tokens.len());
                    out.timings.ttft_ms = (ft - started).as_secs_f64() * 1e3;
                    out.timings.prefill_ms = out.timings.ttft_ms;
                    out.timings.prefill_tok_per_s = req.prompt_tokens.len() as f64 / (ft - started).as_secs_f64();
                    out.timings.decoded(ft, decoded);
                }
                return Recovered { result: Ok(out), attempts, recoveries };
            }
            Err(mut e) => {
                attempts.push(Attempt { route: route.clone(), session, usage: std::mem::take(&mut e.usage) });
                // A generation with all its tokens is done; an embedding has none to wait for.
                let done = embed.is_none() && merged.tokens.len() >= req.max_tokens;
                if !recoverable(&e) || recoveries.len() >= max_replays || done {
                    e.generated = merged.tokens.len();
                    return Recovered { result: Err(e), attempts, recoveries };
                }
                let worker_id = e.stage.and_then(|i| route.stages.get(i as usize)).map(|s| s.worker_id.clone()).filter(|w| !w.is_empty());
                exclude.extend(worker_id.clone());
                let detected = Instant::now();
                let budget = (req.prompt_tokens.len() + req.max_tokens) as u64;
                let replanned = replan(exclude.clone(), budget, engine.clone()).await.and_then(|(r, t)| match r.engine() {
                    e if e != engine => Err(DriveError::new(
                        FailKind::Route,
                        None,
                        None,
                        format!("the replacement route runs engine {e:?}, not {engine:?}"),
                    )),
                    _ => Ok((r, t)),
                });
                match replanned {
                    Ok((r, t)) => {
                        recoveries.push(Recovery {
                            kind: e.kind,
                            stage: e.stage,
                            addr: e.addr.clone(),
                            worker_id,
                            at_token: merged.tokens.len(),
                            stall_ms: None,
                            detected,
                        });
                        route = r;
                        ticket = t;
                    }
                    Err(why) => {
                        e.message = format!("{} (no replacement route: {})", e.message, why.message);
                        e.generated = merged.tokens.len();
                        return Recovered { result: Err(e), attempts, recoveries };
                    }
                }
            }
        }
    }
}

//! A driver's dealings with the trackers: asking for a route and its ticket, and reporting what
//! a request used, once, under its request id. `tracker` is one address or the comma-separated
//! list of the swarm's trackers; a call goes to the next when one cannot answer.

use crate::reporter::{report_until, ReportStats};
use crate::trackers::Trackers;
use crate::{Attempt, Completion, DriveError, FailKind, FinishReason, Route};
use dgr_proto::{PrefixProbe, RequestUsage, RouteRequest, SignedTicket, StageUsage, TrackerBody, TrackerCallError, UsageStatus};
use std::time::{Duration, Instant};

const CONNECT: Duration = Duration::from_secs(5);
/// How long a usage report keeps trying (a tracker may be restarting).
const REPORT_FOR: Duration = Duration::from_secs(20);

pub fn tracker_error(e: TrackerCallError) -> DriveError {
    match e {
        TrackerCallError::Refused(r) => DriveError::new(FailKind::Refused(r.refusal_kind()), None, None, r.message),
        e => DriveError::new(FailKind::Tracker, None, None, e.to_string()),
    }
}

/// A fresh request id: 128 random bits, hex.
pub fn new_request_id() -> String {
    let mut b = [0u8; 16];
    let _ = getrandom::fill(&mut b);
    hex::encode(b)
}

/// A route for `model_id` from the tracker, on `engine` (empty: any), avoiding the workers in
/// `exclude`, preferring workers that hold `prompt`'s prefix cached, with its ticket and the
/// session id it names.
#[allow(clippy::too_many_arguments)]
pub async fn route(
    tracker: &str,
    model_id: &str,
    engine: &str,
    budget_tokens: u64,
    api_key: &str,
    request_id: &str,
    exclude: &[String],
    prompt: &[u32],
) -> Result<(Route, (SignedTicket, [u8; 16])), DriveError> {
    let ask = RouteRequest {
        model_id: model_id.into(),
        engine: engine.into(),
        budget_tokens,
        api_key: api_key.into(),
        request_id: request_id.into(),
        exclude: exclude.to_vec(),
        prefix: prompt_probes(prompt),
        ..Default::default()
    };
    routed(Trackers::new(tracker, CONNECT).call(TrackerBody::RouteRequest(ask)).await.map_err(tracker_error)?)
}

/// What a route request names of `prompt` for cache-aware routing (`prefix_probes`).
pub fn prompt_probes(prompt: &[u32]) -> Vec<PrefixProbe> {
    dgr_proto::prefix_probes(&dgr_proto::prefix_chain(prompt))
}

/// The route, ticket and session id in a tracker's answer to a RouteRequest.
pub fn routed(answer: TrackerBody) -> Result<(Route, (SignedTicket, [u8; 16])), DriveError> {
    let TrackerBody::RouteReply(reply) = answer else {
        return Err(DriveError::new(FailKind::Tracker, None, None, "the tracker answered something else"));
    };
    let route = Route::from_tracker(&reply)?;
    let bad = || DriveError::new(FailKind::Tracker, None, None, "a route without a valid ticket");
    let ticket = reply.ticket.ok_or_else(bad)?;
    let session: [u8; 16] = reply.route.as_ref().and_then(|t| t.session_id.as_slice().try_into().ok()).ok_or_else(bad)?;
    Ok((route, (ticket, session)))
}

/// The driver's account of a request: tokens in and out, and what each stage of each of its
/// sessions (more than one after a recovery) reported computing.
pub fn request_usage(
    request_id: &str,
    api_key: &str,
    model_id: &str,
    prompt_tokens: usize,
    result: &Result<Completion, DriveError>,
    attempts: &[Attempt],
) -> RequestUsage {
    let (status, completion) = match result {
        Ok(c) if c.finish_reason == FinishReason::Cancelled => (UsageStatus::Cancelled, c.tokens.len()),
        Ok(c) => (UsageStatus::Completed, c.tokens.len()),
        Err(e) => (UsageStatus::Failed, e.generated),
    };
    let stages = attempts
        .iter()
        .flat_map(|a| {
            a.usage.iter().filter_map(|u| {
                Some(StageUsage {
                    worker_id: a.route.stages.get(u.stage as usize)?.worker_id.clone(),
                    session_id: a.session.to_vec(),
                    tokens_prefilled: u.tokens_prefilled,
                    tokens_decoded: u.tokens_decoded,
                    layer_tokens: u.layer_tokens,
                })
            })
        })
        .collect();
    RequestUsage {
        request_id: request_id.into(),
        api_key: api_key.into(),
        model_id: model_id.into(),
        // A replay runs on the route engine of the first route (`generate_recovering`).
        engine: attempts.first().map(|a| a.route.engine()).unwrap_or_default(),
        prompt_tokens: prompt_tokens as u64,
        completion_tokens: completion as u64,
        status: status.as_str().into(),
        stages,
    }
}

/// Sends the report until a tracker stores it (or says it already had it), for up to
/// `REPORT_FOR`: "recorded", or why it was not.
pub async fn report(tracker: &str, usage: RequestUsage) -> String {
    let give_up = Instant::now() + REPORT_FOR;
    match report_until(&Trackers::new(tracker, CONNECT), usage, Some(give_up), &ReportStats::default()).await {
        Ok(()) => "recorded".into(),
        Err(why) => why,
    }
}

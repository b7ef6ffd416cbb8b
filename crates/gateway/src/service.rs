//! The gateway's state: the models it serves (tokenizer, identity and context, loaded once),
//! warm connections to workers and to the tracker, admission, and the run of one generation.

use crate::admission::Admission;
use crate::api_error::ApiError;
use crate::metrics::HttpMetrics;
use crate::structured::Grammars;
use crate::text::TextOut;
use crate::verify;
use axum::http::StatusCode;
use dgr_driver::{
    embed_recovering, generate_recovering, tracker, DraftStats, DriveError, DriveOptions, EmbedRequest, FailKind, FinishReason, Flow,
    GenRequest, Links, Recovered, SharedConstraint, Ticketed, Trackers, UsageReporter,
};
use dgr_proto::{
    ErrorKind, Pooling, RefusalKind, RouteRequest, Sampling, SeamDtype, SwarmQuery, SwarmReply, TrackerBody, TrackerCallError,
};
use dgr_tokenizer::Tokenizer;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Usage reports of finished requests waiting for a tracker; past it, a finished request waits
/// for room (and says so).
const USAGE_QUEUE: usize = 4096;

#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// The swarm's trackers, comma-separated: each call goes to the one that answered last, and
    /// to the next when that one cannot answer.
    pub tracker: String,
    /// GGUF files whose tokenizers and chat templates the gateway uses (the swarm serves the weights).
    pub models: Vec<PathBuf>,
    pub max_body_bytes: usize,
    pub max_prompt_tokens: usize,
    pub max_tokens_limit: usize,
    /// Generations running at once; more wait in a queue of `queue` for up to `queue_timeout`.
    pub max_running: usize,
    pub queue: usize,
    pub queue_timeout: Duration,
    /// Connections open at once; slow clients time out on their request head and body.
    pub max_connections: usize,
    /// No request runs longer: past it, the session is cancelled and the client told why.
    pub request_timeout: Duration,
    pub drive: DriveOptions,
    /// The fraction of sessions spot-checked (each stage recomputed on another replica).
    pub verify_fraction: f64,
    /// The tracker's join token: needed to quarantine a worker a spot check caught.
    pub join_token: Option<String>,
}

impl GatewayConfig {
    pub fn new(tracker: String, models: Vec<PathBuf>) -> GatewayConfig {
        GatewayConfig {
            tracker,
            models,
            max_body_bytes: 1 << 20,
            max_prompt_tokens: 8192,
            max_tokens_limit: 4096,
            max_running: 64,
            queue: 256,
            queue_timeout: Duration::from_secs(30),
            max_connections: 4096,
            request_timeout: Duration::from_secs(600),
            drive: DriveOptions::default(),
            verify_fraction: 0.02,
            join_token: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("{path}: {source}")]
    Model { path: PathBuf, source: Box<dyn std::error::Error + Send + Sync> },
    #[error("no model given")]
    NoModel,
}

pub struct ServedModel {
    /// The name clients use: the file's stem.
    pub name: String,
    pub model_id: String,
    pub tokenizer: Tokenizer,
    pub context: usize,
    /// Values per embedding: the model's hidden size.
    pub hidden: usize,
    /// Its grammar compiler, over its vocabulary.
    pub grammars: Grammars,
}

pub struct Gateway {
    pub cfg: GatewayConfig,
    pub models: Vec<Arc<ServedModel>>,
    pub links: Links,
    pub admission: Admission,
    pub metrics: HttpMetrics,
    /// The last 15 minutes, sampled for the dashboard's charts.
    pub history: crate::history::History,
    trackers: Arc<Trackers>,
    /// Started on first use, on the gateway's runtime.
    usage: OnceLock<UsageReporter>,
    swarm: Mutex<Option<(Instant, SwarmReply)>>,
    pub started: Instant,
}

/// One generation, ready to run.
pub struct Job {
    pub model: Arc<ServedModel>,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub logprobs: Option<u32>,
    pub stops: Vec<String>,
    pub ignore_eos: bool,
    pub api_key: String,
    /// The grammar the tokens must follow.
    pub constraint: Option<SharedConstraint>,
}

/// What a running generation sends its response.
pub enum Piece {
    Token {
        id: u32,
        text: String,
        logprob: f32,
        top: Vec<(u32, f32)>,
    },
    /// The end: text held back for a stop string that never came, why it ended (or the error
    /// it ended with), and usage.
    Done {
        text: String,
        end: Result<FinishReason, ApiError>,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Of the prompt's tokens, those the route's prefix caches held.
        cached_tokens: usize,
        /// Speculative decoding's steps and drafts.
        drafts: DraftStats,
    },
}

fn model_error(path: &std::path::Path, e: impl std::error::Error + Send + Sync + 'static) -> GatewayError {
    GatewayError::Model { path: path.to_path_buf(), source: Box::new(e) }
}

impl Gateway {
    pub fn open(cfg: GatewayConfig) -> Result<Gateway, GatewayError> {
        if cfg.models.is_empty() {
            return Err(GatewayError::NoModel);
        }
        let mut models = Vec::new();
        for path in &cfg.models {
            let (g, id) = dgr_hf::describe(path).map_err(|e| model_error(path, e))?;
            let model_id = id.id;
            let tokenizer = Tokenizer::for_model(path, &g).map_err(|e| model_error(path, e))?;
            let arch = g.get_str("general.architecture").map_err(|e| model_error(path, e))?.to_string();
            let context = g.get_u64(&format!("{arch}.context_length")).unwrap_or(2048).clamp(1, 1 << 24) as usize;
            let hidden = g.get_u64(&format!("{arch}.embedding_length")).map_err(|e| model_error(path, e))?.min(1 << 20) as usize;
            let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| model_id.clone());
            let name = name.strip_suffix(".gguf").map(String::from).unwrap_or(name);
            let grammars = Grammars::new(&tokenizer);
            models.push(Arc::new(ServedModel { name, model_id, tokenizer, context, hidden, grammars }));
        }
        Ok(Gateway {
            admission: Admission::new(cfg.max_running, cfg.queue, cfg.queue_timeout),
            trackers: Arc::new(Trackers::new(&cfg.tracker, cfg.drive.connect_timeout)),
            cfg,
            models,
            links: Links::new(),
            metrics: HttpMetrics::default(),
            history: Default::default(),
            usage: OnceLock::new(),
            swarm: Mutex::new(None),
            started: Instant::now(),
        })
    }

    pub fn model(&self, name: &str) -> Result<Arc<ServedModel>, ApiError> {
        self.models.iter().find(|m| m.name == name || m.model_id == name).cloned().ok_or_else(|| {
            ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("the model {name:?} does not exist"))
                .param("model")
                .code("model_not_found")
        })
    }

    /// One exchange with a tracker of the swarm over a warm connection (the one that answered
    /// last first, failing over to the next).
    pub async fn tracker_call(&self, body: TrackerBody) -> Result<TrackerBody, TrackerCallError> {
        self.trackers.call(body).await
    }

    /// A route, asked for again while the tracker answers that every chain serving the model is
    /// full, for up to `queue_timeout`: room frees as sessions end, and a burst of routes looks
    /// like a full worker until its next heartbeat counts the sessions they opened.
    async fn route_request(&self, ask: RouteRequest) -> Result<TrackerBody, TrackerCallError> {
        let deadline = Instant::now() + self.cfg.queue_timeout;
        let mut pause = Duration::from_millis(20);
        loop {
            match self.tracker_call(TrackerBody::RouteRequest(ask.clone())).await {
                Err(TrackerCallError::Refused(r)) if r.refusal_kind() == RefusalKind::Full && Instant::now() + pause < deadline => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(250));
                }
                answer => return answer,
            }
        }
    }

    /// The same message to every tracker of the swarm; Ok if any took it.
    pub async fn tracker_broadcast(&self, body: TrackerBody) -> Result<TrackerBody, TrackerCallError> {
        self.trackers.broadcast(body).await
    }

    /// The background sender of usage reports; called on the gateway's runtime.
    fn reporter(&self) -> &UsageReporter {
        self.usage.get_or_init(|| UsageReporter::start(self.trackers.clone(), USAGE_QUEUE))
    }

    /// What the usage reporter has done, once it has started.
    pub fn report_stats(&self) -> Option<&dgr_driver::ReportStats> {
        self.usage.get().map(|r| r.stats.as_ref())
    }

    /// The swarm as the tracker sees it, at most a second old.
    pub async fn swarm(&self) -> Option<SwarmReply> {
        if let Some((at, r)) = self.swarm.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            if at.elapsed() < Duration::from_secs(1) {
                return Some(r.clone());
            }
        }
        match self.tracker_call(TrackerBody::SwarmQuery(SwarmQuery {})).await {
            Ok(TrackerBody::SwarmReply(r)) => {
                *self.swarm.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), r.clone()));
                Some(r)
            }
            _ => None,
        }
    }

    /// Whether live workers cover every layer of `model_id`.
    pub fn covered(swarm: &SwarmReply, model_id: &str) -> bool {
        let live: Vec<(u32, u32, u32)> = swarm
            .workers
            .iter()
            .filter(|w| w.last_seen_ms <= 3 * swarm.heartbeat_ms as u64)
            .filter_map(|w| w.registration.as_ref())
            .filter(|r| r.model_id == model_id)
            .map(|r| (r.layer_start, r.layer_end, r.n_layers))
            .collect();
        let Some(&(_, _, n)) = live.first() else { return false };
        (0..n).all(|l| live.iter().any(|&(a, b, _)| a <= l && l < b))
    }

    /// Admits the job, gets its route and ticket, and starts it; the receiver yields its pieces.
    /// Every refusal (limits, key, quota, no route, a full queue) comes before any worker is used.
    pub async fn start(self: &Arc<Self>, job: Job) -> Result<(mpsc::UnboundedReceiver<Piece>, Option<String>), ApiError> {
        let permit = self.admission.enter().await?;
        let request_id = tracker::new_request_id();
        let ask = RouteRequest {
            model_id: job.model.model_id.clone(),
            budget_tokens: (job.prompt.len() + job.max_tokens) as u64,
            api_key: job.api_key.clone(),
            request_id: request_id.clone(),
            prefix: tracker::prompt_probes(&job.prompt),
            ..Default::default()
        };
        let answer = self.route_request(ask).await.map_err(refusal)?;
        let key_name = match &answer {
            TrackerBody::RouteReply(r) => Some(r.key_name.clone()).filter(|k| !k.is_empty()),
            _ => None,
        };
        let (route, ticket) = tracker::routed(answer).map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, "api_error", e.message))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let gw = self.clone();
        let key_label = key_name.clone().unwrap_or_else(|| "anonymous".into());
        tokio::spawn(async move {
            let _permit = permit;
            gw.run(job, (route, Some(ticket)), request_id, key_label, tx).await;
        });
        Ok((rx, key_name))
    }

    async fn run(&self, job: Job, first: Ticketed, request_id: String, key: String, tx: mpsc::UnboundedSender<Piece>) {
        let check = verify::sampled(self.cfg.verify_fraction);
        let req = GenRequest {
            prompt_tokens: job.prompt.clone(),
            max_tokens: job.max_tokens,
            sampling: job.sampling,
            top_logprobs: job.logprobs.unwrap_or(0),
            seam_dtype: SeamDtype::F32,
            ticket: None,
            hash_rows: check,
            constraint: job.constraint.clone(),
            stop_tokens: if job.ignore_eos { Vec::new() } else { job.model.tokenizer.eog_ids() },
        };
        let mut traces: Vec<Vec<dgr_proto::Hop>> = Vec::new();
        let mut text = TextOut::new(job.stops.clone());
        let mut stopped_by_text = false;
        let mut past_deadline = false;
        let started = Instant::now();
        let mut last: Option<Instant> = None;
        let tok = &job.model.tokenizer;
        let on_token = |t: &dgr_proto::TokenOut| {
            let now = Instant::now();
            let since = now.duration_since(last.unwrap_or(started));
            match last {
                None => self.metrics.ttft.observe(since.as_secs_f64()),
                Some(_) => self.metrics.itl.observe(since.as_secs_f64()),
            }
            self.metrics.feed.token(since, last.is_none());
            last = Some(now);
            if check {
                traces.push(t.trace.clone());
            }
            if started.elapsed() > self.cfg.request_timeout {
                past_deadline = true;
                return Flow::Cancel;
            }
            let eog = !job.ignore_eos && tok.is_eog(t.token);
            if eog {
                // The end-of-generation token is not part of the completion's text or logprobs.
                return if tx.is_closed() { Flow::Cancel } else { Flow::Stop };
            }
            let (piece, stop) = text.push(&tok.token_bytes(t.token).unwrap_or_default());
            if stop {
                stopped_by_text = true;
                // The token that completed a stop string belongs to the completion only for the
                // text before the stop.
                if !piece.is_empty() {
                    let _ = tx.send(Piece::Token { id: t.token, text: piece, logprob: t.logprob, top: top_of(t) });
                }
                return Flow::Stop;
            }
            if tx.send(Piece::Token { id: t.token, text: piece, logprob: t.logprob, top: top_of(t) }).is_err() || tx.is_closed() {
                // The client went away: cancel the session on every stage.
                return Flow::Cancel;
            }
            Flow::Continue
        };
        // A failed stage is replaced by a route that avoids it; the session's tokens replay.
        let replan = |exclude, budget, engine| {
            let route = (&job.model.model_id[..], &job.api_key[..], &request_id[..], &job.prompt[..]);
            self.reroute(route, exclude, budget, engine)
        };
        let rec = generate_recovering(&self.links, first, &req, &self.cfg.drive, on_token, replan, MAX_REPLAYS).await;
        self.log_recoveries(&request_id, &rec);
        let result = rec.result;
        let usage = tracker::request_usage(&request_id, &job.api_key, &job.model.model_id, job.prompt.len(), &result, &rec.attempts);
        let (end, completion): (Result<FinishReason, ApiError>, usize) = match &result {
            Ok(c) if past_deadline => {
                let e = ApiError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "api_error",
                    format!("the request ran past its deadline of {:?}", self.cfg.request_timeout),
                )
                .code("deadline_exceeded");
                (Err(e), c.tokens.len())
            }
            Ok(c) => {
                let reason = match c.finish_reason {
                    FinishReason::Cancelled => FinishReason::Cancelled,
                    FinishReason::Stop => FinishReason::Stop,
                    _ if stopped_by_text => FinishReason::Stop,
                    _ => FinishReason::Length,
                };
                (Ok(reason), c.tokens.len())
            }
            Err(e) => (Err(drive_error(e)), e.generated),
        };
        self.metrics.finished(&job.model.name, &key, job.prompt.len(), completion, end.as_ref().err().map(|e| e.metric_kind()));
        let tail = if stopped_by_text { String::new() } else { text.finish() };
        let cached_tokens = result.as_ref().map_or(0, |c| c.cached_tokens);
        self.metrics.feed.ended(job.prompt.len(), cached_tokens);
        let drafts = result.as_ref().map_or(DraftStats::default(), |c| c.drafts);
        self.metrics.drafted(&drafts);
        let _ =
            tx.send(Piece::Done { text: tail, end, prompt_tokens: job.prompt.len(), completion_tokens: completion, cached_tokens, drafts });
        if let (true, Ok(c), [attempt]) = (check, &result, rec.attempts.as_slice()) {
            let sample = verify::Sample {
                route: attempt.route.clone(),
                model_id: job.model.model_id.clone(),
                prompt: job.prompt.clone(),
                tokens: c.tokens.clone(),
                traces,
                sampling: job.sampling,
            };
            self.spot_check(sample).await;
        }
        // Stored by some tracker eventually, however long they are all down.
        self.reporter().submit(usage).await;
    }
}

impl Gateway {
    /// A route for a request's replay that avoids the workers in `exclude`, on `engine`: `of` is
    /// the request's model id, API key, request id and prompt (empty: none cached).
    async fn reroute(
        &self,
        of: (&str, &str, &str, &[u32]),
        exclude: Vec<String>,
        budget: u64,
        engine: String,
    ) -> Result<Ticketed, DriveError> {
        let (model_id, api_key, request_id, prompt) = of;
        let ask = RouteRequest {
            model_id: model_id.into(),
            engine,
            budget_tokens: budget,
            api_key: api_key.into(),
            request_id: request_id.into(),
            exclude,
            prefix: tracker::prompt_probes(prompt),
            ..Default::default()
        };
        let answer = self.route_request(ask).await.map_err(tracker::tracker_error)?;
        tracker::routed(answer).map(|(r, t)| (r, Some(t)))
    }

    fn log_recoveries(&self, request_id: &str, rec: &Recovered) {
        for (i, r) in rec.recoveries.iter().enumerate() {
            let stage = r.stage.map_or("unknown".to_string(), |s| s.to_string());
            let at = format!("{} at stage {stage} ({})", r.kind, r.addr.as_deref().unwrap_or("address unknown"));
            // "Recovered" only for the fault whose replay completed the request.
            match r.stall_ms {
                Some(stall) if rec.result.is_ok() && i + 1 == rec.recoveries.len() => {
                    eprintln!("dgr gateway: request {request_id} recovered from {at} after {} tokens; stall {stall:.0} ms", r.at_token);
                    self.metrics.error(&format!("recovered_{}", r.kind));
                }
                _ => eprintln!(
                    "dgr gateway: request {request_id} replayed after {at} after {} tokens; the replay did not complete",
                    r.at_token
                ),
            }
        }
    }

    /// One input's embedding: admitted, routed (its prompt tokens reserved against the key),
    /// computed on the route (recovering from a failed stage by prefilling again elsewhere) and
    /// billed. Returns the vector and the key's name.
    pub async fn embed(&self, model: &ServedModel, prompt: Vec<u32>, api_key: &str) -> Result<(Vec<f32>, String), ApiError> {
        let _permit = self.admission.enter().await?;
        let request_id = tracker::new_request_id();
        let ask = RouteRequest {
            model_id: model.model_id.clone(),
            budget_tokens: prompt.len() as u64,
            api_key: api_key.into(),
            request_id: request_id.clone(),
            ..Default::default()
        };
        let answer = self.route_request(ask).await.map_err(refusal)?;
        let key = match &answer {
            TrackerBody::RouteReply(r) if !r.key_name.is_empty() => r.key_name.clone(),
            _ => "anonymous".into(),
        };
        let (route, ticket) = tracker::routed(answer).map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, "api_error", e.message))?;
        let req = EmbedRequest { prompt_tokens: prompt, pooling: Pooling::Model, seam_dtype: SeamDtype::F32, ticket: None };
        let replan = |exclude, budget, engine| self.reroute((&model.model_id, api_key, &request_id, &[]), exclude, budget, engine);
        let rec = embed_recovering(&self.links, (route, Some(ticket)), &req, &self.cfg.drive, replan, MAX_REPLAYS).await;
        self.log_recoveries(&request_id, &rec);
        let usage = tracker::request_usage(&request_id, api_key, &model.model_id, req.prompt_tokens.len(), &rec.result, &rec.attempts);
        self.reporter().submit(usage).await;
        match rec.result {
            Ok(c) => Ok((c.embedding, key)),
            Err(e) => Err(drive_error(&e)),
        }
    }
}

fn top_of(t: &dgr_proto::TokenOut) -> Vec<(u32, f32)> {
    t.top.iter().map(|e| (e.id, e.logprob)).collect()
}

/// Stage failures one request may recover from.
const MAX_REPLAYS: usize = 3;

/// A tracker refusal as the HTTP status a client should see.
fn refusal(e: TrackerCallError) -> ApiError {
    match e {
        TrackerCallError::Refused(r) => {
            let msg = r.message.clone();
            match r.refusal_kind() {
                RefusalKind::BadApiKey => {
                    ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", "invalid API key").code("invalid_api_key")
                }
                RefusalKind::QuotaExceeded => {
                    ApiError::new(StatusCode::TOO_MANY_REQUESTS, "insufficient_quota", msg).code("insufficient_quota").retry_after(60)
                }
                RefusalKind::NoRoute => {
                    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", msg).code("no_route").retry_after(1)
                }
                RefusalKind::Full => {
                    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", msg).code("workers_full").retry_after(1)
                }
                // The tracker's database is down: nothing was routed, and it resumes by itself.
                RefusalKind::Unavailable => {
                    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", msg).code("ledger_unavailable").retry_after(1)
                }
                RefusalKind::BadRequest => ApiError::bad_request(msg),
                _ => ApiError::new(StatusCode::BAD_GATEWAY, "api_error", msg),
            }
        }
        // A tracker restarting is back in moments.
        e => ApiError::new(StatusCode::BAD_GATEWAY, "api_error", format!("the tracker is unreachable: {e}"))
            .code("tracker_unreachable")
            .retry_after(1),
    }
}

/// A failed route as an error naming the stage.
fn drive_error(e: &DriveError) -> ApiError {
    if e.kind == FailKind::Worker(ErrorKind::Unsupported) {
        return ApiError::bad_request(e.message.clone()).code("unsupported");
    }
    let status = if e.kind.is_overloaded() { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::BAD_GATEWAY };
    let at = match (e.stage, &e.addr) {
        (Some(s), Some(a)) => format!(" at stage {s} ({a})"),
        _ => String::new(),
    };
    let err = ApiError::new(status, "api_error", format!("{}{at}: {}", e.kind, e.message)).code("route_failed");
    // Full workers free up as sessions end: worth a retry soon.
    if e.kind.is_overloaded() {
        err.retry_after(1)
    } else {
        err
    }
}

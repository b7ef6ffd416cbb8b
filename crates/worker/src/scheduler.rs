//! The scheduler: one thread that owns the stage and every session's state, and runs each
//! ready session's next chunk in one batched forward per step.

use crate::{Metrics, WorkerConfig};
use dgr_engine::{Input, LogitRows, SamplingParams, SeqInput, Stage};
use dgr_proto::{
    check_forward, check_open, session_id, Body, BoundarySchema, ErrorKind, ErrorMsg, Forward, Frame, Hop, OpenSession, SeamDtype,
    SessionId, SessionRef, TokenOut, TopEntry, STAGE_UNKNOWN,
};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::mpsc::Sender;

pub(crate) type Outbox = Sender<Frame>;
pub(crate) type ConnId = u64;

/// Frames a session may have waiting before it is refused more.
const MAX_PENDING: usize = 64;

pub(crate) enum Cmd {
    Open { conn: ConnId, open: OpenSession, reply: Outbox, next: Option<(String, Outbox)> },
    Forward { f: Forward, recv_us: u64, at: Instant, reply: Outbox },
    Cancel { id: Vec<u8> },
    Close { id: Vec<u8> },
    /// A driver's connection ended: its sessions end with it.
    ConnClosed { conn: ConnId },
    /// The connection to a next stage broke.
    PeerLost { addr: String, why: String },
    /// The next stage reported an error about one of our sessions.
    PeerError { err: ErrorMsg },
    /// Stop taking sessions; exit once none are left or at `deadline`.
    Drain { deadline: Instant },
}

struct Pending {
    f: Forward,
    rows: usize,
    recv_us: u64,
    at: Instant,
}

struct Session {
    id: SessionId,
    driver: ConnId,
    reply: Outbox,
    next: Option<(String, Outbox)>,
    kv: dgr_engine::KvCache,
    dtype: SeamDtype,
    stage_index: u32,
    sampling: SamplingParams,
    top_logprobs: usize,
    reserved: usize,
    pending: VecDeque<Pending>,
    last_active: Instant,
}

pub(crate) struct Scheduler {
    pub stage: Stage,
    pub cfg: WorkerConfig,
    pub schema: BoundarySchema,
    pub metrics: Arc<Metrics>,
    sessions: HashMap<SessionId, Session>,
    reserved: usize,
    drain: Option<Instant>,
}

fn unix_us() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

fn send(to: &Outbox, body: Body) -> bool {
    to.try_send(Frame::new(body)).is_ok()
}

impl Scheduler {
    pub fn new(stage: Stage, cfg: WorkerConfig, schema: BoundarySchema, metrics: Arc<Metrics>) -> Scheduler {
        let per_position = 2 * stage.layers().len() * stage.config().kv_dim() * 4;
        metrics.kv_bytes_capacity.store((cfg.kv_budget_tokens * per_position) as u64, Relaxed);
        metrics.weight_bytes.store(stage.weight_bytes() as u64, Relaxed);
        Scheduler { stage, cfg, schema, metrics, sessions: HashMap::new(), reserved: 0, drain: None }
    }

    /// Runs until every command sender is gone or a drain completes.
    pub fn run(mut self, rx: Receiver<Cmd>) {
        let tick = Duration::from_millis(100);
        loop {
            let busy = self.sessions.values().any(|s| !s.pending.is_empty());
            if !busy {
                match rx.recv_timeout(tick) {
                    Ok(c) => self.handle(c),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(c) = rx.try_recv() {
                self.handle(c);
            }
            self.step();
            self.sweep();
            if let Some(deadline) = self.drain {
                if self.sessions.is_empty() || Instant::now() >= deadline {
                    let ids: Vec<SessionId> = self.sessions.keys().copied().collect();
                    for id in ids {
                        self.fail(&id, ErrorKind::ShuttingDown, "the worker is shutting down");
                    }
                    return;
                }
            }
            self.publish();
        }
    }

    fn error_to(&self, to: &Outbox, id: &[u8], kind: ErrorKind, stage: u32, msg: impl Into<String>) {
        self.metrics.failure(kind);
        send(to, Body::Error(ErrorMsg::new(id, kind, stage, msg)));
    }

    /// Ends a session with an error sent to its driver.
    fn fail(&mut self, id: &SessionId, kind: ErrorKind, msg: &str) {
        if let Some(s) = self.sessions.remove(id) {
            self.end(s, Some((kind, msg.to_string())));
        }
    }

    /// Frees a session (already out of the map) and tells its driver why, if it failed.
    fn end(&mut self, s: Session, err: Option<(ErrorKind, String)>) {
        self.reserved -= s.reserved;
        self.metrics.sessions_closed.fetch_add(1, Relaxed);
        if let Some((kind, msg)) = err {
            self.error_to(&s.reply, &s.id, kind, s.stage_index, msg);
        }
    }

    fn remove(&mut self, id: &SessionId) -> Option<Session> {
        let s = self.sessions.remove(id)?;
        self.reserved -= s.reserved;
        self.metrics.sessions_closed.fetch_add(1, Relaxed);
        Some(s)
    }

    fn handle(&mut self, c: Cmd) {
        match c {
            Cmd::Open { conn, open, reply, next } => self.open(conn, open, reply, next),
            Cmd::Forward { f, recv_us, at, reply } => self.forward(f, recv_us, at, reply),
            Cmd::Cancel { id } | Cmd::Close { id } => {
                if let Ok(id) = session_id(&id) {
                    self.remove(&id);
                }
            }
            Cmd::ConnClosed { conn } => {
                let ids: Vec<SessionId> = self.sessions.values().filter(|s| s.driver == conn).map(|s| s.id).collect();
                for id in ids {
                    self.remove(&id);
                }
            }
            Cmd::PeerLost { addr, why } => {
                let ids: Vec<SessionId> =
                    self.sessions.values().filter(|s| s.next.as_ref().is_some_and(|(a, _)| *a == addr)).map(|s| s.id).collect();
                for id in ids {
                    if let Some(s) = self.remove(&id) {
                        let msg = format!("lost the next stage at {addr}: {why}");
                        self.error_to(&s.reply, &id, ErrorKind::NextStage, s.stage_index + 1, msg);
                    }
                }
            }
            Cmd::PeerError { err } => {
                if let Ok(id) = session_id(&err.session_id) {
                    if let Some(s) = self.remove(&id) {
                        self.metrics.failure(err.error_kind());
                        send(&s.reply, Body::Error(err));
                    }
                }
            }
            Cmd::Drain { deadline } => self.drain = Some(deadline),
        }
    }

    fn open(&mut self, conn: ConnId, open: OpenSession, reply: Outbox, next: Option<(String, Outbox)>) {
        let stage_index = open.stage_index;
        let refuse = |me: &Self, kind, msg: String| me.error_to(&reply, &open.session_id, kind, stage_index, msg);
        if self.drain.is_some() {
            return refuse(self, ErrorKind::ShuttingDown, "the worker is shutting down".into());
        }
        let (id, dtype) = match check_open(&open, &self.schema, &self.cfg.seam_dtypes) {
            Ok(v) => v,
            Err(e) => return refuse(self, e.kind(), e.to_string()),
        };
        if self.sessions.contains_key(&id) {
            return refuse(self, ErrorKind::BadFrame, "a session with this id is already open".into());
        }
        if open.next.is_empty() != self.stage.is_last() {
            return refuse(self, ErrorKind::BadFrame, "the route's next hop does not fit this stage's place".into());
        }
        let want = open.max_positions as usize;
        if want == 0 || want > self.stage.config().context {
            return refuse(self, ErrorKind::BadInput, format!("{want} positions (the model holds 1..={})", self.stage.config().context));
        }
        if self.sessions.len() >= self.cfg.max_sessions || self.reserved + want > self.cfg.kv_budget_tokens {
            return refuse(
                self,
                ErrorKind::Overloaded,
                format!("no room: {} sessions open, {} of {} KV positions reserved", self.sessions.len(), self.reserved, self.cfg.kv_budget_tokens),
            );
        }
        let sampling = open.sampling.unwrap_or_default();
        let session = Session {
            id,
            driver: conn,
            reply: reply.clone(),
            next,
            kv: self.stage.new_kv(want),
            dtype,
            stage_index,
            sampling: SamplingParams {
                temperature: sampling.temperature,
                top_k: sampling.top_k as usize,
                top_p: if sampling.top_p > 0.0 { sampling.top_p } else { 1.0 },
                seed: sampling.seed,
            },
            top_logprobs: (open.top_logprobs as usize).min(64),
            reserved: want,
            pending: VecDeque::new(),
            last_active: Instant::now(),
        };
        self.reserved += want;
        self.sessions.insert(id, session);
        self.metrics.sessions_opened.fetch_add(1, Relaxed);
        send(&reply, Body::Opened(SessionRef { session_id: id.to_vec() }));
    }

    fn forward(&mut self, f: Forward, recv_us: u64, at: Instant, reply: Outbox) {
        let me = STAGE_UNKNOWN;
        let id = match session_id(&f.session_id) {
            Ok(id) => id,
            Err(e) => return self.error_to(&reply, &f.session_id, ErrorKind::BadFrame, me, e.to_string()),
        };
        let first = self.stage.is_first();
        let hidden = self.stage.config().hidden;
        let step_tokens = self.cfg.step_tokens;
        let Some(s) = self.sessions.get_mut(&id) else {
            return self.error_to(&reply, &id, ErrorKind::UnknownSession, me, "no such session on this stage");
        };
        let stage_index = s.stage_index;
        let checked = check_forward(&f, first, hidden, s.dtype, step_tokens).map_err(|e| (e.kind(), e.to_string())).and_then(|rows| {
            let expected = s.kv.len() + s.pending.iter().map(|p| p.rows).sum::<usize>();
            if f.position as usize != expected {
                Err((ErrorKind::BadInput, format!("rows at position {} but the session is at {expected}", f.position)))
            } else if s.pending.len() >= MAX_PENDING {
                Err((ErrorKind::Overloaded, format!("more than {MAX_PENDING} frames waiting")))
            } else {
                Ok(rows)
            }
        });
        match checked {
            Ok(rows) => {
                s.last_active = Instant::now();
                s.pending.push_back(Pending { f, rows, recv_us, at });
            }
            Err((kind, msg)) => {
                // The frame's sender hears why; the session cannot go on with a gap in it.
                self.error_to(&reply, &id, kind, stage_index, msg.clone());
                if let Some(s) = self.remove(&id) {
                    if !s.reply.same_channel(&reply) {
                        self.error_to(&s.reply, &id, kind, stage_index, msg);
                    }
                }
            }
        }
    }

    /// One batched forward over the next chunk of every ready session, within the token budget.
    fn step(&mut self) {
        let mut budget = self.cfg.step_tokens;
        let mut chosen: Vec<Session> = Vec::new();
        let ready: Vec<SessionId> = self.sessions.values().filter(|s| !s.pending.is_empty()).map(|s| s.id).collect();
        for id in ready {
            let rows = self.sessions[&id].pending[0].rows;
            if rows <= budget || chosen.is_empty() {
                budget = budget.saturating_sub(rows);
                chosen.extend(self.sessions.remove(&id));
            }
        }
        if chosen.is_empty() {
            return;
        }
        let started = Instant::now();
        let work: Vec<Pending> = chosen.iter_mut().filter_map(|s| s.pending.pop_front()).collect();
        let hidden: Vec<Vec<f32>> = work.iter().zip(&chosen).map(|(p, s)| dgr_proto::decode_rows(&p.f.hidden, s.dtype)).collect();
        let last = self.stage.is_last();
        let mut batch: Vec<SeqInput> = Vec::with_capacity(chosen.len());
        let mut bad: Vec<(usize, String)> = Vec::new();
        for (i, (s, p)) in chosen.iter_mut().zip(&work).enumerate() {
            let input = if self.stage.is_first() { Input::Tokens(&p.f.tokens) } else { Input::Hidden(&hidden[i]) };
            let seq = SeqInput { kv: &mut s.kv, input, logits: if last && p.f.sample { LogitRows::Last } else { LogitRows::None } };
            match self.stage.check(&seq) {
                Ok(_) => batch.push(seq),
                Err(e) => bad.push((i, e.to_string())),
            }
        }
        let result = self.stage.forward(&mut batch);
        drop(batch);
        let compute_us = started.elapsed().as_micros() as u64;
        let rows: usize = work.iter().enumerate().filter(|(i, _)| !bad.iter().any(|(b, _)| b == i)).map(|(_, p)| p.rows).sum();
        self.metrics.steps.fetch_add(1, Relaxed);
        self.metrics.step_rows.fetch_add(rows as u64, Relaxed);
        self.metrics.step_micros.fetch_add(compute_us, Relaxed);
        self.metrics.last_batch_sessions.store((chosen.len() - bad.len()) as u64, Relaxed);
        let mut outputs = match result {
            Ok(o) => o.into_iter(),
            Err(e) => {
                // Checked per sequence above, so this is a bug; fail the batch rather than guess.
                for s in chosen {
                    self.end(s, Some((ErrorKind::Internal, e.to_string())));
                }
                return;
            }
        };
        for (i, (mut s, p)) in chosen.into_iter().zip(work).enumerate() {
            if let Some((_, msg)) = bad.iter().find(|(b, _)| *b == i) {
                self.end(s, Some((ErrorKind::BadInput, msg.clone())));
                continue;
            }
            let out = outputs.next().unwrap_or_default();
            let counter = if p.rows > 1 { &self.metrics.tokens_prefilled } else { &self.metrics.tokens_decoded };
            counter.fetch_add(p.rows as u64, Relaxed);
            let mut trace = p.f.trace;
            let hop = |bytes_out: usize| Hop {
                stage: s.stage_index,
                queue_us: started.duration_since(p.at).as_micros() as u64,
                compute_us,
                bytes_out: bytes_out as u64,
                recv_unix_us: p.recv_us,
                sent_unix_us: unix_us(),
            };
            let delivered = match &s.next {
                Some((_, next)) => {
                    let bytes = dgr_proto::encode_rows(&out.hidden, s.dtype);
                    trace.push(hop(bytes.len()));
                    let f = Forward {
                        session_id: s.id.to_vec(),
                        position: p.f.position,
                        tokens: Vec::new(),
                        hidden: bytes,
                        dtype: s.dtype as i32,
                        n_rows: p.rows as u32,
                        sample: p.f.sample,
                        trace,
                    };
                    send(next, Body::Forward(f))
                }
                None if p.f.sample => {
                    let position = s.kv.len() as u64;
                    let token = dgr_engine::sample(&out.logits, &s.sampling, position);
                    let (logprob, top) = dgr_engine::logprobs(&out.logits, token, s.top_logprobs);
                    trace.push(hop(0));
                    let t = TokenOut {
                        session_id: s.id.to_vec(),
                        position,
                        token,
                        logprob,
                        top: top.into_iter().map(|(id, logprob)| TopEntry { id, logprob }).collect(),
                        trace,
                    };
                    send(&s.reply, Body::Token(t))
                }
                None => true,
            };
            if delivered {
                s.last_active = Instant::now();
                self.sessions.insert(s.id, s);
            } else {
                let kind = if s.next.is_some() { ErrorKind::NextStage } else { ErrorKind::Overloaded };
                self.end(s, Some((kind, "could not pass the step on: the receiver is gone or not reading".into())));
            }
        }
    }

    /// Frees sessions idle past the timeout.
    fn sweep(&mut self) {
        let timeout = self.cfg.idle_timeout;
        let idle: Vec<SessionId> = self.sessions.values().filter(|s| s.last_active.elapsed() > timeout).map(|s| s.id).collect();
        for id in idle {
            self.fail(&id, ErrorKind::Cancelled, "idle past the session timeout");
        }
    }

    fn publish(&self) {
        let m = &self.metrics;
        m.sessions_open.store(self.sessions.len() as u64, Relaxed);
        m.kv_bytes_used.store(self.sessions.values().map(|s| s.kv.bytes() as u64).sum(), Relaxed);
        m.queue_depth.store(self.sessions.values().map(|s| s.pending.len() as u64).sum(), Relaxed);
    }
}

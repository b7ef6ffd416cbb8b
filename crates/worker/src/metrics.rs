//! What a worker reports at /metrics, as Prometheus text.

use crate::compat::Phase;
use dgr_proto::{session_tag, ErrorKind, SeamDtype, SessionId, TicketError, MAX_OPENED_TAGS, OPENED_WINDOW};
use dgr_telemetry::prom::{Kind::*, Text};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

#[derive(Default)]
pub struct Metrics {
    pub sessions_open: AtomicU64,
    pub kv_bytes_used: AtomicU64,
    /// KV positions reserved by open sessions.
    pub kv_tokens_used: AtomicU64,
    /// KV positions open sessions reserved, over all the held layers (rounded up).
    pub kv_tokens_reserved: AtomicU64,
    pub kv_bytes_capacity: AtomicU64,
    pub queue_depth: AtomicU64,
    pub weight_bytes: AtomicU64,
    pub tokens_prefilled: AtomicU64,
    pub tokens_decoded: AtomicU64,
    pub steps: AtomicU64,
    pub step_rows: AtomicU64,
    pub step_micros: AtomicU64,
    pub last_batch_sessions: AtomicU64,
    /// Most rows of a long prompt (over `whole_prompt`) run in one step that also decoded: what
    /// bounds the decoding sessions' inter-token latency while it prefills.
    pub busy_chunk_rows_max: AtomicU64,
    pub sessions_opened: AtomicU64,
    /// Speculative steps verified (the last stage), and their drafts accepted and rejected.
    pub verify_steps: AtomicU64,
    pub drafts_accepted: AtomicU64,
    pub drafts_rejected: AtomicU64,
    /// Decode steps a ring session's last stage started here (the first stage), with no driver.
    pub ring_steps: AtomicU64,
    /// Embeddings sent (the last stage of embedding sessions).
    pub embeddings: AtomicU64,
    pub sessions_closed: AtomicU64,
    /// Connections being served now (stage protocol and HTTP), at most `max_connections`.
    pub connections_open: AtomicU64,
    /// Connections closed at once because `max_connections` were open.
    pub connections_refused: AtomicU64,
    /// Connections closed for sending no handshake within the handshake timeout.
    pub handshake_timeouts: AtomicU64,
    /// Connections closed for holding no session and sending nothing for the connection idle timeout.
    pub idle_closed: AtomicU64,
    /// Frames of hidden rows refused for holding a NaN or an infinity.
    pub nonfinite_frames: AtomicU64,
    /// Prefix-cache blocks (of `PREFIX_BLOCK` positions) sessions attached instead of computing,
    /// and blocks their prompts named that they computed.
    pub prefix_hit_blocks: AtomicU64,
    pub prefix_miss_blocks: AtomicU64,
    /// Blocks and bytes the prefix cache holds now.
    pub prefix_blocks: AtomicU64,
    pub prefix_bytes: AtomicU64,
    pub prefix_bytes_capacity: AtomicU64,
    /// 1 once the scheduler has begun a drain (SIGTERM): from then on it refuses new sessions.
    pub draining: AtomicU64,
    /// The memory of the stage's GPU, last read (none on the CPU).
    pub device_memory: Mutex<Option<dgr_engine::DeviceMemory>>,
    /// The engine id the stage computes with, set once it is open (the `dgr_worker_info` label).
    pub engine: OnceLock<String>,
    /// The route digests of the prefix blocks held, most recently used first, and a count that
    /// moves with each new list: what the heartbeats report (a tracker hears a list once).
    held: Mutex<(u64, Arc<Vec<u64>>)>,
    /// When sessions opened lately, and their tags (`session_tag`), newest last: what the
    /// heartbeats name, so a tracker counts each new session's reservation once.
    opened: Mutex<VecDeque<(Instant, u64)>>,
    failures: Mutex<Vec<(ErrorKind, u64)>>,
    tickets_refused: Mutex<Vec<(TicketError, u64)>>,
    batches: Mutex<Vec<BatchCount>>,
}

/// Per (phase, seam dtype): batches run and the most sessions one of them held.
type BatchCount = ((Phase, SeamDtype), u64, u64);

impl Metrics {
    pub fn set_held(&self, digests: Vec<u64>) {
        let mut h = self.held.lock().unwrap_or_else(|p| p.into_inner());
        *h = (h.0 + 1, Arc::new(digests));
    }

    /// The current list of held digests and its version (0: none published yet).
    pub fn held(&self) -> (u64, Arc<Vec<u64>>) {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Names a session as opened, once its reservation is published: the lock orders those
    /// stores before any heartbeat's `opened_lately` that names it.
    pub fn opened(&self, id: &SessionId, now: Instant) {
        let mut o = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        Self::forget_opened(&mut o, now);
        if o.len() == MAX_OPENED_TAGS {
            o.pop_front();
        }
        o.push_back((now, session_tag(id)));
    }

    /// The tags of the sessions opened in the last `OPENED_WINDOW`, newest first.
    pub fn opened_lately(&self, now: Instant) -> Vec<u64> {
        let mut o = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        Self::forget_opened(&mut o, now);
        o.iter().rev().map(|&(_, tag)| tag).collect()
    }

    fn forget_opened(o: &mut VecDeque<(Instant, u64)>, now: Instant) {
        while o.front().is_some_and(|&(at, _)| now.saturating_duration_since(at) > OPENED_WINDOW) {
            o.pop_front();
        }
    }

    pub fn failure(&self, kind: ErrorKind) {
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        match f.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => f.push((kind, 1)),
        }
    }

    pub fn ticket_refused(&self, why: TicketError) {
        self.failure(ErrorKind::Ticket);
        let mut t = self.tickets_refused.lock().unwrap_or_else(|p| p.into_inner());
        match t.iter_mut().find(|(k, _)| *k == why) {
            Some((_, n)) => *n += 1,
            None => t.push((why, 1)),
        }
    }

    pub fn batch(&self, phase: Phase, dtype: SeamDtype, sessions: usize) {
        let mut b = self.batches.lock().unwrap_or_else(|p| p.into_inner());
        match b.iter_mut().find(|(k, _, _)| *k == (phase, dtype)) {
            Some((_, n, max)) => {
                *n += 1;
                *max = (*max).max(sessions as u64);
            }
            None => b.push(((phase, dtype), 1, sessions as u64)),
        }
    }

    pub fn render(&self) -> String {
        let mut t = Text::new();
        let get = |a: &AtomicU64| a.load(Relaxed);
        t.metric("dgr_worker_rss_bytes", "Resident set size of the worker process.", Gauge, rss_bytes());
        t.metric("dgr_worker_weight_bytes", "Bytes of the weights this stage reads.", Gauge, get(&self.weight_bytes));
        if let Some(engine) = self.engine.get() {
            t.family("dgr_worker_info", "What this worker computes with (always 1).", Gauge).sample(&[("engine", engine)], 1);
        }
        if let Some(m) = *self.device_memory.lock().unwrap_or_else(|p| p.into_inner()) {
            let mut f = t.family(
                "dgr_worker_device_memory_bytes",
                "The GPU's device-local memory: total, used by this worker, and free to it.",
                Gauge,
            );
            f.sample(&[("kind", "total")], m.total);
            f.sample(&[("kind", "used")], m.used);
            f.sample(&[("kind", "free")], m.free);
        }
        t.metric("dgr_worker_sessions_open", "Sessions holding state on this worker.", Gauge, get(&self.sessions_open));
        t.metric("dgr_worker_kv_bytes_used", "KV cache bytes held by open sessions.", Gauge, get(&self.kv_bytes_used));
        t.metric("dgr_worker_kv_bytes_capacity", "KV cache bytes this worker may hold.", Gauge, get(&self.kv_bytes_capacity));
        t.metric(
            "dgr_worker_kv_tokens_reserved",
            "KV positions open sessions reserved (prompt and most tokens), over all held layers.",
            Gauge,
            get(&self.kv_tokens_reserved),
        );
        t.metric(
            "dgr_worker_prefix_cache_hit_blocks_total",
            "Prefix-cache blocks (16 positions each) sessions attached instead of prefilling.",
            Counter,
            get(&self.prefix_hit_blocks),
        );
        t.metric(
            "dgr_worker_prefix_cache_miss_blocks_total",
            "Full blocks of prompts (16 positions each) that were prefilled, not attached.",
            Counter,
            get(&self.prefix_miss_blocks),
        );
        t.metric("dgr_worker_prefix_cache_blocks", "Blocks the prefix cache holds.", Gauge, get(&self.prefix_blocks));
        t.metric("dgr_worker_prefix_cache_bytes", "Bytes the prefix cache holds.", Gauge, get(&self.prefix_bytes));
        t.metric(
            "dgr_worker_prefix_cache_bytes_capacity",
            "Bytes the prefix cache may hold (0: off).",
            Gauge,
            get(&self.prefix_bytes_capacity),
        );
        t.metric("dgr_worker_queue_depth", "Forward requests waiting for a step.", Gauge, get(&self.queue_depth));
        t.metric("dgr_worker_tokens_prefilled_total", "Prompt rows computed.", Counter, get(&self.tokens_prefilled));
        t.metric("dgr_worker_tokens_decoded_total", "Decode rows computed.", Counter, get(&self.tokens_decoded));
        t.metric("dgr_worker_steps_total", "Batched forward steps run.", Counter, get(&self.steps));
        t.metric("dgr_worker_step_rows_total", "Rows computed over all steps.", Counter, get(&self.step_rows));
        t.metric("dgr_worker_step_seconds_total", "Time spent in forward steps.", Counter, get(&self.step_micros) as f64 / 1e6);
        t.metric("dgr_worker_batch_sessions", "Sessions in the most recent step.", Gauge, get(&self.last_batch_sessions));
        t.metric(
            "dgr_worker_busy_chunk_rows_max",
            "Most rows of a long prompt run in one step that also decoded.",
            Gauge,
            get(&self.busy_chunk_rows_max),
        );
        t.metric("dgr_worker_sessions_opened_total", "Sessions opened.", Counter, get(&self.sessions_opened));
        t.metric("dgr_worker_embeddings_total", "Embeddings pooled and sent (last stage).", Counter, get(&self.embeddings));
        t.metric("dgr_worker_verify_steps_total", "Speculative steps verified (last stage).", Counter, get(&self.verify_steps));
        t.metric(
            "dgr_worker_ring_steps_total",
            "Decode steps that came round a ring from its last stage (first stage).",
            Counter,
            get(&self.ring_steps),
        );
        let mut drafts = t.family("dgr_worker_draft_tokens_total", "Draft tokens verified (last stage), by outcome.", Counter);
        drafts.sample(&[("outcome", "accepted")], get(&self.drafts_accepted));
        drafts.sample(&[("outcome", "rejected")], get(&self.drafts_rejected));
        t.metric(
            "dgr_worker_sessions_closed_total",
            "Sessions freed (closed, cancelled, failed or idle).",
            Counter,
            get(&self.sessions_closed),
        );
        t.metric("dgr_worker_connections_open", "Connections open now.", Gauge, get(&self.connections_open));
        t.metric("dgr_worker_draining", "1 once a drain has begun: new sessions are refused.", Gauge, get(&self.draining));
        t.metric(
            "dgr_worker_connections_refused_total",
            "Connections closed at once because --max-connections were open.",
            Counter,
            get(&self.connections_refused),
        );
        t.metric(
            "dgr_worker_nonfinite_frames_total",
            "Frames of hidden rows refused for NaN or infinite values.",
            Counter,
            get(&self.nonfinite_frames),
        );
        let mut closed = t.family("dgr_worker_connections_closed_total", "Connections the worker closed, by reason.", Counter);
        closed.sample(&[("reason", "handshake_timeout")], get(&self.handshake_timeouts));
        closed.sample(&[("reason", "idle")], get(&self.idle_closed));
        let batches = self.batches.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let labels =
            |p: &Phase, d: &SeamDtype| [("phase", if *p == Phase::Decode { "decode" } else { "prefill" }), ("seam_dtype", d.name())];
        let mut runs = t.family("dgr_worker_batches_total", "Batched forwards by phase and seam dtype.", Counter);
        for ((p, d), n, _) in &batches {
            runs.sample(&labels(p, d), n);
        }
        let mut most = t.family("dgr_worker_batch_sessions_max", "Most sessions in one batch, by phase and seam dtype.", Gauge);
        for ((p, d), _, m) in &batches {
            most.sample(&labels(p, d), m);
        }
        let mut failures = t.family("dgr_worker_failures_total", "Failures by kind.", Counter);
        for (k, n) in self.failures.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            failures.sample(&[("kind", k.name())], n);
        }
        let refused = self.tickets_refused.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut tickets = t.family("dgr_worker_ticket_refusals_total", "Session opens refused for their route ticket, by reason.", Counter);
        for why in TicketError::ALL {
            let n = refused.iter().find(|(k, _)| *k == why).map_or(0, |(_, n)| *n);
            tickets.sample(&[("reason", why.name())], n);
        }
        t.finish()
    }
}

/// This process's resident set size, from /proc (0 where that is unavailable).
pub fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    pages * 4096
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn heartbeats_name_the_sessions_opened_in_the_last_window_newest_first() {
        let (m, t0) = (Metrics::default(), Instant::now());
        let id = |i: u64| -> SessionId { [i.to_le_bytes(), [7; 8]].concat().try_into().unwrap() };
        m.opened(&id(1), t0);
        m.opened(&id(2), t0 + Duration::from_millis(600));
        assert_eq!(m.opened_lately(t0 + Duration::from_millis(900)), [2, 1]);
        assert_eq!(m.opened_lately(t0 + OPENED_WINDOW + Duration::from_millis(1)), [2]);
        // However many open within the window, a heartbeat names only the newest it may.
        let t1 = t0 + Duration::from_secs(5);
        (0..MAX_OPENED_TAGS as u64 + 10).for_each(|i| m.opened(&id(i), t1));
        let named = m.opened_lately(t1);
        assert_eq!((named.len(), named[0], *named.last().unwrap()), (MAX_OPENED_TAGS, MAX_OPENED_TAGS as u64 + 9, 10));
    }
}

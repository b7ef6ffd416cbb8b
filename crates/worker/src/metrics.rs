//! What a worker reports at /metrics, as Prometheus text.

use crate::compat::Phase;
use dgr_proto::{ErrorKind, SeamDtype, TicketError};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

#[derive(Default)]
pub struct Metrics {
    pub sessions_open: AtomicU64,
    pub kv_bytes_used: AtomicU64,
    /// KV positions reserved by open sessions.
    pub kv_tokens_used: AtomicU64,
    pub kv_bytes_capacity: AtomicU64,
    pub queue_depth: AtomicU64,
    pub weight_bytes: AtomicU64,
    pub tokens_prefilled: AtomicU64,
    pub tokens_decoded: AtomicU64,
    pub steps: AtomicU64,
    pub step_rows: AtomicU64,
    pub step_micros: AtomicU64,
    pub last_batch_sessions: AtomicU64,
    pub sessions_opened: AtomicU64,
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
    failures: Mutex<Vec<(ErrorKind, u64)>>,
    tickets_refused: Mutex<Vec<(TicketError, u64)>>,
    batches: Mutex<Vec<BatchCount>>,
}

/// Per (phase, seam dtype): batches run and the most sessions one of them held.
type BatchCount = ((Phase, SeamDtype), u64, u64);

impl Metrics {
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
        let mut out = String::new();
        let mut line = |name: &str, help: &str, kind: &str, v: &dyn std::fmt::Display| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"));
        };
        let get = |a: &AtomicU64| a.load(Relaxed);
        line("dgr_worker_rss_bytes", "Resident set size of the worker process.", "gauge", &rss_bytes());
        line("dgr_worker_weight_bytes", "Bytes of the weights this stage reads.", "gauge", &get(&self.weight_bytes));
        line("dgr_worker_sessions_open", "Sessions holding state on this worker.", "gauge", &get(&self.sessions_open));
        line("dgr_worker_kv_bytes_used", "KV cache bytes held by open sessions.", "gauge", &get(&self.kv_bytes_used));
        line("dgr_worker_kv_bytes_capacity", "KV cache bytes this worker may hold.", "gauge", &get(&self.kv_bytes_capacity));
        line("dgr_worker_queue_depth", "Forward requests waiting for a step.", "gauge", &get(&self.queue_depth));
        line("dgr_worker_tokens_prefilled_total", "Prompt rows computed.", "counter", &get(&self.tokens_prefilled));
        line("dgr_worker_tokens_decoded_total", "Decode rows computed.", "counter", &get(&self.tokens_decoded));
        line("dgr_worker_steps_total", "Batched forward steps run.", "counter", &get(&self.steps));
        line("dgr_worker_step_rows_total", "Rows computed over all steps.", "counter", &get(&self.step_rows));
        line("dgr_worker_step_seconds_total", "Time spent in forward steps.", "counter", &(get(&self.step_micros) as f64 / 1e6));
        line("dgr_worker_batch_sessions", "Sessions in the most recent step.", "gauge", &get(&self.last_batch_sessions));
        line("dgr_worker_sessions_opened_total", "Sessions opened.", "counter", &get(&self.sessions_opened));
        line(
            "dgr_worker_sessions_closed_total",
            "Sessions freed (closed, cancelled, failed or idle).",
            "counter",
            &get(&self.sessions_closed),
        );
        line("dgr_worker_connections_open", "Connections open now.", "gauge", &get(&self.connections_open));
        line(
            "dgr_worker_connections_refused_total",
            "Connections closed at once because --max-connections were open.",
            "counter",
            &get(&self.connections_refused),
        );
        line(
            "dgr_worker_nonfinite_frames_total",
            "Frames of hidden rows refused for NaN or infinite values.",
            "counter",
            &get(&self.nonfinite_frames),
        );
        out.push_str(
            "# HELP dgr_worker_connections_closed_total Connections the worker closed, by reason.\n# TYPE dgr_worker_connections_closed_total counter\n",
        );
        out.push_str(&format!("dgr_worker_connections_closed_total{{reason=\"handshake_timeout\"}} {}\n", get(&self.handshake_timeouts)));
        out.push_str(&format!("dgr_worker_connections_closed_total{{reason=\"idle\"}} {}\n", get(&self.idle_closed)));
        out.push_str(
            "# HELP dgr_worker_batches_total Batched forwards by phase and seam dtype.\n# TYPE dgr_worker_batches_total counter\n",
        );
        let batches = self.batches.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let label = |p: &Phase, d: &SeamDtype| {
            format!("phase=\"{}\",seam_dtype=\"{}\"", if *p == Phase::Decode { "decode" } else { "prefill" }, d.name())
        };
        for ((p, d), n, _) in &batches {
            out.push_str(&format!("dgr_worker_batches_total{{{}}} {n}\n", label(p, d)));
        }
        out.push_str("# HELP dgr_worker_batch_sessions_max Most sessions in one batch, by phase and seam dtype.\n# TYPE dgr_worker_batch_sessions_max gauge\n");
        for ((p, d), _, m) in &batches {
            out.push_str(&format!("dgr_worker_batch_sessions_max{{{}}} {m}\n", label(p, d)));
        }
        out.push_str("# HELP dgr_worker_failures_total Failures by kind.\n# TYPE dgr_worker_failures_total counter\n");
        for (k, n) in self.failures.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            out.push_str(&format!("dgr_worker_failures_total{{kind=\"{}\"}} {n}\n", k.name()));
        }
        out.push_str("# HELP dgr_worker_ticket_refusals_total Session opens refused for their route ticket, by reason.\n# TYPE dgr_worker_ticket_refusals_total counter\n");
        let refused = self.tickets_refused.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for why in TicketError::ALL {
            let n = refused.iter().find(|(k, _)| *k == why).map_or(0, |(_, n)| *n);
            out.push_str(&format!("dgr_worker_ticket_refusals_total{{reason=\"{}\"}} {n}\n", why.name()));
        }
        out
    }
}

/// This process's resident set size, from /proc (0 where that is unavailable).
pub fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    pages * 4096
}

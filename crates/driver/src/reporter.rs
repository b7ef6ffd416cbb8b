//! Usage reports of finished requests, sent in the background until a tracker stores each:
//! every tracker of the swarm is tried in turn, with backoff while none answers; a report is
//! never dropped for want of a tracker. The queue is bounded: when it is full, `submit` says so
//! loudly, counts it, and waits for room (the request's own task holds its report meanwhile, so
//! memory stays bounded by the requests admitted).

use crate::trackers::{fails_over, Trackers};
use dgr_proto::{RequestUsage, TrackerBody};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// What the reporter has done, for /metrics.
#[derive(Default)]
pub struct ReportStats {
    /// Reports submitted and not yet stored (queued, being sent, or waiting for room).
    pub pending: AtomicU64,
    pub recorded: AtomicU64,
    /// Sends that reached no tracker, each followed by a retry.
    pub retries: AtomicU64,
    /// Submits that found the queue full and had to wait.
    pub queue_full: AtomicU64,
    /// Reports a tracker refused for good (a malformed report or an unknown key).
    pub refused: AtomicU64,
}

pub struct UsageReporter {
    tx: mpsc::Sender<RequestUsage>,
    pub stats: Arc<ReportStats>,
}

impl UsageReporter {
    /// Starts the background sender (on the current tokio runtime) with a queue of `queue`.
    pub fn start(trackers: Arc<Trackers>, queue: usize) -> UsageReporter {
        let (tx, mut rx) = mpsc::channel::<RequestUsage>(queue.max(1));
        let stats = Arc::new(ReportStats::default());
        let s = stats.clone();
        tokio::spawn(async move {
            while let Some(u) = rx.recv().await {
                let id = u.request_id.clone();
                match report_until(&trackers, u, None, &s).await {
                    Ok(()) => {
                        s.recorded.fetch_add(1, Relaxed);
                    }
                    Err(why) => {
                        s.refused.fetch_add(1, Relaxed);
                        eprintln!("dgr: usage of request {id} was refused by the tracker: {why}");
                    }
                }
                s.pending.fetch_sub(1, Relaxed);
            }
        });
        UsageReporter { tx, stats }
    }

    /// Queues the report; when the queue is full, says so and waits for room.
    pub async fn submit(&self, u: RequestUsage) {
        self.stats.pending.fetch_add(1, Relaxed);
        if let Err(mpsc::error::TrySendError::Full(u)) = self.tx.try_send(u) {
            let n = self.stats.queue_full.fetch_add(1, Relaxed) + 1;
            eprintln!(
                "dgr: the usage report queue is full ({} reports wait for a tracker; {n} times so far): request {} waits for room",
                self.stats.pending.load(Relaxed),
                u.request_id
            );
            // The sender lives as long as the runtime: a send fails only at shutdown.
            let _ = self.tx.send(u).await;
        }
    }
}

/// Sends `u` across the trackers until one stores it (or had it already), or until `give_up`
/// passes: Err says why it was not stored.
pub(crate) async fn report_until(
    trackers: &Trackers,
    u: RequestUsage,
    give_up: Option<Instant>,
    stats: &ReportStats,
) -> Result<(), String> {
    let mut backoff = BACKOFF_MIN;
    loop {
        let why = match trackers.call(TrackerBody::RequestUsage(u.clone())).await {
            Ok(TrackerBody::Ack(_)) => return Ok(()),
            Ok(_) => "an unexpected answer".to_string(),
            Err(e) if !fails_over(&e) => return Err(e.to_string()),
            Err(e) => e.to_string(),
        };
        stats.retries.fetch_add(1, Relaxed);
        if give_up.is_some_and(|t| Instant::now() + backoff >= t) {
            return Err(format!("not recorded: {why}"));
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

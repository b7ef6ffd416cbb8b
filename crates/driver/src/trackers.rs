//! A driver's trackers: every tracker of the swarm it was given (`A,B`), each call going first
//! to the one that answered last and, when that one cannot answer (connection refused, timed
//! out or dropped, or it says it cannot serve now), to the next. The trackers share one ledger
//! and one key set, so any of them may route and record; request ids are idempotent there, so
//! asking another after a failure never bills twice.

use dgr_proto::{RefusalKind, TrackerBody, TrackerCallError, TrackerClient};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Idle connections kept per tracker for the next calls.
const POOL: usize = 64;

pub struct Trackers {
    addrs: Vec<String>,
    /// The index of the tracker that answered last.
    preferred: AtomicUsize,
    pools: Vec<Mutex<Vec<TrackerClient>>>,
    timeout: Duration,
}

impl Trackers {
    /// The trackers of a comma-separated list of addresses; `timeout` bounds each connect,
    /// send and answer.
    pub fn new(list: &str, timeout: Duration) -> Trackers {
        let addrs: Vec<String> = list.split(',').map(str::trim).filter(|a| !a.is_empty()).map(String::from).collect();
        let pools = addrs.iter().map(|_| Mutex::new(Vec::new())).collect();
        Trackers { addrs, preferred: AtomicUsize::new(0), pools, timeout }
    }

    pub fn addrs(&self) -> &[String] {
        &self.addrs
    }

    /// One exchange with the first tracker that answers; a refusal is an answer (the request
    /// is wrong everywhere), except one that says this tracker cannot serve now.
    pub async fn call(&self, body: TrackerBody) -> Result<TrackerBody, TrackerCallError> {
        let n = self.addrs.len();
        let first = self.preferred.load(Relaxed);
        let mut failed = no_tracker();
        for k in 0..n {
            let i = (first + k) % n;
            match self.call_at(i, body.clone()).await {
                Err(e) if fails_over(&e) => failed = e,
                answer => {
                    self.preferred.store(i, Relaxed);
                    return answer;
                }
            }
        }
        Err(failed)
    }

    /// The same message to every tracker (what each keeps in memory besides the shared ledger,
    /// such as a quarantine): Ok with the first answer if any tracker took it.
    pub async fn broadcast(&self, body: TrackerBody) -> Result<TrackerBody, TrackerCallError> {
        let calls = (0..self.addrs.len()).map(|i| self.call_at(i, body.clone()));
        let answers = futures::future::join_all(calls).await;
        answers.into_iter().reduce(|kept, next| if kept.is_ok() { kept } else { next }).unwrap_or_else(|| Err(no_tracker()))
    }

    /// One exchange with tracker `i` over a pooled connection; one that turns out broken (the
    /// tracker restarted) is replaced once.
    async fn call_at(&self, i: usize, body: TrackerBody) -> Result<TrackerBody, TrackerCallError> {
        let addr = &self.addrs[i];
        let pooled = lock(&self.pools[i]).pop();
        let was_pooled = pooled.is_some();
        let mut c = match pooled {
            Some(c) => c,
            None => TrackerClient::connect(addr, self.timeout).await?,
        };
        let mut answer = c.call(body.clone()).await;
        if was_pooled && matches!(answer, Err(TrackerCallError::Io { .. } | TrackerCallError::Protocol { .. })) {
            c = TrackerClient::connect(addr, self.timeout).await?;
            answer = c.call(body).await;
        }
        if matches!(answer, Ok(_) | Err(TrackerCallError::Refused(_))) {
            let mut pool = lock(&self.pools[i]);
            if pool.len() < POOL {
                pool.push(c);
            }
        }
        answer
    }
}

/// Whether another tracker should be asked: this one did not answer, or answered that it
/// cannot serve now (its store failed, its ledger is unreachable, or it is overloaded).
pub fn fails_over(e: &TrackerCallError) -> bool {
    match e {
        TrackerCallError::Refused(r) => {
            matches!(r.refusal_kind(), RefusalKind::Internal | RefusalKind::Overloaded | RefusalKind::Unavailable)
        }
        TrackerCallError::Io { .. } | TrackerCallError::Protocol { .. } | TrackerCallError::Key { .. } => true,
    }
}

fn no_tracker() -> TrackerCallError {
    TrackerCallError::Io { addr: String::new(), why: "no tracker given".into() }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use dgr_proto::Refused;

    fn refused(kind: RefusalKind) -> TrackerCallError {
        TrackerCallError::Refused(Refused::new(kind, "test"))
    }

    #[test]
    fn only_a_tracker_that_cannot_serve_now_fails_over() {
        let now = [RefusalKind::Internal, RefusalKind::Overloaded, RefusalKind::Unavailable];
        let everywhere = [
            RefusalKind::BadRequest,
            RefusalKind::BadJoinToken,
            RefusalKind::BadSignature,
            RefusalKind::NoRoute,
            RefusalKind::BadApiKey,
            RefusalKind::QuotaExceeded,
            RefusalKind::NotConnected,
            RefusalKind::Full,
        ];
        for k in now {
            assert!(fails_over(&refused(k)), "{} must fail over", k.name());
        }
        for k in everywhere {
            assert!(!fails_over(&refused(k)), "{} is the same answer at every tracker", k.name());
        }
        assert!(fails_over(&TrackerCallError::Io { addr: "a".into(), why: "refused".into() }));
    }
}

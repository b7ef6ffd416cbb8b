//! Admission: at most `running` generations at once; up to `queue` more wait, each for at most
//! `timeout`. Past that a request is refused at once (429 when the queue is full, 503 when its
//! wait ran out), with Retry-After.

use crate::api_error::ApiError;
use axum::http::StatusCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub struct Admission {
    running: Arc<Semaphore>,
    waiting: AtomicUsize,
    queue: usize,
    timeout: Duration,
}

/// Decrements the waiting count however the wait ends.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    pub fn new(running: usize, queue: usize, timeout: Duration) -> Admission {
        Admission { running: Arc::new(Semaphore::new(running.max(1))), waiting: AtomicUsize::new(0), queue, timeout }
    }

    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    pub fn running(&self, limit: usize) -> usize {
        limit.saturating_sub(self.running.available_permits())
    }

    pub async fn enter(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        if let Ok(p) = self.running.clone().try_acquire_owned() {
            return Ok(p);
        }
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.queue {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "the gateway's queue is full")
                .code("queue_full")
                .retry_after(1));
        }
        let _w = Waiting(&self.waiting);
        match tokio::time::timeout(self.timeout, self.running.clone().acquire_owned()).await {
            Ok(Ok(p)) => Ok(p),
            _ => Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", "no capacity before the queue deadline")
                .code("queue_timeout")
                .retry_after(1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn full_queues_refuse_at_once_and_waits_end_at_their_deadline() {
        let a = Arc::new(Admission::new(1, 1, Duration::from_millis(100)));
        let held = a.enter().await.unwrap();
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.enter().await.map(|_| ()) })
        };
        tokio::task::yield_now().await;
        assert_eq!(a.waiting(), 1);
        let full = a.enter().await.unwrap_err();
        assert_eq!((full.status, full.retry_after), (StatusCode::TOO_MANY_REQUESTS, Some(1)));
        let timed_out = waiter.await.unwrap().unwrap_err();
        assert_eq!(timed_out.status, StatusCode::SERVICE_UNAVAILABLE);
        drop(held);
        assert!(a.enter().await.is_ok());
        assert_eq!(a.waiting(), 0);
    }
}

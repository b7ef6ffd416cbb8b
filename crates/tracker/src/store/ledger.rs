//! The ledger as the async tracker reaches it: store threads, each with its own connection,
//! taking calls from one bounded queue, so no database call ever runs on (or blocks) a tokio
//! worker thread, and a slow or dead database costs a caller at most `ANSWER`.

use super::{LedgerSpec, Store, StoreError};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Calls waiting for a store thread; more are refused as `Busy`.
const QUEUE: usize = 4096;
/// A call not answered within this long is `Unavailable` (the store thread may still finish it:
/// every write is idempotent or settles by itself, so a late one does no harm).
const ANSWER: Duration = Duration::from_secs(10);

type Job = Box<dyn FnOnce(&mut Store) + Send>;

#[derive(Clone)]
pub struct Ledger {
    jobs: SyncSender<Job>,
}

impl Ledger {
    /// Opens `threads` connections (migrating the schema on the first) and starts a store
    /// thread on each. The threads end when the last `Ledger` handle is dropped.
    pub fn start(spec: &LedgerSpec, threads: usize) -> Result<Ledger, StoreError> {
        let (jobs, rx) = sync_channel::<Job>(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let (ready, opened) = sync_channel(1);
            let (spec, rx) = (spec.clone(), rx.clone());
            let spawned = std::thread::Builder::new().name(format!("dgr-ledger-{i}")).spawn(move || match Store::open(&spec) {
                Ok(store) => {
                    let _ = ready.send(Ok(()));
                    serve(store, &rx);
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                }
            });
            spawned.map_err(|e| StoreError::Unavailable(format!("starting a store thread: {e}")))?;
            opened.recv().map_err(|_| StoreError::Unavailable("a store thread died opening the ledger".into()))??;
        }
        Ok(Ledger { jobs })
    }

    /// Runs `f` on a store thread and waits for it, within `ANSWER`.
    pub async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(Box::new(move |s| {
            let _ = tx.send(f(s));
        }))?;
        match tokio::time::timeout(ANSWER, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(StoreError::Unavailable("a store thread stopped".into())),
            Err(_) => Err(StoreError::Unavailable(format!("no answer from the ledger within {ANSWER:?}"))),
        }
    }

    /// `call` for a thread that is not async (start-up, tests, benches).
    pub fn call_blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = sync_channel(1);
        self.submit(Box::new(move |s| {
            let _ = tx.send(f(s));
        }))?;
        rx.recv_timeout(ANSWER).map_err(|_| StoreError::Unavailable(format!("no answer from the ledger within {ANSWER:?}")))?
    }

    fn submit(&self, job: Job) -> Result<(), StoreError> {
        self.jobs.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => StoreError::Busy(format!("{QUEUE} calls waiting")),
            TrySendError::Disconnected(_) => StoreError::Unavailable("the store threads stopped".into()),
        })
    }
}

fn serve(mut store: Store, jobs: &Mutex<Receiver<Job>>) {
    loop {
        // One thread waits in recv while holding the lock; the others wait for the lock.
        let job = jobs.lock().unwrap_or_else(|p| p.into_inner()).recv();
        let Ok(job) = job else { return };
        job(&mut store);
    }
}

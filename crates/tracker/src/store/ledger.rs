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

/// Calls one store thread takes from the queue at once and runs in one transaction.
const GROUP: usize = 64;

/// A call waiting for a store thread: run (again, if its group failed), then answered.
trait Call: Send {
    /// Runs it; whether it succeeded.
    fn run(&mut self, store: &mut Store) -> bool;
    /// Answers the caller with what its last run returned.
    fn answer(self: Box<Self>);
}

struct Pending<T, F> {
    f: F,
    out: Option<Result<T, StoreError>>,
    reply: Box<dyn FnOnce(Result<T, StoreError>) + Send>,
}

impl<T: Send, F: FnMut(&mut Store) -> Result<T, StoreError> + Send> Call for Pending<T, F> {
    fn run(&mut self, store: &mut Store) -> bool {
        let out = (self.f)(store);
        let ok = out.is_ok();
        self.out = Some(out);
        ok
    }

    fn answer(self: Box<Self>) {
        (self.reply)(self.out.unwrap_or_else(|| Err(StoreError::Unavailable("a call was never run".into()))));
    }
}

type Job = Box<dyn Call>;
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

    /// Runs `f` on a store thread and waits for it, within `ANSWER`. `f` may run twice: in a
    /// group of calls, and alone if that group's transaction failed (rolled back).
    pub async fn call<T: Send + 'static>(
        &self,
        f: impl FnMut(&mut Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(f, move |out| {
            let _ = tx.send(out);
        })?;
        match tokio::time::timeout(ANSWER, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(StoreError::Unavailable("a store thread stopped".into())),
            Err(_) => Err(StoreError::Unavailable(format!("no answer from the ledger within {ANSWER:?}"))),
        }
    }

    /// `call` for a thread that is not async (start-up, tests, benches).
    pub fn call_blocking<T: Send + 'static>(
        &self,
        f: impl FnMut(&mut Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = sync_channel(1);
        self.submit(f, move |out| {
            let _ = tx.send(out);
        })?;
        rx.recv_timeout(ANSWER).map_err(|_| StoreError::Unavailable(format!("no answer from the ledger within {ANSWER:?}")))?
    }

    fn submit<T: Send + 'static>(
        &self,
        f: impl FnMut(&mut Store) -> Result<T, StoreError> + Send + 'static,
        reply: impl FnOnce(Result<T, StoreError>) + Send + 'static,
    ) -> Result<(), StoreError> {
        let job: Job = Box::new(Pending { f, out: None, reply: Box::new(reply) });
        self.jobs.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => StoreError::Busy(format!("{QUEUE} calls waiting")),
            TrySendError::Disconnected(_) => StoreError::Unavailable("the store threads stopped".into()),
        })
    }
}

/// Takes what is queued (up to `GROUP` calls) and runs it in one transaction, so many requests
/// share one commit: the database's write lock, BEGIN and COMMIT and the log flush are paid once
/// per group (`Store::run_grouped`: a call that fails makes each run again alone).
fn serve(mut store: Store, jobs: &Mutex<Receiver<Job>>) {
    loop {
        let mut calls = Vec::new();
        {
            // One thread waits in recv while holding the lock; the others wait for the lock.
            let rx = jobs.lock().unwrap_or_else(|p| p.into_inner());
            let Ok(first) = rx.recv() else { return };
            calls.push(first);
            calls.extend(std::iter::from_fn(|| rx.try_recv().ok()).take(GROUP - 1));
        }
        store.run_grouped(&mut calls, |c, s| c.run(s));
        for c in calls {
            c.answer();
        }
    }
}

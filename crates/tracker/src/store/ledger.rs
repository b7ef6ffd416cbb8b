//! The ledger as the async tracker reaches it: store threads, each with its own connection,
//! taking calls from one bounded queue, so no database call ever runs on (or blocks) a tokio
//! worker thread, and a slow or dead database costs a caller at most `ANSWER`.

use super::{Grant, LedgerSpec, Report, Reservation, Store, StoreError};
use dgr_proto::RequestUsage;
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
    /// A reservation or a usage report, which a group settles together (`Store::settle_group`).
    fn batched(&mut self) -> Batched<'_> {
        Batched::No
    }
    /// Whether `batched` is a reservation or a usage report.
    fn is_batched(&self) -> bool {
        false
    }
}

type Out<T> = Option<Result<T, StoreError>>;

/// What a call is to its group, with the place its answer goes.
enum Batched<'a> {
    No,
    Reserve(&'a Reservation, &'a mut Out<Grant>),
    Record(&'a Report, &'a mut Out<Option<bool>>),
}

type Reply<T> = Box<dyn FnOnce(Result<T, StoreError>) + Send>;

struct Pending<T, F> {
    f: F,
    out: Out<T>,
    reply: Reply<T>,
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

/// A call a group runs together with the others of its kind (`Kind`).
struct Grouped<A: Kind> {
    args: A,
    out: Out<A::Out>,
    reply: Reply<A::Out>,
}

trait Kind: Send + Sized + 'static {
    type Out: Send + 'static;
    fn alone(&self, store: &mut Store) -> Result<Self::Out, StoreError>;
    fn batched<'a>(&'a self, out: &'a mut Out<Self::Out>) -> Batched<'a>;
}

impl Kind for Reservation {
    type Out = Grant;
    fn alone(&self, store: &mut Store) -> Result<Grant, StoreError> {
        store.reserve_call(self)
    }
    fn batched<'a>(&'a self, out: &'a mut Out<Grant>) -> Batched<'a> {
        Batched::Reserve(self, out)
    }
}

impl Kind for Report {
    type Out = Option<bool>;
    fn alone(&self, store: &mut Store) -> Result<Option<bool>, StoreError> {
        store.record_report(self)
    }
    fn batched<'a>(&'a self, out: &'a mut Out<Option<bool>>) -> Batched<'a> {
        Batched::Record(self, out)
    }
}

impl<A: Kind> Call for Grouped<A> {
    fn run(&mut self, store: &mut Store) -> bool {
        let out = self.args.alone(store);
        let ok = out.is_ok();
        self.out = Some(out);
        ok
    }

    fn answer(self: Box<Self>) {
        (self.reply)(self.out.unwrap_or_else(|| Err(StoreError::Unavailable("a call was never run".into()))));
    }

    fn batched(&mut self) -> Batched<'_> {
        self.args.batched(&mut self.out)
    }

    fn is_batched(&self) -> bool {
        true
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
        self.ask(|reply| Box::new(Pending { f, out: None, reply })).await
    }

    /// `Store::reserve`, settled with the other calls of its group (`Store::settle_group`).
    pub async fn reserve(&self, r: Reservation) -> Result<Grant, StoreError> {
        self.ask(|reply| Box::new(Grouped { args: r, out: None, reply })).await
    }

    /// `Store::record_report`, settled with the other calls of its group (`Store::settle_group`).
    pub async fn record(&self, usage: RequestUsage, now_ms: u64) -> Result<Option<bool>, StoreError> {
        self.ask(|reply| Box::new(Grouped { args: Report { usage, now_ms }, out: None, reply })).await
    }

    async fn ask<T: Send + 'static>(&self, job: impl FnOnce(Reply<T>) -> Job) -> Result<T, StoreError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(job(Box::new(move |out| {
            let _ = tx.send(out);
        })))?;
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
        let reply: Reply<T> = Box::new(move |out| {
            let _ = tx.send(out);
        });
        self.submit(Box::new(Pending { f, out: None, reply }))?;
        rx.recv_timeout(ANSWER).map_err(|_| StoreError::Unavailable(format!("no answer from the ledger within {ANSWER:?}")))?
    }

    fn submit(&self, job: Job) -> Result<(), StoreError> {
        self.jobs.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => StoreError::Busy(format!("{QUEUE} calls waiting")),
            TrySendError::Disconnected(_) => StoreError::Unavailable("the store threads stopped".into()),
        })
    }
}

/// Takes what is queued (up to `GROUP` calls) and runs it as one group, so many requests share
/// a commit: the database's write lock, BEGIN and COMMIT and the log flush are paid once per
/// group, and on Postgres the round trips too (`Store::settle_group`).
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
        let (mut settled, mut plain): (Vec<Job>, Vec<Job>) = calls.into_iter().partition(|c| c.is_batched());
        if !settled.is_empty() && !settle(&mut store, &mut settled) {
            // Rolled back: each runs alone, as it would have without the others.
            for c in settled.iter_mut() {
                c.run(&mut store);
            }
        }
        store.run_grouped(&mut plain, |cs, s| cs.iter_mut().all(|c| c.run(s)), |c, s| c.run(s));
        for c in settled.into_iter().chain(plain) {
            c.answer();
        }
    }
}

/// Runs a group's reservations and usage reports together; whether that succeeded.
fn settle(store: &mut Store, calls: &mut [Job]) -> bool {
    let (mut reserves, mut records) = (Vec::new(), Vec::new());
    for c in calls.iter_mut() {
        match c.batched() {
            Batched::Reserve(r, out) => reserves.push((r, out)),
            Batched::Record(r, out) => records.push((r, out)),
            Batched::No => {}
        }
    }
    let args: Vec<&Reservation> = reserves.iter().map(|(r, _)| *r).collect();
    let reports: Vec<&Report> = records.iter().map(|(r, _)| *r).collect();
    let Ok((grants, stored)) = store.settle_group(&args, &reports) else { return false };
    for ((_, out), g) in reserves.into_iter().zip(grants) {
        *out = Some(g);
    }
    for ((_, out), s) in records.into_iter().zip(stored) {
        *out = Some(s);
    }
    true
}

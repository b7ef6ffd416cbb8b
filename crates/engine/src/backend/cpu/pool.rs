//! A persistent thread pool that hands out a job's items in chunks.
//!
//! Decode runs a few hundred short parallel steps per token, so workers spin briefly between
//! jobs instead of sleeping (a futex wake per step would cost more than the step); the spin is
//! short and then yields the core, so other processes on the host (the other stages of a route)
//! get it, and after a while without work workers sleep.
//!
//! Items are claimed from a shared counter, not split in fixed shares: when the host has more
//! busy threads than cores and a worker is descheduled, the others (the caller at least) take
//! its part instead of waiting a whole time slice for it. Which thread computes an item never
//! changes its result, since every item is computed whole by one thread.

use std::any::Any;
use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::ops::Range;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

type Job = dyn Fn(Range<usize>) + Sync;

/// What `next` holds between jobs: past the end of any job, so every claim fails.
const CLOSED: usize = usize::MAX / 2;

struct Shared {
    epoch: AtomicU64,
    /// The next item to claim, the items in the job, and the chunk size.
    next: AtomicUsize,
    items: AtomicUsize,
    grain: AtomicUsize,
    done: AtomicUsize,
    /// Workers inside the current job; `run` returns only when none is.
    active: AtomicUsize,
    sleeping: AtomicUsize,
    stop: AtomicBool,
    /// Set when a chunk of the current job panicked: later chunks are counted as done without
    /// running, and `run` re-raises the first panic once every participant has let go of the job.
    failed: AtomicBool,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// The current job. Written by `run` while `next` is `CLOSED` (so no claim can succeed) and
    /// before `next` is reset; read by a participant only after a successful claim, and `run`
    /// neither changes it nor returns (nor unwinds) while a claimed chunk is unfinished or a
    /// participant is still inside the job.
    job: UnsafeCell<Option<&'static Job>>,
    bell: (Mutex<()>, Condvar),
}

// SAFETY: every field but `job` is Sync by itself; `job` is written only by `run` while no
// participant can read it, and read only under the claim protocol described on the field.
unsafe impl Sync for Shared {}

pub(crate) struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    caller: Mutex<()>,
}

const SPINS: u32 = 1 << 11;
const YIELDS: u32 = 1 << 12;

/// Aborts the process if dropped while unwinding: guards the stretch in which a job's borrow
/// has been handed to the workers, which must not end early.
struct AbortOnUnwind(&'static str);

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "dgr: fatal: {}; aborting", self.0);
            std::process::abort();
        }
    }
}

impl ThreadPool {
    /// A pool of `n` participants: the calling thread plus `n - 1` workers (n = 0 counts as 1).
    pub(crate) fn new(n: usize) -> ThreadPool {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            next: AtomicUsize::new(CLOSED),
            items: AtomicUsize::new(0),
            grain: AtomicUsize::new(1),
            done: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            panic: Mutex::new(None),
            job: UnsafeCell::new(None),
            bell: (Mutex::new(()), Condvar::new()),
        });
        let workers = (1..n.max(1))
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new().name(format!("dgr-compute-{i}")).spawn(move || worker(&s)).expect("spawning a compute thread")
            })
            .collect();
        ThreadPool { shared, workers, caller: Mutex::new(()) }
    }

    pub(crate) fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `f` on chunks of `0..items` (at most `grain` items each) until every item is done,
    /// spreading the chunks over the pool; returns when all have finished.
    ///
    /// If `f` panics on any thread, the chunks not yet started are skipped, and once every
    /// participant has finished the chunk it was running (so nothing touches `f` any more) the
    /// first panic resumes on the calling thread; the pool stays usable. `f` must not call `run`
    /// on the same pool (that would deadlock).
    pub(crate) fn run(&self, items: usize, grain: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        let grain = grain.max(1);
        if self.workers.is_empty() || items <= grain {
            return f(0..items);
        }
        // Each participant's failing claims add at most `grain < items` to the counter per job
        // (two for a worker that joins late), so with this bound the counter stays below `CLOSED`
        // during a job and below `usize::MAX` after it: no claim can wrap around to an item that
        // was already handed out.
        assert!(items <= usize::MAX / 8 / (2 * self.threads() + 1), "a pool job of {items} items");
        let one_job_at_a_time = self.caller.lock().unwrap_or_else(|p| p.into_inner());
        let s = &*self.shared;
        // From here until every participant has left the job, unwinding would free `f` while a
        // worker may still call it; nothing below unwinds (`claim_all` catches the job's panics),
        // and this guard turns a bug that did into an abort instead.
        let guard = AbortOnUnwind("a thread-pool job unwound while its workers held it");
        // SAFETY: `next` is `CLOSED` (the previous `run` left it so, after waiting until no
        // participant was inside its job), so no claim succeeds and no one reads `job` now. The
        // lifetime is extended to 'static only for storage: the reference is read only after a
        // successful claim of this job, and this call neither returns nor unwinds before every
        // claimed chunk is finished and `active` is back to 0; then `job` is cleared.
        unsafe { *s.job.get() = Some(std::mem::transmute::<&(dyn Fn(Range<usize>) + Sync + '_), &'static Job>(f)) };
        s.items.store(items, SeqCst);
        s.grain.store(grain, SeqCst);
        s.done.store(0, SeqCst);
        s.failed.store(false, SeqCst);
        s.next.store(0, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        if s.sleeping.load(SeqCst) > 0 {
            let _g = s.bell.0.lock().unwrap_or_else(|p| p.into_inner());
            s.bell.1.notify_all();
        }
        claim_all(s, || Some(f));
        // Every item is claimed once and counted once its chunk has finished (or was skipped).
        wait(|| s.done.load(Acquire) >= items);
        // Close the job: later claims fail until the next job resets the counter. A worker that
        // enters after this sees `CLOSED`: its increment of `active` and its claim, like this
        // store and the load of `active` below, are SeqCst, so if the load misses the increment
        // the claim comes after the store in the single order of SeqCst operations.
        s.next.store(CLOSED, SeqCst);
        wait(|| s.active.load(SeqCst) == 0);
        // SAFETY: `next` is `CLOSED` and no participant is inside the job, so no one reads `job`.
        unsafe { *s.job.get() = None };
        std::mem::forget(guard);
        let panic = s.panic.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(payload) = panic {
            drop(one_job_at_a_time);
            resume_unwind(payload);
        }
    }
}

/// Claims and runs chunks until none is left; `job` is looked up after each successful claim.
/// Never unwinds: a panic in the job is caught, recorded for `run` to re-raise, and the rest of
/// the job's chunks are counted without running.
fn claim_all<'a>(s: &Shared, job: impl Fn() -> Option<&'a (dyn Fn(Range<usize>) + Sync + 'a)>) {
    loop {
        let g = s.grain.load(Acquire);
        let start = s.next.fetch_add(g, SeqCst);
        let items = s.items.load(Acquire);
        if start >= items {
            return;
        }
        let end = (start + g).min(items);
        if !s.failed.load(Acquire) {
            if let Some(f) = job() {
                if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f(start..end))) {
                    record_panic(s, payload);
                }
            }
        }
        s.done.fetch_add(end - start, Release);
    }
}

/// Keeps the first panic of a job for `run`; any later one is leaked rather than dropped (a
/// payload's destructor could itself panic, and nothing here may unwind).
fn record_panic(s: &Shared, payload: Box<dyn Any + Send>) {
    s.failed.store(true, Release);
    let mut slot = s.panic.lock().unwrap_or_else(|p| p.into_inner());
    if slot.is_none() {
        *slot = Some(payload);
    } else {
        std::mem::forget(payload);
    }
}

/// Spins briefly, then yields, until `ready`.
fn wait(ready: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !ready() {
        spins += 1;
        if spins < SPINS {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(Acquire);
            if e != seen {
                seen = e;
                break;
            }
            if s.stop.load(Relaxed) {
                return;
            }
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else if spins < SPINS + YIELDS {
                std::thread::yield_now();
            } else {
                let mut g = s.bell.0.lock().unwrap_or_else(|p| p.into_inner());
                s.sleeping.fetch_add(1, SeqCst);
                while s.epoch.load(SeqCst) == seen && !s.stop.load(SeqCst) {
                    g = s.bell.1.wait(g).unwrap_or_else(|p| p.into_inner());
                }
                s.sleeping.fetch_sub(1, SeqCst);
                spins = 0;
            }
        }
        s.active.fetch_add(1, SeqCst);
        // A worker that unwound here would leave `active` raised and the caller waiting forever.
        let guard = AbortOnUnwind("a thread-pool worker unwound inside a job");
        // SAFETY: the closure is called only after a successful claim of the current job, when
        // `run` has stored that job's reference and keeps it alive until this worker has left
        // (see `Shared::job`).
        claim_all(s, || unsafe { *s.job.get() });
        std::mem::forget(guard);
        s.active.fetch_sub(1, Release);
    }
}

/// A buffer that pool participants write in disjoint parts (each job its own rows or slices).
pub(crate) struct Disjoint<'a> {
    ptr: *mut f32,
    len: usize,
    _buf: PhantomData<&'a mut [f32]>,
}

// SAFETY: the wrapper holds the buffer's unique borrow for its lifetime; sharing it only lets
// threads form pointers into the buffer, and every write through one is an `unsafe` operation
// whose caller promises that each element is written by one job alone.
unsafe impl Sync for Disjoint<'_> {}

impl<'a> Disjoint<'a> {
    pub(crate) fn new(buf: &'a mut [f32]) -> Disjoint<'a> {
        Disjoint { ptr: buf.as_mut_ptr(), len: buf.len(), _buf: PhantomData }
    }

    /// A pointer to element `i` (`i` may be the length: one past the end). A method, so
    /// closures capture the whole wrapper.
    pub(crate) fn at(&self, i: usize) -> *mut f32 {
        assert!(i <= self.len, "element {i} of a buffer of {}", self.len);
        self.ptr.wrapping_add(i)
    }

    /// Elements `start..start + len` as a slice (panics unless they are inside the buffer).
    ///
    /// # Safety
    /// While the slice lives, no other thread or slice reads or writes these elements.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start <= self.len && len <= self.len - start, "elements {start}..+{len} of a buffer of {}", self.len);
        // SAFETY: in bounds of the buffer borrowed for `'a` (checked above), and unaliased as the
        // caller promises.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        {
            let _g = self.shared.bell.0.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.bell.1.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_is_visited_once_across_many_jobs() {
        let pool = ThreadPool::new(3);
        for round in 0..200 {
            for (len, grain) in [(0usize, 1usize), (1, 1), (2, 1), (7, 2), (1000, 16), (1000, 1)] {
                let hits: Vec<AtomicUsize> = (0..len).map(|_| AtomicUsize::new(0)).collect();
                pool.run(len, grain, &|r| {
                    for j in r {
                        hits[j].fetch_add(1, Relaxed);
                    }
                });
                assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "round {round} len {len}");
            }
        }
    }

    fn message(payload: Box<dyn Any + Send>) -> String {
        match payload.downcast::<&str>() {
            Ok(s) => s.to_string(),
            Err(p) => *p.downcast::<String>().expect("a panic message"),
        }
    }

    /// Runs a job whose chunk holding item `bad` panics (after a pause, so other chunks are in
    /// flight) and checks that the panic reaches the caller only once no chunk is still running.
    fn panic_in_chunk(pool: &ThreadPool, bad: usize) {
        let (started, finished) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(64, 1, &|r| {
                started.fetch_add(1, SeqCst);
                if r.contains(&bad) {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    panic!("chunk {bad} failed");
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
                finished.fetch_add(1, SeqCst);
            })
        }));
        assert_eq!(message(r.expect_err("the job's panic reaches the caller")), format!("chunk {bad} failed"));
        // Every chunk that started has ended (all but the panicking one normally), and none
        // starts afterwards: nothing touches the job once `run` has unwound.
        let (s, f) = (started.load(SeqCst), finished.load(SeqCst));
        assert_eq!(s, f + 1);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!((started.load(SeqCst), finished.load(SeqCst)), (s, f));
    }

    #[test]
    fn a_panicking_job_unwinds_to_the_caller_after_every_worker_has_let_go() {
        let pool = ThreadPool::new(4);
        for bad in [0, 9, 63] {
            panic_in_chunk(&pool, bad);
            // The pool is whole afterwards: the next jobs visit every item once.
            for (len, grain) in [(100usize, 1usize), (1000, 7)] {
                let hits: Vec<AtomicUsize> = (0..len).map(|_| AtomicUsize::new(0)).collect();
                pool.run(len, grain, &|r| {
                    for j in r {
                        hits[j].fetch_add(1, Relaxed);
                    }
                });
                assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "after a panic at {bad}: len {len}");
            }
        }
    }

    #[test]
    fn a_panic_on_a_worker_thread_reaches_the_caller() {
        let pool = ThreadPool::new(3);
        let caller = std::thread::current().id();
        let worker_ran = AtomicBool::new(false);
        for _ in 0..20 {
            worker_ran.store(false, SeqCst);
            let r = catch_unwind(AssertUnwindSafe(|| {
                pool.run(64, 1, &|_| {
                    if std::thread::current().id() != caller {
                        worker_ran.store(true, SeqCst);
                        panic!("worker failed");
                    }
                    // Hold the caller on its first chunk until a worker has taken one.
                    let t0 = std::time::Instant::now();
                    while !worker_ran.load(SeqCst) && t0.elapsed() < std::time::Duration::from_secs(10) {
                        std::thread::yield_now();
                    }
                })
            }));
            assert_eq!(message(r.expect_err("the worker's panic reaches the caller")), "worker failed");
        }
        let count = AtomicUsize::new(0);
        pool.run(64, 1, &|r| {
            count.fetch_add(r.len(), Relaxed);
        });
        assert_eq!(count.load(Relaxed), 64);
    }

    #[test]
    fn a_single_threaded_pool_passes_a_panic_straight_through() {
        let pool = ThreadPool::new(1);
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(10, 1, &|_| panic!("alone"))));
        assert_eq!(message(r.unwrap_err()), "alone");
        let count = AtomicUsize::new(0);
        pool.run(10, 3, &|r| {
            count.fetch_add(r.len(), Relaxed);
        });
        assert_eq!(count.load(Relaxed), 10);
    }

    #[test]
    fn disjoint_slices_are_bounds_checked() {
        let mut buf = [0f32; 8];
        let d = Disjoint::new(&mut buf);
        // SAFETY: the only slice of this buffer alive at a time.
        unsafe { d.slice(6, 2) }.fill(1.0);
        assert_eq!(d.at(8), d.at(0).wrapping_add(8));
        // SAFETY: as above (the call panics before forming a slice).
        let past = catch_unwind(AssertUnwindSafe(|| unsafe { d.slice(7, 2) }.len()));
        assert!(past.is_err());
        assert_eq!(buf, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]);
    }

    #[test]
    fn sleeping_workers_wake_for_the_next_job() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(std::time::Duration::from_millis(200));
        let count = AtomicUsize::new(0);
        pool.run(64, 1, &|r| {
            count.fetch_add(r.len(), Relaxed);
        });
        assert_eq!(count.load(Relaxed), 64);
    }
}

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

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

type Job = dyn Fn(Range<usize>) + Sync;

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
    /// The current job. Written by `run` while `next` is past the end of the last job (so no
    /// claim can succeed) and before `next` is reset; read by a worker only after a successful
    /// claim, and `run` neither changes it nor returns while a claimed chunk is unfinished.
    job: UnsafeCell<Option<&'static Job>>,
    bell: (Mutex<()>, Condvar),
}

// SAFETY: `job` is written and read under the claim protocol described on the field.
unsafe impl Sync for Shared {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    caller: Mutex<()>,
}

const SPINS: u32 = 1 << 11;
const YIELDS: u32 = 1 << 12;

impl ThreadPool {
    /// A pool of `n` participants: the calling thread plus `n - 1` workers (n = 0 counts as 1).
    pub fn new(n: usize) -> ThreadPool {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            next: AtomicUsize::new(0),
            items: AtomicUsize::new(0),
            grain: AtomicUsize::new(1),
            done: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
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

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `f` on chunks of `0..items` (at most `grain` items each) until every item is done,
    /// spreading the chunks over the pool; returns when all have finished.
    pub fn run(&self, items: usize, grain: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        let grain = grain.max(1);
        if self.workers.is_empty() || items <= grain {
            return f(0..items);
        }
        let _one_job_at_a_time = self.caller.lock().unwrap_or_else(|p| p.into_inner());
        let s = &*self.shared;
        // Every claim fails until `next` is reset below, so nothing reads the job meanwhile.
        // SAFETY: `f` outlives every use: we return only after `active` is back to 0.
        unsafe { *s.job.get() = Some(std::mem::transmute::<&(dyn Fn(Range<usize>) + Sync + '_), &'static Job>(f)) };
        s.items.store(items, SeqCst);
        s.grain.store(grain, SeqCst);
        s.done.store(0, SeqCst);
        s.next.store(0, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        if s.sleeping.load(SeqCst) > 0 {
            let _g = s.bell.0.lock().unwrap_or_else(|p| p.into_inner());
            s.bell.1.notify_all();
        }
        claim_all(s, || Some(f));
        wait(|| s.done.load(Acquire) >= items);
        // Close the job: later claims fail until the next job resets the counter.
        s.next.store(usize::MAX / 2, SeqCst);
        wait(|| s.active.load(Acquire) == 0);
    }
}

/// Claims and runs chunks until none is left; `job` is looked up after each successful claim.
fn claim_all<'a>(s: &Shared, job: impl Fn() -> Option<&'a (dyn Fn(Range<usize>) + Sync + 'a)>) {
    loop {
        let g = s.grain.load(Acquire);
        let start = s.next.fetch_add(g, SeqCst);
        let items = s.items.load(Acquire);
        if start >= items {
            return;
        }
        let end = (start + g).min(items);
        if let Some(f) = job() {
            f(start..end);
        }
        s.done.fetch_add(end - start, Release);
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
        // SAFETY: read only after a successful claim (see `Shared::job`).
        claim_all(s, || unsafe { *s.job.get() });
        s.active.fetch_sub(1, Release);
    }
}

/// A buffer that pool participants write in disjoint parts (each job its own rows or slices).
pub(crate) struct Disjoint(*mut f32);

// SAFETY: every user writes only the elements its job owns, and the buffer outlives the job.
unsafe impl Sync for Disjoint {}

impl Disjoint {
    pub(crate) fn new(buf: &mut [f32]) -> Disjoint {
        Disjoint(buf.as_mut_ptr())
    }

    /// A pointer to element `i` (a method, so closures capture the whole wrapper).
    pub(crate) fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
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

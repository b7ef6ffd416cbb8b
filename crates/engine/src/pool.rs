//! A persistent thread pool: one job at a time, split by the job itself over `n` participants.
//!
//! Decode runs a few hundred short parallel steps per token, so workers spin briefly between
//! jobs instead of sleeping (a futex wake per step would cost more than the step). The spin is
//! short and then yields the core, so that other processes on the host (the other stages of a
//! route) get it; after a while without work, workers sleep.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    epoch: AtomicU64,
    pending: AtomicUsize,
    sleeping: AtomicUsize,
    stop: AtomicBool,
    /// The current job; written only by `run` before it bumps `epoch`, read by workers after.
    job: UnsafeCell<Option<&'static Job>>,
    bell: (Mutex<()>, Condvar),
}

// SAFETY: `job` is only written while no worker reads it (between jobs, under `caller`).
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
            pending: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            job: UnsafeCell::new(None),
            bell: (Mutex::new(()), Condvar::new()),
        });
        let n = n.max(1);
        let workers = (1..n)
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("dgr-compute-{i}"))
                    .spawn(move || worker(&s, i, n))
                    .expect("spawning a compute thread")
            })
            .collect();
        ThreadPool { shared, workers, caller: Mutex::new(()) }
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(i, n)` for every participant `i` in `0..n` and returns when all have finished.
    pub fn run(&self, f: &(dyn Fn(usize, usize) + Sync)) {
        let n = self.threads();
        if n == 1 {
            return f(0, 1);
        }
        let _one_job_at_a_time = self.caller.lock().unwrap_or_else(|p| p.into_inner());
        let s = &*self.shared;
        // SAFETY: no worker reads `job` until `epoch` moves, and we wait for all of them below
        // before `f` goes out of scope, so extending its lifetime is never observed.
        unsafe { *s.job.get() = Some(std::mem::transmute::<&(dyn Fn(usize, usize) + Sync + '_), &'static Job>(f)) };
        s.pending.store(n - 1, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        if s.sleeping.load(SeqCst) > 0 {
            let _g = s.bell.0.lock().unwrap_or_else(|p| p.into_inner());
            s.bell.1.notify_all();
        }
        f(0, n);
        let mut spins = 0u32;
        while s.pending.load(Acquire) != 0 {
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

fn worker(s: &Shared, i: usize, n: usize) {
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
        // SAFETY: `run` set the job before moving `epoch` and keeps it alive until `pending` is 0.
        if let Some(job) = unsafe { *s.job.get() } {
            job(i, n);
        }
        s.pending.fetch_sub(1, Release);
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

/// The part of `0..len` that participant `i` of `n` owns: contiguous, in order, balanced.
pub fn share(len: usize, i: usize, n: usize) -> std::ops::Range<usize> {
    (len * i / n)..(len * (i + 1) / n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_is_visited_once_across_many_jobs() {
        let pool = ThreadPool::new(3);
        for len in [0usize, 1, 2, 7, 1000] {
            let hits: Vec<AtomicUsize> = (0..len).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&|i, n| {
                for j in share(len, i, n) {
                    hits[j].fetch_add(1, Relaxed);
                }
            });
            assert!(hits.iter().all(|h| h.load(Relaxed) == 1));
        }
    }

    #[test]
    fn sleeping_workers_wake_for_the_next_job() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(std::time::Duration::from_millis(200));
        let count = AtomicUsize::new(0);
        pool.run(&|_, _| {
            count.fetch_add(1, Relaxed);
        });
        assert_eq!(count.load(Relaxed), 2);
    }
}

//! This machine's streaming read bandwidth: each thread sums its own part of a buffer many times
//! larger than the last-level cache, so every pass reads from memory. Decode of a model larger
//! than the cache reads every weight once per token, so this is the rate it is bound by.

use super::{median, record, spread};
use crate::error::{BenchError, Result};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Barrier;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Threads reading at once, each its own part of the buffer
    #[arg(long, short = 't', default_value_t = 2)]
    threads: usize,
    /// Size of the buffer in MiB
    #[arg(long, default_value_t = DEFAULT_MIB)]
    mib: usize,
    /// Passes over the buffer
    #[arg(long, short = 'r', default_value_t = 10)]
    reps: usize,
    /// Directory for the run's record
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

/// 4 GiB: eight times the 480 MiB L3 of the largest machines these benchmarks ran on.
pub const DEFAULT_MIB: usize = 4096;

/// The last-level cache's size in bytes, as Linux reports it (0 when it does not).
fn llc_bytes() -> u64 {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let sizes = (0..8).filter_map(|i| std::fs::read_to_string(dir.join(format!("index{i}/size"))).ok());
    let parse = |s: String| {
        let s = s.trim();
        let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
        n.parse::<u64>().ok().map(|n| {
            n << if unit == "M" {
                20
            } else if unit == "K" {
                10
            } else {
                0
            }
        })
    };
    sizes.filter_map(parse).max().unwrap_or(0)
}

/// A buffer filled (so every page is really there), read by `threads` threads at once.
pub struct Reader {
    data: Vec<u64>,
    threads: usize,
}

impl Reader {
    /// `mib` MiB over `threads` threads; refused when it is not at least four times the
    /// last-level cache, or cannot be allocated.
    pub fn new(mib: usize, threads: usize) -> Result<Reader> {
        let bytes = (mib as u64) << 20;
        let llc = llc_bytes();
        if threads == 0 || bytes < 4 * llc.max(1 << 20) {
            return Err(BenchError::Usage(format!(
                "the bandwidth buffer ({mib} MiB) must be at least four times the last-level cache ({} MiB), over one thread or more",
                llc >> 20
            )));
        }
        let words = (bytes / 8) as usize;
        let mut data = Vec::new();
        data.try_reserve_exact(words).map_err(|e| BenchError::Measure(format!("allocating {mib} MiB to read: {e}")))?;
        data.extend((0..words as u64).map(|i| i | 1));
        Ok(Reader { data, threads })
    }

    pub fn bytes(&self) -> u64 {
        self.data.len() as u64 * 8
    }

    /// One pass: every thread sums its part, started together; GB/s over the whole buffer.
    pub fn pass(&self) -> f64 {
        let parts: Vec<&[u64]> = self.data.chunks(self.data.len().div_ceil(self.threads)).collect();
        let start = Barrier::new(parts.len() + 1);
        let t = std::thread::scope(|s| {
            for chunk in parts {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    std::hint::black_box(sum(chunk));
                });
            }
            start.wait();
            Instant::now()
        });
        // The scope ends when every reader has: its duration is the slowest thread's.
        self.bytes() as f64 / t.elapsed().as_secs_f64() / 1e9
    }

    /// The median of `n` passes, GB/s.
    pub fn median_gb_s(&self, n: usize) -> f64 {
        median(&(0..n).map(|_| self.pass()).collect::<Vec<_>>())
    }
}

/// Eight independent sums, so the adds keep up with the loads.
fn sum(words: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut blocks = words.chunks_exact(8);
    for b in &mut blocks {
        for (a, w) in acc.iter_mut().zip(b) {
            *a = a.wrapping_add(*w);
        }
    }
    blocks.remainder().iter().chain(&acc).fold(0u64, |a, w| a.wrapping_add(*w))
}

pub fn run(a: Args) -> Result<()> {
    let reader = Reader::new(a.mib, a.threads)?;
    reader.pass(); // warm-up
    let samples: Vec<f64> = (0..a.reps).map(|_| reader.pass()).collect();
    let (lo, hi) = spread(&samples);
    println!(
        "streaming read, {} threads, {} MiB ({} MiB last-level cache): median {:.1} GB/s (min {lo:.1}, max {hi:.1}, {} passes)",
        a.threads,
        a.mib,
        llc_bytes() >> 20,
        median(&samples),
        a.reps
    );
    let path = record::write_maybe_model(
        &a.out,
        "bandwidth",
        None,
        json!({ "threads": a.threads, "buffer_bytes": reader.bytes(), "llc_bytes": llc_bytes(), "samples": { "gb_s": samples } }),
    )?;
    println!("record: {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_every_word() {
        let words: Vec<u64> = (1..=21).collect();
        assert_eq!(sum(&words), 231);
        assert_eq!(sum(&[]), 0);
    }

    #[test]
    fn a_buffer_smaller_than_four_caches_is_refused() {
        assert!(matches!(Reader::new(0, 2), Err(BenchError::Usage(_))));
        assert!(matches!(Reader::new(DEFAULT_MIB, 0), Err(BenchError::Usage(_))));
    }
}

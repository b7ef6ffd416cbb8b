//! Support for the fuzz targets in `fuzz_targets/`: their bodies and seeds (`harness`, shared
//! with the main workspace's replay test), an allocator that makes a huge allocation a finding,
//! and seeding of the corpus directory. See `scripts/fuzz.sh`.

pub mod harness;

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};

/// Largest single allocation a target may make. The inputs are a few KiB, so anything near this
/// is an allocation sized by a claimed count rather than by the bytes present.
pub const MAX_ALLOC: usize = 64 << 20;

/// The system allocator, failing any allocation over [`MAX_ALLOC`]: Rust then reports
/// "memory allocation of N bytes failed" and aborts, which libFuzzer records as a crash (with no
/// sanitizer, libFuzzer's own -malloc_limit_mb cannot see allocations).
pub struct CappedAlloc;

// SAFETY: every call forwards to the system allocator with the caller's own arguments, or
// returns null, which GlobalAlloc allows for any allocation that cannot be made.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > MAX_ALLOC {
            return std::ptr::null_mut();
        }
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > MAX_ALLOC {
            return std::ptr::null_mut();
        }
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > MAX_ALLOC {
            return std::ptr::null_mut();
        }
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOC: CappedAlloc = CappedAlloc;

/// Called once before fuzzing: writes `target`'s seeds (`harness::seeds`) into the first
/// directory on the command line, which libFuzzer grows as its corpus, so the seeds always match
/// the current code. Files already there are left alone; a run on single files writes nothing,
/// and neither does one with DGR_FUZZ_NO_SEEDS set (to measure how far the fuzzer gets alone).
pub fn init(target: &str) {
    if std::env::var_os("DGR_FUZZ_NO_SEEDS").is_some() {
        return;
    }
    let Some(dir) = std::env::args_os().skip(1).map(PathBuf::from).find(|p| p.is_dir()) else {
        return;
    };
    if let Err(e) = write_seeds(target, &dir) {
        eprintln!("could not write the seeds of {target} into {}: {e}", dir.display());
    }
}

fn write_seeds(target: &str, dir: &Path) -> std::io::Result<()> {
    for (t, name, bytes) in harness::seeds() {
        let path = dir.join(format!("seed-{name}"));
        if t == target && !path.exists() {
            std::fs::write(path, bytes)?;
        }
    }
    Ok(())
}

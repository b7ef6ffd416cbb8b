//! Partial maps: one read-only mmap per run of adjacent tensors a process keeps, so its address
//! space holds those bytes (and at most a page or so around each run) and no others. A model
//! assembled from another format's files (see [`crate::Gguf::assemble`]) keeps its tensors as
//! runs too, mapped from their files or, where they were transformed at load, owned.

use memmap2::{Mmap, MmapOptions};
use std::fs::File;

/// Map offsets are rounded down to a multiple of this: a multiple of every page size Linux
/// uses (4 KiB to 64 KiB), as mmap requires.
const MAP_ALIGN: u64 = 64 << 10;

/// File bytes [start, end), held from `start - skip`.
struct Run {
    start: u64,
    end: u64,
    skip: usize,
    held: Held,
}

/// A run's bytes: mapped from a file, or owned.
pub(crate) enum Held {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl Held {
    fn bytes(&self) -> &[u8] {
        match self {
            Held::Map(m) => m,
            Held::Owned(v) => v,
        }
    }
}

/// Maps file bytes [start, end) read-only, from the map-aligned offset at or below `start`;
/// returns the map and how many bytes precede `start` in it.
pub(crate) fn map_range(file: &File, start: u64, end: u64) -> std::io::Result<(Mmap, usize)> {
    let from = start - start % MAP_ALIGN;
    let len = usize::try_from(end - from).map_err(std::io::Error::other)?;
    // SAFETY: read-only, and the file does not change while mapped: the invariant stated on
    // `Gguf::open`, which every map of a model file relies on.
    let map = unsafe { MmapOptions::new().offset(from).len(len).map(file) }?;
    Ok((map, (start - from) as usize))
}

/// Lets the kernel drop this process's resident pages of bytes `at..at + len` of `map` (the
/// whole 64 KiB-aligned pieces inside them, so no neighbour's page goes with them): they stay
/// mapped, and read the same bytes from the file if touched again. Best effort: a refusal only
/// leaves them resident.
pub(crate) fn release(map: &Mmap, at: usize, len: usize) {
    let align = MAP_ALIGN as usize;
    let base = map.as_ptr() as usize;
    let (from, to) = ((base + at).next_multiple_of(align) - base, (base + at + len) / align * align - base);
    if from < to && to <= map.len() {
        // SAFETY: `map` is a shared, read-only map of a model file, which does not change while
        // mapped (the invariant on `Gguf::open`). MADV_DONTNEED on such a map drops only this
        // process's page-table entries: a later read faults the same bytes in from the file, so
        // every reference into the map keeps reading what it read before.
        #[cfg(unix)]
        let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, from, to - from) };
    }
}

/// Mapped runs of a file, sorted by start and disjoint.
#[derive(Default)]
pub(crate) struct Runs(Vec<Run>);

impl Runs {
    /// Maps each of `ranges` (absolute [start, end), sorted, disjoint, nonempty, inside the
    /// file).
    pub fn map(file: &File, ranges: &[(u64, u64)]) -> std::io::Result<Runs> {
        let mut runs = Vec::with_capacity(ranges.len());
        for &(start, end) in ranges {
            let (map, skip) = map_range(file, start, end)?;
            runs.push(Run { start, end, skip, held: Held::Map(map) });
        }
        Ok(Runs(runs))
    }

    /// Runs from held bytes: each at `start`, its bytes from `skip` on (sorted by start,
    /// disjoint).
    pub fn from_held(parts: Vec<(u64, usize, Held)>) -> Runs {
        Runs(
            parts
                .into_iter()
                .map(|(start, skip, held)| Run { start, end: start + (held.bytes().len() - skip) as u64, skip, held })
                .collect(),
        )
    }

    /// File bytes [start, end) if one run holds them all.
    pub fn get(&self, start: u64, end: u64) -> Option<&[u8]> {
        let (i, at) = self.locate(start, end)?;
        self.region(i).get(at..at.checked_add(usize::try_from(end - start).ok()?)?)
    }

    /// The run holding all of file bytes [start, end), and where they start in its region.
    pub fn locate(&self, start: u64, end: u64) -> Option<(usize, usize)> {
        let i = self.0.partition_point(|r| r.start <= start).checked_sub(1)?;
        let run = &self.0[i];
        (end <= run.end).then_some(())?;
        Some((i, usize::try_from(start - run.start).ok()?))
    }

    /// Releases bytes `range` of run `i`'s region (see [`release`]) where the run is mapped.
    pub fn release(&self, i: usize, range: std::ops::Range<usize>) {
        if let Some(Run { skip, held: Held::Map(map), .. }) = self.0.get(i) {
            release(map, skip + range.start, range.len());
        }
    }

    /// Run `i`'s bytes, from its first tensor's first byte (empty for a run that does not exist).
    pub fn region(&self, i: usize) -> &[u8] {
        self.0.get(i).and_then(|r| r.held.bytes().get(r.skip..)).unwrap_or(&[])
    }
}

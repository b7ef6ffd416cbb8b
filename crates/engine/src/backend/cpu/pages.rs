//! Memory for weights repacked at load, on huge pages where the kernel gives them.
//!
//! A decode step reads every packed byte once, as a stream. With 4 KiB pages that stream misses
//! the TLB every 4 KiB (a 1B model's 430 MB is 105k pages, far past the TLB), and the integer
//! kernels, which do more work per byte than a plain read, hide those page walks worse: on an
//! AMD EPYC (Zen 4), one thread's one-column Q4_K product read 10–17 GB/s of a 38 MB matrix from
//! 4 KiB pages and 18–23 from 2 MiB ones (a plain read ~20), and 2-thread decode of the synthetic
//! 1B Q4_K ran 15% faster in the median of 6 alternating pairs. So the records live in an anonymous
//! mapping aligned to 2 MiB and advised as huge pages (`MADV_HUGEPAGE`: where transparent huge
//! pages are `madvise`-only, as Debian and Ubuntu ship them, a kernel gives them only on
//! request), mapped untouched so that the first write faults huge pages in. Where the kernel
//! gives none, the pages are ordinary ones and nothing else changes.

use memmap2::MmapMut;

/// The huge page size of x86-64 and most ARM64 kernels; a mapping aligned to it is also aligned
/// to any smaller page.
const HUGE: usize = 2 << 20;

/// `len` zeroed bytes starting on a 2 MiB boundary, written once at load and read after.
pub(crate) struct Pages {
    map: MmapMut,
    start: usize,
    len: usize,
}

impl Pages {
    /// Zeroed bytes; their pages are faulted in as they are first written.
    ///
    /// Aborts, as a `Vec` would, when the address space has no room.
    pub(crate) fn zeroed(len: usize) -> Pages {
        // Room to slide the start to a boundary; the unused ends are never touched, so they
        // take address space, not memory.
        let map = MmapMut::map_anon(len + HUGE).unwrap_or_else(|_| {
            std::alloc::handle_alloc_error(std::alloc::Layout::from_size_align(len.max(1), HUGE).expect("a mapping's layout"))
        });
        let start = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
        // Only a request: a kernel without transparent huge pages refuses it, and the bytes are
        // the same either way. (Other systems have no such advice.)
        #[cfg(target_os = "linux")]
        let _ = map.advise_range(memmap2::Advice::HugePage, start, len);
        Pages { map, start, len }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map[self.start..][..self.len]
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map[self.start..][..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_zeroed_aligned_and_writable() {
        for len in [0, 1, 64, HUGE + 100] {
            let mut p = Pages::zeroed(len);
            assert_eq!(p.bytes().len(), len);
            assert!(p.bytes().iter().all(|&b| b == 0));
            assert!((p.bytes().as_ptr() as usize).is_multiple_of(HUGE));
            p.bytes_mut().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
            assert!(p.bytes().iter().enumerate().all(|(i, &b)| b == i as u8));
        }
    }
}

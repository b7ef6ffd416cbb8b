//! Test-only fault injection, compiled only with the `fault-injection` feature: a worker that
//! lies, or that stops halfway through fetching its slice.

/// With `DGR_FAULT_CORRUPT_ROWS` set, every hidden row it sends on is negated, which changes
/// what the model says, so spot checks have a liar to catch.
pub(crate) fn corrupt(hidden: &mut [f32]) {
    if std::env::var_os("DGR_FAULT_CORRUPT_ROWS").is_some() {
        for x in hidden {
            *x = -*x;
        }
    }
}

/// With `DGR_FAULT_CORRUPT_FETCH` set, a worker serving tensors to a fetcher flips one byte of
/// every chunk it sends.
pub(crate) fn corrupt_chunk(bytes: &mut [u8]) {
    if std::env::var_os("DGR_FAULT_CORRUPT_FETCH").is_some() {
        if let Some(b) = bytes.first_mut() {
            *b ^= 0x40;
        }
    }
}

/// With `DGR_FAULT_FETCH_STOP_AFTER=N`, a fetching worker stops (as if killed) after writing N
/// tensors: the next start must resume.
pub(crate) fn fetch_stop_after() -> Option<usize> {
    std::env::var("DGR_FAULT_FETCH_STOP_AFTER").ok()?.parse().ok()
}

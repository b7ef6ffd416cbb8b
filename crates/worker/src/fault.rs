//! Test-only fault injection, compiled only with the `fault-injection` feature: a worker that
//! lies, that stops halfway through fetching its slice, that reports a given speed, or whose GPU
//! is lost.

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

/// With `DGR_FAULT_STEP_US_PER_LAYER=X`, the worker registers X µs per layer instead of what it
/// measured, so a test's replicas are equally fast to the planner whatever the machine's noise.
pub(crate) fn step_us_per_layer() -> Option<f64> {
    std::env::var("DGR_FAULT_STEP_US_PER_LAYER").ok()?.parse().ok()
}

/// With `DGR_FAULT_LOSE_DEVICE_AT_STEP=N`, the stage's GPU is destroyed just before its step N
/// (from 0), as a driver reset would lose it.
pub(crate) fn lose_device_at() -> Option<u64> {
    std::env::var("DGR_FAULT_LOSE_DEVICE_AT_STEP").ok()?.parse().ok()
}

/// With `DGR_FAULT_FETCH_STOP_AFTER=N`, a fetching worker stops (as if killed) after writing N
/// tensors: the next start must resume.
pub(crate) fn fetch_stop_after() -> Option<usize> {
    std::env::var("DGR_FAULT_FETCH_STOP_AFTER").ok()?.parse().ok()
}

//! Test-only fault injection, compiled only with the `fault-injection` feature: a worker that
//! lies. With `DGR_FAULT_CORRUPT_ROWS` set, every hidden row it sends on is negated, which
//! changes what the model says, so spot checks have a liar to catch.

pub(crate) fn corrupt(hidden: &mut [f32]) {
    if std::env::var_os("DGR_FAULT_CORRUPT_ROWS").is_some() {
        for x in hidden {
            *x = -*x;
        }
    }
}

//! Unix time from the system clock, for timestamps that cross processes (traces, tickets, the
//! ledger). A clock set before 1970 reads 0.

use std::time::{Duration, SystemTime};

fn since_epoch() -> Duration {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default()
}

pub fn unix_secs() -> u64 {
    since_epoch().as_secs()
}

pub fn unix_ms() -> u64 {
    since_epoch().as_millis() as u64
}

pub fn unix_us() -> u64 {
    since_epoch().as_micros() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_units_agree() {
        let (s, ms, us) = (unix_secs(), unix_ms(), unix_us());
        // 2020 or later, and each reading the previous one's or a little after it.
        assert!(s >= 1_577_836_800, "{s}");
        assert!(ms / 1000 >= s && ms / 1000 - s <= 1, "{s} {ms}");
        assert!(us / 1000 >= ms && us / 1000 - ms <= 1000, "{ms} {us}");
    }
}

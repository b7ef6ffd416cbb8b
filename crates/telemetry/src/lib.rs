//! What the services report about themselves, shared by workers, trackers and gateways: the
//! Prometheus text they expose (`prom`), the one-request GET responder that serves it on a
//! protocol port (`http`), and the wall clock as Unix time (`time`).

pub mod http;
pub mod prom;
mod time;

pub use time::{unix_ms, unix_secs, unix_us};

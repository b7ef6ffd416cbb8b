//! The tracker: the one place that knows who serves what. Registry and liveness of workers,
//! route planning over replicas and overlapping ranges, signed route tickets, the usage ledger
//! and the relay. It is never on the data path (except as a relay for a worker that asks).

mod answers;
mod control;
mod keys;
mod metrics;
pub mod place;
pub mod plan;
pub mod registry;
mod relay;
mod server;
pub mod splitmix;
pub mod store;

pub use server::{Tracker, TrackerConfig, TrackerError};
pub use store::{Ledger, LedgerSpec, Store, StoreError};

//! A worker serves one stage of a model: the layers it opened, the sessions driven through them,
//! one scheduler that batches every ready session into one forward per step, and metrics.
//!
//! Threads: tokio tasks own the sockets (one reader and one writer per connection); one
//! scheduler thread owns the engine (`open_engine`'s, used through the `Engine` trait) and every
//! session's state. They talk through bounded queues, so a slow or hostile peer can fill only its
//! own queue.

mod compat;
mod config;
#[cfg(feature = "fault-injection")]
mod fault;
mod fetch;
mod join;
mod load;
mod metrics;
mod placement;
mod plan;
mod prefix;
mod ring;
mod scheduler;
mod server;
mod share;

pub use compat::{CompatKey, Phase};
pub use config::{TrackerLink, WorkerConfig};
pub use fetch::{describe as describe_fetch, FetchError, FetchSpec, Fetched};
pub use join::load_or_create_identity;
pub use metrics::{rss_bytes, Metrics};
pub use placement::{available_memory, ModelSizes, PlaceError, PlaceSpec, WEIGHT_SHARE};
pub use plan::Policy;
pub use server::{bind, Worker, WorkerError};

//! The route driver: opens a session along a route of stage workers, drives prefill and decode,
//! streams tokens back, recovers on a replacement route when a stage fails, and deals with the
//! tracker for routes and usage. Its public items are the whole seam the HTTP gateway
//! (`dgr-gateway`) and the binary drive requests through.

#[macro_use]
mod named;

mod conn;
mod constraint;
mod draft;
mod driver;
mod error;
mod links;
mod recover;
mod report;
mod reporter;
mod route;
pub mod tracker;
mod trackers;

pub use constraint::{Constraint, SharedConstraint};
pub use draft::{DraftStats, Speculate};
pub use driver::{embed_on, generate, generate_on, DriveOptions, EmbedRequest, Flow, GenRequest};
pub use error::{DriveError, FailKind};
pub use links::Links;
pub use recover::{embed_recovering, generate_recovering, Attempt, Recovered, Recovery, Ticketed};
pub use report::{Completion, FinishReason, SeamReport, StageReport, Timings, UsageReport};
pub use reporter::{ReportStats, UsageReporter};
pub use route::{Route, StageEndpoint};
pub use trackers::Trackers;

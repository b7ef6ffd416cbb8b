//! The gateway side of dgr: the driver that opens a session along a route of stage workers,
//! drives prefill and decode, and streams tokens back.

mod conn;
mod driver;
mod error;
pub mod http;
mod links;
mod recover;
mod report;
mod route;
pub mod tracker;

pub use driver::{generate, generate_on, DriveOptions, Flow, GenRequest};
pub use error::DriveError;
pub use links::Links;
pub use recover::{generate_recovering, Attempt, Recovered, Recovery, Ticketed};
pub use report::{Completion, SeamReport, StageReport, Timings, UsageReport};
pub use route::{Route, StageEndpoint};

//! A constraint on what a session may generate (a grammar, in the gateway): before each step
//! the driver asks it which tokens the last stage may sample, and tells it the token chosen. The
//! mask travels with the step's rows to the last stage, whose sampler applies it, so a
//! constrained seeded session reproduces on any route, and a replay after a failure goes on
//! from the constraint's state after the tokens already delivered.

use std::sync::{Arc, Mutex};

/// What the caller's constraint answers.
pub trait Constraint: Send {
    /// The tokens the next sample may take (bit `i % 8` of byte `i / 8` for token `i`), or
    /// `None` when the constraint is complete and the generation ends ("stop").
    fn allowed(&mut self) -> Result<Option<Vec<u8>>, String>;
    /// The token the route chose under the last mask.
    fn advance(&mut self, token: u32) -> Result<(), String>;
}

/// A constraint shared by a request's sessions (the first route and any replacement).
pub type SharedConstraint = Arc<Mutex<dyn Constraint>>;

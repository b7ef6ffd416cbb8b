use serde::Serialize;

/// Why a routed request failed, naming the stage (index in the route, and its address) where
/// that is known. Serializes as the structured error the CLI prints.
#[derive(Debug, Clone, Serialize, thiserror::Error)]
#[error("{kind} at stage {stage:?} ({addr:?}): {message}")]
pub struct DriveError {
    /// A stable name: connect_failed, connection_lost, timeout, protocol, route, or a worker's
    /// error kind (bad_input, overloaded, schema_mismatch, next_stage, ...).
    pub kind: String,
    pub stage: Option<u32>,
    pub addr: Option<String>,
    pub message: String,
    /// Tokens delivered before the failure (for the ledger).
    #[serde(skip_serializing_if = "is_zero")]
    pub generated: usize,
    /// What the surviving stages reported computing (for the ledger).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub usage: Vec<crate::UsageReport>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl DriveError {
    pub fn new(kind: &str, stage: Option<u32>, addr: Option<&str>, message: impl Into<String>) -> DriveError {
        DriveError { kind: kind.into(), stage, addr: addr.map(String::from), message: message.into(), generated: 0, usage: Vec::new() }
    }
}

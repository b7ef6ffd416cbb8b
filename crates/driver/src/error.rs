use dgr_proto::{ErrorKind, RefusalKind};
use serde::Serialize;

/// Why a routed request failed, naming the stage (index in the route, and its address) where
/// that is known. Serializes as the structured error the CLI prints.
#[derive(Debug, Clone, Serialize, thiserror::Error)]
#[error("{kind} at stage {stage:?} ({addr:?}): {message}")]
pub struct DriveError {
    pub kind: FailKind,
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
    pub fn new(kind: FailKind, stage: Option<u32>, addr: Option<&str>, message: impl Into<String>) -> DriveError {
        DriveError { kind, stage, addr: addr.map(String::from), message: message.into(), generated: 0, usage: Vec::new() }
    }
}

/// What failed: the driver's own findings, a worker's error frame, or the tracker's refusal.
/// Serialized and displayed as a stable name (`as_str`), the one the CLI, the API's error
/// messages and `/metrics` show.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailKind {
    ConnectFailed,
    ConnectionLost,
    Timeout,
    /// A stage that did not answer a ping while the route was quiet (a stopped process).
    Silent,
    /// A peer that broke the protocol.
    Protocol,
    /// A route that cannot be driven as given.
    Route,
    /// The tracker could not be asked, or answered nonsense.
    Tracker,
    BadRequest,
    Internal,
    /// A worker's error frame.
    Worker(ErrorKind),
    /// The tracker refused the route.
    Refused(RefusalKind),
    /// A message on a link failed its authentication tag: altered or injected in flight.
    Integrity,
    /// The worker at a stage's address proved a key other than the one its ticket names.
    WrongPeer,
}

impl FailKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FailKind::ConnectFailed => "connect_failed",
            FailKind::ConnectionLost => "connection_lost",
            FailKind::Timeout => "timeout",
            FailKind::Silent => "silent",
            FailKind::Protocol => "protocol",
            FailKind::Route => "route",
            FailKind::Tracker => "tracker",
            FailKind::BadRequest => "bad_request",
            FailKind::Internal => "internal",
            FailKind::Worker(k) => k.name(),
            FailKind::Refused(k) => k.name(),
            FailKind::Integrity => "integrity",
            FailKind::WrongPeer => "wrong_peer",
        }
    }

    /// No room anywhere (a worker's or the tracker's): the client may retry later.
    pub fn is_overloaded(self) -> bool {
        matches!(self, FailKind::Worker(ErrorKind::Overloaded) | FailKind::Refused(RefusalKind::Overloaded | RefusalKind::Full))
    }
}

by_name!(FailKind);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_keep_their_names() {
        let own = [
            (FailKind::ConnectFailed, "connect_failed"),
            (FailKind::ConnectionLost, "connection_lost"),
            (FailKind::Timeout, "timeout"),
            (FailKind::Silent, "silent"),
            (FailKind::Protocol, "protocol"),
            (FailKind::Route, "route"),
            (FailKind::Tracker, "tracker"),
            (FailKind::BadRequest, "bad_request"),
            (FailKind::Internal, "internal"),
            (FailKind::Worker(ErrorKind::NextStage), "next_stage"),
            (FailKind::Worker(ErrorKind::SchemaMismatch), "schema_mismatch"),
            (FailKind::Refused(RefusalKind::QuotaExceeded), "quota_exceeded"),
            (FailKind::Refused(RefusalKind::NoRoute), "no_route"),
        ];
        for (k, name) in own {
            assert_eq!((k.as_str(), k.to_string()), (name, name.to_string()));
        }
        let e = DriveError::new(FailKind::Worker(ErrorKind::Overloaded), Some(1), Some("a:1"), "full");
        assert_eq!(
            serde_json::to_value(&e).unwrap(),
            serde_json::json!({"kind": "overloaded", "stage": 1, "addr": "a:1", "message": "full"})
        );
        assert_eq!(e.to_string(), "overloaded at stage Some(1) (Some(\"a:1\")): full");
        assert!(e.kind.is_overloaded() && FailKind::Refused(RefusalKind::Overloaded).is_overloaded());
        assert!(FailKind::Refused(RefusalKind::Full).is_overloaded());
        assert!(!FailKind::Refused(RefusalKind::NoRoute).is_overloaded());
    }
}

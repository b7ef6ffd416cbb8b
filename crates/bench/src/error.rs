//! What can go wrong in a benchmark run or in the local processes it starts.

use std::fmt::Display;

pub type Result<T, E = BenchError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The arguments do not describe a run that can be made.
    #[error("{0}")]
    Usage(String),
    /// A file, a pipe or a process could not be read, written or started.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// Something that should be JSON (a ready line, a peer's report, a record) is not.
    #[error("{what}: {source}")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    /// A local worker or tracker did not start as it should.
    #[error("{0}")]
    Local(String),
    /// A peer tool (llama.cpp, Transformers) is missing or failed.
    #[error("{0}")]
    Peer(String),
    /// The run produced nothing it could measure.
    #[error("{0}")]
    Measure(String),
    /// A plot could not be drawn.
    #[error("drawing a plot: {0}")]
    Plot(String),
    /// The endpoint under load could not be measured at all.
    #[error("{0}")]
    Endpoint(String),
    #[error("opening {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: dgr_hf::HfError,
    },
    #[error("hashing {path}: {source}")]
    Hash {
        path: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(transparent)]
    Gguf(#[from] dgr_gguf::GgufError),
    #[error(transparent)]
    Engine(#[from] dgr_engine::EngineError),
    #[error("the tokenizer of {path}: {source}")]
    Tokenizer {
        path: String,
        #[source]
        source: dgr_tokenizer::TokenizerError,
    },
    #[error(transparent)]
    Drive(#[from] dgr_driver::DriveError),
    #[error(transparent)]
    Tracker(#[from] dgr_proto::TrackerCallError),
    /// A ledger seeded before a tracker starts on it.
    #[error(transparent)]
    Store(#[from] dgr_tracker::StoreError),
}

/// Names what was being done when an I/O or JSON call failed.
pub trait Context<T> {
    fn context(self, what: impl Display) -> Result<T>;
    fn with_context<D: Display>(self, what: impl FnOnce() -> D) -> Result<T>;
}

impl<T> Context<T> for std::io::Result<T> {
    fn context(self, what: impl Display) -> Result<T> {
        self.map_err(|source| BenchError::Io { what: what.to_string(), source })
    }
    fn with_context<D: Display>(self, what: impl FnOnce() -> D) -> Result<T> {
        self.map_err(|source| BenchError::Io { what: what().to_string(), source })
    }
}

impl<T> Context<T> for serde_json::Result<T> {
    fn context(self, what: impl Display) -> Result<T> {
        self.map_err(|source| BenchError::Json { what: what.to_string(), source })
    }
    fn with_context<D: Display>(self, what: impl FnOnce() -> D) -> Result<T> {
        self.map_err(|source| BenchError::Json { what: what().to_string(), source })
    }
}

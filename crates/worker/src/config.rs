use dgr_proto::SeamDtype;
use std::ops::Range;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub model: PathBuf,
    pub layers: Range<usize>,
    pub threads: usize,
    /// Where the stage computes (`auto` resolved at start; part of its engine id).
    pub device: dgr_engine::Device,
    /// The numerics the stage computes in (part of its engine id).
    pub numerics: dgr_engine::Numerics,
    /// The dtype its KV cache stores keys and values in (part of its engine id).
    pub kv_dtype: dgr_engine::KvDtype,
    /// Most sessions open at once.
    pub max_sessions: usize,
    /// KV positions held across all sessions; a session reserves its `max_positions` at open.
    pub kv_budget_tokens: usize,
    /// `kv_budget_tokens` is the default, not asked for: on a GPU it shrinks to what fits in the
    /// device's memory (a budget asked for that does not fit is refused at start).
    pub kv_budget_default: bool,
    /// Most bytes of the GPU's memory the stage may hold (weights, KV and scratch); None: what
    /// the device has free.
    pub gpu_memory_cap: Option<u64>,
    /// A session with no traffic for this long is freed.
    pub idle_timeout: Duration,
    /// After SIGTERM, how long open sessions may take to finish before they are cancelled.
    pub drain_timeout: Duration,
    /// Most connections served at once (stage protocol and HTTP); past it a new one is closed
    /// at once.
    pub max_connections: usize,
    /// A connection must complete its handshake (Hello, or an HTTP request's first bytes)
    /// within this long.
    pub handshake_timeout: Duration,
    /// A connection that holds no session (none driven through it, none whose rows arrive on
    /// it) and sends nothing for this long is closed.
    pub conn_idle_timeout: Duration,
    pub max_frame: usize,
    /// Seam dtypes this worker accepts.
    pub seam_dtypes: Vec<SeamDtype>,
    /// The scheduler's per-step budget and chunking.
    pub policy: crate::plan::Policy,
    /// The trackers to join; None: ticketless local mode (any driver may open sessions).
    pub tracker: Option<TrackerLink>,
    /// Bytes of prefix-cache blocks held at most; None: a quarter of the KV budget's bytes
    /// (`prefix_cache_default`); 0 turns the cache off.
    pub prefix_cache_bytes: Option<usize>,
}

/// How a worker joins its trackers.
#[derive(Clone, Debug)]
pub struct TrackerLink {
    /// Every tracker of the swarm it should register and heartbeat with (host:port each).
    pub addrs: Vec<String>,
    pub join_token: String,
    /// The worker's identity (kept in a key file so a restart keeps it).
    pub identity: dgr_proto::SigningKey,
    /// The address clients dial; None: relayed (no listening port, reached through the tracker).
    pub advertise: Option<String>,
    /// How long the worker keeps trying before it gives up on ever joining (`serve` fails).
    pub join_timeout: std::time::Duration,
}

impl TrackerLink {
    /// Each tracker once, in the order given: `--tracker A,A` runs one join loop, not two
    /// competing for the same registration.
    pub fn distinct_addrs(&self) -> Vec<&str> {
        let mut seen = std::collections::HashSet::new();
        self.addrs.iter().map(String::as_str).filter(|a| seen.insert(*a)).collect()
    }
}

impl WorkerConfig {
    pub fn new(model: PathBuf, layers: Range<usize>) -> WorkerConfig {
        WorkerConfig {
            model,
            layers,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            device: dgr_engine::Device::Cpu,
            numerics: dgr_engine::Numerics::default(),
            kv_dtype: dgr_engine::KvDtype::F32,
            max_sessions: 64,
            kv_budget_tokens: 1 << 16,
            kv_budget_default: true,
            gpu_memory_cap: None,
            idle_timeout: Duration::from_secs(120),
            drain_timeout: Duration::from_secs(10),
            max_connections: 1024,
            handshake_timeout: Duration::from_secs(10),
            conn_idle_timeout: Duration::from_secs(300),
            max_frame: dgr_proto::DEFAULT_MAX_FRAME,
            seam_dtypes: vec![SeamDtype::F32, SeamDtype::F16, SeamDtype::Bf16],
            policy: crate::plan::Policy::default(),
            tracker: None,
            prefix_cache_bytes: None,
        }
    }

    /// The prefix cache's default budget for a stage whose positions cost `per_position`
    /// bytes: a quarter of what the KV budget lets sessions hold. Sessions reserve their whole
    /// context but touch only what they use, so this is memory they rarely reach, and it holds
    /// a quarter of the positions the worker can serve at once: a long system prompt many
    /// times over.
    pub fn prefix_cache_default(&self, per_position: usize) -> usize {
        self.kv_budget_tokens * per_position / 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tracker_named_twice_is_joined_once() {
        let link = TrackerLink {
            addrs: ["b:1", "a:1", "b:1", "c:1", "a:1"].map(String::from).to_vec(),
            join_token: String::new(),
            identity: dgr_proto::SigningKey::from_bytes(&[7; 32]),
            advertise: None,
            join_timeout: std::time::Duration::from_secs(60),
        };
        assert_eq!(link.distinct_addrs(), ["b:1", "a:1", "c:1"]);
    }
}

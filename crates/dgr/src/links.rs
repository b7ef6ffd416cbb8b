//! How a process's links are secured: `--insecure-plaintext` (every process: links in clear,
//! for debugging on a network one trusts; both ends of a link must ask for it, each refuses the
//! other mode, and it is said loudly); `--tracker-key` (every process that talks to a tracker:
//! the key the tracker must prove); `--peer-key` (every process that dials workers on a
//! ticketless route: the key each must prove).

use dgr_proto::VerifyingKey;

#[derive(clap::Args, Clone, Debug)]
pub struct PlaintextArg {
    /// Run this process's links (to trackers, to and between workers) in clear: no encryption
    /// and no check of the other end's key. Refused unless the other end of each link asks for
    /// it too
    #[arg(long)]
    pub insecure_plaintext: bool,
}

impl PlaintextArg {
    /// Sets the process-wide mode before any link is made, and says so.
    pub fn apply(&self, who: &str) {
        if self.insecure_plaintext {
            dgr_proto::set_insecure_plaintext(true);
            eprintln!(
                "dgr {who}: WARNING: --insecure-plaintext: links are NOT encrypted or authenticated; anyone on the path can read and alter prompts, tokens, hidden states, join tokens and API keys"
            );
        }
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct TrackerKeyArg {
    /// The key the tracker proves on its links (hex, 64 digits: `link_key` in `dgr tracker`'s
    /// first line, also printed by `dgr up`); a tracker proving another is refused. Comma-
    /// separate several for trackers that do not share one ledger. Without it, each tracker's
    /// key is trusted on first use (and printed), and a later link proving another is refused
    #[arg(long, env = "DGR_TRACKER_KEY", value_delimiter = ',', value_parser = dgr_proto::parse_tracker_key)]
    pub tracker_key: Vec<VerifyingKey>,
}

impl TrackerKeyArg {
    /// Pins the keys for every tracker link this process makes.
    pub fn apply(&self) {
        dgr_proto::pin_tracker_keys(self.tracker_key.clone());
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct PeerKeyArg {
    /// On a ticketless route (--route, no tracker): the key the worker at ADDR must prove, as
    /// ADDR=KEY (KEY: the worker's id, 64 hex digits, in its first line); repeat or comma-separate
    /// for several. A worker proving another is refused. Without one, each worker's key is
    /// trusted on first use (and printed), and a later link there proving another is refused
    #[arg(long, value_delimiter = ',', value_parser = peer_key)]
    pub peer_key: Vec<(String, VerifyingKey)>,
}

impl PeerKeyArg {
    /// Pins the keys for every ticketless stage link this process makes.
    pub fn apply(&self) {
        dgr_proto::pin_peer_keys(self.peer_key.clone());
    }
}

/// `ADDR=KEY`, the address normalized as every flag's is.
fn peer_key(s: &str) -> Result<(String, VerifyingKey), String> {
    let (addr, key) = dgr_proto::parse_peer_key(s)?;
    Ok((crate::addr::one(&addr).map_err(|e| e.to_string())?, key))
}

//! `dgr key add`: create an API key at a tracker (it stores only the key's hash).

use crate::state::{read_secret, state_dir};
use anyhow::{bail, Result};
use dgr_proto::{KeyAdd, TrackerBody};
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Create an API key; prints it once. Once any key exists, the tracker requires one for every route.
    Add(AddArgs),
}

#[derive(clap::Args)]
pub struct AddArgs {
    #[command(flatten)]
    pub tracker_key: crate::links::TrackerKeyArg,
    #[command(flatten)]
    pub plaintext: crate::links::PlaintextArg,
    /// The tracker's address (host:port, [v6]:port, or dgr://, tcp://, http:// before either), or the swarm's trackers, comma-separated (the first that answers)
    #[arg(long, env = "DGR_TRACKER", value_parser = crate::addr::list)]
    tracker: String,
    /// The key's name in the ledger
    #[arg(long)]
    name: String,
    /// Most prompt + completion tokens the key may use (0: no limit)
    #[arg(long, default_value_t = 0)]
    quota_tokens: u64,
    /// The tracker's join token file (adding keys is the operator's right) [default: $DGR_STATE_DIR/join-token]
    #[arg(long)]
    join_token_file: Option<PathBuf>,
}

pub fn run(c: Command) -> Result<()> {
    let Command::Add(a) = c;
    a.plaintext.apply("key");
    a.tracker_key.apply();
    let join_token = read_secret(&a.join_token_file.unwrap_or_else(|| state_dir().join("join-token")))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let add = KeyAdd { join_token, name: a.name.clone(), quota_tokens: a.quota_tokens, key: String::new() };
    let answer = rt.block_on(dgr_driver::Trackers::new(&a.tracker, Duration::from_secs(5)).call(TrackerBody::KeyAdd(add)))?;
    let TrackerBody::KeyAdded(k) = answer else { bail!("the tracker answered something else") };
    println!("{}", serde_json::json!({ "name": a.name, "key": k.key, "quota_tokens": a.quota_tokens }));
    Ok(())
}

//! `dgr`: the command line over dgr's crates. Each subcommand lives in its own module.

mod addr;
mod devices;
mod embed;
mod fetch;
mod gateway;
mod generate;
mod inspect;
mod key;
mod links;
mod model;
mod routed;
mod score;
mod slice;
mod state;
mod status;
mod synth;
mod tokenize;
mod tracker;
mod up;
mod worker;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "dgr", version, about = "Run GGUF language models, whole or split across worker processes.")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Tokenize text as llama.cpp does (special tokens parsed, no BOS added); prints {"tokens":[...]}.
    Tokenize(tokenize::Args),
    /// Generate a completion of a prompt.
    Generate(generate::Args),
    /// A text's embedding in one process: the final-normed hidden states pooled as the model's
    /// `{arch}.pooling_type` says (mean when it says none or nothing: cls and last are the first
    /// and last position), L2-normalised; prints {"embedding":[...], ...}.
    Embed(embed::Args),
    /// Serve a layer range of a model as one stage of a route.
    Worker(worker::Args),
    /// Teacher-forced log-probabilities of a given continuation of a prompt.
    Score(score::Args),
    /// Print a GGUF file's architecture, hyperparameters and tensors.
    Inspect(inspect::Args),
    /// List the GPU adapters `--device gpu:N` counts, as JSON: index, name, ids, driver, whether
    /// it is a software device (never picked by `--device auto`), its engine id and memory.
    Devices(devices::Args),
    /// Cut the part of a model one stage needs (its layers' tensors, the whole model's metadata
    /// and identity) into a GGUF file a worker can serve from.
    Slice(slice::Args),
    /// Write a random-weight llama-shaped GGUF (for tests and benchmarks).
    Synth(synth::Args),
    /// Start a local swarm (a tracker, workers, the OpenAI gateway) and serve until Ctrl-C.
    Up(up::Args),
    /// Serve the OpenAI API (and a dashboard) over a tracker's swarm.
    Gateway(gateway::Args),
    /// Run a tracker: worker registry, route planning, signed tickets, usage ledger, relay.
    Tracker(tracker::Args),
    /// Show what a tracker knows: per model, the coverage of its layers and every worker.
    Swarm(status::SwarmArgs),
    /// Show a tracker's usage ledger, by API key or by worker.
    Usage(status::UsageArgs),
    /// Manage a tracker's API keys.
    #[command(subcommand)]
    Key(key::Command),
    /// Measure dgr against llama.cpp in the same run and print the ratios.
    #[command(subcommand)]
    Bench(dgr_bench::Command),
}

fn main() {
    // Mesa's Vulkan device-select layer asks the Wayland session which GPU to prefer, and prints
    // an error to stderr at every adapter listing where there is none (a headless host).
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Tokenize(_)
            | Command::Embed(_)
            | Command::Score(_)
            | Command::Inspect(_)
            | Command::Devices(_)
            | Command::Synth(_)
            | Command::Swarm(_)
            | Command::Usage(_)
    ) {
        die_on_broken_pipe();
    }
    let result = match cli.command {
        Command::Tokenize(a) => tokenize::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Score(a) => score::run(a),
        Command::Embed(a) => embed::run(a),
        Command::Worker(a) => worker::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Devices(a) => devices::run(a),
        Command::Synth(a) => synth::run(a),
        Command::Slice(a) => slice::run(a),
        Command::Up(a) => up::run(a),
        Command::Gateway(a) => gateway::run(a),
        Command::Tracker(a) => tracker::run(a),
        Command::Swarm(a) => status::swarm(a),
        Command::Usage(a) => status::usage(a),
        Command::Key(c) => key::run(c),
        Command::Bench(c) => dgr_bench::run(c).map_err(Into::into),
    };
    if let Err(e) = result {
        eprintln!("dgr: {}", describe(&e));
        std::process::exit(1);
    }
}

/// Makes a write to a closed pipe end the process quietly (`dgr inspect m | head`), as CLI tools
/// do. Only for commands without sockets: there a peer that goes away must be an error to
/// handle, not a signal that kills the process.
pub fn die_on_broken_pipe() {
    // SAFETY: restoring the default disposition of a signal, before any other thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// The error and its causes, leaving out a cause whose text its parent already includes.
fn describe(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}

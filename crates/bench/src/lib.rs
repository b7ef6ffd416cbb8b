//! dgr's benchmarks: each measures dgr and its peer (llama.cpp) in the same run, reports the
//! ratios and writes a record. Also what they share with the binary's local commands: the
//! `--model` argument (`model`), one-process generation (`local`) and local worker and tracker
//! processes of the dgr executable (`swarm`).

mod bandwidth;
mod batch;
mod delay;
mod engine;
mod error;
mod links;
pub mod local;
mod model;
mod peer;
mod plot;
mod prefix;
pub mod probe;
mod record;
mod route;
mod serve;
mod serve_client;
mod servers;
pub mod swarm;
mod tracker;
mod tracker_load;
mod wan;

pub use error::{BenchError, Result};
pub use model::{gpu_room, ModelArg, NumericsArg};

#[derive(clap::Subcommand)]
pub enum Command {
    /// One process: prefill of a prompt and decode of new tokens, against llama-bench, with this
    /// machine's streaming read bandwidth measured beside decode.
    Engine(engine::Args),
    /// This machine's streaming read bandwidth over N threads (the rate a large model's decode
    /// is bound by).
    Bandwidth(bandwidth::Args),
    /// One session decoding through a local multi-process route, against one-process dgr and
    /// llama.cpp RPC (ggml-rpc-server processes driven by llama-bench).
    Route(route::Args),
    /// Aggregate decode of 1, 2, 4, 8 concurrent sessions, one process and through a route,
    /// against llama-batched-bench; writes a plot beside the record.
    Batch(batch::Args),
    /// What link encryption costs decode: one session through a local route with encrypted
    /// links and through the same route with --insecure-plaintext, in alternating rounds.
    Links(links::Args),
    /// What a tracker costs per token: decode through the same 2-worker route given by --route,
    /// planned by a tracker with a signed ticket, and with its second hop relayed. With
    /// --workers N [--ledger-rows M]: the tracker under load instead: routed requests/s and route
    /// latency with N registered workers and M ledger rows (and an empty ledger), no model needed.
    Tracker(tracker::Args),
    /// Load on any OpenAI-compatible endpoint (dgr, llama-server, vLLM): streamed completions,
    /// N in flight, reporting output tok/s, TTFT and inter-token latency; with --peer-url,
    /// rounds alternate with a second endpoint and the report adds the ratios.
    Serve(serve::Args),
    /// What the prefix caches buy: the second turn of chats with a long first message (its
    /// TTFT over the first turn's) and requests sharing a long system message, N in flight
    /// (aggregate throughput), through `dgr up` with its defaults, the same with
    /// --prefix-cache-mb 0, and llama-server with its prompt cache, all started by the bench.
    Prefix(prefix::Args),
    /// The 2-worker route over a slow network: every hop behind a proxy delaying each direction
    /// by --delay-ms, 1 and 16 concurrent sessions, against llama.cpp RPC behind the same
    /// proxies.
    Wan(wan::Args),
}

/// Runs one benchmark; the local workers and trackers it starts are `dgr` processes of the
/// running executable.
pub fn run(c: Command) -> Result<()> {
    match c {
        Command::Engine(a) => engine::run(a),
        Command::Bandwidth(a) => bandwidth::run(a),
        Command::Route(a) => route::run(a),
        Command::Batch(a) => batch::run(a),
        Command::Links(a) => links::run(a),
        Command::Tracker(a) => tracker::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Prefix(a) => prefix::run(a),
        Command::Wan(a) => wan::run(a),
    }
}

/// A deterministic prompt of `len` token ids for sequence `seq`, distinct per sequence.
fn prompt(vocab: u32, seq: usize, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7919 + seq as u32 * 104_729 + 13) % vocab).collect()
}

/// The smallest and largest of samples.
fn spread(v: &[f64]) -> (f64, f64) {
    v.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| (lo.min(x), hi.max(x)))
}

/// The median of samples (the mean of the middle two for an even count).
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

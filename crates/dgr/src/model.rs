//! The arguments that say what a command computes on and with how many threads.

pub use dgr_bench::{ModelArg, NumericsArg};

/// `--threads N` on every command that computes.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct ThreadsArg {
    /// Compute threads [default: the number of CPUs]
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
}

impl ThreadsArg {
    pub fn get(&self) -> usize {
        self.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)).max(1)
    }
}

//! `dgr devices`: the GPU adapters `--device gpu:N` counts, as JSON, and how fast each computes.

use anyhow::{Context, Result};
use dgr_engine::{Device, EngineSpec};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct Args {
    /// Also time one session's decode step on each adapter over this model's first layers, as
    /// `step_us_per_layer` (what `dgr up` weighs a GPU against the CPU with)
    #[arg(long)]
    time_model: Option<PathBuf>,
    /// With --time-model: time only adapter N (a step on a software adapter takes seconds)
    #[arg(long, value_name = "N", requires = "time_model")]
    only: Option<usize>,
}

pub fn run(a: Args) -> Result<()> {
    let mut listed = dgr_bench::NumericsArg::devices_json();
    if let Some(path) = &a.time_model {
        let g = Arc::new(dgr_hf::open_any(path).with_context(|| format!("opening {}", path.display()))?);
        let n_layers = dgr_engine::ModelConfig::from_gguf(&g)?.n_layers;
        for (i, d) in listed.as_array_mut().into_iter().flatten().enumerate() {
            if a.only.is_some_and(|n| n != i) {
                continue;
            }
            let spec = EngineSpec::threads(1).on(Device::Gpu(i), None);
            d["step_us_per_layer"] = match dgr_bench::probe::step_us_per_layer(&g, n_layers, spec) {
                Ok(us) => us.into(),
                Err(e) => {
                    eprintln!("dgr devices: timing GPU {i}: {e}");
                    serde_json::Value::Null
                }
            };
        }
    }
    println!("{listed}");
    Ok(())
}

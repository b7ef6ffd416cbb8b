//! How long a device takes per layer for one session's decode step: what `dgr up` weighs the CPU
//! against a GPU with when a model is split between them.

use crate::error::{BenchError, Result};
use dgr_engine::{Engine, EngineSpec, Input, LogitRows, SeqInput};
use dgr_gguf::Gguf;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Layers a probe runs (the model's first ones), and its timed steps (after as many untimed).
const LAYERS: usize = 4;
const STEPS: usize = 8;

/// Microseconds per layer of one session's decode step on `spec`'s device: the model's first
/// layers opened there, a short prompt prefilled, the median of single-token steps.
pub fn step_us_per_layer(model: &Arc<Gguf>, n_layers: usize, spec: EngineSpec) -> Result<f64> {
    let layers = 0..LAYERS.min(n_layers).max(1);
    let stage = dgr_engine::open_engine(model.clone(), layers.clone(), spec)?;
    let mut kv = stage.new_state(16 + 2 * STEPS, layers.clone())?;
    let mut step = |tokens: &[u32]| stage.forward(&mut [SeqInput { kv: &mut kv, input: Input::Tokens(tokens), logits: LogitRows::Last }]);
    step(&[1, 2, 3, 4, 5, 6, 7, 8])?;
    let mut samples = Vec::with_capacity(STEPS);
    for i in 0..2 * STEPS {
        let t = Instant::now();
        step(&[9 + i as u32])?;
        if i >= STEPS {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples[STEPS / 2] / layers.len() as f64)
}

/// `step_us_per_layer` on GPU `index`, measured by a child process (`dgr devices --time-model`)
/// so that this one never loads a GPU driver.
pub fn gpu_step_us_per_layer(model: &Path, index: usize) -> Result<f64> {
    let exe = std::env::current_exe().map_err(|e| BenchError::Local(format!("finding this executable: {e}")))?;
    let out = std::process::Command::new(exe)
        .args(["devices", "--time-model"])
        .arg(model)
        .args(["--only", &index.to_string()])
        .output()
        .map_err(|e| BenchError::Local(format!("running dgr devices: {e}")))?;
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    listed[index]["step_us_per_layer"]
        .as_f64()
        .ok_or_else(|| BenchError::Measure(format!("timing GPU {index}: {}", String::from_utf8_lossy(&out.stderr).trim())))
}

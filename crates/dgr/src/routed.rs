//! `dgr generate` through a route of stage workers: given by address, or started locally.

use crate::local::Request;
use crate::swarm::LocalSwarm;
use anyhow::{bail, Context, Result};
use dgr_gateway::{Completion, DriveError, DriveOptions, Flow, GenRequest, Route};
use dgr_proto::{Sampling, SeamDtype};
use std::path::Path;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct RouteArgs {
    /// Generate through these workers (their --listen addresses, in layer order, comma-separated)
    #[arg(long, conflicts_with = "split")]
    pub route: Option<String>,
    /// Start N local workers with even layer ranges, generate through them, then stop them
    #[arg(long)]
    pub split: Option<usize>,
    /// Seconds to wait for any one step before giving up on the route
    #[arg(long, default_value_t = 5.0)]
    pub step_timeout: f64,
    /// Dtype of hidden rows between stages: f32 (lossless) or the opt-in f16, bf16
    #[arg(long, default_value = "f32")]
    pub seam_dtype: String,
}

/// Runs the request along the route. The outer error is a local problem (bad options, workers
/// that would not start); the inner one is the route's structured failure.
pub fn generate(
    a: &RouteArgs,
    model: &Path,
    n_layers: usize,
    threads: usize,
    req: &Request,
    is_eog: &dyn Fn(u32) -> bool,
    on_token: &mut dyn FnMut(u32),
) -> Result<std::result::Result<(Completion, serde_json::Value), DriveError>> {
    let seam_dtype = SeamDtype::parse(&a.seam_dtype).with_context(|| format!("--seam-dtype {:?}: use f32, f16 or bf16", a.seam_dtype))?;
    let step_timeout =
        Duration::try_from_secs_f64(a.step_timeout).ok().filter(|d| !d.is_zero()).context("--step-timeout must be positive")?;
    let swarm;
    let addrs: Vec<String> = match (&a.route, a.split) {
        (Some(r), _) => r.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect(),
        (None, Some(n)) => {
            crate::swarm::check_split(n_layers, n)?;
            swarm = LocalSwarm::start(model, &crate::swarm::even_split(n_layers, n), threads, &[])?;
            swarm.addrs.clone()
        }
        (None, None) => bail!("neither --route nor --split"),
    };
    let model_id = dgr_gguf::model_id(model).with_context(|| format!("hashing {}", model.display()))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let opts = DriveOptions { step_timeout, ..DriveOptions::default() };
    Ok(rt.block_on(async {
        let route = Route::discover(&addrs, opts.connect_timeout).await?;
        if route.model_id() != model_id {
            let msg = format!("the route serves model {} but --model is {model_id}", route.model_id());
            return Err(DriveError::new("route", Some(0), Some(&addrs[0]), msg));
        }
        let g = GenRequest {
            prompt_tokens: req.prompt_tokens.clone(),
            max_tokens: req.max_tokens,
            sampling: Sampling {
                temperature: req.sampling.temperature,
                top_k: req.sampling.top_k as u32,
                top_p: req.sampling.top_p,
                seed: req.sampling.seed,
            },
            top_logprobs: req.top_logprobs as u32,
            seam_dtype,
        };
        let out = dgr_gateway::generate(&route, &g, &opts, |t| {
            on_token(t.token);
            if !req.ignore_eos && is_eog(t.token) {
                Flow::Stop
            } else {
                Flow::Continue
            }
        })
        .await?;
        let extra = serde_json::json!({
            "route": route.addrs(),
            "seam_dtype": seam_dtype.name(),
            "seams": out.seams,
            "stages": out.stages,
            "usage": out.usage,
        });
        Ok((out, extra))
    }))
}

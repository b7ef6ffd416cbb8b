//! `dgr generate` through a route of stage workers: given by address, or started locally.

use anyhow::{bail, Context, Result};
use dgr_bench::local::Request;
use dgr_bench::swarm::LocalSwarm;
use dgr_bench::NumericsArg;
use dgr_driver::{generate_recovering, tracker, Completion, DriveError, DriveOptions, FailKind, Flow, GenRequest, Route};
use dgr_engine::EngineId;
use dgr_proto::{Sampling, SeamDtype};
use std::path::Path;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct RouteArgs {
    /// Generate through these ticketless workers (their --listen addresses, in layer order,
    /// comma-separated; each (host:port, [v6]:port, or dgr://, tcp://, http:// before either))
    #[arg(long, conflicts_with_all = ["split", "tracker"], value_parser = crate::addr::list)]
    pub route: Option<String>,
    /// Start N local workers with even layer ranges, generate through them, then stop them
    #[arg(long, conflicts_with = "tracker")]
    pub split: Option<usize>,
    /// Ask this tracker (host:port, [v6]:port, or dgr://, tcp://, http:// before either), or the swarm's trackers, comma-separated (the next when one
    /// cannot answer), for a route and its signed ticket, and report the request's usage to the ledger
    #[arg(long, value_parser = crate::addr::list)]
    pub tracker: Option<String>,
    /// Run on a route of any engine, one that mixes engines (CPU layers, then GPU layers)
    /// included: with --tracker the cheapest, as the gateway asks; with --route the one given.
    /// Without it the route must run the engine --device, --numerics and --kv-dtype name
    #[arg(long)]
    pub any_engine: bool,
    /// The API key the tracker bills (needed once the tracker has keys)
    #[arg(long, env = "DGR_API_KEY", default_value = "", hide_env_values = true)]
    pub api_key: String,
    /// Seconds to wait for any one step before giving up on the route
    #[arg(long, default_value_t = 5.0)]
    pub step_timeout: f64,
    /// Dtype of hidden rows between stages: f32 (lossless) or the opt-in f16, bf16
    #[arg(long, default_value = "f32")]
    pub seam_dtype: String,
    /// Speculative decoding through the route: off, or at most N draft tokens a step (up to 16),
    /// guessed from the text so far and verified in one step; the tokens are the same as off
    #[arg(long, default_value_t = dgr_driver::Speculate::DEFAULT, value_parser = dgr_driver::Speculate::parse)]
    pub speculate: dgr_driver::Speculate,
    #[command(flatten)]
    pub plaintext: crate::links::PlaintextArg,
    #[command(flatten)]
    pub tracker_key: crate::links::TrackerKeyArg,
    #[command(flatten)]
    pub peer_key: crate::links::PeerKeyArg,
}

/// Runs the request along the route. The outer error is a local problem (bad options, workers
/// that would not start); the inner one is the route's structured failure.
pub fn generate(
    a: &RouteArgs,
    model: &Path,
    n_layers: usize,
    (threads, engine): (usize, EngineId),
    req: &Request,
    eog: &[u32],
    on_token: &mut dyn FnMut(u32),
) -> Result<std::result::Result<(Completion, serde_json::Value), DriveError>> {
    let seam_dtype = SeamDtype::parse(&a.seam_dtype).with_context(|| format!("--seam-dtype {:?}: use f32, f16 or bf16", a.seam_dtype))?;
    let step_timeout =
        Duration::try_from_secs_f64(a.step_timeout).ok().filter(|d| !d.is_zero()).context("--step-timeout must be positive")?;
    a.plaintext.apply("generate");
    a.tracker_key.apply();
    a.peer_key.apply();
    let worker_flags: Vec<String> = if a.plaintext.insecure_plaintext { vec!["--insecure-plaintext".into()] } else { Vec::new() };
    let swarm;
    let addrs: Vec<String> = match (&a.route, a.split) {
        (Some(r), _) => r.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect(),
        (None, Some(n)) => {
            dgr_bench::swarm::check_split(n_layers, n)?;
            let mut flags = NumericsArg::of(engine).worker_flags()?.to_vec();
            flags.extend(worker_flags);
            swarm = LocalSwarm::start(model, &dgr_bench::swarm::even_split(n_layers, n), threads, &flags)?;
            swarm.addrs.clone()
        }
        (None, None) if a.tracker.is_some() => Vec::new(),
        (None, None) => bail!("none of --route, --split, --tracker"),
    };
    let model_id = dgr_hf::identity_any(model).with_context(|| format!("hashing the tensors of {}", model.display()))?.id;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let opts = DriveOptions { step_timeout, speculate: a.speculate, ..DriveOptions::default() };
    Ok(rt.block_on(async {
        let budget = (req.prompt_tokens.len() + req.max_tokens) as u64;
        let (route, ticket, request_id) = match &a.tracker {
            Some(t) => {
                let request_id = tracker::new_request_id();
                let ask = if a.any_engine { String::new() } else { engine.to_string() };
                let (route, ticket) = tracker::route(t, &model_id, &ask, budget, &a.api_key, &request_id, &[], &req.prompt_tokens).await?;
                (route, Some(ticket), request_id)
            }
            None => (Route::discover(&addrs, opts.connect_timeout).await?, None, String::new()),
        };
        if route.model_id() != model_id {
            let msg = format!("the route serves model {} but --model is {model_id}", route.model_id());
            return Err(DriveError::new(FailKind::Route, Some(0), Some(&route.stages[0].addr), msg));
        }
        if !a.any_engine && route.engine() != engine.to_string() {
            let msg = format!("the route computes with engine {} but this run asks for {engine} (--any-engine runs on it)", route.engine());
            return Err(DriveError::new(FailKind::Route, Some(0), Some(&route.stages[0].addr), msg));
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
            ticket: None,
            hash_rows: false,
            constraint: None,
            stop_tokens: if req.ignore_eos { Vec::new() } else { eog.to_vec() },
        };
        let on_token = |t: &dgr_proto::TokenOut| {
            on_token(t.token);
            if !req.ignore_eos && eog.contains(&t.token) {
                Flow::Stop
            } else {
                Flow::Continue
            }
        };
        // Through a tracker a failed stage is replaced and the session replayed; a ticketless
        // route has no one to ask.
        let replan = |exclude: Vec<String>, budget: u64, engine: String| {
            let (tracker, model_id, key, request_id) = (a.tracker.clone(), model_id.clone(), a.api_key.clone(), request_id.clone());
            let prompt = req.prompt_tokens.clone();
            async move {
                let t = tracker.ok_or_else(|| DriveError::new(FailKind::Route, None, None, "no tracker"))?;
                tracker::route(&t, &model_id, &engine, budget, &key, &request_id, &exclude, &prompt).await.map(|(r, t)| (r, Some(t)))
            }
        };
        let replays = if a.tracker.is_some() { 3 } else { 0 };
        let links = dgr_driver::Links::new();
        let rec = generate_recovering(&links, (route, ticket), &g, &opts, on_token, replan, replays).await;
        let ledger = match &a.tracker {
            Some(t) => {
                let usage = tracker::request_usage(&request_id, &a.api_key, &model_id, req.prompt_tokens.len(), &rec.result, &rec.attempts);
                Some(tracker::report(t, usage).await)
            }
            None => None,
        };
        let Some(route) = rec.attempts.last().map(|x| x.route.clone()) else { return rec.result.map(|c| (c, serde_json::Value::Null)) };
        let out = rec.result?;
        let extra = serde_json::json!({
            "route": route.addrs(),
            "layers": route.stages.iter().map(|s| [s.info.layer_start, s.info.layer_end]).collect::<Vec<_>>(),
            "worker_ids": route.stages.iter().map(|s| s.worker_id.clone()).collect::<Vec<_>>(),
            "engine": route.engine(),
            "request_id": request_id,
            "ledger": ledger,
            "recoveries": rec.recoveries,
            "seam_dtype": seam_dtype.name(),
            "seams": out.seams,
            "stages": out.stages,
            "usage": out.usage,
            "cached_tokens": out.cached_tokens,
            "drafts": out.drafts,
        });
        Ok((out, extra))
    }))
}

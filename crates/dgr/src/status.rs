//! `dgr swarm` and `dgr usage`: what a tracker knows, as a table or JSON.

use anyhow::{bail, Result};
use dgr_proto::{SwarmQuery, SwarmReply, TrackerBody, TrackerClient, UsageQuery};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(clap::Args)]
pub struct SwarmArgs {
    /// The tracker's address
    #[arg(long, env = "DGR_TRACKER")]
    tracker: String,
    /// text or json
    #[arg(long, default_value = "text")]
    format: String,
}

#[derive(clap::Args)]
pub struct UsageArgs {
    /// The tracker's address
    #[arg(long, env = "DGR_TRACKER")]
    tracker: String,
    /// Group by API key (prompt and completion tokens per model) or by worker (layer-tokens computed)
    #[arg(long, default_value = "key")]
    by: String,
    /// text or json
    #[arg(long, default_value = "text")]
    format: String,
}

fn check_format(f: &str) -> Result<()> {
    if f != "text" && f != "json" {
        bail!("--format {f:?}: use text or json");
    }
    Ok(())
}

fn ask(tracker: &str, q: TrackerBody) -> Result<TrackerBody> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    Ok(rt.block_on(async {
        let mut c = TrackerClient::connect(tracker, Duration::from_secs(5)).await?;
        c.call(q).await
    })?)
}

/// The swarm as JSON: per model, the replicas of each layer and every worker.
pub fn swarm_json(r: &SwarmReply) -> Value {
    let mut models: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    let mut coverage: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for w in &r.workers {
        let Some(reg) = &w.registration else { continue };
        let live = w.last_seen_ms <= 3 * r.heartbeat_ms as u64;
        let load = w.load.unwrap_or_default();
        let cover = coverage.entry(reg.model_id.clone()).or_insert_with(|| vec![0; reg.n_layers as usize]);
        if live {
            for l in reg.layer_start..reg.layer_end.min(cover.len() as u32) {
                cover[l as usize] += 1;
            }
        }
        models.entry(reg.model_id.clone()).or_default().push(json!({
            "worker_id": w.worker_id,
            "addr": reg.addr,
            "relayed": w.relayed,
            "engine": reg.engine,
            "layers": [reg.layer_start, reg.layer_end],
            "live": live,
            "last_seen_ms": w.last_seen_ms,
            "sessions": load.sessions,
            "queue_depth": load.queue_depth,
            "kv_used_tokens": load.kv_used_tokens,
            "kv_tokens": reg.kv_tokens,
            "step_us_per_layer": reg.step_us_per_layer,
            "recent_step_us": load.recent_step_us,
            "threads": reg.threads,
            "routes_total": w.routes_total,
        }));
    }
    let models: Vec<Value> = models
        .into_iter()
        .map(|(model, workers)| {
            let cover = &coverage[&model];
            json!({
                "model_id": model,
                "n_layers": cover.len(),
                "covered": cover.iter().all(|c| *c > 0),
                "replicas_per_layer": cover,
                "workers": workers,
            })
        })
        .collect();
    json!({ "heartbeat_ms": r.heartbeat_ms, "models": models })
}

pub fn swarm(a: SwarmArgs) -> Result<()> {
    check_format(&a.format)?;
    let TrackerBody::SwarmReply(r) = ask(&a.tracker, TrackerBody::SwarmQuery(SwarmQuery {}))? else {
        bail!("the tracker answered something else");
    };
    let v = swarm_json(&r);
    if a.format == "json" {
        println!("{v}");
        return Ok(());
    }
    let models = v["models"].as_array().cloned().unwrap_or_default();
    if models.is_empty() {
        println!("no workers");
    }
    for m in models {
        let cover: Vec<u64> = m["replicas_per_layer"].as_array().into_iter().flatten().filter_map(|c| c.as_u64()).collect();
        let map: String = cover.iter().map(|c| if *c == 0 { '.' } else { char::from_digit((*c).min(9) as u32, 10).unwrap_or('9') }).collect();
        let state = if m["covered"].as_bool() == Some(true) { "covered" } else { "NOT covered" };
        println!("model {} ({} layers, {state})\n  replicas per layer: {map}", m["model_id"].as_str().unwrap_or(""), cover.len());
        println!("  {:<16} {:<28} {:>9} {:<6} {:>8} {:>6} {:>11} {:>7}", "worker", "addr", "layers", "state", "sessions", "queue", "us/layer", "routes");
        for w in m["workers"].as_array().into_iter().flatten() {
            let id = w["worker_id"].as_str().unwrap_or("");
            println!(
                "  {:<16} {:<28} {:>9} {:<6} {:>8} {:>6} {:>11.1} {:>7}",
                &id[..id.len().min(16)],
                w["addr"].as_str().unwrap_or(""),
                format!("{}..{}", w["layers"][0], w["layers"][1]),
                if w["live"].as_bool() == Some(true) { "live" } else { "silent" },
                w["sessions"],
                w["queue_depth"],
                w["step_us_per_layer"].as_f64().unwrap_or(0.0),
                w["routes_total"],
            );
        }
    }
    Ok(())
}

pub fn usage(a: UsageArgs) -> Result<()> {
    check_format(&a.format)?;
    if a.by != "key" && a.by != "worker" {
        bail!("--by {:?}: use key or worker", a.by);
    }
    let TrackerBody::UsageReply(r) = ask(&a.tracker, TrackerBody::UsageQuery(UsageQuery { by: a.by.clone() }))? else {
        bail!("the tracker answered something else");
    };
    let rows: Vec<Value> = r
        .rows
        .iter()
        .map(|u| {
            json!({
                a.by.as_str(): u.who, "model_id": u.model_id, "engine": u.engine, "requests": u.requests,
                "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "tokens_prefilled": u.tokens_prefilled, "tokens_decoded": u.tokens_decoded,
                "layer_tokens": u.layer_tokens, "disagreements": u.disagreements,
            })
        })
        .collect();
    if a.format == "json" {
        println!("{}", json!({ "by": a.by, "rows": rows }));
        return Ok(());
    }
    if a.by == "key" {
        println!("{:<20} {:<18} {:>8} {:>12} {:>12} {:>14}", "key", "model", "requests", "prompt", "completion", "layer_tokens");
        for u in &r.rows {
            println!(
                "{:<20} {:<18} {:>8} {:>12} {:>12} {:>14}",
                u.who,
                &u.model_id[..u.model_id.len().min(16)],
                u.requests,
                u.prompt_tokens,
                u.completion_tokens,
                u.layer_tokens
            );
        }
    } else {
        println!("{:<18} {:<18} {:>8} {:>10} {:>10} {:>14} {:>8}", "worker", "model", "sessions", "prefilled", "decoded", "layer_tokens", "disagree");
        for u in &r.rows {
            println!(
                "{:<18} {:<18} {:>8} {:>10} {:>10} {:>14} {:>8}",
                &u.who[..u.who.len().min(16)],
                &u.model_id[..u.model_id.len().min(16)],
                u.requests,
                u.tokens_prefilled,
                u.tokens_decoded,
                u.layer_tokens,
                u.disagreements
            );
        }
    }
    Ok(())
}

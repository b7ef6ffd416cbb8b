//! `dgr swarm` and `dgr usage`: what a tracker knows, as a table or JSON.

use anyhow::{bail, Result};
use dgr_proto::{SwarmQuery, TrackerBody, UsageQuery};
use serde_json::{json, Value};
use std::time::Duration;

#[derive(clap::Args)]
pub struct SwarmArgs {
    #[command(flatten)]
    pub tracker_key: crate::links::TrackerKeyArg,
    #[command(flatten)]
    pub plaintext: crate::links::PlaintextArg,
    /// The tracker's address (host:port, [v6]:port, or dgr://, tcp://, http:// before either), or the swarm's trackers, comma-separated (the first that answers)
    #[arg(long, env = "DGR_TRACKER", value_parser = crate::addr::list)]
    tracker: String,
    /// text or json
    #[arg(long, default_value = "text")]
    format: String,
}

#[derive(clap::Args)]
pub struct UsageArgs {
    #[command(flatten)]
    pub tracker_key: crate::links::TrackerKeyArg,
    #[command(flatten)]
    pub plaintext: crate::links::PlaintextArg,
    /// The tracker's address (host:port, [v6]:port, or dgr://, tcp://, http:// before either), or the swarm's trackers, comma-separated (the first that answers)
    #[arg(long, env = "DGR_TRACKER", value_parser = crate::addr::list)]
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
    Ok(rt.block_on(dgr_driver::Trackers::new(tracker, Duration::from_secs(5)).call(q))?)
}

pub fn swarm(a: SwarmArgs) -> Result<()> {
    a.plaintext.apply("swarm");
    a.tracker_key.apply();
    check_format(&a.format)?;
    let TrackerBody::SwarmReply(r) = ask(&a.tracker, TrackerBody::SwarmQuery(SwarmQuery {}))? else {
        bail!("the tracker answered something else");
    };
    let v = dgr_gateway::swarm_json(&r);
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
        let map: String =
            cover.iter().map(|c| if *c == 0 { '.' } else { char::from_digit((*c).min(9) as u32, 10).unwrap_or('9') }).collect();
        let state = if m["covered"].as_bool() == Some(true) { "covered" } else { "NOT covered" };
        let engine = m["workers"][0]["engine"].as_str().unwrap_or("");
        println!("model {} ({} layers, {engine}, {state})\n  replicas per layer: {map}", m["model_id"].as_str().unwrap_or(""), cover.len());
        println!("{}", table_row(HEADER));
        for w in m["workers"].as_array().into_iter().flatten() {
            println!("{}", worker_row(w));
        }
    }
    Ok(())
}

pub fn usage(a: UsageArgs) -> Result<()> {
    a.plaintext.apply("usage");
    a.tracker_key.apply();
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
        println!(
            "{:<18} {:<18} {:<21} {:>8} {:>10} {:>10} {:>14} {:>8}",
            "worker", "model", "engine", "sessions", "prefilled", "decoded", "layer_tokens", "disagree"
        );
        for u in &r.rows {
            println!(
                "{:<18} {:<18} {:<21} {:>8} {:>10} {:>10} {:>14} {:>8}",
                &u.who[..u.who.len().min(16)],
                &u.model_id[..u.model_id.len().min(16)],
                u.engine,
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

const HEADER: [&str; 10] = ["worker", "addr", "layers", "state", "sessions", "queue", "KV free", "GPU MiB free", "us/layer", "routes"];

/// One line of `dgr swarm`'s table: the header's or a worker's cells, each in its column.
fn table_row(cells: [&str; 10]) -> String {
    let [id, addr, layers, state, sessions, queue, kv, gpu, step, routes] = cells;
    format!("  {id:<16} {addr:<28} {layers:>9} {state:<6} {sessions:>8} {queue:>6} {kv:>9} {gpu:>15} {step:>11} {routes:>7}")
}

/// A worker of `dgr_gateway::swarm_json` as a row of the table.
fn worker_row(w: &serde_json::Value) -> String {
    let id = w["worker_id"].as_str().unwrap_or("");
    let count = |k: &str| w[k].as_u64().unwrap_or(0).to_string();
    let mib = |k: &str| w[k].as_u64().unwrap_or(0) >> 20;
    let gpu = match w["device_memory_total"].as_u64() {
        Some(t) if t > 0 => format!("{} / {}", mib("device_memory_free"), mib("device_memory_total")),
        _ => "-".into(),
    };
    let state = if w["quarantined"] == true {
        "QUAR."
    } else if w["live"] == true {
        "live"
    } else {
        "silent"
    };
    table_row([
        &id[..id.len().min(16)],
        w["addr"].as_str().unwrap_or(""),
        &format!("{}..{}", w["layers"][0], w["layers"][1]),
        state,
        &count("sessions"),
        &count("queue_depth"),
        // The KV positions a new session may still reserve (what the tracker routes by).
        &w["kv_tokens"].as_u64().unwrap_or(0).saturating_sub(w["kv_reserved_tokens"].as_u64().unwrap_or(0)).to_string(),
        &gpu,
        &format!("{:.1}", w["step_us_per_layer"].as_f64().unwrap_or(0.0)),
        &count("routes_total"),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every cell of a worker's row ends where its header's does (numbers were once printed as
    /// JSON values, which ignore the width).
    #[test]
    fn a_workers_row_lines_up_with_the_header() {
        let w = serde_json::json!({
            "worker_id": "w-1", "addr": "127.0.0.1:9", "layers": [0, 15], "live": true, "sessions": 3,
            "queue_depth": 1, "kv_tokens": 65536, "kv_reserved_tokens": 300, "device_memory_total": 2u64 << 30, "device_memory_free": 1u64 << 30,
            "step_us_per_layer": 12.5, "routes_total": 40,
        });
        let header = table_row(HEADER);
        let row = worker_row(&w);
        assert_eq!(
            row,
            format!(
                "  {:<16} {:<28} {:>9} {:<6} {:>8} {:>6} {:>9} {:>15} {:>11} {:>7}",
                "w-1", "127.0.0.1:9", "0..15", "live", 3, 1, 65236, "1024 / 2048", "12.5", 40
            )
        );
        assert_eq!(row.len(), header.len(), "{header}\n{row}");
    }
}

//! What the dashboard shows, as JSON: per model, the coverage of its layers and every worker
//! with its range, liveness and load; tokens/s; usage per key from the tracker's ledger.

use crate::service::Gateway;
use dgr_proto::{SwarmReply, TrackerBody, UsageQuery};
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// The swarm per model: replicas of each layer, whether every layer is covered, every worker.
pub fn swarm_json(r: &SwarmReply) -> Value {
    let mut models: BTreeMap<String, (Vec<u32>, Vec<Value>)> = BTreeMap::new();
    for w in &r.workers {
        let Some(reg) = &w.registration else { continue };
        let live = w.last_seen_ms <= 3 * r.heartbeat_ms as u64 && w.quarantined.is_empty();
        let load = w.load.unwrap_or_default();
        let (cover, workers) = models.entry(reg.model_id.clone()).or_insert_with(|| (vec![0; reg.n_layers as usize], Vec::new()));
        if live {
            for l in reg.layer_start..reg.layer_end.min(cover.len() as u32) {
                cover[l as usize] += 1;
            }
        }
        workers.push(json!({
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
            "kv_reserved_tokens": load.kv_reserved_tokens,
            "kv_tokens": reg.kv_tokens,
            "device_memory_total": load.device_memory_total,
            "device_memory_free": load.device_memory_free,
            "step_us_per_layer": reg.step_us_per_layer,
            "recent_step_us": load.recent_step_us,
            "threads": reg.threads,
            "routes_total": w.routes_total,
            "prefix_blocks": w.prefix_blocks,
            "quarantined": !w.quarantined.is_empty(),
            "quarantine_evidence": w.quarantined,
        }));
    }
    let models: Vec<Value> = models
        .into_iter()
        .map(|(model, (cover, workers))| {
            json!({
                "model_id": model,
                "n_layers": cover.len(),
                "covered": !cover.is_empty() && cover.iter().all(|c| *c > 0),
                "replicas_per_layer": cover,
                "workers": workers,
            })
        })
        .collect();
    json!({ "heartbeat_ms": r.heartbeat_ms, "models": models })
}

pub async fn state(gw: &Gateway) -> Value {
    let swarm = gw.swarm().await;
    let mut v = swarm.as_ref().map(swarm_json).unwrap_or_else(|| json!({ "models": [], "tracker": "unreachable" }));
    // Name each model the way clients do.
    if let Some(models) = v["models"].as_array_mut() {
        for m in models {
            let name = gw.models.iter().find(|s| m["model_id"] == s.model_id.as_str()).map(|s| s.name.clone());
            m["name"] = json!(name.unwrap_or_default());
        }
    }
    let usage = match gw.tracker_call(TrackerBody::UsageQuery(UsageQuery { by: "key".into() })).await {
        Ok(TrackerBody::UsageReply(u)) => u
            .rows
            .iter()
            .map(|r| {
                json!({ "key": r.who, "model_id": r.model_id, "requests": r.requests,
                             "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens })
            })
            .collect(),
        _ => Vec::new(),
    };
    v["usage_by_key"] = json!(usage);
    // Tokens as they are generated (not as requests finish), over the last 10 seconds.
    v["tokens_per_s"] = json!(gw.history.tokens_per_s(5));
    v["gateway"] = json!({
        "running": gw.admission.running(gw.cfg.max_running),
        "queued": gw.admission.waiting(),
        "uptime_s": gw.started.elapsed().as_secs(),
    });
    v
}

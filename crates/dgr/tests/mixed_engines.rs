//! A swarm with both engines: workers of a Transformers checkpoint and workers of a GGUF file
//! (llama.cpp's conversion of the same checkpoint, so the two models have the same shape) join
//! one tracker. Each request is routed within its own model and engine, its output equals that
//! model's one-process output (and, the weights being the same F32 values, the other engine's),
//! and the ledger records each worker's usage under its engine.

mod common;

use common::dgr;
use common::swarm::{Tracker, Worker};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/hf").join(name)
}

fn generate(model: &Path, extra: &[&str]) -> Value {
    let out = dgr()
        .args(["generate", "--format", "json", "--threads", "1", "-n", "12", "--ignore-eos", "-p", "the quick brown fox"])
        .arg("--model")
        .arg(model)
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "generate on {}: {}", model.display(), String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn requests_stay_within_their_engine_and_the_ledger_says_which() {
    let (hf, gguf) = (data("qwen3-f32"), data("qwen3-f32.gguf"));
    let config: Value = serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
    let layers = config["num_hidden_layers"].as_u64().unwrap() as usize;
    let cut = layers / 2;
    let t = Tracker::start("mixed-engines", &[]);
    let workers: Vec<Worker> = [(&hf, "hf"), (&gguf, "gguf")]
        .into_iter()
        .flat_map(|(m, tag)| [(0, cut), (cut, layers)].map(|r| (m, tag, r)))
        .map(|(m, tag, r)| Worker::start_on(&t, r, &format!("{tag}-{}", r.0), &[], &[], Some(m)))
        .collect();
    let ids: Vec<&str> = workers.iter().map(|w| w.id.as_str()).collect();
    t.wait_live(&ids, std::time::Duration::from_secs(20), "all four workers");

    let swarm = t.query(&["swarm"]);
    let engines: Vec<(String, String)> = swarm["models"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|m| {
            m["workers"].as_array().unwrap().iter().map(|w| (w["worker_id"].as_str().unwrap().to_string(), w["engine"].to_string()))
        })
        .collect();
    assert_eq!(swarm["models"].as_array().unwrap().len(), 2, "two models: {swarm}");

    let mut outputs = Vec::new();
    for (model, engine, mine) in [(&hf, "transformers-cpu-fast", &workers[..2]), (&gguf, "gguf-cpu-fast", &workers[2..])] {
        let local = generate(model, &[]);
        let routed = generate(model, &["--tracker", &t.addr]);
        assert_eq!(routed["tokens"], local["tokens"], "{}: routed through the swarm vs one process", model.display());
        for w in mine {
            let e = engines.iter().find(|(id, _)| *id == w.id).map(|(_, e)| e.clone());
            assert_eq!(e.as_deref(), Some(format!("\"{engine}\"").as_str()), "worker {} of {}", w.id, model.display());
            let shown = common::metrics(w.addr.as_deref().unwrap()).get(&format!("dgr_worker_info{{engine=\"{engine}\"}}"));
            assert_eq!(shown, 1.0, "worker {}'s /metrics names its engine", w.id);
        }
        outputs.push(local["tokens"].clone());
    }
    assert_eq!(outputs[0], outputs[1], "the same F32 weights under either engine");
    println!("both engines generated {} through the swarm, as one process does", outputs[0]);

    // Every worker served exactly the one request of its own model, under its own engine.
    let usage = t.usage("worker");
    for (i, w) in workers.iter().enumerate() {
        let rows: Vec<&Value> = usage["rows"].as_array().unwrap().iter().filter(|r| r["worker"] == w.id.as_str()).collect();
        let engine = if i < 2 { "transformers-cpu-fast" } else { "gguf-cpu-fast" };
        assert_eq!(rows.len(), 1, "worker {i}: {usage}");
        assert_eq!((rows[0]["engine"].as_str(), rows[0]["requests"].as_u64()), (Some(engine), Some(1)), "worker {i}: {usage}");
        println!("worker {i}: {} layer-tokens under {engine}", rows[0]["layer_tokens"]);
    }
}

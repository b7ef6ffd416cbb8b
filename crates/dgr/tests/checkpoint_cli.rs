//! The command line on Transformers checkpoint directories (tests/data/hf, written by
//! scripts/hf-ref.sh): `generate` follows transformers' own greedy continuation, as a completion
//! and through the chat template; `tokenize` gives transformers' ids; `inspect` names the engine
//! and the identity a worker registers under.

mod common;

use common::dgr;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/hf").join(name)
}

fn reference(name: &str) -> Value {
    serde_json::from_slice(&std::fs::read(data(&format!("{name}.ref.json"))).unwrap()).unwrap()
}

fn run(args: &[&str]) -> String {
    let out = dgr().args(args).output().unwrap();
    assert!(out.status.success(), "dgr {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn generate_follows_transformers_as_a_completion_and_through_the_chat_template() {
    for name in ["llama-f32", "qwen3-f32", "gemma3-f32"] {
        let r = reference(name);
        let dir = data(name);
        let dir = dir.to_str().unwrap();
        for p in r["prompts"].as_array().unwrap() {
            let mut args = vec!["generate", "--model", dir, "--format", "json", "-n", "16", "--ignore-eos", "-t", "1"];
            let content;
            match p["chat"].as_array() {
                Some(messages) => {
                    content = messages[0]["content"].as_str().unwrap().to_string();
                    args.extend(["--chat", "-p", &content]);
                }
                None => args.extend(["-p", p["text"].as_str().unwrap()]),
            }
            let out: Value = serde_json::from_str(&run(&args)).unwrap();
            assert_eq!(out["prompt_tokens"], p["ids"], "{name}: prompt {:?}", p["text"]);
            // Greedy equals transformers' float64 run wherever its margin is clear (every step of
            // these prompts but for a rare near-tie, after which the runs may part).
            let forced = p["runs"]["f64_strict"]["forced"].as_array().unwrap();
            let clear = forced.iter().take_while(|s| s["margin"].as_f64().unwrap() >= 1e-3).count();
            let got: Vec<&Value> = out["tokens"].as_array().unwrap().iter().take(clear).collect();
            let want: Vec<&Value> = p["reference"].as_array().unwrap().iter().take(clear).collect();
            assert!(clear >= 8, "{name}: only {clear} clear steps");
            assert_eq!(got, want, "{name}: {:?}", p["text"]);
        }
    }
}

#[test]
fn tokenize_and_inspect_read_a_checkpoint() {
    let r = reference("qwen3-f32");
    let dir = data("qwen3-f32");
    let dir = dir.to_str().unwrap();
    // qwen adds no BOS: transformers' ids are the text's own.
    let p = &r["prompts"][0];
    let out: Value = serde_json::from_str(&run(&["tokenize", "--model", dir, "--text", p["text"].as_str().unwrap()])).unwrap();
    assert_eq!(out["tokens"], p["ids"]);
    let shown = run(&["inspect", dir]);
    let id = dgr_hf::identity(Path::new(dir)).unwrap().id;
    assert!(shown.contains("transformers-cpu-exact") && shown.contains(&id), "{shown}");
}

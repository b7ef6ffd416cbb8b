//! Shared by the acceptance tests: the real model, the reference files and running `dgr`.
#![allow(dead_code)]

use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

/// The default model. Missing is a failure, never a skip: fetch it with scripts/fetch-model.sh.
pub fn model() -> PathBuf {
    let p = dgr_gguf::default_model_path();
    assert!(p.exists(), "the default model is not at {}: run scripts/fetch-model.sh first", p.display());
    p
}

pub fn reference(name: &str) -> Value {
    let path = format!("{}/../../tests/data/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))).unwrap()
}

pub fn dgr() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dgr"));
    c.env_remove("DGR_MODEL");
    c
}

/// Runs dgr with `args` on the default model and parses its JSON output.
pub fn dgr_json(args: &[&str]) -> Value {
    let out = dgr().args(args).arg("--model").arg(model()).output().expect("running dgr");
    assert!(out.status.success(), "dgr {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("dgr {args:?} printed no JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

pub fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

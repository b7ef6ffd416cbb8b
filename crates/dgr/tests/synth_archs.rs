//! Every architecture and tensor type dgr claims, held against llama.cpp: for each reference in
//! tests/data/synth (written by scripts/ref-synth.sh), `dgr synth` writes the same synthetic
//! model again (byte for byte), dgr scores llama.cpp's greedy tokens on it teacher-forced, and
//! its log-probabilities must be at least as close to the exact float64 computation as
//! llama.cpp's are. An architecture the engine cannot run fails here; it is never skipped.

use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/synth")
}

/// A directory of its own, removed when dropped.
struct TempDir(PathBuf);
impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("dgr-synth-archs-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dgr(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dgr")).env_remove("DGR_MODEL").args(args).output().expect("running dgr")
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// A step's top entries as (id, logprob).
fn top(step: &Value) -> Vec<(u64, f64)> {
    step["top"].as_array().unwrap().iter().map(|e| (e[0].as_u64().unwrap(), f(&e[1]))).collect()
}

fn check(name: &str) {
    let path = data_dir().join(format!("{name}.json"));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap();
    let dir = TempDir::new(name);
    let model = dir.0.join("model.gguf");
    let model_arg = model.to_str().unwrap();

    let mut synth: Vec<&str> = r["synth"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    synth.extend(["--out", model_arg]);
    let out = dgr(&synth);
    assert!(out.status.success(), "{name}: dgr {synth:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    let sha = dgr_gguf::file_sha256(&model).unwrap();
    assert_eq!(sha, r["sha256"].as_str().unwrap(), "{name}: dgr synth no longer writes the model llama.cpp ran");

    let greedy: Vec<String> = r["greedy_tokens"].as_array().unwrap().iter().map(|t| t.to_string()).collect();
    let out = dgr(&[
        "score",
        "--model",
        model_arg,
        "--prompt",
        r["prompt"].as_str().unwrap(),
        "--continuation",
        &greedy.join(","),
        "--top-logprobs",
        "5",
        "--threads",
        "2",
    ]);
    assert!(out.status.success(), "{name}: dgr cannot run this model: {}", String::from_utf8_lossy(&out.stderr));
    let ours: Value = serde_json::from_slice(&out.stdout).expect("dgr score printed JSON");
    assert_eq!(ours["prompt_tokens"], r["prompt_tokens"], "{name}: dgr tokenizes the prompt differently from llama.cpp");

    let (ours, llama, exact) =
        (ours["steps"].as_array().unwrap(), r["llama_cpp_steps"].as_array().unwrap(), r["exact_steps"].as_array().unwrap());
    assert_eq!(ours.len(), exact.len(), "{name}: steps scored");
    let (mut dgr_sum, mut dgr_max, mut llama_sum, mut llama_max) = (0.0, 0f64, 0.0, 0f64);
    for ((o, l), e) in ours.iter().zip(llama).zip(exact) {
        assert_eq!(o["token"], e["id"], "{name}: dgr scored a different token");
        let d = (f(&o["logprob"]) - f(&e["logprob"])).abs();
        (dgr_sum, dgr_max) = (dgr_sum + d, dgr_max.max(d));
        let d = (f(&l["logprob"]) - f(&e["logprob"])).abs();
        llama_sum += d;
        // llama.cpp's error: on the token it chose and on every top entry both report.
        let etop = top(e);
        llama_max = top(l)
            .iter()
            .filter_map(|(id, lp)| etop.iter().find(|x| x.0 == *id).map(|x| (lp - x.1).abs()))
            .fold(llama_max.max(d), f64::max);
    }
    let n = exact.len() as f64;
    let (dgr_mean, llama_mean) = (dgr_sum / n, llama_sum / n);
    println!("{name}: mean |Δ logprob| vs exact: dgr {dgr_mean:.1e} (max {dgr_max:.1e}), llama.cpp {llama_mean:.4} (max {llama_max:.4})");
    assert!(dgr_mean <= llama_mean, "{name}: dgr is further from the exact computation ({dgr_mean}) than llama.cpp ({llama_mean})");

    // Where the exact top two are further apart than llama.cpp can be wrong, dgr must pick what
    // llama.cpp ranks first (before any sampler: its run was barred from some tokens).
    for (i, ((o, l), e)) in ours.iter().zip(llama).zip(exact).enumerate() {
        let etop = top(e);
        let margin = etop[0].1 - etop[1].1;
        if margin > llama_max {
            assert_eq!(top(o)[0].0, top(l)[0].0, "{name}: step {i}: dgr's top token differs from llama.cpp's (exact margin {margin:.4})");
        }
    }
}

/// One test per reference, so each architecture and type passes or fails by name.
macro_rules! references {
    ($($test:ident => $name:literal,)*) => {
        $(#[test] fn $test() { check($name) })*
        const REFERENCES: &[&str] = &[$($name),*];
    };
}

references! {
    llama_q8_0 => "llama-q8_0",
    mistral_q8_0 => "mistral-q8_0",
    qwen2_q8_0 => "qwen2-q8_0",
    qwen3_q8_0 => "qwen3-q8_0",
    gemma3_q8_0 => "gemma3-q8_0",
    llama_f32 => "llama-f32",
    llama_f16 => "llama-f16",
    llama_bf16 => "llama-bf16",
    llama_q4_0 => "llama-q4_0",
    llama_q4_1 => "llama-q4_1",
    llama_q5_0 => "llama-q5_0",
    llama_q5_1 => "llama-q5_1",
    llama_q2_k => "llama-q2_k",
    llama_q3_k => "llama-q3_k",
    llama_q4_k => "llama-q4_k",
    llama_q5_k => "llama-q5_k",
    llama_q6_k => "llama-q6_k",
    llama_q4_k_m => "llama-q4_k_m",
    qwen2_q4_k_m => "qwen2-q4_k_m",
}

#[test]
fn every_reference_has_a_test() {
    let mut files: Vec<String> = std::fs::read_dir(data_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let mut listed: Vec<String> = REFERENCES.iter().map(|s| s.to_string()).collect();
    listed.sort();
    assert_eq!(files, listed, "tests/data/synth and this file's list of references differ");
}

//! dgr's Transformers-layout engine against transformers itself, on the small random
//! checkpoints of every model type that `scripts/hf-ref.sh` wrote and recorded (committed under
//! tests/data/hf, so no torch is needed here):
//! - tokenization equals transformers' tokenizer on every prompt;
//! - teacher-forced log-probabilities against transformers' float64 run (`f64_strict`: every
//!   operation in float64, RoPE, norms and softmax included): F32 checkpoints mean
//!   |Δ| ≤ 1e-4 and every step ≤ 1e-3; BF16/F16 checkpoints at least as close as transformers'
//!   own float32 run of the same weights;
//! - greedy tokens equal the float64 run's wherever its top-1/top-2 margin is ≥ 1e-3;
//! - the same checkpoints converted by llama.cpp's convert_hf_to_gguf.py, run by dgr's GGUF
//!   engine, give the same tokens, and in F32 the same logits bit for bit.

use dgr_engine::{open_engine, EngineSpec, Input, LogitRows, SeqInput};
use dgr_gguf::Gguf;
use dgr_tokenizer::Tokenizer;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/hf")
}

fn references() -> Vec<(String, Value)> {
    let mut out: Vec<(String, Value)> = std::fs::read_dir(data())
        .expect("tests/data/hf (written by scripts/hf-ref.sh)")
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            let stem = name.strip_suffix(".ref.json")?.to_string();
            let v = serde_json::from_slice(&std::fs::read(data().join(&name)).ok()?).ok()?;
            Some((stem, v))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(out.len() >= 11, "expected every model type in F32 and BF16 and one F16, found {}", out.len());
    out
}

/// Logits (one row per position) of `tokens` through the whole model, one forward.
fn all_logits(g: &Arc<Gguf>, tokens: &[u32]) -> Vec<Vec<f32>> {
    let n = dgr_engine::ModelConfig::from_gguf(g).unwrap().n_layers;
    let stage = open_engine(g.clone(), 0..n, EngineSpec::threads(2)).unwrap();
    let mut kv = stage.new_kv(tokens.len());
    let out = stage.forward(&mut [SeqInput { kv: &mut kv, input: Input::Tokens(tokens), logits: LogitRows::All }]).unwrap();
    let vocab = stage.config().vocab;
    out[0].logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Per prompt: the sequence teacher-forced (prompt ids + the float64 run's continuation) and the
/// index of the row predicting the continuation's first token.
fn sequences(r: &Value) -> Vec<(Vec<u32>, usize)> {
    r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let prompt = ids(&p["ids"]);
            let cont = ids(&p["reference"]);
            let first = prompt.len() - 1;
            ([prompt, cont[..cont.len() - 1].to_vec()].concat(), first)
        })
        .collect()
}

#[test]
fn tokenization_equals_transformers() {
    for (name, r) in references() {
        let tok = Tokenizer::from_hf_dir(&data().join(r["checkpoint"].as_str().unwrap())).unwrap();
        for p in r["prompts"].as_array().unwrap() {
            let got = tok.encode(p["text"].as_str().unwrap(), p["add_special_tokens"].as_bool().unwrap(), true).unwrap();
            assert_eq!(got, ids(&p["ids"]), "{name}: {:?}", p["text"]);
        }
    }
}

#[test]
fn log_probabilities_match_transformers_float64() {
    for (name, r) in references() {
        let dir = data().join(r["checkpoint"].as_str().unwrap());
        let g = Arc::new(dgr_hf::Checkpoint::open(&dir, &|_| true).unwrap().model);
        let (mut sum, mut max, mut n, mut greedy_checked) = (0f64, 0f64, 0usize, 0usize);
        let (mut f32_sum, mut f32_n) = (0f64, 0usize);
        for ((seq, first), p) in sequences(&r).into_iter().zip(r["prompts"].as_array().unwrap()) {
            let logits = all_logits(&g, &seq);
            let reference = &p["runs"]["f64_strict"]["forced"];
            let f32_run = &p["runs"]["f32"]["forced"];
            for (i, step) in reference.as_array().unwrap().iter().enumerate() {
                let token = step["token"].as_u64().unwrap() as u32;
                let (lp, _) = dgr_engine::logprobs(&logits[first + i], token, 0);
                let d = (lp as f64 - step["logprob"].as_f64().unwrap()).abs();
                (sum, max, n) = (sum + d, max.max(d), n + 1);
                f32_sum += (f32_run[i]["logprob"].as_f64().unwrap() - step["logprob"].as_f64().unwrap()).abs();
                f32_n += 1;
                if step["margin"].as_f64().unwrap() >= 1e-3 {
                    let top = step["top"][0][0].as_u64().unwrap() as u32;
                    assert_eq!(dgr_engine::argmax(&logits[first + i]), top, "{name}: step {i} of {:?}", p["text"]);
                    greedy_checked += 1;
                }
            }
        }
        let (mean, f32_mean) = (sum / n as f64, f32_sum / f32_n as f64);
        println!("{name}: mean |Δ logprob| {mean:.2e}, max {max:.2e} (transformers f32: mean {f32_mean:.2e}); greedy checked at {greedy_checked}/{n} steps");
        assert!(greedy_checked * 2 >= n, "{name}: too few steps with a clear margin to check greedy tokens");
        if r["dtype"] == "float32" {
            assert!(mean <= 1e-4 && max <= 1e-3, "{name}: mean {mean:e}, max {max:e}");
        } else {
            assert!(mean <= f32_mean, "{name}: mean {mean:e} is further from float64 than transformers' float32 run ({f32_mean:e})");
        }
    }
}

#[test]
fn llama_cpp_conversions_compute_the_same_in_the_gguf_engine() {
    let mut checked = 0;
    for (name, r) in references() {
        let Some(file) = r["gguf"]["file"].as_str() else { continue };
        let hf = Arc::new(dgr_hf::Checkpoint::open(&data().join(r["checkpoint"].as_str().unwrap()), &|_| true).unwrap().model);
        let gguf = Arc::new(Gguf::open(&data().join(file)).unwrap());
        for (seq, first) in sequences(&r) {
            let (a, b) = (all_logits(&hf, &seq), all_logits(&gguf, &seq));
            let tokens = |l: &[Vec<f32>]| l[first..].iter().map(|row| dgr_engine::argmax(row)).collect::<Vec<u32>>();
            assert_eq!(tokens(&a), tokens(&b), "{name}: greedy tokens of the checkpoint and of {file}");
            if r["dtype"] == "float32" {
                assert!(a == b, "{name}: F32 logits of the checkpoint and of {file} differ");
            }
        }
        checked += 1;
    }
    assert!(checked >= 10, "every model type's F32 and BF16 conversions: {checked}");
}

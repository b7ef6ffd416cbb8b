//! `--numerics fast` (integer activations) against the exact float64 computation on the shared
//! references, SmolLM2-135M-Instruct Q4_1 and gemma-3-270m Q4_K_M: over each model's prompts,
//! teacher-forced, the mean |Δ logprob| of the scored tokens is at most 1e-3 and at most 1/20 of
//! llama.cpp's on the same steps, and the top-1 token equals the exact mode's wherever the
//! exact mode's top two differ by at least 1e-2.
#![cfg(feature = "real-model")]

mod common;
use common::*;
use serde_json::Value;
use std::path::Path;

fn top(step: &Value, i: usize) -> (u64, f64) {
    (step["top"][i][0].as_u64().unwrap(), step["top"][i][1].as_f64().unwrap())
}

fn check(name: &str, model: &Path, exact_file: &str, llama_file: &str) {
    let (exact, llama) = (reference(exact_file), reference(llama_file));
    let truth = reference_steps(&exact);
    let llama_mean = mean_distance(&reference_steps(&llama), &truth);
    let fast = score_all(model, &exact, &["--numerics", "fast"]);
    let exact_mode = score_all(model, &exact, &["--numerics", "exact"]);
    for (i, (f, t)) in fast.iter().zip(&truth).enumerate() {
        assert_eq!(f["token"], t["id"], "{name}: step {i} scores a different token");
    }
    let (fast_mean, exact_mean) = (mean_distance(&fast, &truth), mean_distance(&exact_mode, &truth));
    let misses: Vec<usize> = (0..fast.len())
        .filter(|&i| {
            let (e1, e2) = (top(&exact_mode[i], 0), top(&exact_mode[i], 1));
            e1.1 - e2.1 >= 1e-2 && top(&fast[i], 0).0 != e1.0
        })
        .collect();
    println!(
        "{name}: {} steps; mean |Δ logprob| vs float64: fast {fast_mean:.6}, exact {exact_mean:.7}, llama.cpp {llama_mean:.4} (fast is 1/{:.0} of it); top-1 differs from exact at clear steps {misses:?}",
        fast.len(),
        llama_mean / fast_mean
    );
    assert!(fast_mean <= 1e-3, "{name}: fast mean |Δ logprob| {fast_mean} > 1e-3");
    assert!(fast_mean <= llama_mean / 20.0, "{name}: fast mean {fast_mean} > 1/20 of llama.cpp's {llama_mean}");
    assert!(misses.is_empty(), "{name}: fast's top-1 differs from exact's at steps {misses:?} with margins ≥ 1e-2");
}

#[test]
fn fast_numerics_stay_within_a_twentieth_of_llama_cpp_from_the_exact_computation_on_smollm2() {
    check("SmolLM2 Q4_1", &model(), "smollm2-q4_1-exact.json", "smollm2-q4_1-llamacpp.json");
}

#[test]
fn fast_numerics_stay_within_a_twentieth_of_llama_cpp_from_the_exact_computation_on_gemma3() {
    check("gemma-3-270m Q4_K_M", &gemma3_model(), "gemma3-270m-q4_k_m-exact.json", "gemma3-270m-q4_k_m-llamacpp.json");
}

//! The KV dtypes, in exact numerics (the KV cache's own error, apart from fast numerics'), against the exact float64 computation on the shared references, SmolLM2-135M-
//! Instruct Q4_1 and gemma-3-270m Q4_K_M: over each model's prompts, teacher-forced, the mean
//! |Δ logprob| of the scored tokens in each `--kv-dtype` is printed; q8_0's is at most 1e-2 (the
//! issue's bar; measured 7.8e-3 and 6.1e-3, 1.3e-2 and 1.1e-2 before its Hadamard rotation), f16's at most 1e-3 (measured 3.0e-4 on SmolLM2, 2.5e-4 on gemma3: f16's
//! rounding of every key and value, 2^-11 relative, with room for other prompts), f32's at most
//! 1e-5 (measured ~1e-6), and each is below llama.cpp's own on the same steps (0.035, 0.028:
//! llama.cpp keeps KV in f16 and rounds activations besides).
#![cfg(feature = "real-model")]

mod common;
use common::*;
use dgr_engine::KvDtype;
use std::path::Path;

fn check(name: &str, model: &Path, exact_file: &str, llama_file: &str) {
    let (exact, llama) = (reference(exact_file), reference(llama_file));
    let truth = reference_steps(&exact);
    let llama_mean = mean_distance(&reference_steps(&llama), &truth);
    let mut table = Vec::new();
    for kv in KvDtype::ALL {
        let steps = score_all(model, &exact, &["--numerics", "exact", "--kv-dtype", kv.name()]);
        for (i, (s, t)) in steps.iter().zip(&truth).enumerate() {
            assert_eq!(s["token"], t["id"], "{name} {kv}: step {i} scores a different token");
        }
        table.push((*kv, mean_distance(&steps, &truth)));
    }
    let row: Vec<String> = table.iter().map(|(kv, m)| format!("{kv} {m:.7}")).collect();
    println!("{name}: {} steps; mean |Δ logprob| vs float64 by KV dtype: {}; llama.cpp {llama_mean:.4}", truth.len(), row.join(", "));
    for (kv, mean) in table {
        let bar = match kv {
            KvDtype::F32 => 1e-5,
            KvDtype::F16 => 1e-3,
            KvDtype::Q8_0 => 1e-2,
        };
        assert!(mean <= bar, "{name}: {kv} KV mean |Δ logprob| {mean} > {bar}");
        assert!(mean < llama_mean, "{name}: {kv} KV mean {mean} is not below llama.cpp's {llama_mean}");
    }
}

#[test]
fn every_kv_dtype_stays_near_the_exact_computation_on_smollm2() {
    check("SmolLM2 Q4_1", &model(), "smollm2-q4_1-exact.json", "smollm2-q4_1-llamacpp.json");
}

#[test]
fn every_kv_dtype_stays_near_the_exact_computation_on_gemma3() {
    check("gemma-3-270m Q4_K_M", &gemma3_model(), "gemma3-270m-q4_k_m-exact.json", "gemma3-270m-q4_k_m-llamacpp.json");
}

//! A Transformers checkpoint holding the same weights as a GGUF file (written here from dgr's
//! synthetic models, undoing what llama.cpp's converter does: Q/K rows back to halves, Gemma's
//! norms back to w - 1) computes bitwise the same logits in dgr's engine, for every family and
//! storage type, in one process and split; its config reads to the same hyperparameters.

mod common;

use common::{write_checkpoint, TempDir};
use dgr_engine::synth::SynthSpec;
use dgr_engine::{open_engine, Arch, EngineSpec, Input, LogitRows, ModelConfig, SeqInput};
use dgr_gguf::{GgmlType, Gguf};
use dgr_hf::Checkpoint;
use std::sync::Arc;

const LAYERS: usize = 6;

/// Logits of `prompt` and then 4 greedy steps through stages over `cuts`.
fn run(g: &Arc<Gguf>, cuts: &[usize], prompt: &[u32]) -> Vec<Vec<f32>> {
    let bounds: Vec<usize> = [0].into_iter().chain(cuts.iter().copied()).chain([LAYERS]).collect();
    let opts = EngineSpec::threads(2);
    let stages: Vec<_> = bounds.windows(2).map(|b| open_engine(g.clone(), b[0]..b[1], opts).unwrap()).collect();
    let mut kvs: Vec<_> = stages.iter().map(|s| s.new_kv(64)).collect();
    let mut tokens = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..5 {
        let mut hidden = Vec::new();
        for (j, (s, kv)) in stages.iter().zip(kvs.iter_mut()).enumerate() {
            let input = if j == 0 { Input::Tokens(&tokens) } else { Input::Hidden(&hidden) };
            let mut batch = [SeqInput { input, kv, logits: LogitRows::Last }];
            let o = s.forward(&mut batch).unwrap().remove(0);
            if s.is_last() {
                out.push(o.logits.clone());
            } else {
                hidden = o.hidden;
            }
        }
        let last = out.last().unwrap();
        let next = (0..last.len()).max_by(|&a, &b| last[a].total_cmp(&last[b]).then(b.cmp(&a))).unwrap() as u32;
        tokens = vec![next];
    }
    out
}

fn same_model(arch: &'static str, ty: GgmlType, sharded: bool) {
    let spec =
        SynthSpec { ty, layers: LAYERS, hidden: 64, ffn: 128, arch: arch.parse().unwrap(), head_dim: Some(32), ..SynthSpec::default() };
    let spec = if matches!(arch, "qwen3" | "gemma3") { spec } else { SynthSpec { head_dim: None, ..spec } };
    let gguf = Arc::new(Gguf::from_bytes(spec.to_gguf().unwrap()).unwrap());
    let dir = TempDir::new(arch);
    write_checkpoint(&gguf, arch, &dir.0, sharded);
    let hf = Arc::new(Checkpoint::open(&dir.0, &|_| true).unwrap().model);
    assert_eq!(ModelConfig::from_gguf(&hf).unwrap(), ModelConfig::from_gguf(&gguf).unwrap(), "{arch} {ty:?}");
    let prompt: Vec<u32> = (0..19u32).map(|i| (i * 37 + 11) % 300).collect();
    let reference = run(&gguf, &[], &prompt);
    for cuts in [&[][..], &[2], &[1, 4]] {
        assert!(run(&hf, cuts, &prompt) == reference, "{arch} {ty:?} split at {cuts:?}: logits differ from the GGUF's");
    }
}

#[test]
fn every_family_computes_as_its_gguf_in_f32() {
    for arch in ["llama", "mistral", "qwen2", "qwen3", "gemma3"] {
        same_model(arch, GgmlType::F32, false);
    }
}

#[test]
fn half_precision_checkpoints_and_shards_compute_as_their_gguf() {
    same_model("llama", GgmlType::BF16, true);
    same_model("qwen3", GgmlType::F16, false);
    same_model("gemma3", GgmlType::BF16, true);
}

/// Last-row logits of each prompt, its prefill batched with the others `b` at a time, then 3
/// greedy steps batched the same way.
fn batched(g: &Arc<Gguf>, prompts: &[Vec<u32>], b: usize) -> Vec<Vec<Vec<f32>>> {
    let stage = open_engine(g.clone(), 0..LAYERS, EngineSpec::threads(2)).unwrap();
    let mut out = vec![Vec::new(); prompts.len()];
    for (c, chunk) in prompts.chunks(b).enumerate() {
        let mut kvs: Vec<_> = chunk.iter().map(|_| stage.new_kv(64)).collect();
        let mut inputs: Vec<Vec<u32>> = chunk.to_vec();
        for _ in 0..4 {
            let mut batch: Vec<SeqInput> =
                kvs.iter_mut().zip(&inputs).map(|(kv, t)| SeqInput { kv, input: Input::Tokens(t), logits: LogitRows::Last }).collect();
            let res = stage.forward(&mut batch).unwrap();
            for (i, r) in res.into_iter().enumerate() {
                inputs[i] = vec![dgr_engine::argmax(&r.logits)];
                out[c * b + i].push(r.logits);
            }
        }
    }
    out
}

#[test]
fn a_checkpoints_sessions_batch_as_a_gguf_models_do() {
    let spec = SynthSpec { ty: GgmlType::BF16, layers: LAYERS, hidden: 64, ffn: 128, arch: Arch::Qwen2, ..SynthSpec::default() };
    let gguf = Gguf::from_bytes(spec.to_gguf().unwrap()).unwrap();
    let dir = TempDir::new("batch");
    write_checkpoint(&gguf, "qwen2", &dir.0, false);
    let hf = Arc::new(Checkpoint::open(&dir.0, &|_| true).unwrap().model);
    let prompts: Vec<Vec<u32>> = (0..8u32).map(|s| (0..3 + s * 4).map(|i| (i * 31 + s * 7 + 3) % 300).collect()).collect();
    let solo = batched(&hf, &prompts, 1);
    for b in [2, 4, 8] {
        assert!(batched(&hf, &prompts, b) == solo, "batches of {b} differ from each session alone");
    }
}

//! One body, many shapes: a sequence's logits are bitwise the same however the model is split
//! into stages, whatever it is batched with, however many threads run it and whichever
//! instruction set the kernels use.

use dgr_engine::synth::SynthSpec;
use dgr_engine::{Input, Isa, LogitRows, SeqInput, Stage, StageOptions};
use dgr_gguf::{GgmlType, Gguf};
use std::sync::Arc;

fn model(ty: GgmlType, arch: &'static str) -> Arc<Gguf> {
    // K-quant rows are whole blocks of 256.
    let (hidden, ffn) = if ty.block_size() == 256 { (256, 512) } else { (64, 128) };
    let spec = SynthSpec { ty, layers: 6, hidden, ffn, arch, ..SynthSpec::default() };
    Arc::new(Gguf::from_bytes(spec.to_gguf().unwrap()).unwrap())
}

fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    (0..8u32).map(|s| (0..(3 + s * 5) % 23 + 1).map(|i| (i * 37 + s * 101 + 7) % vocab).collect()).collect()
}

/// Runs `prompts` concurrently (one batch) through a chain of stages, prefill then `steps`
/// greedy decode steps, and returns each sequence's logits at every step.
fn run(g: &Arc<Gguf>, cuts: &[usize], threads: usize, isa: Isa, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<Vec<f32>>> {
    let n_layers = dgr_engine::ModelConfig::from_gguf(g).unwrap().n_layers;
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(n_layers);
    let opts = StageOptions { threads, isa: Some(isa) };
    let stages: Vec<Stage> = bounds.windows(2).map(|w| Stage::open(g.clone(), w[0]..w[1], opts).unwrap()).collect();
    let mut kvs: Vec<Vec<_>> = stages.iter().map(|s| prompts.iter().map(|_| s.new_kv(256)).collect()).collect();
    let mut inputs: Vec<Vec<u32>> = prompts.to_vec();
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); prompts.len()];
    for _ in 0..=steps {
        let mut hidden: Vec<Vec<f32>> = Vec::new();
        for (si, stage) in stages.iter().enumerate() {
            let mut batch: Vec<SeqInput> = kvs[si]
                .iter_mut()
                .enumerate()
                .map(|(i, kv)| SeqInput {
                    kv,
                    input: if si == 0 { Input::Tokens(&inputs[i]) } else { Input::Hidden(&hidden[i]) },
                    logits: LogitRows::Last,
                })
                .collect();
            let out = stage.forward(&mut batch).unwrap();
            hidden = out.iter().map(|o| o.hidden.clone()).collect();
            if stage.is_last() {
                for (i, o) in out.into_iter().enumerate() {
                    inputs[i] = vec![dgr_engine::argmax(&o.logits)];
                    logits[i].push(o.logits);
                }
            }
        }
    }
    logits
}

fn bits(v: &[Vec<Vec<f32>>]) -> Vec<Vec<Vec<u32>>> {
    v.iter().map(|s| s.iter().map(|l| l.iter().map(|x| x.to_bits()).collect()).collect()).collect()
}

#[test]
fn logits_do_not_depend_on_split_batch_threads_or_isa() {
    let shapes = [
        (GgmlType::Q4_1, "llama"),
        (GgmlType::Q8_0, "qwen2"),
        (GgmlType::Q4_0, "llama"),
        (GgmlType::F16, "llama"),
        (GgmlType::BF16, "qwen2"),
        (GgmlType::Q4_K, "llama"),
        (GgmlType::Q6_K, "qwen2"),
    ];
    for (ty, arch) in shapes {
        let g = model(ty, arch);
        let ps = prompts(300);
        // Reference: each sequence alone, unsplit, one thread, scalar kernels.
        let solo: Vec<_> = ps.iter().map(|p| run(&g, &[], 1, Isa::Scalar, std::slice::from_ref(p), 3).remove(0)).collect();
        assert!(solo.iter().all(|s| s.iter().all(|l| l.iter().all(|x| x.is_finite()))));
        for cuts in [&[][..], &[3][..], &[2, 4][..]] {
            for batch in [1usize, 2, 4, 8] {
                for isa in Isa::available() {
                    let threads = 1 + batch % 3;
                    let got = run(&g, cuts, threads, isa, &ps[..batch], 3);
                    assert_eq!(bits(&got), bits(&solo[..batch]), "{ty:?} {arch} cuts={cuts:?} batch={batch} {isa:?} threads={threads}");
                }
            }
        }
    }
}

#[test]
fn bad_inputs_are_typed_errors_and_leave_state_untouched() {
    let g = model(GgmlType::Q4_1, "llama");
    let first = Stage::open(g.clone(), 0..3, StageOptions { threads: 1, isa: None }).unwrap();
    let second = Stage::open(g.clone(), 3..6, StageOptions { threads: 1, isa: None }).unwrap();
    assert!(Stage::open(g.clone(), 4..4, StageOptions::default()).is_err());
    assert!(Stage::open(g.clone(), 0..7, StageOptions::default()).is_err());
    let mut kv = first.new_kv(4);
    let mut other = second.new_kv(4);
    let bad = |stage: &Stage, kv: &mut dgr_engine::KvCache, input: Input| {
        stage.forward(&mut [SeqInput { kv, input, logits: LogitRows::Last }]).unwrap_err()
    };
    bad(&first, &mut kv, Input::Tokens(&[9999]));
    bad(&first, &mut kv, Input::Tokens(&[]));
    bad(&first, &mut kv, Input::Tokens(&[1, 2, 3, 4, 5]));
    bad(&first, &mut kv, Input::Hidden(&[0.0; 64]));
    bad(&second, &mut other, Input::Hidden(&[0.0; 63]));
    bad(&second, &mut other, Input::Tokens(&[1]));
    bad(&second, &mut kv, Input::Hidden(&[0.0; 64]));
    assert_eq!((kv.len(), other.len()), (0, 0));
    first.forward(&mut [SeqInput { kv: &mut kv, input: Input::Tokens(&[1, 2]), logits: LogitRows::None }]).unwrap();
    assert_eq!(kv.len(), 2);
}

//! One body, many shapes: a sequence's logits are bitwise the same however the model is split
//! into stages, whatever it is batched with, however many threads run it and whichever
//! instruction set the kernels use — on every registered engine (`registered_specs`: each
//! backend × numerics × KV dtype), each against its own solo run.

use dgr_engine::synth::SynthSpec;
use dgr_engine::{open_engine, BackendKind, EngineError, EngineSpec, Input, Isa, KvCache, KvDtype, LogitRows, SeqInput, SeqState, Stage};
use dgr_gguf::{GgmlType, Gguf};
use std::ops::Range;
use std::sync::Arc;

const LAYERS: usize = 6;

fn model(ty: GgmlType, arch: &'static str) -> Arc<Gguf> {
    // K-quant rows are whole blocks of 256.
    let (hidden, ffn) = if ty.block_size() == 256 { (256, 512) } else { (64, 128) };
    let spec = SynthSpec { ty, layers: LAYERS, hidden, ffn, arch: arch.parse().unwrap(), ..SynthSpec::default() };
    Arc::new(Gguf::from_bytes(spec.to_gguf().unwrap()).unwrap())
}

fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    (0..8u32).map(|s| (0..(3 + s * 5) % 23 + 1).map(|i| (i * 37 + s * 101 + 7) % vocab).collect()).collect()
}

/// Stages opened over the `held` layer ranges, and routes through them: each route is the cuts
/// of the model into hops, hop j running on stage j over a part of the layers it holds.
/// Sequence i takes route `i % routes.len()`.
#[derive(Clone)]
struct Shape {
    held: Vec<Range<usize>>,
    routes: Vec<Vec<usize>>,
}

impl Shape {
    /// The model cut at `cuts`, each stage holding exactly the layers it runs.
    fn split(cuts: &[usize]) -> Shape {
        let held = hops(cuts).collect();
        Shape { held, routes: vec![cuts.to_vec()] }
    }
}

/// The layer ranges between `cuts`, from 0 to the last layer.
fn hops(cuts: &[usize]) -> impl Iterator<Item = Range<usize>> {
    let bounds: Vec<usize> = [0].into_iter().chain(cuts.iter().copied()).chain([LAYERS]).collect();
    (0..bounds.len() - 1).map(move |j| bounds[j]..bounds[j + 1])
}

/// Runs `prompts` concurrently through `shape`, prefill then `steps` greedy decode steps, and
/// returns each sequence's logits at every step. The sequences of one route run as one batch at
/// each hop; routes take turns on the stages they share.
fn run(g: &Arc<Gguf>, shape: &Shape, on: (EngineSpec, usize, Isa), prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<Vec<f32>>> {
    let (spec, threads, isa) = on;
    let opts = EngineSpec { threads, isa: Some(isa), ..spec };
    let stages: Vec<Stage> = shape.held.iter().map(|r| open_engine(g.clone(), r.clone(), opts).unwrap()).collect();
    let n_routes = shape.routes.len();
    // kvs[i][j]: sequence i's KV cache for hop j of its route.
    let mut kvs: Vec<Vec<KvCache>> = (0..prompts.len())
        .map(|i| hops(&shape.routes[i % n_routes]).enumerate().map(|(j, sub)| stages[j].new_kv_for(256, sub).unwrap()).collect())
        .collect();
    let mut inputs: Vec<Vec<u32>> = prompts.to_vec();
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); prompts.len()];
    for _ in 0..=steps {
        for (r, cuts) in shape.routes.iter().enumerate() {
            let ids: Vec<usize> = (0..prompts.len()).filter(|i| i % n_routes == r).collect();
            let mut hidden: Vec<Vec<f32>> = Vec::new();
            for (j, stage) in stages.iter().enumerate().take(cuts.len() + 1) {
                let mut batch: Vec<SeqInput> = ids
                    .iter()
                    .zip(kvs.iter_mut().enumerate().filter(|(i, _)| i % n_routes == r))
                    .enumerate()
                    .map(|(k, (&i, (_, kv)))| SeqInput {
                        kv: &mut kv[j],
                        input: if j == 0 { Input::Tokens(&inputs[i]) } else { Input::Hidden(&hidden[k]) },
                        logits: LogitRows::Last,
                    })
                    .collect();
                let out = stage.forward(&mut batch).unwrap();
                drop(batch);
                if j < cuts.len() {
                    hidden = out.into_iter().map(|o| o.hidden).collect();
                    continue;
                }
                for (&i, o) in ids.iter().zip(out) {
                    inputs[i] = vec![dgr_engine::argmax(&o.logits)];
                    logits[i].push(o.logits);
                }
            }
        }
    }
    logits
}

/// The instruction sets to run `spec` on: each this CPU has, on the CPU; one (unused) on a GPU.
fn isas(spec: EngineSpec) -> Vec<Isa> {
    match spec.backend {
        BackendKind::Cpu => Isa::available(),
        BackendKind::Gpu => vec![Isa::SCALAR],
    }
}

fn bits(v: &[Vec<Vec<f32>>]) -> Vec<Vec<Vec<u32>>> {
    v.iter().map(|s| s.iter().map(|l| l.iter().map(|x| x.to_bits()).collect()).collect()).collect()
}

/// Each sequence alone, unsplit, one thread, scalar kernels: the reference.
fn solo(g: &Arc<Gguf>, spec: EngineSpec, ps: &[Vec<u32>]) -> Vec<Vec<Vec<f32>>> {
    ps.iter().map(|p| run(g, &Shape::split(&[]), (spec, 1, Isa::SCALAR), std::slice::from_ref(p), 3).remove(0)).collect()
}

#[test]
fn logits_do_not_depend_on_split_batch_threads_or_isa() {
    // Every matrix type the kernels read.
    let shapes = [
        (GgmlType::Q4_1, "llama"),
        (GgmlType::Q8_0, "qwen2"),
        (GgmlType::Q4_0, "llama"),
        (GgmlType::Q5_0, "qwen2"),
        (GgmlType::Q5_1, "llama"),
        (GgmlType::F32, "qwen2"),
        (GgmlType::F16, "llama"),
        (GgmlType::BF16, "qwen2"),
        (GgmlType::Q2_K, "llama"),
        (GgmlType::Q3_K, "qwen2"),
        (GgmlType::Q4_K, "llama"),
        (GgmlType::Q5_K, "qwen2"),
        (GgmlType::Q6_K, "qwen2"),
    ];
    for (ty, arch) in shapes {
        let g = model(ty, arch);
        let ps = prompts(300);
        for spec in dgr_engine::registered_specs().into_iter().filter(|s| s.backend == BackendKind::Cpu || on_gpu(s, ty)) {
            let solo = solo(&g, spec, &ps);
            assert!(solo.iter().all(|s| s.iter().all(|l| l.iter().all(|x| x.is_finite()))));
            for cuts in [&[][..], &[3][..], &[2, 4][..]] {
                for batch in [1usize, 2, 4, 8] {
                    for isa in isas(spec) {
                        let threads = 1 + batch % 3;
                        let got = run(&g, &Shape::split(cuts), (spec, threads, isa), &ps[..batch], 3);
                        let what = format!(
                            "{ty:?} {arch} {} {:?} kv {} cuts={cuts:?} batch={batch} {isa:?} threads={threads}",
                            spec.backend, spec.numerics, spec.kv
                        );
                        assert_eq!(bits(&got), bits(&solo[..batch]), "{what}");
                    }
                }
            }
        }
    }
}

/// Whether a GPU engine's splits and batches are checked on weights of `ty`: a software adapter
/// is slow. Its product kernel runs one loop for every type (each type's block decoding is
/// checked against the CPU's in the backend's own tests), so the f32 cache runs a type of each
/// block size and layout; another cache changes only how keys and values are kept, so it runs one.
fn on_gpu(spec: &EngineSpec, ty: GgmlType) -> bool {
    match spec.kv {
        KvDtype::F32 => [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::F16, GgmlType::Q4_K, GgmlType::Q6_K].contains(&ty),
        _ => ty == GgmlType::Q8_0,
    }
}

#[test]
fn bad_inputs_are_typed_errors_and_leave_state_untouched() {
    let g = model(GgmlType::Q4_1, "llama");
    let first = open_engine(g.clone(), 0..3, EngineSpec::threads(1)).unwrap();
    let second = open_engine(g.clone(), 3..6, EngineSpec::threads(1)).unwrap();
    assert!(open_engine(g.clone(), 4..4, EngineSpec::default()).is_err());
    assert!(open_engine(g.clone(), 0..LAYERS + 1, EngineSpec::default()).is_err());
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

#[test]
fn a_last_stage_step_whose_rows_need_no_logits_computes_them_all_the_same() {
    // A scheduler runs a prompt's early chunks with no logits asked for, on the last stage too.
    let g = model(GgmlType::Q4_1, "llama");
    let whole = open_engine(g, 0..LAYERS, EngineSpec::threads(2)).unwrap();
    let (mut a, mut b) = (whole.new_kv(8), whole.new_kv(8));
    let last = |stage: &Stage, kv: &mut dgr_engine::KvCache, toks: &[u32]| {
        stage.forward(&mut [SeqInput { kv, input: Input::Tokens(toks), logits: LogitRows::Last }]).unwrap().remove(0).logits
    };
    let none = whole.forward(&mut [SeqInput { kv: &mut a, input: Input::Tokens(&[1, 2, 3]), logits: LogitRows::None }]).unwrap();
    assert!(none[0].logits.is_empty());
    let split = last(&whole, &mut a, &[4, 5]);
    let one = last(&whole, &mut b, &[1, 2, 3, 4, 5]);
    assert_eq!(bits(&[vec![split]]), bits(&[vec![one]]));
}

#[test]
fn overlapping_stages_compose_through_sub_ranges() {
    // Stages holding two thirds of the model each, or three overlapping ones, serve routes cut
    // anywhere their holdings overlap; sequences of different routes share the stages.
    let shapes = [
        Shape { held: vec![0..4, 2..6], routes: vec![vec![3], vec![2], vec![4]] },
        Shape { held: vec![0..3, 1..5, 2..6], routes: vec![vec![1, 4], vec![2, 5], vec![3, 5], vec![1, 2]] },
    ];
    for (ty, arch) in [(GgmlType::Q8_0, "qwen2"), (GgmlType::Q4_K, "llama"), (GgmlType::F16, "llama")] {
        let g = model(ty, arch);
        let ps = prompts(300);
        for spec in dgr_engine::registered_specs().into_iter().filter(|s| s.backend == BackendKind::Cpu || on_gpu(s, ty)) {
            let solo = solo(&g, spec, &ps[..4]);
            for shape in &shapes {
                // Batch 1 along each route alone, then batch 4 with the routes mixed.
                let each = shape.routes.iter().map(|r| (Shape { routes: vec![r.clone()], ..shape.clone() }, 1));
                for (shape, batch) in each.chain([(shape.clone(), 4)]) {
                    for isa in isas(spec) {
                        let got = run(&g, &shape, (spec, 2, isa), &ps[..batch], 3);
                        let (routes, numerics, kv) = (&shape.routes, spec.numerics, spec.kv);
                        let what =
                            format!("{ty:?} {arch} {} {numerics:?} kv {kv} held={:?} routes={routes:?} {isa:?}", spec.backend, shape.held);
                        assert_eq!(bits(&got), bits(&solo[..batch]), "{what}");
                    }
                }
            }
        }
    }
}

#[test]
fn sub_ranges_outside_the_stage_or_mixed_in_one_forward_are_typed_errors() {
    let g = model(GgmlType::Q4_1, "llama");
    let opts = EngineSpec::threads(1);
    let (front, back) = (open_engine(g.clone(), 0..4, opts).unwrap(), open_engine(g.clone(), 2..6, opts).unwrap());
    for (stage, sub) in [(&front, 0..5), (&front, 3..3), (&front, 4..6), (&back, 1..3), (&back, 0..6)] {
        assert!(matches!(stage.new_kv_for(4, sub), Err(EngineError::BadSubRange { .. })));
    }
    let (mut a, mut b) = (front.new_kv_for(4, 0..2).unwrap(), front.new_kv_for(4, 2..4).unwrap());
    let mixed = front.forward(&mut [
        SeqInput { kv: &mut a, input: Input::Tokens(&[1]), logits: LogitRows::Last },
        SeqInput { kv: &mut b, input: Input::Hidden(&[0.0; 64]), logits: LogitRows::Last },
    ]);
    assert!(matches!(mixed, Err(EngineError::MixedLayerRanges { .. })));
    // Past layer 0 a sequence takes hidden rows, even on a stage that holds the embedding.
    let tokens = front.forward(&mut [SeqInput { kv: &mut b, input: Input::Tokens(&[1]), logits: LogitRows::Last }]);
    assert!(matches!(tokens, Err(EngineError::BadInput(_))));
    assert_eq!((a.len(), b.len()), (0, 0));
    // Short of the last layer a sequence gets hidden rows, even on a stage that holds the head,
    // and its KV cache holds only its layers.
    let mut c = back.new_kv_for(4, 2..5).unwrap();
    let out = back.forward(&mut [SeqInput { kv: &mut c, input: Input::Hidden(&[0.5; 64]), logits: LogitRows::Last }]).unwrap();
    assert_eq!((out[0].hidden.len(), out[0].logits.len()), (64, 0));
    let kv_dim = dgr_engine::ModelConfig::from_gguf(&g).unwrap().kv_dim();
    assert_eq!((c.layers(), c.bytes()), (2..5, 2 * 3 * kv_dim * 4));
}

#[test]
fn kv_bytes_per_position_follow_the_kv_dtype_and_each_dtype_computes_its_own_bits() {
    // Heads of 64 (q8_0 in blocks of 32) and of 16 (q8_0 a block per head).
    for (hidden, heads, kv_heads) in [(256usize, 4usize, 2usize), (64, 4, 2)] {
        let spec = SynthSpec { layers: LAYERS, hidden, ffn: 2 * hidden, heads, kv_heads, ..SynthSpec::default() };
        let g = Arc::new(Gguf::from_bytes(spec.to_gguf().unwrap()).unwrap());
        let (kv_dim, hd) = (kv_heads * hidden / heads, hidden / heads);
        let mut logits = Vec::new();
        for kv in dgr_engine::KvDtype::ALL {
            let stage = open_engine(g.clone(), 1..LAYERS, EngineSpec { kv: *kv, ..EngineSpec::threads(1) }).unwrap();
            let mut cache = stage.new_kv(16);
            let rows = vec![0.25f32; 5 * hidden];
            let out = stage.forward(&mut [SeqInput { kv: &mut cache, input: Input::Hidden(&rows), logits: LogitRows::Last }]).unwrap();
            // Keys and values of 5 positions in each of the stage's layers.
            let per_value = match kv {
                dgr_engine::KvDtype::F32 => 4.0,
                dgr_engine::KvDtype::F16 => 2.0,
                dgr_engine::KvDtype::Q8_0 => 1.0 + 2.0 / hd.min(32) as f64,
            };
            let want = 5.0 * (LAYERS - 1) as f64 * 2.0 * kv_dim as f64 * per_value;
            assert_eq!(cache.bytes() as f64, want, "{kv} with heads of {hd}");
            assert_eq!(stage.kv_position_bytes() * 5, cache.bytes(), "{kv}");
            assert_eq!(stage.engine().kv, *kv);
            logits.push(bits(&[vec![out[0].logits.clone()]]));
        }
        assert!(logits[0] != logits[1] && logits[0] != logits[2] && logits[1] != logits[2], "each KV dtype rounds its own way");
    }
}

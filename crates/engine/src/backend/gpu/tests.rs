use super::*;
use crate::backend::cpu::kernels::tests::{random_row, Rng, TYPES};
use crate::backend::cpu::Cpu;
use dgr_gguf::GgufWriter;

/// Whether a GPU adapter is here. Under CI a missing one fails the test (CI installs lavapipe);
/// elsewhere the test says plainly that it did not run.
pub(crate) fn have_gpu() -> bool {
    if !adapters().is_empty() {
        return true;
    }
    assert!(std::env::var("CI").as_deref() != Ok("true"), "no GPU adapter: CI installs mesa-vulkan-drivers (lavapipe) for these tests");
    eprintln!("no GPU adapter on this machine (no Vulkan, Metal or DX12 device): the GPU test did not run");
    false
}

/// A model file holding one random `rows × k` matrix `m` of `ty`.
fn one_matrix(ty: GgmlType, k: usize, rows: usize, seed: u64) -> Arc<Gguf> {
    let mut rng = Rng(seed);
    let data: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, ty, k)).collect();
    let mut w = GgufWriter::new();
    w.add_tensor("m", ty, &[k as u64, rows as u64], data).unwrap();
    Arc::new(Gguf::from_bytes(w.to_bytes()).unwrap())
}

use dgr_gguf::GgmlType;

/// Every type's product kernel against the CPU's exact one, per element, within 1e-5 of the
/// sum of the terms' magnitudes (their order differs; cancellation is not the kernels' error).
#[test]
fn every_type_multiplies_as_the_cpu_exact_kernels_do() {
    if !have_gpu() {
        return;
    }
    let (k, rows, n) = (512, 37, 3);
    for (i, &ty) in TYPES.iter().enumerate() {
        let g = one_matrix(ty, k, rows, 7 + i as u64);
        let spec = EngineSpec { numerics: Numerics::Exact, ..EngineSpec::threads(1) };
        let (gpu, cpu) = (Gpu::open(&g, &spec).unwrap(), Cpu::open(&g, &spec).unwrap());
        let mut rng = Rng(99 + i as u64);
        let x: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
        let (wg, wc) = (gpu.matrix("m", k, rows).unwrap(), cpu.matrix("m", k, rows).unwrap());
        let (xg, mut og) = (gpu.upload(x.clone()), gpu.alloc(n * rows));
        gpu.matmul(&xg, n, &mut [Product { w: &wg, out: &mut og }]);
        let (mut got, mut want) = (Vec::new(), vec![0f32; n * rows]);
        gpu.read(&og, 0..n * rows, &mut got).unwrap();
        cpu.matmul(&x, n, &mut [Product { w: &wc, out: &mut want }]);
        let t = g.tensor("m").unwrap();
        let rb = t.ty.row_bytes(k as u64).unwrap() as usize;
        for r in 0..rows {
            let mut row = vec![0f32; k];
            dgr_gguf::quant::dequantize_row(ty, &g.tensor_data(t)[r * rb..(r + 1) * rb], &mut row).unwrap();
            for c in 0..n {
                let mag: f64 = row.iter().zip(&x[c * k..(c + 1) * k]).map(|(w, x)| (*w as f64 * *x as f64).abs()).sum();
                let (a, b) = (got[c * rows + r], want[c * rows + r]);
                assert!(((a - b) as f64).abs() <= 1e-5 * mag, "{}: row {r} column {c}: GPU {a}, CPU {b}", ty.name());
            }
        }
    }
}

/// An f16 cache on the GPU holds the halves the CPU's holds (`half`'s rounding: to nearest, ties
/// to even), bit for bit: ties both ways, subnormals, the largest half, overflow to infinity; a
/// row of an odd width is padded with a zero half.
#[test]
fn an_f16_cache_rounds_each_value_as_the_cpus_does() {
    if !have_gpu() {
        return;
    }
    let tie = 1.0 + f32::EPSILON * 1024.0; // 1 + 2^-11: halfway between two halves
    let mut values = vec![
        0.0,
        -0.0,
        1.0,
        -2.5,
        tie,
        -tie,
        1.0 + 3.0 * f32::EPSILON * 1024.0,
        tie + f32::EPSILON,
        65504.0,
        65519.0,
        65520.0,
        1e9,
        -1e9,
        6.1e-5,
        1e-5,
        5.96e-8,
        2.98e-8,
        2.99e-8,
        1e-9,
        -3e-6,
        0.1,
        1.0 / 3.0,
    ];
    let mut rng = Rng(5);
    while values.len() < 320 {
        values.push(rng.f32() * 8.0f32.powi(values.len() as i32 % 9 - 4));
    }
    let g = one_matrix(GgmlType::F32, 64, 1, 1);
    let gpu = Gpu::open(&g, &EngineSpec { kv: KvDtype::F16, ..EngineSpec::threads(1) }).unwrap();
    let half = |x: f32| half::f16::from_f32(x).to_le_bytes();
    for width in [64, 5] {
        let rows = values.len() / width;
        let keys = values[..rows * width].to_vec();
        let vals: Vec<f32> = keys.iter().map(|x| -x).collect();
        let dtype = KvDtype::F16;
        let shape = KvShape { capacity: rows, layers: 0..1, windowed: vec![false], window: None, width, dtype, block: 32, owner: 0 };
        let mut kv = gpu.new_kv(shape);
        let (k, v) = (gpu.upload(keys.clone()), gpu.upload(vals.clone()));
        gpu.kv_reserve(&mut kv, rows);
        gpu.kv_append(&mut kv, 0, &k, &v, 0..rows);
        gpu.kv_advance(&mut kv, rows);
        gpu.ctx.check().unwrap();
        let block = crate::SeqState::read_block(&kv, 0, rows).unwrap();
        let mut want = Vec::new();
        for part in [&keys, &vals] {
            for row in part.chunks(width) {
                want.extend(row.iter().flat_map(|&x| half(x)));
                if width % 2 == 1 {
                    want.extend([0, 0]);
                }
            }
        }
        assert_eq!(block.len(), want.len(), "width {width}");
        for (i, (got, want)) in block.chunks(2).zip(want.chunks(2)).enumerate() {
            let (got, want) = (u16::from_le_bytes([got[0], got[1]]), u16::from_le_bytes([want[0], want[1]]));
            assert_eq!(got, want, "width {width}: half {i}: the GPU stored {got:#06x}, the CPU {want:#06x}");
        }
    }
}

/// A q8_0 cache on the GPU stores each block of a row rotated (where the block is a power of two)
/// as int8 codes against an f16 scale of max |x| / 127: every stored value is within half a
/// scale of the rotated value, and the scale is the CPU's rule's to within its rounding. Rows of
/// blocks of 32 (rotated), 48 and 5 (not), several rows a step, appended after rows held.
#[test]
fn a_q8_0_cache_stores_each_block_within_half_a_scale() {
    if !have_gpu() {
        return;
    }
    let g = one_matrix(GgmlType::F32, 64, 1, 1);
    let gpu = Gpu::open(&g, &EngineSpec { kv: KvDtype::Q8_0, ..EngineSpec::threads(1) }).unwrap();
    let mut rng = Rng(11);
    for (width, block) in [(64, 32), (96, 48), (10, 5)] {
        let rows = 7;
        let keys: Vec<f32> = (0..rows * width).map(|i| rng.f32() * if i % 17 == 0 { 40.0 } else { 1.0 }).collect();
        let dtype = KvDtype::Q8_0;
        let shape = KvShape { capacity: rows, layers: 0..1, windowed: vec![false], window: None, width, dtype, block, owner: 0 };
        let mut kv = gpu.new_kv(shape);
        let (k, v) = (gpu.upload(keys.clone()), gpu.upload(keys.iter().map(|x| -x).collect()));
        // Two steps: 3 rows, then the other 4, after them.
        for step in [0..3, 3..rows] {
            gpu.kv_reserve(&mut kv, step.len());
            gpu.kv_append(&mut kv, 0, &k, &v, step.clone());
            gpu.kv_advance(&mut kv, step.len());
        }
        gpu.ctx.check().unwrap();
        let stored = crate::SeqState::read_block(&kv, 0, rows).unwrap();
        let words: Vec<u32> = stored.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let row_words = width.div_ceil(4) + (width / block).div_ceil(2);
        assert_eq!(words.len(), 2 * rows * row_words, "width {width}");
        for (part, sign) in [(0, 1.0f64), (1, -1.0)] {
            for r in 0..rows {
                let row = &words[(part * rows + r) * row_words..][..row_words];
                for b in 0..width / block {
                    let mut y: Vec<f32> = keys[r * width + b * block..][..block].iter().map(|&x| sign as f32 * x).collect();
                    if block.is_power_of_two() {
                        crate::backend::cpu::kv::hadamard(&mut y);
                    }
                    let y: Vec<f64> = y.into_iter().map(f64::from).collect();
                    let bits = (row[width.div_ceil(4) + b / 2] >> (16 * (b % 2))) as u16;
                    let scale = half::f16::from_bits(bits).to_f64();
                    let want = y.iter().fold(0f64, |m, v| m.max(v.abs())) / 127.0;
                    assert!((scale - want).abs() <= want * 1e-3, "width {width} row {r} block {b}: scale {scale}, max/127 {want}");
                    for (j, &yj) in y.iter().enumerate() {
                        let at = b * block + j;
                        let code = (row[at / 4] >> (8 * (at % 4))) as u8 as i8;
                        let got = code as f64 * scale;
                        assert!((got - yj).abs() <= scale * 0.5001, "width {width} row {r} value {at}: stored {got}, rotated {yj}");
                    }
                }
            }
        }
    }
}

/// A model whose heads are longer than the attention kernel's copies of a head is refused when
/// it opens, not run wrong.
#[test]
fn heads_longer_than_the_attention_kernel_takes_are_refused() {
    if !have_gpu() {
        return;
    }
    let spec = crate::synth::SynthSpec { hidden: 512, heads: 1, kv_heads: 1, ..crate::synth::SynthSpec::default() };
    let g = Arc::new(Gguf::from_bytes(spec.to_gguf().unwrap()).unwrap());
    let opened = crate::open_engine(g, 0..1, EngineSpec { backend: BackendKind::Gpu, numerics: Numerics::Exact, ..EngineSpec::threads(1) });
    let e = opened.err().map(|e| e.to_string());
    assert!(e.as_deref().is_some_and(|e| e.contains("heads of 512 values on the GPU")), "{e:?}");
}

/// A sequence's cache takes its whole capacity on the device at its first step and keeps those
/// buffers to the last position: growing (a copy into bigger buffers) would hold both at once,
/// past what the worker's KV budget counted for it.
#[test]
fn a_cache_takes_its_capacity_at_its_first_step_and_never_grows() {
    if !have_gpu() {
        return;
    }
    let g = one_matrix(GgmlType::F32, 64, 1, 1);
    let gpu = Gpu::open(&g, &EngineSpec::threads(1)).unwrap();
    let (width, capacity) = (64, 40);
    let shape = KvShape { capacity, layers: 0..2, windowed: vec![false; 2], window: None, width, dtype: KvDtype::F32, block: 32, owner: 0 };
    let mut kv = gpu.new_kv(shape);
    let rows = gpu.upload(vec![1.0; capacity * width]);
    let mut made = None;
    for n in [1, 3, 36] {
        gpu.kv_reserve(&mut kv, n);
        for li in 0..2 {
            gpu.kv_append(&mut kv, li, &rows, &rows, 0..n);
        }
        gpu.kv_advance(&mut kv, n);
        let (k, v) = kv.layer(1);
        assert_eq!((k.size(), v.size()), (capacity as u64 * 4 * width as u64, capacity as u64 * 4 * width as u64));
        let first = made.get_or_insert_with(|| (k.clone(), v.clone()));
        assert!(first.0 == *k && first.1 == *v, "the buffers were replaced after {} positions", crate::SeqState::positions(&kv));
    }
    gpu.ctx.check().unwrap();
    assert_eq!(crate::SeqState::positions(&kv), capacity);
}

/// What a stage says a position takes (what a worker's KV budget counts) is what its caches take
/// on the device, padding included: one q8_0 scale of a 48-wide head fills a word there, where
/// the CPU stores its two bytes.
#[test]
fn a_position_takes_on_the_device_what_the_stage_says() {
    if !have_gpu() {
        return;
    }
    let spec = crate::synth::SynthSpec { hidden: 96, heads: 2, kv_heads: 1, layers: 2, ..crate::synth::SynthSpec::default() };
    let g = Arc::new(Gguf::from_bytes(spec.to_gguf().unwrap()).unwrap());
    for &kv in KvDtype::ALL {
        let spec = EngineSpec { backend: BackendKind::Gpu, numerics: Numerics::Exact, kv, ..EngineSpec::threads(1) };
        let stage = crate::open_engine(g.clone(), 0..2, spec).unwrap();
        let mut state = stage.new_kv(8);
        let input = crate::Input::Tokens(&[1]);
        stage.forward(&mut [crate::SeqInput { kv: &mut state, input, logits: crate::LogitRows::Last }]).unwrap();
        let crate::KvCache::Gpu(cache) = &state else { panic!("a GPU stage made a CPU cache") };
        let held: u64 = (0..2).map(|li| cache.layer(li).0.size() + cache.layer(li).1.size()).sum();
        assert_eq!(held, 8 * stage.kv_position_bytes() as u64, "{kv:?}");
    }
}

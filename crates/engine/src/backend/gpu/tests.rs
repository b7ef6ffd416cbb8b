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

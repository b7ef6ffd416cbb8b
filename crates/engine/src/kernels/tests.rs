use super::*;
use dgr_gguf::GgmlType;
use half::f16;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// A random row of `k` elements in `ty`'s layout, with sane scales (no NaN or infinity).
fn random_row(rng: &mut Rng, ty: GgmlType, k: usize) -> Vec<u8> {
    let h = |v: f32| f16::from_f32(v).to_bits().to_le_bytes();
    let mut row = Vec::new();
    match ty {
        GgmlType::F32 => (0..k).for_each(|_| row.extend_from_slice(&rng.f32().to_le_bytes())),
        GgmlType::F16 => (0..k).for_each(|_| row.extend_from_slice(&h(rng.f32()))),
        GgmlType::BF16 => (0..k).for_each(|_| row.extend_from_slice(&((rng.f32().to_bits() >> 16) as u16).to_le_bytes())),
        _ => {
            for _ in 0..k / 32 {
                row.extend_from_slice(&h(rng.f32() * 0.1));
                if ty == GgmlType::Q4_1 {
                    row.extend_from_slice(&h(rng.f32()));
                }
                let q = if ty == GgmlType::Q8_0 { 32 } else { 16 };
                (0..q).for_each(|_| row.push(rng.next() as u8));
            }
        }
    }
    row
}

const TYPES: [GgmlType; 6] = [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0];

#[test]
fn every_isa_and_every_batch_width_gives_identical_bits_close_to_exact() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for ty in TYPES {
        let fast = FastType::of(ty).unwrap();
        let plain = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        for k in [32usize, 64, 576, 1536] {
            let k = if plain { k + 7 } else { k }; // plain rows also exercise the tail
            let row = random_row(&mut rng, ty, k);
            let all_rows = row.repeat(3);
            let mut w = vec![0f32; k];
            dgr_gguf::quant::dequantize_row(ty, &row, &mut w).unwrap();
            let cols: Vec<Vec<f32>> = (0..11).map(|_| (0..k).map(|_| rng.f32()).collect()).collect();
            let xs: Vec<&[f32]> = cols.iter().map(|c| &c[..]).collect();
            let rows = |n: usize| Rows { ty: fast, bytes: &all_rows[..n * row.len()], row_bytes: row.len(), n_rows: n };
            let mut alone = vec![0f32; xs.len()];
            for (c, x) in xs.iter().enumerate() {
                // SAFETY: one row, one column: the only output is `alone[c]`, which exists.
                unsafe { gemv(Isa::SCALAR, &rows(1), k, &[x], alone[c..].as_mut_ptr(), 1) };
                let exact: f64 = w.iter().zip(x.iter()).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = w.iter().zip(x.iter()).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                assert!((alone[c] as f64 - exact).abs() <= 1e-6 * mag + 1e-30, "{ty:?} k={k}: {} vs {exact}", alone[c]);
            }
            for isa in Isa::available() {
                for width in 1..=xs.len() {
                    // Three copies of the row, so every output row must come out the same.
                    let mut out = vec![0f32; width * 3];
                    let mut c = 0;
                    while c < width {
                        let n = group(width - c);
                        // SAFETY: outputs `(c + j) * 3 + r` for j < n ≤ width - c and r < 3, all
                        // inside `out` (width * 3 floats), which nothing else touches meanwhile.
                        unsafe { gemv(isa, &rows(3), k, &xs[c..c + n], out[c * 3..].as_mut_ptr(), 3) };
                        c += n;
                    }
                    for (i, v) in out.iter().enumerate() {
                        assert_eq!(v.to_bits(), alone[i / 3].to_bits(), "{ty:?} {isa:?} k={k} width={width} out={i}");
                    }
                }
            }
        }
    }
}

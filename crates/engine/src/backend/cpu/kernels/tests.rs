use super::*;
use dgr_gguf::GgmlType;
use half::f16;

pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(crate) fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Where each block type keeps its f16 scales (d, and dmin or m where it has one).
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

/// A random row of `k` elements in `ty`'s layout, with sane scales (no NaN or infinity, some
/// negative).
pub(crate) fn random_row(rng: &mut Rng, ty: GgmlType, k: usize) -> Vec<u8> {
    let h = |v: f32| f16::from_f32(v).to_bits().to_le_bytes();
    let mut row = Vec::new();
    match ty {
        GgmlType::F32 => (0..k).for_each(|_| row.extend_from_slice(&rng.f32().to_le_bytes())),
        GgmlType::F16 => (0..k).for_each(|_| row.extend_from_slice(&h(rng.f32()))),
        GgmlType::BF16 => (0..k).for_each(|_| row.extend_from_slice(&((rng.f32().to_bits() >> 16) as u16).to_le_bytes())),
        _ => {
            for _ in 0..k / ty.block_size() {
                let mut block: Vec<u8> = (0..ty.type_size()).map(|_| rng.next() as u8).collect();
                for &o in scale_offsets(ty) {
                    block[o..o + 2].copy_from_slice(&h(rng.f32() * 0.1));
                }
                row.extend(block);
            }
        }
    }
    row
}

pub(crate) const TYPES: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// `xs.len()` columns against the `n` rows of `all_rows`, column by column.
fn products(isa: Isa, ty: FastType, all_rows: &[u8], n: usize, k: usize, xs: &[&[f32]]) -> Vec<f32> {
    let rows = Rows { ty, bytes: all_rows, row_bytes: all_rows.len() / n, n_rows: n };
    let mut out = vec![0f32; xs.len() * n];
    // SAFETY: outputs `c * n + r` for c < xs.len() and r < n, all inside `out`, which nothing
    // else touches meanwhile.
    unsafe { gemv(isa, &rows, k, &Columns::new(isa, xs.to_vec(), k), out.as_mut_ptr(), n) };
    out
}

#[test]
fn types_are_numbered_by_their_place() {
    for (i, ty) in FastType::ALL.into_iter().enumerate() {
        assert_eq!(ty as usize, i);
    }
    for ty in TYPES {
        let fast = FastType::of(ty).unwrap();
        let elems = 32 * fast.block_chunks();
        assert_eq!(ty.row_bytes(elems as u64), Some(fast.block_bytes() as u64), "{ty:?}");
        assert!(fast.plain() || elems == ty.block_size(), "{ty:?}");
    }
}

#[test]
fn every_isa_and_every_batch_width_gives_identical_bits_close_to_exact() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    // More rows than a group of rows or a panel holds (see `ROW_GROUP` and `PANEL_ROWS`), and not
    // a whole number of tiles.
    let n = panel::PANEL_ROWS + 7;
    for ty in TYPES {
        let fast = FastType::of(ty).unwrap();
        // Lengths past one part of a row, for every column group (see `PART_BYTES`), too.
        for k in [256usize, 512, 1536, 8192] {
            // Plain rows also exercise the tail (and, whole, the panels).
            let k = if fast.plain() && k == 1536 { k + 7 } else { k };
            let rows: Vec<Vec<u8>> = (0..n).map(|_| random_row(&mut rng, ty, k)).collect();
            let cols: Vec<Vec<f32>> = (0..19).map(|_| (0..k).map(|_| rng.f32()).collect()).collect();
            let xs: Vec<&[f32]> = cols.iter().map(|c| &c[..]).collect();
            // Each product alone, by the scalar kernel: `alone[c * n + r]`.
            let mut alone = vec![0f32; xs.len() * n];
            for (r, row) in rows.iter().enumerate() {
                let mut w = vec![0f32; k];
                dgr_gguf::quant::dequantize_row(ty, row, &mut w).unwrap();
                for (c, x) in xs.iter().enumerate() {
                    let v = products(Isa::SCALAR, fast, row, 1, k, &[x])[0];
                    let exact: f64 = w.iter().zip(x.iter()).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let mag: f64 = w.iter().zip(x.iter()).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                    assert!((v as f64 - exact).abs() <= 1e-6 * mag + 1e-30, "{ty:?} k={k}: {v} vs {exact}");
                    alone[c * n + r] = v;
                }
                // The weights the kernels dequantize are ggml's, bit for bit: the same products
                // over the reference's f32 row come out the same.
                let plain: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
                let via_f32 = products(Isa::SCALAR, FastType::F32, &plain, 1, k, &xs);
                let want: Vec<f32> = (0..xs.len()).map(|c| alone[c * n + r]).collect();
                assert_eq!(bits(&via_f32), bits(&want), "{ty:?} k={k}: dequantization differs from the reference");
            }
            let all_rows = rows.concat();
            for isa in Isa::available() {
                for width in [1, 2, 3, 4, 7, 8, 11, 16, 17, 19] {
                    let out = products(isa, fast, &all_rows, n, k, &xs[..width]);
                    assert_eq!(bits(&out), bits(&alone[..width * n]), "{ty:?} {isa:?} k={k} width={width}");
                }
            }
        }
    }
}

pub(super) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

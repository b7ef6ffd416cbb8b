//! Products with many columns (a prefill): a panel of rows at a time, dequantized to f32 once,
//! then multiplied by every column in tiles of a few rows by a few columns whose sums stay in
//! registers. Each tile keeps the canonical order: a vector holds `lanes` of the 32 canonical
//! lanes (a "piece" of each chunk), every piece's sums run over the chunks in order, and at the
//! end the pieces are added as the two sets of 16 are, then reduced as `reduce16` does.

use super::{avx2, avx512, dequant, direct, grow, FastType, Isa, Level, Line, Rows};

/// Columns from which dequantizing a few rows to f32 once, then multiplying every column group by
/// those plain rows, beats dequantizing the rows again for each group of 8 columns.
pub(super) const PANEL_COLS: usize = 16;
/// Bytes of f32 rows dequantized at a time: the panel stays in L2 beside a block of columns while
/// they pass (about a quarter of it: more measured slower for long rows).
const PANEL_BYTES: usize = 256 * 1024;
/// At most this many rows a panel, for short rows (a multiple of every tile's rows).
pub(super) const PANEL_ROWS: usize = 48;
/// Bytes of activations a panel is multiplied by at a time.
const COLUMN_BYTES: usize = 1 << 20;
/// Chunks of a row a tile runs over before its running sums go to memory: a tile's rows' worth
/// of them (16–24 KiB) stay in L1 while every column passes.
const TILE_PART: usize = 32;
/// Columns the tiles take through every part before the next: a multiple of every tile's columns.
const TILE_COLUMNS: usize = 48;

/// The shape of an instruction set's tiles: `rows` rows by `cols` columns, in vectors of
/// `lanes` floats, so each 32-element chunk is `32 / lanes` pieces.
#[derive(Clone, Copy)]
pub(super) struct Tiling {
    pub rows: usize,
    pub cols: usize,
    pub lanes: usize,
}

impl Tiling {
    fn of(isa: Isa) -> Option<Tiling> {
        match isa.level() {
            Level::Avx512 => Some(avx512::TILING),
            Level::Avx2 => Some(avx2::TILING),
            Level::Scalar => None,
        }
    }

    /// Floats of one tile's running sums: all 32 lanes of each row and column.
    pub(super) const fn sums(self) -> usize {
        32 * self.rows * self.cols
    }
}

/// One tile: the tiling's rows by the first `n` (at most `cols`) columns of a group, over
/// `chunks`. Rows and columns are laid out piece by piece (the first piece of every chunk, then
/// the second, ...), chunk by chunk, the group's `lanes` floats side by side.
pub(super) struct Tile {
    /// The group's rows and columns, each `nb` chunks long.
    pub w: *const f32,
    pub x: *const f32,
    pub nb: usize,
    pub chunks: std::ops::Range<usize>,
    /// The sums, piece by piece, row by row, column by column (`cols` of them a row): read first
    /// when `resume`; left there unless `last`, when they are reduced into `out[c * stride + r]`.
    pub acc: *mut f32,
    pub resume: bool,
    pub last: bool,
    pub out: *mut f32,
    pub stride: usize,
}

/// `gemv` for many columns over block (or half-precision) rows: a panel of rows at a time,
/// dequantized to f32 and multiplied as plain rows. The weights are the same exact values and
/// every row and column accumulates in the canonical order, so the results are those of the
/// direct kernels.
///
/// # Safety
/// Each row of `w` holds `n_blocks` whole blocks (`k` elements), each column `k` floats, and
/// `out` is valid for the writes at `c * stride + r` (c < xs.len(), r < w.n_rows), which nothing
/// else accesses meanwhile.
pub(super) unsafe fn panels(isa: Isa, w: &Rows, n_blocks: usize, k: usize, cols: &Columns, out: *mut f32, stride: usize) {
    let xs = &cols.xs[..];
    let tiling = Tiling::of(isa);
    let (tile_rows, tile_cols) = tiling.map_or((1, 1), |t| (t.rows, t.cols));
    // Columns a panel meets at a time: about 1 MiB of them, so they stay in L2 beside the panel
    // while it passes, at the cost of dequantizing each panel once per block of columns. (Whole
    // groups of a tile's columns, so a block starts at a group of the packed columns.)
    let block = (COLUMN_BYTES / (4 * k)).max(tile_cols) / tile_cols * tile_cols;
    // A few columns past the block are cheaper taken along than paid for with a second
    // dequantization of every panel (128 prompt rows of 2048 would otherwise split 126 + 2).
    let block = if xs.len() <= block + block / 4 { xs.len() } else { block };
    let panel_rows = (PANEL_BYTES / (4 * k) / tile_rows * tile_rows).clamp(tile_rows, PANEL_ROWS);
    // The tiles read the columns' packed copy (see `Columns::new`), which must be whole.
    assert!(tiling.is_none() || cols.tiled.len() * 16 >= xs.len().div_ceil(tile_cols) * tile_cols * k);
    SCRATCH.with_borrow_mut(|[lines, sums]| {
        grow(lines, panel_rows * k / 16);
        for c0 in (0..xs.len()).step_by(block) {
            let xs = &xs[c0..xs.len().min(c0 + block)];
            for r0 in (0..w.n_rows).step_by(panel_rows) {
                let n_rows = panel_rows.min(w.n_rows - r0);
                // Whole tiles of rows go laid out for the tiles; the rest as plain rows.
                let in_tiles = n_rows / tile_rows * tile_rows * usize::from(tiling.is_some());
                let panel = Line::floats_mut(lines).as_mut_ptr();
                for r in (0..in_tiles).step_by(tile_rows) {
                    // SAFETY: rows `r0 + r..` of `w` hold `n_blocks` blocks each, and the panel
                    // `tile_rows * k` floats from row `r`'s place on; a tiling exists only for
                    // an instruction set this CPU has.
                    unsafe {
                        dequant_tile(isa, w.ty, w.bytes.as_ptr().add((r0 + r) * w.row_bytes), w.row_bytes, n_blocks, panel.add(r * k))
                    };
                }
                for r in in_tiles..n_rows {
                    // SAFETY: row `r0 + r` of `w` holds `n_blocks` blocks, and row `r` of the
                    // panel `k` floats, their elements.
                    unsafe { dequant(isa, w.ty, w.bytes.as_ptr().add((r0 + r) * w.row_bytes), n_blocks, panel.add(r * k)) };
                }
                let out = out.wrapping_add(c0 * stride + r0);
                let bytes = &Line::bytes(lines)[in_tiles * 4 * k..n_rows * 4 * k];
                let plain = Rows { ty: FastType::F32, bytes, row_bytes: 4 * k, n_rows: n_rows - in_tiles };
                // SAFETY: the panel holds `n_rows` rows of `k` floats (`k` a multiple of 32), the
                // packed columns `xs.len()` columns of `k` from column `c0` on, and these are
                // outputs of rows `r0..r0 + n_rows` and columns `c0..`, which the caller vouches
                // for.
                unsafe {
                    if let Some(t) = tiling.filter(|_| in_tiles > 0) {
                        let x = Line::floats(&cols.tiled)[c0 * k..].as_ptr();
                        tiles(isa, t, panel, k, in_tiles, x, xs.len(), out, stride, sums);
                    }
                    direct(isa, &plain, k, 4 * k, xs, out.add(in_tiles), stride);
                }
            }
        }
    })
}

/// `out[c * stride + r] = row r · column c` for `n_rows` f32 rows (`k` floats each, `k` a
/// multiple of 32, `n_rows` a multiple of the tile's) laid out at `w` as `dequant_tile` writes
/// them, and `n_cols` columns laid out at `x` as `pack_columns` writes them: a tile at a time,
/// each vector loaded feeding several multiply-adds, both operands read in address order.
/// `sums` is scratch.
///
/// # Safety
/// `t` is `isa`'s tiling; `w` holds `n_rows * k` floats, `x`
/// `n_cols.div_ceil(t.cols) * t.cols * k`, and `out` is valid for the writes at
/// `c * stride + r` (c < n_cols, r < n_rows).
#[allow(clippy::too_many_arguments)]
unsafe fn tiles(
    isa: Isa,
    t: Tiling,
    w: *const f32,
    k: usize,
    n_rows: usize,
    x: *const f32,
    n_cols: usize,
    out: *mut f32,
    stride: usize,
    sums: &mut Vec<Line>,
) {
    let nb = k / 32;
    let parts = nb.div_ceil(TILE_PART);
    // Each tile's running sums, for a block of columns: kept between parts, and each piece's
    // until the last is added to them.
    let groups = n_rows / t.rows;
    let per_block = TILE_COLUMNS / t.cols;
    grow(sums, groups * per_block * t.sums() / 16);
    let acc = Line::floats_mut(sums).as_mut_ptr();
    // A block of columns at a time, and a part of each of them: the part and the block's sums
    // stay in L2 while every row passes.
    for c0 in (0..n_cols).step_by(TILE_COLUMNS) {
        let cols = c0..n_cols.min(c0 + TILE_COLUMNS);
        for p in 0..parts {
            let chunks = p * TILE_PART..((p + 1) * TILE_PART).min(nb);
            for g in 0..groups {
                for c in cols.clone().step_by(t.cols) {
                    let tile = Tile {
                        w: w.wrapping_add(g * t.rows * k),
                        x: x.wrapping_add(c / t.cols * t.cols * k),
                        nb,
                        chunks: chunks.clone(),
                        acc: acc.wrapping_add((g * per_block + (c - c0) / t.cols) * t.sums()),
                        resume: p > 0,
                        last: p + 1 == parts,
                        out: out.wrapping_add(c * stride + g * t.rows),
                        stride,
                    };
                    let n = t.cols.min(cols.end - c);
                    // SAFETY: the tile's rows, columns (up to `t.cols` from `c`, the ones it
                    // reads) and chunks (below `nb`) are inside what the caller vouches for, its
                    // sums inside `sums`, and its outputs are the caller's; the instruction set
                    // is this CPU's, as `isa` says.
                    unsafe {
                        match isa.level() {
                            Level::Avx512 => avx512::tile(&tile, n),
                            Level::Avx2 => avx2::tile(&tile, n),
                            Level::Scalar => unreachable!("no tiles without SIMD"),
                        }
                    }
                }
            }
        }
    }
}

/// Dequantizes a tile's rows (`isa`'s tiling) of type `ty`, `row_bytes` apart from `p` and
/// `n_blocks` blocks each, into `out` as the tiles read them.
///
/// # Safety
/// `isa` has a tiling; `p` is valid for reading the rows and `out` for writing their elements.
unsafe fn dequant_tile(isa: Isa, ty: FastType, p: *const u8, row_bytes: usize, n_blocks: usize, out: *mut f32) {
    // SAFETY: as the caller vouches; the instruction set is this CPU's, as `isa` says.
    unsafe {
        by_type!(ty, T => match isa.level() {
            Level::Avx512 => avx512::dequant_tile::<T>(p, row_bytes, n_blocks, out),
            Level::Avx2 => avx2::dequant_tile::<T>(p, row_bytes, n_blocks, out),
            Level::Scalar => unreachable!("no tiles without SIMD"),
        })
    }
}

/// The columns `xs` (`k` floats each, `k` a multiple of 32) laid out as `t`'s tiles read them:
/// `t.cols` columns at a time (the last group's missing columns left as they were: a tile reads
/// only the columns it has), piece by piece, chunk by chunk, the group's `t.lanes` floats side
/// by side.
fn pack_columns(t: Tiling, xs: &[&[f32]], k: usize, mut packed: Vec<Line>) -> Vec<Line> {
    let (nb, pieces) = (k / 32, 32 / t.lanes);
    grow(&mut packed, (xs.len().div_ceil(t.cols) * t.cols * k).div_ceil(16));
    let all = Line::floats_mut(&mut packed);
    for (c, x) in xs.iter().enumerate() {
        let group = &mut all[c / t.cols * t.cols * k..][..t.cols * k];
        for (i, piece) in x[..k].chunks_exact(t.lanes).enumerate() {
            let (b, h) = (i / pieces, i % pieces);
            group[((h * nb + b) * t.cols + c % t.cols) * t.lanes..][..t.lanes].copy_from_slice(piece);
        }
    }
    packed
}

/// The columns of a product (each at least `k` floats), and, where tiles will read them, their
/// copy laid out for the tiles: made once for every thread's share of the rows.
pub(crate) struct Columns<'a> {
    pub xs: Vec<&'a [f32]>,
    tiled: Vec<Line>,
}

impl<'a> Columns<'a> {
    pub(crate) fn new(isa: Isa, xs: Vec<&'a [f32]>, k: usize) -> Columns<'a> {
        let tiled = match Tiling::of(isa) {
            Some(t) if k.is_multiple_of(32) && xs.len() >= PANEL_COLS => pack_columns(t, &xs, k, PACKED.take()),
            _ => Vec::new(),
        };
        Columns { xs, tiled }
    }
}

impl Drop for Columns<'_> {
    fn drop(&mut self) {
        // Columns that were not packed took no buffer, and must not drop the one kept.
        if self.tiled.capacity() > 0 {
            PACKED.set(std::mem::take(&mut self.tiled));
        }
    }
}

thread_local! {
    /// Each thread's panel and tile sums, kept between calls: fresh buffers this size would be
    /// mapped, faulted in and zeroed on every call.
    static SCRATCH: std::cell::RefCell<[Vec<Line>; 2]> = const { std::cell::RefCell::new([Vec::new(), Vec::new()]) };
    /// The buffer of the thread's last packed columns, for its next: a fresh one would be
    /// mapped and faulted in for every product.
    static PACKED: std::cell::Cell<Vec<Line>> = const { std::cell::Cell::new(Vec::new()) };
}

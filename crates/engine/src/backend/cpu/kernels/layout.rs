//! Where the fields of each K-quant super-block lie (ggml-quants.c), and the unpacking of their
//! packed sub-block scales: integer work every instruction set shares, done once per super-block.

/// Q2_K: 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit codes, f16 d and
/// f16 dmin.
pub(super) const Q2K_QS: usize = 16;
pub(super) const Q2K_D: usize = 80;

/// Q3_K: the high-bit mask, 64 bytes of 2-bit codes, 12 bytes of packed 6-bit scales, f16 d.
pub(super) const Q3K_QS: usize = 32;
pub(super) const Q3K_SCALES: usize = 96;
pub(super) const Q3K_D: usize = 108;

/// Q4_K and Q5_K: f16 d and dmin, 12 bytes of packed 6-bit scales and mins, (Q5_K: 32 bytes of
/// fifth bits,) then the nibbles.
pub(super) const Q45K_SCALES: usize = 4;
pub(super) const Q4K_QS: usize = 16;
pub(super) const Q5K_QH: usize = 16;
pub(super) const Q5K_QS: usize = 48;

/// Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales, f16 d.
pub(super) const Q6K_QH: usize = 128;
pub(super) const Q6K_SCALES: usize = 192;
pub(super) const Q6K_D: usize = 208;

fn words(s: [u8; 12]) -> [u32; 3] {
    std::array::from_fn(|i| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]))
}

/// Q4_K/Q5_K's eight 6-bit scales (bytes 0..8) and eight 6-bit mins (bytes 8..16), unpacked
/// from their 12 bytes as ggml's `get_scale_min_k4` does, all at once.
pub(super) fn q45k_scales(s: [u8; 12]) -> [u8; 16] {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let [a, b, c] = words(s);
    let sc_hi = (c & LOW4) | (((a >> 6) & LOW2) << 4);
    let mn_hi = ((c >> 4) & LOW4) | (((b >> 6) & LOW2) << 4);
    let mut out = [0u8; 16];
    for (i, w) in [a & LOW6, sc_hi, b & LOW6, mn_hi].into_iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// Q3_K's sixteen 6-bit scales (each still offset by 32), unpacked from their 12 bytes.
pub(super) fn q3k_scales(s: [u8; 12]) -> [u8; 16] {
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let [a, b, t] = words(s);
    let w = [
        (a & LOW4) | ((t & LOW2) << 4),
        (b & LOW4) | (((t >> 2) & LOW2) << 4),
        ((a >> 4) & LOW4) | (((t >> 4) & LOW2) << 4),
        ((b >> 4) & LOW4) | (((t >> 6) & LOW2) << 4),
    ];
    let mut out = [0u8; 16];
    for (i, w) in w.into_iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// Every f16 widened to f32, by its bits: a block's scale read as one load the vector unit
/// broadcasts for free, where a conversion would take shuffle-port work each block, the port
/// that dequantizing legacy blocks already saturates. (Built at compile time; exact, as the
/// conversion is.)
pub(super) static F16_TO_F32: [f32; 1 << 16] = {
    let mut t = [0f32; 1 << 16];
    let mut i = 0;
    while i < t.len() {
        t[i] = half::f16::from_bits(i as u16).to_f32_const();
        i += 1;
    }
    t
};

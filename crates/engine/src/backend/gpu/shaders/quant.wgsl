// GGUF's blocks read where they lie: `w` holds a matrix's rows as the file stores them. Each
// `deq32_*` decodes sub-block `s` (32 elements) of the block at byte `o` into `blk` (as eight
// vectors of four), computing
// each value as ggml's dequantization does in f32. The float types are read as blocks of 32.

var<private> blk: array<vec4<f32>, 8>;

// Element j of the sub-block.
fn put(j: u32, v: f32) {
    blk[j >> 2u][j & 3u] = v;
}

fn byte(o: u32) -> u32 {
    return (w[o >> 2u] >> ((o & 3u) * 8u)) & 0xffu;
}

// A signed byte.
fn sbyte(o: u32) -> i32 {
    return bitcast<i32>(byte(o) << 24u) >> 24u;
}

// The f16 at even byte `o`.
fn half(o: u32) -> f32 {
    return unpack2x16float((w[o >> 2u] >> ((o & 2u) * 8u)) & 0xffffu).x;
}

// Four bytes at `o` (a multiple of two), little-endian.
fn word(o: u32) -> u32 {
    return byte(o) | (byte(o + 1u) << 8u) | (byte(o + 2u) << 16u) | (byte(o + 3u) << 24u);
}

fn deq32_f32(o: u32, s: u32) {
    for (var j = 0u; j < 32u; j++) {
        put(j, bitcast<f32>(w[(o >> 2u) + j]));
    }
}

fn deq32_f16(o: u32, s: u32) {
    for (var j = 0u; j < 16u; j++) {
        let v = unpack2x16float(w[(o >> 2u) + j]);
        put(2u * j, v.x);
        put(2u * j + 1u, v.y);
    }
}

fn deq32_bf16(o: u32, s: u32) {
    for (var j = 0u; j < 16u; j++) {
        let v = w[(o >> 2u) + j];
        put(2u * j, bitcast<f32>(v << 16u));
        put(2u * j + 1u, bitcast<f32>(v & 0xffff0000u));
    }
}

fn deq32_q4_0(o: u32, s: u32) {
    let d = half(o);
    for (var i = 0u; i < 16u; i++) {
        let b = byte(o + 2u + i);
        put(i, d * f32(i32(b & 15u) - 8));
        put(i + 16u, d * f32(i32(b >> 4u) - 8));
    }
}

fn deq32_q4_1(o: u32, s: u32) {
    let d = half(o);
    let m = half(o + 2u);
    for (var i = 0u; i < 16u; i++) {
        let b = byte(o + 4u + i);
        put(i, d * f32(b & 15u) + m);
        put(i + 16u, d * f32(b >> 4u) + m);
    }
}

fn deq32_q5_0(o: u32, s: u32) {
    let d = half(o);
    let qh = word(o + 2u);
    for (var i = 0u; i < 16u; i++) {
        let b = byte(o + 6u + i);
        put(i, d * f32(i32((b & 15u) | (((qh >> i) & 1u) << 4u)) - 16));
        put(i + 16u, d * f32(i32((b >> 4u) | (((qh >> (i + 16u)) & 1u) << 4u)) - 16));
    }
}

fn deq32_q5_1(o: u32, s: u32) {
    let d = half(o);
    let m = half(o + 2u);
    let qh = word(o + 4u);
    for (var i = 0u; i < 16u; i++) {
        let b = byte(o + 8u + i);
        put(i, d * f32((b & 15u) | (((qh >> i) & 1u) << 4u)) + m);
        put(i + 16u, d * f32((b >> 4u) | (((qh >> (i + 16u)) & 1u) << 4u)) + m);
    }
}

fn deq32_q8_0(o: u32, s: u32) {
    let d = half(o);
    for (var i = 0u; i < 32u; i++) {
        put(i, d * f32(sbyte(o + 2u + i)));
    }
}

// Q2_K: scales[16] at 0, qs[64] at 16, d at 80, dmin at 82. Sub-block s: quarter s % 4 of
// half s / 4, in two runs of 16 with a scale each.
fn deq32_q2_k(o: u32, s: u32) {
    let n = s / 4u;
    let sh = 2u * (s % 4u);
    let d = half(o + 80u);
    let dmin = half(o + 82u);
    for (var h = 0u; h < 2u; h++) {
        let sc = byte(o + 2u * s + h);
        let dl = d * f32(sc & 15u);
        let ml = dmin * f32(sc >> 4u);
        for (var l = 0u; l < 16u; l++) {
            let q = (byte(o + 16u + 32u * n + 16u * h + l) >> sh) & 3u;
            put(16u * h + l, dl * f32(q) - ml);
        }
    }
}

// Q3_K: hmask[32] at 0, qs[64] at 32, scales[12] at 96 (sixteen 6-bit scales), d at 108.
fn deq32_q3_k(o: u32, s: u32) {
    let n = s / 4u;
    let sh = 2u * (s % 4u);
    let m = 1u << s;
    let d = half(o + 108u);
    for (var h = 0u; h < 2u; h++) {
        let is = 2u * s + h;
        let low = select(byte(o + 96u + is - 8u) >> 4u, byte(o + 96u + is) & 15u, is < 8u);
        let high = (byte(o + 104u + is % 4u) >> (2u * (is / 4u))) & 3u;
        let dl = d * f32(i32(low | (high << 4u)) - 32);
        for (var l = 0u; l < 16u; l++) {
            let li = 16u * h + l;
            let q = i32((byte(o + 32u + 32u * n + li) >> sh) & 3u);
            let hi = select(4, 0, (byte(o + li) & m) != 0u);
            put(li, dl * f32(q - hi));
        }
    }
}

// K-quants' 6-bit scale and min `i` of the 12 bytes at `o`.
fn scale_min_k4(o: u32, i: u32) -> vec2<u32> {
    if i < 4u {
        return vec2<u32>(byte(o + i) & 63u, byte(o + i + 4u) & 63u);
    }
    let d = (byte(o + i + 4u) & 15u) | ((byte(o + i - 4u) >> 6u) << 4u);
    let m = (byte(o + i + 4u) >> 4u) | ((byte(o + i) >> 6u) << 4u);
    return vec2<u32>(d, m);
}

// Q4_K: d at 0, dmin at 2, scales[12] at 4, qs[128] at 16. Sub-block s: the low (even s) or
// high nibbles of 32 bytes.
fn deq32_q4_k(o: u32, s: u32) {
    let sm = scale_min_k4(o + 4u, s);
    let d1 = half(o) * f32(sm.x);
    let m1 = half(o + 2u) * f32(sm.y);
    let sh = 4u * (s % 2u);
    for (var l = 0u; l < 32u; l++) {
        put(l, d1 * f32((byte(o + 16u + 32u * (s / 2u) + l) >> sh) & 15u) - m1);
    }
}

// Q5_K: d at 0, dmin at 2, scales[12] at 4, qh[32] at 16, qs[128] at 48.
fn deq32_q5_k(o: u32, s: u32) {
    let sm = scale_min_k4(o + 4u, s);
    let d1 = half(o) * f32(sm.x);
    let m1 = half(o + 2u) * f32(sm.y);
    let sh = 4u * (s % 2u);
    for (var l = 0u; l < 32u; l++) {
        let q = ((byte(o + 48u + 32u * (s / 2u) + l) >> sh) & 15u) | (((byte(o + 16u + l) >> s) & 1u) << 4u);
        put(l, d1 * f32(q) - m1);
    }
}

// Q6_K: ql[128] at 0, qh[64] at 128, scales (int8)[16] at 192, d at 208. Sub-block s: quarter
// s % 4 of half s / 4, in two runs of 16 with a scale each.
fn deq32_q6_k(o: u32, s: u32) {
    let n = s / 4u;
    let quad = s % 4u;
    let d = half(o + 208u);
    for (var h = 0u; h < 2u; h++) {
        let dl = d * f32(sbyte(o + 192u + 8u * n + h + 2u * quad));
        for (var l = 0u; l < 16u; l++) {
            let li = 16u * h + l;
            let low = (byte(o + 64u * n + li + (quad & 1u) * 32u) >> (4u * (quad / 2u))) & 15u;
            let high = (byte(o + 128u + 32u * n + li) >> (2u * quad)) & 3u;
            put(li, dl * f32(i32(low | (high << 4u)) - 32));
        }
    }
}

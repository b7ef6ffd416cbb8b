// The cache as the attention kernel reads it: q8_0 rows (kv_store_q8.wgsl: codes, then scales)
// of p.c.z values in blocks of p.c.y, each block rotated where p.c.y is a power of two. The
// kernel turns the query alike and its output back (H·H = block·I: `turned` is 1/block then).

@group(0) @binding(2) var<storage, read> kc: array<u32>;
@group(0) @binding(3) var<storage, read> vc: array<u32>;

// Value j of a row whose code is in `code_word` and whose block's scale is in `scale_word`.
fn q8(code_word: u32, scale_word: u32, j: u32) -> f32 {
    let code = i32(code_word << (24u - 8u * (j % 4u))) >> 24u;
    return f32(code) * from_half(scale_word >> (16u * ((j / p.c.y) % 2u)));
}

fn scale_at(s: u32, j: u32) -> u32 {
    return s * p.b.w + (p.c.z + 3u) / 4u + j / p.c.y / 2u;
}

fn key(s: u32, j: u32) -> f32 {
    return q8(kc[s * p.b.w + j / 4u], kc[scale_at(s, j)], j);
}

fn value(s: u32, j: u32) -> f32 {
    return q8(vc[s * p.b.w + j / 4u], vc[scale_at(s, j)], j);
}

fn rotated() -> bool {
    return (p.c.y & (p.c.y - 1u)) == 0u;
}

// Each block of x[0..n) times the Walsh–Hadamard matrix, where blocks rotate.
fn turn(x: ptr<function, array<f32, 256>>, n: u32) {
    if rotated() {
        for (var b = 0u; b < n; b += p.c.y) {
            hadamard(x, b, p.c.y);
        }
    }
}

fn turned() -> f32 {
    return select(1.0, 1.0 / f32(p.c.y), rotated());
}

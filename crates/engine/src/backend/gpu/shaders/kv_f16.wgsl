// The cache as the attention kernel reads it: f16 keys and values, two a word (the first in the
// low half), rows p.b.w words apart.

@group(0) @binding(2) var<storage, read> kc: array<u32>;
@group(0) @binding(3) var<storage, read> vc: array<u32>;

fn key(s: u32, j: u32) -> f32 {
    return from_half(kc[s * p.b.w + j / 2u] >> (16u * (j % 2u)));
}

fn value(s: u32, j: u32) -> f32 {
    return from_half(vc[s * p.b.w + j / 2u] >> (16u * (j % 2u)));
}

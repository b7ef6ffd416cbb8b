// The cache as the attention kernel reads it: f16 keys and values, two a word, the first in the
// low half.

@group(0) @binding(2) var<storage, read> kc: array<u32>;
@group(0) @binding(3) var<storage, read> vc: array<u32>;

fn key(i: u32) -> f32 {
    return from_half(kc[i / 2u] >> (16u * (i % 2u)));
}

fn value(i: u32) -> f32 {
    return from_half(vc[i / 2u] >> (16u * (i % 2u)));
}

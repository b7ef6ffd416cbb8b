// The cache as the attention kernel reads it: f32 keys and values.

@group(0) @binding(2) var<storage, read> kc: array<f32>;
@group(0) @binding(3) var<storage, read> vc: array<f32>;

fn key(i: u32) -> f32 {
    return kc[i];
}

fn value(i: u32) -> f32 {
    return vc[i];
}

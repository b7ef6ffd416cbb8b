// The cache as the attention kernel reads it: f32 keys and values, rows p.b.w words apart.

@group(0) @binding(2) var<storage, read> kc: array<f32>;
@group(0) @binding(3) var<storage, read> vc: array<f32>;

fn key(s: u32, j: u32) -> f32 {
    return kc[s * p.b.w + j];
}

fn value(s: u32, j: u32) -> f32 {
    return vc[s * p.b.w + j];
}

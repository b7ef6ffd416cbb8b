// x += rms_norm(o) * w, one invocation a row (gemma3's post-norms). p.a: width, eps bits, rows.

@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> o: array<f32>;
@group(0) @binding(3) var<storage, read> nw: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let width = p.a.x;
    if id.x >= p.a.z {
        return;
    }
    let base = id.x * width;
    var ss = 0.0;
    for (var i = 0u; i < width; i++) {
        ss = fma(o[base + i], o[base + i], ss);
    }
    let scale = 1.0 / sqrt(ss / f32(width) + bitcast<f32>(p.a.y));
    for (var i = 0u; i < width; i++) {
        x[base + i] += (o[base + i] * scale) * nw[i];
    }
}

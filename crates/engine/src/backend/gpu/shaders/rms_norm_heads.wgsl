// rms_norm in place on each head of every row, one invocation a head. p.a: head width, eps
// bits, heads in all.

@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> nw: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let width = p.a.x;
    if id.x >= p.a.z {
        return;
    }
    let base = id.x * width;
    var ss = 0.0;
    for (var i = 0u; i < width; i++) {
        ss = fma(x[base + i], x[base + i], ss);
    }
    let scale = 1.0 / sqrt(ss / f32(width) + bitcast<f32>(p.a.y));
    for (var i = 0u; i < width; i++) {
        x[base + i] = (x[base + i] * scale) * nw[i];
    }
}

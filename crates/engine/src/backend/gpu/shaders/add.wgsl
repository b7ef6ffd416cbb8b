// x[i] += y[i % width] over len floats: a residual (width = len) or a bias. p.a: len, width.

@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = flat(g, ng, l);
    if i < p.a.x {
        x[i] += y[i % p.a.y];
    }
}

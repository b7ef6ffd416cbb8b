// l = cap * tanh(l / cap) over len floats. p.a: len, cap bits.

@group(0) @binding(1) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = flat(g, ng, l);
    if i < p.a.x {
        let cap = bitcast<f32>(p.a.y);
        x[i] = cap * tanh(x[i] / cap);
    }
}

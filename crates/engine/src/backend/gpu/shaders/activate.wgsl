// gate = act(gate) * up over len floats. p.a: len, activation (0 SiLU, 1 GELU's tanh form).

@group(0) @binding(1) var<storage, read_write> gate: array<f32>;
@group(0) @binding(2) var<storage, read> up: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = flat(g, ng, l);
    if i >= p.a.x {
        return;
    }
    let x = gate[i];
    if p.a.y == 0u {
        gate[i] = flush(x * sigmoid(x) * up[i]);
    } else {
        gate[i] = flush(x * sigmoid(2.0 * 0.7978846 * x * (1.0 + 0.044715 * x * x)) * up[i]);
    }
}

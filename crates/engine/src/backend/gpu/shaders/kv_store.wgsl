// Rows of keys or values into an f16 cache, two halves a word, each row padded to whole words:
// source rows [p.a.x, p.a.x + p.a.z) of p.a.y floats to the cache's rows from p.a.w on.

@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = flat(g, ng, l);
    let width = p.a.y;
    let words = (width + 1u) / 2u;
    if i >= p.a.z * words {
        return;
    }
    let j = 2u * (i % words);
    let at = (p.a.x + i / words) * width + j;
    var high = 0u;
    if j + 1u < width {
        high = to_half(src[at + 1u]);
    }
    dst[p.a.w * words + i] = to_half(src[at]) | (high << 16u);
}

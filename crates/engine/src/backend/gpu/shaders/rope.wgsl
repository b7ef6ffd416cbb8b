// Rotates the first 2 * pairs dimensions of each head of every row by the row's (cos, sin)
// table; one invocation a (row, head, pair). p.a: width, head_dim, pairs, style (0 adjacent
// pairs, 1 halves); p.b.x: total invocations.

@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = flat(g, ng, l);
    if i >= p.b.x {
        return;
    }
    let width = p.a.x;
    let hd = p.a.y;
    let pairs = p.a.z;
    let per_row = (width / hd) * pairs;
    let t = i / per_row;
    let head = (i % per_row) / pairs;
    let pair = i % pairs;
    let base = t * width + head * hd;
    var a = base + 2u * pair;
    var b = a + 1u;
    if p.a.w == 1u {
        a = base + pair;
        b = a + pairs;
    }
    let c = table[(t * pairs + pair) * 2u];
    let s = table[(t * pairs + pair) * 2u + 1u];
    let x0 = x[a];
    let x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
}

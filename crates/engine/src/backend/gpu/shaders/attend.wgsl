// Causal attention of one sequence's rows over its cached keys and values, one invocation a
// (query head, row): the largest score, then the weights and the values over the positions in
// order. The cache is read through `key`, `value`, `turn` and `turned` (kv_f32.wgsl, kv_f16.wgsl
// or kv_q8.wgsl, put before this). p.a: first row t0, n_head, heads per KV head, head_dim (at
// most 256); p.b: position of row t0, window (0: none), scale bits, words a cache row; p.c: rows,
// q8_0 block, cache row width.

@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

fn score(x: ptr<function, array<f32, 256>>, s: u32, koff: u32, hd: u32) -> f32 {
    var acc = 0.0;
    for (var d = 0u; d < hd; d++) {
        acc = fma((*x)[d], key(s, koff + d), acc);
    }
    return acc * turned() * bitcast<f32>(p.b.z);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>) {
    let n_head = p.a.y;
    let i = id.y * ng.x * 64u + id.x;
    let row = i / n_head;
    if row >= p.c.x {
        return;
    }
    let h = i % n_head;
    let t = p.a.x + row;
    let hd = p.a.w;
    let qo = t * n_head * hd + h * hd;
    let pos = p.b.x + row;
    let window = p.b.y;
    var first = 0u;
    if window > 0u && pos + 1u > window {
        first = pos + 1u - window;
    }
    let koff = (h / p.a.z) * hd;
    var x: array<f32, 256>;
    for (var d = 0u; d < hd; d++) {
        x[d] = q[qo + d];
    }
    turn(&x, hd);
    var m = -3.4e38;
    for (var s = first; s <= pos; s++) {
        m = max(m, score(&x, s, koff, hd));
    }
    var acc: array<f32, 256>;
    var sum = 0.0;
    for (var s = first; s <= pos; s++) {
        let e = flush(exp(score(&x, s, koff, hd) - m));
        sum += e;
        for (var d = 0u; d < hd; d++) {
            acc[d] = fma(e, value(s, koff + d), acc[d]);
        }
    }
    turn(&acc, hd);
    for (var d = 0u; d < hd; d++) {
        out[qo + d] = acc[d] * turned() / sum;
    }
}

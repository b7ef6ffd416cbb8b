// Output rows times up to COLS input columns, one invocation per (row, group of columns): the
// row's elements in order, decoded 32 at a time from their block, times each column in four
// lanes summed at the end. The order depends
// only on the row's width, never on the column count or which columns share the invocation.
// No workgroup memory and no barriers, so a software device runs it as plain vector code.
// p.a: k, rows (of this chunk), n (columns bound), row_bytes; p.b: row0 (the chunk's first
// row in the output), out_rows (the output's stride per column), workgroups in x.

@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const COLS: u32 = 16u;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let k = p.a.x;
    let r = (g.x + g.y * p.b.z) * 64u + l;
    if r >= p.a.y {
        return;
    }
    let c0 = g.z * COLS;
    let cols = min(COLS, p.a.z - c0);
    // Per column, four partial sums (elements 4i, 4i + 1, ... apart), added at the end.
    var acc: array<vec4<f32>, 16>;
    let row = r * p.a.w;
    for (var b = 0u; b < k / BS; b++) {
        for (var s = 0u; s < BS / 32u; s++) {
            deq32(row + b * BB, s);
            let at = b * BS + 32u * s;
            for (var c = 0u; c < cols; c++) {
                var a = acc[c];
                let xo = ((c0 + c) * k + at) / 4u;
                for (var j = 0u; j < 8u; j++) {
                    a = fma(blk[j], x[xo + j], a);
                }
                acc[c] = a;
            }
        }
    }
    for (var c = 0u; c < cols; c++) {
        let a = acc[c];
        out[(c0 + c) * p.b.y + p.b.x + r] = (a.x + a.y) + (a.z + a.w);
    }
}

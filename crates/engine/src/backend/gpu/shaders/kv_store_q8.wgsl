// Rows of keys or values into a q8_0 cache, one invocation a row: each block of p.b.x values
// times the Walsh–Hadamard matrix where p.b.x is a power of two (butterflies in the CPU's order,
// so an outlier does not set its block's scale alone), then int8 codes against an f16 scale of
// max |x| / 127, rounded first. A row is its codes, four a word, then its scales, two a word.
// Source rows [p.a.x, p.a.x + p.a.z) of p.a.y floats to the cache's rows from p.a.w on.

@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let r = (g.y * ng.x + g.x) * 64u + l;
    if r >= p.a.z {
        return;
    }
    let width = p.a.y;
    let block = p.b.x;
    let code_words = (width + 3u) / 4u;
    let row = (p.a.w + r) * (code_words + (width / block + 1u) / 2u);
    let at0 = (p.a.x + r) * width;
    var code_word = 0u;
    var scale_word = 0u;
    for (var b = 0u; b < width / block; b++) {
        var x: array<f32, 256>;
        for (var j = 0u; j < block; j++) {
            x[j] = src[at0 + b * block + j];
        }
        if (block & (block - 1u)) == 0u {
            hadamard(&x, 0u, block);
        }
        var amax = 0.0;
        for (var j = 0u; j < block; j++) {
            amax = max(amax, abs(x[j]));
        }
        let scale = to_half(min(amax / 127.0, 65504.0));
        let d = from_half(scale);
        for (var j = 0u; j < block; j++) {
            var q = 0.0;
            if d != 0.0 {
                // Halves away from zero, as the CPU's `round`.
                let v = x[j] / d;
                q = clamp(select(floor(v + 0.5), ceil(v - 0.5), v < 0.0), -127.0, 127.0);
            }
            let at = b * block + j;
            code_word |= (u32(i32(q)) & 0xffu) << (8u * (at % 4u));
            if at % 4u == 3u || at + 1u == width {
                dst[row + at / 4u] = code_word;
                code_word = 0u;
            }
        }
        scale_word |= scale << (16u * (b % 2u));
        if b % 2u == 1u || b + 1u == width / block {
            dst[row + code_words + b / 2u] = scale_word;
            scale_word = 0u;
        }
    }
}

// Every kernel's parameters: twelve words in binding 0 (floats as their bits).
struct Params {
    a: vec4<u32>,
    b: vec4<u32>,
    c: vec4<u32>,
}

@group(0) @binding(0) var<uniform> p: Params;

// Magnitudes below 2^-64 leave an activation as zero, as on the CPU.
const TINY: f32 = 5.421010862427522e-20;

fn flush(x: f32) -> f32 {
    return select(x, 0.0, abs(x) < TINY);
}

// 1 / (1 + e^-x) through e^-|x| only, as on the CPU.
fn sigmoid(x: f32) -> f32 {
    let e = exp(-abs(x));
    let s = 1.0 / (1.0 + e);
    return select(e * s, s, x >= 0.0);
}

// The flat index of an invocation of a 2-D grid of 256-wide workgroups.
fn flat(g: vec3<u32>, n: vec3<u32>, l: u32) -> u32 {
    return (g.y * n.x + g.x) * 256u + l;
}

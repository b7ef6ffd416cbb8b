// f16 in the low 16 bits of a word, converted by hand: WGSL leaves pack2x16float's rounding to
// the implementation, and the cache must round as the CPU's does (to nearest, ties to even).

fn to_half(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let m = b & 0x7fffffu;
    let e = i32((b >> 23u) & 0xffu);
    if e == 0xff {
        // Infinity, or a NaN that stays one.
        return sign | 0x7c00u | select(0u, 0x200u, m != 0u) | (m >> 13u);
    }
    let he = e - 127 + 15;
    if he >= 0x1f {
        return sign | 0x7c00u;
    }
    if he <= 0 {
        if 14 - he > 24 {
            return sign;
        }
        // A subnormal half: the hidden bit joins the mantissa.
        let full = m | 0x800000u;
        let shift = u32(14 - he);
        let round = 1u << (shift - 1u);
        let up = (full & round) != 0u && (full & (3u * round - 1u)) != 0u;
        return sign | ((full >> shift) + select(0u, 1u, up));
    }
    let up = (m & 0x1000u) != 0u && (m & 0x2fffu) != 0u;
    return (sign | (u32(he) << 10u) | (m >> 13u)) + select(0u, 1u, up);
}

// Exact: every half is an f32 (subnormal halves are normal floats).
fn from_half(w: u32) -> f32 {
    let h = w & 0xffffu;
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if e == 0u {
        return bitcast<f32>(bitcast<u32>(f32(m) * 5.9604644775390625e-8) | sign);
    }
    if e == 0x1fu {
        return bitcast<f32>(sign | 0x7f800000u | (m << 13u));
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}

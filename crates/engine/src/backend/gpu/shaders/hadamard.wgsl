// x[b..b + n) times the Walsh–Hadamard matrix of size n (a power of two), in place: butterflies
// in the CPU's order (`backend/cpu/kv.rs`, `hadamard`).
fn hadamard(x: ptr<function, array<f32, 256>>, b: u32, n: u32) {
    for (var h = 1u; h < n; h *= 2u) {
        for (var i = b; i < b + n; i += 2u * h) {
            for (var j = i; j < i + h; j++) {
                let a = (*x)[j];
                let c = (*x)[j + h];
                (*x)[j] = a + c;
                (*x)[j + h] = a - c;
            }
        }
    }
}

// A cache that stores values as they are (f32, f16): nothing to turn.

fn turn(x: ptr<function, array<f32, 256>>, n: u32) {}

fn turned() -> f32 {
    return 1.0;
}

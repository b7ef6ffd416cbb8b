//! Parses arbitrary bytes as GGUF; on success touches every metadata value and tensor byte and
//! dequantizes the first row of each tensor, so any accepted file is also safe to use.
#![no_main]

use dgr_gguf::{quant, Gguf, Value};
use libfuzzer_sys::fuzz_target;
use std::hint::black_box;

fn touch(v: &Value) {
    black_box((
        v.type_name(),
        v.as_u64(),
        v.as_i64(),
        v.as_f32(),
        v.as_bool(),
        v.as_str(),
    ));
    for item in v.as_array().unwrap_or(&[]) {
        touch(item);
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::from_bytes(data.to_vec()) else {
        return;
    };
    for (key, value) in g.metadata() {
        assert!(g.get(key).is_some());
        touch(value);
    }
    for t in g.tensors() {
        let bytes = g.tensor_data(t);
        assert_eq!(bytes.len() as u64, t.n_bytes);
        assert!(g.tensor(&t.name).is_some());
        black_box(bytes.iter().fold(0u8, |a, &b| a ^ b));
        // Cap the row so a long row in a tiny file cannot make an iteration slow.
        let row_len = t.row_len().min(1 << 16);
        if let Some(n) =
            t.ty.row_bytes(row_len)
                .and_then(|n| usize::try_from(n).ok())
        {
            let mut row = vec![0.0f32; row_len as usize];
            let _ = quant::dequantize_row(t.ty, &bytes[..n.min(bytes.len())], &mut row);
        }
    }
});

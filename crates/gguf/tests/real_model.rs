//! The default model. Its absence is a failure, never a skip: scripts/fetch-model.sh fetches it.
#![cfg(feature = "real-model")]

use dgr_gguf::{default_model_path, quant, GgmlType, Gguf};

#[test]
fn default_model_parses() {
    let path = default_model_path();
    assert!(path.exists(), "the default model is not at {}: run scripts/fetch-model.sh", path.display());
    let g = Gguf::open(&path).expect("open model");
    assert_eq!(g.get_str("general.architecture").ok(), Some("llama"));
    assert_eq!(g.tensors().len(), 272);
    let tokens = g.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).map(<[_]>::len);
    assert_eq!(tokens, Some(49152));

    let emb = g.tensor("token_embd.weight").expect("token_embd.weight");
    assert_eq!(emb.ty, GgmlType::Q8_0);
    assert_eq!(emb.dims, [576, 49152]);
    assert_eq!(g.tensor_data(emb).len() as u64, emb.n_bytes);

    // Every tensor's first row dequantizes to finite values.
    for t in g.tensors() {
        let row_len = t.row_len() as usize;
        let row_bytes = t.ty.row_bytes(t.row_len()).expect("validated shape") as usize;
        let mut row = vec![0.0f32; row_len];
        quant::dequantize_row(t.ty, &g.tensor_data(t)[..row_bytes], &mut row).expect("dequantize");
        assert!(row.iter().all(|v| v.is_finite()), "{}", t.name);
    }
}

//! `dgr synth --type q4_k_m` held against a Q4_K_M file llama.cpp's quantizer wrote: the same
//! shape as gemma-3-270m gives every tensor the name, shape and type the real file has.
#![cfg(feature = "real-model")]

mod common;

use dgr_gguf::Gguf;

#[test]
fn synth_q4_k_m_matches_gemma_3_270m() {
    let real = Gguf::open(&common::gemma3_model()).unwrap();
    let dir = std::env::temp_dir().join(format!("dgr-q4km-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gemma-shape.gguf");
    // The vocabulary only adds rows, which no rule looks at: a small one keeps this quick.
    let args = ["synth", "--arch", "gemma3", "--layers", "18", "--hidden", "640", "--ffn", "2048", "--heads", "4"];
    let out = common::dgr()
        .args(args)
        .args(["--kv-heads", "1", "--head-dim", "256", "--vocab", "512", "--type", "q4_k_m", "--out"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "dgr synth failed: {}", String::from_utf8_lossy(&out.stderr));
    let synth = Gguf::open(&path);
    let _ = std::fs::remove_dir_all(&dir);
    let synth = synth.unwrap();
    assert_eq!(synth.get_u64("general.file_type").unwrap(), real.get_u64("general.file_type").unwrap());
    let mut real_t: Vec<_> = real.tensors().iter().map(|t| (t.name.clone(), t.ty, t.dims[0])).collect();
    let mut synth_t: Vec<_> = synth.tensors().iter().map(|t| (t.name.clone(), t.ty, t.dims[0])).collect();
    real_t.sort_by(|a, b| a.0.cmp(&b.0));
    synth_t.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(synth_t, real_t);
}

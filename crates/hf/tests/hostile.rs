//! Malformed checkpoints are typed errors: truncated safetensors, header lengths past the file,
//! headers that are not what they claim, shapes that disagree with the config, missing and
//! unknown tensors, shards outside the directory, configs with absurd sizes; no panic, and
//! nothing allocated from a claimed size before it is checked.

mod common;

use common::{write_checkpoint, TempDir};
use dgr_engine::synth::SynthSpec;
use dgr_gguf::{GgmlType, Gguf};
use dgr_hf::{Checkpoint, HfError};
use serde_json::{json, Value};
use std::path::Path;

/// A valid llama checkpoint in F32 (2 layers: small, so every byte can be tried).
fn valid(tag: &str) -> TempDir {
    let spec = SynthSpec { ty: GgmlType::F32, layers: 2, hidden: 32, ffn: 64, heads: 2, kv_heads: 1, ..SynthSpec::default() };
    let g = Gguf::from_bytes(spec.to_gguf().unwrap()).unwrap();
    let dir = TempDir::new(tag);
    write_checkpoint(&g, "llama", &dir.0, false);
    dir
}

fn open(dir: &Path) -> Result<Checkpoint, HfError> {
    Checkpoint::open(dir, &|_| true)
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("config.json");
    let mut c: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut c);
    std::fs::write(p, serde_json::to_vec(&c).unwrap()).unwrap();
}

#[test]
fn a_valid_checkpoint_opens() {
    let d = valid("ok");
    let ck = open(&d.0).unwrap();
    assert_eq!((ck.config.n_layers, ck.config.hidden), (2, 32));
    assert!(dgr_hf::identity(&d.0).unwrap().id.len() == 64);
}

#[test]
fn every_truncation_of_the_weights_is_a_typed_error() {
    let d = valid("trunc");
    let path = d.0.join("model.safetensors");
    let whole = std::fs::read(&path).unwrap();
    // Every length up to well past the header, then a spread over the data.
    let n = u64::from_le_bytes(whole[..8].try_into().unwrap()) as usize;
    let lengths = (0..n + 64).chain((n + 64..whole.len()).step_by(97));
    for len in lengths {
        std::fs::write(&path, &whole[..len]).unwrap();
        match open(&d.0) {
            Err(HfError::BadHeader { .. }) => {}
            other => panic!("{len} of {} bytes: {:?}", whole.len(), other.map(|_| "opened")),
        }
    }
}

#[test]
fn header_lengths_past_the_file_and_garbage_headers_are_refused() {
    let d = valid("header");
    let path = d.0.join("model.safetensors");
    let whole = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(whole[..8].try_into().unwrap());
    for claimed in [n + 1, whole.len() as u64, u64::MAX, 1 << 40, 0] {
        let mut bytes = whole.clone();
        bytes[..8].copy_from_slice(&claimed.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(open(&d.0), Err(HfError::BadHeader { .. })), "header length {claimed}");
    }
    // Byte flips anywhere in the header: an error or (a flip in a name's digit, say) a model;
    // never a panic.
    let mut errors = 0;
    for i in (8..8 + n as usize).step_by(3) {
        let mut bytes = whole.clone();
        bytes[i] ^= 0x5a;
        std::fs::write(&path, &bytes).unwrap();
        errors += open(&d.0).is_err() as usize;
    }
    assert!(errors > 0);
    // Offsets that overlap or leave gaps, and a size that disagrees with dtype and shape.
    let header: Value = serde_json::from_slice(&whole[8..8 + n as usize]).unwrap();
    let data = &whole[8 + n as usize..];
    let first = header.as_object().unwrap().keys().find(|k| *k != "__metadata__").unwrap().clone();
    for (field, v) in [("data_offsets", json!([0, 4])), ("data_offsets", json!([8, 4])), ("shape", json!([3, 3])), ("dtype", json!("F64"))]
    {
        let mut h = header.clone();
        h[&first][field] = v;
        let text = serde_json::to_vec(&h).unwrap();
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&text);
        bytes.extend_from_slice(data);
        std::fs::write(&path, &bytes).unwrap();
        assert!(open(&d.0).is_err(), "{field} of {first} changed");
    }
}

#[test]
fn shapes_missing_and_unknown_tensors_are_named() {
    let d = valid("shapes");
    edit_config(&d.0, |c| c["intermediate_size"] = json!(96));
    assert!(matches!(open(&d.0), Err(HfError::BadShape { name, .. }) if name.contains("mlp")));

    let d = valid("missing");
    edit_config(&d.0, |c| c["num_hidden_layers"] = json!(3));
    assert!(matches!(open(&d.0), Err(HfError::MissingTensor(name)) if name.starts_with("model.layers.2.")));

    let d = valid("unknown");
    edit_config(&d.0, |c| c["num_hidden_layers"] = json!(1));
    assert!(matches!(open(&d.0), Err(HfError::UnexpectedTensor(name)) if name.starts_with("model.layers.1.")));

    let d = valid("untied");
    edit_config(&d.0, |c| c["tie_word_embeddings"] = json!(false));
    assert!(matches!(open(&d.0), Err(HfError::MissingTensor(name)) if name == "lm_head.weight"));
}

#[test]
fn absurd_or_unsupported_configs_are_refused_before_anything_is_read() {
    let cases: [(&str, Value); 9] = [
        ("hidden_size", json!(1u64 << 40)),
        ("num_hidden_layers", json!(0)),
        ("num_key_value_heads", json!(3)),
        ("vocab_size", json!(u64::MAX)),
        ("head_dim", json!(7)),
        ("model_type", json!("gpt2")),
        ("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0})),
        ("rms_norm_eps", json!(-1.0)),
        ("hidden_act", json!("relu")),
    ];
    for (key, v) in cases {
        let d = valid("config");
        edit_config(&d.0, |c| c[key] = v.clone());
        match open(&d.0) {
            Err(HfError::BadConfig(_) | HfError::UnsupportedModel(_)) => {}
            other => panic!("{key} = {v}: {:?}", other.map(|_| "opened")),
        }
    }
    let d = valid("json");
    std::fs::write(d.0.join("config.json"), b"{\"model_type\": \"llama\", \"hidden_size\": ").unwrap();
    assert!(matches!(open(&d.0), Err(HfError::Json { .. })));
}

#[test]
fn an_index_naming_files_outside_the_directory_or_tensors_elsewhere_is_refused() {
    let d = valid("index");
    for file in ["../model.safetensors", "/etc/passwd", "..", ""] {
        let index = json!({ "weight_map": { "model.embed_tokens.weight": file } });
        std::fs::write(d.0.join("model.safetensors.index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
        assert!(matches!(open(&d.0), Err(HfError::BadHeader { .. })), "{file:?}");
    }
    let index = json!({ "weight_map": { "model.layers.9.mlp.up_proj.weight": "model.safetensors" } });
    std::fs::write(d.0.join("model.safetensors.index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    assert!(matches!(open(&d.0), Err(HfError::BadHeader { .. })));
}

#[test]
fn tensor_hashes_are_cached_beside_each_shard_until_it_changes() {
    let d = valid("cache");
    let path = d.0.join("model.safetensors");
    let first = dgr_hf::identity(&d.0).unwrap().id;
    assert!(d.0.join("model.safetensors.dgr-hashes").is_file());
    // A byte altered under the same length and modification time: the cache answers (no tensor
    // byte is read again), so the identity stays.
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let touch = |t| std::fs::File::options().write(true).open(&path).unwrap().set_modified(t).unwrap();
    touch(mtime);
    assert_eq!(dgr_hf::identity(&d.0).unwrap().id, first);
    // Modified later: hashed again, and the altered byte shows.
    touch(mtime + std::time::Duration::from_secs(1));
    assert_ne!(dgr_hf::identity(&d.0).unwrap().id, first);
}

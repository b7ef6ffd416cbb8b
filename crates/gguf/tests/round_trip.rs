mod common;

use common::XorShift;
use dgr_gguf::{quant, GgmlType, Gguf, GgufError, GgufWriter, Value};

fn every_kind_of_value() -> Vec<(String, Value)> {
    let strings = Value::Array(vec![Value::String("<s>".into()), Value::String("héllo".into()), Value::String(String::new())]);
    let nested = Value::Array(vec![
        Value::Array(vec![Value::I32(-1), Value::I32(2)]),
        Value::Array(vec![]),
        Value::Array(vec![Value::I32(i32::MIN)]),
    ]);
    [
        ("general.architecture", Value::String("llama".into())),
        ("u8", Value::U8(200)),
        ("i8", Value::I8(-100)),
        ("u16", Value::U16(60000)),
        ("i16", Value::I16(-30000)),
        ("u32", Value::U32(4_000_000_000)),
        ("i32", Value::I32(-2_000_000_000)),
        ("u64", Value::U64(u64::MAX)),
        ("i64", Value::I64(i64::MIN)),
        ("f32", Value::F32(1.5e-5)),
        ("f64", Value::F64(-2.25e100)),
        ("bool.t", Value::Bool(true)),
        ("bool.f", Value::Bool(false)),
        ("tokens", strings),
        ("ints", Value::Array(vec![Value::I32(1), Value::I32(-2), Value::I32(3)])),
        ("floats", Value::Array(vec![Value::F32(0.5), Value::F32(-0.25)])),
        ("nested", nested),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

#[test]
fn metadata_and_tensors_survive_a_round_trip() {
    let mut rng = XorShift(0x1234_5678);
    let mut w = GgufWriter::new();
    let meta = every_kind_of_value();
    for (k, v) in &meta {
        w.add_metadata(k, v.clone()).unwrap();
    }
    let x: Vec<f32> = (0..512).map(|_| rng.signed_unit()).collect();
    let mut tensors: Vec<(&str, GgmlType, Vec<u64>, Vec<u8>)> = Vec::new();
    for (name, ty, dims) in [
        ("a.f32", GgmlType::F32, vec![8, 2]),
        ("b.f16", GgmlType::F16, vec![5]),
        ("c.q4_1", GgmlType::Q4_1, vec![64, 2, 2]),
        ("d.q8_0", GgmlType::Q8_0, vec![32, 3, 1, 2]),
        ("e.q6_k", GgmlType::Q6_K, vec![256]),
        ("f.bf16", GgmlType::BF16, vec![7, 3]),
    ] {
        let n: u64 = dims.iter().product();
        let mut data = Vec::new();
        quant::quantize_row(ty, &x[..n as usize], &mut data).expect("quantize");
        tensors.push((name, ty, dims, data));
    }
    for (name, ty, dims, data) in &tensors {
        w.add_tensor(name, *ty, dims, data.clone()).expect("add tensor");
    }

    let bytes = w.to_bytes();
    let g = Gguf::from_bytes(bytes.clone()).expect("parse");
    assert_eq!(g.version(), 3);
    assert_eq!(g.alignment(), 32);
    assert_eq!(g.data_offset() % 32, 0);
    assert_eq!(g.metadata(), &meta[..]);
    assert_eq!(g.file_bytes(), &bytes[..]);
    assert_eq!(g.tensors().len(), tensors.len());
    for ((name, ty, dims, data), info) in tensors.iter().zip(g.tensors()) {
        assert_eq!((info.name.as_str(), info.ty, &info.dims), (*name, *ty, dims));
        assert_eq!(info.offset % 32, 0);
        assert_eq!(g.tensor_data(info), &data[..]);
        assert_eq!(g.tensor(name).map(|t| t.offset), Some(info.offset));
    }
    assert!(g.tensor("missing").is_none());

    // The same bytes through the mmap path.
    let path = std::env::temp_dir().join(format!("dgr-gguf-round-trip-{}.gguf", std::process::id()));
    w.write_to_path(&path).expect("write");
    let mapped = Gguf::open(&path);
    let _ = std::fs::remove_file(&path);
    let mapped = mapped.expect("open");
    assert_eq!(mapped.metadata(), g.metadata());
    assert_eq!(mapped.tensor_data(&mapped.tensors()[2]), g.tensor_data(&g.tensors()[2]));
}

#[test]
fn typed_getters_name_the_key() {
    let mut w = GgufWriter::new();
    for (k, v) in every_kind_of_value() {
        w.add_metadata(&k, v).unwrap();
    }
    let g = Gguf::from_bytes(w.to_bytes()).expect("parse");
    assert_eq!(g.get_u64("u32").ok(), Some(4_000_000_000));
    assert_eq!(g.get_u64("u8").ok(), Some(200));
    assert_eq!(g.get_f32("f32").ok(), Some(1.5e-5));
    assert_eq!(g.get_f32("i16").ok(), Some(-30000.0));
    assert_eq!(g.get_str("general.architecture").ok(), Some("llama"));
    assert_eq!(g.get("bool.t").and_then(Value::as_bool), Some(true));
    assert!(matches!(g.get_u64("nope"), Err(GgufError::MissingKey { key }) if key == "nope"));
    assert!(matches!(g.get_u64("i8"), Err(GgufError::WrongType { key, found: "i8", .. }) if key == "i8"));
    assert!(matches!(g.get_str("u8"), Err(GgufError::WrongType { found: "u8", .. })));
    assert!(matches!(g.get_f32("tokens"), Err(GgufError::WrongType { found: "array", .. })));
}

#[test]
fn version_2_and_custom_alignment_are_read() {
    let mut w = GgufWriter::new();
    w.set_version(2);
    w.add_metadata("general.alignment", Value::U32(64)).unwrap();
    w.add_tensor("a", GgmlType::F32, &[3], vec![0; 12]).expect("a");
    w.add_tensor("b", GgmlType::F32, &[5], vec![7; 20]).expect("b");
    let g = Gguf::from_bytes(w.to_bytes()).expect("parse");
    assert_eq!((g.version(), g.alignment()), (2, 64));
    assert_eq!(g.data_offset() % 64, 0);
    assert_eq!(g.tensor("b").map(|t| t.offset), Some(64));
    assert_eq!(g.tensor("b").map(|t| g.tensor_data(t)), Some(&[7u8; 20][..]));
}

#[test]
fn empty_file_without_tensors_is_valid() {
    let g = Gguf::from_bytes(GgufWriter::new().to_bytes()).expect("parse");
    assert!(g.metadata().is_empty() && g.tensors().is_empty());
}

#[test]
fn writer_rejects_bad_tensors_and_replaces_keys() {
    let mut w = GgufWriter::new();
    assert!(matches!(
        w.add_tensor("t", GgmlType::Q4_0, &[32], vec![0; 17]),
        Err(GgufError::LengthMismatch { expected: 18, found: 17, .. })
    ));
    assert!(matches!(w.add_tensor("t", GgmlType::Q4_0, &[16], vec![]), Err(GgufError::RowNotBlockMultiple { .. })));
    w.add_tensor("t", GgmlType::F32, &[1], vec![0; 4]).expect("t");
    assert!(matches!(w.add_tensor("t", GgmlType::F32, &[1], vec![0; 4]), Err(GgufError::DuplicateTensor { .. })));
    w.add_metadata("k", Value::U8(1)).unwrap();
    w.add_metadata("k", Value::U8(2)).unwrap();
    let g = Gguf::from_bytes(w.to_bytes()).expect("parse");
    assert_eq!(g.metadata(), &[("k".to_owned(), Value::U8(2))]);
}

#[test]
fn writer_refuses_mixed_arrays() {
    let e = GgufWriter::new().add_metadata("k", Value::Array(vec![Value::U8(1), Value::I8(1)])).unwrap_err();
    assert!(matches!(e, dgr_gguf::GgufError::MixedArray { ref key } if key == "k"), "{e}");
}

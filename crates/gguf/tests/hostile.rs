//! Malformed and adversarial files: each must fail with its specific error, quickly, without
//! panicking or allocating in proportion to a claimed count.
mod common;

use common::{llama, small_file, Raw, TempDir, XorShift};
use dgr_gguf::{identity, write_slice, Gguf, GgufError, GgufWriter, Value};
use std::time::{Duration, Instant};

fn parse(bytes: Vec<u8>) -> Result<Gguf, GgufError> {
    Gguf::from_bytes(bytes)
}

/// A malformed file and a check that its error is the expected one.
type Case = (Vec<u8>, fn(&GgufError) -> bool);

const F32: u32 = 0;
const Q4_0: u32 = 2;

#[test]
fn every_truncated_prefix_is_rejected() {
    let file = small_file();
    assert!(parse(file.clone()).is_ok());
    for len in 0..file.len() {
        assert!(parse(file[..len].to_vec()).is_err(), "prefix of {len} bytes parsed");
    }
}

/// Parses `rounds` copies of `file`, each with 1 to 4 bytes replaced (at positions below
/// `within`, or anywhere for half of them), and hands each accepted one to `accepted`; returns
/// how many were accepted.
fn mutations(file: &[u8], within: usize, seed: u64, rounds: usize, mut accepted: impl FnMut(Gguf)) -> usize {
    let mut rng = XorShift(seed);
    let interesting = [0x00, 0x01, 0x7F, 0x80, 0xFF, b'\t', b','];
    let mut n = 0;
    for _ in 0..rounds {
        let mut bytes = file.to_vec();
        let span = if rng.below(2) == 0 { within } else { bytes.len() };
        for _ in 0..1 + rng.below(4) {
            let i = rng.below(span);
            bytes[i] = if rng.below(2) == 0 { interesting[rng.below(interesting.len())] } else { rng.next_u64() as u8 };
        }
        if let Ok(g) = parse(bytes) {
            n += 1;
            for t in g.tensors() {
                assert_eq!(g.tensor_data(t).len() as u64, t.n_bytes);
                assert!(g.model_has_tensor(&t.name));
                assert_eq!(g.model_tensor_dims(&t.name), Some(t.dims.as_slice()));
            }
            accepted(g);
        }
    }
    n
}

#[test]
fn random_mutations_never_panic() {
    let file = small_file();
    // Flips inside tensor data leave the file valid, so some must be accepted.
    assert!(mutations(&file, file.len(), 0x9E37_79B9_7F4A_7C15, 5000, |_| {}) > 0);
}

#[test]
fn random_mutations_of_a_slice_never_panic() {
    let dir = TempDir::new("hostile-slice");
    let path = dir.file("m.gguf", &llama(false, 9).to_bytes());
    let g = Gguf::open(&path).expect("open");
    let id = identity(&path, &g).expect("identity");
    let out = dir.path("s.gguf");
    write_slice(&g, &id, 1, 3, &out).expect("slice");
    let file = std::fs::read(&out).expect("read");
    let header = Gguf::from_bytes(file.clone()).expect("parse").data_offset() as usize;
    let mut checked = 0;
    let accepted = mutations(&file, header, 0x05EE_D0F5_11CE, 5000, |g| {
        // Hash some of them: a changed tensor is named, never a panic.
        if checked < 40 {
            checked += 1;
            let p = dir.file(&format!("mutated-{checked}.gguf"), g.file_bytes());
            match identity(&p, &g) {
                Ok(got) => assert_eq!(got.tensors.len(), id.tensors.len()),
                Err(e) => assert!(matches!(e, GgufError::TensorHashMismatch { .. }), "{e:?}"),
            }
        }
    });
    assert!(accepted > 0);
}

#[test]
fn bad_magic_and_versions() {
    let mut file = small_file();
    file[0] = b'X';
    assert!(matches!(parse(file), Err(GgufError::BadMagic { .. })));
    for version in [0, 1, 4, 0x0300_0000] {
        let r = Raw::header(version, 0, 0).0;
        assert!(matches!(parse(r), Err(GgufError::UnsupportedVersion { version: v }) if v == version));
    }
}

#[test]
fn huge_counts_fail_fast() {
    let start = Instant::now();
    let cases: [(Vec<u8>, &str); 7] = [
        (Raw::header(3, u64::MAX, 0).0, "tensor count"),
        (Raw::header(3, 1 << 61, 0).0, "tensor count"),
        (Raw::header(3, 0, u64::MAX).0, "metadata count"),
        (Raw::header(3, 0, 1).u64(u64::MAX).u64(0).0.clone(), "metadata key"),
        (Raw::header(3, 0, 1).str("k").u32(8).u64(u64::MAX).0.clone(), "metadata string"),
        (Raw::header(3, 0, 1).str("k").u32(9).u32(8).u64(u64::MAX).0.clone(), "array length"),
        // 2^61 strings of at least 8 bytes each: the product overflows u64.
        (Raw::header(3, 0, 1).str("k").u32(9).u32(8).u64(1 << 61).0.clone(), "array length"),
    ];
    for (bytes, want) in cases {
        match parse(bytes) {
            Err(GgufError::CountTooLarge { field, .. }) => assert_eq!(field, want),
            other => panic!("{want}: got {other:?}"),
        }
    }
    // A count that fits in bytes but not in elements: 16 u32s need 64 bytes, only 60 follow.
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(9).u32(4).u64(16);
    r.0.extend_from_slice(&[0; 60]);
    assert!(matches!(parse(r.0), Err(GgufError::CountTooLarge { field: "array length", count: 16, remaining: 60, .. })));
    assert!(start.elapsed() < Duration::from_secs(1));
}

#[test]
fn bad_metadata_values() {
    let unknown = Raw::header(3, 0, 1).str("k").u32(13).u32(0).0.clone();
    assert!(matches!(parse(unknown), Err(GgufError::UnknownValueType { id: 13, offset: 33, .. })));
    let unknown_elem = Raw::header(3, 0, 1).str("k").u32(9).u32(99).u64(0).0.clone();
    assert!(matches!(parse(unknown_elem), Err(GgufError::UnknownValueType { id: 99, offset: 37, .. })));
    let bad_bool = Raw::header(3, 0, 1).str("k").u32(7).u8(2).0.clone();
    assert!(matches!(parse(bad_bool), Err(GgufError::InvalidBool { value: 2, .. })));
    let mut bad_utf8 = Raw::header(3, 0, 1);
    bad_utf8.u64(2).u8(0xC3).u8(0x28).u32(0).u8(0);
    assert!(matches!(parse(bad_utf8.0), Err(GgufError::InvalidUtf8 { field: "metadata key", offset: 24 })));
    let dup = Raw::header(3, 0, 2).str("k").u32(0).u8(1).str("k").u32(0).u8(2).0.clone();
    assert!(matches!(parse(dup), Err(GgufError::DuplicateKey { offset: 38, .. })));
}

#[test]
fn nesting_is_bounded() {
    let mut deep = Value::U8(1);
    for _ in 0..5 {
        deep = Value::Array(vec![deep]);
    }
    let mut w = GgufWriter::new();
    w.add_metadata("deep", deep).unwrap();
    assert!(matches!(parse(w.to_bytes()), Err(GgufError::ArrayTooDeep { max: 4, .. })));

    // A million levels of "array of arrays" must stop at the limit, not overflow the stack.
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(9);
    for _ in 0..1_000_000 {
        r.u32(9).u64(1);
    }
    assert!(matches!(parse(r.0), Err(GgufError::ArrayTooDeep { .. })));
}

#[test]
fn bad_alignment_values() {
    for value in [Value::U32(0), Value::U32(3), Value::U64(32), Value::String("32".into())] {
        let mut w = GgufWriter::new();
        w.add_metadata("general.alignment", value.clone()).unwrap();
        assert!(matches!(parse(w.to_bytes()), Err(GgufError::InvalidAlignment { .. })), "{value:?}");
    }
}

#[test]
fn bad_tensor_infos() {
    let cases: Vec<Case> = vec![
        (Raw::header(3, 1, 0).tensor("t", &[], F32, 0).data(4), |e| matches!(e, GgufError::InvalidDimCount { n_dims: 0, .. })),
        (Raw::header(3, 1, 0).tensor("t", &[1; 5], F32, 0).data(4), |e| {
            matches!(e, GgufError::InvalidDimCount { n_dims: 5, offset: Some(24), .. })
        }),
        (Raw::header(3, 1, 0).tensor("t", &[4, 0], F32, 0).data(16), |e| matches!(e, GgufError::ZeroDim { index: 1, .. })),
        (Raw::header(3, 1, 0).tensor("t", &[4], 99, 0).data(16), |e| matches!(e, GgufError::UnknownTensorType { id: 99, .. })),
        (Raw::header(3, 1, 0).tensor("t", &[1 << 32, 1 << 32], F32, 0).data(16), |e| matches!(e, GgufError::ShapeOverflow { .. })),
        (Raw::header(3, 1, 0).tensor("t", &[1 << 62], F32, 0).data(16), |e| matches!(e, GgufError::ShapeOverflow { .. })),
        (Raw::header(3, 1, 0).tensor("t", &[48], Q4_0, 0).data(64), |e| {
            matches!(e, GgufError::RowNotBlockMultiple { row_len: 48, block_size: 32, .. })
        }),
        (Raw::header(3, 1, 0).tensor("t", &[4], F32, 16).data(64), |e| {
            matches!(e, GgufError::MisalignedOffset { data_offset: 16, alignment: 32, .. })
        }),
        (Raw::header(3, 1, 0).tensor("t", &[4], F32, 0).data(15), |e| matches!(e, GgufError::TensorOutOfBounds { n_bytes: 16, .. })),
        (Raw::header(3, 1, 0).tensor("t", &[4], F32, u64::MAX - 31).data(16), |e| matches!(e, GgufError::TensorOutOfBounds { .. })),
        (Raw::header(3, 2, 0).tensor("t", &[4], F32, 0).tensor("t", &[4], F32, 32).data(48), |e| {
            matches!(e, GgufError::DuplicateTensor { offset: Some(57), .. })
        }),
        (
            Raw::header(3, 2, 0).tensor("a", &[16], F32, 32).tensor("b", &[16], F32, 0).data(96),
            |e| matches!(e, GgufError::TensorOverlap { first, second } if first == "b" && second == "a"),
        ),
        (Raw::header(3, 2, 0).tensor("a", &[4], F32, 0).tensor("b", &[4], F32, 0).data(16), |e| {
            matches!(e, GgufError::TensorOverlap { .. })
        }),
    ];
    for (i, (bytes, want)) in cases.into_iter().enumerate() {
        match parse(bytes) {
            Err(e) if want(&e) => {}
            other => panic!("case {i}: unexpected {other:?}"),
        }
    }
    // Adjacent (touching) tensors are fine.
    let ok = Raw::header(3, 2, 0).tensor("a", &[8], F32, 0).tensor("b", &[8], F32, 32).data(64);
    assert!(parse(ok).is_ok());
}

#[test]
fn errors_render_field_and_offset() {
    let msg = parse(Raw::header(3, 0, 1).str("k").u32(13).0.clone()).err().map(|e| e.to_string());
    assert_eq!(msg.as_deref(), Some("metadata key \"k\": unknown value type id 13 at offset 33"));
    let msg = parse(b"GGUF\x03\0\0".to_vec()).err().map(|e| e.to_string());
    assert_eq!(msg.as_deref(), Some("file truncated in version at offset 4: need 4 bytes, 3 left"));
}

#[test]
fn open_reports_io_and_empty_files() {
    let missing = std::env::temp_dir().join("dgr-gguf-definitely-missing.gguf");
    assert!(matches!(Gguf::open(&missing), Err(GgufError::Io { .. })));
    let empty = std::env::temp_dir().join(format!("dgr-gguf-empty-{}.gguf", std::process::id()));
    std::fs::write(&empty, b"").expect("write");
    let r = Gguf::open(&empty);
    let _ = std::fs::remove_file(&empty);
    assert!(matches!(r, Err(GgufError::Truncated { field: "magic", offset: 0, .. })), "{r:?}");
}

//! Slices: files with some layers of a model and the whole model's identity.
mod common;

use common::{llama, TempDir, N_LAYERS};
use dgr_gguf::{identity, needed_by_stage, write_slice, Gguf, GgufError, GgufWriter, ModelIdentity, SliceInfo, SliceLayout, Value};
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// A whole model on disk, opened, and its identity.
fn whole(dir: &TempDir, tied: bool, seed: u64) -> (PathBuf, Gguf, ModelIdentity) {
    let path = dir.file(&format!("whole-{tied}-{seed}.gguf"), &llama(tied, seed).to_bytes());
    let g = Gguf::open(&path).expect("open");
    let id = identity(&path, &g).expect("identity");
    (path, g, id)
}

fn slice(dir: &TempDir, g: &Gguf, id: &ModelIdentity, start: u32, end: u32, name: &str) -> PathBuf {
    let out = dir.path(name);
    write_slice(g, id, start, end, &out).expect("write slice");
    out
}

fn needed(id: &ModelIdentity, start: u32, end: u32) -> Vec<String> {
    let tied = id.get("output.weight").is_none();
    id.tensors.iter().filter(|t| needed_by_stage(&t.name, start, end, N_LAYERS, tied)).map(|t| t.name.clone()).collect()
}

fn no_temp_files(dir: &Path) {
    let left: Vec<_> =
        std::fs::read_dir(dir).expect("read dir").flatten().filter(|e| e.file_name().to_string_lossy().contains(".tmp")).collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn every_cut_holds_its_tensors_and_the_whole_models_identity() {
    let dir = TempDir::new("slice-cuts");
    for tied in [false, true] {
        let (_, g, id) = whole(&dir, tied, 10 + u64::from(tied));
        assert!(g.slice().is_none());
        for cuts in [&[0, 4][..], &[0, 2, 4], &[0, 1, 3, 4], &[0, 3, 4], &[0, 1, 2, 3, 4]] {
            let mut covered = std::collections::HashSet::new();
            for pair in cuts.windows(2) {
                let (start, end) = (pair[0], pair[1]);
                let path = slice(&dir, &g, &id, start, end, &format!("s-{tied}-{start}-{end}.gguf"));
                let s = Gguf::open(&path).expect("open slice");
                assert_eq!(s.slice(), Some(&SliceInfo { layer_start: start, layer_end: end }));
                let names: Vec<String> = s.tensors().iter().map(|t| t.name.clone()).collect();
                assert_eq!(names, needed(&id, start, end), "{tied} [{start}, {end})");
                for t in s.tensors() {
                    let src = g.tensor(&t.name).expect("source tensor");
                    assert_eq!((t.ty, &t.dims), (src.ty, &src.dims));
                    assert_eq!(s.tensor_data(t), g.tensor_data(src), "{}", t.name);
                    covered.insert(t.name.clone());
                }
                assert_eq!(identity(&path, &s).expect("slice identity"), id, "{tied} [{start}, {end})");
                assert_eq!(identity(&path, &s).expect("cached slice identity"), id);
                for t in &id.tensors {
                    assert_eq!(s.model_tensor_dims(&t.name), Some(t.dims.as_slice()));
                    assert!(s.model_has_tensor(&t.name));
                }
                assert!(!s.model_has_tensor("blk.4.attn_q.weight"));
                assert_eq!(s.model_has_tensor("output.weight"), !tied);
                // The slice's metadata is the model's, then the slice's three keys.
                let n = g.metadata().len();
                assert_eq!(&s.metadata()[..n], g.metadata());
                assert_eq!(s.metadata().len(), n + 3);
            }
            assert_eq!(covered.len(), id.tensors.len(), "cuts {cuts:?} cover the model");
        }
    }
    no_temp_files(&dir.0);
}

#[test]
fn slicing_a_slice_gives_the_bytes_of_slicing_the_whole() {
    let dir = TempDir::new("slice-of-slice");
    for tied in [false, true] {
        let (_, g, id) = whole(&dir, tied, 20);
        let mid = slice(&dir, &g, &id, 1, 4, &format!("mid-{tied}.gguf"));
        let m = Gguf::open(&mid).expect("open");
        for (start, end) in [(1, 4), (1, 2), (2, 3), (3, 4), (2, 4)] {
            let direct = slice(&dir, &g, &id, start, end, &format!("direct-{tied}-{start}-{end}.gguf"));
            let again = slice(&dir, &m, &id, start, end, &format!("again-{tied}-{start}-{end}.gguf"));
            assert_eq!(std::fs::read(&direct).expect("read"), std::fs::read(&again).expect("read"), "{tied} [{start}, {end})");
        }
        for (start, end) in [(0, 2), (0, 4), (2, 2)] {
            let e = write_slice(&m, &id, start, end, &dir.path("bad.gguf"));
            assert!(matches!(e, Err(GgufError::BadLayerRange { lo: 1, hi: 4, .. })), "{e:?}");
        }
        assert!(!dir.path("bad.gguf").exists());
    }
}

#[test]
fn the_layout_plans_the_written_bytes() {
    let dir = TempDir::new("slice-layout");
    let (_, g, id) = whole(&dir, false, 30);
    for (start, end) in [(0, 1), (1, 3), (3, 4), (0, 4)] {
        let layout = SliceLayout::new(g.metadata(), &id, start, end).expect("layout");
        let written = std::fs::read(slice(&dir, &g, &id, start, end, &format!("l-{start}-{end}.gguf"))).expect("read");
        // A fetcher: the header, then each tensor's bytes at its offset.
        let mut fetched = layout.header.clone();
        fetched.resize(layout.file_len as usize, 0);
        for (name, offset, n) in &layout.tensors {
            let src = g.tensor_data(g.tensor(name).expect("tensor"));
            assert_eq!(src.len() as u64, *n);
            fetched[*offset as usize..(*offset + *n) as usize].copy_from_slice(src);
        }
        assert_eq!(fetched, written);
        let s = Gguf::from_bytes(written).expect("parse");
        assert_eq!(layout.header.len() as u64, s.data_offset());
        let held: Vec<(String, u64, u64)> = s.tensors().iter().map(|t| (t.name.clone(), s.data_offset() + t.offset, t.n_bytes)).collect();
        assert_eq!(held, layout.tensors);
    }
    // The layout of a slice's own metadata is the same plan.
    let s = Gguf::open(&slice(&dir, &g, &id, 1, 3, "s.gguf")).expect("open");
    assert_eq!(
        SliceLayout::new(s.metadata(), &id, 2, 3).expect("layout").header,
        SliceLayout::new(g.metadata(), &id, 2, 3).expect("layout").header
    );
}

#[test]
fn layouts_refuse_bad_ranges_and_missing_keys() {
    let dir = TempDir::new("slice-layout-bad");
    let (_, g, id) = whole(&dir, false, 40);
    for (start, end) in [(0, 0), (2, 1), (0, 5), (4, 5), (u32::MAX, u32::MAX)] {
        let e = SliceLayout::new(g.metadata(), &id, start, end).err();
        assert!(matches!(e, Some(GgufError::BadLayerRange { lo: 0, hi: 4, .. })), "[{start}, {end}): {e:?}");
    }
    let without = |key: &str| g.metadata().iter().filter(|(k, _)| k != key).cloned().collect::<Vec<_>>();
    for key in ["general.architecture", "llama.block_count"] {
        let e = SliceLayout::new(&without(key), &id, 0, 1).err();
        assert!(matches!(&e, Some(GgufError::MissingKey { key: k }) if k == key), "{e:?}");
    }
    let mut meta = g.metadata().to_vec();
    meta.push(("mixed".into(), Value::Array(vec![Value::U8(1), Value::I8(1)])));
    assert!(matches!(SliceLayout::new(&meta, &id, 0, 1), Err(GgufError::MixedArray { .. })));
    let mut meta = g.metadata().to_vec();
    meta.push(("general.alignment".into(), Value::U32(3)));
    assert!(matches!(SliceLayout::new(&meta, &id, 0, 1), Err(GgufError::InvalidAlignment { .. })));
    let mut tab = id.clone();
    tab.tensors[0].name = "token\tembd".into();
    assert!(matches!(SliceLayout::new(g.metadata(), &tab, 0, 1), Err(GgufError::BadSliceTable { index: 0, .. })));
}

#[test]
fn custom_alignment_carries_into_slices() {
    let dir = TempDir::new("slice-align");
    let mut w = llama(false, 45);
    w.add_metadata("general.alignment", Value::U32(256)).unwrap();
    let path = dir.file("a.gguf", &w.to_bytes());
    let g = Gguf::open(&path).expect("open");
    let id = identity(&path, &g).expect("identity");
    let s = slice(&dir, &g, &id, 1, 3, "s.gguf");
    let s_g = Gguf::open(&s).expect("open slice");
    assert_eq!(s_g.alignment(), 256);
    assert!(s_g.tensors().iter().all(|t| t.offset % 256 == 0));
    assert_eq!(identity(&s, &s_g).expect("identity"), id);
}

#[test]
fn a_flipped_byte_in_a_slice_is_named() {
    let dir = TempDir::new("slice-flip");
    let (_, g, id) = whole(&dir, false, 50);
    let path = slice(&dir, &g, &id, 1, 3, "s.gguf");
    let s = Gguf::open(&path).expect("open");
    let t = s.tensor("blk.2.attn_q.weight").expect("tensor");
    let at = s.data_offset() + t.offset + 3;
    drop(s);
    let f = OpenOptions::new().read(true).write(true).open(&path).expect("open rw");
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).expect("read");
    f.write_all_at(&[b[0] ^ 0x40], at).expect("write");
    drop(f);
    let s = Gguf::open(&path).expect("still a valid file");
    for _ in 0..2 {
        let e = identity(&path, &s);
        assert!(matches!(&e, Err(GgufError::TensorHashMismatch { tensor }) if tensor == "blk.2.attn_q.weight"), "{e:?}");
    }
    // Slicing it again checks the bytes it copies.
    let e = write_slice(&s, &id, 2, 3, &dir.path("again.gguf"));
    assert!(matches!(&e, Err(GgufError::TensorHashMismatch { tensor }) if tensor == "blk.2.attn_q.weight"), "{e:?}");
    assert!(!dir.path("again.gguf").exists());
    no_temp_files(&dir.0);
}

#[test]
fn write_slice_needs_the_tensors_mapped_and_their_hashes() {
    let dir = TempDir::new("slice-mapped");
    let (path, g, id) = whole(&dir, true, 60);
    let mut h = Gguf::read_header(&path).expect("header");
    let e = write_slice(&h, &id, 0, 2, &dir.path("x.gguf"));
    assert!(matches!(&e, Err(GgufError::TensorNotMapped { tensor }) if tensor == "token_embd.weight"), "{e:?}");
    h.map_tensors(|t| t.name.starts_with("blk.0.")).expect("map");
    let e = write_slice(&h, &id, 0, 2, &dir.path("x.gguf"));
    assert!(matches!(&e, Err(GgufError::TensorNotMapped { tensor }) if tensor == "token_embd.weight"), "{e:?}");
    let tied = id.get("output.weight").is_none();
    h.map_tensors(|t| needed_by_stage(&t.name, 0, 2, N_LAYERS, tied)).expect("map");
    let from_part = slice(&dir, &h, &id, 0, 2, "part.gguf");
    let from_whole = slice(&dir, &g, &id, 0, 2, "whole.gguf");
    assert_eq!(std::fs::read(from_part).expect("read"), std::fs::read(from_whole).expect("read"));

    // A table whose hash or shape is not the file's is refused, and nothing is written.
    let mut wrong = id.clone();
    wrong.tensors.iter_mut().find(|t| t.name == "blk.1.ffn_up.weight").expect("tensor").sha256[0] ^= 1;
    let e = write_slice(&g, &wrong, 0, 2, &dir.path("y.gguf"));
    assert!(matches!(&e, Err(GgufError::TensorHashMismatch { tensor }) if tensor == "blk.1.ffn_up.weight"), "{e:?}");
    let mut wrong = id.clone();
    wrong.tensors.iter_mut().find(|t| t.name == "blk.1.ffn_up.weight").expect("tensor").dims = vec![64, 32];
    let e = write_slice(&g, &wrong, 0, 2, &dir.path("y.gguf"));
    assert!(matches!(&e, Err(GgufError::SliceTensorMismatch { tensor, .. }) if tensor == "blk.1.ffn_up.weight"), "{e:?}");
    assert!(!dir.path("y.gguf").exists());
    no_temp_files(&dir.0);
}

/// The slice's file, its metadata edited, written again with the same tensors.
fn rebuild(s: &Gguf, edit: impl FnOnce(&mut Vec<(String, Value)>)) -> Vec<u8> {
    let mut meta = s.metadata().to_vec();
    edit(&mut meta);
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        w.add_metadata(&k, v).unwrap();
    }
    for t in s.tensors() {
        w.add_tensor(&t.name, t.ty, &t.dims, s.tensor_data(t).to_vec()).expect("tensor");
    }
    w.to_bytes()
}

fn set(meta: &mut [(String, Value)], key: &str, value: Value) {
    meta.iter_mut().find(|(k, _)| k == key).expect("key").1 = value;
}

fn entries(meta: &mut [(String, Value)]) -> &mut Vec<Value> {
    match &mut meta.iter_mut().find(|(k, _)| k == "dgr.slice.tensors").expect("table").1 {
        Value::Array(a) => a,
        other => panic!("{other:?}"),
    }
}

type Edit = Box<dyn FnOnce(&mut Vec<(String, Value)>)>;
type Check = fn(&GgufError) -> bool;

#[test]
fn hostile_slice_tables_are_typed_errors() {
    let dir = TempDir::new("slice-hostile");
    let (_, g, id) = whole(&dir, false, 70);
    let path = slice(&dir, &g, &id, 0, 2, "s.gguf");
    let s = Gguf::open(&path).expect("open");
    let hex = "ab".repeat(32);
    let q_index = id.tensors.iter().position(|t| t.name == "blk.0.attn_q.weight").expect("index");
    let entry = |i: usize, text: String| -> Edit { Box::new(move |m| entries(m)[i] = Value::String(text)) };
    let cases: Vec<(&str, Edit, Check)> = vec![
        ("missing fields", entry(3, "blk.0.x\t0".into()), |e| matches!(e, GgufError::BadSliceTable { index: 3, .. })),
        ("bad hex", entry(4, format!("x\t0\t4\t{}", "zz".repeat(32))), |e| matches!(e, GgufError::BadSliceTable { index: 4, .. })),
        ("short hex", entry(4, "x\t0\t4\tabcd".into()), |e| matches!(e, GgufError::BadSliceTable { index: 4, .. })),
        ("huge dims count", entry(5, format!("x\t0\t{}1\t{hex}", "1,".repeat(100_000))), |e| {
            matches!(e, GgufError::BadSliceTable { index: 5, .. })
        }),
        ("unknown type", entry(6, format!("x\t99\t4\t{hex}")), |e| matches!(e, GgufError::BadSliceTable { index: 6, .. })),
        ("type overflow", entry(6, format!("x\t99999999999999999999\t4\t{hex}")), |e| {
            matches!(e, GgufError::BadSliceTable { index: 6, .. })
        }),
        ("zero dim", entry(7, format!("x\t0\t4,0\t{hex}")), |e| matches!(e, GgufError::BadSliceTable { index: 7, .. })),
        ("partial block", entry(7, format!("x\t2\t16\t{hex}")), |e| matches!(e, GgufError::BadSliceTable { index: 7, .. })),
        ("duplicate", entry(8, format!("token_embd.weight\t0\t32,16\t{hex}")), |e| matches!(e, GgufError::BadSliceTable { index: 8, .. })),
        ("non-string array", Box::new(|m| set(m, "dgr.slice.tensors", Value::Array(vec![Value::U32(1); 3]))), |e| {
            matches!(e, GgufError::BadSliceTable { index: 0, .. })
        }),
        (
            "not an array",
            Box::new(|m| set(m, "dgr.slice.tensors", Value::String("x".into()))),
            |e| matches!(e, GgufError::WrongType { key, .. } if key == "dgr.slice.tensors"),
        ),
        ("end before start", Box::new(|m| set(m, "dgr.slice.layer_start", Value::U32(3))), |e| {
            matches!(e, GgufError::BadLayerRange { start: 3, end: 2, .. })
        }),
        ("empty range", Box::new(|m| set(m, "dgr.slice.layer_start", Value::U32(2))), |e| matches!(e, GgufError::BadLayerRange { .. })),
        ("beyond block_count", Box::new(|m| set(m, "dgr.slice.layer_end", Value::U32(5))), |e| {
            matches!(e, GgufError::BadLayerRange { end: 5, hi: 4, .. })
        }),
        ("fewer blocks", Box::new(|m| set(m, "llama.block_count", Value::U32(1))), |e| matches!(e, GgufError::BadLayerRange { hi: 1, .. })),
        (
            "wrong key type",
            Box::new(|m| set(m, "dgr.slice.layer_start", Value::U64(0))),
            |e| matches!(e, GgufError::WrongType { key, .. } if key == "dgr.slice.layer_start"),
        ),
        (
            "missing key",
            Box::new(|m| m.retain(|(k, _)| k != "dgr.slice.layer_end")),
            |e| matches!(e, GgufError::MissingKey { key } if key == "dgr.slice.layer_end"),
        ),
        ("missing block_count", Box::new(|m| m.retain(|(k, _)| k != "llama.block_count")), |e| matches!(e, GgufError::MissingKey { .. })),
        ("only a stray key", Box::new(|m| m.retain(|(k, _)| !k.starts_with("dgr.slice.layer"))), |e| {
            matches!(e, GgufError::MissingKey { .. })
        }),
        (
            "held tensor not listed",
            Box::new(move |m| {
                entries(m).remove(q_index);
            }),
            |e| matches!(e, GgufError::SliceTensorMismatch { tensor, .. } if tensor == "blk.0.attn_q.weight"),
        ),
        (
            "held tensor of another shape",
            entry(q_index, format!("blk.0.attn_q.weight\t3\t32,64\t{hex}")),
            |e| matches!(e, GgufError::SliceTensorMismatch { tensor, .. } if tensor == "blk.0.attn_q.weight"),
        ),
        ("empty table", Box::new(|m| entries(m).clear()), |e| matches!(e, GgufError::SliceTensorMismatch { .. })),
    ];
    for (i, (what, edit, check)) in cases.into_iter().enumerate() {
        let bytes = rebuild(&s, edit);
        match Gguf::from_bytes(bytes.clone()) {
            Err(e) if check(&e) => {}
            other => panic!("{what}: {other:?}"),
        }
        // The same from a header read.
        let p = dir.file(&format!("hostile-{i}.gguf"), &bytes);
        match Gguf::read_header(&p) {
            Err(e) if check(&e) => {}
            other => panic!("{what} (read_header): {other:?}"),
        }
    }
    // The untouched rebuild is fine, and so is a name with odd characters but no tab.
    assert!(Gguf::from_bytes(rebuild(&s, |_| {})).is_ok());
    let odd = entry(25, format!("blk.9.ünïcode ,;\\n\t0\t4\t{hex}"));
    assert!(Gguf::from_bytes(rebuild(&s, odd)).is_ok());
}

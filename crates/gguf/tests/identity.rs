//! Model identities from tensor hashes, and their cache beside the file.
mod common;

use common::{llama, random_bytes, set_mode, TempDir, XorShift};
use dgr_gguf::{file_sha256, identity, Gguf, GgufWriter, ModelIdentity, TensorHash, Value};
use sha2::{Digest, Sha256};
use std::fs::{File, FileTimes, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

fn id_of(path: &Path) -> ModelIdentity {
    let g = Gguf::open(path).expect("open");
    identity(path, &g).expect("identity")
}

fn sidecar(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".dgr-hashes");
    s.into()
}

/// Overwrites bytes in place, keeping the file's modification time: only a read of the tensor
/// bytes could notice.
fn overwrite_keeping_mtime(path: &Path, at: u64, bytes: &[u8]) {
    let mtime = std::fs::metadata(path).and_then(|m| m.modified()).expect("mtime");
    let f = OpenOptions::new().write(true).open(path).expect("open for write");
    f.write_all_at(bytes, at).expect("overwrite");
    f.set_modified(mtime).expect("restore mtime");
}

fn set_mtime(path: &Path, t: SystemTime) {
    File::options().write(true).open(path).and_then(|f| f.set_times(FileTimes::new().set_modified(t))).expect("set mtime");
}

#[test]
fn identity_is_stable_and_ignores_the_file_name() {
    let dir = TempDir::new("id-stable");
    let bytes = llama(false, 1).to_bytes();
    let a = dir.file("a.gguf", &bytes);
    let b = dir.file("other name.gguf", &bytes);
    let id = id_of(&a);
    assert_eq!(id.id.len(), 64);
    assert!(id.id.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)), "{}", id.id);
    assert_eq!(id_of(&a), id, "cached");
    assert_eq!(id_of(&b), id, "another name");
    std::fs::remove_file(sidecar(&a)).expect("remove sidecar");
    assert_eq!(id_of(&a), id, "recomputed");
    assert_ne!(id.id, file_sha256(&a).expect("file hash"));
}

#[test]
fn identity_is_computed_from_the_tensor_hashes() {
    let dir = TempDir::new("id-compute");
    let path = dir.file("m.gguf", &llama(true, 2).to_bytes());
    let g = Gguf::open(&path).expect("open");
    let tensors: Vec<TensorHash> = g
        .tensors()
        .iter()
        .map(|t| TensorHash { name: t.name.clone(), ty: t.ty, dims: t.dims.clone(), sha256: Sha256::digest(g.tensor_data(t)).into() })
        .collect();
    let want = ModelIdentity::compute(g.metadata(), tensors.clone());
    assert_eq!(identity(&path, &g).expect("identity"), want);
    assert_eq!(want.get("blk.3.ffn_up.weight"), tensors.iter().find(|t| t.name == "blk.3.ffn_up.weight"));
    assert_eq!(want.get("output.weight"), None);

    // dgr.slice.* keys are left out; any other key counts, and so does the order.
    let mut meta = g.metadata().to_vec();
    meta.push(("dgr.slice.anything".into(), Value::U8(1)));
    assert_eq!(ModelIdentity::compute(&meta, tensors.clone()).id, want.id);
    meta.push(("dgr.slicex".into(), Value::U8(1)));
    assert_ne!(ModelIdentity::compute(&meta, tensors.clone()).id, want.id);
    let mut swapped = g.metadata().to_vec();
    swapped.swap(0, 1);
    assert_ne!(ModelIdentity::compute(&swapped, tensors.clone()).id, want.id);
    let mut renamed = tensors;
    renamed[0].name.push('x');
    assert_ne!(ModelIdentity::compute(g.metadata(), renamed).id, want.id);
}

#[test]
fn identity_changes_with_one_tensor_byte_or_one_metadata_value() {
    let dir = TempDir::new("id-changes");
    let bytes = llama(false, 3).to_bytes();
    let base = id_of(&dir.file("base.gguf", &bytes));

    let g = Gguf::from_bytes(bytes.clone()).expect("parse");
    let t = g.tensor("blk.2.ffn_down.weight").expect("tensor");
    let mut flipped = bytes.clone();
    flipped[(g.data_offset() + t.offset + 5) as usize] ^= 1;
    let changed = id_of(&dir.file("flipped.gguf", &flipped));
    assert_ne!(changed.id, base.id);
    let differ: Vec<&str> = base.tensors.iter().zip(&changed.tensors).filter(|(a, b)| a != b).map(|(a, _)| a.name.as_str()).collect();
    assert_eq!(differ, ["blk.2.ffn_down.weight"]);

    let mut w = llama(false, 3);
    w.add_metadata("llama.embedding_length", Value::U32(33)).unwrap();
    let meta = id_of(&dir.file("meta.gguf", &w.to_bytes()));
    assert_ne!(meta.id, base.id);
    assert_eq!(meta.tensors, base.tensors);
}

#[test]
fn a_cached_identity_reads_no_tensor_bytes_until_the_file_changes() {
    let dir = TempDir::new("id-cache");
    let path = dir.file("m.gguf", &llama(false, 4).to_bytes());
    let first = id_of(&path);
    assert!(sidecar(&path).is_file());

    // New tensor bytes under the old length and time: the cache answers, so none were read.
    let g = Gguf::open(&path).expect("open");
    let t = g.tensor("blk.0.attn_q.weight").expect("tensor");
    let at = g.data_offset() + t.offset;
    drop(g);
    overwrite_keeping_mtime(&path, at, &[0xAB; 16]);
    assert_eq!(id_of(&path), first);

    // A new modification time invalidates it.
    set_mtime(&path, SystemTime::now() + Duration::from_secs(10));
    let second = id_of(&path);
    assert_ne!(second.id, first.id);
    assert_eq!(id_of(&path), second);
}

#[test]
fn corrupt_sidecars_are_ignored_and_replaced() {
    let dir = TempDir::new("id-corrupt");
    let path = dir.file("m.gguf", &llama(true, 5).to_bytes());
    let want = id_of(&path);
    let good = std::fs::read(sidecar(&path)).expect("sidecar");
    let mut rng = XorShift(0xC0FF_EE00_1234_5678);

    let mut cases: Vec<Vec<u8>> = vec![Vec::new(), random_bytes(&mut rng, good.len()), random_bytes(&mut rng, 3 * good.len())];
    cases.extend((0..good.len()).step_by(7).map(|n| good[..n].to_vec()));
    let mut longer = good.clone();
    longer.push(0);
    cases.push(longer);
    for i in [0, 8, 12, 20, 36, good.len() - 40, good.len() - 1] {
        let mut flipped = good.clone();
        flipped[i] ^= 0x10;
        cases.push(flipped);
    }
    for _ in 0..50 {
        let mut mutated = good.clone();
        let i = rng.below(mutated.len());
        mutated[i] = rng.next_u64() as u8;
        cases.push(mutated);
    }
    for (i, bytes) in cases.iter().enumerate() {
        std::fs::write(sidecar(&path), bytes).expect("write sidecar");
        assert_eq!(id_of(&path), want, "case {i}");
        // Unchanged bytes mean a mutation that did nothing, or the recomputed cache.
        assert_eq!(std::fs::read(sidecar(&path)).expect("sidecar"), good, "case {i}");
    }

    // A cache of other bytes that is valid in itself is used only for its own file.
    let other = dir.file("other.gguf", &llama(true, 6).to_bytes());
    set_mtime(&other, SystemTime::now() + Duration::from_secs(100));
    let _ = id_of(&other);
    std::fs::copy(sidecar(&other), sidecar(&path)).expect("copy sidecar");
    assert_eq!(id_of(&path), want);
}

#[test]
fn an_unwritable_cache_location_still_gives_the_identity() {
    let dir = TempDir::new("id-unwritable");
    let bytes = llama(false, 7).to_bytes();

    // A directory where the sidecar would go: neither read nor replaced.
    let path = dir.file("m.gguf", &bytes);
    std::fs::create_dir(sidecar(&path)).expect("mkdir");
    let want = id_of(&path);
    assert_eq!(id_of(&path), want);
    assert!(sidecar(&path).is_dir());

    // A read-only directory (root may write to it anyway, which is fine too).
    let ro = dir.path("ro");
    std::fs::create_dir(&ro).expect("mkdir");
    let path = ro.join("m.gguf");
    std::fs::write(&path, &bytes).expect("write");
    set_mode(&ro, 0o555).expect("chmod");
    assert_eq!(id_of(&path), want);
    assert_eq!(id_of(&path), want);
    set_mode(&ro, 0o755).expect("chmod");
    let leftovers: Vec<_> =
        std::fs::read_dir(&ro).expect("read dir").flatten().filter(|e| e.file_name().to_string_lossy().contains(".tmp")).collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn identity_refuses_a_file_that_changed_length_since_it_was_opened() {
    let dir = TempDir::new("id-length");
    let path = dir.file("m.gguf", &llama(false, 8).to_bytes());
    let g = Gguf::open(&path).expect("open");
    let longer = [std::fs::read(&path).expect("read"), vec![0; 64]].concat();
    std::fs::write(&path, longer).expect("rewrite");
    assert!(matches!(identity(&path, &g), Err(dgr_gguf::GgufError::LengthMismatch { .. })));
}

#[test]
fn a_file_without_tensors_has_an_identity() {
    let dir = TempDir::new("id-empty");
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", Value::String("llama".into())).unwrap();
    let path = dir.file("e.gguf", &w.to_bytes());
    let id = id_of(&path);
    assert!(id.tensors.is_empty());
    assert_eq!(id, ModelIdentity::compute(Gguf::open(&path).expect("open").metadata(), Vec::new()));
}

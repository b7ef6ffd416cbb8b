//! Reading only the header, then mapping only the tensors a process keeps.
mod common;

use common::{llama, small_file, TempDir};
use dgr_gguf::{identity, GgmlType, Gguf, GgufWriter, Value};
use std::path::Path;

/// The mappings of `path` in this process: (start, end) addresses from /proc/self/maps.
fn mappings_of(path: &Path) -> Vec<(u64, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
    let want = path.to_str().expect("utf-8 path");
    maps.lines()
        .filter(|l| l.ends_with(want))
        .map(|l| {
            let (range, _) = l.split_once(' ').expect("range");
            let (a, b) = range.split_once('-').expect("range");
            (u64::from_str_radix(a, 16).expect("hex"), u64::from_str_radix(b, 16).expect("hex"))
        })
        .collect()
}

#[test]
fn a_header_read_maps_nothing_then_only_the_kept_tensors() {
    let dir = TempDir::new("partial-keep");
    let path = dir.file("m.gguf", &llama(false, 1).to_bytes());
    let whole = Gguf::open(&path).expect("open");
    let mut g = Gguf::read_header(&path).expect("header");
    assert_eq!(g.metadata(), whole.metadata());
    assert_eq!((g.version(), g.alignment(), g.data_offset()), (whole.version(), whole.alignment(), whole.data_offset()));
    assert_eq!(g.file_bytes(), &whole.file_bytes()[..whole.data_offset() as usize]);
    assert_eq!(g.tensors().len(), whole.tensors().len());
    assert!(g.tensors().iter().all(|t| !g.is_mapped(t) && g.tensor_data(t).is_empty()));
    assert!(mappings_of(&path).len() == 1, "only `whole` maps the file");

    let keep = |t: &dgr_gguf::TensorInfo| t.name.starts_with("blk.1.") || t.name.starts_with("blk.3.") || t.name == "token_embd.weight";
    g.map_tensors(keep).expect("map");
    for t in g.tensors() {
        assert_eq!(g.is_mapped(t), keep(t), "{}", t.name);
        let want = if keep(t) { whole.tensor_data(whole.tensor(&t.name).expect("tensor")) } else { &[][..] };
        assert_eq!(g.tensor_data(t), want, "{}", t.name);
    }
    // Three runs of adjacent kept tensors, three maps (plus the whole file's one).
    assert_eq!(mappings_of(&path).len(), 4);

    // Mapping again replaces what was mapped.
    g.map_tensors(|t| t.name.starts_with("blk.2.")).expect("map");
    assert!(g.tensors().iter().all(|t| g.is_mapped(t) == t.name.starts_with("blk.2.")));
    assert_eq!(mappings_of(&path).len(), 2);
    g.map_tensors(|_| false).expect("map");
    assert_eq!(mappings_of(&path).len(), 1);

    // A Gguf that holds the whole file is left as it is.
    let mut w = Gguf::open(&path).expect("open");
    w.map_tensors(|_| false).expect("no-op");
    assert!(w.tensors().iter().all(|t| w.is_mapped(t)));
}

#[test]
fn the_address_space_holds_the_kept_bytes_and_little_else() {
    let dir = TempDir::new("partial-size");
    // Big enough tensors that the 64 KiB rounding of a map's start is small beside them.
    let mut w = GgufWriter::new();
    for i in 0..6 {
        w.add_tensor(&format!("t{i}"), GgmlType::F32, &[1 << 16], vec![i as u8; 1 << 18]).expect("tensor");
    }
    let path = dir.file("big.gguf", &w.to_bytes());
    let mut g = Gguf::read_header(&path).expect("header");
    g.map_tensors(|t| t.name == "t1" || t.name == "t2" || t.name == "t4").expect("map");
    let maps = mappings_of(&path);
    assert_eq!(maps.len(), 2, "{maps:?}");
    let mapped: u64 = maps.iter().map(|(a, b)| b - a).sum();
    let kept = 3 << 18;
    assert!(mapped >= kept && mapped <= kept + 2 * (64 << 10) + 2 * 4096, "{mapped} bytes mapped for {kept}");
    for t in g.tensors() {
        let n = t.name[1..].parse::<u8>().expect("index");
        let data = g.tensor_data(t);
        assert!(data.is_empty() || data.iter().all(|&b| b == n), "{}", t.name);
    }
}

#[test]
fn a_header_over_a_mebibyte_is_read() {
    let dir = TempDir::new("partial-big-header");
    let mut w = llama(true, 2);
    let words: Vec<Value> = (0..200_000).map(|i| Value::String(format!("word{i:08}"))).collect();
    w.add_metadata("tokenizer.ggml.tokens", Value::Array(words)).unwrap();
    let bytes = w.to_bytes();
    let path = dir.file("big.gguf", &bytes);
    let whole = Gguf::open(&path).expect("open");
    assert!(whole.data_offset() > 3 << 20, "header of {} bytes", whole.data_offset());
    let mut g = Gguf::read_header(&path).expect("header");
    assert_eq!(g.metadata(), whole.metadata());
    assert_eq!(g.file_bytes().len() as u64, whole.data_offset());
    g.map_tensors(|_| true).expect("map");
    for (a, b) in g.tensors().iter().zip(whole.tensors()) {
        assert_eq!(g.tensor_data(a), whole.tensor_data(b));
    }
    assert_eq!(identity(&path, &g).expect("identity"), identity(&path, &whole).expect("identity"));

    // Cut short inside the metadata, or inside the tensors: the errors a whole parse gives.
    for len in [(1 << 20) - 1, 1 << 20, (1 << 20) + 3, 2 << 20, (3 << 20) + 5, bytes.len() - 1] {
        let p = dir.file("cut.gguf", &bytes[..len]);
        let want = format!("{:?}", Gguf::from_bytes(bytes[..len].to_vec()).expect_err("truncated"));
        assert_eq!(format!("{:?}", Gguf::read_header(&p).expect_err("truncated")), want, "{len}");
    }
}

#[test]
fn truncated_files_fail_as_before() {
    let dir = TempDir::new("partial-truncated");
    let file = small_file();
    for len in 0..file.len() {
        let p = dir.file("cut.gguf", &file[..len]);
        let want = format!("{:?}", Gguf::from_bytes(file[..len].to_vec()).expect_err("truncated"));
        assert_eq!(format!("{:?}", Gguf::read_header(&p).expect_err("truncated")), want, "{len}");
    }
    let p = dir.file("ok.gguf", &file);
    assert!(Gguf::read_header(&p).is_ok());
    assert!(matches!(Gguf::read_header(&dir.path("missing.gguf")), Err(dgr_gguf::GgufError::Io { .. })));
}

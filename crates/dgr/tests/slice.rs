//! Slices of the real model: `dgr slice` cuts it in 2 and 3, workers serve the slices with
//! output bitwise equal to one process on the whole file, every slice carries the whole model's
//! identity, a slice with one altered byte is refused naming the tensor, and a worker started on
//! a file whose tensors were hashed before reads none of its tensor bytes.
#![cfg(feature = "real-model")]

mod common;
use common::*;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

const SPLITS: [&[usize]; 2] = [&[0, 15, 30], &[0, 10, 20, 30]];

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dgr-test-slice-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn slice(model: &Path, (a, b): (usize, usize), out: &Path) -> Value {
    let o = dgr().args(["slice", "--layers", &format!("{a}..{b}"), "--out"]).arg(out).arg("--model").arg(model).output().unwrap();
    assert!(o.status.success(), "dgr slice {a}..{b}: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn inspect(file: &Path) -> String {
    let o = dgr().arg("inspect").arg(file).output().unwrap();
    assert!(o.status.success(), "dgr inspect {}: {}", file.display(), String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn slices_in_2_and_3_serve_bitwise_like_the_whole_file_under_one_identity() {
    let _serial = serial();
    let dir = scratch("parity");
    let whole_id = dgr_gguf::model_identity(&model()).unwrap().id;
    assert!(inspect(&model()).contains(&format!("model: {whole_id} (the whole model)")));
    let file_len = std::fs::metadata(model()).unwrap().len();
    let args = ["--max-tokens", "12", "--ignore-eos", "--top-logprobs", "5"];
    let prompts = prompts();
    let want: Vec<Value> = prompts
        .iter()
        .take(3)
        .map(|p| {
            let mut a = vec!["--prompt", &p.text, "--threads", "1"];
            a.extend(args);
            generate_json(&a)
        })
        .collect();
    for cuts in SPLITS {
        let mut files = Vec::new();
        for r in cuts.windows(2) {
            let out = dir.join(format!("{}-{}.gguf", r[0], r[1]));
            let v = slice(&model(), (r[0], r[1]), &out);
            assert_eq!(v["model_id"], whole_id.as_str(), "the slice's identity: {v}");
            let bytes = std::fs::metadata(&out).unwrap().len();
            let shown = inspect(&out);
            assert!(shown.contains(&format!("slice: layers {}..{} of model {whole_id}", r[0], r[1])), "dgr inspect of a slice:\n{shown}");
            println!("{}: slice {}..{}: {bytes} bytes of the {file_len}-byte model", layers_of(cuts), r[0], r[1]);
            files.push(out);
        }
        let w = Workers::start_on(&files, cuts, 1, &[]);
        let route = w.route();
        for (p, want) in prompts.iter().zip(&want) {
            let mut a = vec!["--prompt", &p.text, "--route", &route];
            a.extend(args);
            assert_same_generation(&generate_json(&a), want, &format!("{} over slices {}", p.name, layers_of(cuts)));
        }
        // Mixed: a slice next to the whole file, and a sub-range of a slice.
        drop(w);
        let mixed = Workers::start_on(&[files[0].clone(), model()], &[0, cuts[1], 30], 1, &[]);
        let mixed_route = mixed.route();
        let mut a = vec!["--prompt", &prompts[0].text, "--route", &mixed_route];
        a.extend(args);
        assert_same_generation(&generate_json(&a), &want[0], "a slice next to the whole file");
    }
    // Slicing a slice gives the very bytes slicing the whole file does.
    let (outer, inner_a, inner_b) = (dir.join("outer.gguf"), dir.join("inner-a.gguf"), dir.join("inner-b.gguf"));
    slice(&model(), (5, 25), &outer);
    slice(&outer, (10, 20), &inner_a);
    slice(&model(), (10, 20), &inner_b);
    assert!(
        std::fs::read(&inner_a).unwrap() == std::fs::read(&inner_b).unwrap(),
        "a slice of a slice differs from the same slice of the whole"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_slice_with_one_altered_byte_is_refused_naming_the_tensor() {
    let _serial = serial();
    let dir = scratch("tamper");
    let out = dir.join("15-30.gguf");
    slice(&model(), (15, 30), &out);
    let g = dgr_gguf::Gguf::open(&out).unwrap();
    let t = g.tensor("blk.20.ffn_down.weight").expect("the slice holds layer 20");
    let at = g.data_offset() + t.offset + t.n_bytes / 2;
    drop(g);
    let mut bytes = std::fs::read(&out).unwrap();
    bytes[at as usize] ^= 1;
    std::fs::write(&out, bytes).unwrap();
    let o = dgr().args(["worker", "--layers", "15..30", "--listen", "127.0.0.1:0", "--model"]).arg(&out).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a tampered slice was served: {err}");
    assert!(err.contains("blk.20.ffn_down.weight"), "the error names the tensor: {err}");
    println!("refused: {}", err.trim());
    // A range the slice does not hold is refused too, saying what it holds.
    let o = dgr().args(["worker", "--layers", "0..30", "--listen", "127.0.0.1:0", "--model"]).arg(&out).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("holds layers 15..30"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bytes the process read with read(2) and friends (not through its memory maps).
fn rchar(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
    io.lines().find_map(|l| l.strip_prefix("rchar: ")).unwrap().trim().parse().unwrap()
}

#[test]
fn a_worker_on_an_already_hashed_file_reads_no_tensor_bytes() {
    let _serial = serial();
    let dir = scratch("rchar");
    let copy = dir.join("model.gguf");
    std::fs::copy(model(), &copy).unwrap();
    let g = dgr_gguf::Gguf::read_header(&copy).unwrap();
    let tensor_bytes: u64 = g.tensors().iter().map(|t| t.n_bytes).sum();
    drop(g);
    let start = |what: &str| {
        let w = Workers::start_on(std::slice::from_ref(&copy), &[0, 30], 1, &[]);
        let read = rchar(w.children[0].id());
        println!("{what}: the worker read {read} bytes with read(2); the file's tensors are {tensor_bytes} bytes");
        read
    };
    let first = start("first start (no hash table yet)");
    assert!(first >= tensor_bytes, "the first start hashes every tensor");
    let second = start("second start");
    assert!(second < tensor_bytes / 10, "a start on a hashed file read {second} bytes");
    // Changing the file (its modification time) makes the next start hash it again.
    let f = std::fs::File::options().write(true).open(&copy).unwrap();
    f.set_modified(std::time::SystemTime::now() + Duration::from_secs(5)).unwrap();
    drop(f);
    assert!(start("after touching the file") >= tensor_bytes);
    let _ = std::fs::remove_dir_all(&dir);
}

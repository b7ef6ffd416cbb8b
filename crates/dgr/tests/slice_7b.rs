//! A model no worker could map whole: a synthetic 7B-shaped llama (32 layers, hidden 4096, FFN
//! 11008, 32 heads, 8 KV heads, 32k vocabulary, Q4_1: about 3.7 GB) cut into three slices, each
//! served by a worker whose memory is capped below half the whole file: its address space in
//! exact numerics, its peak resident memory in fast (whose packed weights lie beside the map).
//! Tokens and logprobs equal one process on the whole file bitwise in each numerics; each
//! worker's disk use, VmSize, VmRSS and VmHWM are printed.
#![cfg(feature = "real-model")]

mod common;
use common::*;

use std::path::Path;
use std::process::Command;

const CUTS: [usize; 4] = [0, 11, 22, 32];

fn run(cmd: &mut Command, what: &str) -> String {
    let o = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(o.status.success(), "{what}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn status_kb(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn generate(model: &Path, extra: &[&str]) -> serde_json::Value {
    let mut cmd = dgr();
    cmd.args(["generate", "--format", "json", "--prompt", "Once upon a time", "--max-tokens", "4", "--ignore-eos", "--top-logprobs", "5"])
        .args(extra)
        .arg("--model")
        .arg(model);
    serde_json::from_str(&run(&mut cmd, "dgr generate")).unwrap()
}

#[test]
fn a_7b_shaped_model_runs_on_three_slices_under_a_memory_cap() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("dgr-test-7b-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let whole = dir.join("synth-7b.gguf");
    run(
        dgr()
            .args(["synth", "--layers", "32", "--hidden", "4096", "--ffn", "11008", "--heads", "32", "--kv-heads", "8"])
            .args(["--vocab", "32000", "--type", "q4_1", "--context", "4096", "-o"])
            .arg(&whole),
        "dgr synth",
    );
    let whole_len = std::fs::metadata(&whole).unwrap().len();
    let cap = whole_len / 2 - (64 << 20);
    println!("whole file: {whole_len} bytes; each worker capped at {cap} bytes");

    let mut slices = Vec::new();
    for r in CUTS.windows(2) {
        let out = dir.join(format!("slice-{}-{}.gguf", r[0], r[1]));
        run(dgr().args(["slice", "--layers", &format!("{}..{}", r[0], r[1]), "--out"]).arg(&out).arg("--model").arg(&whole), "dgr slice");
        slices.push(out);
    }
    // Exact numerics reads the weights from the map alone, so the cap is on address space. Fast
    // numerics (the default) holds its packed weights beside the map and lets the map's pages
    // go: its address space is about twice its slice, so the cap is on its peak resident memory.
    for numerics in ["exact", "fast"] {
        let want = generate(&whole, &["--threads", "2", "--numerics", numerics]);
        let as_limit = if numerics == "exact" { cap.to_string() } else { "unlimited".into() };
        // Three workers, started the way `Workers` starts them but via prlimit.
        let mut children = Vec::new();
        let mut addrs = Vec::new();
        for (r, slice) in CUTS.windows(2).zip(&slices) {
            let mut child = Command::new("prlimit")
                .arg(format!("--as={as_limit}"))
                .arg(env!("CARGO_BIN_EXE_dgr"))
                .args(["worker", "--listen", "127.0.0.1:0", "--threads", "2", "--numerics", numerics])
                .args(["--layers", &format!("{}..{}", r[0], r[1]), "--model"])
                .arg(slice)
                .env_remove("DGR_MODEL")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("prlimit");
            let mut line = String::new();
            std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
            let ready: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| {
                let mut err = String::new();
                let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err);
                panic!("{numerics}: worker {}..{} under the cap did not start ({e}): {err}", r[0], r[1])
            });
            addrs.push(ready["listening"].as_str().unwrap().to_string());
            children.push(KillOnDrop(child));
        }
        let got = generate(&whole, &["--route", &addrs.join(","), "--numerics", numerics]);
        for (i, (c, slice)) in children.iter().zip(&slices).enumerate() {
            let pid = c.0.id();
            let kb = |field| status_kb(pid, field) << 10;
            let (vm, rss, peak) = (kb("VmSize:"), kb("VmRSS:"), kb("VmHWM:"));
            let disk = std::fs::metadata(slice).unwrap().len();
            println!(
                "{numerics}: worker {i} (layers {}..{}): slice on disk {disk} bytes, VmSize {vm}, VmRSS {rss}, VmHWM {peak}",
                CUTS[i],
                CUTS[i + 1]
            );
            if numerics == "exact" {
                let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
                let line = limits.lines().find(|l| l.starts_with("Max address space")).unwrap();
                assert!(line.split_whitespace().any(|w| w == cap.to_string()), "worker {i} runs without the cap: {line}");
            } else {
                assert!(peak < cap, "fast: worker {i}'s peak resident memory {peak} is not under the cap {cap}");
            }
        }
        assert_same_generation(&got, &want, &format!("{numerics}: three slices under the cap against one process on the whole file"));
        println!("{numerics}: tokens {} equal bitwise, logprobs and top-5 included", got["tokens"]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

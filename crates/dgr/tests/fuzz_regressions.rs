//! The fuzz targets' inputs, replayed under `cargo test`: every seed, which must be accepted all
//! the way through so that the fuzzers start deep, and every input committed under
//! `tests/fuzz-regressions/<target>/` (what the fuzzers found, kept so it stays fixed). The
//! target bodies are the fuzzers' own (`fuzz/src/harness.rs`), so an input fails here exactly as
//! it failed under the fuzzer. `scripts/fuzz.sh` runs the fuzzers.

#[path = "../../../fuzz/src/harness.rs"]
mod harness;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

fn target(name: &str) -> harness::Target {
    harness::TARGETS.iter().find(|(t, _)| *t == name).map(|(_, run)| *run).unwrap_or_else(|| panic!("no target {name}"))
}

#[test]
fn every_seed_is_accepted() {
    let seeds = harness::seeds();
    for (name, _) in harness::TARGETS {
        assert!(seeds.iter().any(|(t, ..)| *t == name), "{name} has no seeds");
    }
    for (t, name, bytes) in &seeds {
        assert!(target(t)(bytes), "the seed {name} of {t} is not accepted all the way through");
    }
}

#[test]
fn regression_inputs_replay() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fuzz-regressions");
    let mut replayed = 0;
    for entry in std::fs::read_dir(&root).expect("tests/fuzz-regressions") {
        let dir = entry.expect("a directory entry").path();
        if !dir.is_dir() {
            continue;
        }
        let name = dir.file_name().and_then(|n| n.to_str()).expect("a target directory name").to_owned();
        let run = target(&name);
        let mut inputs: Vec<PathBuf> = std::fs::read_dir(&dir).expect("a target directory").map(|e| e.expect("an entry").path()).collect();
        inputs.sort();
        for input in inputs {
            let bytes = std::fs::read(&input).expect("a regression input");
            if catch_unwind(AssertUnwindSafe(|| run(&bytes))).is_err() {
                panic!("{} fails its target {name} again (the panic is above)", input.display());
            }
            replayed += 1;
        }
    }
    eprintln!("{replayed} regression inputs replayed");
}

//! Fetching a slice from the swarm (test builds: `--features fault-injection` compiles in a
//! holder that corrupts what it sends and a fetcher that stops halfway). A worker started with
//! an empty model directory gets its slice from the workers that hold it, byte for byte the slice
//! `dgr slice` writes, and serves it with output bitwise equal to one process; a holder sending
//! corrupted bytes is caught and the fetch completes from another; a stopped fetch resumes, asking
//! the next tracker when the first is down.
#![cfg(all(feature = "real-model", feature = "fault-injection"))]

mod common;

use common::swarm::{Tracker, Worker};
use common::{dgr, model, serial};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn sliced(dir: &Path, (a, b): (usize, usize)) -> Vec<u8> {
    let out = dir.join(format!("want-{a}-{b}.gguf"));
    let o = dgr().args(["slice", "--layers", &format!("{a}..{b}"), "--out"]).arg(&out).arg("--model").arg(model()).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::read(out).unwrap()
}

fn fetched(slices: &Path, id: &str, (a, b): (usize, usize)) -> PathBuf {
    slices.join(format!("{id}.{a}-{b}.gguf"))
}

fn fetcher(t: &Tracker, layers: (usize, usize), id: &str, slices: &Path, env: &[(&str, &str)]) -> Worker {
    let extra = ["--model-id", id, "--slice-dir", slices.to_str().unwrap()];
    Worker::start_on(t, layers, "fetcher", &extra, env, None)
}

#[test]
fn a_worker_without_the_file_fetches_its_slice_and_serves_it_bitwise() {
    let _g = serial();
    let t = Tracker::start("fetch", &[]);
    let id = dgr_gguf::model_identity(&model()).unwrap().id;
    let slices = t.dir.join("slices");
    let h0 = Worker::start(&t, (0, 15), "h0", &[]);
    let mut h1 = Worker::start(&t, (15, 30), "h1", &[]);
    t.wait_live(&[h0.id.as_str(), h1.id.as_str()], Duration::from_secs(5), "holders joined");
    let args = ["--prompt", "The capital of France is", "--max-tokens", "12", "--ignore-eos", "--top-logprobs", "5"];
    let want = common::generate_json(&[&args[..], &["--threads", "1"]].concat());

    let f = fetcher(&t, (10, 30), &id, &slices, &[]);
    println!("{}", f.log().trim());
    assert!(f.log().contains("fetched"), "{}", f.log());
    let got = std::fs::read(fetched(&slices, &id, (10, 30))).unwrap();
    assert!(got == sliced(&t.dir, (10, 30)), "the fetched slice differs from `dgr slice`'s");
    // With h1 gone, every route's layers 15..30 run on the fetched slice.
    h1.kill();
    t.wait_live(&[h0.id.as_str(), f.id.as_str()], Duration::from_secs(5), "h1 gone");
    let routed = t.generate(&args);
    common::assert_same_generation(&routed, &want, "a route through the fetched slice");
    assert!(t.workers().iter().any(|w| w["worker_id"] == f.id.as_str() && w["routes_total"].as_u64() > Some(0)));

    // A second start finds the slice in place and fetches nothing.
    drop(f);
    let again = fetcher(&t, (10, 30), &id, &slices, &[]);
    assert!(again.log().contains("already here"), "{}", again.log());
}

#[test]
fn a_holder_sending_corrupted_bytes_is_caught_and_the_fetch_completes_from_another() {
    let _g = serial();
    let t = Tracker::start("fetch-liar", &[]);
    let id = dgr_gguf::model_identity(&model()).unwrap().id;
    let slices = t.dir.join("slices");
    // The liar holds the most of the range, so it is asked first.
    let liar = Worker::start_with_env(&t, (0, 30), "liar", &[], &[("DGR_FAULT_CORRUPT_FETCH", "1")]);
    let honest = [Worker::start(&t, (0, 15), "h0", &[]), Worker::start(&t, (15, 30), "h1", &[])];
    t.wait_live(&[liar.id.as_str(), honest[0].id.as_str(), honest[1].id.as_str()], Duration::from_secs(5), "holders joined");
    let f = fetcher(&t, (0, 30), &id, &slices, &[]);
    println!("{}", f.log().trim());
    assert!(f.log().contains(&format!("caught 1 holder(s) sending corrupted bytes: {}", liar.id)), "{}", f.log());
    let got = std::fs::read(fetched(&slices, &id, (0, 30))).unwrap();
    assert!(got == sliced(&t.dir, (0, 30)), "the fetched slice differs from `dgr slice`'s");
}

#[test]
fn a_stopped_fetch_resumes_where_it_stopped() {
    let _g = serial();
    let t = Tracker::start("fetch-resume", &[]);
    let id = dgr_gguf::model_identity(&model()).unwrap().id;
    let slices = t.dir.join("slices");
    let h = Worker::start(&t, (0, 30), "h", &[]);
    t.wait_live(&[h.id.as_str()], Duration::from_secs(5), "holder joined");
    let o = dgr()
        .env("DGR_FAULT_FETCH_STOP_AFTER", "40")
        .args(["worker", "--threads", "1", "--layers", "0..30", "--listen", "127.0.0.1:0", "--tracker", &t.addr, "--join-token-file"])
        .arg(&t.token_file)
        .args(["--model-id", &id, "--slice-dir"])
        .arg(&slices)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("stopped after 40 tensors"), "{err}");
    assert!(!fetched(&slices, &id, (0, 30)).exists(), "an unfinished fetch is never under the final name");
    // The resuming worker is given a dead tracker first: the fetch asks the next one.
    let mut dead = Tracker::start("fetch-resume-dead", &[]);
    dead.kill();
    let extra = ["--model-id", id.as_str(), "--slice-dir", slices.to_str().unwrap()];
    let f = Worker::start_joined(&[&dead, &t], (0, 30), "fetcher", &extra, &[], None);
    println!("{}", f.log().trim());
    assert!(f.log().contains(&format!("asking {} who holds the model", dead.addr)), "{}", f.log());
    assert!(f.log().contains("; 40 tensors were already there from an interrupted fetch"), "{}", f.log());
    assert!(std::fs::read(fetched(&slices, &id, (0, 30))).unwrap() == sliced(&t.dir, (0, 30)));
}

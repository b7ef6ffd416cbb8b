//! The command line's contract, on the real model: what each subcommand prints, that it agrees
//! with the llama.cpp reference, that it is deterministic, and that bad input ends in a clean
//! error (non-zero exit, a message, no panic) rather than a crash or a hang.
#![cfg(feature = "real-model")]

mod common;
use common::*;

use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Held by every test: one dgr at a time. The engine's compute threads spin while they wait for
/// each other, so two multi-threaded dgr processes sharing few cores slow each other down by far
/// more than 2×; run alone, the whole file takes seconds.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A fresh directory under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let p = std::env::temp_dir().join(format!("dgr-cli-{}-{nanos}-{name}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        TempDir(p)
    }
    fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `cmd` to completion, failing the test if it takes longer than `limit`.
fn run_within(mut cmd: Command, limit: Duration) -> Output {
    let what = format!("{cmd:?}");
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawning dgr");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output { status, stdout: out.join().unwrap(), stderr: err.join().unwrap() }
}

/// Asserts that `cmd` failed cleanly and quickly: non-zero exit, a message on stderr, no panic.
/// Returns stderr.
fn expect_clean_failure(cmd: Command) -> String {
    let what = format!("{cmd:?}");
    let out = run_within(cmd, Duration::from_secs(20));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{what} succeeded; stdout: {}", String::from_utf8_lossy(&out.stdout));
    assert!(out.status.code().is_some(), "{what} was killed by a signal ({:?}); stderr: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{what} panicked: {stderr}");
    assert!(stderr.trim().len() > 5, "{what} failed without a message on stderr");
    stderr
}

/// `dgr generate --format json` on the default model.
fn generate(args: &[&str]) -> Value {
    let mut all = vec!["generate", "--format", "json"];
    all.extend_from_slice(args);
    dgr_json(&all)
}

fn tokenize(text: &str) -> Vec<u64> {
    ids(&dgr_json(&["tokenize", "--text", text])["tokens"])
}

fn synth(dir: &TempDir) -> PathBuf {
    let path = dir.path("synth.gguf");
    let out = dgr().args(["synth", "--out"]).arg(&path).output().expect("running dgr synth");
    assert!(out.status.success(), "dgr synth failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(path.exists(), "dgr synth wrote nothing at {}", path.display());
    path
}

fn tokens_str(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

#[test]
fn tokenize_prints_exactly_the_reference_tokens() {
    let _serial = serial();
    let model = model();
    let reference = reference("smollm2-q4_1-llamacpp.json");
    let cases = reference["tokenize"].as_array().unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let out = dgr().args(["tokenize", "--model"]).arg(&model).arg(format!("--text={text}")).output().unwrap();
        assert!(out.status.success(), "tokenize {text:?}: {}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).unwrap();
        let expected = format!("{{\"tokens\":[{}]}}", tokens_str(&ids(&case["tokens"])));
        assert_eq!(stdout.trim_end_matches('\n'), expected, "tokenize {text:?}");
    }
}

#[test]
fn generate_json_has_the_documented_fields() {
    let _serial = serial();
    let k = 3;
    let out = generate(&["--prompt", "Once upon a time", "--max-tokens", "5", "--ignore-eos", "--top-logprobs", "3", "--threads", "1"]);
    let tokens = ids(&out["tokens"]);
    assert!(!tokens.is_empty() && tokens.len() <= 5, "--max-tokens 5 gave {} tokens", tokens.len());
    assert!(!ids(&out["prompt_tokens"]).is_empty());
    assert!(out["text"].is_string(), "no text: {out}");

    let top = out["top_logprobs"].as_array().expect("top_logprobs is a list");
    assert_eq!(top.len(), tokens.len(), "one top_logprobs entry per generated token");
    for (i, (step, &token)) in top.iter().zip(&tokens).enumerate() {
        let step = step.as_array().unwrap();
        assert_eq!(step.len(), k, "step {i}: --top-logprobs {k} gave {} entries", step.len());
        let lps: Vec<f64> = step
            .iter()
            .map(|e| {
                let e = e.as_array().unwrap();
                assert_eq!(e.len(), 2, "step {i}: entries are [id, logprob]");
                assert!(e[0].is_u64(), "step {i}: id {} is not a token id", e[0]);
                e[1].as_f64().unwrap()
            })
            .collect();
        assert!(lps.iter().all(|&lp| lp <= 0.0), "step {i}: positive logprob in {lps:?}");
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "step {i}: not sorted descending: {lps:?}");
        // greedy by default: the chosen token is the most likely one
        assert_eq!(step[0][0].as_u64(), Some(token), "step {i}: greedy token is not the top-1");
    }

    let timings = &out["timings"];
    for field in ["prefill_tok_per_s", "decode_tok_per_s", "ttft_ms"] {
        let v = timings[field].as_f64().unwrap_or_else(|| panic!("timings.{field} missing or not a number: {timings}"));
        assert!(v > 0.0 && v.is_finite(), "timings.{field} = {v}");
    }
}

#[test]
fn max_tokens_bounds_the_generated_count() {
    let _serial = serial();
    for n in [1usize, 4] {
        let out = generate(&["--prompt", "The capital of France is", "--max-tokens", &n.to_string(), "--ignore-eos", "--threads", "1"]);
        assert_eq!(ids(&out["tokens"]).len(), n, "--max-tokens {n} --ignore-eos");
    }
    let out = generate(&["--prompt", "The capital of France is", "--max-tokens", "3", "--threads", "1"]);
    assert!(ids(&out["tokens"]).len() <= 3);
    let mut cmd = dgr();
    cmd.args(["generate", "--prompt", "x", "--max-tokens", "0", "--model"]).arg(model());
    expect_clean_failure(cmd);
}

#[test]
fn greedy_generation_follows_llama_cpp_up_to_a_near_tie() {
    let _serial = serial();
    let llama = reference("smollm2-q4_1-llamacpp.json");
    let exact = reference("smollm2-q4_1-exact.json");
    for c in llama["completions"].as_array().unwrap() {
        let name = c["name"].as_str().unwrap();
        let out = generate(&[
            "--prompt",
            c["prompt"].as_str().unwrap(),
            "--temperature",
            "0",
            "--ignore-eos",
            "--max-tokens",
            "32",
            "--threads",
            "1",
        ]);
        assert_eq!(ids(&out["prompt_tokens"]), ids(&c["prompt_tokens"]), "{name}: prompt tokens differ from llama.cpp's");
        let ours = ids(&out["tokens"]);
        let theirs = ids(&c["greedy_tokens"]);
        assert_eq!(ours.len(), 32, "{name}: --ignore-eos --max-tokens 32 gave {} tokens", ours.len());
        match ours.iter().zip(&theirs).position(|(a, b)| a != b) {
            None => println!("{name:>8}: all {} greedy tokens agree with llama.cpp", theirs.len().min(32)),
            Some(i) => {
                let e = exact["completions"].as_array().unwrap().iter().find(|e| e["name"] == c["name"]).expect("exact reference");
                let top = e["steps"][i]["top"].as_array().unwrap();
                let margin = top[0][1].as_f64().unwrap() - top[1][1].as_f64().unwrap();
                println!(
                    "{name:>8}: diverged from llama.cpp at step {i} (dgr {}, llama.cpp {}); exact top-1 {} top-2 {} margin {margin:.4}",
                    ours[i], theirs[i], top[0][0], top[1][0]
                );
                assert!(margin < 0.3, "{name}: greedy diverged at step {i} although the exact margin is {margin}");
            }
        }
    }
}

#[test]
fn thread_count_does_not_change_the_output() {
    let _serial = serial();
    let run = |threads: &str| {
        let out = generate(&[
            "--prompt",
            "def fibonacci(n):\n    ",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--top-logprobs",
            "5",
            "--threads",
            threads,
        ]);
        (out["tokens"].to_string(), out["top_logprobs"].to_string(), out["logprobs"].to_string())
    };
    let one = run("1");
    let two = run("2");
    assert_eq!(one.0, two.0, "tokens differ between --threads 1 and 2");
    assert_eq!(one.1, two.1, "top_logprobs differ between --threads 1 and 2");
    assert_eq!(one.2, two.2, "logprobs differ between --threads 1 and 2");
}

#[test]
fn seeded_sampling_is_reproducible() {
    let _serial = serial();
    let run = |seed: &str| {
        ids(&generate(&[
            "--prompt",
            "Once upon a time",
            "--temperature",
            "0.8",
            "--seed",
            seed,
            "--max-tokens",
            "32",
            "--ignore-eos",
            "--threads",
            "1",
        ])["tokens"])
    };
    let a = run("7");
    let b = run("7");
    assert_eq!(a.len(), 32);
    assert_eq!(a, b, "the same seed gave different tokens");
    let c = run("8");
    assert_ne!(a, c, "seeds 7 and 8 gave the same 32 sampled tokens");
}

#[test]
fn chat_renders_the_template() {
    let _serial = serial();
    let im_start = tokenize("<|im_start|>");
    assert_eq!(im_start.len(), 1, "<|im_start|> is one special token, got {im_start:?}");
    let llama = reference("smollm2-q4_1-llamacpp.json");
    let chat = llama["completions"].as_array().unwrap().iter().find(|c| c["name"] == "chat").expect("chat reference");
    // The reference's prompt is the user turn and the generation prompt rendered by hand.
    let user = "What is the tallest mountain in the world?";
    assert!(chat["prompt"].as_str().unwrap().contains(user));
    let out = generate(&["--chat", "--prompt", user, "--max-tokens", "1", "--threads", "1"]);
    let prompt = ids(&out["prompt_tokens"]);
    assert_eq!(prompt.first(), Some(&im_start[0]), "--chat prompt does not start with <|im_start|>: {prompt:?}");
    let turn = ids(&chat["prompt_tokens"]);
    assert!(prompt.ends_with(&turn), "--chat prompt {prompt:?} does not end with the user turn and generation prompt {turn:?}");
    // without --chat the prompt is taken as is
    let plain = generate(&["--prompt", user, "--max-tokens", "1", "--threads", "1"]);
    assert_eq!(ids(&plain["prompt_tokens"]), tokenize(user));
}

#[test]
fn score_reports_one_step_per_continuation_token() {
    let _serial = serial();
    let cont = [28u64, 260, 2240];
    let out = dgr_json(&[
        "score",
        "--prompt",
        "Once upon a time",
        "--continuation",
        &tokens_str(&cont),
        "--format",
        "json",
        "--top-logprobs",
        "4",
        "--threads",
        "1",
    ]);
    assert_eq!(ids(&out["prompt_tokens"]), vec![6403, 1980, 253, 655]);
    let steps = out["steps"].as_array().unwrap();
    assert_eq!(steps.len(), cont.len());
    for (i, (s, &t)) in steps.iter().zip(&cont).enumerate() {
        assert_eq!(s["token"].as_u64(), Some(t), "step {i}");
        let lp = s["logprob"].as_f64().unwrap_or_else(|| panic!("step {i}: logprob {}", s["logprob"]));
        assert!(lp <= 0.0 && lp.is_finite(), "step {i}: logprob {lp}");
        let top = s["top"].as_array().unwrap();
        assert_eq!(top.len(), 4, "step {i}");
        assert!(top[0][1].as_f64().unwrap() >= lp, "step {i}: top-1 below the token's own logprob");
    }
}

#[test]
fn score_rejects_bad_continuations_cleanly() {
    let _serial = serial();
    for bad in ["1,x", "", "-1", "49152", "5,99999999"] {
        let mut cmd = dgr();
        cmd.args(["score", "--prompt", "Once upon a time", "--format", "json", "--model"])
            .arg(model())
            .arg(format!("--continuation={bad}"));
        let err = expect_clean_failure(cmd);
        println!("--continuation {bad:?}: {}", err.trim());
    }
}

#[test]
fn inspect_describes_the_model() {
    let _serial = serial();
    let out = run_within(
        {
            let mut c = dgr();
            c.arg("inspect").arg(model());
            c
        },
        Duration::from_secs(20),
    );
    assert!(out.status.success(), "inspect: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("architecture: llama"), "no llama architecture in:\n{text}");
    assert!(text.contains("engines: gguf-cpu-fast"), "no engine in:\n{text}");
    assert!(text.contains("layers 30"), "not 30 layers:\n{text}");
    for ty in ["Q4_1", "Q8_0", "F32"] {
        assert!(text.lines().any(|l| l.split_whitespace().next() == Some(ty)), "tensor type {ty} not listed:\n{text}");
    }
}

#[test]
fn synth_writes_a_model_the_cli_accepts() {
    let _serial = serial();
    let dir = TempDir::new("synth");
    let path = synth(&dir);
    let out = dgr().arg("inspect").arg(&path).output().unwrap();
    assert!(out.status.success(), "inspect of a synth model: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("architecture: llama"));
    let out = dgr()
        .args(["generate", "--prompt", "abc", "--max-tokens", "4", "--threads", "1", "--format", "json", "--model"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "generate on a synth model: {}", String::from_utf8_lossy(&out.stderr));
    let json: Value = serde_json::from_slice(&out.stdout).expect("generate printed JSON");
    let n = ids(&json["tokens"]).len();
    assert!((1..=4).contains(&n), "{n} tokens from --max-tokens 4");
}

#[test]
fn hostile_model_files_fail_cleanly() {
    let _serial = serial();
    let dir = TempDir::new("hostile");
    let good = std::fs::read(synth(&dir)).unwrap();
    let mut files: Vec<(&str, PathBuf)> = Vec::new();
    let mut write = |name: &'static str, bytes: &[u8]| {
        let p = dir.path(name);
        std::fs::write(&p, bytes).unwrap();
        files.push((name, p));
    };
    write("truncated-half", &good[..good.len() / 2]);
    write("truncated-header", &good[..100]);
    write("truncated-last-byte", &good[..good.len() - 1]);
    // deterministic pseudo-random bytes (xorshift)
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let random: Vec<u8> = (0..64 * 1024)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    write("random", &random);
    let mut random_gguf = b"GGUF".to_vec();
    random_gguf.extend_from_slice(&random);
    write("random-after-magic", &random_gguf);
    write("empty", b"");
    files.push(("nonexistent", dir.path("no-such-model.gguf")));

    for (name, path) in &files {
        let runs: [(&str, Vec<&str>); 3] = [
            ("generate", vec!["generate", "--prompt", "abc", "--max-tokens", "2", "--format", "json"]),
            ("tokenize", vec!["tokenize", "--text", "abc"]),
            ("inspect", vec!["inspect"]),
        ];
        for (sub, args) in runs {
            let mut cmd = dgr();
            cmd.args(&args);
            if sub == "inspect" {
                cmd.arg(path);
            } else {
                cmd.arg("--model").arg(path);
            }
            let err = expect_clean_failure(cmd);
            println!("{name} / {sub}: {}", err.trim());
        }
    }
}

#[test]
fn a_missing_default_model_points_at_the_fetch_script() {
    let _serial = serial();
    let dir = TempDir::new("no-model");
    let mut cmd = dgr();
    cmd.args(["generate", "--prompt", "x"]).env("DGR_MODEL_DIR", &dir.0);
    let err = expect_clean_failure(cmd);
    assert!(err.contains("scripts/fetch-model.sh"), "the message does not mention scripts/fetch-model.sh: {err}");
    assert!(Path::new(&dir.0).read_dir().unwrap().next().is_none(), "dgr wrote into the empty model dir");
}

/// An unknown numerics or KV dtype is refused by the argument parser with the list of the known
/// ones; every known one runs.
/// Without --layers a worker asks a tracker for its range: with no tracker, or none to size the
/// slice it would fetch, it says what is missing before doing anything.
#[test]
fn a_worker_without_layers_says_what_it_needs_to_be_placed() {
    let dir = TempDir::new("placed");
    let token = dir.path("token");
    std::fs::write(&token, "a-join-token-of-some-length").unwrap();
    let mut alone = dgr();
    alone.args(["worker", "--model"]).arg(model());
    assert!(expect_clean_failure(alone).contains("--layers A..B is needed without --tracker"));
    let mut fetching = dgr();
    fetching.args(["worker", "--model-id", "abc", "--tracker", "127.0.0.1:9", "--join-token-file"]).arg(&token);
    let err = expect_clean_failure(fetching);
    assert!(err.contains("sizing model abc") && err.contains("127.0.0.1:9"), "{err}");
    let mut both = dgr();
    both.args(["worker", "--model"]).arg(model()).args(["--layers", "0..30", "--max-layers", "3"]);
    assert!(expect_clean_failure(both).contains("cannot be used with"));
    let mut none = dgr();
    none.args(["worker", "--model"]).arg(model()).args(["--max-layers", "0", "--tracker", "127.0.0.1:9"]);
    assert!(expect_clean_failure(none).contains("invalid value '0' for '--max-layers"));
}

#[test]
fn unknown_numerics_and_kv_dtypes_are_refused_at_start_with_the_ones_available() {
    let model = model();
    let model = model.to_str().unwrap();
    let worker = ["worker", "--model", model, "--layers", "0..30"];
    let generate = ["generate", "--model", model, "-p", "hi", "-n", "1"];
    let score = ["score", "--model", model, "--prompt", "hi", "--continuation", "1"];
    let embed = ["embed", "--model", model, "--text", "hi"];
    let up = ["up", "--model", model, "--listen", "127.0.0.1:0"];
    let flags = [
        ("--numerics", &["exact", "fast"][..], "f32", "exact, fast"),
        ("--kv-dtype", &["f32", "f16", "q8_0"][..], "q4_0", "f32, f16, q8_0"),
    ];
    for (flag, known, unknown, listed) in flags {
        for value in known {
            let out = dgr().args(score).args([flag, value]).output().unwrap();
            assert!(out.status.success(), "score {flag} {value}: {}", String::from_utf8_lossy(&out.stderr));
        }
        for args in [&worker[..], &generate[..], &score[..], &embed[..], &up[..]] {
            let mut cmd = dgr();
            cmd.args(args).args([flag, unknown]);
            let err = expect_clean_failure(cmd);
            assert!(
                err.contains(&format!("invalid value '{unknown}'")) && err.contains(&format!("[possible values: {listed}]")),
                "{args:?}: {err}"
            );
        }
    }
}

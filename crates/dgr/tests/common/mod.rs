//! Shared by the acceptance tests: the real model, the reference files and running `dgr`;
//! `dgr worker` processes with guards, their /metrics, and the reference prompts.
#![allow(dead_code)]

pub mod proxy;
pub mod secure;
pub mod swarm;
pub mod tap;

use dgr_driver::Completion;
use serde_json::Value;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The default model. Missing is a failure, never a skip: fetch it with scripts/fetch-model.sh.
pub fn model() -> PathBuf {
    let p = dgr_gguf::default_model_path();
    assert!(p.exists(), "the default model is not at {}: run scripts/fetch-model.sh first", p.display());
    p
}

/// gemma-3-270m Q4_K_M, beside the default model. Missing is a failure, never a skip: fetch it
/// with `scripts/fetch-model.sh gemma3`.
pub fn gemma3_model() -> PathBuf {
    let p = dgr_gguf::default_model_path().with_file_name("gemma-3-270m-q4_k_m.gguf");
    assert!(p.exists(), "the gemma3 model is not at {}: run scripts/fetch-model.sh gemma3 first", p.display());
    p
}

pub fn reference(name: &str) -> Value {
    let path = format!("{}/../../tests/data/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))).unwrap()
}

pub fn dgr() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dgr"));
    c.env_remove("DGR_MODEL");
    c
}

/// Runs dgr with `args` on the default model and parses its JSON output.
pub fn dgr_json(args: &[&str]) -> Value {
    let out = dgr().args(args).arg("--model").arg(model()).output().expect("running dgr");
    assert!(out.status.success(), "dgr {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("dgr {args:?} printed no JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

pub fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

/// `dgr score`'s teacher-forced steps of every completion of `reference` on `model`, with
/// `flags` (the engine's: `--numerics`, `--kv-dtype`).
pub fn score_all(model: &std::path::Path, reference: &Value, flags: &[&str]) -> Vec<Value> {
    score_first(model, reference, usize::MAX, flags)
}

/// `score_all` of the first `n` completions.
pub fn score_first(model: &std::path::Path, reference: &Value, n: usize, flags: &[&str]) -> Vec<Value> {
    let mut steps = Vec::new();
    for c in reference["completions"].as_array().unwrap().iter().take(n) {
        let cont: Vec<String> = ids(&c["continuation"]).iter().map(|t| t.to_string()).collect();
        let mut cmd = dgr();
        cmd.args(["score", "--prompt", c["prompt"].as_str().unwrap(), "--continuation", &cont.join(",")])
            .args(["--top-logprobs", "5", "--threads", "2"])
            .args(flags)
            .arg("--model")
            .arg(model);
        let out = Proc::spawn(cmd).wait_within(Duration::from_secs(900));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "dgr score {flags:?} failed ({:?}): {stdout}{}", out.status, String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("dgr score printed no JSON ({e}): {stdout}"));
        steps.extend(v["steps"].as_array().unwrap().iter().cloned());
    }
    steps
}

/// Every completion's steps of a reference file, in order.
pub fn reference_steps(reference: &Value) -> Vec<Value> {
    reference["completions"].as_array().unwrap().iter().flat_map(|c| c["steps"].as_array().unwrap().iter().cloned()).collect()
}

/// The mean |Δ logprob| of the scored tokens of two runs over the same steps.
pub fn mean_distance(a: &[Value], b: &[Value]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x["logprob"].as_f64().unwrap() - y["logprob"].as_f64().unwrap()).abs()).sum::<f64>() / a.len() as f64
}

// ---------------------------------------------------------------------------------------------
// Routes: one test at a time

/// Held by every test: one route at a time. Several checks time what workers do (a freed
/// session within a second, a failed request within ten), which other tests' compute on the
/// same few cores would only blur.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Every CPU engine this build registers (`dgr_engine::registered_specs`: numerics × KV dtype):
/// the suites that hold the engine's contract through real workers (a route equals the whole
/// model, a batch equals its solo runs) run once per entry, so registering a new one tests it.
/// The GPU's engines hold the same contract in the engine's own suites (`invariance.rs`) and in
/// `gpu.rs`; a software adapter is too slow for the swarm suites.
pub fn engines() -> Vec<Engine> {
    let cpu = dgr_engine::registered_specs().into_iter().filter(|s| s.backend == dgr_engine::BackendKind::Cpu);
    cpu.map(|s| Engine { numerics: s.numerics, kv: s.kv }).collect()
}

/// Whether a GPU adapter is here. Under CI a missing one fails the test (CI installs lavapipe);
/// elsewhere the test says plainly that it did not run.
pub fn have_gpu() -> bool {
    if !dgr_engine::adapters().is_empty() {
        return true;
    }
    assert!(std::env::var("CI").as_deref() != Ok("true"), "no GPU adapter: CI installs mesa-vulkan-drivers (lavapipe) for the GPU tests");
    eprintln!("no GPU adapter on this machine (no Vulkan, Metal or DX12 device): the GPU test did not run");
    false
}

/// A registered engine, as the flags that ask for it.
#[derive(Clone, Copy, Debug)]
pub struct Engine {
    pub numerics: dgr_engine::Numerics,
    pub kv: dgr_engine::KvDtype,
}

impl Engine {
    pub fn flags(&self) -> [&'static str; 6] {
        ["--device", "cpu", "--numerics", self.numerics.name(), "--kv-dtype", self.kv.name()]
    }

    /// Its id on the default model (what workers register and routes carry).
    pub fn id(&self) -> String {
        use dgr_engine::{BackendKind, EngineId, Format};
        EngineId { format: Format::Gguf, backend: BackendKind::Cpu, numerics: self.numerics, kv: self.kv, adapter: None }.to_string()
    }
}

pub fn layers_of(cuts: &[usize]) -> String {
    cuts.windows(2).map(|w| format!("[{},{})", w[0], w[1])).collect::<Vec<_>>().join("+")
}

// ---------------------------------------------------------------------------------------------
// Processes

/// Reads a child's pipe to the end on a thread, so the child never blocks on a full pipe.
pub fn drain(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        buf
    })
}

/// A running dgr process (not a worker), killed when dropped.
pub struct Proc {
    pub child: Child,
    pub what: String,
    out: Option<std::thread::JoinHandle<Vec<u8>>>,
    err: Option<std::thread::JoinHandle<Vec<u8>>>,
}

impl Proc {
    pub fn spawn(mut cmd: Command) -> Proc {
        let what = format!("{cmd:?}");
        let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawning dgr");
        let out = Some(drain(child.stdout.take().unwrap()));
        let err = Some(drain(child.stderr.take().unwrap()));
        Proc { child, what, out, err }
    }

    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits for the exit, failing the test (and killing the process) past `limit`.
    pub fn wait_within(mut self, limit: Duration) -> Output {
        let start = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > limit {
                panic!("{} still running after {limit:?}", self.what);
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        Output { status, stdout: self.out.take().unwrap().join().unwrap(), stderr: self.err.take().unwrap().join().unwrap() }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One `dgr worker` process per stage of a split, each on its own loopback port; all killed
/// (SIGKILL) when dropped. Their stderr is kept and shown if the test fails.
pub struct Workers {
    pub children: Vec<Child>,
    pub addrs: Vec<String>,
    /// Each worker's id: the key it proves on its links, in hex.
    pub ids: Vec<String>,
    pub cuts: Vec<usize>,
    logs: Vec<Arc<Mutex<Vec<u8>>>>,
}

impl Workers {
    /// Starts the workers for `cuts` with `--threads 1` and `extra` options, and waits (with a
    /// deadline) for each one's ready line.
    pub fn start(cuts: &[usize], extra: &[&str]) -> Workers {
        Workers::start_threads(cuts, 1, extra)
    }

    /// As `start`, with `--threads threads` on each worker.
    pub fn start_threads(cuts: &[usize], threads: usize, extra: &[&str]) -> Workers {
        Workers::start_on(&vec![model(); cuts.len() - 1], cuts, threads, extra)
    }

    /// As `start_threads`, each worker on its own model file (a slice, say).
    pub fn start_on(models: &[PathBuf], cuts: &[usize], threads: usize, extra: &[&str]) -> Workers {
        let threads = threads.to_string();
        let mut w = Workers { children: Vec::new(), addrs: Vec::new(), ids: Vec::new(), cuts: cuts.to_vec(), logs: Vec::new() };
        let mut ready = Vec::new();
        for (r, model) in cuts.windows(2).zip(models) {
            let mut child = dgr()
                .args(["worker", "--listen", "127.0.0.1:0", "--threads", &threads, "--layers", &format!("{}..{}", r[0], r[1])])
                .args(extra)
                .arg("--model")
                .arg(model)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawning dgr worker");
            let (rx, log) = swarm::watch(&mut child);
            w.children.push(child);
            w.logs.push(log);
            ready.push(rx);
        }
        for (i, rx) in ready.into_iter().enumerate() {
            let line = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("worker {i} of {cuts:?} not ready within 60 s"));
            let v: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("worker {i} of {cuts:?}: no ready line ({e}): {line:?}; stderr: {}", w.log(i)));
            assert_eq!(v["layers"], serde_json::json!([cuts[i], cuts[i + 1]]), "worker {i}: {v}");
            w.addrs.push(v["listening"].as_str().expect("listening").to_string());
            w.ids.push(v["worker_id"].as_str().expect("worker_id").to_string());
        }
        w
    }

    pub fn n(&self) -> usize {
        self.addrs.len()
    }

    pub fn route(&self) -> String {
        self.addrs.join(",")
    }

    pub fn log(&self, i: usize) -> String {
        String::from_utf8_lossy(&self.logs[i].lock().unwrap()).into_owned()
    }

    /// SIGKILL worker `i`, waiting for it to be gone.
    pub fn kill(&mut self, i: usize) {
        self.children[i].kill().expect("killing a worker");
        let _ = self.children[i].wait();
    }

    /// Fails the test, saying how, if worker `i` is no longer running.
    pub fn assert_alive(&mut self, i: usize, when: &str) {
        if let Ok(Some(status)) = self.children[i].try_wait() {
            panic!("worker {i} (layers {}..{}) died {when}: {status}", self.cuts[i], self.cuts[i + 1]);
        }
    }

    /// Worker `i`'s /metrics; a worker that died fails the test with its exit status.
    pub fn metrics(&mut self, i: usize) -> Metrics {
        self.assert_alive(i, "before GET /metrics");
        match try_metrics(&self.addrs[i]) {
            Ok(m) => m,
            Err(e) => {
                std::thread::sleep(Duration::from_millis(100));
                self.assert_alive(i, &format!("(GET /metrics: {e})"));
                panic!("GET {}/metrics from worker {i}: {e}", self.addrs[i]);
            }
        }
    }

    /// Waits until every worker in `which` holds no session and no KV bytes; fails past
    /// `within`. Returns how long it took.
    pub fn wait_all_free(&mut self, which: &[usize], within: Duration, what: &str) -> Duration {
        let start = Instant::now();
        loop {
            let ms: Vec<Metrics> = which.iter().map(|&i| self.metrics(i)).collect();
            if ms.iter().all(|m| m.get("dgr_worker_sessions_open") == 0.0 && m.get("dgr_worker_kv_bytes_used") == 0.0) {
                return start.elapsed();
            }
            if start.elapsed() > within {
                let seen: Vec<String> = which
                    .iter()
                    .zip(&ms)
                    .map(|(i, m)| {
                        format!(
                            "worker {i}: sessions_open {} kv_bytes_used {}",
                            m.get("dgr_worker_sessions_open"),
                            m.get("dgr_worker_kv_bytes_used")
                        )
                    })
                    .collect();
                panic!("{what}: sessions not freed within {within:?}: {seen:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for c in self.children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            for i in 0..self.children.len() {
                let log = self.log(i);
                let tail: String = log.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
                eprintln!("--- worker {i} of {:?} stderr (tail):\n{tail}", self.cuts);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// /metrics

pub struct Metrics(pub HashMap<String, f64>);

impl Metrics {
    pub fn get(&self, name: &str) -> f64 {
        *self.0.get(name).unwrap_or_else(|| panic!("/metrics has no {name}: {:?}", self.0.keys().collect::<Vec<_>>()))
    }
}

/// GET /metrics over a plain TcpStream, parsed into name (with labels) → value.
pub fn metrics(addr: &str) -> Metrics {
    try_metrics(addr).unwrap_or_else(|e| panic!("GET {addr}/metrics: {e}"))
}

pub fn try_metrics(addr: &str) -> std::io::Result<Metrics> {
    let mut s = TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    // A worker at its connection cap closes at once: an empty reply is an error, not a panic.
    if resp.is_empty() {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed without a reply"));
    }
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or_else(|| panic!("GET {addr}/metrics: no HTTP head in {resp:?}"));
    assert!(head.starts_with("HTTP/1.1 200"), "GET {addr}/metrics: {head}");
    let mut m = HashMap::new();
    for line in body.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let (name, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad metrics line {line:?}"));
        m.insert(name.to_string(), value.parse().unwrap_or_else(|_| panic!("bad metrics value in {line:?}")));
    }
    Ok(Metrics(m))
}

// ---------------------------------------------------------------------------------------------
// The reference prompts

pub struct Prompt {
    pub name: String,
    pub text: String,
    pub tokens: Vec<u32>,
}

pub fn prompts() -> Vec<Prompt> {
    let r = reference("smollm2-q4_1-llamacpp.json");
    let c = r["completions"].as_array().expect("completions");
    assert_eq!(c.len(), 6, "the reference has six completion prompts");
    c.iter()
        .map(|c| Prompt {
            name: c["name"].as_str().unwrap().into(),
            text: c["prompt"].as_str().unwrap().into(),
            tokens: ids(&c["prompt_tokens"]).into_iter().map(|t| t as u32).collect(),
        })
        .collect()
}

pub fn prompt(name: &str) -> Prompt {
    prompts().into_iter().find(|p| p.name == name).unwrap_or_else(|| panic!("no prompt {name:?} in the reference"))
}

/// A runtime for driving sessions with the `dgr_driver` library.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// `got` has `want`'s tokens, logprobs and top logprobs bit for bit, and its finish reason.
pub fn assert_same_completion(got: &Completion, want: &Completion, what: &str) {
    assert_eq!(got.tokens, want.tokens, "{what}: tokens");
    let bits = |c: &Completion| c.logprobs.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(got), bits(want), "{what}: logprobs");
    let top =
        |c: &Completion| c.top_logprobs.iter().map(|s| s.iter().map(|(i, l)| (*i, l.to_bits())).collect::<Vec<_>>()).collect::<Vec<_>>();
    assert_eq!(top(got), top(want), "{what}: top_logprobs");
    assert_eq!(got.finish_reason, want.finish_reason, "{what}: finish_reason");
}

// ---------------------------------------------------------------------------------------------
// Generations compared field by field

/// `dgr generate` with `args`, on the default model.
pub fn generate_cmd(args: &[&str]) -> Command {
    let mut c = dgr();
    c.arg("generate").args(args).arg("--model").arg(model());
    c
}

/// `dgr generate --format json` with `args`; fails the test on a non-zero exit.
pub fn generate_json(args: &[&str]) -> Value {
    let mut all = vec!["--format", "json"];
    all.extend_from_slice(args);
    let out = Proc::spawn(generate_cmd(&all)).wait_within(Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "dgr generate {args:?} failed ({:?}): {stdout}{}", out.status, String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("dgr generate {args:?} printed no JSON ({e}): {stdout}"))
}

/// The draft rows a generation's speculative steps computed and threw away: they crossed every
/// seam and were decoded by every stage besides the generation's own rows.
pub fn rejected_drafts(generation: &Value) -> u64 {
    let d = &generation["drafts"];
    d["drafted"].as_u64().expect("drafts.drafted") - d["accepted"].as_u64().expect("drafts.accepted")
}

/// The fields of a generation that a route must reproduce exactly, as their JSON text (so
/// numbers compare bit for bit as printed).
pub fn essence(v: &Value) -> Vec<(&'static str, String)> {
    ["prompt_tokens", "tokens", "text", "logprobs", "top_logprobs", "finish_reason"].iter().map(|&k| (k, v[k].to_string())).collect()
}

pub fn assert_same_generation(got: &Value, want: &Value, what: &str) {
    assert!(got["tokens"].as_array().is_some_and(|t| !t.is_empty()), "{what}: no tokens in {got}");
    for ((k, g), (_, w)) in essence(got).iter().zip(essence(want)) {
        assert_eq!(*g, w, "{what}: field {k:?} differs\n routed: {g}\n  whole: {w}");
    }
}

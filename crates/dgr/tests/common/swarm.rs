//! A tracker process and workers that join it, for the tracker's acceptance tests.

use super::{dgr, model};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// Spawns `cmd`, returns the child, its first stdout line as JSON, and its stderr as it grows.
pub fn spawn_ready(mut cmd: std::process::Command, what: &str) -> (Child, Value, Arc<Mutex<Vec<u8>>>) {
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawning dgr");
    let (rx, log) = watch(&mut child);
    let line = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("{what} not ready within 60 s"));
    let v: Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("{what}: no ready line ({e}): {line:?}; stderr: {}", String::from_utf8_lossy(&log.lock().unwrap())));
    (child, v, log)
}

/// Reads a child spawned with piped stdout and stderr: its first stdout line (sent when read; the
/// rest is drained), and its stderr as it grows.
pub fn watch(child: &mut Child) -> (mpsc::Receiver<String>, Arc<Mutex<Vec<u8>>>) {
    let stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stdout);
        let mut line = String::new();
        let _ = r.read_line(&mut line);
        let _ = tx.send(line);
        let _ = std::io::copy(&mut r, &mut std::io::sink());
    });
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = log.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stderr.read(&mut buf) {
            if n == 0 {
                break;
            }
            l.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    (rx, log)
}

pub struct Tracker {
    pub child: Child,
    pub addr: String,
    pub dir: PathBuf,
    pub token_file: PathBuf,
    /// The key it proves on its links (`--tracker-key`), in hex.
    pub link_key: String,
    log: Arc<Mutex<Vec<u8>>>,
}

impl Tracker {
    /// `dgr key add` on this tracker: the new key's secret.
    pub fn add_key(&self, name: &str, quota: u64) -> String {
        let out = dgr()
            .args(["key", "add", "--tracker", &self.addr, "--name", name, "--quota-tokens", &quota.to_string(), "--join-token-file"])
            .arg(&self.token_file)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<Value>(&out.stdout).unwrap()["key"].as_str().unwrap().to_string()
    }

    /// A tracker with its database and join token in a fresh directory `name` under the temp dir.
    pub fn start(name: &str, extra: &[&str]) -> Tracker {
        Tracker::start_in(&Tracker::fresh_dir(name), "127.0.0.1:0", extra)
    }

    /// A tracker on the ledger `ledger` (`--ledger`), its join token in a fresh directory `name`.
    pub fn start_on_ledger(name: &str, ledger: &str, extra: &[&str]) -> Tracker {
        Tracker::start_with(&Tracker::fresh_dir(name), "127.0.0.1:0", &["--ledger", ledger], extra)
    }

    /// Two trackers of one swarm on a PostgreSQL database of their own (`postgres_ledger`),
    /// each with its join token in a fresh directory named for `name`.
    #[cfg(feature = "postgres-tests")]
    pub fn pair_on_postgres(name: &str) -> (Tracker, Tracker) {
        let url = postgres_ledger(name);
        (Tracker::start_on_ledger(&format!("{name}-a"), &url, &[]), Tracker::start_on_ledger(&format!("{name}-b"), &url, &[]))
    }

    fn fresh_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("dgr-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("join-token"), "test-join-token\n").unwrap();
        dir
    }

    /// A tracker on the database in `dir` (a restart), listening on `listen`.
    pub fn start_in(dir: &Path, listen: &str, extra: &[&str]) -> Tracker {
        let db = dir.join("tracker.db");
        Tracker::start_with(dir, listen, &["--db", db.to_str().unwrap()], extra)
    }

    fn start_with(dir: &Path, listen: &str, ledger: &[&str], extra: &[&str]) -> Tracker {
        let token_file = dir.join("join-token");
        let mut cmd = dgr();
        cmd.args(["tracker", "--listen", listen])
            .args(ledger)
            .arg("--join-token-file")
            .arg(&token_file)
            .args(extra)
            .env("DGR_STATE_DIR", dir);
        let (child, v, log) = spawn_ready(cmd, "tracker");
        let addr = v["listening"].as_str().expect("listening").to_string();
        let link_key = v["link_key"].as_str().expect("link_key").to_string();
        Tracker { child, addr, dir: dir.to_path_buf(), token_file, link_key, log }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log(&self) -> String {
        String::from_utf8_lossy(&self.log.lock().unwrap()).into_owned()
    }

    pub fn query(&self, args: &[&str]) -> Value {
        let out = dgr().args(args).args(["--tracker", &self.addr, "--format", "json"]).output().unwrap();
        assert!(out.status.success(), "dgr {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// `dgr swarm --format json`: the workers of the one model, by id.
    pub fn workers(&self) -> Vec<Value> {
        let v = self.query(&["swarm"]);
        v["models"].as_array().unwrap().iter().flat_map(|m| m["workers"].as_array().unwrap().clone()).collect()
    }

    /// Ids of the workers the tracker would route to now.
    pub fn live_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> =
            self.workers().iter().filter(|w| w["live"] == true).map(|w| w["worker_id"].as_str().unwrap().to_string()).collect();
        ids.sort();
        ids
    }

    /// Waits until the live workers are exactly `want`; returns how long that took.
    pub fn wait_live(&self, want: &[&str], within: Duration, what: &str) -> Duration {
        let start = Instant::now();
        let mut want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
        want.sort();
        loop {
            let live = self.live_ids();
            if live == want {
                return start.elapsed();
            }
            assert!(start.elapsed() < within, "{what}: live workers {live:?}, want {want:?} within {within:?}");
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    pub fn usage(&self, by: &str) -> Value {
        self.query(&["usage", "--by", by])
    }

    /// `dgr generate --tracker` on the default model; the parsed JSON (an error exits 2 with
    /// {"error": ...}, returned as is).
    pub fn generate(&self, args: &[&str]) -> Value {
        let out = dgr()
            .args(["generate", "--tracker", &self.addr, "--format", "json", "--threads", "1"])
            .args(args)
            .arg("--model")
            .arg(model())
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!("generate {args:?}: no JSON ({e}): {} {}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
        })
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("--- tracker stderr:\n{}", self.log());
        }
    }
}

pub struct Worker {
    pub child: Child,
    pub id: String,
    pub addr: Option<String>,
    pub layers: (usize, usize),
    log: Arc<Mutex<Vec<u8>>>,
}

impl Worker {
    /// A worker of layers a..b joined to `t`, with its identity in `key` (under the tracker's
    /// dir), one thread, and `extra` flags.
    pub fn start(t: &Tracker, layers: (usize, usize), key: &str, extra: &[&str]) -> Worker {
        Worker::start_with_env(t, layers, key, extra, &[])
    }

    /// As `start`, with extra environment variables.
    pub fn start_with_env(t: &Tracker, layers: (usize, usize), key: &str, extra: &[&str], env: &[(&str, &str)]) -> Worker {
        Worker::start_on(t, layers, key, extra, env, Some(&model()))
    }

    /// As `start_with_env`, on `model` (None: no --model, for a worker that fetches its slice).
    pub fn start_on(t: &Tracker, layers: (usize, usize), key: &str, extra: &[&str], env: &[(&str, &str)], model: Option<&Path>) -> Worker {
        Worker::start_joined(&[t], layers, key, extra, env, model)
    }

    /// As `start_on`, joined to every tracker of `ts` (trackers of one swarm: one join token;
    /// the key file lives under the first one's dir).
    pub fn start_joined(
        ts: &[&Tracker],
        layers: (usize, usize),
        key: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        model: Option<&Path>,
    ) -> Worker {
        Worker::spawn(ts, Some(layers), key, extra, env, model)
    }

    /// A worker started without --layers, joined to `t`: it serves the range the tracker
    /// assigns, of `model` (None: no --model, for a worker that fetches its slice).
    pub fn start_placed(t: &Tracker, key: &str, extra: &[&str], model: Option<&Path>) -> Worker {
        Worker::spawn(&[t], None, key, extra, &[], model)
    }

    fn spawn(
        ts: &[&Tracker],
        layers: Option<(usize, usize)>,
        key: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        model: Option<&Path>,
    ) -> Worker {
        let t = ts[0];
        let trackers: Vec<&str> = ts.iter().map(|t| t.addr.as_str()).collect();
        let mut cmd = dgr();
        cmd.envs(env.iter().copied());
        if let Some((a, b)) = layers {
            cmd.args(["worker", "--layers", &format!("{a}..{b}")]);
        } else {
            cmd.arg("worker");
        }
        cmd.args(["--threads", "1", "--tracker", &trackers.join(","), "--join-token-file"])
            .arg(&t.token_file)
            .arg("--key-file")
            .arg(t.dir.join(format!("{key}.key")))
            .args(extra);
        if let Some(m) = model {
            cmd.arg("--model").arg(m);
        }
        if !extra.contains(&"--relay") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        let (child, v, log) = spawn_ready(cmd, "worker");
        let layer = |i: usize| v["layers"][i].as_u64().expect("layers") as usize;
        Worker {
            child,
            id: v["worker_id"].as_str().expect("worker_id").to_string(),
            addr: v["listening"].as_str().map(String::from),
            layers: (layer(0), layer(1)),
            log,
        }
    }

    pub fn signal(&self, sig: &str) {
        let ok = std::process::Command::new("kill").args([&format!("-{sig}"), &self.child.id().to_string()]).status().unwrap();
        assert!(ok.success(), "kill -{sig}");
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log(&self) -> String {
        String::from_utf8_lossy(&self.log.lock().unwrap()).into_owned()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // A stopped process must be continued to die of anything but SIGKILL; SIGKILL it anyway.
        self.kill();
        if std::thread::panicking() {
            eprintln!("--- worker {:?} stderr:\n{}", self.layers, self.log());
        }
    }
}

/// `dgr gateway` on the default model, asking the trackers `ts` (the list form).
pub struct Gateway {
    pub child: Child,
    pub addr: String,
    log: Arc<Mutex<Vec<u8>>>,
}

impl Gateway {
    pub fn start(ts: &[&Tracker], extra: &[&str]) -> Gateway {
        let trackers: Vec<&str> = ts.iter().map(|t| t.addr.as_str()).collect();
        let mut cmd = dgr();
        cmd.args(["gateway", "--tracker", &trackers.join(","), "--listen", "127.0.0.1:0"]).args(extra).arg("--model").arg(model());
        let (child, v, log) = spawn_ready(cmd, "gateway");
        Gateway { child, addr: v["listening"].as_str().expect("listening").to_string(), log }
    }

    pub fn log(&self) -> String {
        String::from_utf8_lossy(&self.log.lock().unwrap()).into_owned()
    }

    /// The model's name in the API (the file's stem).
    pub fn model_name() -> String {
        model().file_stem().unwrap().to_string_lossy().trim_end_matches(".gguf").to_string()
    }

    /// POSTs `body` as JSON to `path`, with `key` as the bearer token: the status, the response
    /// head, and the body as JSON.
    pub fn post(&self, path: &str, key: Option<&str>, body: &Value) -> (u16, String, Value) {
        use std::io::Write;
        let body = body.to_string();
        let mut s = std::net::TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        let (head, body) = resp.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP response: {resp:?}"));
        let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("status line: {head}"));
        let v = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
        (status, head.to_string(), v)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- gateway stderr:\n{}", self.log());
        }
    }
}

/// A database of its own on the server DGR_TEST_POSTGRES names (scripts/postgres.sh): missing
/// is a failure, never a skip.
#[cfg(feature = "postgres-tests")]
pub fn postgres_ledger(tag: &str) -> String {
    let url = std::env::var("DGR_TEST_POSTGRES").expect("postgres-tests need DGR_TEST_POSTGRES (scripts/postgres.sh start prints it)");
    let name = format!("{tag}_{}_{}", std::process::id(), Instant::now().elapsed().as_nanos());
    dgr_tracker::store::fresh_postgres_database(&url, &name).expect("a fresh database on DGR_TEST_POSTGRES")
}

//! OpenAI servers a benchmark starts and stops itself on loopback: `dgr up` (the running dgr
//! executable, its state in a temporary directory) and llama-server. Each logs to a file that a
//! failure to start quotes; each is stopped on drop.

use crate::error::{BenchError, Context, Result};
use crate::serve_client::{self as client, Endpoint};
use crate::swarm::{die_with_parent, terminate};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to load its model and say it is ready.
const START_TIMEOUT: Duration = Duration::from_secs(180);

pub struct Server {
    child: Child,
    /// Its base URL, `http://127.0.0.1:PORT`.
    pub url: String,
    /// The command line that started it, for the record.
    pub command: Vec<String>,
    /// A temporary directory (the log, dgr's state), removed on drop.
    dir: PathBuf,
}

/// A fresh temporary directory for one server.
fn temp_dir(kind: &str) -> Result<PathBuf> {
    let mut seed = [0u8; 8];
    getrandom::fill(&mut seed).map_err(|e| BenchError::Local(format!("randomness: {e}")))?;
    let dir = std::env::temp_dir().join(format!("dgr-bench-{kind}-{}-{:016x}", std::process::id(), u64::from_le_bytes(seed)));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

fn command_line(cmd: &Command) -> Vec<String> {
    std::iter::once(cmd.get_program()).chain(cmd.get_args()).map(|s| s.to_string_lossy().into_owned()).collect()
}

/// A loopback port free at the time of asking.
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr().context("finding a free port")?.port())
}

impl Server {
    /// `dgr up` with `flags` after `--model MODEL` on a free port, once its ready line says
    /// where it serves.
    pub fn dgr_up(model: &Path, flags: &[String]) -> Result<Server> {
        let exe = std::env::current_exe().context("locating the dgr executable")?;
        let dir = temp_dir("up")?;
        let mut cmd = Command::new(exe);
        cmd.args(["up", "--listen", "127.0.0.1:0", "--model"]).arg(model).args(flags);
        let command = command_line(&cmd);
        die_with_parent(&mut cmd);
        let log = std::fs::File::create(dir.join("log")).with_context(|| format!("creating a log in {}", dir.display()))?;
        let mut child =
            cmd.env("DGR_STATE_DIR", &dir).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(log).spawn().context("starting dgr up")?;
        let stdout = child.stdout.take().ok_or_else(|| BenchError::Local("no pipe from dgr up's stdout".into()))?;
        // The ready line is read on a thread of its own, so that a server that never says it is
        // ready fails the run at the deadline instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut out = BufReader::new(stdout);
            let mut line = String::new();
            let _ = tx.send(out.read_line(&mut line).map(|_| line));
            // Keep reading, so dgr up never blocks on a full pipe.
            let mut sink = String::new();
            while out.read_line(&mut sink).is_ok_and(|n| n > 0) {
                sink.clear();
            }
        });
        let mut server = Server { child, url: String::new(), command, dir };
        let line = match rx.recv_timeout(START_TIMEOUT) {
            Ok(Ok(l)) if !l.is_empty() => l,
            _ => return Err(server.failed("dgr up did not say it was ready")),
        };
        let v: serde_json::Value = serde_json::from_str(&line).context("reading dgr up's ready line")?;
        let base = v["base_url"].as_str().ok_or_else(|| BenchError::Local(format!("dgr up's ready line has no base_url: {line}")))?;
        server.url = base.trim_end_matches("/v1").to_string();
        Ok(server)
    }

    /// llama-server on `model` with `flags`, on a free loopback port; wait with `healthy`.
    pub fn llama_server(bin: &Path, model: &Path, flags: &[String]) -> Result<Server> {
        let dir = temp_dir("llama-server")?;
        let port = free_port()?;
        let mut cmd = Command::new(bin);
        cmd.arg("-m").arg(model).args(["--host", "127.0.0.1", "--port", &port.to_string()]).args(flags);
        let command = command_line(&cmd);
        die_with_parent(&mut cmd);
        let log = std::fs::File::create(dir.join("log")).with_context(|| format!("creating a log in {}", dir.display()))?;
        let log2 = log.try_clone().context("sharing llama-server's log")?;
        let child = cmd.stdin(Stdio::null()).stdout(log).stderr(log2).spawn().with_context(|| format!("starting {}", bin.display()))?;
        Ok(Server { child, url: format!("http://127.0.0.1:{port}"), command, dir })
    }

    /// Waits until GET /health answers 200 (llama-server answers 503 while it loads).
    pub async fn healthy(&mut self) -> Result<()> {
        let (ep, deadline) = (self.endpoint()?, Instant::now() + START_TIMEOUT);
        loop {
            if client::get_json(&ep, "/health", Duration::from_secs(5)).await.is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline || !matches!(self.child.try_wait(), Ok(None)) {
                return Err(self.failed("the server did not become healthy"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn endpoint(&self) -> Result<Endpoint> {
        Endpoint::parse(&self.url, None)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    fn failed(&self, what: &str) -> BenchError {
        let log = self.log();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        BenchError::Local(format!("{what} ({}); its log ends:\n{}", self.command.join(" "), tail.join("\n")))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        terminate(std::slice::from_mut(&mut self.child));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What `bin --version` says (llama.cpp prints "version: N (commit)").
pub fn llama_version(bin: &Path) -> String {
    let out = Command::new(bin).arg("--version").output();
    let text = out.map(|o| String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout)).unwrap_or_default();
    let line = text.lines().find(|l| l.starts_with("version:")).unwrap_or("version unknown").trim().to_string();
    format!("{}, {line}", crate::peer::source())
}

//! A quick local swarm: worker and tracker processes of the running dgr executable on loopback.

use crate::error::{BenchError, Context, Result};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Checks a stage count against the model's layers.
pub fn check_split(layers: usize, n: usize) -> Result<()> {
    if n == 0 || n > layers {
        return Err(BenchError::Usage(format!("--split {n}: the model has {layers} layers")));
    }
    Ok(())
}

pub struct LocalSwarm {
    children: Vec<Child>,
    /// Each worker's stderr, kept in a file (removed on drop) and shown if it fails to start.
    logs: Vec<std::path::PathBuf>,
    /// Where each worker listens ("" for a relayed one).
    pub addrs: Vec<String>,
    /// Each worker's id at its tracker ("" when ticketless).
    pub ids: Vec<String>,
}

/// Layer ranges of `n` stages over `layers` layers, as even as they divide.
pub fn even_split(layers: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    (0..n).map(|i| layers * i / n..layers * (i + 1) / n).collect()
}

/// Layer ranges of `n` stages with about equal compute each: a layer costs its weights'
/// element count, and the last stage also carries the head (as large as several layers in a
/// small model), so it gets fewer layers.
pub fn balanced_split(g: &dgr_gguf::Gguf, layers: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    let (cost, head) = g.per_layer(layers, dgr_gguf::TensorInfo::n_elements);
    balance(&cost, head, n)
}

/// Ranges of `n` stages over the layers `0..cost.len()` with about equal cost each, the last
/// stage also carrying `head`.
pub fn balance(cost: &[u64], head: u64, n: usize) -> Vec<std::ops::Range<usize>> {
    let layers = cost.len();
    let total: u64 = cost.iter().sum::<u64>() + head;
    let mut ranges = Vec::new();
    let (mut start, mut acc) = (0, 0u64);
    for (i, c) in cost.iter().enumerate() {
        let stage = ranges.len() as u64 + 1;
        let share = total * stage / n as u64;
        // Close the stage before layer i when that lands closer to its share than after it,
        // or when every later stage needs one of the layers left.
        let closer = acc.abs_diff(share) <= (acc + c).abs_diff(share);
        if (stage as usize) < n && i > start && (closer || layers - i == n - stage as usize) {
            ranges.push(start..i);
            start = i;
        }
        acc += c;
    }
    ranges.push(start..layers);
    ranges
}

impl LocalSwarm {
    /// Starts one `dgr worker` per range (each with `threads` threads and `extra` flags) and
    /// waits until each is listening.
    pub fn start(model: &Path, ranges: &[std::ops::Range<usize>], threads: usize, extra: &[String]) -> Result<LocalSwarm> {
        let exe = std::env::current_exe().context("locating the dgr executable")?;
        static SWARMS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = SWARMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut swarm = LocalSwarm { children: Vec::new(), logs: Vec::new(), addrs: Vec::new(), ids: Vec::new() };
        for (i, r) in ranges.iter().enumerate() {
            let log = std::env::temp_dir().join(format!("dgr-worker-{}-{n}-{i}.log", std::process::id()));
            let stderr = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
            swarm.logs.push(log);
            let mut cmd = Command::new(&exe);
            die_with_parent(&mut cmd);
            let child = cmd
                .args(["worker", "--listen", "127.0.0.1:0", "--layers", &format!("{}..{}", r.start, r.end)])
                .arg("--threads")
                .arg(threads.to_string())
                .arg("--model")
                .arg(model)
                .args(extra)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(stderr)
                .spawn()
                .context("starting a worker")?;
            swarm.children.push(child);
        }
        for (c, log) in swarm.children.iter_mut().zip(&swarm.logs) {
            let mut line = String::new();
            let mut out = BufReader::new(c.stdout.take().ok_or_else(|| BenchError::Local("no pipe from a worker's stdout".into()))?);
            if out.read_line(&mut line).context("reading a worker's ready line")? == 0 {
                let why = std::fs::read_to_string(log).unwrap_or_default();
                return Err(BenchError::Local(format!("a local worker failed to start: {}", why.trim())));
            }
            let v: serde_json::Value = serde_json::from_str(&line).context("reading a worker's ready line")?;
            swarm.addrs.push(v["listening"].as_str().unwrap_or_default().to_string());
            swarm.ids.push(v["worker_id"].as_str().unwrap_or_default().to_string());
        }
        Ok(swarm)
    }
}

/// Has the child get SIGTERM when this process dies, however it dies, so no worker or tracker
/// outlives the command that started it.
pub(crate) fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe; the closure touches nothing else between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
}

/// A local `dgr tracker` on a free loopback port, with its database and join token in a fresh
/// temporary directory (removed on drop); killed on drop.
pub struct LocalTracker {
    child: Child,
    dir: std::path::PathBuf,
    pub addr: String,
    pub token_file: std::path::PathBuf,
    /// The key the tracker proves on its links, in hex (`--tracker-key`).
    pub link_key: String,
    temporary: bool,
}

impl LocalTracker {
    /// A tracker with its state in a fresh temporary directory, removed on drop.
    pub fn start(extra: &[&str]) -> Result<LocalTracker> {
        let mut seed = [0u8; 8];
        getrandom::fill(&mut seed).map_err(|e| BenchError::Local(format!("randomness: {e}")))?;
        let dir = std::env::temp_dir().join(format!("dgr-tracker-{}-{:016x}", std::process::id(), u64::from_le_bytes(seed)));
        let mut t = LocalTracker::start_in(&dir, "127.0.0.1:0", extra)?;
        t.temporary = true;
        Ok(t)
    }

    /// A tracker on `listen` whose database and join token live in `dir` (kept). The tracker
    /// itself creates them there, as its state directory, before it says where it listens.
    pub fn start_in(dir: &std::path::Path, listen: &str, extra: &[&str]) -> Result<LocalTracker> {
        let exe = std::env::current_exe().context("locating the dgr executable")?;
        let dir = dir.to_path_buf();
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut cmd = Command::new(exe);
        die_with_parent(&mut cmd);
        let mut child = cmd
            .env("DGR_STATE_DIR", &dir)
            .args(["tracker", "--listen", listen])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting a tracker")?;
        let mut line = String::new();
        let stdout = child.stdout.take().ok_or_else(|| BenchError::Local("no pipe from the tracker's stdout".into()))?;
        BufReader::new(stdout).read_line(&mut line).context("reading the tracker's ready line")?;
        let v: serde_json::Value = serde_json::from_str(&line).context("reading the tracker's ready line")?;
        let field =
            |k: &str| v[k].as_str().map(str::to_string).ok_or_else(|| BenchError::Local(format!("the tracker's ready line has no {k}")));
        let (addr, token_file, link_key) = (field("listening")?, field("join_token_file")?.into(), field("link_key")?);
        Ok(LocalTracker { child, dir, addr, token_file, link_key, temporary: false })
    }

    /// The tracker process's id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The flags that make a worker join this tracker (and no other proving another key).
    pub fn join_flags(&self) -> Vec<String> {
        let token = self.token_file.display().to_string();
        vec!["--tracker".into(), self.addr.clone(), "--join-token-file".into(), token, "--tracker-key".into(), self.link_key.clone()]
    }
}

impl Drop for LocalTracker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if self.temporary {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl Drop for LocalSwarm {
    fn drop(&mut self) {
        terminate(&mut self.children);
        for log in &self.logs {
            let _ = std::fs::remove_file(log);
        }
    }
}

/// Stops child processes: SIGTERM, a short wait for a clean exit, then SIGKILL.
pub(crate) fn terminate(children: &mut [Child]) {
    for c in children.iter() {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for c in children.iter_mut() {
        while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

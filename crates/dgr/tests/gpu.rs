//! The GPU backend on the real models (on CI, Mesa's lavapipe, a software device): against the
//! exact float64 computation on the shared references, SmolLM2-135M-Instruct Q4_1 (all six
//! prompts) and gemma-3-270m Q4_K_M (its first three: its 262k-entry head is slow to score on a
//! software device), teacher-forced, the mean |Δ logprob| of the scored tokens is at most 1e-3
//! (with an f32 cache; on SmolLM2 with an f16 one too, and 1e-2 with q8_0) and below llama.cpp's own on the same
//! steps, and each scored token is the reference's; a
//! route of a CPU stage and a GPU stage generates the CPU route's tokens.
#![cfg(feature = "real-model")]

mod common;
use common::swarm::{Tracker, Worker};
use common::*;
use std::path::Path;

fn check(name: &str, model: &Path, prompts: usize, exact_file: &str, llama_file: &str, kv: &str) {
    if !have_gpu() {
        return;
    }
    let (exact, llama) = (reference(exact_file), reference(llama_file));
    let gpu = score_first(model, &exact, prompts, &["--device", "gpu", "--kv-dtype", kv]);
    let truth = &reference_steps(&exact)[..gpu.len()];
    let llama_mean = mean_distance(&reference_steps(&llama)[..gpu.len()], truth);
    for (i, (g, t)) in gpu.iter().zip(truth).enumerate() {
        assert_eq!(g["token"], t["id"], "{name}: step {i} scores a different token");
    }
    let mean = mean_distance(&gpu, truth);
    println!("{name} on the GPU, {kv} KV: {} steps; mean |Δ logprob| vs float64 {mean:.7}, llama.cpp's {llama_mean:.4}", gpu.len());
    // The CPU's bars (tests/accuracy_kv.rs): q8_0's int8 codes cost ~1e-2.
    let bar = if kv == "q8_0" { 1e-2 } else { 1e-3 };
    assert!(mean <= bar, "{name}: the GPU's mean |Δ logprob| {mean} > {bar} ({kv} KV)");
    assert!(mean < llama_mean, "{name}: the GPU's mean {mean} is not below llama.cpp's {llama_mean}");
}

#[test]
fn the_gpu_stays_within_1e_3_of_the_exact_computation_on_smollm2() {
    check("SmolLM2 Q4_1", &model(), 6, "smollm2-q4_1-exact.json", "smollm2-q4_1-llamacpp.json", "f32");
}

/// An f16 cache rounds every key and value to 2^-11 (on the CPU 3.0e-4 from float64 here):
/// still within the GPU's bar.
#[test]
fn the_gpu_with_an_f16_cache_stays_within_1e_3_of_the_exact_computation_on_smollm2() {
    check("SmolLM2 Q4_1", &model(), 3, "smollm2-q4_1-exact.json", "smollm2-q4_1-llamacpp.json", "f16");
}

/// A q8_0 cache (on the CPU 7.8e-3 from float64 here) within the CPU's q8_0 bar.
#[test]
fn the_gpu_with_a_q8_0_cache_stays_within_1e_2_of_the_exact_computation_on_smollm2() {
    check("SmolLM2 Q4_1", &model(), 3, "smollm2-q4_1-exact.json", "smollm2-q4_1-llamacpp.json", "q8_0");
}

#[test]
fn the_gpu_stays_within_1e_3_of_the_exact_computation_on_gemma3() {
    check("gemma-3-270m Q4_K_M", &gemma3_model(), 3, "gemma3-270m-q4_k_m-exact.json", "gemma3-270m-q4_k_m-llamacpp.json", "f32");
}

/// `dgr generate` of `n` greedy tokens of `prompt` over `route`, whatever its engines.
fn generate_n(route: &str, prompt: &str, n: usize) -> serde_json::Value {
    let n = n.to_string();
    let args =
        ["generate", "--format", "json", "--max-tokens", &n, "--ignore-eos", "--top-logprobs", "2", "--route", route, "--prompt", prompt];
    let out = dgr().args(args).arg("--any-engine").arg("--model").arg(model()).output().unwrap();
    assert!(
        out.status.success(),
        "generate over {route}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn generate(route: &str, prompt: &str) -> serde_json::Value {
    generate_n(route, prompt, 32)
}

/// A route of a CPU stage (layers 0..15, exact numerics) and a GPU stage (15..30) generates the
/// CPU route's greedy tokens wherever the CPU route's top two differ by at least 1e-2 (up to
/// the first step where they differ, past which the two continue different texts), and its
/// accuracy is printed and held to the GPU's bar.
#[test]
fn a_route_of_cpu_and_gpu_stages_generates_the_cpu_routes_tokens_where_the_margin_is_clear() {
    if !have_gpu() {
        return;
    }
    let exact = reference("smollm2-q4_1-exact.json");
    let cpu_flags = ["--device", "cpu", "--numerics", "exact"];
    let (front, cpu_back, gpu_back) =
        (Workers::start(&[0, 15], &cpu_flags), Workers::start(&[15, 30], &cpu_flags), Workers::start(&[15, 30], &["--device", "gpu"]));
    let (cpu_route, mixed_route) = (format!("{},{}", front.route(), cpu_back.route()), format!("{},{}", front.route(), gpu_back.route()));
    // Without --any-engine a run takes only a route of the engine its flags name.
    let out = dgr()
        .args(["generate", "-n", "1", "-p", "hi", "--route", &mixed_route])
        .args(cpu_flags)
        .arg("--model")
        .arg(model())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success() && err.contains("but this run asks for gguf-cpu-exact (--any-engine runs on it)"), "{err}");
    // |Δ logprob| against the float64 computation while the mixed route follows the reference's
    // tokens, and against the CPU route (exact numerics, ~1e-6 from float64) while it follows
    // that route's.
    let (mut to_exact, mut to_cpu) = (Vec::new(), Vec::new());
    for c in exact["completions"].as_array().unwrap().iter().take(2) {
        let prompt = c["prompt"].as_str().unwrap();
        let (cpu, mixed) = (generate(&cpu_route, prompt), generate(&mixed_route, prompt));
        assert_eq!(mixed["prompt_tokens"], c["prompt_tokens"], "the reference's prompt");
        let (want, got) = (ids(&cpu["tokens"]), ids(&mixed["tokens"]));
        assert_eq!(got.len(), 32);
        let logprob = |v: &serde_json::Value, i: usize| v["logprobs"][i].as_f64().unwrap();
        for i in 0..32 {
            let top = &cpu["top_logprobs"][i];
            let margin = top[0][1].as_f64().unwrap() - top[1][1].as_f64().unwrap();
            if got[i] != want[i] {
                assert!(
                    margin < 1e-2,
                    "{}: step {i}: the mixed route chose {} where the CPU route chose {} by a margin of {margin}",
                    c["name"],
                    got[i],
                    want[i]
                );
                break;
            }
            to_cpu.push((logprob(&mixed, i) - logprob(&cpu, i)).abs());
        }
        for (i, step) in c["steps"].as_array().unwrap().iter().enumerate().take_while(|(i, s)| s["id"].as_u64() == Some(got[*i])) {
            to_exact.push((logprob(&mixed, i) - step["logprob"].as_f64().unwrap()).abs());
        }
    }
    let mean = |d: &[f64]| d.iter().sum::<f64>() / d.len().max(1) as f64;
    println!(
        "CPU 0..15 + GPU 15..30 route of SmolLM2: mean |Δ logprob| {:.7} vs float64 over the {} steps on the reference's tokens, {:.7} vs the CPU route over {} steps",
        mean(&to_exact),
        to_exact.len(),
        mean(&to_cpu),
        to_cpu.len()
    );
    assert!(to_cpu.len() >= 32, "the mixed route followed the CPU route for only {} steps", to_cpu.len());
    assert!(!to_exact.is_empty() && mean(&to_exact) <= 1e-3, "the mixed route's mean |Δ logprob| from float64 {} > 1e-3", mean(&to_exact));
    assert!(mean(&to_cpu) <= 1e-3, "the mixed route's mean |Δ logprob| from the CPU route {} > 1e-3", mean(&to_cpu));
}

/// A tracker whose workers cover the model only by mixing engines (the CPU holds layers 0..15,
/// the GPU and the CPU hold 15..30) routes a request that asks for any engine over a mix, and
/// names it by layer; when the GPU stage is lost, the replay computes 15..30 on a GPU again
/// (though a CPU worker there looks cheaper), so its tokens are those of a fault-free route of
/// the same engines.
#[cfg(feature = "fault-injection")]
#[test]
fn a_tracker_plans_a_mixed_route_and_its_replay_keeps_each_layers_engine() {
    use std::time::Duration;
    if !have_gpu() {
        return;
    }
    let prompt = "The quick brown fox";
    let cpu = ["--device", "cpu", "--numerics", "exact"];
    let (front, back) = (Workers::start(&[0, 15], &cpu), Workers::start(&[15, 30], &["--device", "gpu"]));
    let want = generate_n(&format!("{},{}", front.route(), back.route()), prompt, 8);
    let engine = want["engine"].as_str().unwrap().to_string();
    assert!(engine.starts_with("gguf-cpu-exact@0..15+gguf-gpu.") && engine.ends_with("-exact@15..30"), "{engine}");

    let t = Tracker::start("gpu-mixed", &[]);
    let step = |us: &'static str| ("DGR_FAULT_STEP_US_PER_LAYER", us);
    let head = Worker::start_with_env(&t, (0, 15), "head", &cpu, &[step("100")]);
    // The planner takes the fast-looking GPU stage first; its GPU goes just before its fourth step.
    let gpu = ["--device", "gpu"];
    let lost = Worker::start_with_env(&t, (15, 30), "lost", &gpu, &[step("100"), ("DGR_FAULT_LOSE_DEVICE_AT_STEP", "3")]);
    let spare = Worker::start_with_env(&t, (15, 30), "spare", &gpu, &[step("100000")]);
    let cpu_tail = Worker::start_with_env(&t, (15, 30), "cpu-tail", &cpu, &[step("50000")]);
    t.wait_live(&[&head.id, &lost.id, &spare.id, &cpu_tail.id], Duration::from_secs(30), "the four workers");
    // Asked for the CPU's engine, the tracker routes over CPU workers alone.
    let cpu_only = t.generate(&[&cpu[..], &["--prompt", prompt, "--max-tokens", "2", "--ignore-eos"]].concat());
    assert_eq!(cpu_only["engine"], "gguf-cpu-exact", "{cpu_only}");

    let got = t.generate(&["--any-engine", "--prompt", prompt, "--max-tokens", "8", "--ignore-eos"]);
    assert_eq!(got["tokens"], want["tokens"], "the replayed mixed route's tokens: {got}");
    assert_eq!(got["engine"], engine.as_str(), "{got}");
    let recoveries = got["recoveries"].as_array().unwrap_or_else(|| panic!("no recoveries: {got}"));
    assert_eq!((recoveries.len(), recoveries[0]["kind"].as_str()), (1, Some("device_lost")), "{got}");
    assert_eq!(got["worker_ids"], serde_json::json!([head.id, spare.id]), "the replay's route: {got}");
    // The ledger keeps each request under its route's engine.
    let by_key = t.usage("key");
    let engines: Vec<&str> = by_key["rows"].as_array().unwrap().iter().filter_map(|r| r["engine"].as_str()).collect();
    assert!(engines.contains(&engine.as_str()) && engines.contains(&"gguf-cpu-exact"), "{by_key}");
    println!("a mixed route {engine} replayed after {} tokens onto a GPU again: {}", recoveries[0]["at_token"], got["text"]);
}

/// `dgr up` with `--device` as given, its workers' engines and layers as the tracker lists
/// them, in layer order, the tokens of a request through it (any engine, as the gateway asks),
/// and what it logged.
fn up(device: &[&str]) -> (Vec<(String, u64, u64)>, serde_json::Value, String) {
    let state = std::env::temp_dir().join(format!("dgr-gpu-up-{}-{}", std::process::id(), device.join("-")));
    let _ = std::fs::remove_dir_all(&state);
    let mut cmd = dgr();
    cmd.args(["up", "--listen", "127.0.0.1:0"]).args(device).arg("--model").arg(model()).env("DGR_STATE_DIR", &state);
    let (mut child, ready, log) = common::swarm::spawn_ready(cmd, "dgr up");
    // What the test asks of the swarm is read before anything can fail, so dgr up is always stopped.
    let tracker = ready["tracker"].as_str().unwrap_or_default().to_string();
    let swarm = dgr().args(["swarm", "--tracker", &tracker, "--format", "json"]).output().unwrap();
    let args =
        ["generate", "--tracker", &tracker, "--any-engine", "--format", "json", "-p", "The quick brown fox", "-n", "8", "--ignore-eos"];
    let generated = dgr().args(args).arg("--model").arg(model()).output().unwrap();
    // SIGINT, as Ctrl-C: dgr up stops its workers and tracker.
    // SAFETY: kill(2) on our own child's pid, which has not been waited for, so not reused.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let status = child.wait().unwrap();
    let _ = std::fs::remove_dir_all(&state);
    let log = String::from_utf8_lossy(&log.lock().unwrap()).into_owned();
    assert!(status.success(), "dgr up exited {status}: {log}");
    let swarm: serde_json::Value = serde_json::from_slice(&swarm.stdout).unwrap();
    let mut workers: Vec<(String, u64, u64)> = swarm["models"][0]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["engine"].as_str().unwrap().to_string(), w["layers"][0].as_u64().unwrap(), w["layers"][1].as_u64().unwrap()))
        .collect();
    workers.sort_by_key(|w| w.1);
    let out = serde_json::from_slice(&generated.stdout)
        .unwrap_or_else(|e| panic!("generate through dgr up {device:?}: {e}: {}", String::from_utf8_lossy(&generated.stderr)));
    (workers, out, log)
}

/// `dgr up` on a machine whose only GPU is a software one runs on the CPU by default and on that
/// GPU when asked; a GPU whose memory cannot hold the model takes some of the last layers that
/// fit (as many as the devices' measured steps say), the CPU the others, and requests run over
/// the mixed route.
#[test]
fn dgr_up_runs_on_the_gpu_asked_for_and_puts_what_does_not_fit_there_on_the_cpu() {
    if !have_gpu() {
        return;
    }
    let engines = |w: &[(String, u64, u64)]| w.iter().map(|w| w.0.clone()).collect::<Vec<_>>();
    let (by_default, ..) = up(&[]);
    assert_eq!(engines(&by_default), ["gguf-cpu-fast", "gguf-cpu-fast"], "{by_default:?}");
    let (asked, all_gpu, _) = up(&["--device", "gpu"]);
    assert!(asked.iter().all(|w| w.0.starts_with("gguf-gpu.")) && asked.len() == 2, "{asked:?}");
    // SmolLM2's weights are 92 MiB; in 60 MiB three quarters hold the head and a few layers.
    let (mixed, out, log) = up(&["--device", "gpu", "--gpu-memory-mb", "60"]);
    let cut = mixed[1].1;
    assert!(mixed.len() == 2 && mixed[0] == ("gguf-cpu-fast".into(), 0, cut) && mixed[1].2 == 30 && (1..30).contains(&cut), "{mixed:?}");
    assert_eq!(mixed[1].0, asked[1].0, "the GPU's engine: {mixed:?}");
    assert_eq!(out["engine"], format!("gguf-cpu-fast@0..{cut}+{}@{cut}..30", asked[1].0).as_str(), "{out}");
    assert_eq!(out["tokens"].as_array().map(Vec::len), Some(8), "{out}");
    // The GPU takes no more layers than it has room for, as many as the measured steps say.
    let timed = log.lines().find(|l| l.contains("a decode step takes")).unwrap_or_else(|| panic!("no measured step in: {log}"));
    let room: u64 = log.split("(room for ").nth(1).and_then(|r| r.split(' ').next()?.parse().ok()).unwrap_or_else(|| panic!("{log}"));
    assert!(30 - cut <= room, "{room} layers fit; the GPU took {}: {log}", 30 - cut);
    println!(
        "dgr up with 60 MiB of GPU memory (room for {room} layers): layers 0..{cut} on the CPU, {cut}..30 on the GPU: {}",
        out["text"]
    );
    println!("  {timed}");
    assert!(all_gpu["engine"].as_str().is_some_and(|e| e.starts_with("gguf-gpu.")), "{all_gpu}");
}

/// A GPU that is not there, and numerics the GPU has no kernels for, are refused at start,
/// naming what is there.
#[test]
fn an_adapter_that_is_not_there_is_refused_at_start() {
    if !have_gpu() {
        return;
    }
    let refused = |flags: &[&str], want: &str| {
        let out = dgr().args(["generate", "-n", "1", "-p", "hi"]).args(flags).arg("--model").arg(model()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{flags:?}: {err}");
    };
    refused(&["--device", "gpu:99"], "no GPU adapter 99: this machine has");
    refused(&["--device", "gpu", "--numerics", "fast"], "numerics fast is not available on this engine; available: exact");
}

/// `dgr devices --time-model` times a decode step on each adapter listed, or with `--only N` on
/// adapter N alone (what `dgr up` asks for: a step on a software adapter takes seconds).
#[test]
fn dgr_devices_times_the_adapters_asked_for() {
    if !have_gpu() {
        return;
    }
    let listed = |only: &[&str]| -> Vec<serde_json::Value> {
        let out = dgr().args(["devices", "--time-model"]).arg(model()).args(only).output().unwrap();
        assert!(out.status.success(), "dgr devices {only:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap().as_array().unwrap().clone()
    };
    let timed = |d: &serde_json::Value| d["step_us_per_layer"].as_f64().is_some_and(|us| us > 0.0);
    let all = listed(&[]);
    assert!(!all.is_empty() && all.iter().all(timed), "{all:?}");
    let last = (all.len() - 1).to_string();
    let one = listed(&["--only", &last]);
    assert_eq!(one.len(), all.len());
    assert!(one.iter().enumerate().all(|(i, d)| timed(d) == (i == all.len() - 1)), "{one:?}");
    let none = listed(&["--only", "99"]);
    assert!(none.iter().all(|d| d.get("step_us_per_layer").is_none()), "{none:?}");
}

/// A GPU stage's KV budget fits in the device memory its weights leave, so no session meets an
/// out-of-memory failure mid-way: a budget asked for that does not fit is refused at start,
/// naming the bytes, as are weights over `--gpu-memory-mb`; the default shrinks to what fits.
/// The GPU's memory is in the worker's /metrics, and in its heartbeats, so `dgr swarm` shows it.
#[test]
fn a_gpu_stages_kv_budget_fits_its_device_memory_and_the_swarm_sees_it() {
    if !have_gpu() {
        return;
    }
    let refused = |flag: &str, value: &str, want: &str| {
        let out = dgr().args(["worker", "--layers", "0..30", "--device", "gpu", flag, value]).arg("--model").arg(model()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{flag} {value}: {err}");
    };
    // SmolLM2's 30 layers keep 2 × 192 f32 a position each: 46,080 bytes.
    let want = "--kv-tokens 100000000 needs 4608000000000 bytes of GPU memory (46080 a position over the stage's layers)";
    refused("--kv-tokens", "100000000", want);
    // Weights over the memory the stage may take are refused at start too.
    refused("--gpu-memory-mb", "10", "bytes of GPU memory, over --gpu-memory-mb's 10485760");

    let t = Tracker::start("gpu-memory", &[]);
    let w = Worker::start(&t, (0, 30), "gpu", &["--device", "gpu"]);
    let m = common::metrics(w.addr.as_deref().unwrap());
    let kind = |k: &str| m.get(&format!("dgr_worker_device_memory_bytes{{kind=\"{k}\"}}"));
    let (total, used, free) = (kind("total"), kind("used"), kind("free"));
    let (weights, kv) = (m.get("dgr_worker_weight_bytes"), m.get("dgr_worker_kv_bytes_capacity"));
    println!("GPU memory: {total} total, {used} used, {free} free; weights {weights}, KV budget {kv} bytes");
    assert!(used >= weights && free > 0.0 && free + used <= total, "{total} total, {used} used, {free} free, {weights} of weights");
    assert!(kv > 0.0 && kv <= 0.8 * (free + used - weights), "a KV budget of {kv} bytes does not fit");

    let start = std::time::Instant::now();
    loop {
        let seen = t.workers().iter().find(|x| x["worker_id"] == w.id.as_str()).map(|x| x["device_memory_total"].as_f64());
        if seen == Some(Some(total)) {
            break;
        }
        assert!(start.elapsed() < std::time::Duration::from_secs(15), "dgr swarm shows {seen:?} for the GPU's {total} bytes");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let table = dgr().args(["swarm", "--tracker", &t.addr]).output().unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    let shown = format!(" / {}", total as u64 >> 20);
    assert!(table.contains("GPU MiB free") && table.contains(&shown), "{table}");
}

/// A stage whose GPU is lost mid-session fails its sessions with a typed error (`device_lost`)
/// and exits non-zero, naming why; the driver replays the session on another worker of the same
/// engine, and the tokens are a fault-free run's.
#[cfg(feature = "fault-injection")]
#[test]
fn a_lost_gpu_fails_its_sessions_and_the_driver_replays_them_elsewhere() {
    use std::time::Duration;
    if !have_gpu() {
        return;
    }
    // The routed run asks for the GPU's engine, as the one-process run computes with.
    let args = ["--prompt", "The quick brown fox", "--max-tokens", "8", "--ignore-eos", "--device", "gpu"];
    let want = dgr_json(&[&["generate", "--format", "json"][..], &args].concat());
    let t = Tracker::start("gpu-lost", &[]);
    // The planner takes the fast-looking worker first; its GPU goes just before its fourth step.
    let fast = [("DGR_FAULT_STEP_US_PER_LAYER", "100"), ("DGR_FAULT_LOSE_DEVICE_AT_STEP", "3")];
    let mut lost = Worker::start_with_env(&t, (0, 30), "lost", &["--device", "gpu"], &fast);
    let spare = Worker::start_with_env(&t, (0, 30), "spare", &["--device", "gpu"], &[("DGR_FAULT_STEP_US_PER_LAYER", "100000")]);
    t.wait_live(&[&lost.id, &spare.id], Duration::from_secs(20), "both GPU workers");

    let got = t.generate(&args);
    assert_eq!(got["tokens"], want["tokens"], "the replayed run's tokens: {got}");
    let recoveries = got["recoveries"].as_array().unwrap_or_else(|| panic!("no recoveries: {got}"));
    assert_eq!(recoveries.len(), 1, "{got}");
    assert_eq!(recoveries[0]["kind"], "device_lost", "{got}");
    assert_eq!(recoveries[0]["worker_id"], lost.id.as_str(), "{got}");

    let status = lost.child.wait().unwrap();
    assert!(!status.success(), "the worker whose GPU was lost exited {status}");
    assert!(lost.log().contains("the GPU was lost mid-step"), "{}", lost.log());
    println!("recovered from a lost GPU after {} tokens: {}", recoveries[0]["at_token"], got["text"]);
}

//! Finding and opening the model a command runs on: the `--model` argument every command that
//! computes takes, the benchmarks' and the binary's alike.

use crate::error::{BenchError, Result};
use dgr_engine::{Device, EngineId, EngineSpec, KvDtype, Numerics};
use dgr_gguf::Gguf;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args, Clone, Debug)]
pub struct ModelArg {
    /// GGUF model file, or a Transformers checkpoint directory (config.json, *.safetensors,
    /// tokenizer.json) [default: the cached SmolLM2-135M-Instruct Q4_1, fetched by scripts/fetch-model.sh]
    #[arg(long, short = 'm', env = "DGR_MODEL")]
    pub model: Option<PathBuf>,
}

impl ModelArg {
    pub fn path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => {
                let p = dgr_gguf::default_model_path();
                if !p.exists() {
                    return Err(BenchError::Usage(format!(
                        "no --model given and the default model is not at {}; fetch it with scripts/fetch-model.sh \
                         (set DGR_MODEL_DIR to choose where it is cached)",
                        p.display()
                    )));
                }
                Ok(p)
            }
        }
    }

    pub fn open(&self) -> Result<Arc<Gguf>> {
        let p = self.path()?;
        let g = dgr_hf::open_any(&p).map_err(|source| BenchError::Open { path: p.display().to_string(), source })?;
        Ok(Arc::new(g))
    }

    /// The tokenizer of the model, opened as `g`.
    pub fn tokenizer(&self, g: &Gguf) -> Result<dgr_tokenizer::Tokenizer> {
        let p = self.path()?;
        dgr_tokenizer::Tokenizer::for_model(&p, g).map_err(|source| BenchError::Tokenizer { path: p.display().to_string(), source })
    }
}

/// `--device`, `--numerics` and `--kv-dtype` on every command that computes: where the layers
/// run, how activations meet the weights, and how keys and values are cached. All are part of
/// the engine's id, so workers that differ in any never share a batch or a route.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct NumericsArg {
    /// Where the layers compute: auto (the first hardware GPU, else the CPU; a software Vulkan
    /// device such as lavapipe is never picked), cpu, or gpu / gpu:N (the Nth adapter; `dgr
    /// devices` lists them)
    #[arg(long, default_value = "auto")]
    pub device: Device,
    /// fast: 16-bit integer activations where the weights are integer codes (about 1/100 of
    /// llama.cpp's distance from the float64 computation, and faster); exact: f32 activations,
    /// within ~1e-6 of it. Float weights compute exactly in both. [default: fast on the CPU,
    /// exact on a GPU (its only numerics)]
    #[arg(long, value_parser = names::<Numerics>(Numerics::ALL.iter().map(|n| n.name())))]
    pub numerics: Option<Numerics>,
    /// How the KV cache stores keys and values: f32 as computed; f16 (half the bytes); q8_0,
    /// int8 in blocks of 32 with an f16 scale (34 bytes per 32 values, 0.27 of f32's). Scores
    /// and sums stay f32; README's KV dtype table has each one's measured accuracy
    #[arg(long, default_value = "f32", value_parser = names::<KvDtype>(KvDtype::ALL.iter().map(|n| n.name())))]
    pub kv_dtype: KvDtype,
}

/// The adapters as `dgr devices` lists them, from a child process, so that a process that
/// computes on the CPU never loads a GPU driver (Mesa's software one alone is ~50 MB resident);
/// none where the child cannot run.
fn listed_devices() -> &'static [serde_json::Value] {
    static LISTED: std::sync::OnceLock<Vec<serde_json::Value>> = std::sync::OnceLock::new();
    LISTED.get_or_init(|| {
        let listed = std::env::current_exe().and_then(|exe| std::process::Command::new(exe).arg("devices").output());
        match listed {
            Ok(out) if out.status.success() => serde_json::from_slice(&out.stdout).unwrap_or_default(),
            _ => Vec::new(),
        }
    })
}

/// The bytes of GPU `index`'s memory a process may use: what `dgr devices` lists free there,
/// capped by `cap_mb` (a `--gpu-memory-mb`); `None` where neither says.
pub fn gpu_room(index: usize, cap_mb: Option<u64>) -> Option<u64> {
    let free = listed_devices().get(index).and_then(|d| d["memory_free"].as_u64());
    free.into_iter().chain(cap_mb.map(|mb| mb.saturating_mul(1 << 20))).min()
}

/// A clap parser that takes exactly `names` (listing them when refused), parsed as a `T`.
fn names<T>(names: impl Iterator<Item = &'static str>) -> impl clap::builder::TypedValueParser<Value = T>
where
    T: std::str::FromStr + Clone + Send + Sync + 'static,
    T::Err: std::error::Error + Send + Sync + 'static,
{
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(names).try_map(|s| s.parse::<T>())
}

impl NumericsArg {
    /// The adapters this process can compute on, as `dgr devices` prints them: a JSON array of
    /// `{index, name, vendor, device, driver, software, engine, memory_total, memory_free}` (the
    /// device memory in bytes, null where the platform does not say).
    pub fn devices_json() -> serde_json::Value {
        let adapters = dgr_engine::adapters().into_iter().enumerate().map(|(i, a)| {
            let engine = EngineId {
                format: dgr_engine::Format::Gguf,
                backend: dgr_engine::BackendKind::Gpu,
                numerics: Numerics::Exact,
                kv: KvDtype::F32,
                adapter: Some(a.digest()),
            };
            let memory = dgr_engine::adapter_memory(i).ok().flatten();
            serde_json::json!({
                "index": i,
                "name": a.name,
                "vendor": a.vendor,
                "device": a.device,
                "driver": format!("{} {}", a.driver, a.driver_info),
                "software": a.software,
                "engine": engine.to_string(),
                "memory_total": memory.map(|m| m.total),
                "memory_free": memory.map(|m| m.free),
            })
        });
        serde_json::Value::Array(adapters.collect())
    }

    /// The adapter this run computes on, as `dgr devices` lists it; null on the CPU.
    pub fn adapter_json(&self) -> serde_json::Value {
        let spec = self.spec(1);
        match spec.backend {
            dgr_engine::BackendKind::Cpu => serde_json::Value::Null,
            dgr_engine::BackendKind::Gpu => Self::devices_json()[spec.adapter].clone(),
        }
    }

    /// The flags of the engine `id` computes with (a GPU's by its adapter's place here).
    pub fn of(id: EngineId) -> NumericsArg {
        let device = match id.adapter {
            Some(digest) => Device::Gpu(dgr_engine::adapters().iter().position(|a| a.digest() == digest).unwrap_or(0)),
            None => Device::Cpu,
        };
        NumericsArg { device, numerics: Some(id.numerics), kv_dtype: id.kv }
    }

    /// `--device`, with `auto` resolved over the adapters `listed_devices` finds.
    pub fn device(&self) -> Device {
        match self.device {
            // An adapter not said to be hardware counts as software: never picked.
            Device::Auto => Device::auto_among(listed_devices().iter().map(|a| a["software"] != false)),
            d => d,
        }
    }

    /// The engine spec for `threads` threads on this device, in these numerics and KV dtype.
    pub fn spec(&self, threads: usize) -> EngineSpec {
        EngineSpec { kv: self.kv_dtype, ..EngineSpec::threads(threads) }.on(self.device(), self.numerics)
    }

    /// The engine a run on this device, in these numerics and KV dtype, computes with (a GPU's
    /// named by its adapter here): what a routed run asks its route for.
    pub fn engine(&self, format: dgr_engine::Format) -> EngineId {
        let spec = self.spec(1);
        let adapter = match spec.backend {
            dgr_engine::BackendKind::Cpu => None,
            dgr_engine::BackendKind::Gpu => dgr_engine::adapters().get(spec.adapter).map(|a| a.digest()),
        };
        EngineId { format, backend: spec.backend, numerics: spec.numerics, kv: spec.kv, adapter }
    }

    /// The numerics asked for, or the device's default.
    pub fn numerics(&self) -> Numerics {
        self.spec(1).numerics
    }

    /// The flags that start a `dgr worker` on this device in these numerics and KV dtype,
    /// refused here first (before any worker starts) if that backend cannot compute in them.
    pub fn worker_flags(&self) -> std::result::Result<[String; 6], dgr_engine::EngineError> {
        let spec = self.spec(1);
        dgr_engine::check_numerics(spec.backend, spec.numerics)?;
        let device = match spec.backend {
            dgr_engine::BackendKind::Cpu => Device::Cpu,
            dgr_engine::BackendKind::Gpu => Device::Gpu(spec.adapter),
        };
        Ok([
            "--device".into(),
            device.to_string(),
            "--numerics".into(),
            spec.numerics.name().into(),
            "--kv-dtype".into(),
            self.kv_dtype.name().into(),
        ])
    }
}

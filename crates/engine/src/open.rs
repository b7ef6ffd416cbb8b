//! The one way to open an engine over a model's layers: every caller (the worker, `generate`,
//! `score`, the benches, the tests) says what it wants in an [`EngineSpec`] and gets a
//! [`Stage`] on that backend, so none of them names a backend's types.

use crate::backend::{cpu, gpu};
use crate::model::Model;
use crate::{BackendKind, EngineError, Isa, KvDtype, Numerics, Stage};
use dgr_gguf::Gguf;
use std::ops::Range;
use std::sync::Arc;

/// Where a stage computes, as `--device` names it: `auto` (the first hardware GPU adapter, else
/// the CPU; a software adapter such as lavapipe is never picked), `cpu`, or `gpu` / `gpu:N`
/// (adapter N in `adapters()` order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Auto,
    Cpu,
    Gpu(usize),
}

impl Device {
    /// The backend and adapter this names on this machine.
    pub fn resolve(self) -> (BackendKind, usize) {
        match self {
            Device::Cpu => (BackendKind::Cpu, 0),
            Device::Gpu(n) => (BackendKind::Gpu, n),
            Device::Auto => Device::auto_among(gpu::adapters().iter().map(|a| a.software)).resolve(),
        }
    }

    /// What `auto` picks among adapters listed in `adapters()` order, each said to be a software
    /// one or not: the first hardware adapter, else the CPU.
    pub fn auto_among(software: impl IntoIterator<Item = bool>) -> Device {
        match software.into_iter().position(|s| !s) {
            Some(n) => Device::Gpu(n),
            None => Device::Cpu,
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "gpu" => Ok(Device::Gpu(0)),
            _ => match s.strip_prefix("gpu:").map(str::parse) {
                Some(Ok(n)) => Ok(Device::Gpu(n)),
                _ => Err(format!("unknown device {s:?} (known: auto, cpu, gpu, gpu:N)")),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Auto => f.write_str("auto"),
            Device::Cpu => f.write_str("cpu"),
            Device::Gpu(n) => write!(f, "gpu:{n}"),
        }
    }
}

/// What to compute a model's layers with.
#[derive(Clone, Copy, Debug)]
pub struct EngineSpec {
    pub backend: BackendKind,
    pub numerics: Numerics,
    /// How sequences' keys and values are stored (f32 unless asked).
    pub kv: KvDtype,
    pub threads: usize,
    /// The instruction set to use; `None` picks the best this CPU has.
    pub isa: Option<Isa>,
    /// Which GPU adapter (in `adapters()` order), on the GPU.
    pub adapter: usize,
}

impl Default for EngineSpec {
    fn default() -> Self {
        EngineSpec {
            backend: BackendKind::Cpu,
            numerics: Numerics::default(),
            kv: KvDtype::F32,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            isa: None,
            adapter: 0,
        }
    }
}

impl EngineSpec {
    /// The default spec on `threads` threads.
    pub fn threads(threads: usize) -> EngineSpec {
        EngineSpec { threads, ..EngineSpec::default() }
    }

    /// This spec on `device` (resolved here), in `numerics` when given, else the backend's
    /// default: fast where it has it (the CPU), exact where that is all it has (a GPU).
    pub fn on(self, device: Device, numerics: Option<Numerics>) -> EngineSpec {
        let (backend, adapter) = device.resolve();
        let available = available_numerics(backend);
        let default = if available.contains(&Numerics::default()) { Numerics::default() } else { available[0] };
        EngineSpec { backend, adapter, numerics: numerics.unwrap_or(default), ..self }
    }
}

/// The numerics `backend` can compute with.
pub fn available_numerics(backend: BackendKind) -> &'static [Numerics] {
    match backend {
        BackendKind::Cpu => cpu::NUMERICS,
        BackendKind::Gpu => gpu::NUMERICS,
    }
}

/// Every engine this build can open here (each backend with a device here, in each numerics it
/// can run, with each KV dtype; the GPU on its first adapter), with the default
/// threads and instruction set: the list the test suites run one body over, so a new backend,
/// numerics or KV dtype is tested by being registered.
pub fn registered_specs() -> Vec<EngineSpec> {
    BackendKind::ALL
        .iter()
        .filter(|&&b| b == BackendKind::Cpu || !gpu::adapters().is_empty())
        .flat_map(|&backend| available_numerics(backend).iter().map(move |&numerics| (backend, numerics)))
        .flat_map(|(backend, numerics)| KvDtype::ALL.iter().map(move |&kv| EngineSpec { backend, numerics, kv, ..EngineSpec::default() }))
        .collect()
}

/// Refuses numerics `backend` cannot compute with here, naming those it can.
pub fn check_numerics(backend: BackendKind, numerics: Numerics) -> Result<(), EngineError> {
    let available = available_numerics(backend);
    match available.contains(&numerics) {
        true => Ok(()),
        false => Err(EngineError::NumericsUnavailable { asked: numerics, available }),
    }
}

/// Opens layers `layers` of `model` as `spec` says: only those layers' tensors, plus the
/// embedding when the range starts at 0 and the final norm and head when it ends at the last
/// layer. Numerics the backend cannot run are refused before anything is loaded.
pub fn open_engine(model: Arc<Gguf>, layers: Range<usize>, spec: EngineSpec) -> Result<Stage, EngineError> {
    check_numerics(spec.backend, spec.numerics)?;
    Ok(match spec.backend {
        BackendKind::Cpu => Stage::Cpu(Model::open(model, layers, spec)?),
        BackendKind::Gpu => Stage::Gpu(Model::open(model, layers, spec)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_the_first_hardware_adapter_and_never_a_software_one() {
        assert_eq!(Device::auto_among([true, false, false]), Device::Gpu(1));
        assert_eq!(Device::auto_among([true]), Device::Cpu);
        assert_eq!(Device::auto_among([]), Device::Cpu);
    }

    #[test]
    fn every_numerics_opens_and_a_refusal_names_the_available_ones() {
        let g = Arc::new(Gguf::from_bytes(crate::synth::SynthSpec::default().to_gguf().unwrap()).unwrap());
        let specs = registered_specs();
        let ids: Vec<_> = specs.iter().filter(|s| s.backend == BackendKind::Cpu).map(|s| (s.numerics, s.kv)).collect();
        let want: Vec<_> = [Numerics::Exact, Numerics::Fast].iter().flat_map(|&n| KvDtype::ALL.iter().map(move |&kv| (n, kv))).collect();
        assert_eq!(ids, want);
        for spec in specs {
            let id = open_engine(g.clone(), 0..1, spec).unwrap().engine();
            assert_eq!((id.numerics, id.kv), (spec.numerics, spec.kv));
        }
        let e = EngineError::NumericsUnavailable { asked: Numerics::Fast, available: &[Numerics::Exact] };
        assert_eq!(e.to_string(), "numerics fast is not available on this engine; available: exact");
    }
}

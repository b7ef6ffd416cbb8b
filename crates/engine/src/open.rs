//! The one way to open an engine over a model's layers: every caller (the worker, `generate`,
//! `score`, the benches, the tests) says what it wants in an [`EngineSpec`] and gets the
//! backend's engine, so none of them names a backend's types.

use crate::backend::cpu::{self, Cpu};
use crate::model::Model;
use crate::{BackendKind, EngineError, Isa, KvDtype, Numerics};
use dgr_gguf::Gguf;
use std::ops::Range;
use std::sync::Arc;

/// One layer range of a model on the CPU backend: what [`open_engine`] opens.
pub type Stage = Model<Cpu>;

impl Stage {
    pub fn isa(&self) -> Isa {
        self.backend().isa()
    }

    pub fn threads(&self) -> usize {
        self.backend().threads()
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
}

impl Default for EngineSpec {
    fn default() -> Self {
        EngineSpec {
            backend: BackendKind::Cpu,
            numerics: Numerics::default(),
            kv: KvDtype::F32,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            isa: None,
        }
    }
}

impl EngineSpec {
    /// The default spec on `threads` threads.
    pub fn threads(threads: usize) -> EngineSpec {
        EngineSpec { threads, ..EngineSpec::default() }
    }
}

/// The numerics `backend` can compute with on this machine.
pub fn available_numerics(backend: BackendKind) -> &'static [Numerics] {
    match backend {
        BackendKind::Cpu => cpu::NUMERICS,
    }
}

/// Every engine this build can open here (each backend in each numerics it can run, with each
/// KV dtype), with the default threads and instruction set: the list the test suites run one
/// body over, so a new backend, numerics or KV dtype is tested by being registered.
pub fn registered_specs() -> Vec<EngineSpec> {
    BackendKind::ALL
        .iter()
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
    Stage::open(model, layers, spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_numerics_opens_and_a_refusal_names_the_available_ones() {
        let g = Arc::new(Gguf::from_bytes(crate::synth::SynthSpec::default().to_gguf().unwrap()).unwrap());
        let specs = registered_specs();
        let ids: Vec<_> = specs.iter().map(|s| (s.numerics, s.kv)).collect();
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

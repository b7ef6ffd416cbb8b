//! What [`crate::open_engine`] opens: one layer range of a model on the backend the spec asked
//! for, and its sequences' state, as one type each whatever the backend, so that a worker, the
//! driver, the benches and the tests name neither backend's types.

use crate::backend::cpu::kv::KvCache as CpuKv;
use crate::backend::cpu::Cpu;
use crate::backend::gpu::{AdapterIdentity, DeviceMemory, Gpu, GpuKv};
use crate::model::Model;
use crate::{Engine, EngineError, EngineId, Isa, ModelConfig, SeqInput, SeqOutput, SeqState};
use dgr_gguf::Gguf;
use std::ops::Range;
use std::sync::Arc;

/// One layer range of a model, on the CPU or on a GPU.
pub enum Stage {
    Cpu(Model<Cpu>),
    Gpu(Model<Gpu>),
}

/// A sequence's KV cache on the stage that made it.
pub enum KvCache {
    Cpu(CpuKv),
    Gpu(GpuKv),
}

/// Runs `$body` with `$m` bound to the stage's model, whichever backend it runs on.
macro_rules! each {
    ($stage:expr, $m:ident => $body:expr) => {
        match $stage {
            Stage::Cpu($m) => $body,
            Stage::Gpu($m) => $body,
        }
    };
}

/// Likewise for a KV cache.
macro_rules! each_kv {
    ($kv:expr, $k:ident => $body:expr) => {
        match $kv {
            KvCache::Cpu($k) => $body,
            KvCache::Gpu($k) => $body,
        }
    };
}

fn foreign() -> EngineError {
    EngineError::BadInput("KV cache belongs to another stage".into())
}

impl Stage {
    pub fn config(&self) -> &ModelConfig {
        each!(self, m => m.config())
    }

    pub fn layers(&self) -> Range<usize> {
        each!(self, m => m.layers())
    }

    pub fn is_first(&self) -> bool {
        each!(self, m => m.is_first())
    }

    pub fn is_last(&self) -> bool {
        each!(self, m => m.is_last())
    }

    pub fn gguf(&self) -> &Arc<Gguf> {
        each!(self, m => m.gguf())
    }

    pub fn engine(&self) -> EngineId {
        each!(self, m => m.engine())
    }

    pub fn weight_bytes(&self) -> usize {
        each!(self, m => m.weight_bytes())
    }

    pub fn kv_position_bytes(&self) -> usize {
        each!(self, m => m.kv_position_bytes())
    }

    /// The CPU's instruction set, on the CPU.
    pub fn isa(&self) -> Option<Isa> {
        match self {
            Stage::Cpu(m) => Some(m.backend().isa()),
            Stage::Gpu(_) => None,
        }
    }

    /// The CPU's threads, on the CPU.
    pub fn threads(&self) -> Option<usize> {
        match self {
            Stage::Cpu(m) => Some(m.backend().threads()),
            Stage::Gpu(_) => None,
        }
    }

    /// The GPU adapter, on a GPU.
    pub fn adapter(&self) -> Option<&AdapterIdentity> {
        match self {
            Stage::Cpu(_) => None,
            Stage::Gpu(m) => Some(m.backend().identity()),
        }
    }

    /// The GPU's memory, on a GPU whose backend reports it.
    pub fn device_memory(&self) -> Option<DeviceMemory> {
        match self {
            Stage::Cpu(_) => None,
            Stage::Gpu(m) => m.backend().memory(),
        }
    }

    /// A fresh, empty KV cache over all of the stage's layers (see `Model::new_kv`).
    pub fn new_kv(&self, capacity: usize) -> KvCache {
        match self {
            Stage::Cpu(m) => KvCache::Cpu(m.new_kv(capacity)),
            Stage::Gpu(m) => KvCache::Gpu(m.new_kv(capacity)),
        }
    }

    /// A fresh KV cache over `sub`, a part of the stage's layers (see `Model::new_kv_for`).
    pub fn new_kv_for(&self, capacity: usize, sub: Range<usize>) -> Result<KvCache, EngineError> {
        Ok(match self {
            Stage::Cpu(m) => KvCache::Cpu(m.new_kv_for(capacity, sub)?),
            Stage::Gpu(m) => KvCache::Gpu(m.new_kv_for(capacity, sub)?),
        })
    }

    pub fn check(&self, s: &SeqInput<KvCache>) -> Result<usize, EngineError> {
        match (self, &*s.kv) {
            (Stage::Cpu(m), KvCache::Cpu(kv)) => m.check_parts(kv, &s.input),
            (Stage::Gpu(m), KvCache::Gpu(kv)) => m.check_parts(kv, &s.input),
            _ => Err(foreign()),
        }
    }

    pub fn forward(&self, batch: &mut [SeqInput<KvCache>]) -> Result<Vec<SeqOutput>, EngineError> {
        match self {
            Stage::Cpu(m) => m.forward(&mut unwrap(batch, |kv| if let KvCache::Cpu(k) = kv { Some(k) } else { None })?),
            Stage::Gpu(m) => m.forward(&mut unwrap(batch, |kv| if let KvCache::Gpu(k) = kv { Some(k) } else { None })?),
        }
    }
}

/// The batch with each KV cache as the backend's own, or an error if one is another backend's.
fn unwrap<'b, K>(
    batch: &'b mut [SeqInput<KvCache>],
    own: impl Fn(&'b mut KvCache) -> Option<&'b mut K>,
) -> Result<Vec<SeqInput<'b, K>>, EngineError> {
    batch.iter_mut().map(|s| Ok(SeqInput { kv: own(&mut *s.kv).ok_or_else(foreign)?, input: s.input, logits: s.logits })).collect()
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.positions()
    }

    pub fn is_empty(&self) -> bool {
        self.positions() == 0
    }
}

impl SeqState for KvCache {
    fn positions(&self) -> usize {
        each_kv!(self, k => k.positions())
    }
    fn capacity(&self) -> usize {
        each_kv!(self, k => k.capacity())
    }
    fn layers(&self) -> Range<usize> {
        each_kv!(self, k => k.layers())
    }
    fn bytes(&self) -> usize {
        each_kv!(self, k => k.bytes())
    }
    fn blockable(&self) -> bool {
        each_kv!(self, k => k.blockable())
    }
    fn read_block(&self, at: usize, n: usize) -> Option<Vec<u8>> {
        each_kv!(self, k => k.read_block(at, n))
    }
    fn write_block(&mut self, n: usize, block: &[u8]) -> Result<(), EngineError> {
        each_kv!(self, k => k.write_block(n, block))
    }
    fn truncate(&mut self, len: usize) -> Result<(), EngineError> {
        each_kv!(self, k => k.truncate(len))
    }
}

impl Engine for Stage {
    type State = KvCache;
    fn id(&self) -> EngineId {
        self.engine()
    }
    fn config(&self) -> &ModelConfig {
        Stage::config(self)
    }
    fn layers(&self) -> Range<usize> {
        Stage::layers(self)
    }
    fn weight_bytes(&self) -> usize {
        Stage::weight_bytes(self)
    }
    fn kv_position_bytes(&self) -> usize {
        Stage::kv_position_bytes(self)
    }
    fn device_memory(&self) -> Option<DeviceMemory> {
        Stage::device_memory(self)
    }
    fn lose_device(&self) {
        if let Stage::Gpu(m) = self {
            m.backend().lose_device();
        }
    }
    fn new_state(&self, capacity: usize, sub: Range<usize>) -> Result<KvCache, EngineError> {
        self.new_kv_for(capacity, sub)
    }
    fn check(&self, s: &SeqInput<KvCache>) -> Result<usize, EngineError> {
        Stage::check(self, s)
    }
    fn forward(&self, batch: &mut [SeqInput<KvCache>]) -> Result<Vec<SeqOutput>, EngineError> {
        Stage::forward(self, batch)
    }
}

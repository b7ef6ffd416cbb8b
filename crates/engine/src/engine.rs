//! The seam between an engine and what drives it: a worker's scheduler and the one-process
//! driver compute through this trait alone: every [`Model`] implements it, whatever its
//! backend, and so does the [`crate::Stage`] `open_engine` gives. The contract each engine keeps: a sequence's
//! output is bitwise independent of what it is batched with and of how the layers are split.

use crate::backend::Backend;
use crate::model::Model;
use crate::{EngineError, EngineId, ModelConfig, SeqInput, SeqOutput};
use std::ops::Range;

/// A sequence's state over the layers it runs on a stage (its KV cache).
pub trait SeqState: Send {
    /// Positions cached (the next row's position).
    fn positions(&self) -> usize;
    /// Most positions it may hold.
    fn capacity(&self) -> usize;
    /// The model's layers this sequence runs on its stage.
    fn layers(&self) -> Range<usize>;
    /// Memory held for the cached positions.
    fn bytes(&self) -> usize;
    /// Whether positions can be copied out and in as blocks (a prefix cache's): false while a
    /// layer keeps only a window of them.
    fn blockable(&self) -> bool;
    /// A copy of positions `at..at + n` of every layer as stored (bytes in the engine's KV
    /// dtype, never re-rounded), or None when they are not all held.
    fn read_block(&self, at: usize, n: usize) -> Option<Vec<u8>>;
    /// Appends `n` positions copied by `read_block` from a state over the same layers of the
    /// same engine: the sequence then computes on exactly as if it had computed them itself.
    fn write_block(&mut self, n: usize, block: &[u8]) -> Result<(), EngineError>;
    /// Keeps only the first `len` positions (a speculative step's rejected drafts dropped): the
    /// sequence then computes on exactly as if it had never computed the others.
    fn truncate(&mut self, len: usize) -> Result<(), EngineError>;
}

/// One stage's layers of a model, computed batched.
pub trait Engine: Send + 'static {
    type State: SeqState;
    /// The engine's id: a compatibility key field, sent in a worker's registration and
    /// boundary schema.
    fn id(&self) -> EngineId;
    fn config(&self) -> &ModelConfig;
    /// The layers this stage holds.
    fn layers(&self) -> Range<usize>;
    /// Bytes of weights the stage reads per forward.
    fn weight_bytes(&self) -> usize;
    /// Bytes one position of a sequence over all of the stage's layers takes in its KV cache.
    fn kv_position_bytes(&self) -> usize;
    /// The memory of the device the stage computes on, where it has one of its own that says.
    fn device_memory(&self) -> Option<crate::DeviceMemory> {
        None
    }
    /// Destroys the stage's GPU device, as a driver reset or a card gone would lose it: for
    /// tests of recovery (a worker built with its `fault-injection` feature). Nothing on the CPU.
    fn lose_device(&self) {}
    /// Fresh state for a sequence running layers `sub` (a part of `layers`), holding at most
    /// `capacity` positions.
    fn new_state(&self, capacity: usize, sub: Range<usize>) -> Result<Self::State, EngineError>;
    /// What `forward` would refuse in this sequence, without running it; its row count if none.
    fn check(&self, s: &SeqInput<Self::State>) -> Result<usize, EngineError>;
    /// Every sequence's rows through its layers, in one batch.
    fn forward(&self, batch: &mut [SeqInput<Self::State>]) -> Result<Vec<SeqOutput>, EngineError>;
}

impl SeqState for crate::backend::cpu::kv::KvCache {
    fn positions(&self) -> usize {
        crate::backend::cpu::kv::KvCache::len(self)
    }
    fn capacity(&self) -> usize {
        crate::backend::cpu::kv::KvCache::capacity(self)
    }
    fn layers(&self) -> Range<usize> {
        crate::backend::cpu::kv::KvCache::layers(self)
    }
    fn bytes(&self) -> usize {
        crate::backend::cpu::kv::KvCache::bytes(self)
    }
    fn blockable(&self) -> bool {
        crate::backend::cpu::kv::KvCache::blockable(self)
    }
    fn read_block(&self, at: usize, n: usize) -> Option<Vec<u8>> {
        crate::backend::cpu::kv::KvCache::read_block(self, at, n)
    }
    fn write_block(&mut self, n: usize, block: &[u8]) -> Result<(), EngineError> {
        crate::backend::cpu::kv::KvCache::write_block(self, n, block)
    }
    fn truncate(&mut self, len: usize) -> Result<(), EngineError> {
        crate::backend::cpu::kv::KvCache::truncate(self, len)
    }
}

impl<B: Backend> Engine for Model<B> {
    type State = B::Kv;
    fn id(&self) -> EngineId {
        self.engine()
    }
    fn config(&self) -> &ModelConfig {
        Model::config(self)
    }
    fn layers(&self) -> Range<usize> {
        Model::layers(self)
    }
    fn weight_bytes(&self) -> usize {
        Model::weight_bytes(self)
    }
    fn kv_position_bytes(&self) -> usize {
        Model::kv_position_bytes(self)
    }
    fn new_state(&self, capacity: usize, sub: Range<usize>) -> Result<Self::State, EngineError> {
        self.new_kv_for(capacity, sub)
    }
    fn check(&self, s: &SeqInput<Self::State>) -> Result<usize, EngineError> {
        Model::check(self, s)
    }
    fn forward(&self, batch: &mut [SeqInput<Self::State>]) -> Result<Vec<SeqOutput>, EngineError> {
        Model::forward(self, batch)
    }
}

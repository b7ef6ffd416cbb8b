//! A sequence's KV cache in device memory: per layer one buffer of keys and one of values, a
//! row of `width` values per position (f32; f16, two a word; or q8_0: int8 codes, four a word,
//! then an f16 scale a block, two a word; each row padded to whole words), made for the
//! sequence's whole capacity when its first positions arrive. Every position is kept, also on
//! sliding-window layers (the kernel attends only the window), so blocks can always be copied out
//! and in.

use super::device::Ctx;
use crate::backend::{KvShape, KvStore};
use crate::{EngineError, KvDtype, SeqState};
use std::ops::Range;
use std::sync::Arc;

pub struct GpuKv {
    ctx: Arc<Ctx>,
    shape: KvShape,
    /// Positions held.
    len: usize,
    /// Positions the buffers have room for.
    room: usize,
    /// Per layer of `shape.layers`: keys, values.
    store: Vec<(wgpu::Buffer, wgpu::Buffer)>,
}

impl GpuKv {
    pub(super) fn new(ctx: Arc<Ctx>, shape: KvShape) -> GpuKv {
        GpuKv { ctx, shape, len: 0, room: 0, store: Vec::new() }
    }

    fn row_bytes(&self) -> u64 {
        4 * self.row_words() as u64
    }

    pub(super) fn width(&self) -> usize {
        self.shape.width
    }

    /// q8_0's values per scale.
    pub(super) fn block(&self) -> usize {
        self.shape.block
    }

    pub(super) fn row_words(&self) -> usize {
        row_words(self.shape.dtype, self.shape.width, self.shape.block)
    }

    pub(super) fn dtype(&self) -> KvDtype {
        self.shape.dtype
    }

    pub(super) fn layer(&self, li: usize) -> &(wgpu::Buffer, wgpu::Buffer) {
        &self.store[li]
    }

    /// Makes room for `rows` more positions: on the first call, for the whole capacity the
    /// sequence reserved, so the device holds what the worker's KV budget counted for it at open.
    /// Growing instead (a copy into bigger buffers) would hold old and new buffers at once, past
    /// that budget, and could meet an out-of-memory failure mid-session.
    pub(super) fn reserve(&mut self, rows: usize) {
        let needed = self.len + rows;
        if needed <= self.room {
            return;
        }
        // `check` keeps every sequence within its capacity, so this is the first call.
        assert_eq!(self.room, 0, "a sequence past its capacity");
        let room = needed.max(self.shape.capacity);
        let bytes = room as u64 * self.row_bytes();
        self.store = (0..self.shape.layers.len()).map(|_| (self.ctx.buffer(bytes), self.ctx.buffer(bytes))).collect();
        self.room = room;
    }

    /// Copies rows `rows` of `k` and `v` to layer `li` at the positions after those held (an f32
    /// cache; the others are written by a kernel, `Gpu::kv_append`).
    pub(super) fn append(&mut self, li: usize, k: &wgpu::Buffer, v: &wgpu::Buffer, rows: Range<usize>) {
        let rb = self.row_bytes();
        let (from, to, n) = (rows.start as u64 * rb, self.len as u64 * rb, rows.len() as u64 * rb);
        let (kc, vc) = &self.store[li];
        self.ctx.record(|enc| {
            enc.copy_buffer_to_buffer(k, from, kc, to, n);
            enc.copy_buffer_to_buffer(v, from, vc, to, n);
        });
    }

    pub(super) fn advance(&mut self, rows: usize) {
        self.len += rows;
    }
}

/// Words a position's row of `width` values takes: each row starts a word (padded where its
/// values do not fill the last one). q8_0: the codes, four a word, then the blocks' scales (of
/// `block` values each), two a word.
pub(super) fn row_words(dtype: KvDtype, width: usize, block: usize) -> usize {
    match dtype {
        KvDtype::F32 => width,
        KvDtype::F16 => width.div_ceil(2),
        KvDtype::Q8_0 => width.div_ceil(4) + (width / block).div_ceil(2),
    }
}

impl KvStore for GpuKv {
    fn owner(&self) -> u64 {
        self.shape.owner
    }
}

impl SeqState for GpuKv {
    fn positions(&self) -> usize {
        self.len
    }

    fn capacity(&self) -> usize {
        self.shape.capacity
    }

    fn layers(&self) -> Range<usize> {
        self.shape.layers.clone()
    }

    fn bytes(&self) -> usize {
        2 * self.store.len() * self.len * self.row_bytes() as usize
    }

    fn blockable(&self) -> bool {
        true
    }

    /// Per layer, the keys then the values of the positions, as the cache stores them.
    fn read_block(&self, at: usize, n: usize) -> Option<Vec<u8>> {
        if at.checked_add(n)? > self.len {
            return None;
        }
        let rb = self.row_bytes();
        let mut out = Vec::with_capacity(2 * self.store.len() * n * rb as usize);
        for (k, v) in &self.store {
            out.extend(self.ctx.read(k, at as u64 * rb, n as u64 * rb).ok()?);
            out.extend(self.ctx.read(v, at as u64 * rb, n as u64 * rb).ok()?);
        }
        Some(out)
    }

    fn write_block(&mut self, n: usize, block: &[u8]) -> Result<(), EngineError> {
        let rb = self.row_bytes() as usize;
        let want = 2 * self.shape.layers.len() * n * rb;
        if block.len() != want {
            return Err(EngineError::BadInput(format!("a KV block of {n} positions is {want} bytes here, not {}", block.len())));
        }
        if self.len + n > self.shape.capacity {
            return Err(EngineError::ContextFull { needed: self.len + n, capacity: self.shape.capacity });
        }
        if n == 0 {
            return Ok(());
        }
        self.reserve(n);
        let staged = self.ctx.buffer_with(block);
        let (to, size) = (self.len as u64 * rb as u64, (n * rb) as u64);
        self.ctx.record(|enc| {
            for (li, (k, v)) in self.store.iter().enumerate() {
                let from = (2 * li) as u64 * size;
                enc.copy_buffer_to_buffer(&staged, from, k, to, size);
                enc.copy_buffer_to_buffer(&staged, from + size, v, to, size);
            }
        });
        self.len += n;
        Ok(())
    }

    fn truncate(&mut self, len: usize) -> Result<(), EngineError> {
        if len > self.len {
            return Err(EngineError::BadInput(format!("cannot keep {len} of {} positions", self.len)));
        }
        self.len = len;
        Ok(())
    }
}

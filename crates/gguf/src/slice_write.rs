//! Writing slices. A [`SliceLayout`] plans a slice file byte for byte, so that the slicer
//! (copying from a model file) and a fetcher (filling from the network) write the same bytes.

use crate::error::GgufError;
use crate::gguf::Gguf;
use crate::identity::ModelIdentity;
use crate::read::parse;
use crate::slice::{block_count, check_range, format_entry, needed_by_stage, read_slice, LAYER_END, LAYER_START, PREFIX, TENSORS};
use crate::temp::write_atomically;
use crate::tensor::tensor_n_bytes;
use crate::value::Value;
use crate::write::{alignment_of, encode_header, is_homogeneous, place, HeaderTensor};
use sha2::{Digest, Sha256};
use std::io::{BufWriter, Read, Write};
use std::path::Path;

/// Copies go through buffers of this size.
const COPY_BUF: usize = 1 << 20;

/// Where each tensor of a slice file lies and the header bytes that precede them.
#[derive(Clone, Debug)]
pub struct SliceLayout {
    /// Header (magic, version 3, metadata, tensor infos) plus padding up to the data section.
    pub header: Vec<u8>,
    /// (name, absolute file offset, n_bytes) for each tensor the slice holds, in order.
    pub tensors: Vec<(String, u64, u64)>,
    pub file_len: u64,
}

impl SliceLayout {
    /// The slice for layers [start, end) of the model with `metadata` (its dgr.slice.* keys, if
    /// any, dropped and the slice's own appended) and table `identity`. It holds, in the
    /// model's order, each tensor [`needed_by_stage`] picks, with n_layers from
    /// `{general.architecture}.block_count` and the head tied when the table has no
    /// output.weight. The header is parsed back as a reader will, so a planned slice opens.
    pub fn new(metadata: &[(String, Value)], identity: &ModelIdentity, start: u32, end: u32) -> Result<SliceLayout, GgufError> {
        let n_layers = block_count(metadata)?;
        let tied = identity.get("output.weight").is_none();
        let meta = slice_metadata(metadata, identity, start, end)?;

        let held: Vec<_> = identity.tensors.iter().filter(|t| needed_by_stage(&t.name, start, end, n_layers, tied)).collect();
        let sizes = held.iter().map(|t| tensor_n_bytes(&t.name, t.ty, &t.dims, None)).collect::<Result<Vec<u64>, _>>()?;
        let align = alignment_of(&meta);
        let overflow = GgufError::Overflow { what: "slice file length", offset: 0 };
        let (offsets, data_len) = place(sizes.iter().copied(), align).ok_or(overflow)?;
        let infos: Vec<HeaderTensor> =
            held.iter().zip(&offsets).map(|(t, &offset)| HeaderTensor { name: &t.name, ty: t.ty, dims: &t.dims, offset }).collect();
        let header = encode_header(3, &meta, &infos, align);
        let data_start = header.len() as u64;
        let file_len = data_start.checked_add(data_len).ok_or(GgufError::Overflow { what: "slice file length", offset: 0 })?;

        let parsed = parse(&header, file_len)?;
        read_slice(&parsed.metadata, &parsed.tensors)?;

        let tensors = held.iter().zip(offsets).zip(sizes).map(|((t, offset), n)| (t.name.clone(), data_start + offset, n)).collect();
        Ok(SliceLayout { header, tensors, file_len })
    }
}

/// A slice's metadata for layers [start, end): the model's `metadata` with any dgr.slice.* keys
/// dropped and the slice's own appended (its range and the whole model's table `identity`).
pub fn slice_metadata(
    metadata: &[(String, Value)],
    identity: &ModelIdentity,
    start: u32,
    end: u32,
) -> Result<Vec<(String, Value)>, GgufError> {
    check_range(start, end, 0, block_count(metadata)?)?;
    let mut entries = Vec::with_capacity(identity.tensors.len());
    for (i, t) in identity.tensors.iter().enumerate() {
        entries.push(Value::String(format_entry(i, t)?));
    }
    let mut meta: Vec<(String, Value)> = metadata.iter().filter(|(k, _)| !k.starts_with(PREFIX)).cloned().collect();
    meta.push((LAYER_START.to_owned(), Value::U32(start)));
    meta.push((LAYER_END.to_owned(), Value::U32(end)));
    meta.push((TENSORS.to_owned(), Value::Array(entries)));
    // Encoded, a mixed array would read back as other values (a parse need not see it).
    if let Some((key, _)) = meta.iter().find(|(_, v)| !is_homogeneous(v)) {
        return Err(GgufError::MixedArray { key: key.clone() });
    }
    Ok(meta)
}

/// Writes the slice of `g` (whose identity is `id`) for layers [start, end) to `out`, through a
/// temporary file renamed into place. Each tensor streams from `g`'s mapped bytes (which must
/// include every tensor the slice holds) and is checked against `id`'s hash on the way. A
/// slice can be sliced again within its own range.
pub fn write_slice(g: &Gguf, id: &ModelIdentity, start: u32, end: u32, out: &Path) -> Result<(), GgufError> {
    if let Some(s) = g.slice() {
        check_range(start, end, s.layer_start, s.layer_end)?;
    }
    let layout = SliceLayout::new(g.metadata(), id, start, end)?;
    // Every source is found before the file is created.
    let mut sources = Vec::with_capacity(layout.tensors.len());
    for (name, offset, _) in &layout.tensors {
        let t = g.tensor(name).filter(|t| g.is_mapped(t)).ok_or_else(|| GgufError::TensorNotMapped { tensor: name.clone() })?;
        if !id.get(name).is_some_and(|e| e.ty == t.ty && e.dims == t.dims) {
            return Err(GgufError::SliceTensorMismatch {
                tensor: name.clone(),
                reason: "its type or shape differs from the model's table",
            });
        }
        sources.push((name, *offset, g.tensor_data(t)));
    }
    let io = |source| GgufError::Io { path: out.to_owned(), source };
    write_atomically(out, |file| {
        let mut w = BufWriter::with_capacity(COPY_BUF, &mut *file);
        w.write_all(&layout.header).map_err(io)?;
        let mut pos = layout.header.len() as u64;
        for (name, offset, data) in sources {
            std::io::copy(&mut std::io::repeat(0).take(offset.saturating_sub(pos)), &mut w).map_err(io)?;
            let mut h = Sha256::new();
            for chunk in data.chunks(COPY_BUF) {
                h.update(chunk);
                w.write_all(chunk).map_err(io)?;
            }
            if id.get(name).map(|e| e.sha256) != Some(h.finalize().into()) {
                return Err(GgufError::TensorHashMismatch { tensor: name.clone() });
            }
            pos = offset + data.len() as u64;
        }
        w.flush().map_err(io)?;
        drop(w);
        // On disk before it takes the name: a crash leaves the old file or the whole new one.
        file.sync_all().map_err(io)
    })
}

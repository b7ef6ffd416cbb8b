//! Slices: GGUF files that hold some of a model's layers and carry the whole model's tensor
//! table (names, types, shapes, hashes), so a worker holding one knows, and can prove, which
//! whole model it serves. The table arrives from strangers: every field is checked at open.

use crate::error::GgufError;
use crate::identity::TensorHash;
use crate::tensor::{tensor_n_bytes, TensorInfo, MAX_DIMS};
use crate::types::GgmlType;
use crate::value::Value;
use std::collections::HashMap;

/// Every key a slice adds starts with this; the model's identity leaves them out.
pub(crate) const PREFIX: &str = "dgr.slice.";
pub(crate) const LAYER_START: &str = "dgr.slice.layer_start";
pub(crate) const LAYER_END: &str = "dgr.slice.layer_end";
pub(crate) const TENSORS: &str = "dgr.slice.tensors";

/// The layers a slice holds: [layer_start, layer_end).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceInfo {
    pub layer_start: u32,
    pub layer_end: u32,
}

/// A slice's validated dgr.slice.* keys.
pub(crate) struct SliceTable {
    pub info: SliceInfo,
    /// The whole model's tensors, in its order.
    pub tensors: Vec<TensorHash>,
    index: HashMap<String, usize>,
}

impl SliceTable {
    pub fn get(&self, name: &str) -> Option<&TensorHash> {
        self.tensors.get(*self.index.get(name)?)
    }
}

/// Whether a stage serving layers [start, end) of an n_layers model needs tensor `name` (GGUF
/// naming). `tied`: the model has no output.weight, so the last stage projects with the
/// embedding.
pub fn needed_by_stage(name: &str, start: u32, end: u32, n_layers: u32, tied: bool) -> bool {
    if let Some(rest) = name.strip_prefix("blk.") {
        let index = rest.split('.').next().unwrap_or_default();
        // Digits only: `u32::from_str` would also take "+3".
        let layer = index.bytes().all(|b| b.is_ascii_digit()).then(|| index.parse::<u32>().ok()).flatten();
        return layer.is_some_and(|i| start <= i && i < end);
    }
    match name {
        "token_embd.weight" => start == 0 || (end == n_layers && tied),
        "output_norm.weight" | "output.weight" => end == n_layers,
        _ => true,
    }
}

/// Of (tensor name, size) pairs (GGUF naming), the sizes of each of the first `layers` layers'
/// tensors summed, and the head's: the output matrix, or the token embeddings a model with tied
/// embeddings computes its logits with.
pub fn per_layer<'a>(tensors: impl IntoIterator<Item = (&'a str, u64)>, layers: usize) -> (Vec<u64>, u64) {
    let mut per = vec![0u64; layers];
    let (mut output, mut embedding) = (None, None);
    for (name, size) in tensors {
        let layer = name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok());
        if let Some(c) = layer.and_then(|i| per.get_mut(i)) {
            *c = c.saturating_add(size);
        }
        match name {
            "output.weight" => output = Some(size),
            "token_embd.weight" => embedding = Some(size),
            _ => {}
        }
    }
    (per, output.or(embedding).unwrap_or(0))
}

/// `[start, end)` must be nonempty and lie within `[lo, hi)`.
pub(crate) fn check_range(start: u32, end: u32, lo: u32, hi: u32) -> Result<(), GgufError> {
    if start < end && lo <= start && end <= hi {
        Ok(())
    } else {
        Err(GgufError::BadLayerRange { start, end, lo, hi })
    }
}

fn lookup<'a>(metadata: &'a [(String, Value)], key: &str) -> Result<&'a Value, GgufError> {
    metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v).ok_or_else(|| GgufError::MissingKey { key: key.to_owned() })
}

fn wrong_type(key: &str, expected: &'static str, found: &Value) -> GgufError {
    GgufError::WrongType { key: key.to_owned(), expected, found: found.type_name() }
}

fn get_u32(metadata: &[(String, Value)], key: &str) -> Result<u32, GgufError> {
    match lookup(metadata, key)? {
        Value::U32(v) => Ok(*v),
        other => Err(wrong_type(key, "u32", other)),
    }
}

/// The model's layer count: `{general.architecture}.block_count`.
pub(crate) fn block_count(metadata: &[(String, Value)]) -> Result<u32, GgufError> {
    const ARCH: &str = "general.architecture";
    let arch = lookup(metadata, ARCH)?;
    let arch = arch.as_str().ok_or_else(|| wrong_type(ARCH, "string", arch))?;
    let key = format!("{arch}.block_count");
    let v = lookup(metadata, &key)?;
    v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| wrong_type(&key, "integer in u32's range", v))
}

/// A table entry: "name\ttype_id\tdim0,dim1,...\t<64 hex sha256>". `index` names it in errors.
pub(crate) fn format_entry(index: usize, t: &TensorHash) -> Result<String, GgufError> {
    if t.name.contains('\t') {
        return Err(GgufError::BadSliceTable { index, reason: "the tensor name holds a tab".into() });
    }
    let dims: Vec<String> = t.dims.iter().map(u64::to_string).collect();
    Ok(format!("{}\t{}\t{}\t{}", t.name, t.ty.id(), dims.join(","), hex::encode(t.sha256)))
}

/// A decimal number of digits only.
fn number<T: std::str::FromStr>(s: &str) -> Option<T> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse().ok()).flatten()
}

/// Parses one entry, from the right: the fields after the name hold no tab.
fn parse_entry(index: usize, s: &str) -> Result<TensorHash, GgufError> {
    let bad = |reason: &str| GgufError::BadSliceTable { index, reason: reason.to_owned() };
    let mut fields = s.rsplitn(4, '\t');
    let (Some(sha), Some(dims), Some(ty), Some(name)) = (fields.next(), fields.next(), fields.next(), fields.next()) else {
        return Err(bad("expected 4 tab-separated fields"));
    };
    if name.contains('\t') {
        return Err(bad("the tensor name holds a tab"));
    }
    let ty = number::<u32>(ty).ok_or_else(|| bad("the type id is not a number"))?;
    let ty = GgmlType::from_id(ty).ok_or_else(|| bad("unknown type id"))?;
    // Bounded before collecting, whatever the field's length.
    let mut parsed = Vec::with_capacity(MAX_DIMS);
    for d in dims.split(',') {
        if parsed.len() == MAX_DIMS {
            return Err(bad("more than 4 dimensions"));
        }
        parsed.push(number::<u64>(d).ok_or_else(|| bad("a dimension is not a number"))?);
    }
    tensor_n_bytes(name, ty, &parsed, None).map_err(|e| GgufError::BadSliceTable { index, reason: e.to_string() })?;
    // Lowercase only, so that each digest has one spelling.
    let mut sha256 = [0u8; 32];
    if sha.bytes().any(|c| c.is_ascii_uppercase()) || hex::decode_to_slice(sha, &mut sha256).is_err() {
        return Err(bad("the hash is not 64 lowercase hex digits"));
    }
    Ok(TensorHash { name: name.to_owned(), ty, dims: parsed, sha256 })
}

/// The slice table of a file whose metadata has any dgr.slice.* key (None when it has none),
/// checked against the tensors the file holds: each must be in the table, with its type and
/// shape.
pub(crate) fn read_slice(metadata: &[(String, Value)], held: &[TensorInfo]) -> Result<Option<SliceTable>, GgufError> {
    if !metadata.iter().any(|(k, _)| k.starts_with(PREFIX)) {
        return Ok(None);
    }
    let info = SliceInfo { layer_start: get_u32(metadata, LAYER_START)?, layer_end: get_u32(metadata, LAYER_END)? };
    check_range(info.layer_start, info.layer_end, 0, block_count(metadata)?)?;
    let entries = lookup(metadata, TENSORS)?;
    let entries = entries.as_array().ok_or_else(|| wrong_type(TENSORS, "array of strings", entries))?;
    let mut tensors = Vec::with_capacity(entries.len());
    let mut index = HashMap::with_capacity(entries.len());
    for (i, entry) in entries.iter().enumerate() {
        let s = entry.as_str().ok_or_else(|| GgufError::BadSliceTable { index: i, reason: "not a string".into() })?;
        let t = parse_entry(i, s)?;
        if index.insert(t.name.clone(), i).is_some() {
            return Err(GgufError::BadSliceTable { index: i, reason: format!("tensor {:?} is listed twice", t.name) });
        }
        tensors.push(t);
    }
    let table = SliceTable { info, tensors, index };
    for t in held {
        let reason = match table.get(&t.name) {
            None => "the slice holds it but its table does not list it",
            Some(e) if e.ty != t.ty || e.dims != t.dims => "its type or shape differs from the slice's table",
            Some(_) => continue,
        };
        return Err(GgufError::SliceTensorMismatch { tensor: t.name.clone(), reason });
    }
    Ok(Some(table))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_needs() {
        let n = 4;
        assert!(needed_by_stage("blk.0.attn_q.weight", 0, 2, n, false));
        assert!(!needed_by_stage("blk.2.attn_q.weight", 0, 2, n, false));
        assert!(needed_by_stage("blk.3.ffn_up.weight", 2, 4, n, false));
        assert!(!needed_by_stage("blk.x.ffn_up.weight", 0, 4, n, false));
        assert!(!needed_by_stage("blk.+1.ffn_up.weight", 0, 4, n, false));
        assert!(!needed_by_stage("blk.99999999999.ffn_up.weight", 0, 4, n, false));
        assert!(needed_by_stage("token_embd.weight", 0, 1, n, false));
        assert!(!needed_by_stage("token_embd.weight", 2, 4, n, false));
        assert!(needed_by_stage("token_embd.weight", 2, 4, n, true));
        assert!(!needed_by_stage("token_embd.weight", 1, 3, n, true));
        assert!(needed_by_stage("output_norm.weight", 3, 4, n, false));
        assert!(!needed_by_stage("output.weight", 0, 3, n, false));
        assert!(needed_by_stage("rope_freqs.weight", 1, 2, n, false));
    }

    #[test]
    fn entries_round_trip_and_bad_ones_are_named() {
        let t = TensorHash { name: "blk.0.a b".into(), ty: GgmlType::Q4_1, dims: vec![64, 3], sha256: [7; 32] };
        let s = format_entry(0, &t).expect("format");
        assert_eq!(parse_entry(0, &s).ok(), Some(t));
        let h = hex::encode([7; 32]);
        for (entry, want) in [
            (format!("a\t0\t4\t{h}\tx"), "tab"),
            (format!("0\t4\t{h}"), "expected 4"),
            (format!("a\tb\t0\t4\t{h}"), "tab"),
            (format!("a\t+0\t4\t{h}"), "type id"),
            (format!("a\t4\t4\t{h}"), "unknown type id"),
            (format!("a\t0\t1,1,1,1,1\t{h}"), "more than 4"),
            (format!("a\t0\t{}\t{h}", "1,".repeat(1 << 16)), "more than 4"),
            (format!("a\t0\t\t{h}"), "dimension"),
            (format!("a\t0\t4,0\t{h}"), "zero"),
            (format!("a\t0\t{}\t{h}", u64::MAX), "overflows"),
            ("a\t0\t4\tabc".to_owned(), "hash"),
            (format!("a\t0\t4\t{}", "AB".repeat(32)), "hash"),
            (format!("a\t0\t4\t{}g", &h[1..]), "hash"),
            (format!("a\t0\t4\t{}é", &h[2..]), "hash"),
        ] {
            match parse_entry(3, &entry) {
                Err(GgufError::BadSliceTable { index: 3, reason }) => assert!(reason.contains(want), "{entry:?}: {reason}"),
                other => panic!("{entry:?}: {other:?}"),
            }
        }
        let tab = TensorHash { name: "a\tb".into(), ..parse_entry(0, &s).expect("entry") };
        assert!(matches!(format_entry(5, &tab), Err(GgufError::BadSliceTable { index: 5, .. })));
    }
}

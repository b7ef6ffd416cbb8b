//! Hugging Face Transformers checkpoints (`config.json`, `*.safetensors`) as models dgr's
//! engine computes: the config read into GGUF-convention hyperparameters, each tensor renamed to
//! its GGUF name and mapped from its file (only those the caller keeps), the few that
//! llama.cpp's converter rewrites rewritten the same way at load (llama's Q/K row order,
//! Gemma's norm offset), and the checkpoint's identity built as a GGUF model's is.

mod config;
mod error;
mod names;
mod shards;

pub use config::{Config, Family};
pub use error::HfError;

use dgr_gguf::{GgmlType, Gguf, ModelIdentity, Part, PartBytes, TensorHash, TensorInfo, Value};
use safetensors::Dtype;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The engine name of models loaded from Transformers checkpoints (a compatibility key field).
pub const ENGINE: &str = "transformers";

/// The Transformers name of the tensor GGUF calls `gguf` in a model of `family`.
pub fn transformers_name(gguf: &str, family: Family) -> String {
    names::hf_name(gguf, family)
}

/// Whether `path` is a Transformers checkpoint directory (has a config.json).
pub fn is_checkpoint(path: &Path) -> bool {
    path.is_dir() && path.join("config.json").is_file()
}

/// A checkpoint opened for computing.
pub struct Checkpoint {
    pub config: Config,
    /// The model in GGUF's terms, holding the tensors `keep` selected.
    pub model: Gguf,
    dir: std::path::PathBuf,
    config_sha256: String,
    shards: Vec<shards::Shard>,
    /// Each tensor of the model: its GGUF name, and its stored bytes' shard, offset and length.
    locations: Vec<(String, usize, u64, u64)>,
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

fn ggml_type(name: &str, dtype: Dtype) -> Result<GgmlType, HfError> {
    match dtype {
        Dtype::F32 => Ok(GgmlType::F32),
        Dtype::F16 => Ok(GgmlType::F16),
        Dtype::BF16 => Ok(GgmlType::BF16),
        other => Err(HfError::UnsupportedDtype { name: name.into(), dtype: format!("{other:?}") }),
    }
}

impl Checkpoint {
    /// Opens the checkpoint in `dir`, holding the tensors (by GGUF name) that `keep` selects;
    /// the others are listed with their shapes but never mapped.
    pub fn open(dir: &Path, keep: &dyn Fn(&str) -> bool) -> Result<Checkpoint, HfError> {
        let config_path = dir.join("config.json");
        let config_text = shards::read_small(&config_path)?;
        let config = Config::parse(&config_text, &config_path)?;
        let shards = shards::open_shards(dir)?;
        let expected = names::expected(&config);
        let mut parts = Vec::with_capacity(expected.len());
        let mut locations = Vec::with_capacity(expected.len());
        let mut seen: std::collections::HashMap<String, &Path> = std::collections::HashMap::new();
        for (s, shard) in shards.iter().enumerate() {
            for (hf_name, info) in &shard.tensors {
                let Some(name) = names::gguf_name(hf_name, config.family) else {
                    return Err(HfError::UnexpectedTensor(hf_name.clone()));
                };
                // Tied: Transformers ignores a stored head and projects with the embedding.
                if config.tied && name == "output.weight" {
                    continue;
                }
                let Some(shape) = expected.get(&name) else { return Err(HfError::UnexpectedTensor(hf_name.clone())) };
                if let Some(first) = seen.insert(name.clone(), &shard.path) {
                    return Err(HfError::DuplicateTensor { name: hf_name.clone(), first: first.to_owned(), second: shard.path.clone() });
                }
                if info.shape != *shape {
                    return Err(HfError::BadShape { name: hf_name.clone(), expected: shape.clone(), found: info.shape.clone() });
                }
                let stored = ggml_type(hf_name, info.dtype)?;
                let at = shard.data_start + info.data_offsets.0 as u64;
                let len = (info.data_offsets.1 - info.data_offsets.0) as u64;
                let rewrite = names::rewrite(&name, &config);
                let ty = if matches!(rewrite, names::Rewrite::AddOne) { GgmlType::F32 } else { stored };
                let bytes = if !keep(&name) {
                    None
                } else if let names::Rewrite::None = rewrite {
                    Some(PartBytes::File { file: &shard.file, path: &shard.path, offset: at })
                } else {
                    let mut raw = vec![0u8; len as usize];
                    shard.file.read_exact_at(&mut raw, at).map_err(|source| HfError::Io { path: shard.path.clone(), source })?;
                    Some(PartBytes::Owned(names::apply(rewrite, stored, raw, shape)?))
                };
                // ggml lists dims innermost first.
                let dims = shape.iter().rev().map(|&d| d as u64).collect();
                locations.push((name.clone(), s, at, len));
                parts.push(Part { name, ty, dims, bytes });
            }
        }
        if let Some(missing) = expected.keys().find(|n| !seen.contains_key(*n)) {
            return Err(HfError::MissingTensor(names::hf_name(missing, config.family)));
        }
        let model = Gguf::assemble(config.metadata.clone(), parts)?;
        Ok(Checkpoint { config, model, dir: dir.to_owned(), config_sha256: sha256_hex(&config_text), shards, locations })
    }

    /// The checkpoint's identity, as a GGUF model's is defined ([`ModelIdentity::compute`]): the
    /// metadata dgr reads from config.json plus the SHA-256s of config.json and tokenizer.json
    /// (keys `dgr.hf.config_sha256`, `dgr.hf.tokenizer_sha256`), and per tensor, in the order of
    /// the shards and their data, its GGUF name, the type and dims the engine computes with, and
    /// the SHA-256 of its bytes as the checkpoint stores them (read with plain reads, or from
    /// the cache beside each shard, `<shard>.dgr-hashes`, while the shard is unchanged).
    pub fn identity(&self) -> Result<ModelIdentity, HfError> {
        let mut metadata = self.config.metadata.clone();
        metadata.push(("dgr.hf.config_sha256".into(), Value::String(self.config_sha256.clone())));
        let tokenizer = self.dir.join("tokenizer.json");
        if tokenizer.exists() {
            let text = std::fs::read(&tokenizer).map_err(|source| HfError::Io { path: tokenizer.clone(), source })?;
            metadata.push(("dgr.hf.tokenizer_sha256".into(), Value::String(sha256_hex(&text))));
        }
        // Per shard, its tensors' hashes: cached beside the shard as a GGUF file's are, so a
        // restart reads no tensor bytes.
        let mut tensors = Vec::with_capacity(self.locations.len());
        for (s, shard) in self.shards.iter().enumerate() {
            let mut infos = Vec::new();
            for (name, _, at, len) in self.locations.iter().filter(|l| l.1 == s) {
                let t = self.model.tensor(name).ok_or_else(|| HfError::MissingTensor(name.clone()))?;
                infos.push(TensorInfo { name: name.clone(), ty: t.ty, dims: t.dims.clone(), offset: at - shard.data_start, n_bytes: *len });
            }
            let hashes = dgr_gguf::cached_tensor_hashes(&shard.path, &shard.file, shard.data_start, &infos)?;
            tensors.extend(infos.into_iter().zip(hashes).map(|(t, sha256)| TensorHash { name: t.name, ty: t.ty, dims: t.dims, sha256 }));
        }
        Ok(ModelIdentity::compute(&metadata, tensors))
    }
}

/// The model at `path`, whole: a GGUF file mapped, or a checkpoint directory with every tensor.
pub fn open_any(path: &Path) -> Result<Gguf, HfError> {
    if is_checkpoint(path) {
        Ok(Checkpoint::open(path, &|_| true)?.model)
    } else {
        Ok(Gguf::open(path)?)
    }
}

/// The model at `path` with no tensor mapped (a GGUF file's header, a checkpoint's table), and
/// its identity: what describes a model without computing with it.
pub fn describe(path: &Path) -> Result<(Gguf, ModelIdentity), HfError> {
    if is_checkpoint(path) {
        let ck = Checkpoint::open(path, &|_| false)?;
        let id = ck.identity()?;
        Ok((ck.model, id))
    } else {
        let g = Gguf::read_header(path)?;
        let id = dgr_gguf::identity(path, &g)?;
        Ok((g, id))
    }
}

/// The identity of the model at `path`, a GGUF file or a checkpoint directory.
pub fn identity_any(path: &Path) -> Result<ModelIdentity, HfError> {
    Ok(describe(path)?.1)
}

/// Opens the checkpoint in `dir` for a stage of layers `range`: only the tensors those layers
/// need are mapped (as for a GGUF file), and the checkpoint's identity.
pub fn open_stage(dir: &Path, range: std::ops::Range<usize>) -> Result<(Gguf, ModelIdentity), HfError> {
    let config_path = dir.join("config.json");
    let c = Config::parse(&shards::read_small(&config_path)?, &config_path)?;
    let (start, end, n) = (range.start as u32, range.end as u32, c.n_layers as u32);
    let ck = Checkpoint::open(dir, &|name| dgr_gguf::needed_by_stage(name, start, end, n, c.tied))?;
    let id = ck.identity()?;
    Ok((ck.model, id))
}

/// The identity of the checkpoint in `dir` (see [`Checkpoint::identity`]).
pub fn identity(dir: &Path) -> Result<ModelIdentity, HfError> {
    Checkpoint::open(dir, &|_| false)?.identity()
}

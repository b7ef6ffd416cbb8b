//! Serving the tensors this worker holds to a worker fetching its slice: the manifest (the whole
//! model's metadata and table of tensor hashes) and runs of tensor bytes, behind the join token.
//! The fetcher checks every byte against the table, so nothing here is trusted by it. The
//! manifest is a GGUF slice header with no tensors, naming the layers this worker serves.

use dgr_gguf::{Gguf, GgufWriter, ModelIdentity};
use dgr_proto::{Body, ErrorKind, ErrorMsg, FetchAsk, Frame, Manifest, TensorChunk, MAX_CHUNK, STAGE_UNKNOWN};
use sha2::{Digest, Sha256};
use std::sync::Arc;

pub(crate) struct Holdings {
    gguf: Arc<Gguf>,
    model_id: String,
    manifest: Vec<u8>,
    /// SHA-256 of the join token: asks are compared digest to digest.
    token_digest: [u8; 32],
}

impl Holdings {
    pub fn new(
        gguf: Arc<Gguf>,
        identity: &ModelIdentity,
        layers: std::ops::Range<u32>,
        join_token: &str,
    ) -> Result<Holdings, dgr_gguf::GgufError> {
        let mut w = GgufWriter::new();
        for (k, v) in dgr_gguf::slice_metadata(gguf.metadata(), identity, layers.start, layers.end)? {
            w.add_metadata(&k, v)?;
        }
        Ok(Holdings { manifest: w.to_bytes(), gguf, model_id: identity.id.clone(), token_digest: Sha256::digest(join_token).into() })
    }

    /// The answer to one ask.
    pub fn answer(&self, ask: &FetchAsk) -> Frame {
        let refuse = |kind, msg: String| Frame::new(Body::Error(ErrorMsg::new(&[], kind, STAGE_UNKNOWN, msg)));
        if <[u8; 32]>::from(Sha256::digest(&ask.join_token)) != self.token_digest {
            return refuse(ErrorKind::Ticket, "wrong join token".into());
        }
        if ask.model_id != self.model_id {
            return refuse(ErrorKind::SchemaMismatch, format!("this worker holds model {}", self.model_id));
        }
        if ask.tensor.is_empty() {
            return Frame::new(Body::Manifest(Manifest { gguf: self.manifest.clone() }));
        }
        let Some(t) = self.gguf.tensor(&ask.tensor).filter(|t| self.gguf.is_mapped(t)) else {
            return refuse(ErrorKind::BadInput, format!("tensor {:?} is not held here", ask.tensor));
        };
        let data = self.gguf.tensor_data(t);
        let start = usize::try_from(ask.offset).ok().filter(|s| *s <= data.len());
        let Some(start) = start.filter(|_| ask.len <= MAX_CHUNK) else {
            return refuse(ErrorKind::BadInput, format!("bytes {}+{} of {:?} are out of range", ask.offset, ask.len, ask.tensor));
        };
        let end = data.len().min(start + ask.len as usize);
        #[allow(unused_mut)]
        let mut bytes = data[start..end].to_vec();
        #[cfg(feature = "fault-injection")]
        crate::fault::corrupt_chunk(&mut bytes);
        Frame::new(Body::Chunk(TensorChunk { tensor: ask.tensor.clone(), offset: ask.offset, data: bytes }))
    }
}

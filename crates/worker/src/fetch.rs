//! Fetching a slice from the swarm: a worker started without the model file asks its trackers
//! (the first that answers) who holds the model, takes the manifest from one holder (accepted only if it hashes to the model
//! id asked for), then each tensor its layers need from any holder of it, hashing every tensor as
//! it arrives. A tensor whose bytes do not match the identity's table is thrown away and fetched
//! from another holder; the liar gets nothing more. Tensors are written in place into a `.part`
//! file laid out as the final slice, so a fetch stopped at any point resumes: a tensor already
//! there and matching its hash is kept. Nothing unverified reaches the final file name.

use bytes::Bytes;
use dgr_gguf::{Gguf, ModelIdentity, SliceLayout};
use dgr_proto::{Body, FetchAsk, Frame, Hello, Role, SwarmQuery, TrackerBody, TrackerClient, MAX_CHUNK, PROTOCOL_VERSION};
use futures::{SinkExt, StreamExt};
use prost::Message;
use sha2::{Digest, Sha256};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio_util::codec::{Framed, LengthDelimitedCodec};

const TIMEOUT: Duration = Duration::from_secs(30);
/// How long one tracker may take to answer who holds the model before the next one is asked.
const TRACKER_TIMEOUT: Duration = Duration::from_secs(5);
/// Rounds over the holders before a fetch gives up on a tensor (a holder that dropped the
/// connection may be back; one that lied is not asked again).
const ROUNDS: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("asking the tracker who holds the model: {0}")]
    Tracker(#[from] dgr_proto::TrackerCallError),
    #[error("no live worker holds model {model_id}")]
    NoHolder { model_id: String },
    #[error("no holder sent a manifest of model {model_id} ({why})")]
    NoManifest { model_id: String, why: String },
    #[error("no holder sent tensor {tensor:?} intact ({why})")]
    Tensor { tensor: String, why: String },
    #[error("the manifest: {0}")]
    Gguf(#[from] dgr_gguf::GgufError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("stopped after {0} tensors (fault injection)")]
    Stopped(usize),
}

/// What to fetch and from whom.
#[derive(Clone, Debug)]
pub struct FetchSpec {
    /// The swarm's trackers, asked in order until one answers (they share one registry).
    pub trackers: Vec<String>,
    pub join_token: String,
    pub model_id: String,
    pub layers: Range<u32>,
    /// Where slices are kept.
    pub dir: PathBuf,
}

/// What a fetch did.
#[derive(Debug, Default)]
pub struct Fetched {
    pub path: PathBuf,
    pub bytes_fetched: u64,
    /// Tensors found intact in a `.part` file left by an earlier, interrupted fetch.
    pub tensors_resumed: usize,
    pub tensors_fetched: usize,
    /// Holders caught sending bytes that do not match the model's identity.
    pub liars: Vec<String>,
    /// The file was complete already.
    pub cached: bool,
}

struct Holder {
    worker_id: String,
    addr: String,
    layers: Range<u32>,
    conn: Option<Framed<dgr_proto::SecureStream, LengthDelimitedCodec>>,
    lied: bool,
}

impl FetchSpec {
    /// Where the slice ends up.
    pub fn path(&self) -> PathBuf {
        self.dir.join(format!("{}.{}-{}.gguf", self.model_id, self.layers.start, self.layers.end))
    }

    pub async fn run(&self) -> Result<Fetched, FetchError> {
        let path = self.path();
        if path.exists() {
            return Ok(Fetched { path, cached: true, ..Default::default() });
        }
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |source| FetchError::Io { path: p, source }
        };
        std::fs::create_dir_all(&self.dir).map_err(io(&self.dir))?;
        let mut holders = self.holders().await?;
        let (manifest, identity) = self.manifest(&mut holders).await?;
        let layout = SliceLayout::new(manifest.metadata(), &identity, self.layers.start, self.layers.end)?;
        let arch = manifest.get_str("general.architecture")?;
        let n_layers = u32::try_from(manifest.get_u64(&format!("{arch}.block_count"))?).unwrap_or(u32::MAX);
        let tied = !identity.tensors.iter().any(|t| t.name == "output.weight");

        let part = path.with_extension("gguf.part");
        let mut file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&part).map_err(io(&part))?;
        file.set_len(layout.file_len).map_err(io(&part))?;
        file.write_all_at(&layout.header, 0).map_err(io(&part))?;
        let mut out = Fetched { path: path.clone(), ..Default::default() };
        for (name, at, len) in &layout.tensors {
            let want = identity
                .get(name)
                .map(|t| t.sha256)
                .ok_or_else(|| FetchError::Tensor { tensor: name.clone(), why: "not in the model's table".into() })?;
            if dgr_gguf::sha256_range(&file, *at, *len).map_err(io(&part))? == want {
                out.tensors_resumed += 1;
                continue;
            }
            #[cfg(feature = "fault-injection")]
            if crate::fault::fetch_stop_after().is_some_and(|n| out.tensors_fetched >= n) {
                return Err(FetchError::Stopped(out.tensors_fetched));
            }
            self.tensor(&mut holders, &mut file, &part, name, *at, *len, want, n_layers, tied).await?;
            out.tensors_fetched += 1;
            out.bytes_fetched += len;
        }
        file.sync_all().map_err(io(&part))?;
        std::fs::rename(&part, &path).map_err(io(&path))?;
        out.liars = holders.iter().filter(|h| h.lied).map(|h| h.worker_id.clone()).collect();
        Ok(out)
    }

    /// How large the model's layers are, as the first holder's manifest says (checked against
    /// the model id): known before a range is chosen, so a worker can take what fits.
    pub async fn sizes(&self) -> Result<crate::placement::ModelSizes, FetchError> {
        let mut holders = self.holders().await?;
        let (manifest, identity) = self.manifest(&mut holders).await?;
        let arch = manifest.get_str("general.architecture")?;
        let n_layers = u32::try_from(manifest.get_u64(&format!("{arch}.block_count"))?).unwrap_or(u32::MAX);
        // The count comes from a stranger: bounded before anything is sized by it.
        if n_layers == 0 || n_layers > dgr_proto::MAX_PLACE_LAYERS {
            let why = format!("a manifest of {n_layers} layers (1 to {} can be placed)", dgr_proto::MAX_PLACE_LAYERS);
            return Err(FetchError::NoManifest { model_id: self.model_id.clone(), why });
        }
        let sizes =
            identity.tensors.iter().map(|t| Ok((t.name.as_str(), t.n_bytes()?))).collect::<Result<Vec<_>, dgr_gguf::GgufError>>()?;
        let (layers, head) = dgr_gguf::per_layer(sizes, n_layers as usize);
        Ok(crate::placement::ModelSizes { n_layers, layers, head })
    }

    /// Live, unquarantined workers serving the model, nearest layers first.
    async fn holders(&self) -> Result<Vec<Holder>, FetchError> {
        let reply = self.swarm().await?;
        let mut holders: Vec<Holder> = reply
            .workers
            .into_iter()
            .filter(|w| w.quarantined.is_empty())
            .filter_map(|w| {
                let r = w.registration?;
                (r.model_id == self.model_id && !r.addr.is_empty()).then(|| Holder {
                    worker_id: w.worker_id,
                    addr: r.addr,
                    layers: r.layer_start..r.layer_end,
                    conn: None,
                    lied: false,
                })
            })
            .collect();
        if holders.is_empty() {
            return Err(FetchError::NoHolder { model_id: self.model_id.clone() });
        }
        let overlap = |h: &Holder| h.layers.end.min(self.layers.end).saturating_sub(h.layers.start.max(self.layers.start));
        holders.sort_by_key(|h| std::cmp::Reverse(overlap(h)));
        Ok(holders)
    }

    /// The swarm as the first of the trackers that answers lists it (they share one registry; a
    /// refusal is an answer, since the others share its rules).
    async fn swarm(&self) -> Result<dgr_proto::SwarmReply, dgr_proto::TrackerCallError> {
        use dgr_proto::TrackerCallError::{Io, Key, Protocol};
        let mut why = Io { addr: String::new(), why: "no tracker given".into() };
        for addr in &self.trackers {
            let asked = async {
                match TrackerClient::connect(addr, TRACKER_TIMEOUT).await?.call(TrackerBody::SwarmQuery(SwarmQuery {})).await? {
                    TrackerBody::SwarmReply(reply) => Ok(reply),
                    _ => Err(Protocol { addr: addr.clone() }),
                }
            };
            match asked.await {
                Err(e @ (Io { .. } | Key { .. })) => {
                    eprintln!("dgr worker: asking {addr} who holds the model: {e}; trying the next tracker");
                    why = e;
                }
                answered => return answered,
            }
        }
        Err(why)
    }

    /// The first manifest that parses and hashes to the model id. A holder asked for a model it
    /// does not hold refuses; one that answers with anything but that model's manifest lied.
    async fn manifest(&self, holders: &mut [Holder]) -> Result<(Gguf, ModelIdentity), FetchError> {
        let mut why = String::new();
        for h in holders.iter_mut() {
            let m = match self.ask(h, String::new(), 0, 0).await {
                Ok(Body::Manifest(m)) => m,
                Ok(Body::Error(e)) => {
                    why = format!("{}: {}", h.addr, e.message);
                    continue;
                }
                Ok(_) => {
                    why = format!("{}: an answer that is not a manifest", h.addr);
                    continue;
                }
                Err(e) => {
                    why = format!("{}: {e}", h.addr);
                    continue;
                }
            };
            let checked = Gguf::from_bytes(m.gguf).map_err(|e| e.to_string()).and_then(|g| match ModelIdentity::claimed(&g) {
                Some(id) if id.id == self.model_id => Ok((g, id)),
                Some(id) => Err(format!("a manifest of model {}", id.id)),
                None => Err("a manifest that is not a slice header".into()),
            });
            match checked {
                Ok(found) => return Ok(found),
                Err(e) => {
                    h.lied = true;
                    why = format!("{} sent {e}", h.addr);
                }
            }
        }
        Err(FetchError::NoManifest { model_id: self.model_id.clone(), why })
    }

    /// Fetches one tensor into `file` at `at`, from the first holder whose bytes hash right.
    #[allow(clippy::too_many_arguments)]
    async fn tensor(
        &self,
        holders: &mut [Holder],
        file: &mut std::fs::File,
        part: &Path,
        name: &str,
        at: u64,
        len: u64,
        want: [u8; 32],
        n_layers: u32,
        tied: bool,
    ) -> Result<(), FetchError> {
        let mut why = "no holder serves it".to_string();
        for round in 0..ROUNDS {
            if round > 0 {
                tokio::time::sleep(Duration::from_millis(200 << round)).await;
            }
            for h in holders.iter_mut() {
                if h.lied || !dgr_gguf::needed_by_stage(name, h.layers.start, h.layers.end, n_layers, tied) {
                    continue;
                }
                let mut hash = Sha256::new();
                let mut off = 0u64;
                let result = loop {
                    if off == len {
                        break Ok(());
                    }
                    let n = (len - off).min(MAX_CHUNK as u64) as u32;
                    match self.ask(h, name.into(), off, n).await {
                        Ok(Body::Chunk(c)) if c.tensor == name && c.offset == off && c.data.len() == n as usize => {
                            hash.update(&c.data);
                            if let Err(e) = file.write_all_at(&c.data, at + off) {
                                return Err(FetchError::Io { path: part.to_path_buf(), source: e });
                            }
                            off += n as u64;
                        }
                        Ok(Body::Error(e)) => break Err(e.message),
                        Ok(_) => break Err("an answer that is not the chunk asked for".into()),
                        Err(e) => break Err(e),
                    }
                };
                match result {
                    Ok(()) if <[u8; 32]>::from(hash.finalize()) == want => return Ok(()),
                    Ok(()) => {
                        h.lied = true;
                        h.conn = None;
                        why = format!("{} ({}) sent bytes that do not match the model's identity", h.addr, h.worker_id);
                        eprintln!("dgr worker: fetching {name}: {why}; not asking it again");
                    }
                    Err(e) => {
                        h.conn = None;
                        why = format!("{}: {e}", h.addr);
                    }
                }
            }
        }
        Err(FetchError::Tensor { tensor: name.into(), why })
    }

    /// One ask and its answer, on the holder's connection (opened on first use).
    async fn ask(&self, h: &mut Holder, tensor: String, offset: u64, len: u32) -> Result<Body, String> {
        if h.conn.is_none() {
            h.conn = Some(connect(&h.addr).await?);
        }
        let conn = h.conn.as_mut().ok_or("no connection")?;
        let ask = FetchAsk { join_token: self.join_token.clone(), model_id: self.model_id.clone(), tensor, offset, len };
        let sent = tokio::time::timeout(TIMEOUT, conn.send(Bytes::from(Frame::new(Body::Fetch(ask)).encode_to_vec()))).await;
        if !matches!(sent, Ok(Ok(()))) {
            h.conn = None;
            return Err("could not send".into());
        }
        match tokio::time::timeout(TIMEOUT, conn.next()).await {
            Ok(Some(Ok(b))) => match Frame::decode(b) {
                Ok(Frame { body: Some(body) }) => Ok(body),
                _ => Err("an undecodable answer".into()),
            },
            Ok(Some(Err(e))) => Err(e.to_string()),
            Ok(None) => Err("connection closed".into()),
            Err(_) => Err("no answer in time".into()),
        }
    }
}

async fn connect(addr: &str) -> Result<Framed<dgr_proto::SecureStream, LengthDelimitedCodec>, String> {
    let stream = dgr_proto::dial(addr, TIMEOUT).await.map_err(|e| e.to_string())?;
    let mut conn = Framed::new(stream, dgr_proto::codec(dgr_proto::DEFAULT_MAX_FRAME));
    let hello = Hello { protocol_version: PROTOCOL_VERSION, role: Role::Driver as i32, info: None };
    conn.send(Bytes::from(Frame::new(Body::Hello(hello)).encode_to_vec())).await.map_err(|e| e.to_string())?;
    match tokio::time::timeout(TIMEOUT, conn.next()).await {
        Ok(Some(Ok(b))) => match Frame::decode(b) {
            Ok(Frame { body: Some(Body::Hello(h)) }) if h.info.is_some() => Ok(conn),
            Ok(Frame { body: Some(Body::Error(e)) }) => Err(e.message),
            _ => Err("no worker's Hello".into()),
        },
        _ => Err("no Hello".into()),
    }
}

/// Logs what a fetch did, for the worker's stderr.
pub fn describe(f: &Fetched, took: Instant) -> String {
    if f.cached {
        return format!("slice {} already here", f.path.display());
    }
    let mut s = format!(
        "fetched {} tensors ({:.1} MB) into {} in {:.1} s",
        f.tensors_fetched,
        f.bytes_fetched as f64 / 1e6,
        f.path.display(),
        took.elapsed().as_secs_f64()
    );
    if f.tensors_resumed > 0 {
        s += &format!("; {} tensors were already there from an interrupted fetch", f.tensors_resumed);
    }
    if !f.liars.is_empty() {
        s += &format!("; caught {} holder(s) sending corrupted bytes: {}", f.liars.len(), f.liars.join(", "));
    }
    s
}

//! A worker started without a layer range: it takes as many layers as its memory holds, and a
//! tracker of its swarm says which (where they add most to the swarm's capacity for the model:
//! the tracker's `place`). Asked before anything is loaded, so only that range is mapped.

use dgr_proto::{PlaceRequest, Placed, RefusalKind, TrackerBody, TrackerCallError, TrackerClient};
use std::path::Path;
use std::time::{Duration, Instant};

/// Of the memory a worker may use, the share its weights may take: the rest is for the KV
/// cache, each step's scratch and (on the CPU) everything else the host runs.
pub const WEIGHT_SHARE: f64 = 0.75;

const CALL: Duration = Duration::from_secs(5);
const RETRY: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum PlaceError {
    #[error("opening the model: {0}")]
    Model(#[from] dgr_hf::HfError),
    #[error(transparent)]
    Engine(#[from] dgr_engine::EngineError),
    #[error("the model's head takes {head} bytes and a layer up to {layer}, and {room} bytes of memory are free: not even one layer fits")]
    NoRoom { head: u64, layer: u64, room: u64 },
    #[error("the tracker at {addr} would not place this worker: {why}")]
    Refused { addr: String, why: String },
    #[error("the tracker at {addr} placed this worker at layers {start}..{end}, which is not a range of at most {max} of this model's {n} layers")]
    BadRange { addr: String, start: u32, end: u32, n: u32, max: u32 },
    #[error("no tracker at {trackers} placed this worker within {} s (every attempt's reason is logged above)", .after.as_secs_f64())]
    Timeout { trackers: String, after: Duration },
}

/// How large a model's layers are: its layer count, each layer's tensor bytes, and the head's
/// (which a last stage holds).
pub struct ModelSizes {
    pub n_layers: u32,
    pub layers: Vec<u64>,
    pub head: u64,
}

impl ModelSizes {
    /// The model at `path` (a GGUF file or a checkpoint directory), and its identity.
    pub fn of_file(path: &Path) -> Result<(String, ModelSizes), PlaceError> {
        let g = dgr_hf::open_any(path)?;
        let n = dgr_engine::ModelConfig::from_gguf(&g)?.n_layers;
        let (layers, head) = g.per_layer(n, |t| t.n_bytes);
        let n_layers = u32::try_from(n).unwrap_or(u32::MAX);
        Ok((dgr_hf::identity_any(path)?.id, ModelSizes { n_layers, layers, head }))
    }

    /// How many of its layers fit in `room` bytes (every one where the room is not known).
    pub fn fit(&self, room: Option<u64>) -> Result<u32, PlaceError> {
        let Some(room) = room else { return Ok(self.n_layers) };
        match layers_that_fit(&self.layers, self.head, room) {
            0 => Err(PlaceError::NoRoom { head: self.head, layer: self.layers.iter().copied().max().unwrap_or(0), room }),
            fit => Ok(u32::try_from(fit).unwrap_or(u32::MAX)),
        }
    }
}

/// How many layers fit in `room` bytes wherever the range lands: the head (which a last stage
/// holds) and that many of the largest layers, their weights taking at most `WEIGHT_SHARE`.
fn layers_that_fit(layers: &[u64], head: u64, room: u64) -> usize {
    let limit = (room as f64 * WEIGHT_SHARE) as u64;
    let mut largest = layers.to_vec();
    largest.sort_unstable_by(|a, b| b.cmp(a));
    let mut used = head;
    largest
        .iter()
        .take_while(|&&b| {
            used = used.saturating_add(b);
            used <= limit
        })
        .count()
}

/// The memory the system could give this process now (Linux's MemAvailable), if it says.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = info.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
    kib.checked_mul(1024)
}

/// A placement to ask for: of model `model_id` (`n_layers` layers), at most `max_layers`, from
/// the first of `trackers` that answers, trying for `timeout`.
pub struct PlaceSpec {
    pub trackers: Vec<String>,
    pub join_token: String,
    pub model_id: String,
    pub n_layers: u32,
    pub max_layers: u32,
    pub timeout: Duration,
}

impl PlaceSpec {
    /// The range a tracker assigned, and that tracker's address. A tracker that cannot be
    /// reached, or refuses the join token, is said and tried again (as a join is); one that
    /// refuses the request, or answers with a range this worker cannot serve, is final.
    pub async fn run(&self) -> Result<(std::ops::Range<usize>, String), PlaceError> {
        let started = Instant::now();
        loop {
            for addr in &self.trackers {
                match self.ask(addr).await {
                    Ok(p) => return Ok((self.check(p, addr)?, addr.clone())),
                    Err(TrackerCallError::Refused(r)) if r.refusal_kind() == RefusalKind::BadRequest => {
                        return Err(PlaceError::Refused { addr: addr.clone(), why: r.message })
                    }
                    Err(e) => eprintln!("dgr worker: asking the tracker at {addr} for layers to serve: {e}"),
                }
            }
            if started.elapsed() >= self.timeout {
                return Err(PlaceError::Timeout { trackers: self.trackers.join(", "), after: self.timeout });
            }
            tokio::time::sleep(RETRY).await;
        }
    }

    async fn ask(&self, addr: &str) -> Result<Placed, TrackerCallError> {
        let mut c = TrackerClient::connect(addr, CALL).await?;
        let req = PlaceRequest {
            join_token: self.join_token.clone(),
            model_id: self.model_id.clone(),
            n_layers: self.n_layers,
            max_layers: self.max_layers,
        };
        match c.call(TrackerBody::PlaceRequest(req)).await? {
            TrackerBody::Placed(p) => Ok(p),
            _ => Err(TrackerCallError::Protocol { addr: addr.into() }),
        }
    }

    /// `p`, if it is a range of at most `max_layers` of the model's layers.
    fn check(&self, p: Placed, addr: &str) -> Result<std::ops::Range<usize>, PlaceError> {
        let ok = p.layer_start < p.layer_end && p.layer_end <= self.n_layers && p.layer_end - p.layer_start <= self.max_layers;
        if !ok {
            let (start, end, n, max) = (p.layer_start, p.layer_end, self.n_layers, self.max_layers);
            return Err(PlaceError::BadRange { addr: addr.into(), start, end, n, max });
        }
        Ok(p.layer_start as usize..p.layer_end as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_fit_with_the_head_in_the_weights_share_of_the_room() {
        // 4 layers of 100 (one of 150) and a head of 200, in room whose weights' share is 600.
        let layers = [100, 150, 100, 100];
        assert_eq!(layers_that_fit(&layers, 200, 800), 3);
        assert_eq!(layers_that_fit(&layers, 200, 10_000), 4);
        // The largest layer counts first: wherever the range lands, it fits.
        assert_eq!(layers_that_fit(&layers, 200, 467), 1);
        assert_eq!(layers_that_fit(&layers, 200, 400), 0);
        // A head over the share alone leaves no room for any layer.
        assert_eq!(layers_that_fit(&layers, 700, 800), 0);
    }

    #[test]
    fn a_model_fits_whole_where_the_room_is_unknown_and_not_at_all_says_why() {
        let sizes = ModelSizes { n_layers: 4, layers: vec![100, 150, 100, 100], head: 200 };
        assert_eq!(sizes.fit(None).unwrap(), 4);
        assert_eq!(sizes.fit(Some(800)).unwrap(), 3);
        let err = sizes.fit(Some(400)).unwrap_err().to_string();
        assert!(err.contains("head takes 200 bytes and a layer up to 150, and 400 bytes of memory are free"), "{err}");
    }
}

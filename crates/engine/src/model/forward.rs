//! The llama-family forward, written once over a [`Backend`]: one contiguous layer range of a
//! model, and one batched forward over many sequences, each at its own positions. What each
//! architecture changes comes from its [`ModelConfig`] (`model::adapt`).

use super::batch::{Input, LogitRows, SeqInput, SeqOutput};
use super::weights::{self, Weights};
use crate::backend::{Backend, Heads, KvShape, KvStore, Product};
use crate::config::ModelConfig;
use crate::{EngineError, EngineId, EngineSpec, Format, KvDtype, Numerics, SeqState};
use dgr_gguf::Gguf;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Layers `range` of a model on backend `B`: its weights held there, and the forward.
pub struct Model<B: Backend> {
    gguf: Arc<Gguf>,
    cfg: ModelConfig,
    range: Range<usize>,
    weights: Weights<B>,
    numerics: Numerics,
    kv: KvDtype,
    backend: B,
    /// Names this stage in the KV caches it makes, so that no other stage takes them.
    id: u64,
}

static NEXT_STAGE_ID: AtomicU64 = AtomicU64::new(1);

impl<B: Backend> Model<B> {
    /// Opens layers `range` of the model (see [`crate::open_engine`], which checked `spec`).
    pub(crate) fn open(gguf: Arc<Gguf>, range: Range<usize>, spec: EngineSpec) -> Result<Model<B>, EngineError> {
        let cfg = ModelConfig::from_gguf(&gguf)?;
        if range.start >= range.end || range.end > cfg.n_layers {
            return Err(EngineError::BadLayerRange { start: range.start, end: range.end, n_layers: cfg.n_layers });
        }
        let backend = B::open(&gguf, &spec)?;
        backend.check_config(&cfg)?;
        let weights = weights::load(&backend, &gguf, &cfg, range.clone())?;
        Ok(Model {
            gguf,
            cfg,
            range,
            weights,
            numerics: spec.numerics,
            kv: spec.kv,
            backend,
            id: NEXT_STAGE_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn layers(&self) -> Range<usize> {
        self.range.clone()
    }

    pub fn is_first(&self) -> bool {
        self.weights.embed.is_some()
    }

    pub fn is_last(&self) -> bool {
        self.weights.head.is_some()
    }

    pub fn gguf(&self) -> &Arc<Gguf> {
        &self.gguf
    }

    pub(crate) fn backend(&self) -> &B {
        &self.backend
    }

    /// The engine computing this stage: the model's format, the backend and the numerics (a
    /// compatibility key field: sessions of different engines never share a batch or a route).
    pub fn engine(&self) -> EngineId {
        EngineId { format: Format::of(&self.gguf), backend: B::KIND, numerics: self.numerics, kv: self.kv, adapter: self.backend.adapter() }
    }

    /// Bytes of weights this stage reads.
    pub fn weight_bytes(&self) -> usize {
        self.weights.bytes
    }

    /// Bytes one position of a sequence over all of this stage's layers takes, keys and values
    /// in its KV dtype (what `KvCache::bytes` counts per position).
    pub fn kv_position_bytes(&self) -> usize {
        let (kvd, block) = (self.cfg.kv_dim(), KvDtype::q8_block(self.cfg.head_dim));
        2 * self.range.len() * self.backend.kv_row_bytes(self.kv, kvd, block)
    }

    /// A fresh, empty KV cache for one sequence over all of this stage's layers, holding at most
    /// `capacity` positions (and never more than the model's context length).
    pub fn new_kv(&self, capacity: usize) -> B::Kv {
        self.kv(capacity, self.range.clone())
    }

    /// Like `new_kv`, for a sequence that runs only layers `sub`, a non-empty part of this
    /// stage's: its forwards embed tokens iff `sub` starts at 0, and end with the head iff `sub`
    /// ends at the model's last layer; otherwise they take and return hidden rows.
    pub fn new_kv_for(&self, capacity: usize, sub: Range<usize>) -> Result<B::Kv, EngineError> {
        if sub.start >= sub.end || sub.start < self.range.start || sub.end > self.range.end {
            return Err(EngineError::BadSubRange { sub, held: self.range.clone() });
        }
        Ok(self.kv(capacity, sub))
    }

    fn kv(&self, capacity: usize, layers: Range<usize>) -> B::Kv {
        let cfg = &self.cfg;
        self.backend.new_kv(KvShape {
            capacity: capacity.min(cfg.context),
            windowed: layers.clone().map(|il| cfg.window(il).is_some()).collect(),
            layers,
            window: cfg.sliding_window.as_ref().map(|s| s.window),
            width: cfg.kv_dim(),
            dtype: self.kv,
            block: KvDtype::q8_block(cfg.head_dim),
            owner: self.id,
        })
    }

    /// Checks one sequence's input as `forward` would, returning its row count, so a caller can
    /// turn away one bad sequence without failing a whole batch. A KV cache made by this stage
    /// runs a part of its layers (`new_kv_for` checked that), so the stage id is the whole check.
    pub fn check(&self, s: &SeqInput<B::Kv>) -> Result<usize, EngineError> {
        self.check_parts(s.kv, &s.input)
    }

    /// `check` of a sequence's cache and input.
    pub(crate) fn check_parts(&self, kv: &B::Kv, input: &Input) -> Result<usize, EngineError> {
        if kv.owner() != self.id {
            return Err(EngineError::BadInput("KV cache belongs to another stage".into()));
        }
        let rows = match (input, kv.layers().start == 0) {
            (Input::Tokens(t), true) => {
                if let Some(&bad) = t.iter().find(|&&t| t as usize >= self.cfg.vocab) {
                    return Err(EngineError::TokenOutOfRange { token: bad, vocab: self.cfg.vocab });
                }
                t.len()
            }
            (Input::Hidden(x), false) => {
                if x.len() % self.cfg.hidden != 0 {
                    return Err(EngineError::BadInput(format!("{} hidden floats are not whole rows of {}", x.len(), self.cfg.hidden)));
                }
                x.len() / self.cfg.hidden
            }
            (Input::Tokens(_), false) => return Err(EngineError::BadInput("token ids sent to layers past the embedding".into())),
            (Input::Hidden(_), true) => return Err(EngineError::BadInput("hidden rows sent to the first layer".into())),
        };
        if rows == 0 {
            return Err(EngineError::BadInput("a sequence with no rows".into()));
        }
        let needed = kv.positions() + rows;
        if needed > kv.capacity() {
            return Err(EngineError::ContextFull { needed, capacity: kv.capacity() });
        }
        Ok(rows)
    }

    /// Runs every sequence's rows through its KV cache's layers in one batch; every sequence of
    /// a batch must run the same layers. Each sequence's result is bitwise what it would be
    /// alone: every operation is per row or per sequence, and every reduction has a fixed order
    /// (the backend's promise).
    pub fn forward(&self, batch: &mut [SeqInput<B::Kv>]) -> Result<Vec<SeqOutput>, EngineError> {
        let Some(sub) = batch.first().map(|s| s.kv.layers()) else { return Ok(Vec::new()) };
        let mut rows_of = Vec::with_capacity(batch.len());
        for s in batch.iter() {
            if s.kv.layers() != sub {
                return Err(EngineError::MixedLayerRanges { a: sub, b: s.kv.layers() });
            }
            rows_of.push(self.check(s)?);
        }
        let (b, cfg) = (&self.backend, &self.cfg);
        let (h, hd, kvd, qd, eps) = (cfg.hidden, cfg.head_dim, cfg.kv_dim(), cfg.q_dim(), cfg.rms_eps);
        let t_all: usize = rows_of.iter().sum();

        // The rows in batch order: embedded tokens from layer 0 (`check` let tokens in there
        // only), hidden rows past it.
        let mut x = if sub.start == 0 {
            let Some(table) = &self.weights.embed else { unreachable!("a stage running layer 0 holds the embedding") };
            let mut tokens = Vec::with_capacity(t_all);
            batch.iter().for_each(|s| {
                if let Input::Tokens(t) = &s.input {
                    tokens.extend_from_slice(t)
                }
            });
            b.embed(table, &tokens, cfg.embed_scale)?
        } else {
            let mut hidden = Vec::with_capacity(t_all * h);
            batch.iter().for_each(|s| {
                if let Input::Hidden(x) = &s.input {
                    hidden.extend_from_slice(x)
                }
            });
            b.upload(hidden)
        };
        // Row t belongs to sequence seq_of[t] at position pos_of[t].
        let (mut seq_of, mut pos_of) = (Vec::with_capacity(t_all), Vec::with_capacity(t_all));
        for (si, s) in batch.iter().enumerate() {
            seq_of.extend(std::iter::repeat_n(si, rows_of[si]));
            pos_of.extend(s.kv.positions()..s.kv.positions() + rows_of[si]);
        }
        let rows = b.rows(seq_of, pos_of);
        // Each row's rotations; sliding-window layers have their own base, unscaled (llama.cpp's
        // `rope_freq_base_train_swa`, `rope_freq_scale_train_swa`).
        let rope_full = b.rope_table(&rows, cfg.rope_dim, cfg.rope_base, cfg.rope_scale);
        let rope_window = cfg.sliding_window.as_ref().map(|s| b.rope_table(&rows, cfg.rope_dim, s.rope_base, 1.0));
        for (si, s) in batch.iter_mut().enumerate() {
            b.kv_reserve(s.kv, rows_of[si]);
        }

        let mut xn = b.alloc(t_all * h);
        let (mut q, mut k, mut v) = (b.alloc(t_all * qd), b.alloc(t_all * kvd), b.alloc(t_all * kvd));
        let mut att = b.alloc(t_all * qd);
        let mut o = b.alloc(t_all * h);
        let (mut gate, mut up) = (b.alloc(t_all * cfg.ffn), b.alloc(t_all * cfg.ffn));

        // The batch's layers within the stage's; `li` indexes each KV cache's layers.
        let layers = &self.weights.layers[sub.start - self.range.start..sub.end - self.range.start];
        for (li, layer) in layers.iter().enumerate() {
            let window = cfg.window(sub.start + li);
            let rope = match (window, &rope_window) {
                (Some(_), Some(r)) => r,
                _ => &rope_full,
            };
            b.rms_norm(&x, &layer.attn_norm, eps, &mut xn);
            b.matmul(
                &xn,
                t_all,
                &mut [Product { w: &layer.wq, out: &mut q }, Product { w: &layer.wk, out: &mut k }, Product { w: &layer.wv, out: &mut v }],
            );
            if let Some([bq, bk, bv]) = &layer.bias {
                b.add_bias(&mut q, bq);
                b.add_bias(&mut k, bk);
                b.add_bias(&mut v, bv);
            }
            if let Some([nq, nk]) = &layer.qk_norm {
                b.rms_norm_heads(&mut q, nq, eps);
                b.rms_norm_heads(&mut k, nk, eps);
            }
            b.rope(&mut q, qd, hd, rope, cfg.rope_style);
            b.rope(&mut k, kvd, hd, rope, cfg.rope_style);
            let mut t0 = 0;
            for (si, s) in batch.iter_mut().enumerate() {
                b.kv_append(s.kv, li, &k, &v, t0..t0 + rows_of[si]);
                t0 += rows_of[si];
            }
            let kvs: Vec<&B::Kv> = batch.iter().map(|s| &*s.kv).collect();
            let heads = Heads { n_head: cfg.n_head, n_kv: cfg.n_head_kv, dim: hd, scale: cfg.attn_scale, window };
            b.attend(&kvs, li, &rows, heads, &q, &mut att);
            b.matmul(&att, t_all, &mut [Product { w: &layer.wo, out: &mut o }]);
            b.residual(&mut x, &o, layer.post_norms.as_ref().map(|[n, _]| (n, eps)), h, &mut xn);
            b.rms_norm(&x, &layer.ffn_norm, eps, &mut xn);
            b.matmul(&xn, t_all, &mut [Product { w: &layer.gate, out: &mut gate }, Product { w: &layer.up, out: &mut up }]);
            b.activate(cfg.activation, &mut gate, &up, cfg.ffn);
            b.matmul(&gate, t_all, &mut [Product { w: &layer.down, out: &mut o }]);
            b.residual(&mut x, &o, layer.post_norms.as_ref().map(|[_, n]| (n, eps)), h, &mut xn);
        }
        for (si, s) in batch.iter_mut().enumerate() {
            b.kv_advance(s.kv, rows_of[si]);
        }

        let mut outputs: Vec<SeqOutput> = (0..batch.len()).map(|_| SeqOutput::default()).collect();
        let Some(head) = self.weights.head.as_ref().filter(|_| sub.end == cfg.n_layers) else {
            let mut t0 = 0;
            for (si, out) in outputs.iter_mut().enumerate() {
                b.read(&x, t0 * h..(t0 + rows_of[si]) * h, &mut out.hidden)?;
                t0 += rows_of[si];
            }
            return Ok(outputs);
        };
        // The rows that want logits, in batch order; an embedding's rows, normed, read back.
        let mut picked = Vec::new();
        let mut t0 = 0;
        for (si, s) in batch.iter().enumerate() {
            let n = rows_of[si];
            let rows = match s.logits {
                LogitRows::Normed => {
                    let mut normed = b.alloc(n * h);
                    b.rms_norm(&b.gather(&x, h, &(t0..t0 + n).collect::<Vec<_>>()), &head.norm, eps, &mut normed);
                    b.read(&normed, 0..n * h, &mut outputs[si].hidden)?;
                    0..0
                }
                LogitRows::None => 0..0,
                LogitRows::Last => n - 1..n,
                LogitRows::All => 0..n,
            };
            picked.extend(rows.map(|r| (si, t0 + r)));
            t0 += n;
        }
        let mut hn = b.alloc(picked.len() * h);
        b.rms_norm(&b.gather(&x, h, &picked.iter().map(|&(_, t)| t).collect::<Vec<_>>()), &head.norm, eps, &mut hn);
        let vocab = cfg.vocab;
        let mut logits = b.alloc(picked.len() * vocab);
        b.matmul(&hn, picked.len(), &mut [Product { w: &head.w, out: &mut logits }]);
        if let Some(cap) = cfg.logit_softcap {
            b.softcap(&mut logits, cap);
        }
        for (i, &(si, _)) in picked.iter().enumerate() {
            b.read(&logits, i * vocab..(i + 1) * vocab, &mut outputs[si].logits)?;
        }
        Ok(outputs)
    }
}

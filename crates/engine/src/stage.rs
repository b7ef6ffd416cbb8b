//! A `Stage`: the weights of one contiguous layer range, and one batched forward over many
//! sequences, each at its own positions.

use crate::backend::cpu::kernels::Isa;
use crate::backend::cpu::matrix::{matmul, Matrix, Product};
use crate::backend::cpu::ops;
use crate::backend::cpu::pool::{Disjoint, ThreadPool};
use crate::config::ModelConfig;
use crate::kv::{KvCache, Store, Window};
use crate::{BackendKind, EngineError, EngineId, EngineSpec, Format, KvDtype, Numerics};
use dgr_gguf::{GgmlType, Gguf};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

struct Layer {
    attn_norm: Vec<f32>,
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    bias: Option<[Vec<f32>; 3]>,
    /// Per-head norms of queries and keys (qwen3, gemma3).
    qk_norm: Option<[Vec<f32>; 2]>,
    wo: Matrix,
    /// Norms of the attention's and the FFN's outputs, before each residual add (gemma3).
    post_norms: Option<[Vec<f32>; 2]>,
    ffn_norm: Vec<f32>,
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

struct Head {
    norm: Vec<f32>,
    w: Matrix,
}

/// What a sequence brings to a forward: token ids (when its layers start at 0) or hidden rows.
pub enum Input<'a> {
    Tokens(&'a [u32]),
    Hidden(&'a [f32]),
}

/// Which rows of a sequence want logits, when its layers end at the model's last.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    None,
    Last,
    All,
    /// No logits: every row after the final norm (what the head would read), in `hidden`, for
    /// an embedding.
    Normed,
}

/// One sequence's part of a batched forward. Its rows take positions `kv.len()..`. `K` is the
/// engine's per-sequence state (this engine's: a [`KvCache`]).
pub struct SeqInput<'a, K = KvCache> {
    pub kv: &'a mut K,
    pub input: Input<'a>,
    pub logits: LogitRows,
}

/// One sequence's result: hidden rows for the next stage (every row, when the sequence's layers
/// end before the model's last) or logits (`vocab` floats per requested row, otherwise), or
/// every row final-normed (`LogitRows::Normed`).
#[derive(Debug, Default)]
pub struct SeqOutput {
    pub hidden: Vec<f32>,
    pub logits: Vec<f32>,
}

pub struct Stage {
    gguf: Arc<Gguf>,
    cfg: ModelConfig,
    range: Range<usize>,
    embed: Option<Matrix>,
    layers: Vec<Layer>,
    head: Option<Head>,
    isa: Isa,
    numerics: Numerics,
    kv: KvDtype,
    pool: ThreadPool,
    id: u64,
}

static NEXT_STAGE_ID: AtomicU64 = AtomicU64::new(1);

fn vector(g: &Gguf, name: &str, len: usize) -> Result<Vec<f32>, EngineError> {
    let t = g.tensor(name).filter(|t| g.is_mapped(t)).ok_or_else(|| EngineError::MissingTensor(name.into()))?;
    if t.dims != [len as u64] {
        return Err(EngineError::BadShape { name: name.into(), expected: vec![len as u64], found: t.dims.clone() });
    }
    if !matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        return Err(EngineError::UnsupportedType { name: name.into(), ty: t.ty.name() });
    }
    let mut out = vec![0f32; len];
    dgr_gguf::quant::dequantize_row(t.ty, g.tensor_data(t), &mut out)?;
    Ok(out)
}

impl Stage {
    /// Opens layers `range` of the model (see [`crate::open_engine`], which checked `spec`).
    pub(crate) fn open(gguf: Arc<Gguf>, range: Range<usize>, spec: EngineSpec) -> Result<Stage, EngineError> {
        let cfg = ModelConfig::from_gguf(&gguf)?;
        if range.start >= range.end || range.end > cfg.n_layers {
            return Err(EngineError::BadLayerRange { start: range.start, end: range.end, n_layers: cfg.n_layers });
        }
        let g = &*gguf;
        let (h, kvd, qd, f) = (cfg.hidden, cfg.kv_dim(), cfg.q_dim(), cfg.ffn);
        let embed = if range.start == 0 { Some(Matrix::load(g, "token_embd.weight", h, cfg.vocab)?) } else { None };
        let mut layers = Vec::with_capacity(range.len());
        for i in range.clone() {
            let n = |s: &str| format!("blk.{i}.{s}");
            let bias = if g.tensor(&n("attn_q.bias")).is_some() {
                Some([vector(g, &n("attn_q.bias"), qd)?, vector(g, &n("attn_k.bias"), kvd)?, vector(g, &n("attn_v.bias"), kvd)?])
            } else {
                None
            };
            let qk_norm = if cfg.qk_norm {
                Some([vector(g, &n("attn_q_norm.weight"), cfg.head_dim)?, vector(g, &n("attn_k_norm.weight"), cfg.head_dim)?])
            } else {
                None
            };
            let post_norms = if cfg.post_norms {
                Some([vector(g, &n("post_attention_norm.weight"), h)?, vector(g, &n("post_ffw_norm.weight"), h)?])
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: vector(g, &n("attn_norm.weight"), h)?,
                wq: Matrix::load(g, &n("attn_q.weight"), h, qd)?,
                wk: Matrix::load(g, &n("attn_k.weight"), h, kvd)?,
                wv: Matrix::load(g, &n("attn_v.weight"), h, kvd)?,
                bias,
                qk_norm,
                wo: Matrix::load(g, &n("attn_output.weight"), qd, h)?,
                post_norms,
                ffn_norm: vector(g, &n("ffn_norm.weight"), h)?,
                gate: Matrix::load(g, &n("ffn_gate.weight"), h, f)?,
                up: Matrix::load(g, &n("ffn_up.weight"), h, f)?,
                down: Matrix::load(g, &n("ffn_down.weight"), f, h)?,
            });
        }
        let head = if range.end == cfg.n_layers {
            let name = if g.tensor("output.weight").is_some() { "output.weight" } else { "token_embd.weight" };
            Some(Head { norm: vector(g, "output_norm.weight", h)?, w: Matrix::load(g, name, h, cfg.vocab)? })
        } else {
            None
        };
        let isa = spec.isa.unwrap_or_else(Isa::detect);
        Ok(Stage {
            gguf,
            cfg,
            range,
            embed,
            layers,
            head,
            isa,
            numerics: spec.numerics,
            kv: spec.kv,
            pool: ThreadPool::new(spec.threads),
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
        self.embed.is_some()
    }

    pub fn is_last(&self) -> bool {
        self.head.is_some()
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn gguf(&self) -> &Arc<Gguf> {
        &self.gguf
    }

    /// The engine computing this stage: the model's format, the backend and the numerics (a
    /// compatibility key field: sessions of different engines never share a batch or a route).
    pub fn engine(&self) -> EngineId {
        EngineId { format: Format::of(&self.gguf), backend: BackendKind::Cpu, numerics: self.numerics, kv: self.kv }
    }

    /// Bytes of weights this stage reads.
    pub fn weight_bytes(&self) -> usize {
        let mats = self.layers.iter().map(|l| {
            let norms = [&l.attn_norm, &l.ffn_norm].into_iter().chain(l.qk_norm.iter().flatten()).chain(l.post_norms.iter().flatten());
            [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down].iter().map(|m| m.bytes()).sum::<usize>()
                + 4 * norms.map(Vec::len).sum::<usize>()
        });
        let embed = self.embed.as_ref().map_or(0, |m| m.bytes());
        let head = self.head.as_ref().filter(|_| self.embed.is_none() || self.gguf.tensor("output.weight").is_some());
        mats.sum::<usize>() + embed + head.map_or(0, |h| h.w.bytes())
    }

    /// Bytes one position of a sequence over all of this stage's layers takes, keys and values
    /// in its KV dtype (what `KvCache::bytes` counts per position).
    pub fn kv_position_bytes(&self) -> usize {
        let (kvd, block) = (self.cfg.kv_dim(), KvDtype::q8_block(self.cfg.head_dim));
        2 * self.range.len() * self.kv.row_bytes(kvd, block)
    }

    /// A fresh, empty KV cache for one sequence over all of this stage's layers, holding at most
    /// `capacity` positions (and never more than the model's context length).
    pub fn new_kv(&self, capacity: usize) -> KvCache {
        self.kv(capacity, self.range.clone())
    }

    /// Like `new_kv`, for a sequence that runs only layers `sub`, a non-empty part of this
    /// stage's: its forwards embed tokens iff `sub` starts at 0, and end with the head iff `sub`
    /// ends at the model's last layer; otherwise they take and return hidden rows.
    pub fn new_kv_for(&self, capacity: usize, sub: Range<usize>) -> Result<KvCache, EngineError> {
        if sub.start >= sub.end || sub.start < self.range.start || sub.end > self.range.end {
            return Err(EngineError::BadSubRange { sub, held: self.range.clone() });
        }
        Ok(self.kv(capacity, sub))
    }

    fn kv(&self, capacity: usize, layers: Range<usize>) -> KvCache {
        let (capacity, kv_dim) = (capacity.min(self.cfg.context), self.cfg.kv_dim());
        let windowed: Vec<bool> = layers.clone().map(|il| self.cfg.window(il).is_some()).collect();
        let window = self.cfg.sliding_window.as_ref().filter(|_| windowed.contains(&true)).map(|s| {
            let base = capacity.min(2 * s.window);
            Window { size: s.window, start: 0, slots: base, base }
        });
        let slots = |on: bool| window.as_ref().filter(|_| on).map_or(capacity, |w| w.slots);
        let block = KvDtype::q8_block(self.cfg.head_dim);
        KvCache {
            store: windowed.iter().map(|&on| Store::new(self.kv, kv_dim, slots(on), block)).collect(),
            len: 0,
            capacity,
            stage_id: self.id,
            layers,
            windowed,
            window,
        }
    }

    /// Checks one sequence's input as `forward` would, returning its row count, so a caller can
    /// turn away one bad sequence without failing a whole batch. A KV cache made by this stage
    /// runs a part of its layers (`new_kv_for` checked that), so the stage id is the whole check.
    pub fn check(&self, s: &SeqInput) -> Result<usize, EngineError> {
        if s.kv.stage_id != self.id {
            return Err(EngineError::BadInput("KV cache belongs to another stage".into()));
        }
        let rows = match (&s.input, s.kv.layers.start == 0) {
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
        let needed = s.kv.len + rows;
        if needed > s.kv.capacity {
            return Err(EngineError::ContextFull { needed, capacity: s.kv.capacity });
        }
        Ok(rows)
    }

    /// Runs every sequence's rows through its KV cache's layers in one batch; every sequence of
    /// a batch must run the same layers. Each sequence's result is bitwise what it would be
    /// alone: every operation is per row or per sequence, and every reduction has a fixed order.
    pub fn forward(&self, batch: &mut [SeqInput]) -> Result<Vec<SeqOutput>, EngineError> {
        let Some(sub) = batch.first().map(|s| s.kv.layers.clone()) else { return Ok(Vec::new()) };
        let mut rows_of = Vec::with_capacity(batch.len());
        for s in batch.iter() {
            if s.kv.layers != sub {
                return Err(EngineError::MixedLayerRanges { a: sub, b: s.kv.layers.clone() });
            }
            rows_of.push(self.check(s)?);
        }
        let cfg = &self.cfg;
        let (h, hd, kvd, qd) = (cfg.hidden, cfg.head_dim, cfg.kv_dim(), cfg.q_dim());
        let t_all: usize = rows_of.iter().sum();
        let g = &*self.gguf;

        // Row t belongs to sequence seq_of[t] at position pos_of[t].
        let mut seq_of = Vec::with_capacity(t_all);
        let mut pos_of = Vec::with_capacity(t_all);
        let mut x = vec![0f32; t_all * h];
        let mut t = 0;
        for (si, s) in batch.iter().enumerate() {
            for r in 0..rows_of[si] {
                seq_of.push(si);
                pos_of.push(s.kv.len + r);
                let row = &mut x[t * h..(t + 1) * h];
                match (&s.input, &self.embed) {
                    (Input::Tokens(toks), Some(e)) => {
                        e.dequantize_row(g, toks[r] as usize, row)?;
                        if let Some(scale) = cfg.embed_scale {
                            row.iter_mut().for_each(|v| *v = (*v as f64 * scale) as f32);
                        }
                    }
                    (Input::Hidden(hs), _) => row.copy_from_slice(&hs[r * h..(r + 1) * h]),
                    (Input::Tokens(_), None) => unreachable!("checked above"),
                }
                t += 1;
            }
        }
        // Each row's rotations; sliding-window layers have their own base, unscaled (llama.cpp's
        // `rope_freq_base_train_swa`, `rope_freq_scale_train_swa`).
        let rotations = |base: f32, scale: f64| -> Vec<Vec<(f64, f64)>> {
            let mut angles = Vec::new();
            pos_of
                .iter()
                .map(|&p| {
                    ops::rope_angles(p, cfg.rope_dim, base, scale, &mut angles);
                    angles.clone()
                })
                .collect()
        };
        let rope_full = rotations(cfg.rope_base, cfg.rope_scale);
        let rope_window = cfg.sliding_window.as_ref().map(|s| rotations(s.rope_base, 1.0));
        for (si, s) in batch.iter_mut().enumerate() {
            s.kv.reserve(rows_of[si]);
        }

        let mut xn = vec![0f32; t_all * h];
        let (mut q, mut k, mut v) = (vec![0f32; t_all * qd], vec![0f32; t_all * kvd], vec![0f32; t_all * kvd]);
        let mut att = vec![0f32; t_all * qd];
        let mut o = vec![0f32; t_all * h];
        let (mut gate, mut up) = (vec![0f32; t_all * cfg.ffn], vec![0f32; t_all * cfg.ffn]);

        // The batch's layers within the stage's; `li` indexes each KV cache's layers.
        let layers = &self.layers[sub.start - self.range.start..sub.end - self.range.start];
        for (li, layer) in layers.iter().enumerate() {
            let window = cfg.window(sub.start + li);
            let rope = match (window, &rope_window) {
                (Some(_), Some(r)) => r,
                _ => &rope_full,
            };
            for t in 0..t_all {
                ops::rms_norm(&x[t * h..(t + 1) * h], &layer.attn_norm, cfg.rms_eps, &mut xn[t * h..(t + 1) * h]);
            }
            matmul(
                &self.pool,
                self.isa,
                self.numerics,
                g,
                &xn,
                t_all,
                &mut [Product { w: &layer.wq, out: &mut q }, Product { w: &layer.wk, out: &mut k }, Product { w: &layer.wv, out: &mut v }],
            );
            for t in 0..t_all {
                let (qt, kt) = (&mut q[t * qd..(t + 1) * qd], &mut k[t * kvd..(t + 1) * kvd]);
                if let Some([bq, bk, bv]) = &layer.bias {
                    add(qt, bq);
                    add(kt, bk);
                    add(&mut v[t * kvd..(t + 1) * kvd], bv);
                }
                if let Some([nq, nk]) = &layer.qk_norm {
                    ops::rms_norm_heads(qt, nq, cfg.rms_eps);
                    ops::rms_norm_heads(kt, nk, cfg.rms_eps);
                }
                ops::rope(qt, hd, &rope[t], cfg.rope_style);
                ops::rope(kt, hd, &rope[t], cfg.rope_style);
            }
            let mut t0 = 0;
            for (si, s) in batch.iter_mut().enumerate() {
                let n = rows_of[si];
                s.kv.append(li, &k[t0 * kvd..(t0 + n) * kvd], &v[t0 * kvd..(t0 + n) * kvd]);
                t0 += n;
            }
            self.attention(batch, li, window, &seq_of, &pos_of, &q, &mut att);
            matmul(&self.pool, self.isa, self.numerics, g, &att, t_all, &mut [Product { w: &layer.wo, out: &mut o }]);
            self.residual(&mut x, &o, layer.post_norms.as_ref().map(|[n, _]| n.as_slice()), &mut xn);
            for t in 0..t_all {
                ops::rms_norm(&x[t * h..(t + 1) * h], &layer.ffn_norm, cfg.rms_eps, &mut xn[t * h..(t + 1) * h]);
            }
            matmul(
                &self.pool,
                self.isa,
                self.numerics,
                g,
                &xn,
                t_all,
                &mut [Product { w: &layer.gate, out: &mut gate }, Product { w: &layer.up, out: &mut up }],
            );
            self.activate(&mut gate, &up);
            matmul(&self.pool, self.isa, self.numerics, g, &gate, t_all, &mut [Product { w: &layer.down, out: &mut o }]);
            self.residual(&mut x, &o, layer.post_norms.as_ref().map(|[_, n]| n.as_slice()), &mut xn);
        }
        for (si, s) in batch.iter_mut().enumerate() {
            s.kv.len += rows_of[si];
        }

        let mut outputs: Vec<SeqOutput> = (0..batch.len()).map(|_| SeqOutput::default()).collect();
        let Some(head) = self.head.as_ref().filter(|_| sub.end == cfg.n_layers) else {
            let mut t0 = 0;
            for (si, out) in outputs.iter_mut().enumerate() {
                out.hidden = x[t0 * h..(t0 + rows_of[si]) * h].to_vec();
                t0 += rows_of[si];
            }
            return Ok(outputs);
        };
        // The rows that want logits, normed, in batch order.
        let mut picked = Vec::new();
        let mut t0 = 0;
        for (si, s) in batch.iter().enumerate() {
            let n = rows_of[si];
            let rows = match s.logits {
                LogitRows::Normed => {
                    let normed = &mut outputs[si].hidden;
                    normed.resize(n * h, 0.0);
                    for r in 0..n {
                        let t = t0 + r;
                        ops::rms_norm(&x[t * h..(t + 1) * h], &head.norm, cfg.rms_eps, &mut normed[r * h..(r + 1) * h]);
                    }
                    0..0
                }
                LogitRows::None => 0..0,
                LogitRows::Last => n - 1..n,
                LogitRows::All => 0..n,
            };
            for r in rows {
                picked.push((si, t0 + r));
            }
            t0 += n;
        }
        let mut hn = vec![0f32; picked.len() * h];
        for (i, &(_, t)) in picked.iter().enumerate() {
            ops::rms_norm(&x[t * h..(t + 1) * h], &head.norm, cfg.rms_eps, &mut hn[i * h..(i + 1) * h]);
        }
        let vocab = cfg.vocab;
        let mut logits = vec![0f32; picked.len() * vocab];
        matmul(&self.pool, self.isa, self.numerics, g, &hn, picked.len(), &mut [Product { w: &head.w, out: &mut logits }]);
        if let Some(cap) = cfg.logit_softcap {
            let cap = cap as f64;
            logits.iter_mut().for_each(|l| *l = (cap * (*l as f64 / cap).tanh()) as f32);
        }
        for (i, &(si, _)) in picked.iter().enumerate() {
            outputs[si].logits.extend_from_slice(&logits[i * vocab..(i + 1) * vocab]);
        }
        Ok(outputs)
    }

    /// `gate = act(gate) * up`, row by row, spread over the pool (GELU's tanh is dear).
    fn activate(&self, gate: &mut [f32], up: &[f32]) {
        let ffn = self.cfg.ffn;
        let rows = gate.len() / ffn;
        let out = Disjoint::new(gate);
        let grain = (rows / (4 * self.pool.threads())).max(4);
        self.pool.run(rows, grain, &|r| {
            // SAFETY: the pool hands each row to one chunk, so these rows are this call's alone.
            let g = unsafe { out.slice(r.start * ffn, r.len() * ffn) };
            let u = &up[r.start * ffn..r.end * ffn];
            ops::activate(self.isa, self.cfg.activation, g, u)
        });
    }

    /// Adds a block's output `o` to the residual stream `x`, normed by `norm` first when the
    /// model has one there (gemma3; `scratch` takes the normed rows).
    fn residual(&self, x: &mut [f32], o: &[f32], norm: Option<&[f32]>, scratch: &mut [f32]) {
        let Some(w) = norm else { return add(x, o) };
        let h = self.cfg.hidden;
        for ((xt, ot), st) in x.chunks_exact_mut(h).zip(o.chunks_exact(h)).zip(scratch.chunks_exact_mut(h)) {
            ops::rms_norm(ot, w, self.cfg.rms_eps, st);
            add(xt, st);
        }
    }

    /// Causal attention for every (row, head), spread over the pool, over the last `window`
    /// positions when the layer has one. Row t's sequence has already cached its keys and
    /// values up to and including position pos_of[t].
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        batch: &[SeqInput],
        li: usize,
        window: Option<usize>,
        seq_of: &[usize],
        pos_of: &[usize],
        q: &[f32],
        att: &mut [f32],
    ) {
        let cfg = &self.cfg;
        let (qd, hd) = (cfg.q_dim(), cfg.head_dim);
        let group = cfg.n_head / cfg.n_head_kv;
        let jobs = seq_of.len() * cfg.n_head;
        let out = Disjoint::new(att);
        // Per sequence: the layer's keys and values, slots per key row, and the position in slot 0.
        let caches: Vec<(&Store, usize, usize)> = batch
            .iter()
            .map(|s| {
                let (start, slots) = s.kv.span(li);
                (&s.kv.store[li], slots, start)
            })
            .collect();
        self.pool.run(jobs, 1, &|chunk| {
            SCRATCH.with_borrow_mut(|scratch| {
                for job in chunk {
                    let (t, head) = (job / cfg.n_head, job % cfg.n_head);
                    let (store, slots, start) = caches[seq_of[t]];
                    let first = window.map_or(0, |w| (pos_of[t] + 1).saturating_sub(w));
                    // SAFETY: job (t, head) alone touches att[t*qd + head*hd ..][..hd] (heads of
                    // a row are `hd` apart and rows `qd = n_head * hd` apart), and `slice` checks
                    // the bounds.
                    let dst = unsafe { out.slice(t * qd + head * hd, hd) };
                    let qh = &q[t * qd + head * hd..t * qd + (head + 1) * hd];
                    let ctx = first - start..pos_of[t] + 1 - start;
                    ops::attend(self.isa, qh, store, slots, ctx, (head / group) * hd, cfg.attn_scale, scratch, dst);
                }
            })
        });
    }
}

thread_local! {
    /// The attention scratch of the job at hand, kept per thread so that no job allocates.
    static SCRATCH: std::cell::RefCell<ops::Scratch> = std::cell::RefCell::new(ops::Scratch::default());
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

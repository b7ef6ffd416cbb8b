//! The prefix cache through real schedulers: a session that attaches cached blocks computes
//! the same tokens and logprob bits as a cold one, on 1, 2 and 3 stages, alone and batched;
//! under a tiny budget; apart per tenant; and bad prefixes or attach positions are typed errors.

use super::*;
use dgr_engine::synth::SynthSpec;
use dgr_engine::{Arch, KvDtype};
use dgr_proto::prefix_chain_bytes;
use std::ops::Range;
use tokio::sync::mpsc::{channel, Receiver as Inbox};

const LAYERS: usize = 6;

/// The tests' scheduler: over the CPU engine `open_engine` gives.
type Scheduler = super::Scheduler<dgr_engine::Stage>;

fn stage(spec: &SynthSpec, held: Range<usize>, cache: Option<usize>, kv: KvDtype) -> Scheduler {
    super::tests::scheduler_with(spec.to_gguf().unwrap(), held, |cfg| {
        cfg.kv_budget_tokens = 4096;
        cfg.prefix_cache_bytes = cache;
        cfg.kv_dtype = kv;
    })
}

/// A route of schedulers over the model's layers cut at `cuts`, with the hops between them.
struct Route {
    stages: Vec<Scheduler>,
    hops: Vec<(Outbox, Inbox<Frame>)>,
    next_id: u16,
}

/// One session as the test's driver sees it: its inbox on each stage.
struct Drive {
    id: Vec<u8>,
    inboxes: Vec<Inbox<Frame>>,
    prompt: Vec<u32>,
    out: Vec<(u32, u32)>,
    cached: usize,
}

impl Route {
    fn new(spec: &SynthSpec, cuts: &[usize], cache: Option<usize>) -> Route {
        Route::with_kv(spec, cuts, cache, KvDtype::F32)
    }

    fn with_kv(spec: &SynthSpec, cuts: &[usize], cache: Option<usize>, kv: KvDtype) -> Route {
        let bounds: Vec<usize> = std::iter::once(0).chain(cuts.iter().copied()).chain(std::iter::once(LAYERS)).collect();
        let stages = bounds.windows(2).map(|w| stage(spec, w[0]..w[1], cache, kv)).collect::<Vec<_>>();
        let hops = (1..stages.len()).map(|_| channel(1024)).collect();
        Route { stages, hops, next_id: 0 }
    }

    fn open(&mut self, prompt: &[u32], max_positions: u64, tenant: &str, blocks: Vec<Vec<u8>>) -> (Drive, Vec<Body>) {
        self.next_id += 1;
        let mut id = vec![0u8; 16];
        id[..2].copy_from_slice(&self.next_id.to_le_bytes());
        let n = self.stages.len();
        let (mut inboxes, mut replies) = (Vec::new(), Vec::new());
        for (i, s) in self.stages.iter_mut().enumerate() {
            let (reply, mut inbox) = channel(1024);
            let schema = s.schema.clone();
            let last = i + 1 == n;
            let open = OpenSession {
                session_id: id.clone(),
                schema: Some(schema),
                stage_index: i as u32,
                n_stages: n as u32,
                next: if last { String::new() } else { "next".into() },
                max_positions,
                prefix_blocks: blocks.clone(),
                ..Default::default()
            };
            let next = (!last).then(|| ("next".to_string(), self.hops[i].0.clone()));
            let (request_id, tenant) = (String::new(), tenant.to_string());
            s.handle(Cmd::Open { conn: 1, uses: ConnUse::default(), open: Box::new(open), reply, next, request_id, tenant });
            replies.push(inbox.try_recv().unwrap().body.unwrap());
            inboxes.push(inbox);
        }
        (Drive { id, inboxes, prompt: prompt.to_vec(), out: Vec::new(), cached: 0 }, replies)
    }

    /// Sends each session's frame to the first stage and steps the route until every one of
    /// them has its token (or an error, returned per session).
    fn step(&mut self, sessions: &mut [&mut Drive], frames: Vec<Forward>) -> Vec<Result<TokenOut, ErrorMsg>> {
        for f in frames {
            let (reply, _) = channel(8);
            self.stages[0].handle(Cmd::Forward { f, recv_us: 0, at: Instant::now(), reply, conn: 1, uses: ConnUse::default() });
        }
        let mut got: Vec<Option<Result<TokenOut, ErrorMsg>>> = sessions.iter().map(|_| None).collect();
        for _ in 0..10_000 {
            for i in 0..self.stages.len() {
                self.stages[i].step();
                if i + 1 < self.stages.len() {
                    while let Ok(fr) = self.hops[i].1.try_recv() {
                        let Some(Body::Forward(f)) = fr.body else { panic!("a hop carries only rows") };
                        let (reply, _) = channel(8);
                        self.stages[i + 1].handle(Cmd::Forward {
                            f,
                            recv_us: 0,
                            at: Instant::now(),
                            reply,
                            conn: 2,
                            uses: ConnUse::default(),
                        });
                    }
                }
            }
            for (k, s) in sessions.iter_mut().enumerate() {
                for inbox in s.inboxes.iter_mut() {
                    while let Ok(fr) = inbox.try_recv() {
                        match fr.body.unwrap() {
                            Body::Token(t) => got[k] = Some(Ok(t)),
                            Body::Error(e) => got[k] = Some(Err(e)),
                            Body::Progress(_) => {}
                            other => panic!("unexpected {other:?}"),
                        }
                    }
                }
            }
            if got.iter().all(Option::is_some) {
                return got.into_iter().map(Option::unwrap).collect();
            }
        }
        panic!("the route did not answer")
    }

    /// Generates `decode` greedy tokens for each prompt, the prompts batched together.
    fn generate(&mut self, prompts: &[Vec<u32>], decode: usize, tenant: &str) -> Vec<Drive> {
        let mut drives: Vec<Drive> = prompts
            .iter()
            .map(|p| {
                let (mut d, replies) = self.open(p, (p.len() + decode) as u64, tenant, prefix_chain_bytes(p));
                let held = replies.iter().map(|b| match b {
                    Body::Opened(r) => r.cached_blocks as usize,
                    other => panic!("expected Opened, got {other:?}"),
                });
                d.cached = held.min().unwrap().min((p.len() - 1) / PREFIX_BLOCK) * PREFIX_BLOCK;
                d
            })
            .collect();
        let mut frames: Vec<Forward> = drives
            .iter()
            .map(|d| Forward {
                session_id: d.id.clone(),
                position: d.cached as u64,
                tokens: d.prompt[d.cached..].to_vec(),
                sample: true,
                ..Default::default()
            })
            .collect();
        for _ in 0..decode {
            let mut refs: Vec<&mut Drive> = drives.iter_mut().collect();
            let tokens = self.step(&mut refs, frames);
            frames = Vec::new();
            for (d, t) in drives.iter_mut().zip(tokens) {
                let t = t.unwrap_or_else(|e| panic!("a session failed: {}", e.message));
                d.out.push((t.token, t.logprob.to_bits()));
                frames.push(Forward {
                    session_id: d.id.clone(),
                    position: t.position,
                    tokens: vec![t.token],
                    sample: true,
                    ..Default::default()
                });
            }
        }
        // Closed with the whole sequence's chain, so the answers are cached too.
        for d in &drives {
            let sequence: Vec<u32> = d.prompt.iter().copied().chain(d.out.iter().map(|&(t, _)| t)).collect();
            for s in self.stages.iter_mut() {
                s.handle(Cmd::Close {
                    id: d.id.clone(),
                    prefix_blocks: prefix_chain_bytes(&sequence),
                    positions: sequence.len() as u64 - 1,
                });
                s.publish();
            }
        }
        drives
    }

    fn run_all(&mut self, prompts: &[Vec<u32>], batch: usize, tenant: &str) -> Vec<(Vec<(u32, u32)>, usize)> {
        prompts.chunks(batch).flat_map(|group| self.generate(group, DECODE, tenant)).map(|d| (d.out, d.cached)).collect()
    }

    fn whole(&self) -> bool {
        self.stages.iter().all(|s| s.prefix.whole() && s.prefix.bytes() <= s.metrics.prefix_bytes_capacity.load(Relaxed) as usize)
    }
}

const DECODE: usize = 3;

/// 50 prompts over five shared beginnings (of 21 to 64 tokens), some repeated exactly, some
/// extending another, some shorter than a block.
fn prompts() -> Vec<Vec<u32>> {
    let mut x = 7u64;
    let mut next = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) as u32 % 300 + 5
    };
    let heads: Vec<Vec<u32>> = [37, 48, 21, 64, 50].iter().map(|&n| (0..n).map(|_| next()).collect()).collect();
    let mut out: Vec<Vec<u32>> = Vec::new();
    for i in 0..50 {
        let p = match i % 10 {
            // A repeat of an earlier prompt.
            7 => out[i - 3].clone(),
            // An earlier prompt, continued.
            8 => out[i - 5].iter().copied().chain((0..20).map(|_| next())).collect(),
            // Under one block.
            9 => (0..(i % 15 + 1)).map(|_| next()).collect(),
            _ => heads[i % 5].iter().copied().chain((0..(i * 7 % 31)).map(|_| next())).collect(),
        };
        out.push(p);
    }
    out
}

fn spec() -> SynthSpec {
    SynthSpec { layers: LAYERS, ..SynthSpec::default() }
}

#[test]
fn hits_equal_cold_runs_bitwise_on_every_split_and_batch_in_every_kv_dtype() {
    let prompts = prompts();
    // Heads of 16 (q8_0 a block per head) and of 32 (q8_0 in blocks of 32).
    for (spec, kv) in KvDtype::ALL.iter().map(|&kv| (spec(), kv)).chain([(SynthSpec { heads: 2, kv_heads: 1, ..spec() }, KvDtype::Q8_0)]) {
        let cold = Route::with_kv(&spec, &[], Some(0), kv).run_all(&prompts, 1, "");
        assert!(cold.iter().all(|(_, cached)| *cached == 0));
        for cuts in [vec![], vec![3], vec![2, 4]] {
            for batch in [1, 4] {
                let mut route = Route::with_kv(&spec, &cuts, None, kv);
                let hit = route.run_all(&prompts, batch, "t");
                let cached: usize = hit.iter().map(|(_, c)| c).sum();
                let what = format!("{kv} KV, heads of {}, {} stage(s), batch {batch}", spec.hidden / spec.heads, cuts.len() + 1);
                for (i, ((a, _), (b, c))) in cold.iter().zip(&hit).enumerate() {
                    assert_eq!(a, b, "{what}: prompt {i} ({} of its tokens cached) differs from its cold run", c);
                }
                assert!(cached >= 40 * PREFIX_BLOCK, "{what}: only {cached} tokens came from the cache");
                // A repeated prompt attaches all of itself but the last block's worth it must compute.
                assert_eq!(hit[17].1, (prompts[17].len() - 1) / PREFIX_BLOCK * PREFIX_BLOCK, "{what}");
                assert!(route.whole());
                let m = route.stages[0].metrics.render();
                let hits = route.stages[0].metrics.prefix_hit_blocks.load(Relaxed) as usize;
                assert_eq!(hits * PREFIX_BLOCK, cached, "{what}: every stage attached what the driver skipped");
                assert!(m.contains("dgr_worker_prefix_cache_blocks ") && !m.contains("dgr_worker_prefix_cache_blocks 0\n"), "{m}");
            }
        }
    }
}

#[test]
fn a_second_turn_attaches_the_first_turns_answer() {
    let mut route = Route::new(&spec(), &[3], None);
    // 30 prompt tokens and 3 generated: the close names two full blocks, the prompt only one.
    let first: Vec<u32> = (0..30).map(|i| i * 7 % 300 + 5).collect();
    let turn = route.generate(std::slice::from_ref(&first), DECODE, "t").remove(0);
    let second: Vec<u32> = first.iter().copied().chain(turn.out.iter().map(|&(t, _)| t)).chain([9, 10, 11]).collect();
    let hit = route.generate(std::slice::from_ref(&second), DECODE, "t").remove(0);
    assert_eq!(hit.cached, 2 * PREFIX_BLOCK);
    let cold = Route::new(&spec(), &[3], Some(0)).generate(&[second], DECODE, "t").remove(0);
    assert_eq!(hit.out, cold.out);
}

#[test]
fn a_tiny_budget_evicts_leaves_and_keeps_results_equal() {
    let prompts = prompts();
    let cold = Route::new(&spec(), &[], Some(0)).run_all(&prompts, 1, "");
    let block = (LAYERS / 2) * PREFIX_BLOCK * stage(&spec(), 0..1, None, KvDtype::F32).stage.kv_position_bytes();
    let mut big = Route::new(&spec(), &[3], None);
    let mut tiny = Route::new(&spec(), &[3], Some(3 * block));
    let (b, t) = (big.run_all(&prompts, 4, "t"), tiny.run_all(&prompts, 4, "t"));
    let sum = |r: &[(Vec<(u32, u32)>, usize)]| r.iter().map(|(_, c)| c).sum::<usize>();
    assert!(sum(&t) < sum(&b) && sum(&t) > 0, "hits under 3 blocks: {}, unbounded: {}", sum(&t), sum(&b));
    for (i, ((a, _), (c, _))) in cold.iter().zip(&t).enumerate() {
        assert_eq!(a, c, "prompt {i} under a tiny cache");
    }
    assert!(tiny.whole(), "no chain has a hole and the budget holds");
    assert!(tiny.stages.iter().all(|s| s.prefix.blocks() <= 3));
}

#[test]
fn one_tenants_prefix_is_a_miss_for_another() {
    let mut route = Route::new(&spec(), &[3], None);
    let p: Vec<u32> = (0..40).map(|i| i + 5).collect();
    assert_eq!(route.generate(std::slice::from_ref(&p), 1, "a")[0].cached, 0);
    assert_eq!(route.generate(std::slice::from_ref(&p), 1, "b")[0].cached, 0, "b does not see a's blocks");
    assert_eq!(route.generate(std::slice::from_ref(&p), 1, "a")[0].cached, 32);
}

#[test]
fn a_stage_with_sliding_window_layers_caches_nothing() {
    let spec = SynthSpec { arch: Arch::Gemma3, ..spec() };
    let mut route = Route::new(&spec, &[3], None);
    let p: Vec<u32> = (0..40).map(|i| i + 5).collect();
    let first = route.generate(std::slice::from_ref(&p), DECODE, "t").remove(0);
    let again = route.generate(std::slice::from_ref(&p), DECODE, "t").remove(0);
    assert_eq!((again.cached, again.out), (0, first.out));
    assert!(route.stages.iter().all(|s| s.prefix.blocks() == 0));
}

fn error_of(b: &Body) -> (ErrorKind, String) {
    match b {
        Body::Error(e) => (e.error_kind(), e.message.clone()),
        other => panic!("expected an error, got {other:?}"),
    }
}

#[test]
fn bad_prefixes_and_attach_positions_are_typed_errors() {
    let mut route = Route::new(&spec(), &[], None);
    let p: Vec<u32> = (0..40).map(|i| i + 5).collect();
    route.generate(std::slice::from_ref(&p), 1, "t");
    // More hashes than the session's positions hold blocks, or one of the wrong length.
    let mut three = prefix_chain_bytes(&p);
    three.push(vec![1; 32]);
    let (_, r) = route.open(&p, 47, "t", three);
    assert_eq!(error_of(&r[0]).0, ErrorKind::BadInput);
    let mut short = prefix_chain_bytes(&p);
    short[1].truncate(31);
    let (_, r) = route.open(&p, 64, "t", short);
    assert_eq!(error_of(&r[0]).0, ErrorKind::BadInput);
    assert_eq!(route.stages[0].sessions.len(), 0, "nothing was opened");
    // Two blocks of its three are cached: attaching at 5 (not a block edge) or 48 (past them)
    // fails the session, as does attaching at all without a chain.
    let p: Vec<u32> = p.iter().copied().chain(100..120).collect();
    for (position, blocks) in [(5u64, 2), (48, 2), (16, 0)] {
        let chain = if blocks == 0 { Vec::new() } else { prefix_chain_bytes(&p) };
        let (mut d, r) = route.open(&p, 64, "t", chain);
        assert!(matches!(&r[0], Body::Opened(o) if o.cached_blocks == blocks));
        let f = Forward { session_id: d.id.clone(), position, tokens: p[position as usize..].to_vec(), sample: true, ..Default::default() };
        let got = route.step(&mut [&mut d], vec![f]).remove(0);
        let e = got.expect_err("a bad attach position");
        assert_eq!(e.error_kind(), ErrorKind::BadInput, "{}", e.message);
        assert!(e.message.contains("multiple of 16"), "{}", e.message);
        assert!(route.stages[0].sessions.is_empty());
    }
    assert_eq!(route.stages[0].prefix.pinned_blocks(), 0, "a failed session's pins go with it");
    assert!(route.whole());
}

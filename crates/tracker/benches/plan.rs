//! Route planning over many registered workers holding random overlapping ranges of an 80-layer
//! model: the planner given every worker (`plan`), and the registry's whole route (`registry`:
//! one candidate per registered range from its index, the plan, and counting the issue in each
//! chosen worker's load; `plan_route_prefix`: the same with every worker holding four of 2,000
//! cached 64-block prompts and each route asking for one of them). Each `plan` size cycles through several seeded instances so one lucky
//! layout cannot skew it.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use dgr_proto::Registration;
use dgr_tracker::plan::{plan, Candidate};
use dgr_tracker::registry::{Joining, Registry, Want};
use dgr_tracker::splitmix::SplitMix64;
use std::hint::black_box;

const LAYERS: u32 = 80;
const INSTANCES: u64 = 16;

/// `workers` candidates: random start, random length 5..=40 clipped to the model, per layer
/// 0.5..2.0 ms, fixed 0.1..1.0 ms.
fn workers(workers: usize, seed: u64) -> Vec<Candidate> {
    let mut rng = SplitMix64(seed);
    (0..workers)
        .map(|_| {
            let start = rng.below(LAYERS);
            let end = (start + 5 + rng.below(36)).min(LAYERS);
            Candidate { start, end, per_layer: 0.5 + 1.5 * rng.unit(), fixed: 0.1 + 0.9 * rng.unit() }
        })
        .collect()
}

fn bench_plan(c: &mut Criterion) {
    let mut group = c.benchmark_group("plan");
    for n in [1_000, 10_000] {
        let sets: Vec<_> = (0..INSTANCES).map(|seed| workers(n, seed)).collect();
        assert!(sets.iter().all(|s| plan(LAYERS, s).is_some()), "every instance must be routable");
        group.bench_with_input(BenchmarkId::new("workers", n), &sets, |b, sets| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) % sets.len();
                plan(LAYERS, black_box(&sets[i]))
            })
        });
    }
    group.finish();
}

/// A registry of `n` workers laid out as `workers(n, seed)` lays out candidates (a candidate's
/// per-layer ms is the worker's measured step time), all live, none loaded.
fn registry(n: usize, seed: u64) -> Registry {
    let mut r = Registry::new(std::time::Duration::from_secs(3600));
    for (i, c) in workers(n, seed).into_iter().enumerate() {
        let reg = Registration {
            engine: "e".into(),
            model_id: "m".into(),
            n_layers: LAYERS,
            layer_start: c.start,
            layer_end: c.end,
            max_sessions: u32::MAX,
            step_us_per_layer: c.per_layer * 1e3,
            kv_tokens: u64::MAX,
            ..Default::default()
        };
        let (control, _) = tokio::sync::mpsc::channel(1);
        r.join(Joining { id: format!("w{i}"), reg, addr: format!("10.0.0.1:{i}"), relayed: false, conn: 0, control });
    }
    r
}

/// Cached prompts in the prefix benchmark, and blocks each.
const PROMPTS: u64 = 2_000;
const PROMPT_BLOCKS: u32 = 64;

/// Block `b` (from 0) of cached prompt `p`'s route digests.
fn digest(p: u64, b: u32) -> u64 {
    SplitMix64(p << 8 | u64::from(b)).next_u64()
}

/// A request for prompt `p`: every one of its blocks, as the tracker probes the index.
fn probes(p: u64) -> Vec<(u32, u64)> {
    (0..PROMPT_BLOCKS).map(|b| (b + 1, digest(p, b))).collect()
}

fn bench_registry(c: &mut Criterion) {
    let mut group = c.benchmark_group("registry");
    for n in [1_000, 10_000] {
        let mut r = registry(n, 0);
        assert!(r.plan_route("m", &Want::Any, &[], &[], 64, 0).is_some(), "the instance must be routable");
        // Each route counts in its workers' load, so successive routes spread as under real load.
        group.bench_function(BenchmarkId::new("plan_route", n), |b| {
            b.iter(|| r.plan_route("m", &Want::Any, &[], &[], 64, 0).map(|p| p.stages.len()))
        });
        let mut rng = SplitMix64(n as u64);
        for i in 0..n {
            let held = (0..4).flat_map(|_| {
                let p = rng.below(PROMPTS as u32) as u64;
                (0..PROMPT_BLOCKS).map(move |b| digest(p, b))
            });
            r.heartbeat(&format!("w{i}"), Default::default(), &[], Some(held.collect()));
        }
        let asks: Vec<_> = (0..INSTANCES).map(|_| probes(rng.below(PROMPTS as u32) as u64)).collect();
        assert!(
            asks.iter().any(|a| r.plan_route("m", &Want::Any, &[], a, 64, 0).is_some_and(|p| p.prefix_stages > 0)),
            "holders are found"
        );
        let mut i = 0;
        group.bench_function(BenchmarkId::new("plan_route_prefix", n), |b| {
            b.iter(|| {
                i = (i + 1) % asks.len();
                r.plan_route("m", &Want::Any, &[], black_box(&asks[i]), 64, 0).map(|p| p.stages.len())
            })
        });
    }
    group.finish();
}

/// `dgr bench tracker --workers 10000`'s swarm (`crates/bench/src/tracker_load.rs`): two models
/// of 32 and 80 layers (60% / 40% of the workers and of the requests), each worker the whole
/// model, a half, a quarter or an eighth, or one time in five a random range of 4 to 24 layers,
/// 100 to 1,000 µs a layer, 0 to 3 sessions. Each iteration plans one route and takes two
/// workers' heartbeats, as 5,000 routes a second meet 10,000 heartbeats.
fn bench_swarm(c: &mut Criterion) {
    const MODELS: [(&str, u32); 2] = [("m32", 32), ("m80", 80)];
    let mut rng = SplitMix64(7);
    let mut r = Registry::new(std::time::Duration::from_secs(3600));
    let n = 10_000;
    for i in 0..n {
        let (model, layers) = MODELS[usize::from(rng.unit() >= 0.6)];
        let (start, end) = rng.layer_range(layers);
        let reg = Registration {
            engine: "e".into(),
            model_id: model.into(),
            n_layers: layers,
            layer_start: start,
            layer_end: end,
            max_sessions: 1 << 20,
            step_us_per_layer: 100.0 + 900.0 * rng.unit(),
            kv_tokens: u64::MAX,
            ..Default::default()
        };
        let (control, _) = tokio::sync::mpsc::channel(1);
        r.join(Joining { id: format!("w{i}"), reg, addr: format!("10.0.0.1:{i}"), relayed: false, conn: 0, control });
    }
    let ids: Vec<String> = (0..n).map(|i| format!("w{i}")).collect();
    let mut beat = 0;
    c.bench_function("registry/plan_route_swarm", |b| {
        b.iter(|| {
            let (model, _) = MODELS[usize::from(rng.unit() >= 0.6)];
            for _ in 0..2 {
                let load = dgr_proto::Load { sessions: (beat % 4) as u32, ..Default::default() };
                r.heartbeat(&ids[beat % n], load, &[], None);
                beat += 1;
            }
            r.plan_route(model, &Want::Any, &[], &[], 64, 0).map(|p| p.stages.len())
        })
    });
}

criterion_group!(benches, bench_plan, bench_registry, bench_swarm);
criterion_main!(benches);

//! The ledger end to end, on the real default model: a key's quota holds under a race (64
//! requests at once against a quota that fits exactly 10, through `dgr generate --tracker` and
//! through the gateway's HTTP API: exactly 10 are served, the rest refused as over quota, and
//! the ledger sums to the quota), on SQLite and (feature `postgres-tests`) on PostgreSQL; and a
//! tracker whose database is unreachable refuses routes as `unavailable` (HTTP 503 with
//! Retry-After at the gateway) and serves again by itself once it is back.
#![cfg(feature = "real-model")]

mod common;

#[cfg(feature = "postgres-tests")]
use common::swarm::postgres_ledger;
use common::swarm::{Gateway, Tracker, Worker};
use common::{serial, Proc};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const PROMPT: &str = "The quick brown fox";
/// New tokens per request; with --ignore-eos each request uses exactly its budget.
const NEW_TOKENS: u64 = 3;
const RACERS: usize = 64;

#[test]
fn a_quota_that_fits_ten_serves_ten_of_64_racing_requests_on_sqlite() {
    let _g = serial();
    quota_race(Tracker::start("quota-race", &[]));
}

#[cfg(feature = "postgres-tests")]
#[test]
fn a_quota_that_fits_ten_serves_ten_of_64_racing_requests_on_postgres() {
    let _g = serial();
    let url = postgres_ledger("quota_race");
    quota_race(Tracker::start_on_ledger("quota-race-pg", &url, &[]));
}

fn quota_race(t: Tracker) {
    let w = Worker::start(&t, (0, 30), "w", &[]);
    t.wait_live(&[&w.id], Duration::from_secs(10), "joined");
    let probe = t.add_key("probe", 0);
    let g = Gateway::start(&[&t], &["--verify-fraction", "0"]);

    // What one request uses (its budget: prompt + new tokens), through each door.
    let v = t.generate(&["--prompt", PROMPT, "--max-tokens", &NEW_TOKENS.to_string(), "--ignore-eos", "--api-key", &probe]);
    let cli_budget = v["prompt_tokens"].as_array().unwrap().len() as u64 + NEW_TOKENS;
    let (status, _, v) = g.post("/v1/completions", Some(&probe), &completion_body());
    assert_eq!(status, 200, "{v}");
    let http_budget = v["usage"]["total_tokens"].as_u64().unwrap();

    // Through `dgr generate --tracker`: 64 processes at once.
    let cli_key = t.add_key("cli", 10 * cli_budget);
    let racers: Vec<Proc> = (0..RACERS)
        .map(|_| {
            let mut cmd = common::dgr();
            cmd.args(["generate", "--tracker", &t.addr, "--format", "json", "--threads", "1", "--prompt", PROMPT])
                .args(["--max-tokens", &NEW_TOKENS.to_string(), "--ignore-eos", "--api-key", &cli_key, "--model"])
                .arg(common::model());
            Proc::spawn(cmd)
        })
        .collect();
    let outcomes: Vec<String> = racers
        .into_iter()
        .map(|p| {
            let out = p.wait_within(Duration::from_secs(300));
            let v: Value = serde_json::from_slice(&out.stdout)
                .unwrap_or_else(|e| panic!("{e}: {} {}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)));
            match v["error"]["kind"].as_str() {
                Some(kind) => kind.to_string(),
                None => {
                    assert_eq!(v["ledger"], "recorded", "{v}");
                    "served".to_string()
                }
            }
        })
        .collect();
    let served = outcomes.iter().filter(|o| *o == "served").count();
    let over = outcomes.iter().filter(|o| *o == "quota_exceeded").count();
    assert_eq!((served, over), (10, RACERS - 10), "{outcomes:?}");
    assert_eq!(key_row(&t, "cli"), (10, 10 * cli_budget), "the ledger sums to the quota");

    // Through the gateway's HTTP API: 64 requests at once.
    let http_key = t.add_key("http", 10 * http_budget);
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let racers: Vec<_> = (0..RACERS).map(|_| s.spawn(|| g.post("/v1/completions", Some(&http_key), &completion_body()))).collect();
        racers
            .into_iter()
            .map(|r| {
                let (status, head, v) = r.join().unwrap();
                if status == 429 {
                    assert_eq!(v["error"]["code"], "insufficient_quota", "{v}");
                    assert!(head.to_ascii_lowercase().contains("retry-after:"), "{head}");
                } else {
                    assert_eq!((status, v["usage"]["total_tokens"].as_u64()), (200, Some(http_budget)), "{v}");
                }
                status
            })
            .collect()
    });
    let ok = statuses.iter().filter(|&&s| s == 200).count();
    let refused = statuses.iter().filter(|&&s| s == 429).count();
    assert_eq!((ok, refused), (10, RACERS - 10), "{statuses:?}");
    // The gateway reports usage after each response: wait for all ten.
    let start = Instant::now();
    while key_row(&t, "http").0 < 10 {
        assert!(start.elapsed() < Duration::from_secs(20), "usage reports missing: {}", t.usage("key"));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(key_row(&t, "http"), (10, 10 * http_budget), "the ledger sums to the quota");
}

/// The database goes away under a running tracker (a proxy in front of PostgreSQL drops every
/// connection and refuses new ones), then comes back.
#[cfg(feature = "postgres-tests")]
#[test]
fn a_tracker_refuses_while_its_database_is_down_and_resumes_when_it_is_back() {
    let _g = serial();
    let url = postgres_ledger("ledger_down");
    let proxy = common::proxy::Proxy::start(&url);
    let t = Tracker::start_on_ledger("ledger-down", &proxy.url, &[]);
    let w = Worker::start(&t, (0, 30), "w", &[]);
    t.wait_live(&[&w.id], Duration::from_secs(10), "joined");
    let g = Gateway::start(&[&t], &["--verify-fraction", "0"]);
    let gen = || t.generate(&["--prompt", PROMPT, "--max-tokens", &NEW_TOKENS.to_string(), "--ignore-eos"]);
    assert_eq!(gen()["ledger"], "recorded");

    proxy.cut();
    let v = gen();
    assert_eq!(v["error"]["kind"], "unavailable", "{v}");
    let (status, head, v) = g.post("/v1/completions", None, &completion_body());
    assert_eq!((status, &v["error"]["code"]), (503, &json!("ledger_unavailable")), "{v}");
    assert!(head.to_ascii_lowercase().contains("retry-after:"), "{head}");

    proxy.restore();
    // A worker whose reports or re-join the tracker refused meanwhile may be re-joining now.
    t.wait_live(&[&w.id], Duration::from_secs(10), "live again once the database is back");
    let v = gen();
    assert_eq!(v["ledger"], "recorded", "served again once the database is back: {v}");
    let (status, _, v) = g.post("/v1/completions", None, &completion_body());
    assert_eq!(status, 200, "{v}");
    let start = Instant::now();
    while key_row(&t, "anonymous").0 < 3 {
        assert!(start.elapsed() < Duration::from_secs(20), "usage reports missing: {}", t.usage("key"));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(key_row(&t, "anonymous").0, 3, "the refused requests were never served, so never billed");
}

fn completion_body() -> Value {
    json!({ "model": Gateway::model_name(), "prompt": PROMPT, "max_tokens": NEW_TOKENS, "ignore_eos": true, "temperature": 0 })
}

/// A key's (requests, prompt + completion tokens) in `dgr usage --by key`.
fn key_row(t: &Tracker, key: &str) -> (u64, u64) {
    let by_key = t.usage("key");
    let rows = by_key["rows"].as_array().unwrap().iter().filter(|r| r["key"] == key);
    rows.fold((0, 0), |(n, tokens), r| {
        (n + r["requests"].as_u64().unwrap(), tokens + r["prompt_tokens"].as_u64().unwrap() + r["completion_tokens"].as_u64().unwrap())
    })
}

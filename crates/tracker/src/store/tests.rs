//! One body per property, run on SQLite and (with the `postgres-tests` feature, against the
//! server `DGR_TEST_POSTGRES` names: scripts/postgres.sh) on PostgreSQL, each in a database of
//! its own.

use super::*;
use dgr_proto::StageUsage;
use std::sync::atomic::{AtomicUsize, Ordering};

fn unique(tag: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let rand: [u8; 4] = crate::server::random();
    // The tag cut short: Postgres keeps 63 bytes of a database's name, which must keep the rest.
    let tag = &tag[..tag.len().min(24)];
    format!("{tag}_{}_{}_{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed), hex::encode(rand))
}

fn sqlite(tag: &str) -> LedgerSpec {
    let dir = std::env::temp_dir().join(format!("dgr-store-{}", unique(tag)));
    std::fs::create_dir_all(&dir).unwrap();
    LedgerSpec::Sqlite(dir.join("ledger.db"))
}

#[cfg(feature = "postgres-tests")]
fn postgres(tag: &str) -> LedgerSpec {
    let url = std::env::var("DGR_TEST_POSTGRES").expect("postgres-tests need DGR_TEST_POSTGRES (scripts/postgres.sh start prints it)");
    LedgerSpec::Postgres(pg::fresh_database(&url, &unique(tag)).expect("a fresh database on DGR_TEST_POSTGRES"))
}

/// Runs the body on each backend, as its own test.
macro_rules! on_both {
    ($($body:ident),* $(,)?) => {$(
        mod $body {
            #[test]
            fn sqlite() {
                super::$body(super::sqlite(stringify!($body)));
            }
            #[cfg(feature = "postgres-tests")]
            #[test]
            fn postgres() {
                super::$body(super::postgres(stringify!($body)));
            }
        }
    )*};
}

on_both!(
    records_each_report_once_and_survive_reopening,
    running_totals_equal_the_sum_over_rows,
    reservations_reserve_once_settle_and_expire,
    concurrent_reservations_fill_the_quota_exactly,
    one_request_reserved_by_many_calls_at_once_reserves_once,
    one_request_reserved_in_two_trackers_groups_reserves_once,
    every_stage_of_a_request_is_stored_once,
    trackers_starting_together_share_one_signing_key,
    a_newer_schema_is_refused,
    bulk_loaded_rows_are_counted_once,
    a_call_failing_in_a_group_is_rolled_back_alone,
    a_group_reserves_as_its_calls_would_one_after_another,
    a_group_records_as_its_reports_would_one_after_another,
    a_group_of_reservations_and_reports_settles_as_one_after_another,
);

/// The group statements' generic plans (those the server settles on for a prepared statement)
/// scan no ledger table whole, and the reservation statements look each request up by index: a
/// whole-table scan there grows with the dead rows of every settled reservation.
#[cfg(feature = "postgres-tests")]
#[test]
fn group_plans_scan_no_ledger_table() {
    let spec = postgres("plans");
    Store::open(&spec).unwrap();
    let LedgerSpec::Postgres(url) = &spec else { unreachable!("a Postgres spec") };
    let mut db = pg::Postgres::new(url).unwrap();
    db.batch("SET plan_cache_mode = force_generic_plan").unwrap();
    let record = "ARRAY['h'], ARRAY['r'], ARRAY['m'], ARRAY['e'], ARRAY[1], ARRAY[1], ARRAY['completed'], ARRAY[1], \
        ARRAY['r'], ARRAY['\\x00'::bytea], ARRAY['w'], ARRAY[1], ARRAY[1], ARRAY[1]";
    for (name, sql, args, reads_state) in [
        ("fast", group::FAST, "ARRAY['h'], ARRAY['r'], ARRAY[1], ARRAY[1]", true),
        ("keys", group::KEYS, "ARRAY['h'], ARRAY['r']", true),
        ("record", group::RECORD, record, false),
    ] {
        db.batch(&format!("PREPARE {name} AS {}", db::postgres_sql(sql))).unwrap();
        let explain: &'static str = Box::leak(format!("EXPLAIN EXECUTE {name}({args})").into_boxed_str());
        let plan: Vec<String> = db.query(explain, &[]).unwrap().into_iter().map(|r| r[0].clone().text().unwrap()).collect();
        let plan = plan.join("\n");
        for table in ["requests", "reservations", "request_stages"] {
            let looked_up = plan.contains(&format!("Index Only Scan using {table}_pkey"));
            assert!(looked_up || !reads_state || table == "request_stages", "{name}: no index lookup in {table}:\n{plan}");
            assert!(!plan.contains(&format!("Seq Scan on {table}")), "{name} scans {table}:\n{plan}");
        }
    }
}

fn request(id: &str, prompt: u64, completion: u64, layer_tokens: u64) -> RequestUsage {
    RequestUsage {
        request_id: id.into(),
        api_key: String::new(),
        model_id: "m".into(),
        engine: "e".into(),
        prompt_tokens: prompt,
        completion_tokens: completion,
        status: "completed".into(),
        stages: vec![StageUsage { worker_id: "w".into(), session_id: id.as_bytes().to_vec(), layer_tokens, ..Default::default() }],
    }
}

fn records_each_report_once_and_survive_reopening(spec: LedgerSpec) {
    let key = {
        let mut s = Store::open(&spec).unwrap();
        s.add_key("alice", "sk-1", 100, 0).unwrap();
        assert!(matches!(s.add_key("alice", "sk-9", 100, 0), Err(StoreError::Conflict(_))));
        assert!(s.record_request("alice", &request("r1", 10, 5, 40), 0).unwrap());
        assert!(!s.record_request("alice", &request("r1", 10, 5, 40), 0).unwrap(), "a request is stored once");
        let wu = WorkerUsage { session_id: b"r1".to_vec(), request_id: "r1".into(), layer_tokens: 41, ..Default::default() };
        assert!(s.record_worker_usage("w", "e", "m", &wu, 0).unwrap());
        assert!(!s.record_worker_usage("w", "e", "m", &wu, 0).unwrap(), "a worker's report is stored once");
        let reg = dgr_proto::Registration { engine: "e".into(), model_id: "m".into(), layer_end: 2, ..Default::default() };
        assert_eq!(s.worker_joined("w", &reg, "a:1", 0).unwrap(), 1);
        assert_eq!(s.worker_joined("w", &reg, "a:1", 1).unwrap(), 2);
        s.quarantine("bad", "lied", 0).unwrap();
        s.quarantine("bad", "lied again", 1).unwrap();
        s.signing_keys().unwrap()[0].key.to_bytes()
    };
    let mut s = Store::open(&spec).unwrap();
    let keys = s.signing_keys().unwrap();
    assert_eq!((keys.len(), keys[0].key.to_bytes()), (1, key), "the signing key survives a restart");
    assert_eq!(keys[0].key_id, dgr_proto::key_id(&keys[0].key.verifying_key()));
    assert_eq!(s.key_totals("alice").unwrap(), (15, 0));
    assert_eq!(s.find_key("sk-1").unwrap().unwrap().quota_tokens, 100);
    assert!(s.find_key("sk-2").unwrap().is_none());
    assert_eq!(s.quarantined().unwrap(), vec![("bad".to_string(), "lied".to_string())]);
    let by_key = s.usage(false).unwrap();
    assert_eq!((by_key[0].requests, by_key[0].prompt_tokens, by_key[0].layer_tokens), (1, 10, 40));
    let by_worker = s.usage(true).unwrap();
    assert_eq!((by_worker[0].layer_tokens, by_worker[0].disagreements), (41, 1));
}

fn running_totals_equal_the_sum_over_rows(spec: LedgerSpec) {
    let mut s = Store::open(&spec).unwrap();
    s.add_key("a", "key-a", 0, 0).unwrap();
    s.put_key("b", "key-b", 1000, 0).unwrap();
    for i in 0..30u64 {
        let key = ["a", "b", "anonymous"][i as usize % 3];
        s.record_request(key, &request(&format!("r{i}"), i, 2 * i + 1, 0), 0).unwrap();
        s.record_request(key, &request(&format!("r{i}"), 99, 99, 0), 0).unwrap();
    }
    for row in s.usage(false).unwrap() {
        assert_eq!(s.key_totals(&row.who).unwrap().0, row.prompt_tokens + row.completion_tokens, "{}", row.who);
    }
    assert_eq!(s.usage(false).unwrap().iter().map(|r| r.requests).sum::<u64>(), 30);
}

fn reservations_reserve_once_settle_and_expire(spec: LedgerSpec) {
    let mut s = Store::open(&spec).unwrap();
    assert_eq!(s.reserve("", "r0", 10, 1_000).unwrap(), Grant::Anonymous, "no keys: no quota");
    s.add_key("k", "key-k", 100, 0).unwrap();
    s.add_key("free", "key-free", 0, 0).unwrap();
    let granted = |new| Grant::Granted { key_name: "k".into(), new };
    assert_eq!(s.reserve("nope", "r0", 10, 1_000).unwrap(), Grant::UnknownKey);
    assert_eq!(s.reserve("key-free", "r0", 1 << 40, 1_000).unwrap(), Grant::Granted { key_name: "free".into(), new: false });
    assert_eq!(s.reserve("key-k", "r1", 60, 1_000).unwrap(), granted(true));
    assert_eq!(s.reserve("key-k", "r1", 60, 1_000).unwrap(), granted(false), "a re-route reserves nothing more");
    assert_eq!(s.key_totals("k").unwrap(), (0, 60));
    let over = s.reserve("key-k", "r2", 41, 1_000).unwrap();
    assert_eq!(over, Grant::OverQuota { key_name: "k".into(), used: 0, reserved: 60, quota: 100 });
    assert_eq!(s.reserve("key-k", "r2", 40, 1_000).unwrap(), granted(true), "exactly the rest fits");
    // Settling: the reservation goes, the actual use stays (less than reserved here).
    assert!(s.record_request("k", &request("r1", 20, 30, 0), 0).unwrap());
    assert_eq!(s.key_totals("k").unwrap(), (50, 40));
    assert_eq!(s.reserve("key-k", "r1", 60, 1_000).unwrap(), Grant::Settled, "a recorded request is not routed again");
    // Use beyond the reservation is billed in full.
    assert!(s.record_request("k", &request("r2", 40, 5, 0), 0).unwrap());
    assert_eq!(s.key_totals("k").unwrap(), (95, 0));
    assert_eq!(s.reserve("key-k", "r3", 6, 1_000).unwrap(), Grant::OverQuota { key_name: "k".into(), used: 95, reserved: 0, quota: 100 });
    // Released (no route came of it) and expired reservations give their room back.
    assert_eq!(s.reserve("key-k", "r3", 5, 1_000).unwrap(), granted(true));
    s.release("r3").unwrap();
    assert_eq!(s.key_totals("k").unwrap(), (95, 0));
    assert_eq!(s.reserve("key-k", "r4", 5, 1_000).unwrap(), granted(true));
    assert_eq!(s.expire_reservations(1_000).unwrap(), 0, "not yet");
    assert_eq!(s.expire_reservations(1_001).unwrap(), 1);
    assert_eq!(s.key_totals("k").unwrap(), (95, 0));
    assert!(s.record_request("k", &request("r4", 5, 0, 0), 0).unwrap(), "a late settle still bills");
    assert_eq!(s.key_totals("k").unwrap(), (100, 0));
}

/// 64 requests of 15 tokens at once against a quota of 150, through two trackers' ledgers on
/// one database: exactly 10 reserve, and settling them fills the quota exactly.
fn concurrent_reservations_fill_the_quota_exactly(spec: LedgerSpec) {
    Store::open(&spec).unwrap().add_key("k", "key-k", 150, 0).unwrap();
    let ledgers = [Ledger::start(&spec, spec.default_threads()).unwrap(), Ledger::start(&spec, spec.default_threads()).unwrap()];
    let barrier = Arc::new(std::sync::Barrier::new(64));
    let threads: Vec<_> = (0..64)
        .map(|i| {
            let (ledger, barrier) = (ledgers[i % 2].clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                ledger.call_blocking(move |s| s.reserve("key-k", &format!("r{i}"), 15, u64::MAX / 2)).unwrap()
            })
        })
        .collect();
    let grants: Vec<Grant> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let won: Vec<usize> = (0..64).filter(|&i| matches!(grants[i], Grant::Granted { new: true, .. })).collect();
    assert_eq!(won.len(), 10, "{grants:?}");
    assert!(grants.iter().all(|g| matches!(g, Grant::Granted { .. } | Grant::OverQuota { .. })), "{grants:?}");
    let mut s = Store::open(&spec).unwrap();
    assert_eq!(s.key_totals("k").unwrap(), (0, 150));
    for i in won {
        s.record_request("k", &request(&format!("r{i}"), 5, 10, 0), 0).unwrap();
    }
    assert_eq!(s.key_totals("k").unwrap(), (150, 0));
    assert_eq!(s.usage(false).unwrap()[0].requests, 10);
}

/// A request id reserved by 16 calls at once through two trackers' ledgers (re-routes racing):
/// one reserves, the rest find its reservation, and the key holds the budget once.
fn one_request_reserved_by_many_calls_at_once_reserves_once(spec: LedgerSpec) {
    reserved_once_by_16_calls(spec, false);
}

/// As above, with each call in its tracker's group (`Ledger::reserve`): on Postgres both groups
/// may find room for the request, and the one that stores the reservation second gives its
/// budget back.
fn one_request_reserved_in_two_trackers_groups_reserves_once(spec: LedgerSpec) {
    reserved_once_by_16_calls(spec, true);
}

fn reserved_once_by_16_calls(spec: LedgerSpec, grouped: bool) {
    Store::open(&spec).unwrap().add_key("k", "key-k", 1000, 0).unwrap();
    let ledgers = [Ledger::start(&spec, spec.default_threads()).unwrap(), Ledger::start(&spec, spec.default_threads()).unwrap()];
    let barrier = Arc::new(std::sync::Barrier::new(16));
    let threads: Vec<_> = (0..16)
        .map(|i| {
            let (ledger, barrier) = (ledgers[i % 2].clone(), barrier.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                barrier.wait();
                if grouped {
                    let r = Reservation { api_key: "key-k".into(), request_id: "same".into(), budget: 30, expires_ms: u64::MAX / 2 };
                    rt.block_on(ledger.reserve(r)).unwrap()
                } else {
                    ledger.call_blocking(|s| s.reserve("key-k", "same", 30, u64::MAX / 2)).unwrap()
                }
            })
        })
        .collect();
    let grants: Vec<Grant> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let new = grants.iter().filter(|g| matches!(g, Grant::Granted { new: true, .. })).count();
    assert_eq!(new, 1, "{grants:?}");
    assert!(grants.iter().all(|g| matches!(g, Grant::Granted { .. })), "{grants:?}");
    assert_eq!(Store::open(&spec).unwrap().key_totals("k").unwrap(), (0, 30));
}

/// A request's stages are stored with it, once; a repeat changes nothing.
fn every_stage_of_a_request_is_stored_once(spec: LedgerSpec) {
    let mut s = Store::open(&spec).unwrap();
    s.add_key("k", "key-k", 1000, 0).unwrap();
    assert_eq!(s.reserve("key-k", "r", 100, u64::MAX / 2).unwrap(), Grant::Granted { key_name: "k".into(), new: true });
    let mut u = request("r", 7, 3, 0);
    u.stages = (0..3u64)
        .map(|i| StageUsage {
            worker_id: format!("w{i}"),
            session_id: vec![i as u8, 0xff],
            tokens_prefilled: 7,
            tokens_decoded: 3 + i,
            layer_tokens: 100 * (i + 1),
        })
        .collect();
    assert!(s.record_request("k", &u, 0).unwrap());
    assert!(!s.record_request("k", &u, 0).unwrap());
    assert_eq!(s.key_totals("k").unwrap(), (10, 0), "billed once, the reservation settled");
    let row = &s.usage(false).unwrap()[0];
    assert_eq!((row.requests, row.tokens_prefilled, row.tokens_decoded, row.layer_tokens), (1, 21, 12, 600));
    let empty = RequestUsage { stages: Vec::new(), ..request("q", 1, 1, 0) };
    assert!(s.record_request("k", &empty, 0).unwrap(), "a request no stage reported on is stored too");
    assert_eq!(s.key_totals("k").unwrap(), (12, 0));
}

use std::sync::Arc;

/// Calls share one transaction and see each other's writes (the quota too); one that fails
/// makes each run again alone, so the others still commit and the failed one writes nothing.
fn a_call_failing_in_a_group_is_rolled_back_alone(spec: LedgerSpec) {
    let mut s = Store::open(&spec).unwrap();
    s.add_key("k", "key-k", 100, 0).unwrap();
    type Call = Box<dyn FnMut(&mut Store) -> Result<Grant, StoreError>>;
    let group = |fail: bool| -> Vec<Call> {
        vec![
            Box::new(move |s| s.reserve("key-k", &format!("a{fail}"), 30, u64::MAX / 2)),
            Box::new(move |s| {
                if fail {
                    // A name taken already: refused inside its own transaction.
                    s.add_key("k", "key-other", 5, 0)?;
                }
                s.reserve("key-k", &format!("b{fail}"), 20, u64::MAX / 2)
            }),
            Box::new(move |s| s.reserve("key-k", &format!("c{fail}"), 20, u64::MAX / 2)),
        ]
    };
    for fail in [false, true] {
        let mut calls = group(fail);
        let mut out = Vec::new();
        let out_cell = std::cell::RefCell::new(&mut out);
        let one = |c: &mut Call, s: &mut Store| {
            let r = c(s);
            let ok = r.is_ok();
            out_cell.borrow_mut().push(r);
            ok
        };
        s.run_grouped(&mut calls, |cs, s| cs.iter_mut().all(|c| one(c, s)), one);
        let last: Vec<String> = out[out.len() - 3..].iter().map(|r| format!("{r:?}")).collect();
        if fail {
            assert!(matches!(out[out.len() - 2], Err(StoreError::Conflict(_))), "{last:?}");
            assert!(matches!(out[out.len() - 1], Ok(Grant::OverQuota { used: 0, reserved: 100, .. })), "{last:?}");
        } else {
            assert_eq!(out.len(), 3, "no rerun: {out:?}");
            assert!(out.iter().all(|r| matches!(r, Ok(Grant::Granted { new: true, .. }))), "{last:?}");
        }
    }
    assert_eq!(s.key_totals("k").unwrap(), (0, 100));
    assert!(s.find_key("key-other").unwrap().is_none());
}

/// Reservations for two keys of equal quota: key `g`'s as one group (`settle_group`), key `s`'s
/// the same calls one after another (`reserve`). Equal answers and totals, with request ids
/// repeated inside the group, a request settled and one held before, unknown and unlimited
/// keys, budgets where a big request does not fit and a later small one does, and one of
/// u64::MAX. The first
/// group is 64 requests of 15 tokens on a quota of 150: exactly 10 reserve, filling it.
fn a_group_reserves_as_its_calls_would_one_after_another(spec: LedgerSpec) {
    let mut s = Store::open(&spec).unwrap();
    s.add_key("free", "key-free", 0, 0).unwrap();
    let fill: Vec<(&str, String, u64)> = (0..64).map(|i| ("key-", format!("r{}", i % 48), 15)).collect();
    let mut mixed: Vec<(&str, String, u64)> = (0..40).map(|i| ("key-", format!("m{}", i % 30), [40, 15, 70, 5][i % 4])).collect();
    mixed.extend([
        // A stranger's budget far past any quota (and past what BIGINT sums hold).
        ("key-", "huge".into(), u64::MAX),
        ("nope-", "u1".into(), 10),
        ("key-free", "f1".into(), 1 << 40),
        ("key-", "done".into(), 10),
        ("key-", "held".into(), 10),
    ]);
    let named = |g: Grant, k: &str| match g {
        Grant::Granted { key_name, new } if key_name == k => Grant::Granted { key_name: "*".into(), new },
        Grant::OverQuota { key_name, used, reserved, quota } if key_name == k => {
            Grant::OverQuota { key_name: "*".into(), used, reserved, quota }
        }
        g => g,
    };
    for (round, shape) in [fill, mixed].iter().enumerate() {
        let (g, a) = (format!("g{round}"), format!("s{round}"));
        for k in [&g, &a] {
            s.add_key(k, &format!("key-{k}"), 150, 0).unwrap();
            if round == 1 {
                assert!(s.record_request(k, &request(&format!("{k}-done"), 1, 1, 0), 0).unwrap());
                let held = s.reserve(&format!("key-{k}"), &format!("{k}-held"), 10, u64::MAX / 2).unwrap();
                assert_eq!(held, Grant::Granted { key_name: k.clone(), new: true });
            }
        }
        let calls = |k: &str| -> Vec<Reservation> {
            shape
                .iter()
                .map(|(key, id, budget)| Reservation {
                    api_key: if key.ends_with('-') { format!("{key}{k}") } else { key.to_string() },
                    request_id: format!("{k}-{id}"),
                    budget: *budget,
                    expires_ms: u64::MAX / 2,
                })
                .collect()
        };
        let group = calls(&g);
        let grouped: Vec<Grant> =
            s.settle_group(&group.iter().collect::<Vec<_>>(), &[]).unwrap().0.into_iter().map(|x| named(x.unwrap(), &g)).collect();
        let alone: Vec<Grant> =
            calls(&a).iter().map(|c| named(s.reserve(&c.api_key, &c.request_id, c.budget, c.expires_ms).unwrap(), &a)).collect();
        assert_eq!(grouped, alone, "round {round}");
        assert_eq!(s.key_totals(&g).unwrap(), s.key_totals(&a).unwrap(), "round {round}");
        if round == 0 {
            assert_eq!(grouped.iter().filter(|x| matches!(x, Grant::Granted { new: true, .. })).count(), 10);
            assert_eq!(s.key_totals(&g).unwrap(), (0, 150), "the quota filled exactly");
        }
    }
}

/// Reports for two keys: key `g`'s as one group (`settle_group`), key `s`'s the same reports
/// one after another (`record_report`). Equal answers, rows and totals, with request ids
/// repeated inside the group, reports stored before, reservations to settle, several stages,
/// and an unknown key.
fn a_group_records_as_its_reports_would_one_after_another(spec: LedgerSpec) {
    let mut s = Store::open(&spec).unwrap();
    for k in ["g", "s"] {
        s.add_key(k, &format!("key-{k}"), 1 << 30, 0).unwrap();
        for i in 0..6 {
            s.reserve(&format!("key-{k}"), &format!("{k}-q{i}"), 100, u64::MAX / 2).unwrap();
        }
        s.record_request(k, &request(&format!("{k}-q0"), 3, 4, 0), 0).unwrap();
    }
    let reports = |k: &str| -> Vec<Report> {
        (0..24u64)
            .map(|i| {
                let mut u = request(&format!("{k}-q{}", i % 10), i, 2 * i, 0);
                u.api_key = if i == 7 { "nope".into() } else { format!("key-{k}") };
                u.stages = (0..i % 3)
                    .map(|j| StageUsage {
                        worker_id: format!("w{j}"),
                        session_id: vec![j as u8, i as u8],
                        tokens_prefilled: i,
                        tokens_decoded: j,
                        layer_tokens: 10 * i + j,
                    })
                    .collect();
                Report { usage: u, now_ms: 5 }
            })
            .collect()
    };
    let g = reports("g");
    let grouped: Vec<Option<bool>> =
        s.settle_group(&[], &g.iter().collect::<Vec<_>>()).unwrap().1.into_iter().map(Result::unwrap).collect();
    let alone: Vec<Option<bool>> = reports("s").iter().map(|r| s.record_report(r).unwrap()).collect();
    assert_eq!(grouped, alone);
    assert!(grouped.contains(&None) && grouped.contains(&Some(true)) && grouped.contains(&Some(false)), "{grouped:?}");
    assert_eq!(s.key_totals("g").unwrap(), s.key_totals("s").unwrap());
    let rows = s.usage(false).unwrap();
    let strip = |who: &str| rows.iter().find(|r| r.who == who).map(|r| UsageRow { who: String::new(), ..r.clone() });
    assert_eq!(strip("g"), strip("s"));
    assert!(strip("g").is_some());
}

/// Reservations and reports in one group (key `g`'s), and the same calls one after another,
/// the reservations first (key `s`'s): equal answers and totals. Some reports settle a
/// reservation of the same group, one repeats, one settles a request reserved before, and a
/// reservation asks for a request already recorded.
fn a_group_of_reservations_and_reports_settles_as_one_after_another(spec: LedgerSpec) {
    let mut s = Store::open(&spec).unwrap();
    for k in ["g", "s"] {
        s.add_key(k, &format!("key-{k}"), 1000, 0).unwrap();
        assert!(s.reserve(&format!("key-{k}"), &format!("{k}-old"), 100, u64::MAX / 2).is_ok());
        assert!(s.record_request(k, &request(&format!("{k}-done"), 1, 2, 0), 0).unwrap());
    }
    let calls = |k: &str| -> (Vec<Reservation>, Vec<Report>) {
        let ids = ["a", "b", "c", "done", "d"];
        let reserves = ids
            .iter()
            .map(|id| Reservation { api_key: format!("key-{k}"), request_id: format!("{k}-{id}"), budget: 200, expires_ms: u64::MAX / 2 })
            .collect();
        let reports = ["a", "old", "b", "a"]
            .iter()
            .map(|id| {
                let mut u = request(&format!("{k}-{id}"), 5, 6, 0);
                u.api_key = format!("key-{k}");
                Report { usage: u, now_ms: 7 }
            })
            .collect();
        (reserves, reports)
    };
    let (reserves, reports) = calls("g");
    let (grants, recorded) = s.settle_group(&reserves.iter().collect::<Vec<_>>(), &reports.iter().collect::<Vec<_>>()).unwrap();
    let grouped: Vec<String> = grants.into_iter().map(|g| format!("{:?}", g.unwrap()).replace("\"g\"", "K")).collect();
    let recorded: Vec<Option<bool>> = recorded.into_iter().map(Result::unwrap).collect();
    let (reserves, reports) = calls("s");
    let alone: Vec<String> = reserves
        .iter()
        .map(|c| format!("{:?}", s.reserve(&c.api_key, &c.request_id, c.budget, c.expires_ms).unwrap()).replace("\"s\"", "K"))
        .collect();
    let recorded_alone: Vec<Option<bool>> = reports.iter().map(|r| s.record_report(r).unwrap()).collect();
    assert_eq!(grouped, alone);
    assert_eq!(recorded, recorded_alone);
    assert_eq!(recorded, [Some(true), Some(true), Some(true), Some(false)]);
    assert_eq!(s.key_totals("g").unwrap(), s.key_totals("s").unwrap());
    // 3 + 3 × 11 used; 100 held before and 4 × 200 reserved, of which 3 settled.
    assert_eq!(s.key_totals("g").unwrap(), (36, 400));
}

fn trackers_starting_together_share_one_signing_key(spec: LedgerSpec) {
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let spec = spec.clone();
            std::thread::spawn(move || Store::open(&spec).unwrap().signing_keys().unwrap()[0].key.to_bytes())
        })
        .collect();
    let keys: Vec<[u8; 32]> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(keys.iter().all(|k| *k == keys[0]), "one key for all");
    assert_eq!(Store::open(&spec).unwrap().signing_keys().unwrap().len(), 1);
}

fn a_newer_schema_is_refused(spec: LedgerSpec) {
    let mut s = Store::open(&spec).unwrap();
    s.db.execute("INSERT INTO schema_migrations (version, applied_ms) VALUES (?1, 0)", &[Value::Int(SCHEMA_VERSION + 1)]).unwrap();
    drop(s);
    match Store::open(&spec) {
        Err(StoreError::TooNew { found, supported }) => assert_eq!((found, supported), (SCHEMA_VERSION + 1, SCHEMA_VERSION)),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a newer schema was opened"),
    }
}

fn bulk_loaded_rows_are_counted_once(spec: LedgerSpec) {
    let mut s = Store::open(&spec).unwrap();
    assert!(s.record_request("a", &request("before", 1, 1, 0), 0).unwrap());
    let mut rows: Vec<RequestUsage> = (0..5000u64)
        .map(|i| {
            let mut u = request(&format!("bulk\t{i}\\"), 3, i % 7, 1);
            u.model_id = "m\nwith a newline".into();
            u
        })
        .collect();
    let want: u64 = 2 + rows.iter().map(|u| u.prompt_tokens + u.completion_tokens).sum::<u64>();
    rows.push(request("before", 50, 50, 9));
    rows.push(rows[0].clone());
    assert_eq!(s.record_requests("a", &rows, 0).unwrap(), 5000, "an id stored before, or twice in the batch, counts once");
    assert_eq!(s.key_totals("a").unwrap(), (want, 0));
    let by_key = s.usage(false).unwrap();
    assert_eq!(by_key.iter().map(|r| (r.requests, r.layer_tokens)).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1)), (5001, 5000));
    assert!(by_key.iter().any(|r| r.model_id == "m\nwith a newline"), "{by_key:?}");
    assert!(!s.record_request("a", &rows[0], 0).unwrap(), "a bulk-loaded id is stored already");
    assert_eq!(s.record_requests("a", &rows, 0).unwrap(), 0);
    assert_eq!(s.key_totals("a").unwrap(), (want, 0), "a repeated load changes nothing");
}

/// A file made by a dgr from before versioned migrations: its rows stay, the totals are
/// computed from them, and its signing key becomes the first of the set.
#[test]
fn an_unversioned_sqlite_file_migrates_forward() {
    let LedgerSpec::Sqlite(path) = sqlite("unversioned") else { unreachable!() };
    let seed = [7u8; 32];
    {
        let db = rusqlite::Connection::open(&path).unwrap();
        db.execute_batch(migrate::V1).unwrap();
        db.execute("INSERT INTO meta (key, value) VALUES ('signing_key', ?1)", [seed.to_vec()]).unwrap();
        db.execute("INSERT INTO api_keys VALUES (?1, 'old', 50, 0)", [key_hash("key-old")]).unwrap();
        db.execute_batch(
            "INSERT INTO requests VALUES ('a', 'old', 'm', 'e', 10, 20, 'completed', 0);
             INSERT INTO requests VALUES ('b', 'old', 'm', 'e', 1, 2, 'failed', 0);
             INSERT INTO requests VALUES ('c', 'anonymous', 'm', 'e', 4, 4, 'completed', 0);",
        )
        .unwrap();
    }
    let mut s = Store::open(&LedgerSpec::Sqlite(path.clone())).unwrap();
    assert_eq!(s.key_totals("old").unwrap(), (33, 0));
    assert_eq!(s.key_totals("anonymous").unwrap(), (8, 0));
    assert_eq!(s.signing_keys().unwrap()[0].key.to_bytes(), seed, "workers keep trusting the old key");
    assert_eq!(s.reserve("key-old", "d", 17, u64::MAX / 2).unwrap(), Grant::Granted { key_name: "old".into(), new: true });
    assert!(matches!(s.reserve("key-old", "e", 1, u64::MAX / 2).unwrap(), Grant::OverQuota { used: 33, reserved: 17, .. }));
    let versions = s.db.query("SELECT version FROM schema_migrations ORDER BY version", &[]).unwrap();
    assert_eq!(versions, (1..=SCHEMA_VERSION).map(|v| vec![Value::Int(v)]).collect::<Vec<_>>());
}

#[test]
fn ledger_specs() {
    assert_eq!(LedgerSpec::parse("postgres://u@h:5/db"), LedgerSpec::Postgres("postgres://u@h:5/db".into()));
    assert_eq!(LedgerSpec::parse("sqlite:/a/b.db"), LedgerSpec::Sqlite("/a/b.db".into()));
    assert_eq!(LedgerSpec::parse("b.db"), LedgerSpec::Sqlite("b.db".into()));
}

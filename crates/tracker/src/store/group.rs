//! A group's reservations in two statements and its usage records in one on PostgreSQL, however
//! many calls the group holds: one statement a call (`one_trip`) still paid a round trip, a
//! parse/bind/execute on the server and the blocking client's runtime hop per call, all on the 2
//! cores the tracker shares. The rules are `mod.rs`'s, decided call by call in the group's order
//! (so a quota filled inside one group is filled exactly): the key rows are locked and read with
//! the requests' state, the grants are worked out here, and what they reserve is stored in one
//! statement. A request id repeated inside a group is left to the caller (it runs alone after the
//! group's statement, as if it came next).

use super::db::{Db, Value};
use super::{key_hash, Grant, Report, Reservation, StoreError};
use dgr_proto::{RequestUsage, StageUsage};
use std::collections::{HashMap, HashSet};

/// The keys' quotas and running totals, their rows locked until the transaction ends (a
/// reservation of another tracker for these keys waits), and each request's state: 2 if its
/// usage is recorded, 1 if it holds a reservation, else 0. A hash without a row is an unknown key
/// (a key's totals row is made with the key). As `one_trip::RESERVE`, the state is read in the
/// statement's snapshot: a request recorded through another tracker while this one waited for
/// the lock is not seen as settled, and its reservation expires.
const KEYS: &str = "SELECT k.hash, k.name, k.quota_tokens, u.used_tokens, u.reserved_tokens,
        ARRAY(SELECT CAST(CASE WHEN EXISTS (SELECT 1 FROM requests r WHERE r.request_id = i.id) THEN 2
                WHEN EXISTS (SELECT 1 FROM reservations v WHERE v.request_id = i.id) THEN 1 ELSE 0 END AS INTEGER)
            FROM unnest(CAST(?2 AS TEXT[])) WITH ORDINALITY AS i (id, n) ORDER BY i.n)
    FROM api_keys k JOIN key_usage u ON u.key_name = k.name
    WHERE k.hash = ANY (CAST(?1 AS TEXT[])) ORDER BY k.name FOR UPDATE OF u";

/// Stores the granted reservations and adds them to their keys' reserved totals; returns the
/// ids stored (one stored meanwhile by another call is not, and adds nothing).
const HOLD: &str = "WITH stored AS (
        INSERT INTO reservations (request_id, key_name, tokens, expires_ms)
        SELECT * FROM unnest(CAST(?1 AS TEXT[]), CAST(?2 AS TEXT[]), CAST(?3 AS INTEGER[]), CAST(?4 AS INTEGER[]))
        ON CONFLICT (request_id) DO NOTHING RETURNING request_id, key_name, tokens),
    added AS (
        UPDATE key_usage u SET reserved_tokens = u.reserved_tokens + d.tokens
        FROM (SELECT key_name, CAST(SUM(tokens) AS INTEGER) AS tokens FROM stored GROUP BY key_name) d
        WHERE u.key_name = d.key_name)
    SELECT request_id FROM stored";

/// Reserves for each call, in order, as `Store::reserve` would one after another. No request id
/// may appear twice.
pub(super) fn reserve(db: &mut dyn Db, calls: &[&Reservation]) -> Result<Vec<Grant>, StoreError> {
    let hashes: Vec<String> = calls.iter().map(|c| key_hash(&c.api_key)).collect();
    let request_ids = Value::Texts(calls.iter().map(|c| c.request_id.clone()).collect());
    let mut keys: HashMap<String, KeyRow> = HashMap::new();
    let mut state = Vec::new();
    for r in db.query(KEYS, &[Value::Texts(hashes.clone()), request_ids])? {
        let mut r = r.into_iter();
        let mut next = || r.next().unwrap_or(Value::Null);
        let hash = next().text()?;
        let row = KeyRow { name: next().text()?, quota: next().count()?, used: next().count()?, reserved: next().count()? };
        keys.insert(hash, row);
        state = next().ints()?;
    }
    // With no key at all every request is anonymous; otherwise a key not found is unknown.
    let anonymous = keys.is_empty() && !super::has_keys(db)?;
    let mut out: Vec<Option<Grant>> = hashes
        .iter()
        .map(|h| match keys.get(h) {
            None if anonymous => Some(Grant::Anonymous),
            None => Some(Grant::UnknownKey),
            Some(k) if k.quota == 0 => Some(Grant::Granted { key_name: k.name.clone(), new: false }),
            Some(_) => None,
        })
        .collect();
    if !keys.is_empty() && state.len() != calls.len() {
        return Err(StoreError::Decode(format!("{} request states for {} requests", state.len(), calls.len())));
    }
    let mut hold: Vec<usize> = Vec::new();
    for i in 0..calls.len() {
        if out[i].is_some() {
            continue;
        }
        let (c, k) = (calls[i], keys.get_mut(&hashes[i]).expect("open calls have a key"));
        out[i] = Some(if state[i] == 2 {
            Grant::Settled
        } else if state[i] == 1 {
            Grant::Granted { key_name: k.name.clone(), new: false }
        } else if k.used.saturating_add(k.reserved).saturating_add(c.budget) <= k.quota {
            k.reserved += c.budget;
            hold.push(i);
            Grant::Granted { key_name: k.name.clone(), new: true }
        } else {
            Grant::OverQuota { key_name: k.name.clone(), used: k.used, reserved: k.reserved, quota: k.quota }
        });
    }
    if !hold.is_empty() {
        let name = |i: usize| keys[&hashes[i]].name.clone();
        let params = [
            Value::Texts(hold.iter().map(|&i| calls[i].request_id.clone()).collect()),
            Value::Texts(hold.iter().map(|&i| name(i)).collect()),
            Value::Ints(hold.iter().map(|&i| int(calls[i].budget)).collect()),
            Value::Ints(hold.iter().map(|&i| int(calls[i].expires_ms)).collect()),
        ];
        let stored = ids(db.query(HOLD, &params)?)?;
        for i in hold {
            if !stored.contains(&calls[i].request_id) {
                // Another call stored this request's reservation first: it holds the budget.
                out[i] = Some(Grant::Granted { key_name: keys[&hashes[i]].name.clone(), new: false });
            }
        }
    }
    Ok(out.into_iter().flatten().collect())
}

struct KeyRow {
    name: String,
    quota: u64,
    used: u64,
    reserved: u64,
}

/// `one_trip::RECORD` over many requests, their keys found by hash (`Store::key_name`'s rule:
/// "anonymous" while no key exists): stores the requests and their stages once, deletes their
/// reservations and settles the totals, one upsert per key. Returns for each report 0 if its
/// key is unknown, 2 if it was stored, 1 if it was stored before.
const RECORD: &str = "WITH input AS (
        SELECT i.*, CASE WHEN NOT EXISTS (SELECT 1 FROM api_keys) THEN 'anonymous' ELSE k.name END AS key_name
        FROM unnest(CAST(?1 AS TEXT[]), CAST(?2 AS TEXT[]), CAST(?3 AS TEXT[]), CAST(?4 AS TEXT[]),
            CAST(?5 AS INTEGER[]), CAST(?6 AS INTEGER[]), CAST(?7 AS TEXT[]), CAST(?8 AS INTEGER[]))
            WITH ORDINALITY AS i (hash, request_id, model_id, engine, prompt_tokens, completion_tokens, status, at_ms, n)
        LEFT JOIN api_keys k ON k.hash = i.hash),
    stored AS (
        INSERT INTO requests (request_id, key_name, model_id, engine, prompt_tokens, completion_tokens, status, at_ms)
        SELECT request_id, key_name, model_id, engine, prompt_tokens, completion_tokens, status, at_ms FROM input
        WHERE key_name IS NOT NULL
        ON CONFLICT (request_id) DO NOTHING RETURNING request_id, key_name, prompt_tokens + completion_tokens AS used),
    stages AS (
        INSERT INTO request_stages (request_id, session_id, worker_id, tokens_prefilled, tokens_decoded, layer_tokens)
        SELECT s.request_id, s.session_id, s.worker_id, s.p, s.d, s.l
        FROM unnest(CAST(?9 AS TEXT[]), CAST(?10 AS BLOB[]), CAST(?11 AS TEXT[]), CAST(?12 AS INTEGER[]), CAST(?13 AS INTEGER[]),
            CAST(?14 AS INTEGER[])) AS s (request_id, session_id, worker_id, p, d, l)
        WHERE s.request_id IN (SELECT request_id FROM stored)
        ON CONFLICT (request_id, session_id, worker_id) DO NOTHING),
    held AS (DELETE FROM reservations WHERE request_id IN (SELECT request_id FROM stored) RETURNING key_name, tokens),
    deltas AS (SELECT key_name, used, CAST(0 AS INTEGER) AS reserved FROM stored UNION ALL SELECT key_name, 0, tokens FROM held),
    totals AS (
        SELECT key_name, CAST(SUM(used) AS INTEGER) AS used, CAST(SUM(reserved) AS INTEGER) AS reserved FROM deltas GROUP BY key_name),
    settle AS (
        INSERT INTO key_usage (key_name, used_tokens, reserved_tokens) SELECT key_name, used, 0 FROM totals
        ON CONFLICT (key_name) DO UPDATE SET used_tokens = key_usage.used_tokens + EXCLUDED.used_tokens,
            reserved_tokens = key_usage.reserved_tokens - (SELECT t.reserved FROM totals t WHERE t.key_name = EXCLUDED.key_name))
    SELECT CAST(CASE WHEN i.key_name IS NULL THEN 0 WHEN EXISTS (SELECT 1 FROM stored s WHERE s.request_id = i.request_id) THEN 2
        ELSE 1 END AS INTEGER)
    FROM input i ORDER BY i.n";

/// Records each report under its key, as `Store::record_report` would one after another: None
/// for an unknown key, else whether the request was new. No request id may appear twice.
pub(super) fn record(db: &mut dyn Db, reports: &[&Report]) -> Result<Vec<Option<bool>>, StoreError> {
    let us: Vec<(&RequestUsage, u64)> = reports.iter().map(|r| (&r.usage, r.now_ms)).collect();
    let stages: Vec<(&str, &StageUsage)> = us.iter().flat_map(|(u, _)| u.stages.iter().map(|s| (u.request_id.as_str(), s))).collect();
    let params = [
        Value::Texts(us.iter().map(|(u, _)| key_hash(&u.api_key)).collect()),
        Value::Texts(us.iter().map(|(u, _)| u.request_id.clone()).collect()),
        Value::Texts(us.iter().map(|(u, _)| u.model_id.clone()).collect()),
        Value::Texts(us.iter().map(|(u, _)| u.engine.clone()).collect()),
        Value::Ints(us.iter().map(|(u, _)| int(u.prompt_tokens)).collect()),
        Value::Ints(us.iter().map(|(u, _)| int(u.completion_tokens)).collect()),
        Value::Texts(us.iter().map(|(u, _)| u.status.clone()).collect()),
        Value::Ints(us.iter().map(|(_, now)| int(*now)).collect()),
        Value::Texts(stages.iter().map(|(id, _)| id.to_string()).collect()),
        Value::Blobs(stages.iter().map(|(_, s)| s.session_id.clone()).collect()),
        Value::Texts(stages.iter().map(|(_, s)| s.worker_id.clone()).collect()),
        Value::Ints(stages.iter().map(|(_, s)| int(s.tokens_prefilled)).collect()),
        Value::Ints(stages.iter().map(|(_, s)| int(s.tokens_decoded)).collect()),
        Value::Ints(stages.iter().map(|(_, s)| int(s.layer_tokens)).collect()),
    ];
    let rows = db.query(RECORD, &params)?;
    if rows.len() != reports.len() {
        return Err(StoreError::Decode(format!("{} answers for {} reports", rows.len(), reports.len())));
    }
    rows.into_iter()
        .map(|r| match r.into_iter().next().unwrap_or(Value::Null).int()? {
            0 => Ok(None),
            done => Ok(Some(done == 2)),
        })
        .collect()
}

/// Token counts and milliseconds stay far below 2^63; saturate rather than wrap, as
/// `Value::from` does.
fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The first column of each row, as text: the ids a statement returned.
fn ids(rows: Vec<Vec<Value>>) -> Result<HashSet<String>, StoreError> {
    rows.into_iter().map(|r| r.into_iter().next().unwrap_or(Value::Null).text()).collect()
}

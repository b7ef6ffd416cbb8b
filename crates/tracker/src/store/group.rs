//! A group's reservations and usage records on PostgreSQL in one transaction of two round trips,
//! however many calls the group holds: one statement a call (`one_trip`) paid a round trip, a
//! parse/bind/execute on the server and a wake-up of each side per call, and a round trip costs
//! more than the statements' work on the 2 cores the tracker shares. The rules are `mod.rs`'s,
//! decided call by call in the group's order (so a quota filled inside one group is filled
//! exactly): the first trip locks and reads the key rows with the requests' state, the grants are
//! worked out here, and the second stores what they reserve, the group's usage records, and
//! commits. A request id repeated inside a group is left to the caller (it runs alone after the
//! group, as if it came next).

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
pub(super) const KEYS: &str = "SELECT k.hash, k.name, k.quota_tokens, u.used_tokens, u.reserved_tokens,
        ARRAY(SELECT CAST(CASE WHEN r.found THEN 2 WHEN v.found THEN 1 ELSE 0 END AS INTEGER)
            FROM unnest(CAST(?2 AS TEXT[])) WITH ORDINALITY AS i (id, n)
            LEFT JOIN LATERAL (SELECT TRUE AS found FROM requests r WHERE r.request_id = i.id LIMIT 1) r ON TRUE
            LEFT JOIN LATERAL (SELECT TRUE AS found FROM reservations v WHERE v.request_id = i.id LIMIT 1) v ON TRUE
            ORDER BY i.n)
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

/// Reservations whose keys have room for all of them (each key's new budgets summed, checked
/// and added in one update of its row, which re-reads the row once its lock is had, so a
/// quota is never passed), and their rows stored. For each call: 0 if its key is unknown (and
/// whether any key exists), 1 if it is granted without a new reservation (unlimited key, or
/// one held already), 2 if settled, 3 if newly reserved, 4 if room was made but another call
/// stored its reservation first (its budget is to be given back), 5 if its key had no room
/// for the group's calls together: those are decided one by one after (`exact`). As
/// `one_trip::RESERVE`, the requests' state is read in the statement's snapshot. The budgets'
/// sum is NUMERIC (SUM's type over BIGINT), so a stranger's huge budget is over quota, never an
/// overflow that fails the group.
///
/// Here and in `KEYS` each request's state is a lateral lookup by index. Written as EXISTS, the
/// server may plan it as one hashed scan of the whole table, and the generic plan it keeps for
/// a prepared statement then scans a `reservations` table that grows with dead rows at every
/// call: measured 0.10 ms a call in one run and 1.4 ms, growing, in the next, at random.
pub(super) const FAST: &str = "WITH input AS (
        SELECT i.n, i.id, i.budget, i.expires, k.name AS key_name, k.quota_tokens AS quota,
            r.found IS NOT NULL AS settled, v.found IS NOT NULL AS held
        FROM unnest(CAST(?1 AS TEXT[]), CAST(?2 AS TEXT[]), CAST(?3 AS INTEGER[]), CAST(?4 AS INTEGER[]))
            WITH ORDINALITY AS i (hash, id, budget, expires, n)
        LEFT JOIN api_keys k ON k.hash = i.hash
        LEFT JOIN LATERAL (SELECT TRUE AS found FROM requests r WHERE r.request_id = i.id LIMIT 1) r ON TRUE
        LEFT JOIN LATERAL (SELECT TRUE AS found FROM reservations v WHERE v.request_id = i.id LIMIT 1) v ON TRUE),
    new AS (SELECT * FROM input WHERE quota > 0 AND NOT settled AND NOT held),
    room AS (
        UPDATE key_usage u SET reserved_tokens = u.reserved_tokens + w.tokens
        FROM (SELECT key_name, MAX(quota) AS quota, SUM(budget) AS tokens FROM new GROUP BY key_name) w
        WHERE u.key_name = w.key_name AND u.used_tokens + u.reserved_tokens + w.tokens <= w.quota
        RETURNING u.key_name),
    stored AS (
        INSERT INTO reservations (request_id, key_name, tokens, expires_ms)
        SELECT id, key_name, budget, expires FROM new WHERE key_name IN (SELECT key_name FROM room)
        ON CONFLICT (request_id) DO NOTHING RETURNING request_id)
    SELECT CAST(CASE WHEN i.key_name IS NULL THEN 0 WHEN i.quota = 0 THEN 1 WHEN i.settled THEN 2 WHEN i.held THEN 1
            WHEN i.id IN (SELECT request_id FROM stored) THEN 3 WHEN i.key_name IN (SELECT key_name FROM room) THEN 4 ELSE 5 END
            AS INTEGER),
        i.key_name, EXISTS (SELECT 1 FROM api_keys)
    FROM input i ORDER BY i.n";

/// A group's reservations (as `Store::reserve` would one after another) and usage reports (as
/// `Store::record_report` would) in one transaction of one round trip: the reservations whose
/// keys have room for all of the group's (`FAST`), the reports, COMMIT. Then, each in a
/// transaction of its own: what a lost race over a request id reserved twice gives back, and
/// the reservations of keys near their quota, decided one by one in the group's order
/// (`exact`). An error is returned only when nothing was written (the caller then runs each
/// call alone); once the group is committed, a call that fails has its own error. No request
/// id may appear twice in a kind.
pub(super) fn settle(db: &mut dyn Db, calls: &[&Reservation], reports: &[&Report]) -> Result<Settled, StoreError> {
    let reserve_params = [
        Value::Texts(calls.iter().map(|c| key_hash(&c.api_key)).collect()),
        Value::Texts(calls.iter().map(|c| c.request_id.clone()).collect()),
        Value::Ints(calls.iter().map(|c| int(c.budget)).collect()),
        Value::Ints(calls.iter().map(|c| int(c.expires_ms)).collect()),
    ];
    let record_params = record_params(reports);
    let mut steps: Vec<(&'static str, &[Value])> = vec![("BEGIN", &[])];
    if !calls.is_empty() {
        steps.push((FAST, &reserve_params));
    }
    if !reports.is_empty() {
        steps.push((RECORD, &record_params));
    }
    steps.push(("COMMIT", &[]));
    let answers = match db.pipeline(&steps) {
        Ok(a) => a,
        Err(e) => {
            let _ = db.batch("ROLLBACK");
            return Err(e);
        }
    };
    // Committed: from here on, what fails is told to the calls it concerns.
    let mut answers = answers.into_iter().skip(1);
    let fast = if calls.is_empty() { Vec::new() } else { answers.next().unwrap_or_default() };
    let recorded = if reports.is_empty() { Ok(Vec::new()) } else { record_answers(answers.next().unwrap_or_default(), reports.len()) };
    let recorded: Vec<Result<Option<bool>, StoreError>> = match recorded {
        Ok(r) => r.into_iter().map(Ok).collect(),
        Err(e) => vec![Err(e); reports.len()],
    };
    let codes = match fast_answers(fast, calls.len()) {
        Ok(codes) => codes,
        Err(e) => return Ok((vec![Err(e); calls.len()], recorded)),
    };

    let mut out: Vec<Option<Result<Grant, StoreError>>> = Vec::with_capacity(calls.len());
    let (mut undecided, mut lost): (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
    for (i, (code, key_name, any_key)) in codes.into_iter().enumerate() {
        out.push(match (code, key_name) {
            (0, _) if any_key => Some(Ok(Grant::UnknownKey)),
            (0, _) => Some(Ok(Grant::Anonymous)),
            (1, Some(key_name)) => Some(Ok(Grant::Granted { key_name, new: false })),
            (2, Some(_)) => Some(Ok(Grant::Settled)),
            (3, Some(key_name)) => Some(Ok(Grant::Granted { key_name, new: true })),
            (4, Some(key_name)) => {
                lost.push(i);
                Some(Ok(Grant::Granted { key_name, new: false }))
            }
            (5, Some(_)) => {
                undecided.push(i);
                None
            }
            (code, key) => Some(Err(StoreError::Decode(format!("reservation answer {code} for key {key:?}")))),
        });
    }
    for i in lost {
        // Another call stored this request's reservation first: give back what this one added.
        let Some(Ok(Grant::Granted { key_name, .. })) = &out[i] else { continue };
        let given = db.execute(
            "UPDATE key_usage SET reserved_tokens = reserved_tokens - ?2 WHERE key_name = ?1",
            &[key_name.into(), calls[i].budget.into()],
        );
        if let Err(e) = given {
            out[i] = Some(Err(e));
        }
    }
    if !undecided.is_empty() {
        let rest: Vec<&Reservation> = undecided.iter().map(|&i| calls[i]).collect();
        let done = exact(db, &rest);
        if done.is_err() {
            let _ = db.batch("ROLLBACK");
        }
        match done {
            Ok(grants) => undecided.iter().zip(grants).for_each(|(&i, g)| out[i] = Some(Ok(g))),
            Err(e) => undecided.iter().for_each(|&i| out[i] = Some(Err(e.clone()))),
        }
    }
    Ok((out.into_iter().flatten().collect(), recorded))
}

/// Each reservation's grant and each report's answer (`Store::record_report`'s), or the error
/// that kept it from being decided.
pub type Settled = (Vec<Result<Grant, StoreError>>, Vec<Result<Option<bool>, StoreError>>);

/// Reservations decided call by call in their order, in a transaction of two round trips:
/// BEGIN with the key rows' read and lock, then the grants' reservations and COMMIT.
fn exact(db: &mut dyn Db, calls: &[&Reservation]) -> Result<Vec<Grant>, StoreError> {
    let hashes: Vec<String> = calls.iter().map(|c| key_hash(&c.api_key)).collect();
    let mut keys: HashMap<String, KeyRow> = HashMap::new();
    let mut state = Vec::new();
    let params = [Value::Texts(hashes.clone()), Value::Texts(calls.iter().map(|c| c.request_id.clone()).collect())];
    let answers = db.pipeline(&[("BEGIN", &[]), (KEYS, &params)])?;
    for r in answers.into_iter().nth(1).unwrap_or_default() {
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

    // The second trip: the reservations granted, COMMIT.
    let name = |i: usize| keys[&hashes[i]].name.clone();
    let hold_params = [
        Value::Texts(hold.iter().map(|&i| calls[i].request_id.clone()).collect()),
        Value::Texts(hold.iter().map(|&i| name(i)).collect()),
        Value::Ints(hold.iter().map(|&i| int(calls[i].budget)).collect()),
        Value::Ints(hold.iter().map(|&i| int(calls[i].expires_ms)).collect()),
    ];
    let mut steps: Vec<(&'static str, &[Value])> = Vec::new();
    if !hold.is_empty() {
        steps.push((HOLD, &hold_params));
    }
    steps.push(("COMMIT", &[]));
    let answers = db.pipeline(&steps)?;
    if !hold.is_empty() {
        let stored = ids(answers.into_iter().next().unwrap_or_default())?;
        for i in hold {
            if !stored.contains(&calls[i].request_id) {
                // Another call stored this request's reservation first: it holds the budget.
                out[i] = Some(Grant::Granted { key_name: name(i), new: false });
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
/// key is unknown, 2 if it was stored, 1 if it was stored before. The reservations go by
/// `= ANY (ARRAY(…))`, an index condition: written `IN (SELECT …)`, a new database's generic plan
/// was a hashed scan of the whole table, dead rows included.
pub(super) const RECORD: &str = "WITH input AS (
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
    held AS (DELETE FROM reservations WHERE request_id = ANY (ARRAY(SELECT request_id FROM stored)) RETURNING key_name, tokens),
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

/// `RECORD`'s parameters: each report's request and its stages, as arrays.
fn record_params(reports: &[&Report]) -> [Value; 14] {
    let us: Vec<(&RequestUsage, u64)> = reports.iter().map(|r| (&r.usage, r.now_ms)).collect();
    let stages: Vec<(&str, &StageUsage)> = us.iter().flat_map(|(u, _)| u.stages.iter().map(|s| (u.request_id.as_str(), s))).collect();
    [
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
    ]
}

/// `FAST`'s answers: each reservation's code, its key's name, and whether any key exists.
fn fast_answers(rows: Vec<Vec<Value>>, calls: usize) -> Result<Vec<(i64, Option<String>, bool)>, StoreError> {
    if rows.len() != calls {
        return Err(StoreError::Decode(format!("{} answers for {calls} reservations", rows.len())));
    }
    rows.into_iter()
        .map(|row| {
            let mut row = row.into_iter();
            let code = row.next().unwrap_or(Value::Null).int()?;
            let key_name = match row.next().unwrap_or(Value::Null) {
                Value::Null => None,
                v => Some(v.text()?),
            };
            Ok((code, key_name, row.next().unwrap_or(Value::Null).int()? != 0))
        })
        .collect()
}

/// `RECORD`'s answers: None for an unknown key, else whether the request was new.
fn record_answers(rows: Vec<Vec<Value>>, reports: usize) -> Result<Vec<Option<bool>>, StoreError> {
    if rows.len() != reports {
        return Err(StoreError::Decode(format!("{} answers for {reports} reports", rows.len())));
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

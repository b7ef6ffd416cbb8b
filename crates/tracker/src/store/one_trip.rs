//! The hot path on PostgreSQL in one statement a call. Every statement there is a round trip to
//! a server process, and every call of a route touches its key's running-total row, so a group's
//! transaction holds that row's lock for as many round trips as its calls make: a reservation
//! was 3 statements and a usage record 4 plus one per stage. Here each is one statement
//! (data-modifying CTEs; the stages as arrays through `unnest`), with the same rules as the
//! statement-by-statement versions in `mod.rs`, which SQLite (in process, no round trips, no
//! data-modifying CTEs) keeps. The store's tests run both.

use super::db::{Db, Value};
use super::{request_row, ApiKey, Grant, StoreError};
use dgr_proto::RequestUsage;

/// Whether the request is settled, whether it holds a reservation already, whether the quota
/// had room (and was reserved), whether this call stored the reservation, and the key's totals
/// before the call (for an over-quota answer). Reserving and storing the reservation happen
/// only together; a reservation stored by a concurrent call of the same request id between the
/// two makes `room && !stored`, which the caller undoes.
const RESERVE: &str = "WITH settled AS (SELECT 1 FROM requests WHERE request_id = ?1),
    held AS (SELECT 1 FROM reservations WHERE request_id = ?1),
    room AS (
        UPDATE key_usage SET reserved_tokens = reserved_tokens + ?3
        WHERE key_name = ?2 AND used_tokens + reserved_tokens + CAST(CAST(?3 AS INTEGER) AS NUMERIC) <= CAST(?5 AS INTEGER)
            AND NOT EXISTS (SELECT 1 FROM settled) AND NOT EXISTS (SELECT 1 FROM held)
        RETURNING 1),
    stored AS (
        INSERT INTO reservations (request_id, key_name, tokens, expires_ms)
        SELECT CAST(?1 AS TEXT), CAST(?2 AS TEXT), CAST(?3 AS INTEGER), CAST(?4 AS INTEGER) WHERE EXISTS (SELECT 1 FROM room)
        ON CONFLICT (request_id) DO NOTHING RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM settled), EXISTS (SELECT 1 FROM held), EXISTS (SELECT 1 FROM room), EXISTS (SELECT 1 FROM stored),
        (SELECT used_tokens FROM key_usage WHERE key_name = ?2), (SELECT reserved_tokens FROM key_usage WHERE key_name = ?2)";

pub(super) fn reserve(db: &mut dyn Db, key: ApiKey, request_id: &str, budget: u64, expires_ms: u64) -> Result<Grant, StoreError> {
    let params = [request_id.into(), (&key.name).into(), budget.into(), expires_ms.into(), key.quota_tokens.into()];
    let rows = db.query(RESERVE, &params)?;
    let r = rows.first().ok_or_else(|| StoreError::Decode("no row".into()))?;
    let flag = |i: usize| r.get(i).map_or(Ok(0), Value::int).map(|v| v != 0);
    let (settled, held, room, stored) = (flag(0)?, flag(1)?, flag(2)?, flag(3)?);
    let count = |i: usize| r.get(i).map_or(Ok(0), Value::count);
    Ok(match (settled, held, room, stored) {
        (true, ..) => Grant::Settled,
        (_, true, ..) => Grant::Granted { key_name: key.name, new: false },
        (_, _, true, true) => Grant::Granted { key_name: key.name, new: true },
        (_, _, true, false) => {
            // Another call stored this request's reservation first: give back what this one added.
            db.execute(
                "UPDATE key_usage SET reserved_tokens = reserved_tokens - ?2 WHERE key_name = ?1",
                &[(&key.name).into(), budget.into()],
            )?;
            Grant::Granted { key_name: key.name, new: false }
        }
        _ => Grant::OverQuota { key_name: key.name, used: count(4)?, reserved: count(5)?, quota: key.quota_tokens },
    })
}

/// Stores the request and its stages once, deletes its reservation and settles both totals
/// (its key's used tokens, the reservation's key's reserved ones) in one upsert per key, since
/// one statement may change a row only once. Returns whether the request was new.
const RECORD: &str = "WITH stored AS (
        INSERT INTO requests (request_id, key_name, model_id, engine, prompt_tokens, completion_tokens, status, at_ms)
        VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) ON CONFLICT (request_id) DO NOTHING RETURNING 1),
    stages AS (
        INSERT INTO request_stages (request_id, session_id, worker_id, tokens_prefilled, tokens_decoded, layer_tokens)
        SELECT ?1, s.session_id, s.worker_id, s.p, s.d, s.l
        FROM unnest(CAST(?9 AS BLOB[]), CAST(?10 AS TEXT[]), CAST(?11 AS INTEGER[]), CAST(?12 AS INTEGER[]), CAST(?13 AS INTEGER[]))
            AS s (session_id, worker_id, p, d, l)
        WHERE EXISTS (SELECT 1 FROM stored)
        ON CONFLICT (request_id, session_id, worker_id) DO NOTHING),
    held AS (DELETE FROM reservations WHERE request_id = ?1 AND EXISTS (SELECT 1 FROM stored) RETURNING key_name, tokens),
    deltas AS (
        SELECT CAST(?2 AS TEXT) AS key_name, CAST(?14 AS INTEGER) AS used, CAST(0 AS INTEGER) AS reserved FROM stored
        UNION ALL SELECT key_name, 0, tokens FROM held),
    totals AS (
        SELECT key_name, CAST(SUM(used) AS INTEGER) AS used, CAST(SUM(reserved) AS INTEGER) AS reserved FROM deltas GROUP BY key_name),
    settle AS (
        INSERT INTO key_usage (key_name, used_tokens, reserved_tokens) SELECT key_name, used, 0 FROM totals
        ON CONFLICT (key_name) DO UPDATE SET used_tokens = key_usage.used_tokens + EXCLUDED.used_tokens,
            reserved_tokens = key_usage.reserved_tokens - (SELECT t.reserved FROM totals t WHERE t.key_name = EXCLUDED.key_name))
    SELECT EXISTS (SELECT 1 FROM stored)";

pub(super) fn record_request(db: &mut dyn Db, key_name: &str, u: &RequestUsage, now_ms: u64) -> Result<bool, StoreError> {
    // Token counts stay far below 2^63; saturate rather than wrap, as `Value::from` does.
    let ints =
        |f: fn(&dgr_proto::StageUsage) -> u64| Value::Ints(u.stages.iter().map(|s| i64::try_from(f(s)).unwrap_or(i64::MAX)).collect());
    let mut params = request_row(key_name, u, now_ms).to_vec();
    params.extend([
        Value::Blobs(u.stages.iter().map(|s| s.session_id.clone()).collect()),
        Value::Texts(u.stages.iter().map(|s| s.worker_id.clone()).collect()),
        ints(|s| s.tokens_prefilled),
        ints(|s| s.tokens_decoded),
        ints(|s| s.layer_tokens),
        (u.prompt_tokens + u.completion_tokens).into(),
    ]);
    let rows = db.query(RECORD, &params)?;
    Ok(rows.first().and_then(|r| r.first()).map_or(Ok(0), Value::int)? != 0)
}

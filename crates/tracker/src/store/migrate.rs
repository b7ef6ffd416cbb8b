//! Versioned schema migrations, applied at start on both backends. `schema_migrations` holds
//! each version applied; a database at a version newer than this binary knows is refused.
//! Version 1 is the schema from before versioning (every statement `IF NOT EXISTS`), so a file
//! made by an older dgr migrates forward without losing a row.

use super::db::{Db, Dialect, Value};
use super::StoreError;

pub(crate) const V1: &str = "
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS quarantine (worker_id TEXT PRIMARY KEY, evidence TEXT NOT NULL, at_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
    id TEXT PRIMARY KEY, engine TEXT NOT NULL, model_id TEXT NOT NULL,
    layer_start INTEGER NOT NULL, layer_end INTEGER NOT NULL, addr TEXT NOT NULL,
    first_seen_ms INTEGER NOT NULL, last_joined_ms INTEGER NOT NULL, joins INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (
    hash TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, quota_tokens INTEGER NOT NULL, created_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY, key_name TEXT NOT NULL, model_id TEXT NOT NULL, engine TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, status TEXT NOT NULL, at_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS request_stages (
    request_id TEXT NOT NULL, session_id BLOB NOT NULL, worker_id TEXT NOT NULL,
    tokens_prefilled INTEGER NOT NULL, tokens_decoded INTEGER NOT NULL, layer_tokens INTEGER NOT NULL,
    PRIMARY KEY (request_id, session_id, worker_id));
CREATE TABLE IF NOT EXISTS worker_usage (
    session_id BLOB NOT NULL, worker_id TEXT NOT NULL, request_id TEXT NOT NULL, engine TEXT NOT NULL,
    model_id TEXT NOT NULL, layer_start INTEGER NOT NULL, layer_end INTEGER NOT NULL,
    tokens_prefilled INTEGER NOT NULL, tokens_decoded INTEGER NOT NULL, layer_tokens INTEGER NOT NULL,
    at_ms INTEGER NOT NULL, PRIMARY KEY (session_id, worker_id));
";

/// Running totals per key (so a quota check reads one row, not a SUM over the ledger), the
/// reservations routes hold until their usage is recorded, and the set of signing keys.
const V2: &str = "
CREATE TABLE key_usage (key_name TEXT PRIMARY KEY, used_tokens INTEGER NOT NULL, reserved_tokens INTEGER NOT NULL);
INSERT INTO key_usage (key_name, used_tokens, reserved_tokens)
    SELECT key_name, CAST(SUM(prompt_tokens + completion_tokens) AS INTEGER), 0 FROM requests GROUP BY key_name;
INSERT INTO key_usage (key_name, used_tokens, reserved_tokens)
    SELECT name, 0, 0 FROM api_keys WHERE name NOT IN (SELECT key_name FROM key_usage);
CREATE TABLE reservations (
    request_id TEXT PRIMARY KEY, key_name TEXT NOT NULL, tokens INTEGER NOT NULL, expires_ms INTEGER NOT NULL);
CREATE INDEX reservations_by_expiry ON reservations (expires_ms);
CREATE TABLE signing_keys (key_id TEXT PRIMARY KEY, seed BLOB NOT NULL, created_ms INTEGER NOT NULL);
";

const MIGRATIONS: [&str; 2] = [V1, V2];

/// The schema version this binary writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Brings the schema to `SCHEMA_VERSION` inside the caller's transaction, which must hold the
/// database's write lock (SQLite: `BEGIN IMMEDIATE`; Postgres: taken here), so trackers that
/// start together migrate once.
pub(crate) fn migrate(db: &mut dyn Db, now_ms: u64) -> Result<(), StoreError> {
    if db.dialect() == Dialect::Postgres {
        db.batch("SELECT pg_advisory_xact_lock(7400)")?;
    }
    db.batch("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_ms INTEGER NOT NULL)")?;
    let found = db.query("SELECT CAST(COALESCE(MAX(version), 0) AS INTEGER) FROM schema_migrations", &[])?[0][0].int()?;
    if found > SCHEMA_VERSION {
        return Err(StoreError::TooNew { found, supported: SCHEMA_VERSION });
    }
    for (v, ddl) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        db.batch(ddl)?;
        db.execute("INSERT INTO schema_migrations (version, applied_ms) VALUES (?1, ?2)", &[Value::Int(v as i64 + 1), now_ms.into()])?;
    }
    Ok(())
}

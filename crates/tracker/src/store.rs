//! What must survive a restart, in SQLite (WAL): the signing key, worker identities, API keys
//! with their quotas, and the usage ledger. Each request is stored once under its id, each
//! worker's report once under (session, worker): a report sent again is acknowledged and
//! ignored.

use dgr_proto::{RequestUsage, SigningKey, UsageRow, WorkerUsage};
use rusqlite::{params, Connection, OptionalExtension};
use sha2::{Digest, Sha256};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("the stored signing key is corrupt")]
    BadKey,
    #[error("randomness: {0}")]
    Random(String),
}

pub struct Store {
    db: Connection,
}

/// An API key as the tracker knows it: a name and a quota, found by the key's hash.
#[derive(Clone, Debug)]
pub struct ApiKey {
    pub name: String,
    /// Most prompt + completion tokens; 0: no limit.
    pub quota_tokens: u64,
}

const SCHEMA: &str = "
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

/// The hex SHA-256 of an API key: only this is stored.
pub fn key_hash(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

impl Store {
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let db = Connection::open(path)?;
        db.pragma_update(None, "journal_mode", "WAL")?;
        db.pragma_update(None, "synchronous", "NORMAL")?;
        db.busy_timeout(std::time::Duration::from_secs(5))?;
        db.execute_batch(SCHEMA)?;
        Ok(Store { db })
    }

    /// The trackers' signing key set, the current key first: made on first start and kept, so
    /// that tickets issued before a restart stay valid, workers keep trusting the same keys, and
    /// every tracker on this database signs with the same key.
    pub fn signing_keys(&self) -> Result<Vec<SigningKey>, StoreError> {
        let fresh = dgr_proto::new_signing_key().map_err(|e| StoreError::Random(e.to_string()))?;
        // Trackers starting on one database at once: the first insert wins and all read it.
        self.db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('signing_key', ?1)", params![fresh.to_bytes().to_vec()])?;
        let bytes: Vec<u8> = self.db.query_row("SELECT value FROM meta WHERE key = 'signing_key'", [], |r| r.get(0))?;
        let seed: [u8; 32] = bytes.as_slice().try_into().map_err(|_| StoreError::BadKey)?;
        Ok(vec![SigningKey::from_bytes(&seed)])
    }

    /// Records a worker's join; returns how many times this identity has joined.
    pub fn worker_joined(&self, id: &str, reg: &dgr_proto::Registration, addr: &str, now_ms: u64) -> Result<u64, StoreError> {
        self.db.execute(
            "INSERT INTO workers (id, engine, model_id, layer_start, layer_end, addr, first_seen_ms, last_joined_ms, joins)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, 1)
             ON CONFLICT(id) DO UPDATE SET engine = ?2, model_id = ?3, layer_start = ?4, layer_end = ?5, addr = ?6,
                last_joined_ms = ?7, joins = joins + 1",
            params![id, reg.engine, reg.model_id, reg.layer_start, reg.layer_end, addr, now_ms as i64],
        )?;
        Ok(self.db.query_row("SELECT joins FROM workers WHERE id = ?1", [id], |r| r.get::<_, i64>(0))? as u64)
    }

    /// Quarantines a worker for good (a restart keeps it out).
    pub fn quarantine(&self, worker_id: &str, evidence: &str, now_ms: u64) -> Result<(), StoreError> {
        self.db.execute(
            "INSERT OR IGNORE INTO quarantine (worker_id, evidence, at_ms) VALUES (?1, ?2, ?3)",
            params![worker_id, evidence, now_ms as i64],
        )?;
        Ok(())
    }

    pub fn quarantined(&self) -> Result<Vec<(String, String)>, StoreError> {
        let mut stmt = self.db.prepare("SELECT worker_id, evidence FROM quarantine")?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    pub fn add_key(&self, name: &str, key: &str, quota_tokens: u64, now_ms: u64) -> Result<(), StoreError> {
        self.db.execute(
            "INSERT INTO api_keys (hash, name, quota_tokens, created_ms) VALUES (?1, ?2, ?3, ?4)",
            params![key_hash(key), name, quota_tokens as i64, now_ms as i64],
        )?;
        Ok(())
    }

    /// Adds the key, or replaces the key and quota of that name.
    pub fn put_key(&self, name: &str, key: &str, quota_tokens: u64, now_ms: u64) -> Result<(), StoreError> {
        self.db.execute(
            "INSERT INTO api_keys (hash, name, quota_tokens, created_ms) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT(name) DO UPDATE SET hash = ?1, quota_tokens = ?3",
            params![key_hash(key), name, quota_tokens as i64, now_ms as i64],
        )?;
        Ok(())
    }

    pub fn has_keys(&self) -> Result<bool, StoreError> {
        Ok(self.db.query_row("SELECT EXISTS (SELECT 1 FROM api_keys)", [], |r| r.get(0))?)
    }

    pub fn find_key(&self, key: &str) -> Result<Option<ApiKey>, StoreError> {
        let row = self
            .db
            .query_row("SELECT name, quota_tokens FROM api_keys WHERE hash = ?1", [key_hash(key)], |r| {
                Ok(ApiKey { name: r.get(0)?, quota_tokens: r.get::<_, i64>(1)? as u64 })
            })
            .optional()?;
        Ok(row)
    }

    /// Prompt + completion tokens billed to a key so far.
    pub fn key_used(&self, name: &str) -> Result<u64, StoreError> {
        let used: i64 = self.db.query_row(
            "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM requests WHERE key_name = ?1",
            [name],
            |r| r.get(0),
        )?;
        Ok(used as u64)
    }

    /// Stores a driver's report of a request; false if this request id was already stored.
    pub fn record_request(&mut self, key_name: &str, u: &RequestUsage, now_ms: u64) -> Result<bool, StoreError> {
        let tx = self.db.transaction()?;
        let added = insert_request(&tx, key_name, u, now_ms)?;
        tx.commit()?;
        Ok(added)
    }

    /// Stores many drivers' reports in one transaction (a bulk load); returns how many were new.
    pub fn record_requests(&mut self, key_name: &str, rows: &[RequestUsage], now_ms: u64) -> Result<u64, StoreError> {
        let tx = self.db.transaction()?;
        let mut added = 0;
        for u in rows {
            added += u64::from(insert_request(&tx, key_name, u, now_ms)?);
        }
        tx.commit()?;
        Ok(added)
    }

    /// Stores a worker's own report of a session; false if already stored.
    pub fn record_worker_usage(
        &self,
        worker_id: &str,
        engine: &str,
        model_id: &str,
        u: &WorkerUsage,
        now_ms: u64,
    ) -> Result<bool, StoreError> {
        let n = self.db.execute(
            "INSERT OR IGNORE INTO worker_usage (session_id, worker_id, request_id, engine, model_id, layer_start, layer_end,
                tokens_prefilled, tokens_decoded, layer_tokens, at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
            params![
                u.session_id,
                worker_id,
                u.request_id,
                engine,
                model_id,
                u.layer_start,
                u.layer_end,
                u.tokens_prefilled as i64,
                u.tokens_decoded as i64,
                u.layer_tokens as i64,
                now_ms as i64
            ],
        )?;
        Ok(n == 1)
    }

    /// Usage per key (the driver's reports) or per worker (the workers' own reports), per model
    /// and engine. Per worker, `disagreements` counts sessions where the driver's view of that
    /// worker differs from the worker's report (both present, numbers unequal).
    pub fn usage(&self, by_worker: bool) -> Result<Vec<UsageRow>, StoreError> {
        let sql = if by_worker {
            "SELECT w.worker_id, w.model_id, w.engine, COUNT(DISTINCT w.request_id), 0, 0,
                SUM(w.tokens_prefilled), SUM(w.tokens_decoded), SUM(w.layer_tokens),
                SUM(CASE WHEN d.layer_tokens IS NOT NULL AND (d.layer_tokens != w.layer_tokens
                    OR d.tokens_prefilled != w.tokens_prefilled OR d.tokens_decoded != w.tokens_decoded) THEN 1 ELSE 0 END)
             FROM worker_usage w LEFT JOIN request_stages d ON d.session_id = w.session_id AND d.worker_id = w.worker_id
             GROUP BY w.worker_id, w.model_id, w.engine ORDER BY w.worker_id, w.model_id"
        } else {
            "SELECT r.key_name, r.model_id, r.engine, COUNT(*), SUM(r.prompt_tokens), SUM(r.completion_tokens),
                COALESCE(SUM(s.p), 0), COALESCE(SUM(s.d), 0), COALESCE(SUM(s.l), 0), 0
             FROM requests r LEFT JOIN (SELECT request_id, SUM(tokens_prefilled) p, SUM(tokens_decoded) d, SUM(layer_tokens) l
                FROM request_stages GROUP BY request_id) s ON s.request_id = r.request_id
             GROUP BY r.key_name, r.model_id, r.engine ORDER BY r.key_name, r.model_id"
        };
        let mut stmt = self.db.prepare(sql)?;
        let rows = stmt.query_map([], |r| {
            let n = |i: usize| r.get::<_, i64>(i).map(|v| v as u64);
            Ok(UsageRow {
                who: r.get(0)?,
                model_id: r.get(1)?,
                engine: r.get(2)?,
                requests: n(3)?,
                prompt_tokens: n(4)?,
                completion_tokens: n(5)?,
                tokens_prefilled: n(6)?,
                tokens_decoded: n(7)?,
                layer_tokens: n(8)?,
                disagreements: n(9)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}

/// One request's rows, unless its id is stored already; false then.
fn insert_request(tx: &rusqlite::Transaction, key_name: &str, u: &RequestUsage, now_ms: u64) -> Result<bool, StoreError> {
    let added =
        tx.prepare_cached(
            "INSERT OR IGNORE INTO requests (request_id, key_name, model_id, engine, prompt_tokens, completion_tokens, status, at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        )?
        .execute(params![
            u.request_id,
            key_name,
            u.model_id,
            u.engine,
            u.prompt_tokens as i64,
            u.completion_tokens as i64,
            u.status,
            now_ms as i64
        ])? == 1;
    if added {
        let mut stage = tx.prepare_cached(
            "INSERT OR IGNORE INTO request_stages (request_id, session_id, worker_id, tokens_prefilled, tokens_decoded, layer_tokens)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )?;
        for s in &u.stages {
            stage.execute(params![
                u.request_id,
                s.session_id,
                s.worker_id,
                s.tokens_prefilled as i64,
                s.tokens_decoded as i64,
                s.layer_tokens as i64
            ])?;
        }
    }
    Ok(added)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dgr_proto::StageUsage;

    fn request(id: &str, prompt: u64, completion: u64, layer_tokens: u64) -> RequestUsage {
        RequestUsage {
            request_id: id.into(),
            api_key: String::new(),
            model_id: "m".into(),
            engine: "e".into(),
            prompt_tokens: prompt,
            completion_tokens: completion,
            status: "completed".into(),
            stages: vec![StageUsage { worker_id: "w".into(), session_id: vec![1; 16], layer_tokens, ..Default::default() }],
        }
    }

    #[test]
    fn ledger_counts_each_report_once_and_survives_reopening() {
        let dir = std::env::temp_dir().join(format!("dgr-store-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.db");
        let key = {
            let mut s = Store::open(&path).unwrap();
            s.add_key("alice", "sk-1", 100, 0).unwrap();
            assert!(s.record_request("alice", &request("r1", 10, 5, 40), 0).unwrap());
            assert!(!s.record_request("alice", &request("r1", 10, 5, 40), 0).unwrap());
            // In bulk, each id once too: r1 is there already, r2 comes twice.
            let r2 = RequestUsage { stages: vec![], ..request("r2", 1, 2, 0) };
            let bulk = [request("r1", 10, 5, 40), r2.clone(), r2];
            assert_eq!(s.record_requests("alice", &bulk, 0).unwrap(), 1);
            let wu = WorkerUsage { session_id: vec![1; 16], request_id: "r1".into(), layer_tokens: 41, ..Default::default() };
            assert!(s.record_worker_usage("w", "e", "m", &wu, 0).unwrap());
            assert!(!s.record_worker_usage("w", "e", "m", &wu, 0).unwrap());
            s.signing_keys().unwrap()[0].to_bytes()
        };
        let s = Store::open(&path).unwrap();
        assert_eq!(s.signing_keys().unwrap()[0].to_bytes(), key);
        assert_eq!(s.key_used("alice").unwrap(), 18);
        assert_eq!(s.find_key("sk-1").unwrap().unwrap().quota_tokens, 100);
        assert!(s.find_key("sk-2").unwrap().is_none());
        let by_key = s.usage(false).unwrap();
        assert_eq!((by_key[0].requests, by_key[0].prompt_tokens, by_key[0].layer_tokens), (2, 11, 40));
        let by_worker = s.usage(true).unwrap();
        assert_eq!((by_worker[0].layer_tokens, by_worker[0].disagreements), (41, 1));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

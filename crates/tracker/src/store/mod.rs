//! What must survive a restart, and what several trackers share: the signing keys, worker
//! identities, API keys with their quotas and running totals, route reservations, and the usage
//! ledger, in SQLite (embedded, the default) or PostgreSQL, behind one API. Every query is
//! written once over the `Db` seam; the backends differ only in how they are reached.
//!
//! Billing is exactly once: a request is stored once under its id, a worker's report once
//! under (session, worker); a report sent again is acknowledged and ignored. A key's quota is
//! checked against its running total: a route reserves the request's budget in one conditional
//! statement (`used + reserved + budget <= quota`), idempotent per request id; recording the
//! request's usage settles it (the reservation goes, the actual tokens are added, even beyond
//! the reservation: a request is billed what it used); a reservation never settled expires.

mod db;
mod group;
mod ledger;
mod migrate;
mod one_trip;
mod pg;
mod sqlite;

use db::{Db, Dialect, Row, Value};
pub use ledger::Ledger;
pub use migrate::SCHEMA_VERSION;
pub use pg::fresh_database as fresh_postgres_database;

use dgr_proto::{key_id, RequestUsage, SigningKey, UsageRow, WorkerUsage};
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::path::PathBuf;

#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached (down, unreachable, locked past the deadline): routes are
    /// refused until it is back, never served unbilled.
    #[error("the ledger is unavailable: {0}")]
    Unavailable(String),
    /// The queue of ledger calls is full.
    #[error("the ledger is overloaded: {0}")]
    Busy(String),
    #[error("already stored: {0}")]
    Conflict(String),
    #[error("database: {0}")]
    Sql(String),
    #[error("the database is at schema version {found}, newer than this dgr's {supported}: run a newer dgr")]
    TooNew { found: i64, supported: i64 },
    #[error("not a ledger: {0}")]
    BadUrl(String),
    #[error("an unexpected value in the database: {0}")]
    Decode(String),
    #[error("the stored signing key {0} is corrupt")]
    BadKey(String),
    #[error("randomness: {0}")]
    Random(String),
}

/// Where the ledger lives: `postgres://…` (or `postgresql://…`), `sqlite:PATH`, or a plain path
/// (SQLite).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LedgerSpec {
    Sqlite(PathBuf),
    Postgres(String),
}

impl LedgerSpec {
    pub fn parse(s: &str) -> LedgerSpec {
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            LedgerSpec::Postgres(s.to_string())
        } else {
            LedgerSpec::Sqlite(PathBuf::from(s.strip_prefix("sqlite:").unwrap_or(s)))
        }
    }

    /// Store threads (connections) a tracker runs on it: one on both. SQLite takes one writer
    /// at a time; on Postgres every group locks its key's totals row until it commits, so more
    /// threads only split the queue into smaller groups waiting on one another (4 threads
    /// measured 1,770 req/s, one 2,900-3,400 with `dgr bench tracker`).
    pub fn default_threads(&self) -> usize {
        1
    }
}

impl std::fmt::Display for LedgerSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LedgerSpec::Sqlite(p) => write!(f, "sqlite:{}", p.display()),
            LedgerSpec::Postgres(url) => f.write_str(url),
        }
    }
}

/// An API key as the tracker knows it: a name and a quota, found by the key's hash.
#[derive(Clone, Debug)]
pub struct ApiKey {
    pub name: String,
    /// Most prompt + completion tokens; 0: no limit.
    pub quota_tokens: u64,
}

/// The answer to a route's key check and reservation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Grant {
    /// No API key exists: every request is "anonymous", without a quota.
    Anonymous,
    UnknownKey,
    /// Room was reserved (`new`), or this request id holds a reservation already (a re-route
    /// after a failure), or the key has no quota (nothing to reserve).
    Granted {
        key_name: String,
        new: bool,
    },
    OverQuota {
        key_name: String,
        used: u64,
        reserved: u64,
        quota: u64,
    },
    /// This request id's usage is recorded already: a route now would go unbilled.
    Settled,
}

/// A route's reservation: the request's budget against its key's quota, until `expires_ms`.
#[derive(Clone, Debug)]
pub struct Reservation {
    pub api_key: String,
    pub request_id: String,
    pub budget: u64,
    pub expires_ms: u64,
}

/// A driver's report of a request, stored under the key it names, at `now_ms`.
#[derive(Clone, Debug)]
pub struct Report {
    pub usage: RequestUsage,
    pub now_ms: u64,
}

/// One of the set of keys route tickets are signed with; the newest signs, every one verifies.
pub struct StoredKey {
    /// `dgr_proto::key_id` of its public key, as tickets name it.
    pub key_id: u64,
    pub key: SigningKey,
    pub created_ms: u64,
}

/// The hex SHA-256 of an API key: only this is stored.
pub fn key_hash(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

pub struct Store {
    db: Box<dyn Db>,
    /// Inside a group's transaction (`run_grouped`): a call's own transaction is the group's.
    grouped: bool,
}

impl Store {
    /// Opens (SQLite: creates) the ledger and migrates its schema; Postgres connects here and
    /// again whenever the connection was lost.
    pub fn open(spec: &LedgerSpec) -> Result<Store, StoreError> {
        let db: Box<dyn Db> = match spec {
            LedgerSpec::Sqlite(path) => Box::new(sqlite::Sqlite::open(path)?),
            LedgerSpec::Postgres(url) => Box::new(pg::Postgres::new(url)?),
        };
        let mut store = Store { db, grouped: false };
        let now = crate::server::unix_ms();
        store.tx(|db| migrate::migrate(db, now))?;
        Ok(store)
    }

    /// Runs `f` in one transaction holding the write lock from its start (so a read inside it
    /// sees what no other writer can change before the commit), rolled back if anything fails.
    /// In a group, the group's transaction holds the lock, and is rolled back if the call fails.
    fn tx<T>(&mut self, f: impl FnOnce(&mut dyn Db) -> Result<T, StoreError>) -> Result<T, StoreError> {
        if self.grouped {
            return f(&mut *self.db);
        }
        self.db.batch(self.begin())?;
        let done = f(&mut *self.db).and_then(|v| self.db.batch("COMMIT").map(|()| v));
        if done.is_err() {
            let _ = self.db.batch("ROLLBACK");
        }
        done
    }

    fn begin(&self) -> &'static str {
        match self.db.dialect() {
            Dialect::Sqlite => "BEGIN IMMEDIATE",
            Dialect::Postgres => "BEGIN",
        }
    }

    /// Runs every call in one transaction, committed once for all: `all` runs the group (and
    /// says whether every call succeeded), `one` runs one call (and says whether it succeeded).
    /// If a call fails, or the commit does, the transaction is rolled back and each call runs
    /// again alone (`one`), in its own transaction, as it would have without the others: a
    /// failure costs a rerun, never a write of a failed call.
    pub(crate) fn run_grouped<C>(
        &mut self,
        calls: &mut [C],
        all: impl FnOnce(&mut [C], &mut Store) -> bool,
        mut one: impl FnMut(&mut C, &mut Store) -> bool,
    ) {
        if calls.len() > 1 && self.group(calls, all).is_ok() {
            return;
        }
        for c in calls.iter_mut() {
            one(c, self);
        }
    }

    fn group<C>(&mut self, calls: &mut [C], all: impl FnOnce(&mut [C], &mut Store) -> bool) -> Result<(), StoreError> {
        self.grouped(|s| if all(calls, s) { Ok(()) } else { Err(StoreError::Conflict("a call of the group failed".into())) })
    }

    /// Runs `f` in one transaction that the calls inside it share, rolled back if `f` or the
    /// commit fails.
    fn grouped<T>(&mut self, f: impl FnOnce(&mut Store) -> Result<T, StoreError>) -> Result<T, StoreError> {
        self.db.batch(self.begin())?;
        self.grouped = true;
        let done = f(self);
        self.grouped = false;
        let done = done.and_then(|v| self.db.batch("COMMIT").map(|()| v));
        if done.is_err() {
            let _ = self.db.batch("ROLLBACK");
        }
        done
    }

    /// The set of signing keys, newest first (the one to sign with). The first tracker to ask
    /// makes the first key, under the write lock so trackers starting together agree on it; a
    /// key from before the set (`meta.signing_key`) becomes its first member, so workers keep
    /// trusting a restarted tracker.
    pub fn signing_keys(&mut self) -> Result<Vec<StoredKey>, StoreError> {
        let now = crate::server::unix_ms();
        let rows = self.tx(|db| {
            if db.dialect() == Dialect::Postgres {
                db.batch("LOCK TABLE signing_keys IN EXCLUSIVE MODE")?;
            }
            let sql = "SELECT key_id, seed, created_ms FROM signing_keys ORDER BY created_ms DESC, key_id DESC";
            let rows = db.query(sql, &[])?;
            if !rows.is_empty() {
                return Ok(rows);
            }
            let legacy = db.query("SELECT value FROM meta WHERE key = 'signing_key'", &[])?;
            let key = match legacy.into_iter().next() {
                Some(r) => seed_key(r.into_iter().next().unwrap_or(Value::Null).bytes()?, "meta.signing_key")?,
                None => dgr_proto::new_signing_key().map_err(|e| StoreError::Random(e.to_string()))?,
            };
            let id = format!("{:016x}", key_id(&key.verifying_key()));
            let params = [Value::Text(id), Value::Bytes(key.to_bytes().to_vec()), now.into()];
            db.execute("INSERT INTO signing_keys (key_id, seed, created_ms) VALUES (?1, ?2, ?3)", &params)?;
            db.query(sql, &[])
        })?;
        rows.into_iter()
            .map(|r| {
                let mut r = r.into_iter();
                let mut next = || r.next().unwrap_or(Value::Null);
                let id = next().text()?;
                let key = seed_key(next().bytes()?, &id)?;
                // The id is the key's own: a row whose id is not is corrupt.
                let kid = key_id(&key.verifying_key());
                if format!("{kid:016x}") != id {
                    return Err(StoreError::BadKey(id));
                }
                Ok(StoredKey { key_id: kid, key, created_ms: next().count()? })
            })
            .collect()
    }

    /// Records a worker's join; returns how many times this identity has joined.
    pub fn worker_joined(&mut self, id: &str, reg: &dgr_proto::Registration, addr: &str, now_ms: u64) -> Result<u64, StoreError> {
        let rows = self.db.query(
            "INSERT INTO workers (id, engine, model_id, layer_start, layer_end, addr, first_seen_ms, last_joined_ms, joins)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, 1)
             ON CONFLICT (id) DO UPDATE SET engine = ?2, model_id = ?3, layer_start = ?4, layer_end = ?5, addr = ?6,
                last_joined_ms = ?7, joins = workers.joins + 1
             RETURNING joins",
            &[
                id.into(),
                (&reg.engine).into(),
                (&reg.model_id).into(),
                reg.layer_start.into(),
                reg.layer_end.into(),
                addr.into(),
                now_ms.into(),
            ],
        )?;
        one(rows)?.count()
    }

    /// Quarantines a worker for good (a restart keeps it out).
    pub fn quarantine(&mut self, worker_id: &str, evidence: &str, now_ms: u64) -> Result<(), StoreError> {
        self.db.execute(
            "INSERT INTO quarantine (worker_id, evidence, at_ms) VALUES (?1, ?2, ?3) ON CONFLICT (worker_id) DO NOTHING",
            &[worker_id.into(), evidence.into(), now_ms.into()],
        )?;
        Ok(())
    }

    pub fn quarantined(&mut self) -> Result<Vec<(String, String)>, StoreError> {
        let rows = self.db.query("SELECT worker_id, evidence FROM quarantine", &[])?;
        rows.into_iter()
            .map(|r| {
                let mut r = r.into_iter();
                Ok((r.next().unwrap_or(Value::Null).text()?, r.next().unwrap_or(Value::Null).text()?))
            })
            .collect()
    }

    /// Adds a key; a name taken already is `Conflict`.
    pub fn add_key(&mut self, name: &str, key: &str, quota_tokens: u64, now_ms: u64) -> Result<(), StoreError> {
        self.tx(|db| {
            db.execute(
                "INSERT INTO api_keys (hash, name, quota_tokens, created_ms) VALUES (?1, ?2, ?3, ?4)",
                &[key_hash(key).as_str().into(), name.into(), quota_tokens.into(), now_ms.into()],
            )?;
            totals_row(db, name)
        })
    }

    /// Adds the key, or replaces the key and quota of that name.
    pub fn put_key(&mut self, name: &str, key: &str, quota_tokens: u64, now_ms: u64) -> Result<(), StoreError> {
        self.tx(|db| {
            db.execute(
                "INSERT INTO api_keys (hash, name, quota_tokens, created_ms) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (name) DO UPDATE SET hash = ?1, quota_tokens = ?3",
                &[key_hash(key).as_str().into(), name.into(), quota_tokens.into(), now_ms.into()],
            )?;
            totals_row(db, name)
        })
    }

    pub fn has_keys(&mut self) -> Result<bool, StoreError> {
        has_keys(&mut *self.db)
    }

    pub fn find_key(&mut self, key: &str) -> Result<Option<ApiKey>, StoreError> {
        let rows = self.db.query("SELECT name, quota_tokens FROM api_keys WHERE hash = ?1", &[key_hash(key).as_str().into()])?;
        let Some(r) = rows.into_iter().next() else { return Ok(None) };
        let mut r = r.into_iter();
        let name = r.next().unwrap_or(Value::Null).text()?;
        Ok(Some(ApiKey { name, quota_tokens: r.next().unwrap_or(Value::Null).count()? }))
    }

    /// Whether any key exists, and the key's record: one statement, on the hot path. Its row:
    /// the key's, or one of NULLs when there are no keys at all; none for an unknown key.
    fn lookup_key(&mut self, key: &str) -> Result<(bool, Option<ApiKey>), StoreError> {
        let rows = self.db.query(
            "SELECT name, quota_tokens FROM api_keys WHERE hash = ?1
             UNION ALL SELECT NULL, NULL WHERE NOT EXISTS (SELECT 1 FROM api_keys)",
            &[key_hash(key).as_str().into()],
        )?;
        let Some(row) = rows.into_iter().next() else { return Ok((true, None)) };
        let mut r = row.into_iter();
        let mut next = || r.next().unwrap_or(Value::Null);
        match next() {
            Value::Null => Ok((false, None)),
            name => Ok((true, Some(ApiKey { name: name.text()?, quota_tokens: next().count()? }))),
        }
    }

    /// The key's name for the ledger: API keys are required once any exists; without any, every
    /// request is "anonymous".
    pub fn key_name(&mut self, api_key: &str) -> Result<Option<String>, StoreError> {
        match self.lookup_key(api_key)? {
            (false, _) => Ok(Some("anonymous".into())),
            (true, key) => Ok(key.map(|k| k.name)),
        }
    }

    /// A key's running totals: tokens billed, and tokens reserved by routes not yet settled.
    pub fn key_totals(&mut self, name: &str) -> Result<(u64, u64), StoreError> {
        let rows = self.db.query("SELECT used_tokens, reserved_tokens FROM key_usage WHERE key_name = ?1", &[name.into()])?;
        match rows.into_iter().next() {
            Some(r) => Ok((r[0].count()?, r[1].count()?)),
            None => Ok((0, 0)),
        }
    }

    /// Checks the key and reserves `budget` tokens of its quota for `request_id` until its usage
    /// is recorded or `expires_ms` passes. Atomic across every tracker sharing the database.
    pub fn reserve(&mut self, api_key: &str, request_id: &str, budget: u64, expires_ms: u64) -> Result<Grant, StoreError> {
        let key = match self.lookup_key(api_key)? {
            (false, _) => return Ok(Grant::Anonymous),
            (true, None) => return Ok(Grant::UnknownKey),
            (true, Some(key)) => key,
        };
        if key.quota_tokens == 0 {
            return Ok(Grant::Granted { key_name: key.name, new: false });
        }
        if self.db.dialect() == Dialect::Postgres {
            return self.tx(|db| one_trip::reserve(db, key, request_id, budget, expires_ms));
        }
        self.tx(|db| {
            if !db.query("SELECT 1 FROM requests WHERE request_id = ?1", &[request_id.into()])?.is_empty() {
                return Ok(Grant::Settled);
            }
            let held = db.execute(
                "INSERT INTO reservations (request_id, key_name, tokens, expires_ms) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (request_id) DO NOTHING",
                &[request_id.into(), (&key.name).into(), budget.into(), expires_ms.into()],
            )? == 0;
            if held {
                return Ok(Grant::Granted { key_name: key.name, new: false });
            }
            let room = db.execute(
                "UPDATE key_usage SET reserved_tokens = reserved_tokens + ?2
                 WHERE key_name = ?1 AND used_tokens + reserved_tokens + ?2 <= ?3",
                &[(&key.name).into(), budget.into(), key.quota_tokens.into()],
            )? == 1;
            if room {
                return Ok(Grant::Granted { key_name: key.name, new: true });
            }
            db.execute("DELETE FROM reservations WHERE request_id = ?1", &[request_id.into()])?;
            let (used, reserved) =
                match db.query("SELECT used_tokens, reserved_tokens FROM key_usage WHERE key_name = ?1", &[(&key.name).into()])?.first() {
                    Some(r) => (r[0].count()?, r[1].count()?),
                    None => (0, 0),
                };
            Ok(Grant::OverQuota { key_name: key.name, used, reserved, quota: key.quota_tokens })
        })
    }

    /// `reserve` for a queued reservation.
    pub(crate) fn reserve_call(&mut self, c: &Reservation) -> Result<Grant, StoreError> {
        self.reserve(&c.api_key, &c.request_id, c.budget, c.expires_ms)
    }

    /// A group's reservations and usage reports, answered as `reserve` and `record_report` one
    /// after another would. An error means nothing was written; a call can still fail alone.
    /// On SQLite they run in turn in one transaction. On Postgres each request id's first use
    /// of a kind is settled for all (`group::settle`: one round trip while keys have room), and
    /// a repeat runs alone after them, as if it came next.
    pub fn settle_group(&mut self, reserves: &[&Reservation], reports: &[&Report]) -> Result<group::Settled, StoreError> {
        if self.db.dialect() == Dialect::Sqlite {
            return self.grouped(|s| {
                let grants = reserves.iter().map(|c| s.reserve_call(c)).collect::<Result<Vec<_>, _>>()?;
                let recorded = reports.iter().map(|r| s.record_report(r)).collect::<Result<Vec<_>, _>>()?;
                Ok((grants.into_iter().map(Ok).collect(), recorded.into_iter().map(Ok).collect()))
            });
        }
        let (reserve_firsts, reserve_repeats) = first_uses(reserves, |c| &c.request_id);
        let (report_firsts, report_repeats) = first_uses(reports, |r| &r.usage.request_id);
        let first_reserves: Vec<&Reservation> = reserve_firsts.iter().map(|&i| reserves[i]).collect();
        let first_reports: Vec<&Report> = report_firsts.iter().map(|&i| reports[i]).collect();
        let (grants, recorded) = group::settle(&mut *self.db, &first_reserves, &first_reports)?;
        let mut g: Vec<Option<Result<Grant, StoreError>>> = (0..reserves.len()).map(|_| None).collect();
        for (i, grant) in reserve_firsts.into_iter().zip(grants) {
            g[i] = Some(grant);
        }
        for i in reserve_repeats {
            g[i] = Some(self.reserve_call(reserves[i]));
        }
        let mut r: Vec<Option<Result<Option<bool>, StoreError>>> = (0..reports.len()).map(|_| None).collect();
        for (i, done) in report_firsts.into_iter().zip(recorded) {
            r[i] = Some(done);
        }
        for i in report_repeats {
            r[i] = Some(self.record_report(reports[i]));
        }
        Ok((g.into_iter().flatten().collect(), r.into_iter().flatten().collect()))
    }

    /// Gives back a reservation that no route came of.
    pub fn release(&mut self, request_id: &str) -> Result<(), StoreError> {
        self.tx(|db| {
            let rows = db.query("DELETE FROM reservations WHERE request_id = ?1 RETURNING key_name, tokens", &[request_id.into()])?;
            unreserve(db, rows)
        })
    }

    /// Drops the reservations whose time ran out; returns how many.
    pub fn expire_reservations(&mut self, now_ms: u64) -> Result<usize, StoreError> {
        self.tx(|db| {
            let rows = db.query("DELETE FROM reservations WHERE expires_ms < ?1 RETURNING key_name, tokens", &[now_ms.into()])?;
            let n = rows.len();
            unreserve(db, rows)?;
            Ok(n)
        })
    }

    /// Stores a driver's report of a request and settles its reservation; false if this
    /// request id was already stored.
    pub fn record_request(&mut self, key_name: &str, u: &RequestUsage, now_ms: u64) -> Result<bool, StoreError> {
        if self.db.dialect() == Dialect::Postgres {
            return self.tx(|db| one_trip::record_request(db, key_name, u, now_ms));
        }
        self.tx(|db| {
            let added = db.execute(
                "INSERT INTO requests (request_id, key_name, model_id, engine, prompt_tokens, completion_tokens, status, at_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) ON CONFLICT (request_id) DO NOTHING",
                &request_row(key_name, u, now_ms),
            )? == 1;
            if !added {
                return Ok(false);
            }
            for row in stage_rows(u) {
                db.execute(
                    "INSERT INTO request_stages (request_id, session_id, worker_id, tokens_prefilled, tokens_decoded, layer_tokens)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT (request_id, session_id, worker_id) DO NOTHING",
                    &row,
                )?;
            }
            let held = db.query("DELETE FROM reservations WHERE request_id = ?1 RETURNING key_name, tokens", &[(&u.request_id).into()])?;
            unreserve(db, held)?;
            add_used(db, key_name, u.prompt_tokens + u.completion_tokens)?;
            Ok(true)
        })
    }

    /// Stores a driver's report under the key it names (see `key_name`): None for an unknown
    /// key, else whether the request was new.
    pub fn record_report(&mut self, r: &Report) -> Result<Option<bool>, StoreError> {
        match self.key_name(&r.usage.api_key)? {
            Some(name) => self.record_request(&name, &r.usage, r.now_ms).map(Some),
            None => Ok(None),
        }
    }

    /// Stores many requests of one key in one transaction, as fast as the backend takes rows
    /// (they go to a staging table first; Postgres fills it with COPY): for seeding a ledger
    /// (`dgr bench tracker --ledger-rows`). Each request id is stored once, as by
    /// `record_request`: repeats, within the batch or of ids stored before, are ignored. Nothing
    /// is settled. Returns how many were new.
    pub fn record_requests(&mut self, key_name: &str, rows: &[RequestUsage], now_ms: u64) -> Result<u64, StoreError> {
        let mut seen = HashSet::new();
        let fresh: Vec<&RequestUsage> = rows.iter().filter(|u| seen.insert(u.request_id.as_str())).collect();
        let requests: Vec<Row> = fresh.iter().map(|u| request_row(key_name, u, now_ms).to_vec()).collect();
        let stages: Vec<Row> = fresh.iter().flat_map(|u| stage_rows(u)).map(|r| r.to_vec()).collect();
        self.tx(|db| {
            db.batch(
                "CREATE TEMP TABLE bulk_requests AS SELECT * FROM requests WHERE 1 = 0;
                 CREATE TEMP TABLE bulk_stages AS SELECT * FROM request_stages WHERE 1 = 0",
            )?;
            let cols = ["request_id", "key_name", "model_id", "engine", "prompt_tokens", "completion_tokens", "status", "at_ms"];
            db.bulk_insert("bulk_requests", &cols, &requests)?;
            let cols = ["request_id", "session_id", "worker_id", "tokens_prefilled", "tokens_decoded", "layer_tokens"];
            db.bulk_insert("bulk_stages", &cols, &stages)?;
            let new = db.query(
                "SELECT COUNT(*), CAST(COALESCE(SUM(prompt_tokens + completion_tokens), 0) AS INTEGER) FROM bulk_requests b
                 WHERE NOT EXISTS (SELECT 1 FROM requests r WHERE r.request_id = b.request_id)",
                &[],
            )?;
            let (added, tokens) = (new[0][0].count()?, new[0][1].count()?);
            db.batch(
                "INSERT INTO request_stages SELECT * FROM bulk_stages s
                    WHERE NOT EXISTS (SELECT 1 FROM requests r WHERE r.request_id = s.request_id) ON CONFLICT DO NOTHING;
                 INSERT INTO requests SELECT * FROM bulk_requests WHERE 1 = 1 ON CONFLICT DO NOTHING;
                 DROP TABLE bulk_requests;
                 DROP TABLE bulk_stages",
            )?;
            add_used(db, key_name, tokens)?;
            Ok(added)
        })
    }

    /// Stores a worker's own report of a session; false if already stored.
    pub fn record_worker_usage(
        &mut self,
        worker_id: &str,
        engine: &str,
        model_id: &str,
        u: &WorkerUsage,
        now_ms: u64,
    ) -> Result<bool, StoreError> {
        let n = self.db.execute(
            "INSERT INTO worker_usage (session_id, worker_id, request_id, engine, model_id, layer_start, layer_end,
                tokens_prefilled, tokens_decoded, layer_tokens, at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
             ON CONFLICT (session_id, worker_id) DO NOTHING",
            &[
                (&u.session_id).into(),
                worker_id.into(),
                (&u.request_id).into(),
                engine.into(),
                model_id.into(),
                u.layer_start.into(),
                u.layer_end.into(),
                u.tokens_prefilled.into(),
                u.tokens_decoded.into(),
                u.layer_tokens.into(),
                now_ms.into(),
            ],
        )?;
        Ok(n == 1)
    }

    /// Usage per key (the driver's reports) or per worker (the workers' own reports), per model
    /// and engine. Per worker, `disagreements` counts sessions where the driver's view of that
    /// worker differs from the worker's report (both present, numbers unequal).
    pub fn usage(&mut self, by_worker: bool) -> Result<Vec<UsageRow>, StoreError> {
        // Postgres sums BIGINTs as NUMERIC: every sum is cast back.
        let sql = if by_worker {
            "SELECT w.worker_id, w.model_id, w.engine, COUNT(DISTINCT w.request_id), CAST(0 AS INTEGER), CAST(0 AS INTEGER),
                CAST(SUM(w.tokens_prefilled) AS INTEGER), CAST(SUM(w.tokens_decoded) AS INTEGER), CAST(SUM(w.layer_tokens) AS INTEGER),
                CAST(SUM(CASE WHEN d.layer_tokens IS NOT NULL AND (d.layer_tokens != w.layer_tokens
                    OR d.tokens_prefilled != w.tokens_prefilled OR d.tokens_decoded != w.tokens_decoded) THEN 1 ELSE 0 END) AS INTEGER)
             FROM worker_usage w LEFT JOIN request_stages d ON d.session_id = w.session_id AND d.worker_id = w.worker_id
             GROUP BY w.worker_id, w.model_id, w.engine ORDER BY w.worker_id, w.model_id"
        } else {
            "SELECT r.key_name, r.model_id, r.engine, COUNT(*), CAST(SUM(r.prompt_tokens) AS INTEGER),
                CAST(SUM(r.completion_tokens) AS INTEGER), CAST(COALESCE(SUM(s.p), 0) AS INTEGER),
                CAST(COALESCE(SUM(s.d), 0) AS INTEGER), CAST(COALESCE(SUM(s.l), 0) AS INTEGER), CAST(0 AS INTEGER)
             FROM requests r LEFT JOIN (SELECT request_id, SUM(tokens_prefilled) p, SUM(tokens_decoded) d, SUM(layer_tokens) l
                FROM request_stages GROUP BY request_id) s ON s.request_id = r.request_id
             GROUP BY r.key_name, r.model_id, r.engine ORDER BY r.key_name, r.model_id"
        };
        self.db
            .query(sql, &[])?
            .into_iter()
            .map(|r| {
                let mut r = r.into_iter();
                let mut next = || r.next().unwrap_or(Value::Null);
                let (who, model_id, engine) = (next().text()?, next().text()?, next().text()?);
                Ok(UsageRow {
                    who,
                    model_id,
                    engine,
                    requests: next().count()?,
                    prompt_tokens: next().count()?,
                    completion_tokens: next().count()?,
                    tokens_prefilled: next().count()?,
                    tokens_decoded: next().count()?,
                    layer_tokens: next().count()?,
                    disagreements: next().count()?,
                })
            })
            .collect()
    }
}

fn seed_key(bytes: Vec<u8>, id: &str) -> Result<SigningKey, StoreError> {
    let seed: [u8; 32] = bytes.as_slice().try_into().map_err(|_| StoreError::BadKey(id.to_string()))?;
    Ok(SigningKey::from_bytes(&seed))
}

fn has_keys(db: &mut dyn Db) -> Result<bool, StoreError> {
    Ok(one(db.query("SELECT EXISTS (SELECT 1 FROM api_keys)", &[])?)?.int()? != 0)
}

/// The positions of each request id's first use in `calls`, and those of its repeats.
fn first_uses<C>(calls: &[&C], id: impl Fn(&C) -> &String) -> (Vec<usize>, Vec<usize>) {
    let mut seen = HashSet::new();
    (0..calls.len()).partition(|&i| seen.insert(id(calls[i]).as_str()))
}

fn one(rows: Vec<Row>) -> Result<Value, StoreError> {
    rows.into_iter().next().and_then(|r| r.into_iter().next()).ok_or_else(|| StoreError::Decode("no row".into()))
}

/// The key's running totals row, made with the key.
fn totals_row(db: &mut dyn Db, name: &str) -> Result<(), StoreError> {
    db.execute(
        "INSERT INTO key_usage (key_name, used_tokens, reserved_tokens) VALUES (?1, 0, 0) ON CONFLICT (key_name) DO NOTHING",
        &[name.into()],
    )?;
    Ok(())
}

fn add_used(db: &mut dyn Db, key_name: &str, tokens: u64) -> Result<(), StoreError> {
    db.execute(
        "INSERT INTO key_usage (key_name, used_tokens, reserved_tokens) VALUES (?1, ?2, 0)
         ON CONFLICT (key_name) DO UPDATE SET used_tokens = key_usage.used_tokens + ?2",
        &[key_name.into(), tokens.into()],
    )?;
    Ok(())
}

/// Takes deleted reservations (key name, tokens) off their keys' reserved totals.
fn unreserve(db: &mut dyn Db, deleted: Vec<Row>) -> Result<(), StoreError> {
    for r in deleted {
        let mut r = r.into_iter();
        let key = r.next().unwrap_or(Value::Null).text()?;
        let tokens = r.next().unwrap_or(Value::Null).int()?;
        db.execute(
            "UPDATE key_usage SET reserved_tokens = reserved_tokens - ?2 WHERE key_name = ?1",
            &[Value::Text(key), Value::Int(tokens)],
        )?;
    }
    Ok(())
}

fn request_row(key_name: &str, u: &RequestUsage, now_ms: u64) -> [Value; 8] {
    [
        (&u.request_id).into(),
        key_name.into(),
        (&u.model_id).into(),
        (&u.engine).into(),
        u.prompt_tokens.into(),
        u.completion_tokens.into(),
        (&u.status).into(),
        now_ms.into(),
    ]
}

fn stage_rows(u: &RequestUsage) -> impl Iterator<Item = [Value; 6]> + '_ {
    u.stages.iter().map(|s| {
        [
            (&u.request_id).into(),
            (&s.session_id).into(),
            (&s.worker_id).into(),
            s.tokens_prefilled.into(),
            s.tokens_decoded.into(),
            s.layer_tokens.into(),
        ]
    })
}

#[cfg(test)]
mod tests;

//! The shared backend: PostgreSQL, one connection per store thread, reconnected on demand. Any
//! failure to reach the server is `StoreError::Unavailable`; the connection is then dropped and
//! made again at the next call, so the tracker resumes by itself once the server is back. The
//! client is tokio-postgres on a runtime of the store thread's own, driven only while a call
//! runs: a connection is found dead only when used, so a statement outside a transaction that
//! fails on an old connection is tried once more on a new one (BEGIN, reads, and idempotent
//! writes: upserts, inserts that ignore a repeat). `pipeline` sends several statements before
//! reading any answer: one round trip for all of them.
//! Commits wait for the WAL's flush (the server's `synchronous_commit`, on by default): a usage
//! record a driver was told is stored survives a crash of the database (`off` measured ~11% more
//! routed requests a second, for losing the last commits in such a crash; not taken).

use super::db::{postgres_sql, Db, Dialect, Row, Value};
use super::StoreError;
use bytes::{Bytes, BytesMut};
use futures::SinkExt;
use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;
use tokio::runtime::Runtime;
use tokio_postgres::types::{to_sql_checked, IsNull, ToSql, Type};
use tokio_postgres::{Client, Config, NoTls, Statement};

/// Connecting, and any one statement, give up after this long (the server or the network may
/// be gone without a word).
const DEADLINE: Duration = Duration::from_secs(5);

pub(crate) struct Postgres {
    cfg: Config,
    /// Drives the connection, during calls only (a current-thread runtime).
    rt: Runtime,
    client: Option<Client>,
    prepared: HashMap<&'static str, Statement>,
    in_tx: bool,
}

impl Postgres {
    /// Parses `url`; connects at the first statement.
    pub(crate) fn new(url: &str) -> Result<Postgres, StoreError> {
        let mut cfg: Config = url.parse().map_err(|e| StoreError::BadUrl(format!("{url}: {e}")))?;
        cfg.connect_timeout(DEADLINE).tcp_user_timeout(DEADLINE).keepalives(true).keepalives_idle(Duration::from_secs(10));
        cfg.application_name("dgr-tracker");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| StoreError::Unavailable(format!("a runtime for the connection: {e}")))?;
        Ok(Postgres { cfg, rt, client: None, prepared: HashMap::new(), in_tx: false })
    }

    /// Runs `f`'s future on the connection, made first if there is none.
    fn run<'a, F: Future>(&'a mut self, f: impl FnOnce(&'a Client) -> F) -> Result<F::Output, StoreError> {
        self.connect()?;
        let client = self.client.as_ref().expect("connected above");
        Ok(self.rt.block_on(f(client)))
    }

    fn connect(&mut self) -> Result<(), StoreError> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            self.prepared.clear();
            self.client = None;
            let connected = self.rt.block_on(self.cfg.connect(NoTls));
            let (c, connection) = connected.map_err(|e| StoreError::Unavailable(format!("connecting: {e}")))?;
            // Ends with the connection; its error reaches the next call as a closed client.
            self.rt.spawn(connection);
            let set = self.rt.block_on(c.batch_execute(&format!("SET statement_timeout = {}", DEADLINE.as_millis())));
            set.map_err(|e| self.failed(e))?;
            self.client = Some(c);
        }
        Ok(())
    }

    fn statement(&mut self, sql: &'static str) -> Result<Statement, StoreError> {
        // First the connection: making a new one forgets the statements prepared on the old.
        self.connect()?;
        if let Some(s) = self.prepared.get(sql) {
            return Ok(s.clone());
        }
        let text = postgres_sql(sql);
        let prepared = self.run(|c| c.prepare(&text))?;
        let s = prepared.map_err(|e| self.failed(e))?;
        self.prepared.insert(sql, s.clone());
        Ok(s)
    }

    /// The error as the ledger's; a lost connection is dropped, to be made again next time.
    fn failed(&mut self, e: tokio_postgres::Error) -> StoreError {
        let code = e.code().map(|c| c.code().to_string());
        // The server's own words (the client's error says only "db error" for them).
        let e = match e.as_db_error() {
            Some(db) => format!("{db} ({})", db.code().code()),
            None => e.to_string(),
        };
        match code.as_deref() {
            Some("23505") => StoreError::Conflict(e),
            // Connection exceptions (08), shutdown and crash (57P0x), too many connections (53300).
            Some(c) if c.starts_with("08") || c.starts_with("57P0") || c == "53300" => {
                self.client = None;
                self.in_tx = false;
                StoreError::Unavailable(e)
            }
            Some(_) => StoreError::Sql(e),
            None => {
                self.client = None;
                self.in_tx = false;
                StoreError::Unavailable(e)
            }
        }
    }

    /// Runs `f`, and once more if it failed on a connection that turned out to be dead and no
    /// transaction was open (one would have been lost with it).
    fn retried<T>(&mut self, mut f: impl FnMut(&mut Self) -> Result<T, StoreError>) -> Result<T, StoreError> {
        let (had_client, in_tx) = (self.client.is_some(), self.in_tx);
        match f(self) {
            Err(StoreError::Unavailable(_)) if had_client && !in_tx => f(self),
            done => done,
        }
    }

    /// Whether a transaction is open after `sql` ran (`began`: a BEGIN there succeeded).
    fn track_transaction(&mut self, sql: &str, began: bool) {
        match sql.split_whitespace().next().unwrap_or("").to_ascii_uppercase().as_str() {
            "BEGIN" => self.in_tx = began,
            "COMMIT" | "ROLLBACK" => self.in_tx = false,
            _ => {}
        }
    }

    fn params(params: &[Value]) -> Vec<&(dyn ToSql + Sync)> {
        params.iter().map(|v| v as &(dyn ToSql + Sync)).collect()
    }
}

impl ToSql for Value {
    fn to_sql(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Value::Null => Ok(IsNull::Yes),
            Value::Int(v) if *ty == Type::INT4 => i32::try_from(*v)?.to_sql(ty, out),
            Value::Int(v) => v.to_sql(ty, out),
            Value::Text(v) => v.to_sql(ty, out),
            Value::Bytes(v) => v.to_sql(ty, out),
            Value::Texts(v) => v.to_sql(ty, out),
            Value::Blobs(v) => v.to_sql(ty, out),
            Value::Ints(v) => v.to_sql(ty, out),
        }
    }

    fn accepts(ty: &Type) -> bool {
        [Type::INT8, Type::INT4, Type::TEXT, Type::VARCHAR, Type::BYTEA, Type::TEXT_ARRAY, Type::BYTEA_ARRAY, Type::INT8_ARRAY].contains(ty)
    }

    to_sql_checked!();
}

fn row(r: &tokio_postgres::Row) -> Result<Row, StoreError> {
    let bad = |e: tokio_postgres::Error| StoreError::Decode(e.to_string());
    (0..r.len())
        .map(|i| {
            let ty = r.columns()[i].type_();
            let v = if *ty == Type::INT8 {
                r.try_get::<_, Option<i64>>(i).map_err(bad)?.map(Value::Int)
            } else if *ty == Type::INT4 {
                r.try_get::<_, Option<i32>>(i).map_err(bad)?.map(|v| Value::Int(v.into()))
            } else if *ty == Type::BOOL {
                r.try_get::<_, Option<bool>>(i).map_err(bad)?.map(|v| Value::Int(v.into()))
            } else if *ty == Type::TEXT || *ty == Type::VARCHAR || *ty == Type::NAME {
                r.try_get::<_, Option<String>>(i).map_err(bad)?.map(Value::Text)
            } else if *ty == Type::BYTEA {
                r.try_get::<_, Option<Vec<u8>>>(i).map_err(bad)?.map(Value::Bytes)
            } else if *ty == Type::INT8_ARRAY {
                r.try_get::<_, Option<Vec<i64>>>(i).map_err(bad)?.map(Value::Ints)
            } else {
                return Err(StoreError::Decode(format!("column {i} has type {ty}")));
            };
            Ok(v.unwrap_or(Value::Null))
        })
        .collect()
}

/// A value in COPY's text format (the ledger's bulk rows hold no arrays).
fn copy_text(v: &Value, out: &mut Vec<u8>) -> Result<(), StoreError> {
    match v {
        Value::Null => out.extend_from_slice(b"\\N"),
        Value::Int(i) => out.extend_from_slice(i.to_string().as_bytes()),
        Value::Text(t) => {
            for &b in t.as_bytes() {
                match b {
                    b'\\' => out.extend_from_slice(b"\\\\"),
                    b'\t' => out.extend_from_slice(b"\\t"),
                    b'\n' => out.extend_from_slice(b"\\n"),
                    b'\r' => out.extend_from_slice(b"\\r"),
                    b => out.push(b),
                }
            }
        }
        // bytea's hex input, `\x…`, with COPY's backslash doubled.
        Value::Bytes(b) => {
            out.extend_from_slice(b"\\\\x");
            out.extend_from_slice(hex::encode(b).as_bytes());
        }
        Value::Texts(_) | Value::Blobs(_) | Value::Ints(_) => return Err(StoreError::Decode("an array in a bulk row".into())),
    }
    Ok(())
}

impl Db for Postgres {
    fn dialect(&self) -> Dialect {
        Dialect::Postgres
    }

    fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        let done = self.retried(|pg| {
            let text = postgres_sql(sql);
            let done = pg.run(|c| c.batch_execute(&text))?;
            done.map_err(|e| pg.failed(e))
        });
        self.track_transaction(sql, done.is_ok());
        done
    }

    fn execute(&mut self, sql: &'static str, params: &[Value]) -> Result<u64, StoreError> {
        self.retried(|pg| {
            let stmt = pg.statement(sql)?;
            let params = Self::params(params);
            let done = pg.run(|c| c.execute(&stmt, &params))?;
            done.map_err(|e| pg.failed(e))
        })
    }

    fn query(&mut self, sql: &'static str, params: &[Value]) -> Result<Vec<Row>, StoreError> {
        self.retried(|pg| {
            let stmt = pg.statement(sql)?;
            let params = Self::params(params);
            let rows = pg.run(|c| c.query(&stmt, &params))?;
            rows.map_err(|e| pg.failed(e))?.iter().map(row).collect()
        })
    }

    /// Every statement is sent before any answer is read (tokio-postgres pipelines the queries
    /// it polls together), so the server runs them in order and the call costs one round trip.
    /// Not retried: it may hold a transaction's BEGIN or COMMIT. A failed statement inside a
    /// transaction fails the ones after it, and turns a COMMIT among them into a rollback.
    fn pipeline(&mut self, steps: &[(&'static str, &[Value])]) -> Result<Vec<Vec<Row>>, StoreError> {
        let stmts = steps.iter().map(|(sql, _)| self.statement(sql)).collect::<Result<Vec<_>, _>>()?;
        let params: Vec<Vec<&(dyn ToSql + Sync)>> = steps.iter().map(|(_, p)| Self::params(p)).collect();
        let answers = self.run(|c| futures::future::join_all(stmts.iter().zip(&params).map(|(s, p)| c.query(s, p))))?;
        for (sql, _) in steps {
            self.track_transaction(sql, true);
        }
        let mut out = Vec::with_capacity(answers.len());
        for a in answers {
            out.push(a.map_err(|e| self.failed(e))?.iter().map(row).collect::<Result<Vec<Row>, _>>()?);
        }
        Ok(out)
    }

    fn bulk_insert(&mut self, table: &str, columns: &[&str], rows: &[Row]) -> Result<(), StoreError> {
        let mut text = Vec::with_capacity(rows.len() * 64);
        for r in rows {
            for (i, v) in r.iter().enumerate() {
                if i > 0 {
                    text.push(b'\t');
                }
                copy_text(v, &mut text)?;
            }
            text.push(b'\n');
        }
        let copy = format!("COPY {table} ({}) FROM STDIN", columns.join(", "));
        let sent = self.run(|c| copy_in(c, &copy, text.into()))?;
        sent.map_err(|e| self.failed(e))
    }
}

/// Makes a new, empty database on the server at `url` and returns the URL that names it: each
/// test or bench run gets a ledger of its own on one server.
pub fn fresh_database(url: &str, name: &str) -> Result<String, StoreError> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
        return Err(StoreError::BadUrl(format!("{name:?}: a database name is [a-z0-9_]+")));
    }
    let mut pg = Postgres::new(url)?;
    pg.batch(&format!("CREATE DATABASE {name}"))?;
    // The URL with its path (the database) replaced, its query kept.
    let bad = || StoreError::BadUrl(format!("{url}: expected postgres://[user@]host[:port][/db][?options]"));
    let authority = url.find("://").ok_or_else(bad)? + 3;
    let rest = &url[authority..];
    let host_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let query = rest[host_end..].find('?').map(|q| &rest[host_end + q..]).unwrap_or("");
    Ok(format!("{}{}/{name}{query}", &url[..authority], &rest[..host_end]))
}

async fn copy_in(client: &Client, copy: &str, text: Bytes) -> Result<(), tokio_postgres::Error> {
    let sink = client.copy_in::<_, Bytes>(copy).await?;
    let mut sink = std::pin::pin!(sink);
    sink.send(text).await?;
    sink.as_mut().finish().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_text_escapes_what_copy_reads_specially() {
        let mut out = Vec::new();
        for v in [Value::Text("a\tb\\c\nd".into()), Value::Bytes(vec![0, 0xab]), Value::Int(-3), Value::Null] {
            copy_text(&v, &mut out).unwrap();
            out.push(b'|');
        }
        assert_eq!(String::from_utf8(out).unwrap(), "a\\tb\\\\c\\nd|\\\\x00ab|-3|\\N|");
    }
}

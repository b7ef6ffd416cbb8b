//! The seam between the ledger's logic and a database: statements with numbered parameters
//! (`?1`), rows of plain values, and a fast bulk insert. SQLite and PostgreSQL implement it, so
//! every query and every rule of the ledger is written once.

use super::StoreError;

/// A parameter or a column's value. Integers are 64-bit on both backends (`BIGINT` in Postgres).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Value {
    Null,
    Int(i64),
    Text(String),
    Bytes(Vec<u8>),
    /// Arrays, for Postgres' `unnest` (a statement that stores many rows in one round trip);
    /// SQLite has no array type and refuses them.
    Texts(Vec<String>),
    Blobs(Vec<Vec<u8>>),
    Ints(Vec<i64>),
}

pub(crate) type Row = Vec<Value>;

impl From<i64> for Value {
    fn from(v: i64) -> Value {
        Value::Int(v)
    }
}

impl From<u64> for Value {
    fn from(v: u64) -> Value {
        // Token counts and milliseconds stay far below 2^63; saturate rather than wrap.
        Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}

impl From<u32> for Value {
    fn from(v: u32) -> Value {
        Value::Int(v.into())
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::Text(v.into())
    }
}

impl From<&String> for Value {
    fn from(v: &String) -> Value {
        Value::Text(v.clone())
    }
}

impl From<&Vec<u8>> for Value {
    fn from(v: &Vec<u8>) -> Value {
        Value::Bytes(v.clone())
    }
}

impl Value {
    pub(crate) fn int(&self) -> Result<i64, StoreError> {
        match self {
            Value::Int(v) => Ok(*v),
            Value::Null => Ok(0),
            v => Err(StoreError::Decode(format!("expected an integer, found {v:?}"))),
        }
    }

    pub(crate) fn count(&self) -> Result<u64, StoreError> {
        Ok(self.int()?.max(0) as u64)
    }

    pub(crate) fn ints(self) -> Result<Vec<i64>, StoreError> {
        match self {
            Value::Ints(v) => Ok(v),
            v => Err(StoreError::Decode(format!("expected integers, found {v:?}"))),
        }
    }

    pub(crate) fn text(self) -> Result<String, StoreError> {
        match self {
            Value::Text(v) => Ok(v),
            v => Err(StoreError::Decode(format!("expected text, found {v:?}"))),
        }
    }

    pub(crate) fn bytes(self) -> Result<Vec<u8>, StoreError> {
        match self {
            Value::Bytes(v) => Ok(v),
            v => Err(StoreError::Decode(format!("expected bytes, found {v:?}"))),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dialect {
    Sqlite,
    Postgres,
}

/// One connection to a database. Statements are `'static` so a backend can cache them prepared.
pub(crate) trait Db: Send {
    fn dialect(&self) -> Dialect;
    /// Statements without parameters, separated by `;` (DDL, BEGIN, COMMIT).
    fn batch(&mut self, sql: &str) -> Result<(), StoreError>;
    /// Rows changed.
    fn execute(&mut self, sql: &'static str, params: &[Value]) -> Result<u64, StoreError>;
    fn query(&mut self, sql: &'static str, params: &[Value]) -> Result<Vec<Row>, StoreError>;
    /// Each statement's rows, the statements run in order; where the backend can, all are sent
    /// before any answer is read (one round trip). Any failure fails the call.
    fn pipeline(&mut self, steps: &[(&'static str, &[Value])]) -> Result<Vec<Vec<Row>>, StoreError> {
        steps.iter().map(|(sql, params)| self.query(sql, params)).collect()
    }
    /// Inserts rows into `table` as fast as the backend allows (Postgres: COPY), inside the
    /// caller's transaction; a duplicate key fails the whole call.
    fn bulk_insert(&mut self, table: &str, columns: &[&str], rows: &[Row]) -> Result<(), StoreError>;
}

/// The statement as Postgres spells it: `$1` for `?1`, and its names for SQLite's column types.
/// The ledger's SQL holds no `?`, `INTEGER` or `BLOB` anywhere else.
pub(crate) fn postgres_sql(sql: &str) -> String {
    sql.replace('?', "$").replace("INTEGER", "BIGINT").replace("BLOB", "BYTEA")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_spelling() {
        assert_eq!(
            postgres_sql("CREATE TABLE t (a INTEGER, b BLOB); SELECT a FROM t WHERE a = ?1 AND b = ?12"),
            "CREATE TABLE t (a BIGINT, b BYTEA); SELECT a FROM t WHERE a = $1 AND b = $12"
        );
    }
}

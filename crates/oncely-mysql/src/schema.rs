//! Migrations, and the check that the tables are what the ledger needs.
//!
//! `CREATE TABLE IF NOT EXISTS` succeeds on any table of that name, so a
//! table someone else created (without the primary key on `effect_key`, with
//! a case-insensitive collation, with a column missing) would be recorded as
//! migrated, and a claim on it could acquire a key that is already claimed.
//! [`verify`] reads `information_schema` on connect (every mode) and at the
//! end of [`migrate`], and refuses such a table with [`Error::Config`] naming
//! it and every problem found.

use oncely::{Error, Result};
use sqlx::{Executor, MySqlConnection, Row};

use crate::error::{self, BACKEND, map};
use crate::row::{first, only};
use crate::sql;

/// What a column must be.
#[derive(Debug, Clone, Copy)]
enum Want {
    /// A string compared byte for byte: `VARCHAR` in `utf8mb4` with a binary
    /// collation (`utf8mb4_bin`, `utf8mb4_0900_bin`, …) or `VARBINARY`, at
    /// least this many characters. Case- or accent-insensitive collations
    /// (and UCA ones, which equate `é` with `e` + U+0301) would let two
    /// different keys or tenants share one record.
    Exact(i64),
    /// A string that stores any key part without loss: `utf8mb4` or binary,
    /// at least this many characters.
    Text(i64),
    /// `ENUM` with at least these values (a record's or a message's
    /// states).
    Enum(&'static [&'static str]),
    /// `BIGINT UNSIGNED` (fences, outbox ids).
    Unsigned,
    /// `INT UNSIGNED` or `BIGINT UNSIGNED` (a count: a message's attempts).
    Count,
    /// `BIGINT` (signed: timestamps and durations in µs).
    Signed,
    /// `TINYINT` (`BOOLEAN`).
    Flag,
    /// Bytes of exactly this length: `BINARY(n)`, or `VARBINARY(≥ n)`.
    Bytes(i64),
    /// A blob or byte string of at least this many bytes.
    Blob(i64),
}

/// (column, what it must be, whether it must accept NULL)
type Spec = &'static [(&'static str, Want, bool)];

const EFFECTS: Spec = &[
    (
        "effect_key",
        Want::Exact(oncely::backend::MAX_KEY_BYTES as i64),
        false,
    ),
    (
        "tenant",
        Want::Exact(oncely::backend::MAX_TENANT_BYTES as i64),
        false,
    ),
    ("kind", Want::Exact(oncely::backend::MAX_KIND_BYTES as i64), false),
    (
        "subject",
        Want::Text(oncely::backend::MAX_KEY_BYTES as i64),
        false,
    ),
    ("state", Want::Enum(RECORD_STATES), false),
    ("fence", Want::Unsigned, false),
    ("fingerprint", Want::Bytes(32), true),
    (
        "outcome",
        Want::Blob(oncely::backend::MAX_OUTCOME_BYTES as i64),
        true,
    ),
    ("at_most_once", Want::Flag, false),
    ("claim_token", Want::Bytes(16), false),
    ("created_us", Want::Signed, false),
    ("updated_us", Want::Signed, false),
    ("lease_expires_us", Want::Signed, true),
    ("retention_us", Want::Signed, false),
    ("retain_until_us", Want::Signed, false),
];

/// A record's stored states.
const RECORD_STATES: &[&str] = &["in_progress", "completed", "released"];

/// The outbox table (schema version 3: it exists whole or not at all).
const OUTBOX: Spec = &[
    ("id", Want::Unsigned, false),
    (
        "effect_key",
        Want::Exact(oncely::backend::MAX_KEY_BYTES as i64),
        false,
    ),
    (
        "tenant",
        Want::Text(oncely::backend::MAX_TENANT_BYTES as i64),
        false,
    ),
    (
        "ordering_key",
        Want::Exact(oncely::outbox::MAX_ORDERING_KEY_BYTES as i64),
        false,
    ),
    (
        "destination",
        Want::Text(oncely::outbox::MAX_DESTINATION_BYTES as i64),
        false,
    ),
    // The headers' JSON: 32 headers of up to 4 KiB values, escaped.
    ("headers", Want::Text(1 << 20), false),
    (
        "payload",
        Want::Blob(oncely::outbox::MAX_PAYLOAD_BYTES as i64),
        false,
    ),
    ("state", Want::Enum(&["pending", "sent", "failed"]), false),
    ("attempts", Want::Count, false),
    ("fence", Want::Unsigned, false),
    ("lease_expires_us", Want::Signed, true),
    ("due_us", Want::Signed, false),
    ("enqueued_us", Want::Signed, false),
    ("sent_us", Want::Signed, true),
    ("last_error", Want::Text(0), true),
];

const HORIZON: Spec = &[
    (
        "tenant",
        Want::Exact(oncely::backend::MAX_TENANT_BYTES as i64),
        false,
    ),
    ("kind", Want::Exact(oncely::backend::MAX_KIND_BYTES as i64), false),
    ("watermark_us", Want::Signed, true),
];

/// A column as `information_schema.COLUMNS` describes it.
#[derive(Debug)]
struct Column {
    name: String,
    data_type: String,
    column_type: String,
    nullable: bool,
    max_len: Option<i64>,
    charset: Option<String>,
    collation: Option<String>,
}

impl Column {
    /// What is wrong with this column for `want`, if anything.
    fn problem(&self, want: Want, must_be_nullable: bool) -> Option<String> {
        let dt = self.data_type.to_ascii_lowercase();
        let ct = self.column_type.to_ascii_lowercase();
        let len = self.max_len.unwrap_or(0);
        let charset = self.charset.as_deref().unwrap_or("binary").to_ascii_lowercase();
        let collation = self.collation.as_deref().unwrap_or("binary").to_ascii_lowercase();
        let is = |types: &[&str]| types.contains(&dt.as_str());
        let wrong = match want {
            Want::Exact(n) => {
                if !is(&["varchar", "varbinary"]) || len < n {
                    Some(format!(
                        "must be VARCHAR({n}) or longer (utf8mb4, binary collation)"
                    ))
                } else if dt == "varchar" && charset != "utf8mb4" {
                    Some(format!("has character set {charset}; it must be utf8mb4"))
                } else if dt == "varchar" && !(collation.ends_with("_bin") || collation == "binary") {
                    Some(format!(
                        "has collation {collation}, which is not binary: keys that differ only in case or \
                         accents would share one record; use utf8mb4_bin"
                    ))
                } else {
                    None
                }
            }
            Want::Text(n) => {
                if !is(&["varchar", "varbinary", "text", "mediumtext", "longtext"]) || len < n {
                    Some(format!("must be VARCHAR({n}) or longer"))
                } else if charset != "utf8mb4" && charset != "binary" {
                    Some(format!("has character set {charset}; it must be utf8mb4"))
                } else {
                    None
                }
            }
            Want::Enum(values) => {
                let has_all = values.iter().all(|v| ct.contains(&format!("'{v}'")));
                (dt != "enum" || !has_all).then(|| {
                    let list: Vec<String> = values.iter().map(|v| format!("'{v}'")).collect();
                    format!("must be ENUM({})", list.join(", "))
                })
            }
            Want::Unsigned => {
                (dt != "bigint" || !ct.contains("unsigned")).then(|| "must be BIGINT UNSIGNED".to_owned())
            }
            Want::Count => (!is(&["int", "bigint"]) || !ct.contains("unsigned"))
                .then(|| "must be INT UNSIGNED".to_owned()),
            Want::Signed => {
                (dt != "bigint" || ct.contains("unsigned")).then(|| "must be BIGINT (signed)".to_owned())
            }
            Want::Flag => (dt != "tinyint").then(|| "must be BOOLEAN (TINYINT)".to_owned()),
            Want::Bytes(n) => {
                let ok = (dt == "binary" && len == n) || (dt == "varbinary" && len >= n);
                (!ok).then(|| format!("must be BINARY({n})"))
            }
            Want::Blob(n) => {
                let ok = is(&["varbinary", "blob", "mediumblob", "longblob"]) && len >= n;
                (!ok).then(|| format!("must be MEDIUMBLOB (at least {n} bytes)"))
            }
        };
        let wrong =
            wrong.or_else(|| (must_be_nullable && !self.nullable).then(|| "must accept NULL".to_owned()));
        wrong.map(|w| format!("column {} ({}) {w}", self.name, self.column_type))
    }
}

/// Checks the ledger table, its horizon table and its outbox table (schema
/// version 3); [`Error::Config`] names the table and everything wrong with
/// it. Reads `information_schema` only, so a user with `SELECT` on the
/// tables can run it.
pub(crate) async fn verify(conn: &mut MySqlConnection, table: &str) -> Result<()> {
    verify_one(conn, table, EFFECTS, &["effect_key"]).await?;
    verify_one(conn, &sql::horizon_table(table), HORIZON, &["kind", "tenant"]).await?;
    verify_one(conn, &sql::outbox_table(table), OUTBOX, &["effect_key"]).await
}

/// Checks one table: it exists as an InnoDB base table, has every column of
/// `spec`, and a primary key or unique index on exactly `key_cols` (sorted)
/// whole columns.
async fn verify_one(conn: &mut MySqlConnection, table: &str, spec: Spec, key_cols: &[&str]) -> Result<()> {
    let db: Option<String> = sqlx::query_scalar(sql::DATABASE)
        .fetch_all(&mut *conn)
        .await
        .and_then(only)
        .map_err(map)?;
    let Some(db) = db else {
        return Err(Error::Config(
            "no database selected: put the database in the MySQL URL (mysql://host/db)".to_owned(),
        ));
    };
    let name = format!("`{db}`.`{table}`");
    let found = sql::bind_is_table(table)
        .fetch_all(&mut *conn)
        .await
        .map(first)
        .map_err(map)?;
    let Some(found) = found else {
        return Err(Error::Config(format!(
            "table {name} does not exist (or this user cannot see it); run `oncely migrate` or \
             MySqlLedger::migrate with a user that may create it"
        )));
    };
    let mut problems = Vec::new();
    let kind: Option<String> = found.try_get("kind").map_err(map)?;
    let engine: Option<String> = found.try_get("engine").map_err(map)?;
    if kind.as_deref() != Some("BASE TABLE") {
        problems.push(format!("it is a {}, not a table", kind.unwrap_or_default()));
    } else if !engine
        .as_deref()
        .is_some_and(|e| e.eq_ignore_ascii_case("InnoDB"))
    {
        problems.push(format!(
            "its engine is {}; it must be InnoDB (transactions, row locks)",
            engine.unwrap_or_default()
        ));
    }
    let rows = sql::bind_is_columns(table)
        .fetch_all(&mut *conn)
        .await
        .map_err(map)?;
    let mut columns = Vec::with_capacity(rows.len());
    for r in &rows {
        columns.push(Column {
            name: r.try_get("name").map_err(map)?,
            data_type: r.try_get("data_type").map_err(map)?,
            column_type: r.try_get("column_type").map_err(map)?,
            nullable: r.try_get::<String, _>("nullable").map_err(map)? == "YES",
            max_len: r.try_get("max_len").map_err(map)?,
            charset: r.try_get("charset").map_err(map)?,
            collation: r.try_get("collation").map_err(map)?,
        });
    }
    for (col, want, nullable) in spec {
        match columns.iter().find(|c| c.name.eq_ignore_ascii_case(col)) {
            None => problems.push(format!("column {col} is missing")),
            Some(c) => problems.extend(c.problem(*want, *nullable)),
        }
    }
    let rows = sql::bind_is_indexes(table)
        .fetch_all(&mut *conn)
        .await
        .map_err(map)?;
    // index name -> (unique, whole columns, any prefix or expression part)
    let mut indexes: Vec<(String, bool, Vec<String>, bool)> = Vec::new();
    for r in &rows {
        let idx: String = r.try_get("idx").map_err(map)?;
        let unique = r.try_get::<i64, _>("non_unique").map_err(map)? == 0;
        let col: Option<String> = r.try_get("col").map_err(map)?;
        let partial = col.is_none() || r.try_get::<Option<i64>, _>("sub_part").map_err(map)?.is_some();
        match indexes.iter_mut().find(|(name, ..)| *name == idx) {
            Some((_, _, cols, p)) => {
                cols.extend(col.map(|c| c.to_ascii_lowercase()));
                *p |= partial;
            }
            None => indexes.push((
                idx,
                unique,
                col.map(|c| c.to_ascii_lowercase()).into_iter().collect(),
                partial,
            )),
        }
    }
    let keyed = indexes.iter().any(|(_, unique, cols, partial)| {
        let mut cols = cols.clone();
        cols.sort();
        *unique && !*partial && cols == key_cols
    });
    if !keyed {
        problems.push(format!(
            "it has no PRIMARY KEY or UNIQUE index on exactly ({}) (whole columns): without it two \
             claims of one key both insert, and both run the effect",
            key_cols.join(", ")
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "table {name} cannot be used by the {BACKEND} ledger: {}",
            problems.join("; ")
        )))
    }
}

/// Creates or upgrades the tables on `conn`, serialised across processes by
/// `GET_LOCK`, then checks them. A table that exists before the migration
/// (made by someone else, or by an older release) is checked first, so a
/// table the ledger cannot use gets no DDL at all.
pub(crate) async fn migrate(conn: &mut MySqlConnection, table: &str) -> Result<()> {
    let lock = format!("oncely.migrate.{table}");
    let got: Option<i64> = sql::bind_migration_lock(&lock)
        .fetch_all(&mut *conn)
        .await
        .and_then(only)
        .map_err(map)?;
    if got != Some(1) {
        return Err(Error::Backend {
            backend: BACKEND,
            message: format!("could not take the migration lock {lock:?} within 60 s"),
            retryable: true,
        });
    }
    let result = apply(conn, table).await;
    // A session lock outlives the statement: release it before the
    // connection goes back to the pool, whatever happened.
    let released = sql::bind_migration_unlock(&lock).execute(&mut *conn).await;
    result?;
    released.map_err(map)?;
    verify(conn, table).await
}

async fn apply(conn: &mut MySqlConnection, table: &str) -> Result<()> {
    let exists: i64 = sql::bind_is_table_count(table)
        .fetch_all(&mut *conn)
        .await
        .and_then(only)
        .map_err(map)?;
    if exists > 0 {
        verify_one(conn, table, EFFECTS, &["effect_key"]).await?;
    }
    conn.execute(sql::MIGRATIONS_TABLE).await.map_err(map)?;
    let applied: Vec<u32> = sql::bind_applied_versions(table)
        .fetch_all(&mut *conn)
        .await
        .map_err(map)?;
    for (version, statements) in sql::migrations(table) {
        if applied.contains(&version) {
            continue;
        }
        // `GET_LOCK` holds off migrators on this server only: on Galera,
        // another node's migrator may run the same steps at once, and one
        // of two writes of the bookkeeping row loses certification (1213).
        // Every step is idempotent, so the version runs again.
        let mut conflicts = 0;
        loop {
            match apply_version(conn, table, version, &statements).await {
                Ok(()) => break,
                Err(e) if error::is_retryable(&e) && conflicts < MIGRATION_CONFLICTS => conflicts += 1,
                Err(e) => return Err(map(e)),
            }
        }
    }
    Ok(())
}

/// How many conflicts one schema version may meet before migrate fails.
const MIGRATION_CONFLICTS: u32 = 5;

async fn apply_version(
    conn: &mut MySqlConnection,
    table: &str,
    version: u32,
    statements: &[String],
) -> std::result::Result<(), sqlx::Error> {
    for s in statements {
        conn.execute(sqlx::AssertSqlSafe(s.as_str())).await?;
    }
    sql::bind_record_version(table, version)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(data_type: &str, column_type: &str, len: Option<i64>, charset: &str, collation: &str) -> Column {
        Column {
            name: "c".into(),
            data_type: data_type.into(),
            column_type: column_type.into(),
            nullable: false,
            max_len: len,
            charset: (!charset.is_empty()).then(|| charset.into()),
            collation: (!collation.is_empty()).then(|| collation.into()),
        }
    }

    #[test]
    fn key_columns_compare_exactly() {
        let want = Want::Exact(255);
        assert!(
            col("varchar", "varchar(255)", Some(255), "utf8mb4", "utf8mb4_bin")
                .problem(want, false)
                .is_none()
        );
        assert!(
            col(
                "varchar",
                "varchar(300)",
                Some(300),
                "utf8mb4",
                "utf8mb4_0900_bin"
            )
            .problem(want, false)
            .is_none()
        );
        assert!(
            col("varbinary", "varbinary(255)", Some(255), "", "")
                .problem(want, false)
                .is_none()
        );
        for bad in [
            col(
                "varchar",
                "varchar(255)",
                Some(255),
                "utf8mb4",
                "utf8mb4_general_ci",
            ),
            col(
                "varchar",
                "varchar(255)",
                Some(255),
                "utf8mb4",
                "utf8mb4_0900_as_cs",
            ),
            col("varchar", "varchar(255)", Some(255), "utf8mb3", "utf8mb3_bin"),
            col("varchar", "varchar(100)", Some(100), "utf8mb4", "utf8mb4_bin"),
            col("char", "char(255)", Some(255), "utf8mb4", "utf8mb4_bin"),
            col("text", "text", Some(65535), "utf8mb4", "utf8mb4_bin"),
        ] {
            assert!(bad.problem(want, false).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn numbers_bytes_and_nulls() {
        assert!(
            col("bigint", "bigint(20) unsigned", None, "", "")
                .problem(Want::Unsigned, false)
                .is_none()
        );
        assert!(
            col("bigint", "bigint(20)", None, "", "")
                .problem(Want::Unsigned, false)
                .is_some()
        );
        assert!(
            col("bigint", "bigint(20) unsigned", None, "", "")
                .problem(Want::Signed, false)
                .is_some()
        );
        assert!(
            col("int", "int(11)", None, "", "")
                .problem(Want::Signed, false)
                .is_some()
        );
        assert!(
            col("binary", "binary(16)", Some(16), "", "")
                .problem(Want::Bytes(16), false)
                .is_none()
        );
        assert!(
            col("binary", "binary(32)", Some(32), "", "")
                .problem(Want::Bytes(16), false)
                .is_some()
        );
        assert!(
            col("blob", "blob", Some(65535), "", "")
                .problem(Want::Blob(65536), false)
                .is_some()
        );
        assert!(
            col("mediumblob", "mediumblob", Some(16777215), "", "")
                .problem(Want::Blob(65536), false)
                .is_none()
        );
        assert!(
            col("bigint", "bigint(20)", None, "", "")
                .problem(Want::Signed, true)
                .is_some(),
            "NOT NULL where NULL is written"
        );
        assert!(
            col(
                "enum",
                "enum('in_progress','completed','released')",
                Some(11),
                "utf8mb4",
                "utf8mb4_bin"
            )
            .problem(Want::Enum(RECORD_STATES), false)
            .is_none()
        );
        assert!(
            col(
                "enum",
                "enum('in_progress','completed')",
                Some(11),
                "utf8mb4",
                "utf8mb4_bin"
            )
            .problem(Want::Enum(RECORD_STATES), false)
            .is_some()
        );
    }
}

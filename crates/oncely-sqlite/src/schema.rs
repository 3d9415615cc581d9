//! The schema: migrations, and the check that the tables in the file are
//! ones the claim can rely on.
//!
//! `CREATE TABLE IF NOT EXISTS` keeps whatever table is already there, so a
//! table made by hand (or by another tool) is checked before the ledger
//! trusts it: without a unique index on the key every claim would insert a
//! new row and acquire; with a case-insensitive collation `Acme` and `acme`
//! would share a record; a missing column fails every claim.

use oncely::{Error, Result};
use sqlx::{AssertSqlSafe, Connection, Row, SqliteConnection};

use crate::error::{corrupt, map};
use crate::sql::{self, Queries, SCHEMA_VERSION};

/// A column's type affinity, which decides how SQLite converts the values
/// the ledger writes (a TEXT key `123` stored in a NUMERIC column comes back
/// as an integer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Affinity {
    Text,
    Integer,
    Blob,
    Real,
    Numeric,
}

impl Affinity {
    /// SQLite's rules for a declared type, in their order
    /// (<https://www.sqlite.org/datatype3.html#determination_of_column_affinity>).
    fn of(declared: &str) -> Affinity {
        let d = declared.to_ascii_uppercase();
        if d.contains("INT") {
            Affinity::Integer
        } else if d.contains("CHAR") || d.contains("CLOB") || d.contains("TEXT") {
            Affinity::Text
        } else if d.contains("BLOB") || d.trim().is_empty() {
            Affinity::Blob
        } else if d.contains("REAL") || d.contains("FLOA") || d.contains("DOUB") {
            Affinity::Real
        } else {
            Affinity::Numeric
        }
    }

    fn name(self) -> &'static str {
        match self {
            Affinity::Text => "TEXT",
            Affinity::Integer => "INTEGER",
            Affinity::Blob => "BLOB",
            Affinity::Real => "REAL",
            Affinity::Numeric => "NUMERIC",
        }
    }
}

/// What a table must have.
struct Shape {
    columns: &'static [(&'static str, Affinity)],
    /// The columns a PRIMARY KEY or UNIQUE index must cover, exactly, with
    /// binary comparison.
    unique: &'static [&'static str],
}

const LEDGER: Shape = Shape {
    columns: &[
        ("key", Affinity::Text),
        ("tenant", Affinity::Text),
        ("kind", Affinity::Text),
        ("subject", Affinity::Text),
        ("state", Affinity::Text),
        ("fence", Affinity::Integer),
        ("fingerprint", Affinity::Blob),
        ("outcome", Affinity::Blob),
        ("at_most_once", Affinity::Integer),
        ("created_at", Affinity::Integer),
        ("updated_at", Affinity::Integer),
        ("lease_expires_at", Affinity::Integer),
        ("retain_until", Affinity::Integer),
        ("retention_us", Affinity::Integer),
    ],
    unique: &["key"],
};

/// The outbox table (schema version 3: it exists whole or not at all).
const OUTBOX: Shape = Shape {
    columns: &[
        ("id", Affinity::Integer),
        ("key", Affinity::Text),
        ("tenant", Affinity::Text),
        ("ordering_key", Affinity::Text),
        ("destination", Affinity::Text),
        ("headers", Affinity::Text),
        ("payload", Affinity::Blob),
        ("state", Affinity::Text),
        ("attempts", Affinity::Integer),
        ("fence", Affinity::Integer),
        ("lease_expires_at", Affinity::Integer),
        ("due_at", Affinity::Integer),
        ("enqueued_at", Affinity::Integer),
        ("sent_at", Affinity::Integer),
        ("last_error", Affinity::Text),
    ],
    unique: &["key"],
};

const HORIZON: Shape = Shape {
    columns: &[
        ("tenant", Affinity::Text),
        ("kind", Affinity::Text),
        ("pruned_through", Affinity::Integer),
    ],
    unique: &["tenant", "kind"],
};

/// Creates or upgrades the tables, in one `BEGIN IMMEDIATE` transaction (so
/// concurrent migrators take turns), and verifies them before it commits:
/// a table that fails the check rolls everything back.
pub(crate) async fn migrate(conn: &mut SqliteConnection, q: &Queries) -> Result<()> {
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(map)?;
    sqlx::query(AssertSqlSafe(q.create_version_table.clone()))
        .execute(&mut *tx)
        .await
        .map_err(map)?;
    let current = read_version(&mut tx, q).await?.unwrap_or(0);
    if current > SCHEMA_VERSION {
        return Err(newer(q, current));
    }
    // A ledger table that is already there (made by hand, or by an older
    // release) is checked before any step touches it, so its problem is
    // named instead of surfacing as a failed CREATE INDEX.
    if exists(&mut tx, &q.table).await? {
        verify_table(&mut tx, &q.table, &LEDGER).await?;
    }
    for step in q.migrations.iter().skip(usize::try_from(current).unwrap_or(0)) {
        sqlx::raw_sql(AssertSqlSafe(step.clone()))
            .execute(&mut *tx)
            .await
            .map_err(map)?;
    }
    if current != SCHEMA_VERSION {
        sqlx::query(AssertSqlSafe(q.write_version.clone()))
            .bind(&*q.table)
            .bind(SCHEMA_VERSION)
            .execute(&mut *tx)
            .await
            .map_err(map)?;
    }
    verify_table(&mut tx, &q.table, &LEDGER).await?;
    verify_table(&mut tx, &q.horizon_table, &HORIZON).await?;
    verify_table(&mut tx, &q.outbox.table, &OUTBOX).await?;
    tx.commit().await.map_err(map)
}

/// Checks, changing nothing, that the tables (the ledger's, its horizon's
/// and its outbox's) exist at this crate's schema version and have the
/// columns and keys the claim and the enqueue rely on.
pub(crate) async fn verify(conn: &mut SqliteConnection, q: &Queries) -> Result<()> {
    let has_versions = exists(conn, "oncely_schema").await?;
    if has_versions && let Some(v) = read_version(conn, q).await? {
        if v > SCHEMA_VERSION {
            return Err(newer(q, v));
        }
        if v < SCHEMA_VERSION {
            return Err(Error::Config(format!(
                "table {} is at schema version {v}; this oncely-sqlite needs version {SCHEMA_VERSION}: \
                 run `oncely migrate` (or connect with SqliteLedgerOptions::migrate(true))",
                q.table
            )));
        }
    }
    // No version row: tables made by the application's own migrations are
    // fine as long as they have the right shape.
    verify_table(conn, &q.table, &LEDGER).await?;
    verify_table(conn, &q.horizon_table, &HORIZON).await?;
    verify_table(conn, &q.outbox.table, &OUTBOX).await
}

async fn read_version(conn: &mut SqliteConnection, q: &Queries) -> Result<Option<i64>> {
    sqlx::query_scalar(AssertSqlSafe(q.read_version.clone()))
        .bind(&*q.table)
        .fetch_optional(conn)
        .await
        .map_err(map)
}

fn newer(q: &Queries, version: i64) -> Error {
    corrupt(format!(
        "table {} has schema version {version}; this oncely-sqlite knows up to {SCHEMA_VERSION}",
        q.table
    ))
}

async fn exists(conn: &mut SqliteConnection, table: &str) -> Result<bool> {
    Ok(object_type(conn, table).await?.is_some())
}

/// What `name` is in the main schema (`table`, `view`, …), if anything.
async fn object_type(conn: &mut SqliteConnection, name: &str) -> Result<Option<String>> {
    let row = sqlx::query(sql::OBJECT_TYPE)
        .bind(name)
        .fetch_optional(conn)
        .await
        .map_err(map)?;
    row.map(|r| r.try_get("type")).transpose().map_err(map)
}

/// Checks one table against its shape; every problem is listed in one
/// [`Error::Config`] that names the table.
async fn verify_table(conn: &mut SqliteConnection, table: &str, shape: &Shape) -> Result<()> {
    match object_type(conn, table).await?.as_deref() {
        None => {
            return Err(Error::Config(format!(
                "table {table} does not exist: run `oncely migrate` (or connect with \
                 SqliteLedgerOptions::migrate(true))"
            )));
        }
        Some("table") => {}
        Some(other) => {
            return Err(Error::Config(format!(
                "{table} is a {other}, not a table: oncely cannot keep a ledger in it"
            )));
        }
    }
    let mut problems = Vec::new();
    let columns = sqlx::query(sql::TABLE_COLUMNS)
        .bind(table)
        .fetch_all(&mut *conn)
        .await
        .map_err(map)?
        .iter()
        .map(|r| Ok::<(String, String), _>((r.try_get("name")?, r.try_get("type")?)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(map)?;
    for (name, wanted) in shape.columns {
        match columns.iter().find(|(c, _)| c.eq_ignore_ascii_case(name)) {
            None => problems.push(format!("no column `{name}` ({})", wanted.name())),
            Some((_, declared)) => {
                let affinity = Affinity::of(declared);
                if affinity != *wanted {
                    problems.push(format!(
                        "column `{name}` is declared {declared:?} ({} affinity); it must be {}",
                        affinity.name(),
                        wanted.name()
                    ));
                }
            }
        }
    }
    if problems.is_empty() {
        check_keys(conn, table, shape, &mut problems).await?;
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "table {table} cannot hold an oncely ledger: {}",
            problems.join("; ")
        )))
    }
}

/// A PRIMARY KEY or full UNIQUE index on exactly the shape's columns, with
/// binary comparison in the index and in the columns themselves. (The
/// column's own collation decides `WHERE key = ?`; the index's decides what
/// conflicts.)
async fn check_keys(
    conn: &mut SqliteConnection,
    table: &str,
    shape: &Shape,
    problems: &mut Vec<String>,
) -> Result<()> {
    let wanted = shape.unique.join(", ");
    let indexes = sqlx::query(sql::TABLE_INDEXES)
        .bind(table)
        .fetch_all(&mut *conn)
        .await
        .map_err(map)?
        .iter()
        .map(|r| {
            Ok::<(String, bool, bool), _>((r.try_get("name")?, r.try_get("unique")?, r.try_get("partial")?))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(map)?;
    let mut unique_binary = false;
    for (name, unique, partial) in &indexes {
        if !unique || *partial {
            continue;
        }
        // Expression parts have no name; they never match a column.
        let parts = sqlx::query(sql::INDEX_KEY_PARTS)
            .bind(name)
            .fetch_all(&mut *conn)
            .await
            .map_err(map)?
            .iter()
            .map(|r| Ok::<(Option<String>, Option<String>), _>((r.try_get("name")?, r.try_get("coll")?)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(map)?;
        let exact = parts.len() == shape.unique.len()
            && shape.unique.iter().all(|col| {
                parts
                    .iter()
                    .any(|(n, _)| n.as_deref().is_some_and(|n| n.eq_ignore_ascii_case(col)))
            });
        if !exact {
            continue;
        }
        let mut collations = parts.iter().map(|(_, c)| c.as_deref().unwrap_or("BINARY"));
        match collations.find(|c| !c.eq_ignore_ascii_case("BINARY")) {
            None => unique_binary = true,
            Some(c) => problems.push(format!(
                "unique index {name} on ({wanted}) compares with collation {c}: keys that differ only \
                 in case would collide (use the default BINARY collation)"
            )),
        }
    }
    if !unique_binary && problems.is_empty() {
        problems.push(format!(
            "no PRIMARY KEY or UNIQUE index on exactly ({wanted}): every claim of one key would insert \
             another row and acquire"
        ));
    }
    for col in shape.unique {
        // The column's declared collation is not in any PRAGMA: see
        // `sql::distinct_under_collation`.
        let distinct: i64 = sqlx::query(AssertSqlSafe(sql::distinct_under_collation(table, col)))
            .fetch_one(&mut *conn)
            .await
            .map_err(map)?
            .try_get("distinct_values")
            .map_err(map)?;
        if distinct != 3 {
            problems.push(format!(
                "column `{col}` compares with a collation other than BINARY (COLLATE NOCASE or RTRIM): \
                 `Acme` and `acme` would share one record"
            ));
        }
    }
    Ok(())
}

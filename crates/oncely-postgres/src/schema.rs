//! Migrations and the schema check: the ledger refuses a table it cannot
//! rely on (issue: a table someone else created, with no unique key on the
//! effect key or a case-insensitive collation, would let two claims of one
//! effect both acquire, or two keys share one record).

use oncely::{Error, Result};
use sqlx::{AssertSqlSafe, PgConnection, Row};

use crate::error::map;
use crate::ledger::PgLedger;
use crate::sql::{self, SCHEMA_VERSION};

/// What a column must be: its name, the types the ledger can use, and
/// whether it is compared by equality on text (then its collation must be
/// deterministic); and the schema version that added it (a table created
/// by someone else is judged, before the migrations run, only on the
/// columns of version 1: the migrations add the later ones).
struct Column {
    name: &'static str,
    kind: Kind,
    since: i32,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `text`, or `varchar` long enough for any part of a key (255).
    Text,
    BigInt,
    Int,
    Bytes,
    Bool,
    Timestamp,
}

impl Kind {
    fn accepts(self, ty: &str) -> bool {
        match self {
            Kind::Text => {
                ty == "text"
                    || ty == "character varying"
                    || ty
                        .strip_prefix("character varying(")
                        .and_then(|n| n.strip_suffix(')'))
                        .and_then(|n| n.parse::<usize>().ok())
                        .is_some_and(|n| n >= oncely::backend::MAX_KEY_BYTES)
            }
            Kind::BigInt => ty == "bigint",
            Kind::Int => ty == "integer",
            Kind::Bytes => ty == "bytea",
            Kind::Bool => ty == "boolean",
            Kind::Timestamp => ty == "timestamp with time zone",
        }
    }

    fn expected(self) -> &'static str {
        match self {
            Kind::Text => "text",
            Kind::BigInt => "bigint",
            Kind::Int => "integer",
            Kind::Bytes => "bytea",
            Kind::Bool => "boolean",
            Kind::Timestamp => "timestamptz",
        }
    }
}

const fn col(name: &'static str, kind: Kind) -> Column {
    Column { name, kind, since: 1 }
}

/// The effects table: every column a statement reads or writes.
const EFFECTS: &[Column] = &[
    col("key", Kind::Text),
    col("tenant", Kind::Text),
    col("kind", Kind::Text),
    col("subject", Kind::Text),
    col("state", Kind::Text),
    col("fence", Kind::BigInt),
    col("fingerprint", Kind::Bytes),
    col("outcome", Kind::Bytes),
    col("at_most_once", Kind::Bool),
    col("created_at", Kind::Timestamp),
    col("updated_at", Kind::Timestamp),
    col("lease_expires_at", Kind::Timestamp),
    col("retain_until", Kind::Timestamp),
    col("retention_us", Kind::BigInt),
    // The claim token (`token.rs`).
    Column {
        name: "claim_token",
        kind: Kind::Bytes,
        since: 3,
    },
    // The waiter's mark (`sql.rs`, `watch_mark`).
    Column {
        name: "watched",
        kind: Kind::Bool,
        since: 4,
    },
];

/// The outbox table (schema version 6: it exists whole or not at all).
const OUTBOX: &[Column] = &[
    col("id", Kind::BigInt),
    col("key", Kind::Text),
    col("tenant", Kind::Text),
    col("ordering_key", Kind::Text),
    col("destination", Kind::Text),
    col("headers", Kind::Text),
    col("payload", Kind::Bytes),
    col("state", Kind::Text),
    col("attempts", Kind::Int),
    col("fence", Kind::BigInt),
    col("lease_expires_at", Kind::Timestamp),
    col("due_at", Kind::Timestamp),
    col("enqueued_at", Kind::Timestamp),
    col("sent_at", Kind::Timestamp),
    col("last_error", Kind::Text),
];

/// The horizon table.
const HORIZON: &[Column] = &[
    col("tenant", Kind::Text),
    col("kind", Kind::Text),
    col("watermark", Kind::Timestamp),
];

impl PgLedger {
    /// Applies the embedded migrations that are missing, then checks the
    /// schema ([`PgLedger::verify`]) before committing: idempotent, and safe
    /// when several processes run it at once (a transaction-scoped advisory
    /// lock per schema serialises them). A table that existed before the
    /// first migration (created by someone else) is checked before anything
    /// is added to it. Refused on a [read-only](crate::PgLedgerOptions::read_only)
    /// ledger.
    pub async fn migrate(&self) -> Result<()> {
        self.writable()?;
        let q = &self.inner.q;
        let (schema, table) = (&self.inner.schema, &self.inner.table);
        let mut tx = self.begin().await?;
        sqlx::query(sql::MIGRATION_LOCK)
            .bind(format!("oncely migrations: {schema}"))
            .execute(&mut *tx)
            .await
            .map_err(map)?;
        let schema_exists: bool = sqlx::query_scalar(AssertSqlSafe(q.schema_exists.clone()))
            .bind(schema)
            .fetch_one(&mut *tx)
            .await
            .map_err(map)?;
        if !schema_exists {
            sqlx::raw_sql(AssertSqlSafe(q.create_schema.clone()))
                .execute(&mut *tx)
                .await
                .map_err(map)?;
        }
        sqlx::raw_sql(AssertSqlSafe(q.create_migrations.clone()))
            .execute(&mut *tx)
            .await
            .map_err(map)?;
        let applied: i32 = sqlx::query_scalar(AssertSqlSafe(q.applied_version.clone()))
            .fetch_one(&mut *tx)
            .await
            .map_err(map)?;
        if applied == 0 {
            // `CREATE TABLE IF NOT EXISTS` would accept any table by that
            // name; judge it first, so that the refusal names what is wrong
            // with it rather than an index that could not be built.
            let problems = check_table(&mut tx, schema, table, EFFECTS, 1, &["key"]).await?;
            if let Some(problems) = problems.filter(|p| !p.is_empty()) {
                return Err(refusal(schema, table, &problems));
            }
        }
        for (version, description, statements) in &q.migrations {
            if *version <= applied {
                continue;
            }
            sqlx::raw_sql(AssertSqlSafe(statements.clone()))
                .execute(&mut *tx)
                .await
                .map_err(map)?;
            sqlx::query(AssertSqlSafe(q.record_migration.clone()))
                .bind(version)
                .bind(*description)
                .execute(&mut *tx)
                .await
                .map_err(map)?;
        }
        // Dropping `tx` on a refusal rolls back everything above.
        self.verify_on(&mut tx).await?;
        tx.commit().await.map_err(map)
    }

    /// Checks, without changing anything, that the schema is one the ledger
    /// can rely on: the ledger table, the `<table>_horizon` table and the
    /// claim's `<table>_beyond` and `<table>_current` functions (schema
    /// version 5) and the `<table>_outbox` table (version 6) exist, the
    /// tables have the columns
    /// the ledger uses (schema version 4: the claim token's `claim_token`
    /// and the waiter's mark `watched` too) with compatible types
    /// (no other `NOT NULL` column without a default), a primary key or
    /// unique index on exactly `key` (and on `(tenant, kind)` for the
    /// horizon), not deferrable nor partial, and deterministic collations on
    /// their text columns: under a case-insensitive (nondeterministic)
    /// collation `Acme` and `acme` would share one record.
    ///
    /// Fails with [`Error::Config`] naming the table and every problem
    /// found. Reads only the catalog, so any role can run it; runs on
    /// connect and at the end of [`PgLedger::migrate`].
    pub async fn verify(&self) -> Result<()> {
        let mut conn = self.acquire().await?;
        self.verify_on(&mut conn).await
    }

    async fn verify_on(&self, conn: &mut PgConnection) -> Result<()> {
        let q = &self.inner.q;
        let (schema, table) = (&self.inner.schema, &self.inner.table);
        let missing = |name: &str, what: &str| {
            Error::Config(format!(
                "{what} {schema}.{name} does not exist; run `oncely migrate` (PgLedger::migrate) with a role \
                 that may create it, or connect with PgLedgerOptions::migrate(true) (this release needs \
                 schema version {SCHEMA_VERSION})"
            ))
        };
        match check_table(conn, schema, table, EFFECTS, SCHEMA_VERSION, &["key"]).await? {
            None => return Err(missing(table, "table")),
            Some(p) if !p.is_empty() => return Err(refusal(schema, table, &p)),
            Some(_) => {}
        }
        match check_table(
            conn,
            schema,
            &q.horizon_table,
            HORIZON,
            SCHEMA_VERSION,
            &["tenant", "kind"],
        )
        .await?
        {
            None => return Err(missing(&q.horizon_table, "table")),
            Some(p) if !p.is_empty() => return Err(refusal(schema, &q.horizon_table, &p)),
            Some(_) => {}
        }
        match check_table(conn, schema, &q.outbox.table, OUTBOX, SCHEMA_VERSION, &["key"]).await? {
            None => return Err(missing(&q.outbox.table, "table")),
            Some(p) if !p.is_empty() => return Err(refusal(schema, &q.outbox.table, &p)),
            Some(_) => {}
        }
        for (name, args, returns) in sql::claim_functions(q) {
            let function: bool = sqlx::query_scalar(sql::FUNCTION_EXISTS)
                .bind(schema)
                .bind(name)
                .bind(args)
                .bind(returns)
                .fetch_one(&mut *conn)
                .await
                .map_err(map)?;
            if !function {
                return Err(missing(name, "function"));
            }
        }
        Ok(())
    }
}

fn refusal(schema: &str, table: &str, problems: &[String]) -> Error {
    Error::Config(format!(
        "table {schema}.{table} cannot hold an oncely ledger: {}",
        problems.join("; ")
    ))
}

/// What is wrong with a table, or `None` if it does not exist: its columns
/// as schema `version` has them.
async fn check_table(
    conn: &mut PgConnection,
    schema: &str,
    table: &str,
    columns: &[Column],
    version: i32,
    unique_key: &[&str],
) -> Result<Option<Vec<String>>> {
    let rows = sqlx::query(sql::TABLE_COLUMNS)
        .bind(schema)
        .bind(table)
        .fetch_all(&mut *conn)
        .await
        .map_err(map)?;
    let Some(first) = rows.first() else {
        return Ok(None);
    };
    let mut problems = Vec::new();
    let relkind: String = first.try_get("relkind").map_err(map)?;
    if relkind != "r" && relkind != "p" {
        problems.push(format!("it is not a table (relkind {relkind:?})"));
        return Ok(Some(problems));
    }
    struct Found {
        name: String,
        ty: String,
        deterministic: bool,
        collation: String,
        not_null: bool,
        has_default: bool,
    }
    let mut found = Vec::new();
    for row in &rows {
        // A table without columns still has its row (LEFT JOIN), unnamed.
        let Some(name) = row.try_get::<Option<String>, _>("name").map_err(map)? else {
            continue;
        };
        found.push(Found {
            name,
            ty: row.try_get("data_type").map_err(map)?,
            deterministic: row.try_get("deterministic").map_err(map)?,
            collation: row.try_get("collation").map_err(map)?,
            not_null: row.try_get("not_null").map_err(map)?,
            has_default: row.try_get("has_default").map_err(map)?,
        });
    }
    for c in columns.iter().filter(|c| c.since <= version) {
        match found.iter().find(|f| f.name == c.name) {
            None if c.since > 1 => problems.push(format!(
                "column {} is missing (schema version {} adds it: run `oncely migrate`, PgLedger::migrate)",
                c.name, c.since
            )),
            None => problems.push(format!("column {} is missing", c.name)),
            Some(f) if !c.kind.accepts(&f.ty) => problems.push(format!(
                "column {} is {}, expected {}",
                c.name,
                f.ty,
                c.kind.expected()
            )),
            Some(f) if c.kind == Kind::Text && !f.deterministic => problems.push(format!(
                "column {} uses the nondeterministic collation {:?}: values that differ (in case, \
                 accents…) would compare equal, so two keys could share one record; use a deterministic \
                 collation such as \"C\"",
                c.name, f.collation
            )),
            Some(_) => {}
        }
    }
    for f in &found {
        if f.not_null && !f.has_default && !columns.iter().any(|c| c.name == f.name) {
            problems.push(format!(
                "column {} is NOT NULL without a default, and the ledger does not write it",
                f.name
            ));
        }
    }
    let keys = sqlx::query(sql::UNIQUE_KEYS)
        .bind(schema)
        .bind(table)
        .fetch_all(&mut *conn)
        .await
        .map_err(map)?;
    let mut exact = Vec::new();
    for row in &keys {
        let name: String = row.try_get("name").map_err(map)?;
        let cols: Vec<String> = row.try_get("columns").map_err(map)?;
        let deterministic: bool = row.try_get("deterministic").map_err(map)?;
        if cols.iter().map(String::as_str).eq(unique_key.iter().copied()) {
            exact.push((name, deterministic));
        }
    }
    let wanted = unique_key.join(", ");
    if exact.is_empty() {
        problems.push(format!(
            "no primary key or unique index on exactly ({wanted}) (one that is not deferrable, partial or \
             on an expression): without it two claims of one effect would both acquire"
        ));
    } else if !exact.iter().any(|(_, deterministic)| *deterministic) {
        let names: Vec<&str> = exact.iter().map(|(n, _)| n.as_str()).collect();
        problems.push(format!(
            "the unique index {} on ({wanted}) uses a nondeterministic collation: keys that differ in case \
             would share one record",
            names.join(", ")
        ));
    }
    Ok(Some(problems))
}

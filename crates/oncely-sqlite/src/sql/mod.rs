//! Every SQL statement of the backend: the ledger's, built once per ledger
//! for its table ([`Queries::new`], here), and the fixed ones that read
//! what a database is (its tables, indexes and settings). The function that
//! binds each ledger statement and what decodes its rows (every column read
//! by the name given here, never by position) sit together, one module per
//! concern: [`claim`], [`record`](mod@record) (`get`, `abandoned`),
//! [`write`](mod@write) (the fenced writes), [`prune`] (and the horizon),
//! [`admin`] (the operator's statements, whose listings are also built
//! there), [`outbox`] (the transactional outbox's table and statements).
//!
//! Timestamps are INTEGER microseconds since the Unix epoch taken from
//! SQLite's clock (`unixepoch('subsec')`, millisecond resolution, SQLite
//! 3.42+; the bundled library is newer). SQLite evaluates `'now'` once per
//! statement, after the statement has taken its locks (a writer that waited
//! for the write lock reads the clock when it gets it), so every timestamp a
//! statement writes is the same instant: the moment the write takes effect.

use std::sync::Arc;

use oncely::Error;
use sqlx::Sqlite;
use sqlx::query::Query;
use sqlx::sqlite::SqliteArguments;

mod admin;
mod claim;
mod outbox;
mod prune;
mod record;
mod write;

pub(crate) use admin::{bind_listing, kind_stats, records, stats};
pub(crate) use claim::{Found, found, lease};
pub(crate) use outbox::{OutboxQueries, enqueued, erase_messages, pending, stats as outbox_stats, ticket};
pub(crate) use record::record;
pub(crate) use write::{fence_param, renewed_until};

/// The database clock in microseconds.
const NOW_US: &str = "CAST(unixepoch('subsec') * 1000000 AS INTEGER)";

/// The default table name.
pub(crate) const DEFAULT_TABLE: &str = "oncely_effects";

/// The schema version this crate writes. Bump it with a new migration step.
/// 1: the ledger table. 2: the horizon table (what prune deleted). 3: the
/// transactional outbox (`<table>_outbox`).
pub(crate) const SCHEMA_VERSION: i64 = 3;

/// The columns every record-reading statement returns, followed by the
/// database clock (`now`). [`record()`] reads them by name.
const RECORD_COLUMNS: &str = "e.key, e.tenant, e.kind, e.subject, e.state, e.fence, e.fingerprint, e.outcome, \
     e.at_most_once, e.created_at, e.updated_at, e.lease_expires_at, e.retain_until";

/// The statements for one table.
#[derive(Debug)]
pub(crate) struct Queries {
    pub(crate) table: Arc<str>,
    /// The horizon table of this ledger table (`<table>_horizon`).
    pub(crate) horizon_table: Arc<str>,
    /// Tracks the schema version of each oncely table in the file, so two
    /// ledgers with different table names can share one database.
    pub(crate) create_version_table: Arc<str>,
    pub(crate) read_version: Arc<str>,
    pub(crate) write_version: Arc<str>,
    /// Migration steps; step `i` brings the schema to version `i + 1`.
    pub(crate) migrations: Vec<Arc<str>>,
    /// The claim; `claim_horizon` is the same with the horizon check, for
    /// claims that give `sent_at` (binds `?9`).
    pub(crate) claim: Arc<str>,
    pub(crate) claim_horizon: Arc<str>,
    pub(crate) claim_read: Arc<str>,
    /// The batch claim ([`claim_many_sql`]) and its follow-up read, one row
    /// per slot given (`slot`, then `claim_read`'s columns).
    pub(crate) claim_many: Arc<str>,
    pub(crate) claim_many_horizon: Arc<str>,
    pub(crate) claim_many_read: Arc<str>,
    /// Completes a batch of leases in one statement (see `Queries::new`).
    pub(crate) complete_many: Arc<str>,
    pub(crate) complete: Arc<str>,
    pub(crate) release: Arc<str>,
    pub(crate) renew: Arc<str>,
    pub(crate) get: Arc<str>,
    /// The clock, in microseconds.
    pub(crate) now: Arc<str>,
    /// One prune batch is two statements in one `BEGIN IMMEDIATE`
    /// transaction: delete up to `?1` prunable records (`prune`, returning
    /// what the horizon needs of each), then raise the horizon of each
    /// tenant and kind it deleted from (`prune_horizon`, once per group).
    pub(crate) prune_horizon: Arc<str>,
    pub(crate) prune: Arc<str>,
    pub(crate) horizon: Arc<str>,
    pub(crate) abandoned: Arc<str>,
    /// `Admin::forget`: completed at exactly this fence becomes released,
    /// without its outcome, kept for its retention from now (`?1` key, `?2`
    /// fence). The row stays, so the next claim's fence is `fence + 1` or
    /// more, whatever the clock does.
    pub(crate) forget: Arc<str>,
    /// `Admin::prunable`: how many records prune would delete now.
    pub(crate) prunable_count: Arc<str>,
    /// `Admin::erase` (`?1` tenant, `?2` subject), in one `BEGIN IMMEDIATE`
    /// transaction with [`Queries::erase_pending`]: the subject's completed
    /// and released records (`oncely::backend::erasable`) lose their outcome
    /// and fingerprint; their keys come back.
    pub(crate) erase: Arc<str>,
    /// The subject's records in progress, which the erasure leaves pending.
    pub(crate) erase_pending: Arc<str>,
    /// `Admin::replace_outcome` (`?1` key, `?2` fence, `?3` expected, `?4`
    /// new): one row changed, or none.
    pub(crate) replace_outcome: Arc<str>,
    /// The transactional outbox's statements (`<table>_outbox`).
    pub(crate) outbox: OutboxQueries,
}

/// Accepts table names that need no quoting anywhere: ASCII letters, digits
/// and `_`, not starting with a digit, at most 48 bytes (the horizon table
/// and the indexes add a suffix), and not SQLite's reserved `sqlite_` prefix.
pub(crate) fn check_table_name(name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !name.as_bytes()[0].is_ascii_digit()
        && !name.to_ascii_lowercase().starts_with("sqlite_");
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "table name {name:?}: use 1 to 48 ASCII letters, digits or '_', not starting with a digit or 'sqlite_'"
        )))
    }
}

/// The insert and the takeover are one statement: SQLite runs it under the
/// database write lock, and reads its clock (`'now'`, once per statement)
/// only after it holds that lock, so a claim that waited for another
/// writer's transaction is judged, and its lease measured, from the moment
/// it writes. There is no gap between the check and the claim.
///
/// The fence is the clock in microseconds on insert, and
/// `max(fence + 1, clock)` on takeover (`oncely::backend::next_fence`): a key
/// claimed again after its record was pruned gets a fence above every fence
/// it had, because the pruned record's fences were granted at least its
/// retention earlier. The clock has millisecond resolution; `+ 1` keeps two
/// grants in one millisecond apart.
///
/// The DO UPDATE's WHERE is the takeover rule: same (or no) fingerprint, and
/// released, or an expired lease of a step that is not at-most-once. When
/// neither the insert nor the takeover happens, nothing is written, no row
/// comes back and `claim_read` tells which answer applies.
///
/// `taken_over` tells the two writes apart without another read: an insert
/// writes `fence = created_at = updated_at` (all the statement's clock); a
/// takeover keeps the old `created_at`, and if that equals the clock (the
/// record was created in the same millisecond), its fence was at least that
/// clock, so the new fence is above it.
///
/// With `horizon`, the row comes from a SELECT whose WHERE is the horizon
/// check: an absent key whose message (`?9`, microseconds) was produced at or
/// before the newest record prune deleted for this tenant and kind is not
/// inserted (`oncely::backend::is_beyond_horizon`). The watermark is read in
/// the same statement, under the same lock, as the insert. (A WHERE also
/// keeps the parser from reading ON CONFLICT as a join constraint.) Without
/// it, plain VALUES: the common case pays for no subquery.
fn claim_sql(t: &str, h: &str, horizon: bool) -> Arc<str> {
    let source = if horizon {
        format!(
            "SELECT ?1, ?2, ?3, ?4, 'in_progress', max(c.now, 1), ?5, NULL,
                ?6, c.now, c.now, c.now + ?7, c.now + ?8, ?8
             FROM (SELECT {NOW_US} AS now) AS c
             WHERE NOT EXISTS (SELECT 1 FROM \"{h}\"
                               WHERE tenant = ?2 AND kind = ?3 AND pruned_through >= ?9)
                OR EXISTS (SELECT 1 FROM \"{t}\" WHERE key = ?1)"
        )
    } else {
        format!(
            "VALUES (?1, ?2, ?3, ?4, 'in_progress', max({NOW_US}, 1), ?5, NULL,
                ?6, {NOW_US}, {NOW_US}, {NOW_US} + ?7, {NOW_US} + ?8, ?8)"
        )
    };
    format!("INSERT INTO \"{t}\" ({INSERT_COLUMNS}) {source} {UPSERT}").into()
}

/// The columns a claim inserts, in the order its source gives them.
const INSERT_COLUMNS: &str = "key, tenant, kind, subject, state, fence, fingerprint, outcome, \
     at_most_once, created_at, updated_at, lease_expires_at, retain_until, retention_us";

/// What a claim does when the key exists: the takeover (see [`claim_sql`]),
/// or nothing. Returns the granted lease, and the key for a batch.
const UPSERT: &str = "ON CONFLICT(key) DO UPDATE SET
        state = 'in_progress',
        fence = max(fence + 1, excluded.fence),
        fingerprint = COALESCE(fingerprint, excluded.fingerprint),
        outcome = NULL,
        at_most_once = excluded.at_most_once,
        updated_at = excluded.updated_at,
        lease_expires_at = excluded.lease_expires_at,
        retain_until = excluded.retain_until,
        retention_us = excluded.retention_us
     WHERE (fingerprint IS NULL OR excluded.fingerprint IS NULL
            OR fingerprint = excluded.fingerprint)
       AND (state = 'released'
            OR (state = 'in_progress' AND at_most_once = 0
                AND lease_expires_at <= excluded.updated_at))
     RETURNING key, fence, created_at, updated_at, lease_expires_at,
        NOT (fence = updated_at AND created_at = updated_at) AS taken_over";

/// The keys of a batch: `?1` is a JSON array of `[key, tenant, kind,
/// subject]` (`batch::keys`), one element per slot; `slot` is the index. One
/// text parameter whatever the batch size, so one prepared statement serves
/// every batch, where a row of `?`s per key would compile a new statement
/// for each size (and SQLite binds no arrays).
const BATCH_KEYS: &str = "batch AS (SELECT j.key AS slot, j.value ->> 0 AS key,
        j.value ->> 1 AS tenant, j.value ->> 2 AS kind, j.value ->> 3 AS subject
     FROM json_each(?1) AS j)";

/// [`claim_sql`] for a batch of keys ([`BATCH_KEYS`]) in one statement:
/// the same insert, takeover rule, clock and horizon check per key, all
/// decided under one write lock and one clock reading. The other
/// parameters are the single claim's, shifted: `?2` fingerprint, `?3`
/// at_most_once, `?4` lease and `?5` retention (µs), `?6` sent_at.
///
/// Rows are inserted in slot order, so of a key listed twice the first
/// slot inserts (or takes over) and the second meets a live lease, which
/// the takeover rule leaves alone: the second slot finds it in progress,
/// as a concurrent duplicate would. SQLite computes the whole SELECT before
/// it inserts when the SELECT reads the target table (the horizon variant),
/// and row by row otherwise; either way each row's conflict is judged
/// against the rows inserted before it. `RETURNING` comes back in no
/// particular order, hence the key in it.
fn claim_many_sql(t: &str, h: &str, horizon: bool) -> Arc<str> {
    let filter = if horizon {
        format!(
            "NOT EXISTS (SELECT 1 FROM \"{h}\"
                         WHERE tenant = batch.tenant AND kind = batch.kind AND pruned_through >= ?6)
             OR EXISTS (SELECT 1 FROM \"{t}\" WHERE key = batch.key)"
        )
    } else {
        // A WHERE keeps the parser from reading ON CONFLICT as a join
        // constraint.
        "true".to_owned()
    };
    format!(
        "WITH {BATCH_KEYS}
         INSERT INTO \"{t}\" ({INSERT_COLUMNS})
         SELECT batch.key, batch.tenant, batch.kind, batch.subject, 'in_progress', max(c.now, 1), ?2,
            NULL, ?3, c.now, c.now, c.now + ?4, c.now + ?5, ?5
         FROM (SELECT {NOW_US} AS now) AS c, batch
         WHERE {filter}
         ORDER BY batch.slot
         {UPSERT}"
    )
    .into()
}

/// The ledger table as this crate creates it (schema version 1).
fn ledger_table_sql(t: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS \"{t}\" (
            key              TEXT PRIMARY KEY NOT NULL,
            tenant           TEXT NOT NULL,
            kind             TEXT NOT NULL,
            subject          TEXT NOT NULL,
            state            TEXT NOT NULL
                             CHECK (state IN ('in_progress', 'completed', 'released')),
            fence            INTEGER NOT NULL CHECK (fence >= 1),
            fingerprint      BLOB CHECK (fingerprint IS NULL OR length(fingerprint) = 32),
            outcome          BLOB,
            at_most_once     INTEGER NOT NULL CHECK (at_most_once IN (0, 1)),
            created_at       INTEGER NOT NULL,
            updated_at       INTEGER NOT NULL,
            lease_expires_at INTEGER,
            retain_until     INTEGER NOT NULL,
            retention_us     INTEGER NOT NULL
        );
        CREATE INDEX IF NOT EXISTS \"{t}_prune\" ON \"{t}\" (state, retain_until);
        CREATE INDEX IF NOT EXISTS \"{t}_abandoned\"
            ON \"{t}\" (tenant, at_most_once, state, lease_expires_at);"
    )
}

/// The horizon table (schema version 2): per tenant and kind, the newest
/// `created_at` among the records prune deleted. Rows only ever grow.
fn horizon_table_sql(h: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS \"{h}\" (
            tenant         TEXT NOT NULL,
            kind           TEXT NOT NULL,
            pruned_through INTEGER NOT NULL,
            PRIMARY KEY (tenant, kind)
        );"
    )
}

/// The records prune may delete: completed or released, past retention at
/// `?2`, at most `?1` of them. No `ORDER BY`: the `(state, retain_until)`
/// index serves the search as two range scans that stop after `?1` rows,
/// so a batch costs the same whether ten or ten million records are due
/// (an order on anything but the index would read every due record, then
/// sort them, in every batch).
fn prunable(t: &str) -> String {
    format!(
        "SELECT key FROM \"{t}\"
         WHERE state IN ('completed', 'released') AND retain_until <= ?2
         LIMIT ?1"
    )
}

/// A statement with its binds, ready to run on a connection.
pub(crate) type Bound = Query<'static, Sqlite, SqliteArguments>;

impl Queries {
    pub(crate) fn new(table: &str) -> Result<Self, Error> {
        check_table_name(table)?;
        let t = table;
        let h = format!("{t}_horizon");
        let s = |sql: String| -> Arc<str> { sql.into() };
        Ok(Queries {
            table: t.into(),
            create_version_table: s("CREATE TABLE IF NOT EXISTS oncely_schema (\
                 table_name TEXT PRIMARY KEY NOT NULL, \
                 version INTEGER NOT NULL)"
                .to_owned()),
            read_version: s("SELECT version FROM oncely_schema WHERE table_name = ?1".to_owned()),
            write_version: s("INSERT INTO oncely_schema (table_name, version) VALUES (?1, ?2) \
                 ON CONFLICT(table_name) DO UPDATE SET version = excluded.version"
                .to_owned()),
            migrations: vec![
                s(ledger_table_sql(t)),
                s(horizon_table_sql(&h)),
                s(outbox::migration(t)),
            ],
            outbox: OutboxQueries::new(t),
            claim: claim_sql(t, &h, false),
            claim_horizon: claim_sql(t, &h, true),
            // The clock and the horizon come back even when the key is absent.
            claim_read: s(format!(
                "SELECT {RECORD_COLUMNS}, c.now,
                    (SELECT pruned_through FROM \"{h}\" WHERE tenant = ?2 AND kind = ?3) AS watermark
                 FROM (SELECT {NOW_US} AS now) AS c
                 LEFT JOIN \"{t}\" AS e ON e.key = ?1"
            )),
            claim_many: claim_many_sql(t, &h, false),
            claim_many_horizon: claim_many_sql(t, &h, true),
            claim_many_read: s(format!(
                "WITH {BATCH_KEYS}
                 SELECT batch.slot, {RECORD_COLUMNS}, c.now,
                    (SELECT pruned_through FROM \"{h}\"
                     WHERE tenant = batch.tenant AND kind = batch.kind) AS watermark
                 FROM (SELECT {NOW_US} AS now) AS c
                 CROSS JOIN batch
                 LEFT JOIN \"{t}\" AS e ON e.key = batch.key"
            )),
            // `complete` for many leases: `?1` is a JSON array of `[key,
            // fence, start, length]` (`batch::completions`), and each
            // outcome is the bytes `start..start + length` (1-based) of the
            // one BLOB `?2` holding them all, so outcomes travel as bound
            // bytes, not re-encoded as JSON text, in one statement of one
            // shape. A (key, fence) pair appears once (the caller answers
            // repeats), so no row has two candidate updates. `+state` keeps
            // the planner off the (state, retain_until) index, which would
            // visit every lease in progress for each item: it looks each
            // item up by key instead (a test checks the plans).
            complete_many: s(format!(
                "WITH done AS (SELECT j.value ->> 0 AS k, j.value ->> 1 AS f,
                    j.value ->> 2 AS start, j.value ->> 3 AS len FROM json_each(?1) AS j)
                 UPDATE \"{t}\" SET state = 'completed', outcome = substr(?2, done.start, done.len),
                    lease_expires_at = NULL, updated_at = {NOW_US},
                    retain_until = {NOW_US} + retention_us
                 FROM done
                 WHERE \"{t}\".key = done.k AND \"{t}\".fence = done.f AND +state = 'in_progress'
                 RETURNING key, fence"
            )),
            complete: s(format!(
                "UPDATE \"{t}\" SET state = 'completed', outcome = ?3, lease_expires_at = NULL,
                    updated_at = {NOW_US}, retain_until = {NOW_US} + retention_us
                 WHERE key = ?1 AND fence = ?2 AND state = 'in_progress'"
            )),
            release: s(format!(
                "UPDATE \"{t}\" SET state = 'released', lease_expires_at = NULL,
                    updated_at = {NOW_US}, retain_until = {NOW_US} + retention_us
                 WHERE key = ?1 AND fence = ?2 AND state = 'in_progress'"
            )),
            renew: s(format!(
                "UPDATE \"{t}\" SET lease_expires_at = {NOW_US} + ?3
                 WHERE key = ?1 AND fence = ?2 AND state = 'in_progress'
                 RETURNING lease_expires_at"
            )),
            get: s(format!(
                "SELECT {RECORD_COLUMNS}, {NOW_US} AS now FROM \"{t}\" AS e WHERE e.key = ?1"
            )),
            now: s(format!("SELECT {NOW_US}")),
            // Raises one tenant and kind's watermark to the newest
            // created_at a batch deleted there; a watermark never moves back.
            prune_horizon: s(format!(
                "INSERT INTO \"{h}\" (tenant, kind, pruned_through) VALUES (?1, ?2, ?3)
                 ON CONFLICT(tenant, kind) DO UPDATE
                    SET pruned_through = max(pruned_through, excluded.pruned_through)"
            )),
            // LIMIT on a DELETE needs a compile-time option; the subquery does
            // the same with the (state, retain_until) index. RETURNING names
            // exactly the records deleted, so the horizon is raised over them
            // and no others. (The subquery selects by key, not rowid, so a
            // user's WITHOUT ROWID table works too.)
            prune: s(format!(
                "DELETE FROM \"{t}\" WHERE key IN ({prunable})
                 RETURNING tenant, kind, created_at",
                prunable = prunable(t)
            )),
            horizon: s(format!(
                "SELECT pruned_through FROM \"{h}\" WHERE tenant = ?1 AND kind = ?2"
            )),
            horizon_table: h.into(),
            // Abandoned = an at-most-once lease that ran out; nothing stores
            // that state, the clock decides it at read time.
            abandoned: s(format!(
                "SELECT {RECORD_COLUMNS}, c.now
                 FROM (SELECT {NOW_US} AS now) AS c
                 JOIN \"{t}\" AS e
                   ON e.tenant = ?1 AND e.at_most_once = 1 AND e.state = 'in_progress'
                  AND e.lease_expires_at <= c.now
                 ORDER BY e.created_at, e.key
                 LIMIT ?2"
            )),
            forget: s(format!(
                "UPDATE \"{t}\" SET state = 'released', outcome = NULL, lease_expires_at = NULL,
                    updated_at = {NOW_US}, retain_until = {NOW_US} + retention_us
                 WHERE key = ?1 AND fence = ?2 AND state = 'completed'"
            )),
            prunable_count: s(format!(
                "SELECT count(*) FROM \"{t}\"
                 WHERE state IN ('completed', 'released') AND retain_until <= {NOW_US}"
            )),
            // Key, state, fence, created_at and retention stay: a completed
            // record without its outcome answers every claim with
            // `Error::Erased`, and is never taken over.
            erase: s(format!(
                "UPDATE \"{t}\" SET outcome = NULL, fingerprint = NULL
                 WHERE tenant = ?1 AND subject = ?2 AND state IN ('completed', 'released')
                 RETURNING key"
            )),
            erase_pending: s(format!(
                "SELECT key FROM \"{t}\" WHERE tenant = ?1 AND subject = ?2 AND state = 'in_progress'"
            )),
            replace_outcome: s(format!(
                "UPDATE \"{t}\" SET outcome = ?4
                 WHERE key = ?1 AND fence = ?2 AND state = 'completed' AND outcome = ?3"
            )),
        })
    }
}

// What a database is: read on connect, by `durability::Probe` and the
// schema check. Every column is read by name.

/// The main database's file (empty: memory or temporary), as `file`.
pub(crate) const DATABASE_FILE: &str = "SELECT file FROM pragma_database_list WHERE name = 'main'";
/// The journal mode, as `journal_mode`.
pub(crate) const JOURNAL_MODE: &str = "PRAGMA journal_mode";
/// `PRAGMA synchronous` (0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA), as `synchronous`.
pub(crate) const SYNCHRONOUS: &str = "PRAGMA synchronous";

/// Whether an object named `?1` (any case: SQLite's names are
/// case-insensitive) exists in the main schema, and what it is (`type`:
/// `table`, `view`, …).
pub(crate) const OBJECT_TYPE: &str =
    "SELECT type FROM pragma_table_list WHERE schema = 'main' AND name = ?1 COLLATE NOCASE";
/// The columns of table `?1` with their declared types (`name`, `type`).
pub(crate) const TABLE_COLUMNS: &str = "SELECT name, type FROM pragma_table_info(?1)";
/// The indexes of table `?1` (`name`, `unique`, `partial`).
pub(crate) const TABLE_INDEXES: &str = "SELECT name, \"unique\", partial FROM pragma_index_list(?1)";
/// The key parts of index `?1` (`name`, null for an expression; `coll`).
pub(crate) const INDEX_KEY_PARTS: &str = "SELECT name, coll FROM pragma_index_xinfo(?1) WHERE key = 1";

/// How many of `'a'`, `'A'` and `'a '` the collation of `table.col` tells
/// apart, as `distinct_values` (3 for BINARY only).
///
/// The column's declared collation is not in any PRAGMA; a compound SELECT
/// deduplicates with the collation of its leftmost column that has one, so
/// three values distinct under BINARY (and only BINARY among SQLite's
/// collations: NOCASE folds case, RTRIM trailing spaces) tell it apart. No
/// row of the table is read. (`table` and `col` are checked identifiers.)
pub(crate) fn distinct_under_collation(table: &str, col: &str) -> String {
    format!(
        "SELECT count(*) AS distinct_values FROM (SELECT \"{col}\" FROM \"{table}\" WHERE 0
            UNION SELECT 'a' UNION SELECT 'A' UNION SELECT 'a ')"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::{AssertSqlSafe, Connection, Row, SqliteConnection};

    /// The batch statements read the batch from a JSON table function whose
    /// size the planner cannot know; each must still look the ledger's rows
    /// up by key, never walk an index of all leases (or the table) per item.
    #[tokio::test]
    async fn batch_statements_look_keys_up_by_key() {
        let q = Queries::new("ledger").unwrap();
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        for step in &q.migrations {
            sqlx::raw_sql(AssertSqlSafe(step.clone()))
                .execute(&mut conn)
                .await
                .unwrap();
        }
        // (The plain batch claim reads no ledger row in its SELECT: its
        // conflicts are found by the insert itself, through the key.)
        for (name, sql, reads) in [
            ("claim_many", &q.claim_many, false),
            ("claim_many_horizon", &q.claim_many_horizon, true),
            ("claim_many_read", &q.claim_many_read, true),
            ("complete_many", &q.complete_many, true),
        ] {
            let plan: Vec<String> = sqlx::query(AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
                .fetch_all(&mut conn)
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<String, _>("detail"))
                .collect();
            for step in &plan {
                let scans_ledger = step.starts_with("SCAN ")
                    && !["SCAN j", "SCAN c", "SCAN CONSTANT ROW"]
                        .iter()
                        .any(|ok| step.starts_with(ok));
                assert!(
                    !scans_ledger && !step.contains("ledger_prune") && !step.contains("ledger_abandoned"),
                    "{name}: {plan:#?}"
                );
            }
            assert!(
                !reads
                    || plan
                        .iter()
                        .any(|s| s.contains("sqlite_autoindex_ledger_1 (key=?)")),
                "{name}: {plan:#?}"
            );
        }
    }

    /// A prune batch finds its records through the (state, retain_until)
    /// index and stops after its limit: no scan of the table, no sort of
    /// every due record.
    #[tokio::test]
    async fn prune_batch_searches_the_expiry_index() {
        let q = Queries::new("ledger").unwrap();
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        for step in &q.migrations {
            sqlx::raw_sql(AssertSqlSafe(step.clone()))
                .execute(&mut conn)
                .await
                .unwrap();
        }
        let plan: Vec<String> = sqlx::query(AssertSqlSafe(format!("EXPLAIN QUERY PLAN {}", q.prune)))
            .fetch_all(&mut conn)
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<String, _>("detail"))
            .collect();
        assert!(
            plan.iter()
                .any(|s| s.contains("ledger_prune (state=? AND retain_until<?)")),
            "{plan:#?}"
        );
        assert!(
            !plan
                .iter()
                .any(|s| s.contains("TEMP B-TREE") || s.starts_with("SCAN ledger")),
            "{plan:#?}"
        );
    }

    #[test]
    fn table_names() {
        for ok in ["oncely_effects", "a", "_x9", "Effects2"] {
            assert!(check_table_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "9a",
            "a-b",
            "a b",
            "a\"b",
            "sqlite_x",
            "SQLITE_master",
            &"x".repeat(49),
        ] {
            assert!(matches!(check_table_name(bad), Err(Error::Config(_))), "{bad}");
        }
    }
}

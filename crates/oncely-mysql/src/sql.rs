//! Every SQL statement of the backend, built once per table name.
//!
//! Timestamps are BIGINT microseconds since the Unix epoch, read from the
//! server's clock. Two clocks are used, on purpose:
//!
//! - [`STMT_US`]: `UTC_TIMESTAMP(6)`, the time the *statement started*. It is
//!   constant within a statement, so a fresh row's `fence`, `created_us` and
//!   `updated_us` are one value (which is how a claim tells its own insert
//!   from a takeover: `fence = created_us` only on the insert). An inserted
//!   row's values are computed before the insert waits on a lock (another
//!   transaction's uncommitted row of the same key), so this is also all an
//!   insert can know: the claim compares it with [`NOW_US`] read after the
//!   write and refreshes the grant if the statement waited (`claim.rs`).
//! - [`NOW_US`]: the clock *when it is evaluated*. An `ON DUPLICATE KEY
//!   UPDATE` (a takeover), an `UPDATE` and a `RETURNING` clause are evaluated
//!   after any lock wait, so expiry, takeover and fences are judged on the
//!   clock at the moment the write takes effect (`docs/design.md`, "The rules every backend keeps").
//!
//! `SYSDATE(6)` is the only call-time clock MySQL and MariaDB have, and it is
//! in the session's time zone, which the ledger does not own (`claim_in` runs
//! on the caller's connection, `from_pool` on the caller's pool). So
//! [`NOW_US`] never converts a local time to UTC: it is the statement's UTC
//! start plus the time elapsed since, and the elapsed time is measured twice,
//! as a difference of local wall-clock times (wrong only if the zone's offset
//! changed during the statement) and as a difference of
//! `UNIX_TIMESTAMP()`s (which follows the zone's rules, but is ambiguous in
//! the repeated hour when clocks go back), taking the smaller, never below
//! zero. A DST change during a statement can therefore only make the clock
//! read *early* (a lease looks live a little longer, a grant a little
//! shorter; the runner measures its own deadline from when it sent the
//! claim, so that stays safe), never late (which would take over a live
//! lease). With the session in UTC or a fixed offset, both are exact.
//! A server started with `--sysdate-is-now` makes `SYSDATE()` the statement
//! start again; the ledger refuses such a server at its first operation.

use std::collections::BTreeMap;

use oncely::admin::{Filter, RecordQuery};
use oncely::backend::{FilterSql, duration_micros, effective_state, filter_where, from_micros, scope_where};
use oncely::backend::{Fingerprint, Lease, Outcome, Record, RecordState};
use oncely::{ClaimOptions, EffectKey, Result, Tenant};
use sqlx::mysql::{MySqlArguments, MySqlRow};
use sqlx::query::{Query, QueryScalar};
use sqlx::{AssertSqlSafe, MySql, Row};

use crate::error::corrupt;

/// The statement's start, UTC, in µs since the epoch; independent of the
/// session time zone and constant within one statement.
pub(crate) const STMT_US: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

/// The server's clock when this expression is evaluated (after any lock
/// wait of the statement), UTC µs; see the module docs for why it is built
/// this way.
pub(crate) const NOW_US: &str = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) \
     + GREATEST(0, LEAST(TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6)), \
     COALESCE(CAST((UNIX_TIMESTAMP(SYSDATE(6)) - UNIX_TIMESTAMP(NOW(6))) * 1000000 AS SIGNED), \
     9223372036854775807))))";

/// How many µs `SYSDATE(6)` runs ahead of the statement start after a 2 ms
/// sleep: about 2000, or 0 on a server started with `--sysdate-is-now`.
pub(crate) const SYSDATE_PROBE: &str =
    "SELECT TIMESTAMPDIFF(MICROSECOND, NOW(6), IF(SLEEP(0.002) = 0, SYSDATE(6), NULL)) AS d";

/// Run on every connection `MySqlLedger::connect` opens: strict mode, so an
/// over-long or invalid value is an error, never a silent clip or a default.
pub(crate) const STRICT_SESSION: &str =
    "SET SESSION sql_mode = CONCAT(@@SESSION.sql_mode, ',STRICT_ALL_TABLES')";

/// Run on every connection of a read-only ledger: the server refuses writes
/// too, not only the ledger.
pub(crate) const READ_ONLY_SESSION: &str = "SET SESSION TRANSACTION READ ONLY";

/// What the server is, asked once (`server::probe`).
pub(crate) const SERVER: &str = "SELECT VERSION() AS v, @@max_allowed_packet AS p";

/// Whether the session commits each statement (`server::probe`).
pub(crate) const AUTOCOMMIT: &str = "SELECT @@autocommit";

/// MariaDB's `@@in_transaction`; MySQL 8 has no such variable and answers
/// with error 1193 (`server::probe`).
pub(crate) const IN_TRANSACTION: &str = "SELECT @@in_transaction";

/// The leaked-transaction guard's check of a pooled connection
/// (`guard::heal_if_leaked`).
pub(crate) const LEAK_CHECK: &str = "SELECT @@in_transaction AS open, @@autocommit AS autocommit";

/// Ends a transaction someone else left open on a pooled connection.
pub(crate) const ROLLBACK: &str = "ROLLBACK";

/// The connection's database (`schema::verify` reads tables in it).
pub(crate) const DATABASE: &str = "SELECT CAST(DATABASE() AS CHAR)";

/// Serialises migrations of one table across processes: a session lock,
/// waited for up to 60 s. Parameter: the lock's name.
pub(crate) const MIGRATION_LOCK: &str = "SELECT GET_LOCK(?, 60)";

/// Releases [`MIGRATION_LOCK`]. Parameter: the lock's name.
pub(crate) const MIGRATION_UNLOCK: &str = "SELECT RELEASE_LOCK(?)";

/// [`MIGRATION_LOCK`] of `lock`: 1 when taken, 0 on timeout, NULL on error.
pub(crate) fn bind_migration_lock(lock: &str) -> BoundScalar<Option<i64>> {
    sqlx::query_scalar(MIGRATION_LOCK).bind(lock.to_owned())
}

/// [`MIGRATION_UNLOCK`] of `lock` (its row is not read).
pub(crate) fn bind_migration_unlock(lock: &str) -> Bound {
    sqlx::query(MIGRATION_UNLOCK).bind(lock.to_owned())
}

/// Makes a read on a Galera node causal: before it reads, the node applies
/// every write set the cluster committed before the read began, so it sees
/// every write acknowledged on any node by then (a node applies other
/// nodes' write sets asynchronously, a few milliseconds behind their
/// commit). MariaDB's per-statement form, so no session state is left
/// behind on a caller's connection.
pub(crate) const CAUSAL: &str = "SET STATEMENT wsrep_sync_wait = 1 FOR ";

/// Whether the server is a Galera node (`wsrep_on`); MySQL without wsrep
/// has no such variable (error 1193) (`server::probe`).
pub(crate) const WSREP_ON: &str = "SELECT CAST(@@wsrep_on AS SIGNED)";

/// Whether a Galera node serves (`ON`), in the text protocol: a node
/// outside the primary component still answers `SHOW` (`guard::cut_off`).
pub(crate) const WSREP_READY: &str = "SHOW STATUS LIKE 'wsrep_ready'";

/// What every new connection of a ledger's pool checks (`hosts.rs`), in
/// one round trip of the text protocol (a Galera node outside the primary
/// component still answers `SHOW`): rows of (name, value). Variables a
/// server does not have are simply absent (`super_read_only` on MariaDB,
/// `wsrep_*` on MySQL).
pub(crate) const SESSION_CHECK: &str = "SHOW GLOBAL VARIABLES WHERE Variable_name IN \
     ('read_only', 'super_read_only', 'innodb_read_only', 'wsrep_on'); \
     SHOW GLOBAL STATUS WHERE Variable_name IN \
     ('wsrep_ready', 'wsrep_cluster_status', 'wsrep_local_state_comment')";

/// The schema versions applied to a table. Parameter: the table's name.
pub(crate) const APPLIED_VERSIONS: &str = "SELECT version FROM oncely_schema_migrations WHERE table_name = ?";

/// Records a version as applied (idempotent: another migrator may have
/// recorded it). Parameters: the table's name, the version.
pub(crate) const RECORD_VERSION: &str = "INSERT INTO oncely_schema_migrations (table_name, version, applied_at) \
     VALUES (?, ?, UTC_TIMESTAMP(6)) ON DUPLICATE KEY UPDATE version = version";

/// [`APPLIED_VERSIONS`] of `table`: one version per row.
pub(crate) fn bind_applied_versions(table: &str) -> BoundScalar<u32> {
    sqlx::query_scalar(APPLIED_VERSIONS).bind(table.to_owned())
}

/// [`RECORD_VERSION`]: `version` of `table` applied. No rows.
pub(crate) fn bind_record_version(table: &str, version: u32) -> Bound {
    sqlx::query(RECORD_VERSION).bind(table.to_owned()).bind(version)
}

/// The columns every read of a record returns ([`stored`] reads them by
/// name).
const COLUMNS: &str = "effect_key, state, fence, fingerprint, outcome, at_most_once, claim_token, \
                       created_us, updated_us, lease_expires_us, retain_until_us";

/// The name of a ledger table's horizon table.
pub(crate) fn horizon_table(t: &str) -> String {
    format!("{t}_horizon")
}

/// The schema versions, applied in order under `GET_LOCK`. Each statement is
/// idempotent on its own (`IF NOT EXISTS`), because MySQL DDL commits
/// implicitly and a migrator can die between a DDL and its bookkeeping row.
/// What a table must look like is checked separately (`schema::verify`),
/// because `IF NOT EXISTS` accepts any table of that name.
pub(crate) fn migrations(t: &str) -> Vec<(u32, Vec<String>)> {
    let h = horizon_table(t);
    vec![
        (
            1,
            vec![format!(
                "CREATE TABLE IF NOT EXISTS `{t}` (
  effect_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  tenant VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  kind VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  subject VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  state ENUM('in_progress', 'completed', 'released') NOT NULL,
  fence BIGINT UNSIGNED NOT NULL,
  fingerprint BINARY(32) NULL,
  outcome MEDIUMBLOB NULL,
  at_most_once BOOLEAN NOT NULL,
  claim_token BINARY(16) NOT NULL,
  created_us BIGINT NOT NULL,
  updated_us BIGINT NOT NULL,
  lease_expires_us BIGINT NULL,
  retention_us BIGINT NOT NULL,
  retain_until_us BIGINT NOT NULL,
  PRIMARY KEY (effect_key),
  KEY prune_idx (state, retain_until_us),
  KEY abandoned_idx (tenant, at_most_once, state, created_us)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
            )],
        ),
        // Version 2: the horizon, one watermark per tenant and kind (the
        // newest `created_us` prune deleted there). NULL: a prune locked the
        // row but deleted nothing of that tenant and kind. Rows of version 1
        // need no change: their small fences are below every clock fence.
        (
            2,
            vec![format!(
                "CREATE TABLE IF NOT EXISTS `{h}` (
  tenant VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  kind VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  watermark_us BIGINT NULL,
  PRIMARY KEY (tenant, kind)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
            )],
        ),
    ]
}

/// The migration bookkeeping table, shared by every ledger table of a schema.
pub(crate) const MIGRATIONS_TABLE: &str = "CREATE TABLE IF NOT EXISTS oncely_schema_migrations (
  table_name VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  version INT UNSIGNED NOT NULL,
  applied_at DATETIME(6) NOT NULL,
  PRIMARY KEY (table_name, version)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4";

/// `information_schema` reads for `schema::verify`, by table name, in the
/// connection's database. Every value is cast to a plain type: MySQL 8 and
/// MariaDB declare these columns differently (binary strings, unsigned or
/// signed integers).
pub(crate) const IS_TABLE: &str = "SELECT CAST(TABLE_TYPE AS CHAR) AS kind, CAST(ENGINE AS CHAR) AS engine \
     FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?";
pub(crate) const IS_TABLE_COUNT: &str =
    "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?";
pub(crate) const IS_COLUMNS: &str = "SELECT CAST(COLUMN_NAME AS CHAR) AS name, CAST(DATA_TYPE AS CHAR) AS data_type, \
     CAST(COLUMN_TYPE AS CHAR) AS column_type, CAST(IS_NULLABLE AS CHAR) AS nullable, \
     CAST(CHARACTER_MAXIMUM_LENGTH AS SIGNED) AS max_len, \
     CAST(CHARACTER_SET_NAME AS CHAR) AS charset, CAST(COLLATION_NAME AS CHAR) AS collation \
     FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?";
/// One row per index column, in index order; `COLUMN_NAME` is NULL for an
/// expression part (MySQL 8 functional indexes), `SUB_PART` set for a prefix.
pub(crate) const IS_INDEXES: &str = "SELECT CAST(INDEX_NAME AS CHAR) AS idx, CAST(NON_UNIQUE AS SIGNED) AS non_unique, \
     CAST(COLUMN_NAME AS CHAR) AS col, CAST(SUB_PART AS SIGNED) AS sub_part \
     FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? \
     ORDER BY INDEX_NAME, SEQ_IN_INDEX";

/// [`IS_TABLE`] of `table`: one row (`kind`, `engine`), or none.
pub(crate) fn bind_is_table(table: &str) -> Bound {
    sqlx::query(IS_TABLE).bind(table.to_owned())
}

/// [`IS_TABLE_COUNT`] of `table`: one count.
pub(crate) fn bind_is_table_count(table: &str) -> BoundScalar<i64> {
    sqlx::query_scalar(IS_TABLE_COUNT).bind(table.to_owned())
}

/// [`IS_COLUMNS`] of `table`: one row per column (`name`, `data_type`,
/// `column_type`, `nullable`, `max_len`, `charset`, `collation`), read
/// by `schema::verify`.
pub(crate) fn bind_is_columns(table: &str) -> Bound {
    sqlx::query(IS_COLUMNS).bind(table.to_owned())
}

/// [`IS_INDEXES`] of `table`: one row per index column (`idx`,
/// `non_unique`, `col`, `sub_part`), read by `schema::verify`.
pub(crate) fn bind_is_indexes(table: &str) -> Bound {
    sqlx::query(IS_INDEXES).bind(table.to_owned())
}

// The operator's statements (`oncely::admin::Admin`): built per query,
// because which filters apply decides which index serves it.

/// A value bound to an admin statement, in the order of its `?`s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Arg {
    Text(String),
    Int(i64),
}

/// One clock reading for the whole statement, `c.now_us`: [`NOW_US`] reads
/// `SYSDATE(6)`, evaluated per call; a derived table with `LIMIT` is
/// materialized (never merged into the outer query), so it is read once.
fn clock() -> String {
    format!("(SELECT {NOW_US} AS now_us LIMIT 1) AS c")
}

/// What a record is, as an operator sees it, at `c.now_us`
/// ([`filter_where`]).
fn filter_sql(filter: Filter) -> String {
    filter_where(
        filter,
        &FilterSql {
            at_most_once: "e.at_most_once = 1",
            not_at_most_once: "e.at_most_once = 0",
            ended: "e.lease_expires_us <= c.now_us",
            running: "e.lease_expires_us > c.now_us",
            truth: "TRUE",
        },
    )
}

/// Tenant, kind and subject ([`scope_where`]): a range of the primary key
/// (`utf8mb4_bin` compares code points, which is byte order), or the key
/// itself when all three are given; the columns are compared too, which
/// keeps the range exact.
fn scope_sql(
    tenant: Option<&Tenant>,
    kind: Option<&str>,
    subject: Option<&str>,
    args: &mut Vec<Arg>,
) -> String {
    let columns = ["e.effect_key", "e.tenant", "e.kind", "e.subject"];
    scope_where(tenant, kind, subject, true, columns, "TRUE", |v| {
        args.push(Arg::Text(v));
        "?".to_owned()
    })
}

/// `Admin::records`: oldest first (`created_us`, then the key), after the
/// cursor, at most a page, each with the statement's clock (`now_us`).
pub(crate) fn records(t: &str, q: &RecordQuery) -> Result<(String, Vec<Arg>), oncely::Error> {
    let mut args = Vec::new();
    let mut w = vec![scope_sql(
        q.tenant.as_ref(),
        q.kind.as_deref(),
        q.subject.as_deref(),
        &mut args,
    )];
    if let Some(since) = q.since {
        w.push("e.created_us >= ?".to_owned());
        args.push(Arg::Int(oncely::backend::to_micros(since)?));
    }
    if let Some(c) = &q.after {
        let at = oncely::backend::to_micros(c.created_at)?;
        w.push("(e.created_us > ? OR (e.created_us = ? AND e.effect_key > ?))".to_owned());
        args.extend([Arg::Int(at), Arg::Int(at), Arg::Text(c.key.as_str().to_owned())]);
    }
    w.push(filter_sql(q.filter));
    args.push(Arg::Int(i64::from(q.page_size())));
    let cols: Vec<String> = COLUMNS.split(',').map(|c| format!("e.{}", c.trim())).collect();
    Ok((
        format!(
            "SELECT {}, c.now_us AS now_us FROM {} JOIN `{t}` AS e ON {} \
             ORDER BY e.created_us, e.effect_key LIMIT ?",
            cols.join(", "),
            clock(),
            w.join(" AND ")
        ),
        args,
    ))
}

/// `Admin::stats`: per tenant and kind, the records in each class and the
/// oldest `created_us` of the open ones, at one clock reading. (`COUNT`,
/// not `SUM`: `SUM` of a condition is a DECIMAL.)
pub(crate) fn stats(t: &str, tenant: Option<&Tenant>) -> (String, Vec<Arg>) {
    let mut args = Vec::new();
    let scope = scope_sql(tenant, None, None, &mut args);
    let live = filter_sql(Filter::Live);
    let stuck = filter_sql(Filter::Stuck);
    let abandoned = filter_sql(Filter::Abandoned);
    (
        format!(
            "SELECT e.tenant AS tenant, e.kind AS kind, MIN(c.now_us) AS now_us, \
               COUNT(CASE WHEN {live} THEN 1 END) AS live, COUNT(CASE WHEN {stuck} THEN 1 END) AS stuck, \
               COUNT(CASE WHEN {abandoned} THEN 1 END) AS abandoned, \
               COUNT(CASE WHEN e.state = 'completed' THEN 1 END) AS completed, \
               COUNT(CASE WHEN e.state = 'released' THEN 1 END) AS released, \
               MIN(CASE WHEN {live} THEN e.created_us END) AS oldest_live, \
               MIN(CASE WHEN {stuck} THEN e.created_us END) AS oldest_stuck, \
               MIN(CASE WHEN {abandoned} THEN e.created_us END) AS oldest_abandoned \
             FROM {clock} JOIN `{t}` AS e ON {scope} \
             GROUP BY e.tenant, e.kind ORDER BY e.tenant, e.kind",
            clock = clock(),
        ),
        args,
    )
}

/// The statements of one ledger table.
///
/// A claim on the pool first reads the key ([`Statements::peek`], a plain
/// read: no lock, no write); only when that read leaves a write to do (the
/// key is absent, or released, or its lease ended) does it run the claim
/// statement, which decides again on its own.
///
/// The claim statement comes in variants: with `RETURNING` (MariaDB 10.5+)
/// or without (MySQL 8: the statement, then [`Statements::read_back`]); and
/// for claims with `sent_at`, a `_pre` form that inserts only if the message
/// is after the horizon, and a `_h` form that also returns the horizon read
/// after the write (see `claim.rs` for how the two together decide
/// `BeyondHorizon`). Batches use the same statements with one `VALUES` row
/// per key ([`Statements::claim_many`]).
#[derive(Debug)]
pub(crate) struct Statements {
    /// What every read of the ledger's tables starts with: [`CAUSAL`] on a
    /// MariaDB Galera node, else nothing.
    pub read: &'static str,
    /// The key's row as committed, with the clock: a consistent read, which
    /// InnoDB answers without a lock and without a transaction id, so a
    /// duplicate of a completed or live effect writes nothing. Parameter:
    /// key.
    pub peek: String,
    /// Parameters: key, tenant, kind, subject, fingerprint, at_most_once,
    /// token, lease µs, retention µs, retention µs.
    pub claim: String,
    /// `claim`'s parameters, then guard, tenant, kind, sent_at µs.
    pub claim_pre: String,
    /// `claim … RETURNING`.
    pub claim_returning: String,
    /// `claim … RETURNING` with the horizon (`claim`'s parameters).
    pub claim_returning_h: String,
    /// `claim_pre … RETURNING` with the horizon (`claim_pre`'s parameters).
    pub claim_pre_returning_h: String,
    /// The row after a claim without `RETURNING`: a locking read, so it is a
    /// current read even inside a caller's REPEATABLE READ snapshot.
    /// Parameter: key.
    pub read_back: String,
    /// `read_back` with the horizon (a locking read too). Parameter: key.
    pub read_back_h: String,
    /// Gives a fresh grant a new expiry and fence from the clock after a
    /// wait. Parameters: lease µs, key, token, fence, guard.
    pub refresh: String,
    /// Deletes this claim's own fresh row (a claim found beyond the horizon
    /// after its insert). Parameters: key, token, fence, guard.
    pub undo: String,
    pub get: String,
    pub complete: String,
    pub release: String,
    /// Renew returns the new expiry through `LAST_INSERT_ID(expr)`, which the
    /// server reports in the OK packet: one round trip.
    pub renew: String,
    pub abandoned: String,
    /// `Admin::forget`: completed at exactly this fence becomes released,
    /// without its outcome, kept for its retention from now. Parameters:
    /// key, fence, guard flag. The row stays, so the next claim's fence is
    /// `fence + 1` or more whatever the clock does.
    pub forget: String,
    /// `Admin::prunable`: how many records prune would delete now.
    pub prunable: String,
    pub horizon: String,
    /// Prune, step 1: a batch of prunable keys (a plain read). Parameter: limit.
    pub prune_candidates: String,
    /// Prune, step 3: locks the candidates that are still prunable (current
    /// read). Built per batch size by [`Statements::prune_lock`].
    prune_lock_prefix: String,
    /// Prune, step 2 and 4: the watermark upsert prefix; rows appended per
    /// batch by [`Statements::watermark_upsert`].
    watermark_prefix: String,
    delete_prefix: String,
    /// The pieces [`Statements::claim_many`] and the other batch statements
    /// are assembled from.
    batch: Batch,
}

/// What the batch statements are built from: the single claim's pieces.
#[derive(Debug)]
struct Batch {
    insert_cols: String,
    values: String,
    odku: String,
    returning: String,
    watermark: String,
    peek_prefix: String,
    read_back_prefix: String,
    read_back_h_prefix: String,
    horizon_prefix: String,
    complete_set: String,
    complete_where: String,
    settled_prefix: String,
}

impl Statements {
    /// `guarded`: the server has MariaDB's `@@in_transaction`, and every
    /// write carries the leaked-transaction guard `(? OR @@in_transaction =
    /// 0)`, whose parameter is true on a caller's transaction. Without it the
    /// guard is `(? OR TRUE)`, so both sets bind the same parameters.
    /// `causal`: a MariaDB Galera node; every read of the ledger's tables
    /// is a causal read ([`CAUSAL`]).
    pub(crate) fn new(t: &str, guarded: bool, causal: bool) -> Self {
        let read = if causal { CAUSAL } else { "" };
        let h = horizon_table(t);
        let guard = if guarded {
            "(? OR @@in_transaction = 0)"
        } else {
            "(? OR TRUE)"
        };
        // The takeover condition, on the row as found, judged on the clock
        // after the row lock was granted. `VALUES(col)` is the value this
        // statement would have inserted, so the update clause needs no
        // parameters of its own. `effect_key = VALUES(effect_key)` keeps a
        // conflict on some other unique index from updating another effect's
        // row.
        let take = format!(
            "(effect_key = VALUES(effect_key) \
             AND (fingerprint IS NULL OR VALUES(fingerprint) IS NULL OR fingerprint = VALUES(fingerprint)) \
             AND (state = 'released' \
                  OR (state = 'in_progress' AND at_most_once = 0 AND lease_expires_us <= {NOW_US})))"
        );
        // Whether the takeover happened, for the assignments after the first.
        // MySQL and MariaDB evaluate ODKU assignments left to right, each
        // seeing the ones before it: the first assignment decides (one read of
        // the clock) and writes the claim token, unique per attempt, and the
        // others test the token, so they agree with it whatever the clock
        // does meanwhile. MariaDB's SIMULTANEOUS_ASSIGNMENT mode (which a
        // caller's session may have) makes each assignment see the old row,
        // token included, so there each one re-evaluates the takeover; the
        // clock only moves forward, so they can only disagree if the old lease
        // ends in the microseconds between two of them, which at worst writes
        // a lease nobody holds (it expires like any other).
        let ours = format!(
            "IF(FIND_IN_SET('SIMULTANEOUS_ASSIGNMENT', @@SESSION.sql_mode) > 0, {take}, \
             claim_token = VALUES(claim_token))"
        );
        // A takeover's fence is above the previous one and on the clock
        // (`backend::next_fence`), so it stays above every fence the key had
        // even after a prune. The lease length is recovered from the values
        // the insert would have written.
        let odku = format!(
            "ON DUPLICATE KEY UPDATE \
             claim_token = IF({take}, VALUES(claim_token), claim_token), \
             fence = IF({ours}, GREATEST(fence + 1, {NOW_US}), fence), \
             fingerprint = IF({ours}, COALESCE(fingerprint, VALUES(fingerprint)), fingerprint), \
             at_most_once = IF({ours}, VALUES(at_most_once), at_most_once), \
             updated_us = IF({ours}, {NOW_US}, updated_us), \
             lease_expires_us = IF({ours}, {NOW_US} + (VALUES(lease_expires_us) - VALUES(created_us)), \
                                   lease_expires_us), \
             retention_us = IF({ours}, VALUES(retention_us), retention_us), \
             retain_until_us = IF({ours}, {NOW_US} + VALUES(retention_us), retain_until_us), \
             state = IF({ours}, 'in_progress', state)"
        );
        let insert_cols = format!(
            "INSERT INTO `{t}` (effect_key, tenant, kind, subject, state, fence, fingerprint, outcome, \
             at_most_once, claim_token, created_us, updated_us, lease_expires_us, retention_us, retain_until_us)"
        );
        // A fresh row: fence, created and updated are the statement's start
        // (one value; the fence is `next_fence(None, now)`), checked against
        // the clock after the write by the claim.
        let values = format!(
            "?, ?, ?, ?, 'in_progress', {STMT_US}, ?, NULL, ?, ?, {STMT_US}, {STMT_US}, {STMT_US} + ?, ?, \
             {STMT_US} + ?"
        );
        // A statement inside a transaction someone else leaked onto a pooled
        // connection would commit only with that transaction (if ever). The
        // plain claim stays an `INSERT … VALUES` (an `INSERT … SELECT` costs
        // the server more) and reports `in_tx` instead: the ledger then rolls
        // the stray transaction back, its own write with it, before anyone
        // could see it, and runs the claim again. The `_pre` claim is an
        // `INSERT … SELECT` anyway and carries the guard in its `WHERE`.
        let claim = format!("{insert_cols} VALUES ({values}) {odku}");
        // Inserts nothing when the ledger has pruned this tenant and kind up
        // to the message's production time or later. A locking read: it waits
        // for a prune that is raising the watermark, and holds off one that
        // has not started, whatever the caller's snapshot. (If it refuses,
        // the key may still exist and answer for itself: the claim reads it.)
        let claim_pre = format!(
            "{insert_cols} SELECT {values} FROM DUAL WHERE {guard} \
             AND NOT EXISTS (SELECT 1 FROM `{h}` AS w WHERE w.tenant = ? AND w.kind = ? \
             AND w.watermark_us >= ? LOCK IN SHARE MODE) {odku}"
        );
        let in_tx = if guarded {
            "@@in_transaction"
        } else {
            "CAST(0 AS UNSIGNED)"
        };
        // Evaluated after the write, so `now_us` is the clock once any lock
        // wait is over, and the watermark is a current read taken after our
        // row exists: a prune that deleted this key before our insert could
        // proceed has committed its watermark by then.
        let returning = format!(" RETURNING {COLUMNS}, {NOW_US} AS now_us, {in_tx} AS in_tx");
        // Correlated with the row on purpose: the server evaluates an
        // uncorrelated subquery once, up front, which for `RETURNING` means
        // before the insert waited (checked on MariaDB 10.11: it returned the
        // watermark as it was before a prune that committed during the wait).
        let watermark = format!(
            "(SELECT w.watermark_us FROM `{h}` AS w WHERE w.tenant = `{t}`.tenant AND w.kind = `{t}`.kind \
             LOCK IN SHARE MODE) AS horizon_us"
        );
        let fenced = "WHERE effect_key = ? AND fence = ? AND state = 'in_progress'";
        let peek_cols = format!("{read}SELECT {COLUMNS}, {NOW_US} AS now_us, {in_tx} AS in_tx FROM `{t}`");
        let batch = Batch {
            insert_cols: insert_cols.clone(),
            values: values.clone(),
            odku: odku.clone(),
            returning: returning.clone(),
            watermark: watermark.clone(),
            peek_prefix: format!("{peek_cols} WHERE effect_key IN "),
            read_back_prefix: format!("{peek_cols} WHERE effect_key IN "),
            read_back_h_prefix: format!(
                "{read}SELECT {COLUMNS}, {NOW_US} AS now_us, {in_tx} AS in_tx, {watermark} FROM `{t}` \
                 WHERE effect_key IN "
            ),
            horizon_prefix: format!("{read}SELECT tenant, kind, watermark_us FROM `{h}` WHERE "),
            // Every row the statement completes also gets the call's own
            // token, so that when some leases missed, a read tells which
            // rows this statement completed (the token of a completed row is
            // never read otherwise: refresh and undo are fenced on
            // `state = 'in_progress'`).
            complete_set: format!(
                "UPDATE `{t}` SET state = 'completed', lease_expires_us = NULL, updated_us = {NOW_US}, \
                 retain_until_us = {NOW_US} + retention_us, claim_token = ?, outcome = CASE effect_key "
            ),
            complete_where: format!("AND state = 'in_progress' AND {guard}"),
            settled_prefix: format!(
                "{read}SELECT effect_key, fence, state, claim_token FROM `{t}` WHERE effect_key IN "
            ),
        };
        Statements {
            read,
            peek: format!("{peek_cols} WHERE effect_key = ?"),
            batch,
            claim_returning: format!("{claim}{returning}"),
            claim_returning_h: format!("{claim}{returning}, {watermark}"),
            claim_pre_returning_h: format!("{claim_pre}{returning}, {watermark}"),
            claim,
            claim_pre,
            read_back: format!(
                "{read}SELECT {COLUMNS}, {NOW_US} AS now_us, {in_tx} AS in_tx FROM `{t}` WHERE effect_key = ? FOR UPDATE"
            ),
            read_back_h: format!(
                "{read}SELECT {COLUMNS}, {NOW_US} AS now_us, {in_tx} AS in_tx, {watermark} \
                 FROM `{t}` WHERE effect_key = ? FOR UPDATE"
            ),
            refresh: format!(
                "UPDATE `{t}` SET fence = GREATEST(fence + 1, {NOW_US}), updated_us = {NOW_US}, \
                 lease_expires_us = {NOW_US} + ?, retain_until_us = {NOW_US} + retention_us \
                 WHERE effect_key = ? AND claim_token = ? AND fence = ? AND state = 'in_progress' AND {guard}"
            ),
            undo: format!(
                "DELETE FROM `{t}` WHERE effect_key = ? AND claim_token = ? AND fence = ? \
                 AND state = 'in_progress' AND {guard}"
            ),
            get: format!("{read}SELECT {COLUMNS}, {NOW_US} AS now_us FROM `{t}` WHERE effect_key = ?"),
            complete: format!(
                "UPDATE `{t}` SET state = 'completed', outcome = ?, lease_expires_us = NULL, \
                 updated_us = {NOW_US}, retain_until_us = {NOW_US} + retention_us {fenced} AND {guard}"
            ),
            release: format!(
                "UPDATE `{t}` SET state = 'released', lease_expires_us = NULL, \
                 updated_us = {NOW_US}, retain_until_us = {NOW_US} + retention_us {fenced} AND {guard}"
            ),
            renew: format!(
                "UPDATE `{t}` SET lease_expires_us = LAST_INSERT_ID({NOW_US} + ?) {fenced} AND {guard}"
            ),
            abandoned: format!(
                "{read}SELECT {COLUMNS}, {NOW_US} AS now_us FROM `{t}` \
                 WHERE tenant = ? AND at_most_once = 1 AND state = 'in_progress' \
                 AND lease_expires_us <= {NOW_US} ORDER BY created_us LIMIT ?"
            ),
            horizon: format!("{read}SELECT watermark_us FROM `{h}` WHERE tenant = ? AND kind = ?"),
            forget: format!(
                "UPDATE `{t}` SET state = 'released', outcome = NULL, lease_expires_us = NULL, \
                 updated_us = {NOW_US}, retain_until_us = {NOW_US} + retention_us \
                 WHERE effect_key = ? AND fence = ? AND state = 'completed' AND {guard}"
            ),
            prunable: format!(
                "{read}SELECT COUNT(*) FROM `{t}` \
                 WHERE state IN ('completed', 'released') AND retain_until_us <= {NOW_US}"
            ),
            prune_candidates: format!(
                "SELECT effect_key, tenant, kind FROM `{t}` \
                 WHERE state IN ('completed', 'released') AND retain_until_us <= {NOW_US} LIMIT ?"
            ),
            prune_lock_prefix: format!(
                "SELECT effect_key, tenant, kind, created_us FROM `{t}` \
                 WHERE state IN ('completed', 'released') AND retain_until_us <= {NOW_US} AND effect_key IN "
            ),
            watermark_prefix: format!("INSERT INTO `{h}` (tenant, kind, watermark_us) VALUES "),
            delete_prefix: format!("DELETE FROM `{t}` WHERE effect_key IN "),
        }
    }

    /// Prune, step 3, for `n` keys: `FOR UPDATE`, in key order.
    pub(crate) fn prune_lock(&self, n: usize) -> String {
        format!(
            "{}{} ORDER BY effect_key FOR UPDATE",
            self.prune_lock_prefix,
            placeholders(n, "?")
        )
    }

    /// Prune, steps 2 and 4, for `n` (tenant, kind, watermark) rows: creates
    /// missing rows and raises the watermark, never lowering it (NULL as a
    /// watermark leaves it as it is, which step 2 uses to lock the rows).
    pub(crate) fn watermark_upsert(&self, n: usize) -> String {
        format!(
            "{}{} ON DUPLICATE KEY UPDATE watermark_us = \
             GREATEST(COALESCE(watermark_us, VALUES(watermark_us)), COALESCE(VALUES(watermark_us), watermark_us))",
            self.watermark_prefix,
            (0..n).map(|_| "(?, ?, ?)").collect::<Vec<_>>().join(", ")
        )
    }

    /// Prune, step 5, for `n` keys.
    pub(crate) fn prune_delete(&self, n: usize) -> String {
        format!("{}{}", self.delete_prefix, placeholders(n, "?"))
    }

    /// [`Statements::peek`] for `n` distinct keys (a plain read, no lock).
    pub(crate) fn peek_many(&self, n: usize) -> String {
        format!("{}{}", self.batch.peek_prefix, placeholders(n, "?"))
    }

    /// The watermarks of `n` (tenant, kind) pairs, as committed (a plain
    /// read: a batch's pre-check, so that a refused replay writes nothing;
    /// the check after the write is the one that is never fooled).
    /// Parameters: tenant, kind, per pair.
    pub(crate) fn watermarks(&self, n: usize) -> String {
        let pairs = vec!["(tenant = ? AND kind = ?)"; n.max(1)].join(" OR ");
        format!("{}{pairs}", self.batch.horizon_prefix)
    }

    /// The claim statement with `n` rows: `claim`'s ten parameters per row.
    /// `returning`: with `RETURNING` (one row back per `VALUES` row, in
    /// order, whether inserted, taken over or untouched); `horizon`: that
    /// also returns the watermark read after each row's write. MariaDB and
    /// MySQL write the rows in `VALUES` order, so callers sort them by key:
    /// two overlapping batches then lock their common keys in the same
    /// order and cannot deadlock on each other.
    pub(crate) fn claim_many(&self, n: usize, returning: bool, horizon: bool) -> String {
        let b = &self.batch;
        let rows = vec![format!("({})", b.values); n.max(1)].join(", ");
        let mut q = format!("{} VALUES {rows} {}", b.insert_cols, b.odku);
        if returning {
            q.push_str(&b.returning);
            if horizon {
                q.push_str(", ");
                q.push_str(&b.watermark);
            }
        }
        q
    }

    /// The rows after [`Statements::claim_many`] without `RETURNING`, as
    /// [`Statements::read_back`] (a locking read) for `n` keys.
    pub(crate) fn read_back_many(&self, n: usize, horizon: bool) -> String {
        let prefix = if horizon {
            &self.batch.read_back_h_prefix
        } else {
            &self.batch.read_back_prefix
        };
        format!("{prefix}{} FOR UPDATE", placeholders(n, "?"))
    }

    /// Completes `n` leases of distinct keys in one statement, each fenced
    /// by its own fence. Parameters: the call's token; (key, outcome) per
    /// lease; the `n` keys; (key, fence) per lease; the guard.
    pub(crate) fn complete_many(&self, n: usize) -> String {
        let b = &self.batch;
        let n = n.max(1);
        let outcomes = "WHEN ? THEN ? ".repeat(n);
        let fences = "WHEN ? THEN ? ".repeat(n);
        format!(
            "{}{outcomes}END WHERE effect_key IN {} AND fence = CASE effect_key {fences}END {}",
            b.complete_set,
            placeholders(n, "?"),
            b.complete_where
        )
    }

    /// Which of `n` keys are completed, at which fence, with which token
    /// (after [`Statements::complete_many`] matched fewer rows than leases).
    pub(crate) fn settled(&self, n: usize) -> String {
        format!("{}{}", self.batch.settled_prefix, placeholders(n, "?"))
    }
}

/// A statement with its binds, ready to run on a connection.
pub(crate) type Bound = Query<'static, MySql, MySqlArguments>;

/// A statement with its binds whose rows are one column of type `O`.
pub(crate) type BoundScalar<O> = QueryScalar<'static, MySql, O, MySqlArguments>;

fn query(text: &str) -> Bound {
    sqlx::query(AssertSqlSafe(text))
}

// One function per statement, each returning it bound: the placeholders
// are filled here, in the order the function's parameters name them, and
// nowhere else. Each statement's row type, and how it is read, sits next to
// it; the callers pick a statement and interpret its row.

/// The rows of [`Statements::peek`], the claim statements, their
/// read-backs, [`Statements::get`], [`Statements::abandoned`] and
/// [`records`]: a row as stored, plus the server's clock at the read
/// (`now_us`) and, for the statements that read it, the horizon of the
/// row's tenant and kind. Read by column name ([`stored`]).
#[derive(Debug)]
pub(crate) struct Stored {
    pub key: String,
    pub state: RecordState,
    pub fence: u64,
    pub fingerprint: Option<Vec<u8>>,
    pub outcome: Option<Vec<u8>>,
    pub at_most_once: bool,
    pub token: Vec<u8>,
    pub created_us: i64,
    pub updated_us: i64,
    pub lease_expires_us: Option<i64>,
    pub retain_until_us: i64,
    pub now_us: i64,
    /// Whether the statement ran inside an open transaction (claims only).
    pub in_tx: bool,
    /// The watermark read after the write (claims with `sent_at` only).
    pub horizon_us: Option<i64>,
}

/// Reads a [`Stored`] row by column name; `in_tx` and `horizon`: whether
/// the statement returned those columns (the claim statements, their
/// read-backs and [`Statements::peek`] return `in_tx`; the `_h` forms
/// `horizon_us`).
pub(crate) fn stored(row: &MySqlRow, in_tx: bool, horizon: bool) -> Result<Stored> {
    let g = |e: sqlx::Error| corrupt(format!("unreadable ledger row: {e}"));
    let state: String = row.try_get("state").map_err(g)?;
    Ok(Stored {
        key: row.try_get("effect_key").map_err(g)?,
        state: RecordState::parse(&state).map_err(|e| corrupt(e.to_string()))?,
        fence: row.try_get("fence").map_err(g)?,
        fingerprint: row.try_get("fingerprint").map_err(g)?,
        outcome: row.try_get("outcome").map_err(g)?,
        at_most_once: row.try_get("at_most_once").map_err(g)?,
        token: row.try_get("claim_token").map_err(g)?,
        created_us: row.try_get("created_us").map_err(g)?,
        updated_us: row.try_get("updated_us").map_err(g)?,
        lease_expires_us: row.try_get("lease_expires_us").map_err(g)?,
        retain_until_us: row.try_get("retain_until_us").map_err(g)?,
        now_us: row.try_get("now_us").map_err(g)?,
        in_tx: if in_tx {
            row.try_get::<u64, _>("in_tx").map_err(g)? != 0
        } else {
            false
        },
        horizon_us: if horizon {
            row.try_get("horizon_us").map_err(g)?
        } else {
            None
        },
    })
}

impl Stored {
    /// Whether this row was written by the claim attempt holding `token`.
    pub fn ours(&self, token: &[u8]) -> bool {
        self.token.as_slice() == token
    }

    /// Whether the row is a fresh insert rather than a takeover: an insert
    /// writes the statement's start as both fence and creation time, and
    /// every later grant raises the fence above it (`GREATEST(fence + 1,
    /// now)`; a version 1 row's small fence jumps to the clock).
    pub fn fresh(&self) -> bool {
        i64::try_from(self.fence).is_ok_and(|f| f == self.created_us)
    }

    /// The record, with an expired at-most-once lease reported as abandoned
    /// (the kit's rule).
    pub fn record(&self, key: Option<&EffectKey>) -> Result<Record> {
        let key = match key {
            Some(k) if k.as_str() == self.key => k.clone(),
            _ => EffectKey::parse(&self.key)
                .map_err(|e| corrupt(format!("stored key {:?} does not parse: {e}", self.key)))?,
        };
        let fingerprint = match &self.fingerprint {
            Some(b) => Some(Fingerprint::from_bytes(b).map_err(|e| corrupt(e.to_string()))?),
            None => None,
        };
        let outcome = match &self.outcome {
            Some(b) => Some(Outcome::from_bytes(b.clone()).map_err(|e| corrupt(e.to_string()))?),
            None => None,
        };
        let lease_expires_at = self.lease_expires_us.map(from_micros);
        let read_at = from_micros(self.now_us);
        Ok(Record {
            key,
            state: effective_state(self.state, self.at_most_once, lease_expires_at, read_at),
            fence: self.fence,
            fingerprint,
            outcome,
            at_most_once: self.at_most_once,
            created_at: from_micros(self.created_us),
            updated_at: from_micros(self.updated_us),
            lease_expires_at,
            retain_until: from_micros(self.retain_until_us),
            read_at,
        })
    }
}

/// Binds one `VALUES` row of a claim statement: key, tenant, kind, subject
/// (from `key`), fingerprint, at_most_once (from `opts`), `token`, then
/// lease µs, retention µs, retention µs (from `opts`).
fn claim_values(q: Bound, key: &EffectKey, opts: &ClaimOptions, token: &[u8; 16]) -> Bound {
    let retention_us = duration_micros(opts.retention);
    q.bind(key.as_str())
        .bind(key.tenant().as_str())
        .bind(key.kind())
        .bind(key.subject())
        .bind(opts.fingerprint.map(|f| f.as_bytes().to_vec()))
        .bind(opts.at_most_once)
        .bind(token.to_vec())
        .bind(duration_micros(opts.lease))
        .bind(retention_us)
        .bind(retention_us)
}

/// The statements whose rows are [`Stored`] rows.
impl Statements {
    /// [`Statements::peek`] of `key`: a [`Stored`] row with `in_tx`, or none.
    pub(crate) fn bind_peek(&self, key: &EffectKey) -> Bound {
        query(&self.peek).bind(key.as_str())
    }

    /// [`Statements::read_back`] of `key`: a [`Stored`] row with `in_tx`, or
    /// none.
    pub(crate) fn bind_read_back(&self, key: &EffectKey) -> Bound {
        query(&self.read_back).bind(key.as_str())
    }

    /// [`Statements::read_back_h`] of `key`: a [`Stored`] row with `in_tx`
    /// and `horizon_us`, or none.
    pub(crate) fn bind_read_back_h(&self, key: &EffectKey) -> Bound {
        query(&self.read_back_h).bind(key.as_str())
    }

    /// The claim of `key` with `token`, without `sent_at`: with `returning`
    /// ([`Statements::claim_returning`]) one [`Stored`] row with `in_tx`;
    /// without ([`Statements::claim`]) no row (read it back with
    /// [`Statements::bind_read_back`]).
    pub(crate) fn bind_claim(
        &self,
        returning: bool,
        key: &EffectKey,
        opts: &ClaimOptions,
        token: &[u8; 16],
    ) -> Bound {
        let text = if returning {
            &self.claim_returning
        } else {
            &self.claim
        };
        claim_values(query(text), key, opts, token)
    }

    /// The claim of `key` with `token` and the horizon after the write, no
    /// pre-check: with `returning` ([`Statements::claim_returning_h`]) one
    /// [`Stored`] row with `in_tx` and `horizon_us`; without
    /// ([`Statements::claim`]) no row (read it back with
    /// [`Statements::bind_read_back_h`]).
    pub(crate) fn bind_claim_h(
        &self,
        returning: bool,
        key: &EffectKey,
        opts: &ClaimOptions,
        token: &[u8; 16],
    ) -> Bound {
        let text = if returning {
            &self.claim_returning_h
        } else {
            &self.claim
        };
        claim_values(query(text), key, opts, token)
    }

    /// The claim of `key` with `token` that inserts only after the horizon
    /// (`sent_us`): the claim's ten parameters, then the guard
    /// (`in_caller_tx`), the key's tenant and kind, `sent_us`. With
    /// `returning` ([`Statements::claim_pre_returning_h`]) one [`Stored`]
    /// row with `in_tx` and `horizon_us`, none when refused; without
    /// ([`Statements::claim_pre`]) no row, and 0 rows affected when refused.
    pub(crate) fn bind_claim_pre(
        &self,
        returning: bool,
        key: &EffectKey,
        opts: &ClaimOptions,
        token: &[u8; 16],
        in_caller_tx: bool,
        sent_us: i64,
    ) -> Bound {
        let text = if returning {
            &self.claim_pre_returning_h
        } else {
            &self.claim_pre
        };
        claim_values(query(text), key, opts, token)
            .bind(in_caller_tx)
            .bind(key.tenant().as_str())
            .bind(key.kind())
            .bind(sent_us)
    }

    /// [`Statements::get`] of `key`: a [`Stored`] row without `in_tx`, or
    /// none.
    pub(crate) fn bind_get(&self, key: &EffectKey) -> Bound {
        query(&self.get).bind(key.as_str())
    }

    /// [`Statements::abandoned`]: `tenant`'s abandoned steps, at most
    /// `limit`, as [`Stored`] rows without `in_tx`.
    pub(crate) fn bind_abandoned(&self, tenant: &Tenant, limit: u64) -> Bound {
        query(&self.abandoned).bind(tenant.as_str()).bind(limit)
    }

    /// [`Statements::peek_many`] of distinct `keys`: a [`Stored`] row with
    /// `in_tx` per key found, in no particular order.
    pub(crate) fn bind_peek_many(&self, keys: &[EffectKey]) -> Bound {
        keys.iter()
            .fold(query(&self.peek_many(keys.len())), |q, k| q.bind(k.as_str()))
    }

    /// [`Statements::claim_many`]: one `VALUES` row per (key, token), in
    /// order, all with `opts`. With `returning`, one [`Stored`] row with
    /// `in_tx` (and with `horizon`, `horizon_us`) per `VALUES` row, in
    /// order; without, no row (read them back with
    /// [`Statements::bind_read_back_many`]).
    pub(crate) fn bind_claim_many(
        &self,
        returning: bool,
        horizon: bool,
        opts: &ClaimOptions,
        rows: &[(&EffectKey, &[u8; 16])],
    ) -> Bound {
        rows.iter().fold(
            query(&self.claim_many(rows.len(), returning, horizon)),
            |q, (key, token)| claim_values(q, key, opts, token),
        )
    }

    /// [`Statements::read_back_many`] of distinct `keys`: a [`Stored`] row
    /// with `in_tx` (and with `horizon`, `horizon_us`) per key found, in no
    /// particular order.
    pub(crate) fn bind_read_back_many(&self, horizon: bool, keys: &[&EffectKey]) -> Bound {
        keys.iter()
            .fold(query(&self.read_back_many(keys.len(), horizon)), |q, k| {
                q.bind(k.as_str())
            })
    }
}

/// The fenced writes: no rows; the callers read `rows_affected` (sqlx sets
/// CLIENT_FOUND_ROWS, so it is the number of rows matched). `in_caller_tx`
/// is the leaked-transaction guard's parameter: true on a caller's
/// transaction.
impl Statements {
    /// [`Statements::refresh`]: a new expiry `lease_us` from now for the
    /// fresh grant of `key` held by `token` at `fence`.
    pub(crate) fn bind_refresh(
        &self,
        lease_us: i64,
        key: &EffectKey,
        token: &[u8; 16],
        fence: u64,
        in_caller_tx: bool,
    ) -> Bound {
        query(&self.refresh)
            .bind(lease_us)
            .bind(key.as_str())
            .bind(&token[..])
            .bind(fence)
            .bind(in_caller_tx)
    }

    /// [`Statements::undo`]: deletes the fresh row of `key` held by `token`
    /// at `fence`.
    pub(crate) fn bind_undo(
        &self,
        key: &EffectKey,
        token: &[u8; 16],
        fence: u64,
        in_caller_tx: bool,
    ) -> Bound {
        query(&self.undo)
            .bind(key.as_str())
            .bind(&token[..])
            .bind(fence)
            .bind(in_caller_tx)
    }

    /// [`Statements::complete`]: `outcome` for the lease of `key` at `fence`.
    pub(crate) fn bind_complete(
        &self,
        outcome: &Outcome,
        key: &EffectKey,
        fence: u64,
        in_caller_tx: bool,
    ) -> Bound {
        query(&self.complete)
            .bind(outcome.as_bytes())
            .bind(key.as_str())
            .bind(fence)
            .bind(in_caller_tx)
    }

    /// [`Statements::release`] of the lease of `key` at `fence`.
    pub(crate) fn bind_release(&self, key: &EffectKey, fence: u64, in_caller_tx: bool) -> Bound {
        query(&self.release)
            .bind(key.as_str())
            .bind(fence)
            .bind(in_caller_tx)
    }

    /// [`Statements::renew`]: the lease of `key` at `fence` until
    /// `extend_us` from now, reported as `last_insert_id`.
    pub(crate) fn bind_renew(
        &self,
        extend_us: i64,
        key: &EffectKey,
        fence: u64,
        in_caller_tx: bool,
    ) -> Bound {
        query(&self.renew)
            .bind(extend_us)
            .bind(key.as_str())
            .bind(fence)
            .bind(in_caller_tx)
    }

    /// [`Statements::forget`] of the completed record of `key` at `fence`.
    pub(crate) fn bind_forget(&self, key: &EffectKey, fence: u64, in_caller_tx: bool) -> Bound {
        query(&self.forget)
            .bind(key.as_str())
            .bind(fence)
            .bind(in_caller_tx)
    }
}

/// A row of [`Statements::watermarks`]: a (tenant, kind) pair's watermark
/// as committed (NULL: locked by a prune that deleted nothing there).
#[derive(Debug)]
pub(crate) struct Watermark {
    pub tenant: String,
    pub kind: String,
    pub watermark_us: Option<i64>,
}

impl Watermark {
    /// Reads a row of [`Statements::bind_watermarks`] by column name.
    pub(crate) fn read(row: &MySqlRow) -> Result<Self> {
        let g = |e: sqlx::Error| corrupt(format!("unreadable watermark row: {e}"));
        Ok(Watermark {
            tenant: row.try_get("tenant").map_err(g)?,
            kind: row.try_get("kind").map_err(g)?,
            watermark_us: row.try_get("watermark_us").map_err(g)?,
        })
    }
}

/// The horizon's statements.
impl Statements {
    /// [`Statements::watermarks`] of distinct (tenant, kind) `pairs`: a
    /// [`Watermark`] row per pair that has a watermark row.
    pub(crate) fn bind_watermarks(&self, pairs: &[(&str, &str)]) -> Bound {
        pairs
            .iter()
            .fold(query(&self.watermarks(pairs.len())), |q, (tenant, kind)| {
                q.bind(*tenant).bind(*kind)
            })
    }

    /// [`Statements::horizon`] of `tenant` and `kind`: the watermark (µs),
    /// NULL or no row when there is none.
    pub(crate) fn bind_horizon(&self, tenant: &Tenant, kind: &str) -> BoundScalar<Option<i64>> {
        // `QueryScalar::bind` keeps its values for the query's lifetime:
        // owned, so the bound statement borrows nothing.
        sqlx::query_scalar(AssertSqlSafe(self.horizon.as_str()))
            .bind(tenant.as_str().to_owned())
            .bind(kind.to_owned())
    }
}

/// A row of [`Statements::settled`]: a key's state, fence and claim token.
#[derive(Debug)]
pub(crate) struct Settled {
    pub key: String,
    pub fence: u64,
    pub state: String,
    pub token: Vec<u8>,
}

impl Settled {
    /// Reads a row of [`Statements::bind_settled`] by column name.
    pub(crate) fn read(row: &MySqlRow) -> Result<Self> {
        let g = |e: sqlx::Error| corrupt(format!("unreadable ledger row: {e}"));
        Ok(Settled {
            key: row.try_get("effect_key").map_err(g)?,
            fence: row.try_get("fence").map_err(g)?,
            state: row.try_get("state").map_err(g)?,
            token: row.try_get("claim_token").map_err(g)?,
        })
    }
}

/// `complete_many`'s statements.
impl Statements {
    /// [`Statements::complete_many`] of leases of distinct keys, on the pool:
    /// the call's `token`; (key, outcome) per lease; the keys; (key, fence)
    /// per lease; the guard, false. No rows: `rows_affected` is the number of
    /// leases it matched.
    pub(crate) fn bind_complete_many(&self, token: &[u8; 16], work: &[(Lease, Outcome)]) -> Bound {
        let mut q = query(&self.complete_many(work.len())).bind(token.to_vec());
        for (lease, outcome) in work {
            q = q.bind(lease.key().as_str()).bind(outcome.as_bytes());
        }
        for (lease, _) in work {
            q = q.bind(lease.key().as_str());
        }
        for (lease, _) in work {
            q = q.bind(lease.key().as_str()).bind(lease.fence());
        }
        q.bind(false)
    }

    /// [`Statements::settled`] of the keys of `leases` (distinct): a
    /// [`Settled`] row per key found.
    pub(crate) fn bind_settled<'l>(&self, leases: impl ExactSizeIterator<Item = &'l Lease>) -> Bound {
        let n = leases.len();
        leases.fold(query(&self.settled(n)), |q, l| q.bind(l.key().as_str()))
    }
}

/// A row of [`Statements::prune_candidates`]: a prunable key, with its
/// tenant and kind.
#[derive(Debug)]
pub(crate) struct Candidate {
    pub key: String,
    pub tenant: String,
    pub kind: String,
}

impl Candidate {
    /// Reads a row of [`Statements::bind_prune_candidates`] by column name.
    pub(crate) fn read(row: &MySqlRow) -> std::result::Result<Self, sqlx::Error> {
        Ok(Candidate {
            key: row.try_get("effect_key")?,
            tenant: row.try_get("tenant")?,
            kind: row.try_get("kind")?,
        })
    }
}

/// A row of [`Statements::prune_lock`]: a key locked for deletion, with its
/// tenant, kind and creation time (µs).
#[derive(Debug)]
pub(crate) struct Doomed {
    pub key: String,
    pub tenant: String,
    pub kind: String,
    pub created_us: i64,
}

impl Doomed {
    /// Reads a row of [`Statements::bind_prune_lock`] by column name.
    pub(crate) fn read(row: &MySqlRow) -> std::result::Result<Self, sqlx::Error> {
        Ok(Doomed {
            key: row.try_get("effect_key")?,
            created_us: row.try_get("created_us")?,
            tenant: row.try_get("tenant")?,
            kind: row.try_get("kind")?,
        })
    }
}

/// Prune's statements, in the order a batch runs them (`prune.rs`).
impl Statements {
    /// [`Statements::prune_candidates`]: at most `limit` [`Candidate`] rows.
    pub(crate) fn bind_prune_candidates(&self, limit: u64) -> Bound {
        query(&self.prune_candidates).bind(limit)
    }

    /// [`Statements::watermark_upsert`] of (tenant, kind) → watermark
    /// (`None` only locks the row), in the map's order. No rows.
    pub(crate) fn bind_watermark_upsert(&self, marks: &BTreeMap<(String, String), Option<i64>>) -> Bound {
        marks.iter().fold(
            query(&self.watermark_upsert(marks.len())),
            |q, ((tenant, kind), w)| q.bind(tenant.as_str()).bind(kind.as_str()).bind(*w),
        )
    }

    /// [`Statements::prune_lock`] of `keys`, sorted by the caller: a
    /// [`Doomed`] row per key still prunable.
    pub(crate) fn bind_prune_lock(&self, keys: &[String]) -> Bound {
        keys.iter()
            .fold(query(&self.prune_lock(keys.len())), |q, k| q.bind(k.as_str()))
    }

    /// [`Statements::prune_delete`] of `keys`. No rows.
    pub(crate) fn bind_prune_delete(&self, keys: &[String]) -> Bound {
        keys.iter()
            .fold(query(&self.prune_delete(keys.len())), |q, k| q.bind(k.as_str()))
    }

    /// [`Statements::prunable`]: one count.
    pub(crate) fn bind_prunable(&self) -> BoundScalar<i64> {
        sqlx::query_scalar(AssertSqlSafe(self.prunable.as_str()))
    }
}

/// A row of [`stats`], by name.
pub(crate) fn kind_stats(row: &MySqlRow) -> Result<oncely::admin::KindStats> {
    let g = |e: sqlx::Error| corrupt(format!("unreadable stats row: {e}"));
    let tenant: String = row.try_get("tenant").map_err(g)?;
    let tenant = oncely::Tenant::parse(&tenant).map_err(|e| corrupt(format!("tenant {tenant:?}: {e}")))?;
    let kind: String = row.try_get("kind").map_err(g)?;
    let now: i64 = row.try_get("now_us").map_err(g)?;
    let count = |c: &str| -> Result<u64> {
        let n: i64 = row.try_get(c).map_err(g)?;
        Ok(u64::try_from(n).unwrap_or(0))
    };
    let at = |c: &str| -> Result<Option<std::time::SystemTime>> {
        Ok(row.try_get::<Option<i64>, _>(c).map_err(g)?.map(from_micros))
    };
    let mut s = oncely::admin::KindStats::new(tenant, kind, from_micros(now));
    s.live = count("live")?;
    s.stuck = count("stuck")?;
    s.abandoned = count("abandoned")?;
    s.completed = count("completed")?;
    s.released = count("released")?;
    s.oldest_live = at("oldest_live")?;
    s.oldest_stuck = at("oldest_stuck")?;
    s.oldest_abandoned = at("oldest_abandoned")?;
    Ok(s)
}

impl Statements {
    /// An operator listing built by [`records`] (rows: [`Stored`] without
    /// `in_tx`) or [`stats`] (rows: [`kind_stats`]), its text and
    /// arguments, behind the ledger's read prefix ([`Statements::read`]),
    /// bound.
    pub(crate) fn bind_listing(&self, text: &str, args: &[Arg]) -> Bound {
        args.iter().fold(
            sqlx::query(AssertSqlSafe(format!("{}{text}", self.read))),
            |q, a| match a {
                Arg::Text(s) => q.bind(s.clone()),
                Arg::Int(i) => q.bind(*i),
            },
        )
    }
}

fn placeholders(n: usize, p: &str) -> String {
    format!("({})", vec![p; n.max(1)].join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On Galera every read is causal, and nothing else changes: the
    /// writes are the statements of a single server.
    #[test]
    fn causal_statements_prefix_every_read_and_no_write() {
        let (plain, causal) = (
            Statements::new("t", true, false),
            Statements::new("t", true, true),
        );
        for (p, c) in [
            (&plain.peek, &causal.peek),
            (&plain.read_back, &causal.read_back),
            (&plain.read_back_h, &causal.read_back_h),
            (&plain.get, &causal.get),
            (&plain.abandoned, &causal.abandoned),
            (&plain.prunable, &causal.prunable),
            (&plain.horizon, &causal.horizon),
            (&plain.peek_many(2), &causal.peek_many(2)),
            (&plain.read_back_many(2, true), &causal.read_back_many(2, true)),
            (&plain.watermarks(2), &causal.watermarks(2)),
            (&plain.settled(2), &causal.settled(2)),
        ] {
            assert_eq!(*c, format!("{CAUSAL}{p}"));
        }
        for (p, c) in [
            (&plain.claim_returning, &causal.claim_returning),
            (&plain.claim_pre, &causal.claim_pre),
            (&plain.complete, &causal.complete),
            (&plain.renew, &causal.renew),
            (&plain.release, &causal.release),
            (&plain.refresh, &causal.refresh),
            (&plain.undo, &causal.undo),
            (&plain.forget, &causal.forget),
            (&plain.complete_many(2), &causal.complete_many(2)),
        ] {
            assert_eq!(p, c);
        }
        assert_eq!((plain.read, causal.read), ("", CAUSAL));
    }

    #[test]
    fn batch_statements_have_one_placeholder_per_value() {
        let s = Statements::new("t", true, false);
        assert_eq!(s.prune_lock(3).matches('?').count(), 3);
        assert_eq!(s.prune_delete(2).matches('?').count(), 2);
        assert_eq!(s.watermark_upsert(2).matches('?').count(), 6);
        assert_eq!(s.peek.matches('?').count(), 1);
        assert_eq!(s.peek_many(3).matches('?').count(), 3);
        assert_eq!(s.watermarks(2).matches('?').count(), 4);
        for (returning, horizon) in [(true, true), (true, false), (false, false)] {
            assert_eq!(
                s.claim_many(3, returning, horizon).matches('?').count(),
                3 * s.claim.matches('?').count()
            );
        }
        assert_eq!(s.claim_many(1, true, false), s.claim_returning);
        assert_eq!(s.claim_many(1, true, true), s.claim_returning_h);
        assert_eq!(s.read_back_many(2, true).matches('?').count(), 2);
        // token, (key, outcome) × 2, keys × 2, (key, fence) × 2, guard
        assert_eq!(s.complete_many(2).matches('?').count(), 1 + 4 + 2 + 4 + 1);
        assert_eq!(s.settled(2).matches('?').count(), 2);
    }
}

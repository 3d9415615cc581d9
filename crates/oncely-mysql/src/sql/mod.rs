//! Every SQL statement of the backend, built once per table name
//! ([`Statements::new`], here), with the clock, the fixed statements that
//! ask what a server and a connection are, and the helpers the statements
//! share. The function that binds each statement and the row type that
//! reads what it returns (every column by name, never by position) sit
//! together, one module per concern: [`claim`], [`record`](mod@record)
//! (`get`, `abandoned`, and the row as stored), [`write`](mod@write) (the
//! fenced writes), [`batch`] (`claim_many`, `complete_many` and the
//! horizon's batch read), [`prune`] (and the horizon), [`admin`] (the
//! operator's statements, whose listings are also built there), [`schema`]
//! (migrations and the `information_schema` reads), [`outbox`] (the
//! transactional outbox's table and statements).
//!
//! Architecture invariant: no other module contains SQL.
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

use oncely::backend::duration_micros;
use oncely::{ClaimOptions, EffectKey};
use sqlx::mysql::MySqlArguments;
use sqlx::query::{Query, QueryScalar};
use sqlx::{AssertSqlSafe, MySql};

mod admin;
mod batch;
mod claim;
mod outbox;
mod prune;
mod record;
mod schema;
mod write;

pub(crate) use admin::{Arg, erasure, kind_stats, records, stats};
pub(crate) use batch::{Settled, Watermark};
#[cfg(test)]
pub(crate) use outbox::empty_outbox;
pub(crate) use outbox::stats as outbox_stats;
pub(crate) use outbox::{
    FencedState, OutboxStatements, READ_COMMITTED_NEXT, enqueued, erase_messages, id as outbox_id, locked,
    outbox_table, pending,
};
pub(crate) use prune::{Candidate, Doomed};
pub(crate) use record::{Stored, stored};
pub(crate) use schema::{
    DATABASE, MIGRATIONS_TABLE, bind_applied_versions, bind_is_columns, bind_is_indexes, bind_is_table,
    bind_is_table_count, bind_migration_lock, bind_migration_unlock, bind_record_version, migrations,
};

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

/// Makes a read on a Galera node causal: before it reads, the node applies
/// every write set the cluster committed before the read began, so it sees
/// every write acknowledged on any node by then (a node applies other
/// nodes' write sets asynchronously, a few milliseconds behind their
/// commit). MariaDB's per-statement form, so no session state is left
/// behind on a caller's connection.
pub(crate) const CAUSAL: &str = "SET STATEMENT wsrep_sync_wait = 1 FOR ";

/// Begins a transaction on a Galera node after the node has applied every
/// write set the cluster committed before it (`wsrep_sync_wait`'s read bit
/// covers `START TRANSACTION`). Needed because MariaDB skips the causal wait
/// for every statement *inside* a transaction (`wsrep_must_sync_wait` is
/// false in an active multi-statement transaction), so [`CAUSAL`] reads
/// there are not causal: a transaction begun plainly could miss a lease
/// granted through another node a moment ago (and refuse its holder's
/// completion as "lease lost"), and Galera would refuse its writes of that
/// row at commit. Elsewhere transactions begin as sqlx begins them.
pub(crate) const CAUSAL_BEGIN: &str = "SET STATEMENT wsrep_sync_wait = 1 FOR START TRANSACTION";

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

/// The columns every read of a record returns ([`stored`] reads them by
/// name).
const COLUMNS: &str = "effect_key, state, fence, fingerprint, outcome, at_most_once, claim_token, \
                       created_us, updated_us, lease_expires_us, retain_until_us";

/// The name of a ledger table's horizon table.
pub(crate) fn horizon_table(t: &str) -> String {
    format!("{t}_horizon")
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
    /// `Admin::erase`, step 1, in a transaction of the ledger's own: the
    /// subject's records, locked (`effect_key`, `state`, `now_us`), or one
    /// row with the clock only when there are none.
    /// Parameters: tenant, subject.
    pub erase_lock: String,
    /// `Admin::erase`, step 2: the subject's completed and released records
    /// (`oncely::backend::erasable`) lose their outcome and fingerprint;
    /// key, state, fence, `created_us` and retention stay, so a completed
    /// one answers every claim with `Error::Erased` and is never taken
    /// over. Parameters: tenant, subject.
    pub erase: String,
    /// `Admin::replace_outcome`. Parameters: new outcome, key, fence,
    /// expected outcome.
    pub replace_outcome: String,
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
    /// The transactional outbox's statements (`<table>_outbox`), with this
    /// set's guard and reads.
    pub outbox: OutboxStatements,
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
            outbox: OutboxStatements::new(t, guard, read),
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
            erase_lock: format!(
                "SELECT e.effect_key AS effect_key, CAST(e.state AS CHAR) AS state, c.now_us AS now_us \
                 FROM (SELECT {NOW_US} AS now_us) AS c \
                 LEFT JOIN `{t}` AS e ON e.tenant = ? AND e.subject = ? FOR UPDATE"
            ),
            erase: format!(
                "UPDATE `{t}` SET outcome = NULL, fingerprint = NULL \
                 WHERE tenant = ? AND subject = ? AND state IN ('completed', 'released')"
            ),
            replace_outcome: format!(
                "UPDATE `{t}` SET outcome = ? \
                 WHERE effect_key = ? AND fence = ? AND state = 'completed' AND outcome = ?"
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

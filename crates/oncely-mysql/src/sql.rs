//! Every SQL statement of the backend, built once per table name.
//!
//! Timestamps are BIGINT microseconds since the Unix epoch taken from the
//! server: [`NOW_US`] reads `UTC_TIMESTAMP(6)`, which is evaluated once per
//! statement and does not depend on the session's `time_zone` (so it is also
//! right on a caller's connection in `claim_in`).

/// The server's clock in microseconds since the epoch, session time zone
/// independent.
pub(crate) const NOW_US: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

/// The columns every read returns, in the order `row_to_stored` expects.
const COLUMNS: &str = "effect_key, state, fence, fingerprint, outcome, at_most_once, claim_token, \
                       created_us, updated_us, lease_expires_us, retain_until_us";

/// The schema versions, applied in order under `GET_LOCK`. Each statement is
/// idempotent on its own (`IF NOT EXISTS`), because MySQL DDL commits
/// implicitly and a migrator can die between a DDL and its bookkeeping row.
pub(crate) fn migrations(t: &str) -> Vec<(u32, Vec<String>)> {
    vec![(
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
    )]
}

/// The migration bookkeeping table, shared by every ledger table of a schema.
pub(crate) const MIGRATIONS_TABLE: &str = "CREATE TABLE IF NOT EXISTS oncely_schema_migrations (
  table_name VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  version INT UNSIGNED NOT NULL,
  applied_at DATETIME(6) NOT NULL,
  PRIMARY KEY (table_name, version)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4";

/// The statements of one ledger table.
#[derive(Debug)]
pub(crate) struct Statements {
    /// The claim without a horizon check (parameters: see `claim_on`).
    pub claim: String,
    /// The claim with a horizon check (`INSERT … SELECT … WHERE`).
    pub claim_horizon: String,
    /// The same two with `RETURNING` (MariaDB 10.5+).
    pub claim_returning: String,
    pub claim_horizon_returning: String,
    /// Read-back after a claim without `RETURNING` (locking read, so it is a
    /// current read even inside a caller's REPEATABLE READ snapshot).
    pub read_locking: String,
    pub get: String,
    pub complete: String,
    pub release: String,
    /// Renew returns the new expiry through `LAST_INSERT_ID(expr)`, which the
    /// server reports in the OK packet: one round trip.
    pub renew: String,
    pub prune: String,
    pub abandoned: String,
}

impl Statements {
    /// `guarded`: the server has MariaDB's `@@in_transaction`, and every
    /// write carries the leaked-transaction guard `(? OR @@in_transaction =
    /// 0)`, whose parameter is true on a caller's transaction. Without it the
    /// guard is `(? OR TRUE)`, so both sets bind the same parameters.
    pub(crate) fn new(t: &str, guarded: bool) -> Self {
        let guard = if guarded {
            "(? OR @@in_transaction = 0)"
        } else {
            "(? OR TRUE)"
        };
        // The takeover condition, on the row as found. `VALUES(col)` is the
        // value this statement would have inserted, so the update clause
        // needs no parameters of its own. `effect_key = VALUES(effect_key)`
        // keeps a conflict on some other unique index from updating another
        // effect's row.
        let take = format!(
            "(effect_key = VALUES(effect_key) \
             AND (fingerprint IS NULL OR VALUES(fingerprint) IS NULL OR fingerprint = VALUES(fingerprint)) \
             AND (state = 'released' \
                  OR (state = 'in_progress' AND at_most_once = 0 AND lease_expires_us <= {NOW_US})))"
        );
        // MySQL and MariaDB evaluate ODKU assignments left to right, each
        // seeing the ones before it; MariaDB's SIMULTANEOUS_ASSIGNMENT mode
        // (which a caller's session may have) makes each see the old row.
        // `claim_token = VALUES(claim_token) OR take` is right under both: left
        // to right, the token (assigned first, unique per attempt) is ours
        // exactly when the takeover happened, and if it did not, nothing was
        // assigned, so `take` still reads the old row; simultaneously, the
        // token test is false and `take` reads the old row.
        let ours = format!("(claim_token = VALUES(claim_token) OR {take})");
        let odku = format!(
            "ON DUPLICATE KEY UPDATE \
             claim_token = IF({take}, VALUES(claim_token), claim_token), \
             fence = IF({ours}, fence + 1, fence), \
             fingerprint = IF({ours}, COALESCE(fingerprint, VALUES(fingerprint)), fingerprint), \
             at_most_once = IF({ours}, VALUES(at_most_once), at_most_once), \
             updated_us = IF({ours}, VALUES(updated_us), updated_us), \
             lease_expires_us = IF({ours}, VALUES(lease_expires_us), lease_expires_us), \
             retention_us = IF({ours}, VALUES(retention_us), retention_us), \
             retain_until_us = IF({ours}, VALUES(retain_until_us), retain_until_us), \
             state = IF({ours}, 'in_progress', state)"
        );
        let insert_cols = format!(
            "INSERT INTO `{t}` (effect_key, tenant, kind, subject, state, fence, fingerprint, outcome, \
             at_most_once, claim_token, created_us, updated_us, lease_expires_us, retention_us, retain_until_us)"
        );
        let values = format!(
            "?, ?, ?, ?, 'in_progress', 1, ?, NULL, ?, ?, {NOW_US}, {NOW_US}, {NOW_US} + ?, ?, {NOW_US} + ?"
        );
        // A statement inside a transaction someone else leaked onto a pooled
        // connection would commit only with that transaction (if ever). The
        // plain claim stays an `INSERT … VALUES` (an `INSERT … SELECT` costs
        // the server more) and reports `in_tx` instead: the ledger then rolls
        // the stray transaction back, its own write with it, before anyone
        // could see it, and runs the claim again. The horizon claim is an
        // `INSERT … SELECT` anyway and carries the guard in its `WHERE`.
        let claim = format!("{insert_cols} VALUES ({values}) {odku}");
        // The horizon is checked only when the key is absent: an existing
        // record answers for itself however old the message is.
        let claim_horizon = format!(
            "{insert_cols} SELECT {values} FROM DUAL WHERE {guard} \
             AND (? + ? >= {NOW_US} OR EXISTS (SELECT 1 FROM `{t}` AS x WHERE x.effect_key = ?)) {odku}"
        );
        let in_tx = if guarded {
            "@@in_transaction"
        } else {
            "CAST(0 AS UNSIGNED)"
        };
        let returning = format!(" RETURNING {COLUMNS}, {NOW_US} AS now_us, {in_tx} AS in_tx");
        Statements {
            claim_returning: format!("{claim}{returning}"),
            claim_horizon_returning: format!("{claim_horizon}{returning}"),
            claim,
            claim_horizon,
            read_locking: format!(
                "SELECT {COLUMNS}, {NOW_US} AS now_us, {in_tx} AS in_tx FROM `{t}` WHERE effect_key = ? FOR UPDATE"
            ),
            get: format!("SELECT {COLUMNS}, {NOW_US} AS now_us FROM `{t}` WHERE effect_key = ?"),
            complete: format!(
                "UPDATE `{t}` SET state = 'completed', outcome = ?, lease_expires_us = NULL, \
                 updated_us = {NOW_US}, retain_until_us = {NOW_US} + retention_us \
                 WHERE effect_key = ? AND fence = ? AND state = 'in_progress' AND {guard}"
            ),
            release: format!(
                "UPDATE `{t}` SET state = 'released', lease_expires_us = NULL, \
                 updated_us = {NOW_US}, retain_until_us = {NOW_US} + retention_us \
                 WHERE effect_key = ? AND fence = ? AND state = 'in_progress' AND {guard}"
            ),
            renew: format!(
                "UPDATE `{t}` SET lease_expires_us = LAST_INSERT_ID({NOW_US} + ?) \
                 WHERE effect_key = ? AND fence = ? AND state = 'in_progress' AND {guard}"
            ),
            prune: format!(
                "DELETE FROM `{t}` WHERE state IN ('completed', 'released') \
                 AND retain_until_us <= {NOW_US} LIMIT ?"
            ),
            abandoned: format!(
                "SELECT {COLUMNS}, {NOW_US} AS now_us FROM `{t}` \
                 WHERE tenant = ? AND at_most_once = 1 AND state = 'in_progress' \
                 AND lease_expires_us <= {NOW_US} ORDER BY created_us LIMIT ?"
            ),
        }
    }
}

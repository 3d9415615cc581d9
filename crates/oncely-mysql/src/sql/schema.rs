//! The schema's statements (`schema.rs`): the migrations, in order, their
//! lock and bookkeeping, and the `information_schema` reads that check a
//! table found in place.

use super::{Bound, BoundScalar, horizon_table, outbox};

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
        // Version 3: the transactional outbox, `<table>_outbox` with its
        // indexes (`outbox::migration`). The ledger's tables are unchanged.
        (3, vec![outbox::migration(t)]),
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

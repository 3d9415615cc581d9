//! The hand-written baseline in SQL, on the ledger's own pool, in a table of
//! the run's own (`oncely_cli_bench_<run id>`, dropped at the end):
//!
//! - PostgreSQL: `INSERT … ON CONFLICT DO NOTHING RETURNING`, then `SELECT`
//!   on a duplicate; a batch inserts from `unnest()` arrays and reads the
//!   duplicates with `= ANY($1)`.
//! - SQLite: `INSERT … ON CONFLICT DO NOTHING` (a row changed: inserted),
//!   then `SELECT`; a batch is one multi-row `INSERT … RETURNING key`.
//! - MySQL / MariaDB: `INSERT IGNORE` (a row affected: inserted), then
//!   `SELECT`. MySQL cannot say which rows of a multi-row `INSERT IGNORE` it
//!   inserted, so a batch writes its own token in every row and reads back
//!   the keys it did not certainly win: the rows carrying its token are its.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicI64;
use std::time::Duration;

use oncely::Result;
use oncely_any::AnyPool;
use oncely_any::scratch::sql_error;
use sqlx::{AssertSqlSafe, Row};

use super::{Answer, Leased, merge, no_baseline};
use crate::server::Sample;

/// Runs the dialect's statement of `sql` (PostgreSQL, SQLite, MySQL, in
/// that order) with the same binds, in order: whether it changed one row.
macro_rules! one_row {
    ($self:expr, $sql:expr, $($bind:expr),+ $(,)?) => {{
        let [pg, sqlite, mysql] = $sql;
        let _ = (&pg, &sqlite, &mysql);
        match &$self.pool {
            Pool::Postgres(p) => sqlx::query(AssertSqlSafe(pg))$(.bind($bind))+
                .execute(p)
                .await
                .map(|done| done.rows_affected() == 1),
            Pool::Sqlite(p) => sqlx::query(AssertSqlSafe(sqlite))$(.bind($bind))+
                .execute(p)
                .await
                .map(|done| done.rows_affected() == 1),
            #[cfg(feature = "mysql")]
            Pool::MySql(p) => sqlx::query(AssertSqlSafe(mysql))$(.bind($bind))+
                .execute(p)
                .await
                .map(|done| done.rows_affected() == 1),
        }
        .map_err(|e| $self.error(e))
    }};
}

/// The ledger's pool, on a backend the baseline has SQL for.
enum Pool {
    // Both drivers are always compiled in (sqlx); a variant is built only
    // with its backend's feature.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    Sqlite(sqlx::SqlitePool),
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Postgres(sqlx::PgPool),
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
}

impl Pool {
    /// `None` for the pool of a backend this crate was built without (one
    /// that `oncely-any` has through another crate's feature).
    fn of(pool: AnyPool) -> Option<Pool> {
        match pool {
            #[cfg(feature = "sqlite")]
            AnyPool::Sqlite(p) => Some(Pool::Sqlite(p)),
            #[cfg(feature = "postgres")]
            AnyPool::Postgres(p) => Some(Pool::Postgres(p)),
            #[cfg(feature = "mysql")]
            AnyPool::MySql(p) => Some(Pool::MySql(p)),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
}

/// The baseline's table on the ledger's pool.
pub(crate) struct SqlBaseline {
    pool: Pool,
    table: String,
    /// The next MySQL batch's token (rows inserted by single claims carry 0).
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    token: AtomicI64,
}

impl SqlBaseline {
    /// Creates the run's table.
    pub(super) async fn create(pool: AnyPool, run_id: &str) -> Result<SqlBaseline> {
        let backend = pool.backend();
        let pool = Pool::of(pool).ok_or_else(|| no_baseline(backend))?;
        let table = format!("oncely_cli_bench_{run_id}");
        let ddl = match &pool {
            Pool::Sqlite(_) | Pool::Postgres(_) => {
                format!("CREATE TABLE {table} (key TEXT PRIMARY KEY, outcome TEXT NOT NULL)")
            }
            // `key` is reserved in MySQL. ASCII and binary: the keys are, and
            // a case-insensitive comparison would merge two of them.
            #[cfg(feature = "mysql")]
            Pool::MySql(_) => format!(
                "CREATE TABLE {table} (k VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PRIMARY KEY, \
                 outcome VARCHAR(255) NOT NULL, owner BIGINT NOT NULL)"
            ),
        };
        let leased = match &pool {
            Pool::Postgres(_) => format!(
                "CREATE TABLE {table}_l (key TEXT PRIMARY KEY, done BOOLEAN NOT NULL, fence BIGINT NOT NULL, \
                 lease_until TIMESTAMPTZ NOT NULL, outcome TEXT)"
            ),
            Pool::Sqlite(_) => format!(
                "CREATE TABLE {table}_l (key TEXT PRIMARY KEY, done INTEGER NOT NULL, fence INTEGER NOT NULL, \
                 lease_until INTEGER NOT NULL, outcome TEXT)"
            ),
            #[cfg(feature = "mysql")]
            Pool::MySql(_) => format!(
                "CREATE TABLE {table}_l (k VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PRIMARY KEY, \
                 done BOOLEAN NOT NULL, fence BIGINT NOT NULL, lease_until DATETIME(6) NOT NULL, \
                 outcome VARCHAR(255))"
            ),
        };
        let baseline = SqlBaseline {
            pool,
            table,
            token: AtomicI64::new(1),
        };
        baseline.exec(ddl).await?;
        baseline.exec(leased).await?;
        Ok(baseline)
    }

    pub(super) fn describe_leased(&self) -> &'static str {
        match &self.pool {
            Pool::Postgres(_) => {
                "INSERT … ON CONFLICT DO NOTHING of an in-progress row with a lease (clock_timestamp()), \
                 SELECT on a duplicate and a fenced UPDATE to take an expired lease over, a fenced UPDATE \
                 with the outcome; a duplicate in flight polls"
            }
            Pool::Sqlite(_) => {
                "INSERT … ON CONFLICT DO NOTHING of an in-progress row with a lease, SELECT on a duplicate \
                 and a fenced UPDATE to take an expired lease over, a fenced UPDATE with the outcome; a \
                 duplicate in flight polls"
            }
            #[cfg(feature = "mysql")]
            Pool::MySql(_) => {
                "INSERT IGNORE of an in-progress row with a lease (SYSDATE(6)), SELECT on a duplicate and a \
                 fenced UPDATE to take an expired lease over, a fenced UPDATE with the outcome; a duplicate \
                 in flight polls"
            }
        }
    }

    pub(super) async fn lease(&self, key: &str, len: Duration) -> Result<Leased> {
        let l = format!("{}_l", self.table);
        let ms = len.as_millis() as i64;
        // The clock in milliseconds: PostgreSQL's and MySQL's when the
        // statement runs, SQLite's of the host.
        const SQLITE_NOW: &str = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";
        let inserted = one_row!(
            self,
            [
                format!(
                    "INSERT INTO {l} (key, done, fence, lease_until) \
                     VALUES ($1, false, 1, clock_timestamp() + $2 * interval '1 millisecond') ON CONFLICT DO NOTHING"
                ),
                format!(
                    "INSERT INTO {l} (key, done, fence, lease_until) VALUES (?1, 0, 1, {SQLITE_NOW} + ?2) \
                     ON CONFLICT DO NOTHING"
                ),
                format!(
                    "INSERT IGNORE INTO {l} (k, done, fence, lease_until) \
                     VALUES (?, FALSE, 1, SYSDATE(6) + INTERVAL (? * 1000) MICROSECOND)"
                ),
            ],
            key,
            ms
        )?;
        if inserted {
            return Ok(Leased::Won(1));
        }
        let (done, fence, expired, outcome): (bool, i64, bool, Option<String>) = match &self.pool {
            Pool::Postgres(p) => {
                sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT done, fence, lease_until < clock_timestamp(), outcome FROM {l} WHERE key = $1"
                )))
                .bind(key)
                .fetch_one(p)
                .await
            }
            Pool::Sqlite(p) => {
                sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT done, fence, lease_until < {SQLITE_NOW}, outcome FROM {l} WHERE key = ?1"
                )))
                .bind(key)
                .fetch_one(p)
                .await
            }
            #[cfg(feature = "mysql")]
            Pool::MySql(p) => sqlx::query_as::<_, (bool, i64, i64, Option<String>)>(AssertSqlSafe(format!(
                "SELECT done, fence, lease_until < SYSDATE(6), outcome FROM {l} WHERE k = ?"
            )))
            .bind(key)
            .fetch_one(p)
            .await
            .map(|(d, f, e, o)| (d, f, e != 0, o)),
        }
        .map_err(|e| self.error(e))?;
        if done {
            return Ok(Leased::Done(outcome.unwrap_or_default()));
        }
        if !expired {
            return Ok(Leased::Busy);
        }
        // Binds in the order MySQL's `?` need them: the lease, the key, the
        // fence read.
        let took = one_row!(
            self,
            [
                format!(
                    "UPDATE {l} SET fence = fence + 1, lease_until = clock_timestamp() + $1 * interval '1 millisecond' \
                     WHERE key = $2 AND fence = $3 AND NOT done AND lease_until < clock_timestamp()"
                ),
                format!(
                    "UPDATE {l} SET fence = fence + 1, lease_until = {SQLITE_NOW} + ?1 \
                     WHERE key = ?2 AND fence = ?3 AND done = 0 AND lease_until < {SQLITE_NOW}"
                ),
                format!(
                    "UPDATE {l} SET fence = fence + 1, lease_until = SYSDATE(6) + INTERVAL (? * 1000) MICROSECOND \
                     WHERE k = ? AND fence = ? AND NOT done AND lease_until < SYSDATE(6)"
                ),
            ],
            ms,
            key,
            fence
        )?;
        Ok(if took {
            Leased::Won(fence as u64 + 1)
        } else {
            Leased::Busy
        })
    }

    pub(super) async fn finish(&self, key: &str, fence: u64, outcome: &str) -> Result<bool> {
        let l = format!("{}_l", self.table);
        one_row!(
            self,
            [
                format!(
                    "UPDATE {l} SET done = true, outcome = $1 WHERE key = $2 AND fence = $3 AND NOT done"
                ),
                format!("UPDATE {l} SET done = 1, outcome = ?1 WHERE key = ?2 AND fence = ?3 AND done = 0"),
                format!("UPDATE {l} SET done = TRUE, outcome = ? WHERE k = ? AND fence = ? AND NOT done"),
            ],
            outcome,
            key,
            fence as i64
        )
    }

    pub(super) fn describe(&self) -> &'static str {
        match &self.pool {
            Pool::Postgres(_) => {
                "INSERT … ON CONFLICT DO NOTHING RETURNING with the outcome, SELECT on a duplicate \
                 (batches: unnest() arrays, then SELECT … = ANY)"
            }
            Pool::Sqlite(_) => {
                "INSERT … ON CONFLICT DO NOTHING with the outcome, SELECT on a duplicate \
                 (batches: one multi-row INSERT … RETURNING, then SELECT … IN)"
            }
            #[cfg(feature = "mysql")]
            Pool::MySql(_) => {
                "INSERT IGNORE with the outcome, SELECT on a duplicate \
                 (batches: one multi-row INSERT IGNORE with a batch token, then SELECT … IN)"
            }
        }
    }

    pub(super) fn key(&self, row: &str, job: usize) -> String {
        format!("{row}:{job}")
    }

    /// The server's live counters ([`crate::server`]): PostgreSQL's next
    /// transaction id and WAL position, MariaDB's `Questions` and
    /// `Innodb_data_fsyncs`; none on SQLite (no server).
    pub(super) async fn sample(&self) -> Result<Sample> {
        match &self.pool {
            Pool::Sqlite(_) => Ok(Sample::default()),
            Pool::Postgres(p) => {
                // Neither call hands out a transaction id of its own.
                let (xid, wal): (i64, i64) = sqlx::query_as(
                    "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint, \
                     (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint",
                )
                .fetch_one(p)
                .await
                .map_err(|e| self.error(e))?;
                Ok(Sample {
                    write_transactions: Some(xid as u64),
                    wal_bytes: Some(wal as u64),
                    ..Sample::default()
                })
            }
            #[cfg(feature = "mysql")]
            Pool::MySql(p) => {
                let rows: Vec<(String, String)> = sqlx::query_as(
                    "SELECT VARIABLE_NAME, VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS \
                     WHERE VARIABLE_NAME IN ('QUESTIONS', 'INNODB_DATA_FSYNCS')",
                )
                .fetch_all(p)
                .await
                .map_err(|e| self.error(e))?;
                let value = |name: &str| {
                    rows.iter()
                        .find(|(n, _)| n.eq_ignore_ascii_case(name))
                        .and_then(|(_, v)| v.parse().ok())
                };
                Ok(Sample {
                    statements: value("QUESTIONS"),
                    fsyncs: value("INNODB_DATA_FSYNCS"),
                    ..Sample::default()
                })
            }
        }
    }

    /// Statements each [`SqlBaseline::sample`] adds to the server's count:
    /// MariaDB counts its own query in `Questions`.
    pub(super) fn own_statements(&self) -> u64 {
        match &self.pool {
            #[cfg(feature = "mysql")]
            Pool::MySql(_) => 1,
            _ => 0,
        }
    }

    fn backend(&self) -> &'static str {
        match &self.pool {
            Pool::Sqlite(_) => "sqlite",
            Pool::Postgres(_) => "postgres",
            #[cfg(feature = "mysql")]
            Pool::MySql(_) => "mysql",
        }
    }

    fn error(&self, e: sqlx::Error) -> oncely::Error {
        sql_error(self.backend(), "bench baseline", e)
    }

    async fn exec(&self, sql: String) -> Result<()> {
        let sql = AssertSqlSafe(sql);
        let done = match &self.pool {
            Pool::Sqlite(p) => sqlx::query(sql).execute(p).await.map(drop),
            Pool::Postgres(p) => sqlx::query(sql).execute(p).await.map(drop),
            #[cfg(feature = "mysql")]
            Pool::MySql(p) => sqlx::query(sql).execute(p).await.map(drop),
        };
        done.map_err(|e| self.error(e))
    }

    pub(super) async fn claim(&self, key: &str, outcome: &str) -> Result<Answer> {
        let t = &self.table;
        let inserted = match &self.pool {
            Pool::Postgres(p) => sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {t} (key, outcome) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING 1"
            )))
            .bind(key)
            .bind(outcome)
            .fetch_optional(p)
            .await
            .map(|row| row.is_some()),
            Pool::Sqlite(p) => sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {t} (key, outcome) VALUES (?1, ?2) ON CONFLICT DO NOTHING"
            )))
            .bind(key)
            .bind(outcome)
            .execute(p)
            .await
            .map(|done| done.rows_affected() == 1),
            #[cfg(feature = "mysql")]
            Pool::MySql(p) => sqlx::query(AssertSqlSafe(format!(
                "INSERT IGNORE INTO {t} (k, outcome, owner) VALUES (?, ?, 0)"
            )))
            .bind(key)
            .bind(outcome)
            .execute(p)
            .await
            .map(|done| done.rows_affected() == 1),
        }
        .map_err(|e| self.error(e))?;
        if inserted {
            return Ok(Answer::Won);
        }
        let stored: String = match &self.pool {
            Pool::Postgres(p) => {
                sqlx::query_scalar(AssertSqlSafe(format!("SELECT outcome FROM {t} WHERE key = $1")))
                    .bind(key)
                    .fetch_one(p)
                    .await
            }
            Pool::Sqlite(p) => {
                sqlx::query_scalar(AssertSqlSafe(format!("SELECT outcome FROM {t} WHERE key = ?1")))
                    .bind(key)
                    .fetch_one(p)
                    .await
            }
            #[cfg(feature = "mysql")]
            Pool::MySql(p) => {
                sqlx::query_scalar(AssertSqlSafe(format!("SELECT outcome FROM {t} WHERE k = ?")))
                    .bind(key)
                    .fetch_one(p)
                    .await
            }
        }
        .map_err(|e| self.error(e))?;
        Ok(Answer::Duplicate(stored))
    }

    pub(super) async fn claim_many(&self, items: &[(String, String)]) -> Result<Vec<Answer>> {
        let t = &self.table;
        let n = items.len();
        let keys: Vec<&str> = items.iter().map(|(k, _)| k.as_str()).collect();
        match &self.pool {
            Pool::Postgres(p) => {
                let outcomes: Vec<&str> = items.iter().map(|(_, o)| o.as_str()).collect();
                let won: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
                    "INSERT INTO {t} (key, outcome) SELECT * FROM unnest($1::text[], $2::text[]) \
                     ON CONFLICT DO NOTHING RETURNING key"
                )))
                .bind(&keys)
                .bind(&outcomes)
                .fetch_all(p)
                .await
                .map_err(|e| self.error(e))?;
                let won: HashSet<String> = won.into_iter().collect();
                let rest: Vec<&str> = keys.iter().copied().filter(|k| !won.contains(*k)).collect();
                let stored: Vec<(String, String)> = if rest.is_empty() {
                    Vec::new()
                } else {
                    sqlx::query_as(AssertSqlSafe(format!(
                        "SELECT key, outcome FROM {t} WHERE key = ANY($1)"
                    )))
                    .bind(&rest)
                    .fetch_all(p)
                    .await
                    .map_err(|e| self.error(e))?
                };
                merge(
                    items,
                    |k| won.contains(k),
                    stored.into_iter().collect(),
                    "postgres",
                )
            }
            Pool::Sqlite(p) => {
                let values = vec!["(?, ?)"; n].join(", ");
                let mut insert = sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {t} (key, outcome) VALUES {values} ON CONFLICT DO NOTHING RETURNING key"
                )));
                for (k, o) in items {
                    insert = insert.bind(k).bind(o);
                }
                let won: HashSet<String> = insert
                    .fetch_all(p)
                    .await
                    .map_err(|e| self.error(e))?
                    .iter()
                    .map(|row| row.try_get::<String, _>(0))
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|e| self.error(e))?;
                let rest: Vec<&str> = keys.iter().copied().filter(|k| !won.contains(*k)).collect();
                let mut stored = HashMap::new();
                if !rest.is_empty() {
                    let list = vec!["?"; rest.len()].join(", ");
                    let mut read = sqlx::query_as::<_, (String, String)>(AssertSqlSafe(format!(
                        "SELECT key, outcome FROM {t} WHERE key IN ({list})"
                    )));
                    for k in &rest {
                        read = read.bind(*k);
                    }
                    stored.extend(read.fetch_all(p).await.map_err(|e| self.error(e))?);
                }
                merge(items, |k| won.contains(k), stored, "sqlite")
            }
            #[cfg(feature = "mysql")]
            Pool::MySql(p) => {
                let token = self.token.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let values = vec!["(?, ?, ?)"; n].join(", ");
                let mut insert = sqlx::query(AssertSqlSafe(format!(
                    "INSERT IGNORE INTO {t} (k, outcome, owner) VALUES {values}"
                )));
                for (k, o) in items {
                    insert = insert.bind(k).bind(o).bind(token);
                }
                let inserted = insert
                    .execute(p)
                    .await
                    .map_err(|e| self.error(e))?
                    .rows_affected();
                if inserted == n as u64 {
                    return Ok(vec![Answer::Won; n]);
                }
                let list = vec!["?"; n].join(", ");
                let mut read = sqlx::query_as::<_, (String, String, i64)>(AssertSqlSafe(format!(
                    "SELECT k, outcome, owner FROM {t} WHERE k IN ({list})"
                )));
                for k in &keys {
                    read = read.bind(*k);
                }
                let rows = read.fetch_all(p).await.map_err(|e| self.error(e))?;
                // Nothing inserted: every row is someone else's, whatever
                // its token.
                let won: HashSet<String> = rows
                    .iter()
                    .filter(|(_, _, owner)| inserted > 0 && *owner == token)
                    .map(|(k, _, _)| k.clone())
                    .collect();
                let stored = rows.into_iter().map(|(k, o, _)| (k, o)).collect();
                merge(items, |k| won.contains(k), stored, "mysql")
            }
        }
    }

    pub(super) async fn remove(&self, _keys: &[String]) -> Result<()> {
        self.exec(format!("DROP TABLE IF EXISTS {}_l", self.table))
            .await?;
        self.exec(format!("DROP TABLE IF EXISTS {}", self.table)).await
    }
}

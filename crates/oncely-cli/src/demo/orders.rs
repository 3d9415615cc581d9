//! The orders table of a run, in each SQL dialect: on the ledger's own
//! database for the SQL backends, in a scratch SQLite file otherwise.

use std::sync::Arc;
use std::time::Duration;

use oncely::{Error, Result};
use oncely_any::AnyPool;
use oncely_any::scratch::sql_error;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{AssertSqlSafe, SqlitePool};

/// The orders table of one run: on the ledger's own database for the SQL
/// backends, in a scratch SQLite file otherwise (see [`run`]).
#[derive(Clone)]
pub(super) struct Orders {
    pool: Pool,
    table: Arc<str>,
}

/// The ledger's pool (or the scratch file's), on a backend the demo has SQL
/// for.
#[derive(Clone)]
enum Pool {
    // Both drivers are always compiled in (sqlx); a variant is built only
    // with its backend's feature.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    Sqlite(SqlitePool),
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Postgres(sqlx::PgPool),
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
}

/// Runs `$body` with `$p` bound to the pool of every [`Pool`] variant and
/// `$backend` to the backend's name, for queries whose SQL is the same on
/// all of them.
macro_rules! on_pool {
    ($pool:expr, |$p:ident, $backend:ident| $body:expr) => {
        match $pool {
            Pool::Sqlite($p) => {
                let $backend = "sqlite";
                $body
            }
            Pool::Postgres($p) => {
                let $backend = "postgres";
                $body
            }
            #[cfg(feature = "mysql")]
            Pool::MySql($p) => {
                let $backend = "mysql";
                $body
            }
        }
    };
}

impl Orders {
    pub(super) async fn create(pool: &AnyPool, table: &str, orders: u32) -> Result<Orders> {
        let pool = &match pool {
            #[cfg(feature = "sqlite")]
            AnyPool::Sqlite(p) => Pool::Sqlite(p.clone()),
            #[cfg(feature = "postgres")]
            AnyPool::Postgres(p) => Pool::Postgres(p.clone()),
            #[cfg(feature = "mysql")]
            AnyPool::MySql(p) => Pool::MySql(p.clone()),
            // A backend this binary was built without, compiled into
            // oncely-any by another crate's feature.
            #[allow(unreachable_patterns)]
            other => {
                return Err(Error::Config(format!(
                    "the demo has no orders table for the {} backend",
                    other.backend()
                )));
            }
        };
        // VARCHAR rather than TEXT: MySQL cannot give a TEXT column a plain
        // string type, and the other two treat both alike.
        let create = format!("CREATE TABLE {table} (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL)");
        exec(pool, create).await?;
        let ids: Vec<u32> = (1..=orders).collect();
        // Literal integers only, so a multi-row insert needs no bind limit.
        for chunk in ids.chunks(500) {
            let values: Vec<String> = chunk.iter().map(|id| format!("({id}, 'new')")).collect();
            exec(
                pool,
                format!("INSERT INTO {table} (id, status) VALUES {}", values.join(", ")),
            )
            .await?;
        }
        Ok(Orders {
            pool: pool.clone(),
            table: table.into(),
        })
    }

    /// The backend's spelling of the first bind parameter.
    pub(super) fn param(&self) -> &'static str {
        match &self.pool {
            Pool::Sqlite(_) => "?1",
            Pool::Postgres(_) => "$1",
            #[cfg(feature = "mysql")]
            Pool::MySql(_) => "?",
        }
    }

    pub(super) async fn status(&self, order: u32) -> Result<String> {
        let sql = format!("SELECT status FROM {} WHERE id = {}", self.table, self.param());
        on_pool!(&self.pool, |p, backend| sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(i64::from(order))
            .fetch_one(p)
            .await
            .map_err(|e| db_error(backend, e)))
    }

    pub(super) async fn mark_paid(&self, order: u32) -> Result<()> {
        let sql = format!(
            "UPDATE {} SET status = 'paid' WHERE id = {}",
            self.table,
            self.param()
        );
        on_pool!(&self.pool, |p, backend| sqlx::query(AssertSqlSafe(sql))
            .bind(i64::from(order))
            .execute(p)
            .await
            .map(drop)
            .map_err(|e| db_error(backend, e)))
    }

    pub(super) async fn count_paid(&self) -> Result<u64> {
        let sql = format!("SELECT COUNT(*) FROM {} WHERE status = 'paid'", self.table);
        let n: i64 = on_pool!(&self.pool, |p, backend| sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(p)
            .await
            .map_err(|e| db_error(backend, e)))?;
        Ok(n as u64)
    }

    pub(super) async fn drop_table(&self) -> Result<()> {
        exec(&self.pool, format!("DROP TABLE IF EXISTS {}", self.table)).await
    }
}

async fn exec(pool: &Pool, sql: String) -> Result<()> {
    on_pool!(pool, |p, backend| sqlx::query(AssertSqlSafe(sql))
        .execute(p)
        .await
        .map(drop)
        .map_err(|e| db_error(backend, e)))
}

/// Maps a driver error on the orders table.
fn db_error(backend: &'static str, e: sqlx::Error) -> Error {
    sql_error(backend, "demo orders table", e)
}

/// A SQLite pool on a scratch file (WAL, a generous busy timeout so that
/// concurrent writers wait for each other instead of failing).
pub(super) async fn scratch_sqlite(path: &std::path::Path, workers: usize) -> Result<SqlitePool> {
    let opts = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    SqlitePoolOptions::new()
        .max_connections(workers.clamp(1, 16) as u32)
        .connect_with(opts)
        .await
        .map_err(|e| Error::Unavailable {
            backend: "sqlite",
            message: e.to_string(),
        })
}

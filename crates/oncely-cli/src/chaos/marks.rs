//! The pipeline's transactional step, on the SQL backends: `mark-paid`
//! inserts one row for its order in the database's own transaction, with
//! the step's claim and completion ([`oncely::Job::step_in`]), so the three
//! commit together or not at all. The run's table has no unique key on the
//! order, on purpose: a step that committed twice leaves two rows, which
//! the report counts as a duplicate. Redis and NATS have no transaction to
//! share with a business write; there the step is not run (`marks: null`).

use std::collections::HashMap;
use std::sync::Mutex;

use oncely::backend::TransactionalLedger;
use oncely::{ClaimOptions, EffectKey, Effects, Error, Failure, Result, StepFuture, Tenant};
use sqlx::AssertSqlSafe;

use oncely_any::AnyLedger;

/// An endpoint's ledger as the transactional step needs it.
pub(super) enum Marks {
    /// SQLite.
    #[cfg(feature = "sqlite")]
    Sqlite(Effects<oncely_sqlite::SqliteLedger>),
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(Effects<oncely_postgres::PgLedger>),
    /// MySQL or MariaDB (Galera included).
    #[cfg(feature = "mysql")]
    MySql(Effects<oncely_mysql::MySqlLedger>),
}

/// Runs `$body` with `$effects` bound to the endpoint's [`Effects`], `$db`
/// to its sqlx database type and `$p` to the spelling of bind parameter
/// `n` (`$p(1)`).
macro_rules! on_marks {
    ($marks:expr, |$effects:ident, $p:ident| $body:expr) => {
        match $marks {
            #[cfg(feature = "sqlite")]
            Marks::Sqlite($effects) => {
                let $p = |n: usize| format!("?{n}");
                $body
            }
            #[cfg(feature = "postgres")]
            Marks::Postgres($effects) => {
                let $p = |n: usize| format!("${n}");
                $body
            }
            #[cfg(feature = "mysql")]
            Marks::MySql($effects) => {
                let $p = |_: usize| "?".to_owned();
                $body
            }
        }
    };
}

impl Marks {
    /// The same ledger (its pool shared), where its backend has
    /// transactions; `None` for Redis, NATS and memory.
    pub(super) fn of(ledger: &AnyLedger) -> Option<Marks> {
        match ledger {
            #[cfg(feature = "sqlite")]
            AnyLedger::Sqlite(l) => Some(Marks::Sqlite(Effects::new(l.clone()))),
            #[cfg(feature = "postgres")]
            AnyLedger::Postgres(l) => Some(Marks::Postgres(Effects::new(l.clone()))),
            #[cfg(feature = "mysql")]
            AnyLedger::MySql(l) => Some(Marks::MySql(Effects::new(l.clone()))),
            _ => None,
        }
    }

    /// Creates the run's table (a row per committed mark).
    pub(super) async fn create(&self, table: &str) -> Result<()> {
        let key = match self {
            #[cfg(feature = "sqlite")]
            Marks::Sqlite(_) => "INTEGER PRIMARY KEY",
            #[cfg(feature = "postgres")]
            Marks::Postgres(_) => "BIGSERIAL PRIMARY KEY",
            #[cfg(feature = "mysql")]
            Marks::MySql(_) => "BIGINT AUTO_INCREMENT PRIMARY KEY",
        };
        // A primary key of its own, as Galera needs for row replication; none
        // on the order, so a second commit of one step would show.
        let sql = format!("CREATE TABLE {table} (id {key}, order_id BIGINT NOT NULL, fence BIGINT NOT NULL)");
        on_marks!(self, |effects, _p| sqlx::query(AssertSqlSafe(sql))
            .execute(effects.ledger().pool())
            .await
            .map(drop)
            .map_err(app_error))
    }

    /// One delivery's `mark-paid` step: begin, claim the step in the
    /// transaction, insert the order's row with the step's fence, complete,
    /// commit. The step's key and fence go to `ran` when its handler ran.
    pub(super) async fn mark(
        &self,
        table: &str,
        tenant: &Tenant,
        opts: &ClaimOptions,
        order: u32,
        ran: &Mutex<Option<(EffectKey, u64)>>,
    ) -> Result<()> {
        let subject = format!("order-{order}");
        on_marks!(self, |effects, p| {
            let insert = format!(
                "INSERT INTO {table} (order_id, fence) VALUES ({}, {})",
                p(1),
                p(2)
            );
            let job = effects.job(tenant, "payment", &subject).options(opts.clone());
            let ledger = effects.ledger();
            let mut tx = ledger.begin().await?;
            let marked = job
                .step_in("mark-paid", &mut *tx, |conn, ctx| {
                    *ran.lock().unwrap_or_else(|p| p.into_inner()) = Some((ctx.key().clone(), ctx.fence()));
                    Box::pin(async move {
                        sqlx::query(AssertSqlSafe(insert))
                            .bind(i64::from(order))
                            .bind(i64::try_from(ctx.fence()).unwrap_or(i64::MAX))
                            .execute(&mut *conn)
                            .await?;
                        Ok::<_, Failure>(())
                    }) as StepFuture<'_, ()>
                })
                .await;
            let committed = match marked {
                Ok(()) => ledger.commit(tx).await,
                Err(e) => {
                    // Nothing of the step was committed: the claim, the row
                    // and the completion roll back together.
                    ran.lock().unwrap_or_else(|p| p.into_inner()).take();
                    let _ = ledger.rollback(tx).await;
                    return Err(e);
                }
            };
            if committed.is_err() {
                // Not acknowledged: the commit may or may not have happened;
                // the redelivery finds out from the record.
                ran.lock().unwrap_or_else(|p| p.into_inner()).take();
            }
            committed
        })
    }

    /// How many rows each order has: one per committed mark.
    pub(super) async fn counts(&self, table: &str) -> Result<HashMap<u32, u64>> {
        let sql = format!("SELECT order_id, COUNT(*) FROM {table} GROUP BY order_id");
        let rows: Vec<(i64, i64)> = on_marks!(self, |effects, _p| sqlx::query_as(AssertSqlSafe(sql))
            .fetch_all(effects.ledger().pool())
            .await
            .map_err(app_error))?;
        Ok(rows
            .into_iter()
            .map(|(order, n)| (order as u32, n as u64))
            .collect())
    }

    /// Drops the run's table (best effort: the run's answer is already read).
    pub(super) async fn drop_table(&self, table: &str) {
        let sql = format!("DROP TABLE IF EXISTS {table}");
        let _ = on_marks!(self, |effects, _p| sqlx::query(AssertSqlSafe(sql))
            .execute(effects.ledger().pool())
            .await
            .map(drop));
    }
}

/// A failure of the run's own statements (not the ledger's): retryable, as
/// a node that went away is.
fn app_error(e: sqlx::Error) -> Error {
    Error::Unavailable {
        backend: "chaos",
        message: e.to_string(),
    }
}

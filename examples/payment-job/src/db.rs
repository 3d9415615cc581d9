//! The orders table and the ledger on one database: the little SQL the job
//! needs, once per backend.

use std::future::Future;

use oncely::backend::TransactionalLedger;
use oncely::{Error, StepFuture};
use oncely_postgres::PgLedger;
use oncely_sqlite::SqliteLedger;

/// One row of `payment_orders`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Order {
    /// The order id.
    pub id: String,
    /// The amount, in cents.
    pub amount: i64,
    /// `pending` or `paid`.
    pub status: String,
    /// The provider's charge, once paid.
    pub charge_id: Option<String>,
    /// The fence of the last lease that wrote the row (0: none yet).
    pub fence: i64,
    /// How many times the mark-paid write was applied (exactly once is the
    /// point of the transactional step).
    pub paid_writes: i64,
}

/// A ledger whose database also holds the orders. Transactions come from
/// [`TransactionalLedger::begin`] and end with its `commit`.
pub trait Db: TransactionalLedger + Clone + Send + Sync + 'static {
    /// Creates `payment_orders` if it is missing.
    fn create_orders(&self) -> impl Future<Output = anyhow::Result<()>> + Send;

    /// Inserts a pending order (or leaves an existing one alone).
    fn insert_order(&self, id: &str, amount: i64) -> impl Future<Output = anyhow::Result<()>> + Send;

    /// The fenced, fixed-value write: marks the order paid unless a holder
    /// with this fence or a later one already wrote it. Returns the number
    /// of rows changed (0 for a stale fence).
    fn mark_paid<'c>(
        conn: &'c mut Self::Connection,
        id: &str,
        charge_id: &str,
        fence: u64,
    ) -> StepFuture<'c, u64>;

    /// The rows of these orders, in the given order.
    fn orders(&self, ids: &[String]) -> impl Future<Output = anyhow::Result<Vec<Order>>> + Send;
}

fn app_error(e: sqlx::Error) -> Error {
    Error::Backend {
        backend: "app",
        message: e.to_string(),
        retryable: true,
    }
}

fn fence_param(fence: u64) -> i64 {
    i64::try_from(fence).unwrap_or(i64::MAX)
}

const SQLITE_CREATE: &str = "CREATE TABLE IF NOT EXISTS payment_orders (
    id TEXT PRIMARY KEY,
    amount INTEGER NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending',
    charge_id TEXT,
    fence INTEGER NOT NULL DEFAULT 0,
    paid_writes INTEGER NOT NULL DEFAULT 0
)";

const PG_CREATE: &str = "CREATE TABLE IF NOT EXISTS payment_orders (
    id TEXT PRIMARY KEY,
    amount BIGINT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending',
    charge_id TEXT,
    fence BIGINT NOT NULL DEFAULT 0,
    paid_writes BIGINT NOT NULL DEFAULT 0
)";

impl Db for SqliteLedger {
    async fn create_orders(&self) -> anyhow::Result<()> {
        sqlx::query(SQLITE_CREATE).execute(self.pool()).await?;
        Ok(())
    }

    async fn insert_order(&self, id: &str, amount: i64) -> anyhow::Result<()> {
        sqlx::query("INSERT INTO payment_orders (id, amount) VALUES (?1, ?2) ON CONFLICT (id) DO NOTHING")
            .bind(id)
            .bind(amount)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    fn mark_paid<'c>(
        conn: &'c mut sqlx::SqliteConnection,
        id: &str,
        charge_id: &str,
        fence: u64,
    ) -> StepFuture<'c, u64> {
        let (id, charge_id) = (id.to_owned(), charge_id.to_owned());
        Box::pin(async move {
            let done = sqlx::query(
                "UPDATE payment_orders SET status = 'paid', charge_id = ?2, fence = ?3, paid_writes = paid_writes + 1
                 WHERE id = ?1 AND fence < ?3",
            )
            .bind(id)
            .bind(charge_id)
            .bind(fence_param(fence))
            .execute(&mut *conn)
            .await
            .map_err(app_error)?;
            Ok(done.rows_affected())
        })
    }

    async fn orders(&self, ids: &[String]) -> anyhow::Result<Vec<Order>> {
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let row: (String, i64, String, Option<String>, i64, i64) = sqlx::query_as(
                "SELECT id, amount, status, charge_id, fence, paid_writes FROM payment_orders WHERE id = ?1",
            )
            .bind(id)
            .fetch_one(self.pool())
            .await?;
            out.push(order(row));
        }
        Ok(out)
    }
}

impl Db for PgLedger {
    async fn create_orders(&self) -> anyhow::Result<()> {
        // Concurrent test binaries may race to create it; the advisory lock
        // keeps CREATE TABLE IF NOT EXISTS from failing on the catalog.
        let mut tx = self.pool().begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('payment_orders'))")
            .execute(&mut *tx)
            .await?;
        sqlx::query(PG_CREATE).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn insert_order(&self, id: &str, amount: i64) -> anyhow::Result<()> {
        sqlx::query("INSERT INTO payment_orders (id, amount) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING")
            .bind(id)
            .bind(amount)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    fn mark_paid<'c>(
        conn: &'c mut sqlx::PgConnection,
        id: &str,
        charge_id: &str,
        fence: u64,
    ) -> StepFuture<'c, u64> {
        let (id, charge_id) = (id.to_owned(), charge_id.to_owned());
        Box::pin(async move {
            let done = sqlx::query(
                "UPDATE payment_orders SET status = 'paid', charge_id = $2, fence = $3, paid_writes = paid_writes + 1
                 WHERE id = $1 AND fence < $3",
            )
            .bind(id)
            .bind(charge_id)
            .bind(fence_param(fence))
            .execute(&mut *conn)
            .await
            .map_err(app_error)?;
            Ok(done.rows_affected())
        })
    }

    async fn orders(&self, ids: &[String]) -> anyhow::Result<Vec<Order>> {
        let rows: Vec<(String, i64, String, Option<String>, i64, i64)> = sqlx::query_as(
            "SELECT o.id, o.amount, o.status, o.charge_id, o.fence, o.paid_writes
             FROM unnest($1::text[]) WITH ORDINALITY AS want(id, n)
             JOIN payment_orders o ON o.id = want.id ORDER BY want.n",
        )
        .bind(ids)
        .fetch_all(self.pool())
        .await?;
        Ok(rows.into_iter().map(order).collect())
    }
}

fn order(
    (id, amount, status, charge_id, fence, paid_writes): (String, i64, String, Option<String>, i64, i64),
) -> Order {
    Order {
        id,
        amount,
        status,
        charge_id,
        fence,
        paid_writes,
    }
}

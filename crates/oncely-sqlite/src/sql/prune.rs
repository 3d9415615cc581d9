//! One prune batch (the clock, the delete, the horizon it raises) and the
//! horizon watermark of a tenant and kind.

use oncely::Tenant;
use sqlx::query::{QueryAs, QueryScalar};
use sqlx::sqlite::SqliteArguments;
use sqlx::{AssertSqlSafe, Sqlite};

use super::{Bound, Queries};

impl Queries {
    /// The database clock (µs), prune's cutoff.
    pub(crate) fn bind_now(&self) -> QueryScalar<'static, Sqlite, i64, SqliteArguments> {
        sqlx::query_scalar(AssertSqlSafe(self.now.clone()))
    }

    /// One prune batch of at most `batch` records retained until before
    /// `cutoff`: the deleted records' tenant, kind and creation time (µs).
    pub(crate) fn bind_prune(
        &self,
        batch: i64,
        cutoff: i64,
    ) -> QueryAs<'static, Sqlite, (String, String, i64), SqliteArguments> {
        sqlx::query_as(AssertSqlSafe(self.prune.clone()))
            .bind(batch)
            .bind(cutoff)
    }

    /// Raises the watermark of a tenant and kind to `watermark` (µs).
    pub(crate) fn bind_prune_horizon(&self, tenant: &str, kind: &str, watermark: i64) -> Bound {
        sqlx::query(AssertSqlSafe(self.prune_horizon.clone()))
            .bind(tenant)
            .bind(kind)
            .bind(watermark)
    }

    /// The watermark of a tenant and kind (µs); no row when there is none.
    pub(crate) fn bind_horizon<'q>(
        &self,
        tenant: &'q Tenant,
        kind: &'q str,
    ) -> QueryScalar<'q, Sqlite, i64, SqliteArguments> {
        sqlx::query_scalar(AssertSqlSafe(self.horizon.clone()))
            .bind(tenant.as_str())
            .bind(kind)
    }
}

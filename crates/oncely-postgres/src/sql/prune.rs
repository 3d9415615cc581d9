//! One prune batch and its counts; the horizon watermark of a tenant and
//! kind.

use oncely::{Result, Tenant};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgRow;

use super::decode::{get, micros_opt};
use super::{Bound, Queries};

impl Queries {
    /// One prune batch of at most `batch` records, from `from` (µs): one
    /// row of counts.
    pub(crate) fn bind_prune(&self, batch: i64, from: Option<i64>) -> Bound {
        sqlx::query(AssertSqlSafe(self.prune.clone()))
            .bind(batch)
            .bind(from)
    }

    /// The watermark of a tenant and kind: one row.
    pub(crate) fn bind_horizon(&self, tenant: &Tenant, kind: &str) -> Bound {
        sqlx::query(AssertSqlSafe(self.horizon.clone()))
            .bind(tenant.as_str())
            .bind(kind)
    }
}

/// How many records a prune batch found past retention and unlocked, and
/// how many it deleted.
pub(crate) fn prune_counts(row: &PgRow) -> Result<(u64, u64, Option<i64>)> {
    let count = |column| get::<i64>(row, column).map(|n| u64::try_from(n).unwrap_or(0));
    Ok((count("candidates")?, count("deleted")?, get(row, "last")?))
}

/// The watermark of a `horizon` row, in microseconds.
pub(crate) fn watermark(row: &PgRow) -> Result<Option<i64>> {
    micros_opt(row, "watermark")
}

//! The fenced writes (complete, the batch completion, release, renew) and
//! their rows: what was written, and whether the leaked-transaction guard
//! passed (also the `probe`'s row).

use oncely::backend::Outcome;
use oncely::{EffectKey, Result};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgRow;

use super::decode::get;
use super::{Bound, Queries};

impl Queries {
    /// A completion fenced by `fence` (`complete`, or `complete_in` in a
    /// caller's transaction, unguarded): the written row, or none.
    pub(crate) fn bind_complete(
        &self,
        key: &EffectKey,
        fence: i64,
        outcome: &Outcome,
        guarded: bool,
    ) -> Bound {
        let text = if guarded {
            &self.complete
        } else {
            &self.complete_in
        };
        sqlx::query(AssertSqlSafe(text.clone()))
            .bind(key.as_str())
            .bind(fence)
            .bind(outcome.as_bytes())
            .bind(guarded)
    }

    /// A waiter's mark on `key` (see `watch_mark`): a row when it wrote.
    pub(crate) fn bind_watch_mark(&self, key: &EffectKey) -> Bound {
        sqlx::query(AssertSqlSafe(self.watch_mark.clone()))
            .bind(key.as_str())
            .bind(true)
    }

    /// The batch completion: one row per lease it completed.
    pub(crate) fn bind_complete_many(&self, keys: &[&str], fences: &[i64], outcomes: &[&[u8]]) -> Bound {
        sqlx::query(AssertSqlSafe(self.complete_many.clone()))
            .bind(keys)
            .bind(fences)
            .bind(outcomes)
            .bind(true)
    }

    /// A release fenced by `fence`: the written row, or none.
    pub(crate) fn bind_release(&self, key: &EffectKey, fence: i64, guarded: bool) -> Bound {
        sqlx::query(AssertSqlSafe(self.release.clone()))
            .bind(key.as_str())
            .bind(fence)
            .bind(guarded)
    }

    /// A renewal by `extend_us` fenced by `fence`: the written row, or none.
    pub(crate) fn bind_renew(&self, key: &EffectKey, fence: i64, extend_us: i64, guarded: bool) -> Bound {
        sqlx::query(AssertSqlSafe(self.renew.clone()))
            .bind(key.as_str())
            .bind(fence)
            .bind(extend_us)
            .bind(guarded)
    }
}

/// A fenced write's value column (the new expiry for renew).
pub(crate) fn written(row: &PgRow) -> Result<i64> {
    get(row, "value")
}

/// Whether a waiter marked the record a fenced write (or a row of
/// `complete_many`) wrote: then its end is announced (see `watch_mark`).
pub(crate) fn watched(row: &PgRow) -> Result<bool> {
    Ok(get::<Option<bool>>(row, "watched")?.unwrap_or(false))
}

/// The (key, fence) a `complete_many` row reports completed, if any (the
/// row of a batch that completed nothing has neither).
pub(crate) fn completed(row: &PgRow) -> Result<Option<(String, i64)>> {
    let key: Option<String> = get(row, "key")?;
    let fence: Option<i64> = get(row, "fence")?;
    Ok(key.zip(fence))
}

/// Whether the leaked-transaction guard (column `ok`) passed.
pub(crate) fn guard_ok(row: &PgRow) -> Result<bool> {
    get(row, "ok")
}

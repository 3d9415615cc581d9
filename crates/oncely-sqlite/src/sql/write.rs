//! The fenced writes (complete, the batch completion, release, renew), the
//! fence as they bind it, and the renewed lease's row.

use std::time::SystemTime;

use oncely::backend::{Outcome, from_micros};
use oncely::{EffectKey, Result};
use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Row};

use super::{Bound, Queries};
use crate::error::map;

impl Queries {
    /// A completion fenced by `fence`: one row changed, or none.
    pub(crate) fn bind_complete(&self, key: &EffectKey, fence: i64, outcome: &Outcome) -> Bound {
        sqlx::query(AssertSqlSafe(self.complete.clone()))
            .bind(key.as_str())
            .bind(fence)
            .bind(outcome.as_bytes())
    }

    /// The batch completion: `parts_json` (each lease's key, fence and its
    /// outcome's place in `outcomes`) and the outcomes end to end; one row
    /// per lease completed.
    pub(crate) fn bind_complete_many(&self, parts_json: String, outcomes: Vec<u8>) -> Bound {
        sqlx::query(AssertSqlSafe(self.complete_many.clone()))
            .bind(parts_json)
            .bind(outcomes)
    }

    /// A release fenced by `fence`: one row changed, or none.
    pub(crate) fn bind_release(&self, key: &EffectKey, fence: i64) -> Bound {
        sqlx::query(AssertSqlSafe(self.release.clone()))
            .bind(key.as_str())
            .bind(fence)
    }

    /// A renewal by `extend_us` fenced by `fence`: the new lease end's row,
    /// or none.
    pub(crate) fn bind_renew(&self, key: &EffectKey, fence: i64, extend_us: i64) -> Bound {
        sqlx::query(AssertSqlSafe(self.renew.clone()))
            .bind(key.as_str())
            .bind(fence)
            .bind(extend_us)
    }
}

/// A fence as bound to a statement.
pub(crate) fn fence_param(fence: u64) -> i64 {
    // Fences are clock microseconds (about 2^51 today); one past i64::MAX
    // matches no stored row, so it is reported as lost like any other stale
    // fence.
    i64::try_from(fence).unwrap_or(-1)
}

/// The new end of a renewed lease, from the renew statement's row.
pub(crate) fn renewed_until(row: &SqliteRow) -> Result<SystemTime> {
    Ok(from_micros(row.try_get("lease_expires_at").map_err(map)?))
}

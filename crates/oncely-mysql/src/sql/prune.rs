//! Prune's statements and their rows; the horizon watermark of a tenant
//! and kind.

use std::collections::BTreeMap;

use oncely::Tenant;
use sqlx::mysql::MySqlRow;
use sqlx::{AssertSqlSafe, Row};

use super::{Bound, BoundScalar, Statements, query};

/// A row of [`Statements::prune_candidates`]: a prunable key, with its
/// tenant and kind.
#[derive(Debug)]
pub(crate) struct Candidate {
    pub key: String,
    pub tenant: String,
    pub kind: String,
}

impl Candidate {
    /// Reads a row of [`Statements::bind_prune_candidates`] by column name.
    pub(crate) fn read(row: &MySqlRow) -> std::result::Result<Self, sqlx::Error> {
        Ok(Candidate {
            key: row.try_get("effect_key")?,
            tenant: row.try_get("tenant")?,
            kind: row.try_get("kind")?,
        })
    }
}

/// A row of [`Statements::prune_lock`]: a key locked for deletion, with its
/// tenant, kind and creation time (µs).
#[derive(Debug)]
pub(crate) struct Doomed {
    pub key: String,
    pub tenant: String,
    pub kind: String,
    pub created_us: i64,
}

impl Doomed {
    /// Reads a row of [`Statements::bind_prune_lock`] by column name.
    pub(crate) fn read(row: &MySqlRow) -> std::result::Result<Self, sqlx::Error> {
        Ok(Doomed {
            key: row.try_get("effect_key")?,
            created_us: row.try_get("created_us")?,
            tenant: row.try_get("tenant")?,
            kind: row.try_get("kind")?,
        })
    }
}

/// Prune's statements, in the order a batch runs them (`prune.rs`).
impl Statements {
    /// [`Statements::prune_candidates`]: at most `limit` [`Candidate`] rows.
    pub(crate) fn bind_prune_candidates(&self, limit: u64) -> Bound {
        query(&self.prune_candidates).bind(limit)
    }

    /// [`Statements::watermark_upsert`] of (tenant, kind) → watermark
    /// (`None` only locks the row), in the map's order. No rows.
    pub(crate) fn bind_watermark_upsert(&self, marks: &BTreeMap<(String, String), Option<i64>>) -> Bound {
        marks.iter().fold(
            query(&self.watermark_upsert(marks.len())),
            |q, ((tenant, kind), w)| q.bind(tenant.as_str()).bind(kind.as_str()).bind(*w),
        )
    }

    /// [`Statements::prune_lock`] of `keys`, sorted by the caller: a
    /// [`Doomed`] row per key still prunable.
    pub(crate) fn bind_prune_lock(&self, keys: &[String]) -> Bound {
        keys.iter()
            .fold(query(&self.prune_lock(keys.len())), |q, k| q.bind(k.as_str()))
    }

    /// [`Statements::prune_delete`] of `keys`. No rows.
    pub(crate) fn bind_prune_delete(&self, keys: &[String]) -> Bound {
        keys.iter()
            .fold(query(&self.prune_delete(keys.len())), |q, k| q.bind(k.as_str()))
    }

    /// [`Statements::prunable`]: one count.
    pub(crate) fn bind_prunable(&self) -> BoundScalar<i64> {
        sqlx::query_scalar(AssertSqlSafe(self.prunable.as_str()))
    }
}

/// The horizon's statement.
impl Statements {
    /// [`Statements::horizon`] of `tenant` and `kind`: the watermark (µs),
    /// NULL or no row when there is none.
    pub(crate) fn bind_horizon(&self, tenant: &Tenant, kind: &str) -> BoundScalar<Option<i64>> {
        // `QueryScalar::bind` keeps its values for the query's lifetime:
        // owned, so the bound statement borrows nothing.
        sqlx::query_scalar(AssertSqlSafe(self.horizon.as_str()))
            .bind(tenant.as_str().to_owned())
            .bind(kind.to_owned())
    }
}

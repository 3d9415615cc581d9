//! Reading records: `get` and `abandoned`, and [`record`], which decodes
//! the record columns every read returns (`RECORD_COLUMNS`, then `now`).

use std::time::SystemTime;

use oncely::backend::{Fingerprint, Outcome, Record, RecordState, effective_state, from_micros};
use oncely::{EffectKey, Result, Tenant};
use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Row};

use super::{Bound, Queries};
use crate::error::{corrupt, map};

impl Queries {
    /// One key's record row, or none.
    pub(crate) fn bind_get(&self, key: &EffectKey) -> Bound {
        sqlx::query(AssertSqlSafe(self.get.clone())).bind(key.as_str())
    }

    /// A tenant's abandoned steps, at most `limit`: record rows.
    pub(crate) fn bind_abandoned(&self, tenant: &Tenant, limit: i64) -> Bound {
        sqlx::query(AssertSqlSafe(self.abandoned.clone()))
            .bind(tenant.as_str())
            .bind(limit)
    }
}

/// Decodes the columns of `sql::RECORD_COLUMNS` plus `now`, by name. An
/// expired at-most-once lease is reported as [`RecordState::Abandoned`].
pub(crate) fn record(row: &SqliteRow) -> Result<Record> {
    let stored: String = row.try_get("key").map_err(map)?;
    let tenant: String = row.try_get("tenant").map_err(map)?;
    let kind: String = row.try_get("kind").map_err(map)?;
    let subject: String = row.try_get("subject").map_err(map)?;
    let key = Tenant::parse(&tenant)
        .and_then(|t| EffectKey::new(&t, &kind, &subject))
        .map_err(|e| corrupt(format!("row {stored:?}: {e}")))?;
    if key.as_str() != stored {
        return Err(corrupt(format!("row {stored:?} has parts of {key}")));
    }
    let state: String = row.try_get("state").map_err(map)?;
    let state = RecordState::parse(&state).map_err(|e| corrupt(format!("row {stored:?}: {e}")))?;
    let fingerprint = row
        .try_get::<Option<Vec<u8>>, _>("fingerprint")
        .map_err(map)?
        .map(|b| Fingerprint::from_bytes(&b))
        .transpose()
        .map_err(|e| corrupt(format!("row {stored:?}: {e}")))?;
    let outcome = row
        .try_get::<Option<Vec<u8>>, _>("outcome")
        .map_err(map)?
        .map(Outcome::from_bytes)
        .transpose()
        .map_err(|e| corrupt(format!("row {stored:?}: {e}")))?;
    let at_most_once: bool = row.try_get("at_most_once").map_err(map)?;
    let ts = |column: &str| -> Result<SystemTime> { Ok(from_micros(row.try_get(column).map_err(map)?)) };
    let lease_expires_at = row
        .try_get::<Option<i64>, _>("lease_expires_at")
        .map_err(map)?
        .map(from_micros);
    let read_at = ts("now")?;
    Ok(Record {
        key,
        state: effective_state(state, at_most_once, lease_expires_at, read_at),
        fence: fence_from(row.try_get("fence").map_err(map)?)?,
        fingerprint,
        outcome,
        at_most_once,
        created_at: ts("created_at")?,
        updated_at: ts("updated_at")?,
        lease_expires_at,
        retain_until: ts("retain_until")?,
        read_at,
    })
}

pub(super) fn fence_from(v: i64) -> Result<u64> {
    u64::try_from(v).map_err(|_| corrupt(format!("negative fence {v}")))
}

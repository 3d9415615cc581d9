//! Reading records: `get` and `abandoned`, and [`RecordRow`], the record
//! columns every read returns (`cols`) decoded into a [`Record`].

use oncely::backend::{Fingerprint, Outcome, Record, RecordState, effective_state, from_micros};
use oncely::{EffectKey, Result, Tenant};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgRow;

use super::decode::{get, micros, micros_opt};
use super::{Bound, Queries};
use crate::error::corrupt;

impl Queries {
    /// One key's record: one `RecordRow` (with `has_record`).
    pub(crate) fn bind_get(&self, key: &EffectKey) -> Bound {
        sqlx::query(AssertSqlSafe(self.get.clone())).bind(key.as_str())
    }

    /// A tenant's abandoned steps, at most `limit`: `RecordRow`s.
    pub(crate) fn bind_abandoned(&self, tenant: &Tenant, limit: i64) -> Bound {
        sqlx::query(AssertSqlSafe(self.abandoned.clone()))
            .bind(tenant.as_str())
            .bind(limit)
    }
}

/// The record columns of `sql`'s `cols`.
pub(crate) struct RecordRow {
    state: String,
    fence: i64,
    fingerprint: Option<Vec<u8>>,
    outcome: Option<Vec<u8>>,
    at_most_once: bool,
    created_us: i64,
    updated_us: i64,
    lease_us: Option<i64>,
    retain_us: i64,
    now_us: i64,
}

impl RecordRow {
    /// The record columns of `row`.
    pub(crate) fn decode(row: &PgRow) -> Result<Self> {
        Ok(RecordRow {
            state: get(row, "state")?,
            fence: get(row, "fence")?,
            fingerprint: get(row, "fingerprint")?,
            outcome: get(row, "outcome")?,
            at_most_once: get(row, "at_most_once")?,
            created_us: micros(row, "created_at")?,
            updated_us: micros(row, "updated_at")?,
            lease_us: micros_opt(row, "lease_expires_at")?,
            retain_us: micros(row, "retain_until")?,
            now_us: micros(row, "now")?,
        })
    }

    /// The record as the contract reports it (an expired at-most-once lease
    /// is [`RecordState::Abandoned`]), read at the row's clock.
    pub(crate) fn record(self, key: EffectKey) -> Result<Record> {
        let stored = RecordState::parse(&self.state).map_err(|e| corrupt(format!("{key}: {e}")))?;
        let read_at = from_micros(self.now_us);
        let lease_expires_at = self.lease_us.map(from_micros);
        Ok(Record {
            state: effective_state(stored, self.at_most_once, lease_expires_at, read_at),
            fence: u64::try_from(self.fence).map_err(|_| corrupt(format!("{key}: fence {}", self.fence)))?,
            fingerprint: self
                .fingerprint
                .map(|f| Fingerprint::from_bytes(&f))
                .transpose()
                .map_err(|e| corrupt(format!("{key}: {e}")))?,
            outcome: self
                .outcome
                .map(Outcome::from_bytes)
                .transpose()
                .map_err(|e| corrupt(format!("{key}: {e}")))?,
            at_most_once: self.at_most_once,
            created_at: from_micros(self.created_us),
            updated_at: from_micros(self.updated_us),
            lease_expires_at,
            retain_until: from_micros(self.retain_us),
            read_at,
            key,
        })
    }
}

/// Whether the row of `get` found a record (its `state` is set).
pub(crate) fn has_record(row: &PgRow) -> Result<bool> {
    get::<Option<String>>(row, "state").map(|s| s.is_some())
}

/// The stored key of an `abandoned` row.
pub(crate) fn key(row: &PgRow) -> Result<EffectKey> {
    let k: String = get(row, "key")?;
    EffectKey::parse(&k).map_err(|e| corrupt(format!("stored key {k:?}: {e}")))
}

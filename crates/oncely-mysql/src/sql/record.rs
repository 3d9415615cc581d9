//! Reading records: `get` and `abandoned`, and [`Stored`], the row as
//! stored that every statement reading a record returns ([`stored`]).

use oncely::backend::{Fingerprint, Outcome, Record, RecordState, effective_state, from_micros};
use oncely::{EffectKey, Result, Tenant};
use sqlx::Row;
use sqlx::mysql::MySqlRow;

use super::{Bound, Statements, query};
use crate::error::corrupt;

/// The rows of [`Statements::peek`], the claim statements, their
/// read-backs, [`Statements::get`], [`Statements::abandoned`] and
/// [`records`](super::records): a row as stored, plus the server's clock at the read
/// (`now_us`) and, for the statements that read it, the horizon of the
/// row's tenant and kind. Read by column name ([`stored`]).
#[derive(Debug)]
pub(crate) struct Stored {
    pub key: String,
    pub state: RecordState,
    pub fence: u64,
    pub fingerprint: Option<Vec<u8>>,
    pub outcome: Option<Vec<u8>>,
    pub at_most_once: bool,
    pub token: Vec<u8>,
    pub created_us: i64,
    pub updated_us: i64,
    pub lease_expires_us: Option<i64>,
    pub retain_until_us: i64,
    pub now_us: i64,
    /// Whether the statement ran inside an open transaction (claims only).
    pub in_tx: bool,
    /// The watermark read after the write (claims with `sent_at` only).
    pub horizon_us: Option<i64>,
}

/// Reads a [`Stored`] row by column name; `in_tx` and `horizon`: whether
/// the statement returned those columns (the claim statements, their
/// read-backs and [`Statements::peek`] return `in_tx`; the `_h` forms
/// `horizon_us`).
pub(crate) fn stored(row: &MySqlRow, in_tx: bool, horizon: bool) -> Result<Stored> {
    let g = |e: sqlx::Error| corrupt(format!("unreadable ledger row: {e}"));
    let state: String = row.try_get("state").map_err(g)?;
    Ok(Stored {
        key: row.try_get("effect_key").map_err(g)?,
        state: RecordState::parse(&state).map_err(|e| corrupt(e.to_string()))?,
        fence: row.try_get("fence").map_err(g)?,
        fingerprint: row.try_get("fingerprint").map_err(g)?,
        outcome: row.try_get("outcome").map_err(g)?,
        at_most_once: row.try_get("at_most_once").map_err(g)?,
        token: row.try_get("claim_token").map_err(g)?,
        created_us: row.try_get("created_us").map_err(g)?,
        updated_us: row.try_get("updated_us").map_err(g)?,
        lease_expires_us: row.try_get("lease_expires_us").map_err(g)?,
        retain_until_us: row.try_get("retain_until_us").map_err(g)?,
        now_us: row.try_get("now_us").map_err(g)?,
        in_tx: if in_tx {
            row.try_get::<u64, _>("in_tx").map_err(g)? != 0
        } else {
            false
        },
        horizon_us: if horizon {
            row.try_get("horizon_us").map_err(g)?
        } else {
            None
        },
    })
}

impl Stored {
    /// Whether this row was written by the claim attempt holding `token`.
    pub fn ours(&self, token: &[u8]) -> bool {
        self.token.as_slice() == token
    }

    /// Whether the row is a fresh insert rather than a takeover: an insert
    /// writes the statement's start as both fence and creation time, and
    /// every later grant raises the fence above it (`GREATEST(fence + 1,
    /// now)`; a version 1 row's small fence jumps to the clock).
    pub fn fresh(&self) -> bool {
        i64::try_from(self.fence).is_ok_and(|f| f == self.created_us)
    }

    /// The record, with an expired at-most-once lease reported as abandoned
    /// (the kit's rule).
    pub fn record(&self, key: Option<&EffectKey>) -> Result<Record> {
        let key = match key {
            Some(k) if k.as_str() == self.key => k.clone(),
            _ => EffectKey::parse(&self.key)
                .map_err(|e| corrupt(format!("stored key {:?} does not parse: {e}", self.key)))?,
        };
        let fingerprint = match &self.fingerprint {
            Some(b) => Some(Fingerprint::from_bytes(b).map_err(|e| corrupt(e.to_string()))?),
            None => None,
        };
        let outcome = match &self.outcome {
            Some(b) => Some(Outcome::from_bytes(b.clone()).map_err(|e| corrupt(e.to_string()))?),
            None => None,
        };
        let lease_expires_at = self.lease_expires_us.map(from_micros);
        let read_at = from_micros(self.now_us);
        Ok(Record {
            key,
            state: effective_state(self.state, self.at_most_once, lease_expires_at, read_at),
            fence: self.fence,
            fingerprint,
            outcome,
            at_most_once: self.at_most_once,
            created_at: from_micros(self.created_us),
            updated_at: from_micros(self.updated_us),
            lease_expires_at,
            retain_until: from_micros(self.retain_until_us),
            read_at,
        })
    }
}

/// `get` and `abandoned`: [`Stored`] rows without `in_tx`.
impl Statements {
    /// [`Statements::get`] of `key`: a [`Stored`] row without `in_tx`, or
    /// none.
    pub(crate) fn bind_get(&self, key: &EffectKey) -> Bound {
        query(&self.get).bind(key.as_str())
    }

    /// [`Statements::abandoned`]: `tenant`'s abandoned steps, at most
    /// `limit`, as [`Stored`] rows without `in_tx`.
    pub(crate) fn bind_abandoned(&self, tenant: &Tenant, limit: u64) -> Bound {
        query(&self.abandoned).bind(tenant.as_str()).bind(limit)
    }
}

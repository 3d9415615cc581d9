//! The batch statements (`batch.rs`): `claim_many` (the peek before it,
//! the claim, the read-back after it, the horizon's watermarks) and
//! `complete_many` (and which keys it settled), with their rows.

use oncely::backend::{Lease, Outcome};
use oncely::{ClaimOptions, EffectKey, Result};
use sqlx::Row;
use sqlx::mysql::MySqlRow;

use super::{Bound, Statements, claim_values, query};
use crate::error::corrupt;

/// `claim_many`'s statements: their rows are [`Stored`](super::Stored) rows.
impl Statements {
    /// [`Statements::peek_many`] of distinct `keys`: a [`Stored`](super::Stored) row with
    /// `in_tx` per key found, in no particular order.
    pub(crate) fn bind_peek_many(&self, keys: &[EffectKey]) -> Bound {
        keys.iter()
            .fold(query(&self.peek_many(keys.len())), |q, k| q.bind(k.as_str()))
    }

    /// [`Statements::claim_many`]: one `VALUES` row per (key, token), in
    /// order, all with `opts`. With `returning`, one [`Stored`](super::Stored) row with
    /// `in_tx` (and with `horizon`, `horizon_us`) per `VALUES` row, in
    /// order; without, no row (read them back with
    /// [`Statements::bind_read_back_many`]).
    pub(crate) fn bind_claim_many(
        &self,
        returning: bool,
        horizon: bool,
        opts: &ClaimOptions,
        rows: &[(&EffectKey, &[u8; 16])],
    ) -> Bound {
        rows.iter().fold(
            query(&self.claim_many(rows.len(), returning, horizon)),
            |q, (key, token)| claim_values(q, key, opts, token),
        )
    }

    /// [`Statements::read_back_many`] of distinct `keys`: a [`Stored`](super::Stored) row
    /// with `in_tx` (and with `horizon`, `horizon_us`) per key found, in no
    /// particular order.
    pub(crate) fn bind_read_back_many(&self, horizon: bool, keys: &[&EffectKey]) -> Bound {
        keys.iter()
            .fold(query(&self.read_back_many(keys.len(), horizon)), |q, k| {
                q.bind(k.as_str())
            })
    }
}

/// A row of [`Statements::watermarks`]: a (tenant, kind) pair's watermark
/// as committed (NULL: locked by a prune that deleted nothing there).
#[derive(Debug)]
pub(crate) struct Watermark {
    pub tenant: String,
    pub kind: String,
    pub watermark_us: Option<i64>,
}

impl Watermark {
    /// Reads a row of [`Statements::bind_watermarks`] by column name.
    pub(crate) fn read(row: &MySqlRow) -> Result<Self> {
        let g = |e: sqlx::Error| corrupt(format!("unreadable watermark row: {e}"));
        Ok(Watermark {
            tenant: row.try_get("tenant").map_err(g)?,
            kind: row.try_get("kind").map_err(g)?,
            watermark_us: row.try_get("watermark_us").map_err(g)?,
        })
    }
}

/// The horizon's batch read.
impl Statements {
    /// [`Statements::watermarks`] of distinct (tenant, kind) `pairs`: a
    /// [`Watermark`] row per pair that has a watermark row.
    pub(crate) fn bind_watermarks(&self, pairs: &[(&str, &str)]) -> Bound {
        pairs
            .iter()
            .fold(query(&self.watermarks(pairs.len())), |q, (tenant, kind)| {
                q.bind(*tenant).bind(*kind)
            })
    }
}

/// A row of [`Statements::settled`]: a key's state, fence and claim token.
#[derive(Debug)]
pub(crate) struct Settled {
    pub key: String,
    pub fence: u64,
    pub state: String,
    pub token: Vec<u8>,
}

impl Settled {
    /// Reads a row of [`Statements::bind_settled`] by column name.
    pub(crate) fn read(row: &MySqlRow) -> Result<Self> {
        let g = |e: sqlx::Error| corrupt(format!("unreadable ledger row: {e}"));
        Ok(Settled {
            key: row.try_get("effect_key").map_err(g)?,
            fence: row.try_get("fence").map_err(g)?,
            state: row.try_get("state").map_err(g)?,
            token: row.try_get("claim_token").map_err(g)?,
        })
    }
}

/// `complete_many`'s statements.
impl Statements {
    /// [`Statements::complete_many`] of leases of distinct keys, on the pool:
    /// the call's `token`; (key, outcome) per lease; the keys; (key, fence)
    /// per lease; the guard, false. No rows: `rows_affected` is the number of
    /// leases it matched.
    pub(crate) fn bind_complete_many(&self, token: &[u8; 16], work: &[(Lease, Outcome)]) -> Bound {
        let mut q = query(&self.complete_many(work.len())).bind(token.to_vec());
        for (lease, outcome) in work {
            q = q.bind(lease.key().as_str()).bind(outcome.as_bytes());
        }
        for (lease, _) in work {
            q = q.bind(lease.key().as_str());
        }
        for (lease, _) in work {
            q = q.bind(lease.key().as_str()).bind(lease.fence());
        }
        q.bind(false)
    }

    /// [`Statements::settled`] of the keys of `leases` (distinct): a
    /// [`Settled`] row per key found.
    pub(crate) fn bind_settled<'l>(&self, leases: impl ExactSizeIterator<Item = &'l Lease>) -> Bound {
        let n = leases.len();
        leases.fold(query(&self.settled(n)), |q, l| q.bind(l.key().as_str()))
    }
}

//! The claim (one key, or a batch in one statement) and the read that
//! follows one that wrote nothing; their rows: the granted [`Lease`]
//! ([`lease`]) and what the read [`Found`].

use oncely::backend::{Grant, Lease, Record, duration_micros, from_micros};
use oncely::{ClaimOptions, EffectKey, Result};
use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Row};

use super::record::{fence_from, record};
use super::{Bound, Queries};
use crate::error::map;

impl Queries {
    /// The claim (`claim`, or `claim_horizon` with `sent_at`, µs): the
    /// granted lease's row, or none.
    pub(crate) fn bind_claim(&self, key: &EffectKey, opts: &ClaimOptions, sent_at: Option<i64>) -> Bound {
        let text = if sent_at.is_some() {
            &self.claim_horizon
        } else {
            &self.claim
        };
        let query = sqlx::query(AssertSqlSafe(text.clone()))
            .bind(key.as_str())
            .bind(key.tenant().as_str())
            .bind(key.kind())
            .bind(key.subject())
            .bind(opts.fingerprint.as_ref().map(|f| f.as_bytes().as_slice()))
            .bind(opts.at_most_once)
            .bind(duration_micros(opts.lease))
            .bind(duration_micros(opts.retention));
        match sent_at {
            Some(sent_at) => query.bind(sent_at),
            None => query,
        }
    }

    /// The read after a claim that was not granted: one found-record row.
    pub(crate) fn bind_claim_read(&self, key: &EffectKey) -> Bound {
        sqlx::query(AssertSqlSafe(self.claim_read.clone()))
            .bind(key.as_str())
            .bind(key.tenant().as_str())
            .bind(key.kind())
    }

    /// The batch claim over `keys_json` (a JSON array of the keys): the
    /// granted leases' rows.
    pub(crate) fn bind_claim_many(
        &self,
        keys_json: String,
        opts: &ClaimOptions,
        sent_at: Option<i64>,
    ) -> Bound {
        let text = if sent_at.is_some() {
            &self.claim_many_horizon
        } else {
            &self.claim_many
        };
        let query = sqlx::query(AssertSqlSafe(text.clone()))
            .bind(keys_json)
            .bind(opts.fingerprint.as_ref().map(|f| f.as_bytes().as_slice()))
            .bind(opts.at_most_once)
            .bind(duration_micros(opts.lease))
            .bind(duration_micros(opts.retention));
        match sent_at {
            Some(sent_at) => query.bind(sent_at),
            None => query,
        }
    }

    /// The batch read of the keys a batch claim did not grant: found-record
    /// rows, each with its `slot`.
    pub(crate) fn bind_claim_many_read(&self, keys_json: String) -> Bound {
        sqlx::query(AssertSqlSafe(self.claim_many_read.clone())).bind(keys_json)
    }
}

/// The lease a claim statement granted, from its `RETURNING` row.
pub(crate) fn lease(key: &EffectKey, opts: &ClaimOptions, row: &SqliteRow) -> Result<Lease> {
    let fence = fence_from(row.try_get("fence").map_err(map)?)?;
    let created: i64 = row.try_get("created_at").map_err(map)?;
    let updated: i64 = row.try_get("updated_at").map_err(map)?;
    let expires: i64 = row.try_get("lease_expires_at").map_err(map)?;
    Ok(Grant {
        key: key.clone(),
        fence,
        expires_at: from_micros(expires),
        first_claimed_at: from_micros(created),
        // The statement's clock, read after it took the write lock: the
        // moment the grant was written.
        acquired_at: from_micros(updated),
        taken_over: row.try_get("taken_over").map_err(map)?,
        at_most_once: opts.at_most_once,
    }
    .into_lease())
}

/// What a claim's follow-up read found (the claim statement wrote nothing).
pub(crate) enum Found {
    /// No record: it was pruned or never existed. `watermark`: the horizon of
    /// the key's tenant and kind, in microseconds, if prune has raised it.
    Absent { watermark: Option<i64> },
    /// The record the claim may not take over, or that changed in between.
    Record(Record),
}

/// Decodes the claim's follow-up read (`sql::Queries::claim_read`): the
/// record's columns (all null when the key is absent), `now` and
/// `watermark`.
pub(crate) fn found(row: &SqliteRow) -> Result<Found> {
    let present: Option<String> = row.try_get("key").map_err(map)?;
    if present.is_none() {
        return Ok(Found::Absent {
            watermark: row.try_get("watermark").map_err(map)?,
        });
    }
    record(row).map(Found::Record)
}

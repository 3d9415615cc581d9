//! Rows to domain types and back: a stored record to a [`Record`], a claim's
//! `RETURNING` row to a [`Lease`], and a fence to its column. Every column is
//! read by name (the statements are in `sql.rs`).

use std::time::SystemTime;

use oncely::backend::{Fingerprint, Lease, Outcome, Record, RecordState};
use oncely::backend::{Grant, effective_state, from_micros};
use oncely::{ClaimOptions, EffectKey, Result, Tenant};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::error::{corrupt, map};

/// A fence as bound to a statement.
pub(crate) fn fence_param(fence: u64) -> i64 {
    // Fences are clock microseconds (about 2^51 today); one past i64::MAX
    // matches no stored row, so it is reported as lost like any other stale
    // fence.
    i64::try_from(fence).unwrap_or(-1)
}

fn fence_from(v: i64) -> Result<u64> {
    u64::try_from(v).map_err(|_| corrupt(format!("negative fence {v}")))
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

/// The new end of a renewed lease, from the renew statement's row.
pub(crate) fn renewed_until(row: &SqliteRow) -> Result<SystemTime> {
    Ok(from_micros(row.try_get("lease_expires_at").map_err(map)?))
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

/// A row of `sql::stats`, by name.
pub(crate) fn kind_stats(row: &SqliteRow) -> Result<oncely::admin::KindStats> {
    let tenant: String = row.try_get("tenant").map_err(map)?;
    let tenant = Tenant::parse(&tenant).map_err(|e| corrupt(format!("tenant {tenant:?}: {e}")))?;
    let kind: String = row.try_get("kind").map_err(map)?;
    let now: i64 = row.try_get("now").map_err(map)?;
    let count = |c: &str| -> Result<u64> {
        let n: Option<i64> = row.try_get(c).map_err(map)?;
        Ok(u64::try_from(n.unwrap_or(0)).unwrap_or(0))
    };
    let at = |c: &str| -> Result<Option<SystemTime>> {
        Ok(row.try_get::<Option<i64>, _>(c).map_err(map)?.map(from_micros))
    };
    let mut s = oncely::admin::KindStats::new(tenant, kind, from_micros(now));
    s.live = count("live")?;
    s.stuck = count("stuck")?;
    s.abandoned = count("abandoned")?;
    s.completed = count("completed")?;
    s.released = count("released")?;
    s.oldest_live = at("oldest_live")?;
    s.oldest_stuck = at("oldest_stuck")?;
    s.oldest_abandoned = at("oldest_abandoned")?;
    Ok(s)
}

//! The claim (one key, or a batch in one statement) and what its rows say:
//! [`ClaimRow`], the lease it granted, the lease an earlier run of the
//! same call holds ([`own_lease`]).

use oncely::backend::{Grant, Lease, Record, RecordState, duration_micros, from_micros};
use oncely::{ClaimOptions, EffectKey, Result};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgRow;

use super::decode::{get, micros, micros_opt, unsigned};
use super::record::RecordRow;
use super::{Bound, Queries};
use crate::error::corrupt;

impl Queries {
    /// The claim (`claim`, or `claim_horizon` with `sent_at`, µs): one
    /// `ClaimRow`.
    pub(crate) fn bind_claim(
        &self,
        key: &EffectKey,
        opts: &ClaimOptions,
        guarded: bool,
        token: &[u8],
        sent_at: Option<i64>,
    ) -> Bound {
        // Relaxed only on the ledger's own connection: a claim in the
        // caller's transaction (`guarded` false) commits with the caller's
        // writes and its completion, as the caller's transaction is set.
        let text = match (sent_at.is_some(), opts.relaxed_claim && guarded) {
            (false, false) => &self.claim,
            (true, false) => &self.claim_horizon,
            (false, true) => &self.claim_relaxed[0],
            (true, true) => &self.claim_relaxed[1],
        };
        let query = sqlx::query(AssertSqlSafe(text.clone()))
            .bind(key.as_str())
            .bind(key.tenant().as_str())
            .bind(key.kind())
            .bind(key.subject())
            .bind(opts.fingerprint.as_ref().map(|f| f.as_bytes().as_slice()))
            .bind(opts.at_most_once)
            .bind(duration_micros(opts.lease))
            .bind(duration_micros(opts.retention))
            .bind(guarded)
            .bind(token);
        match sent_at {
            Some(sent_at) => query.bind(sent_at),
            None => query,
        }
    }

    /// The batch claim over the keys' columns (`claim_many`, or
    /// `claim_many_horizon` with `sent_at`): one `ClaimRow` per key.
    pub(crate) fn bind_claim_many(
        &self,
        keys: &[&EffectKey],
        opts: &ClaimOptions,
        token: &[u8],
        sent_at: Option<i64>,
    ) -> Bound {
        let text = match (sent_at.is_some(), opts.relaxed_claim) {
            (false, false) => &self.claim_many,
            (true, false) => &self.claim_many_horizon,
            (false, true) => &self.claim_relaxed[2],
            (true, true) => &self.claim_relaxed[3],
        };
        let column = |f: fn(&EffectKey) -> &str| keys.iter().map(|k| f(k)).collect::<Vec<_>>();
        let query = sqlx::query(AssertSqlSafe(text.clone()))
            .bind(column(EffectKey::as_str))
            .bind(column(|k| k.tenant().as_str()))
            .bind(column(EffectKey::kind))
            .bind(column(EffectKey::subject))
            .bind(opts.fingerprint.as_ref().map(|f| f.as_bytes().as_slice()))
            .bind(opts.at_most_once)
            .bind(duration_micros(opts.lease))
            .bind(duration_micros(opts.retention))
            .bind(true)
            .bind(token);
        match sent_at {
            Some(sent_at) => query.bind(sent_at),
            None => query,
        }
    }
}

/// What the claim statement found (its `src` column).
pub(crate) enum ClaimRow {
    /// The guard tripped: the statement ran in a transaction nobody owns and
    /// wrote nothing.
    Leaked,
    /// The key is absent and the message is at or before the horizon.
    Beyond,
    /// A row committed after the statement's snapshot (while it waited on
    /// the key's lock): the next run sees it.
    Missing,
    /// The claim inserted or took over the record.
    Acquired(Lease),
    /// The record it found and did not take over, and whether it carries
    /// the claim call's own token (an earlier run of the call wrote it).
    Existing(Record, bool),
}

impl ClaimRow {
    /// The claim statement's row for `key`.
    pub(crate) fn decode(key: &EffectKey, row: &PgRow) -> Result<ClaimRow> {
        let src: String = get(row, "src")?;
        Ok(match src.as_str() {
            "leaked" => ClaimRow::Leaked,
            "beyond" => ClaimRow::Beyond,
            "missing" => ClaimRow::Missing,
            "acquired" => ClaimRow::Acquired(lease(key, row)?),
            "existing" => ClaimRow::Existing(RecordRow::decode(row)?.record(key.clone())?, get(row, "own")?),
            other => return Err(corrupt(format!("claim returned an unknown status {other:?}"))),
        })
    }
}

/// The lease of an `acquired` claim row (see the claim statement in `sql`).
fn lease(key: &EffectKey, row: &PgRow) -> Result<Lease> {
    let expires_us = micros_opt(row, "lease_expires_at")?
        .ok_or_else(|| corrupt(format!("{key}: acquired without a lease")))?;
    Ok(Grant {
        key: key.clone(),
        fence: unsigned(row, "fence", |f| format!("{key}: fence {f}"))?,
        expires_at: from_micros(expires_us),
        first_claimed_at: from_micros(micros(row, "created_at")?),
        // The clock the lease was measured from, read after the key's lock.
        acquired_at: from_micros(micros(row, "now")?),
        taken_over: get(row, "taken_over")?,
        at_most_once: get(row, "at_most_once")?,
    }
    .into_lease())
}

/// The lease a record holds for the claim call whose token it carries
/// (`ClaimRow::Existing` with `own`): the record's fence, expiry and first
/// claim, granted `lease` before its expiry (the length the call asked for;
/// nobody else knows the lease, so nobody renewed it). `None` when the
/// record holds no lease any more (completed, released): then it is
/// answered as any claim would answer it.
pub(crate) fn own_lease(record: &Record, lease: std::time::Duration) -> Option<Lease> {
    if !matches!(record.state, RecordState::InProgress | RecordState::Abandoned) {
        return None;
    }
    let expires_at = record.lease_expires_at?;
    Some(
        Grant {
            key: record.key.clone(),
            fence: record.fence,
            expires_at,
            first_claimed_at: record.created_at,
            acquired_at: expires_at.checked_sub(lease).unwrap_or(record.updated_at),
            // An insert writes `updated_at = created_at`; a takeover moves
            // `updated_at` on and keeps `created_at`.
            taken_over: record.updated_at > record.created_at,
            at_most_once: record.at_most_once,
        }
        .into_lease(),
    )
}

/// The key a claim row answers (its `key` column).
pub(crate) fn claimed_key(row: &PgRow) -> Result<String> {
    get(row, "key")
}

/// Whether a claim row says the leaked-transaction guard tripped.
pub(crate) fn claim_leaked(row: &PgRow) -> bool {
    get::<String>(row, "src").is_ok_and(|s| s == "leaked")
}

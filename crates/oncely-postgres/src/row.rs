//! Rows to ledger values: a stored record to a [`Record`], the claim
//! statement's row to what the claim found, a prune batch's counts. Every
//! column is read by the name `sql` gives it, never by position.

use oncely::backend::{Fingerprint, Lease, Outcome, Record, RecordState};
use oncely::backend::{Grant, effective_state, from_micros};
use oncely::{EffectKey, Result};
use sqlx::postgres::PgRow;
use sqlx::{Postgres, Row};

use crate::error::{corrupt, map};

/// A `timestamptz` decoded from PostgreSQL's binary format (microseconds
/// since 2000-01-01) into microseconds since the Unix epoch, so neither a
/// date-time crate nor a numeric conversion in SQL is needed.
struct Micros(i64);

/// 2000-01-01T00:00:00Z in microseconds since the Unix epoch.
const PG_EPOCH_US: i64 = 946_684_800_000_000;

impl sqlx::Type<Postgres> for Micros {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        // 1184 is `timestamptz`.
        sqlx::postgres::PgTypeInfo::with_oid(sqlx::postgres::types::Oid(1184))
    }
}

impl<'r> sqlx::Decode<'r, Postgres> for Micros {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        match value.format() {
            sqlx::postgres::PgValueFormat::Binary => {
                let bytes: [u8; 8] = value.as_bytes()?.try_into()?;
                Ok(Micros(i64::from_be_bytes(bytes).saturating_add(PG_EPOCH_US)))
            }
            sqlx::postgres::PgValueFormat::Text => Err("timestamptz in text format".into()),
        }
    }
}

fn get<'r, T>(row: &'r PgRow, column: &str) -> Result<T>
where
    T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    row.try_get(column).map_err(map)
}

fn micros(row: &PgRow, column: &str) -> Result<i64> {
    get::<Micros>(row, column).map(|m| m.0)
}

fn micros_opt(row: &PgRow, column: &str) -> Result<Option<i64>> {
    get::<Option<Micros>>(row, column).map(|m| m.map(|m| m.0))
}

/// A `bigint` the ledger stores as `u64` (fences, counts).
fn unsigned(row: &PgRow, column: &str, what: impl FnOnce(i64) -> String) -> Result<u64> {
    let n: i64 = get(row, column)?;
    u64::try_from(n).map_err(|_| corrupt(what(n)))
}

/// Whether the leaked-transaction guard (column `ok`) passed.
pub(crate) fn guard_ok(row: &PgRow) -> Result<bool> {
    get(row, "ok")
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

/// The watermark of a `horizon` row, in microseconds.
pub(crate) fn watermark(row: &PgRow) -> Result<Option<i64>> {
    micros_opt(row, "watermark")
}

/// A fenced write's value column (the new expiry for renew).
pub(crate) fn written(row: &PgRow) -> Result<i64> {
    get(row, "value")
}

/// How many records a prune batch found past retention and unlocked, and
/// how many it deleted.
pub(crate) fn prune_counts(row: &PgRow) -> Result<(u64, u64, Option<i64>)> {
    let count = |column| get::<i64>(row, column).map(|n| u64::try_from(n).unwrap_or(0));
    Ok((count("candidates")?, count("deleted")?, get(row, "last")?))
}

/// The key a claim row answers (its `key` column).
pub(crate) fn claimed_key(row: &PgRow) -> Result<String> {
    get(row, "key")
}

/// Whether a claim row says the leaked-transaction guard tripped.
pub(crate) fn claim_leaked(row: &PgRow) -> bool {
    get::<String>(row, "src").is_ok_and(|s| s == "leaked")
}

/// The (key, fence) a `complete_many` row reports completed, if any (the
/// row of a batch that completed nothing has neither).
pub(crate) fn completed(row: &PgRow) -> Result<Option<(String, i64)>> {
    let key: Option<String> = get(row, "key")?;
    let fence: Option<i64> = get(row, "fence")?;
    Ok(key.zip(fence))
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

/// A row of `sql::stats`, by name.
pub(crate) fn kind_stats(row: &PgRow) -> Result<oncely::admin::KindStats> {
    let tenant: String = get(row, "tenant")?;
    let tenant = oncely::Tenant::parse(&tenant).map_err(|e| corrupt(format!("tenant {tenant:?}: {e}")))?;
    let kind: String = get(row, "kind")?;
    let count = |c: &str| unsigned(row, c, |n| format!("negative count {n}"));
    let at = |c: &str| micros_opt(row, c).map(|m| m.map(from_micros));
    let mut s = oncely::admin::KindStats::new(tenant, kind, from_micros(micros(row, "now")?));
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

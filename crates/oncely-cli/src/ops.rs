//! The operator commands' logic: read a record, list abandoned steps, prune,
//! migrate. Each validates its input before connecting and returns data
//! ([`Read`]: what it read, and from which ledger); the binary prints it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncely::backend::{Ledger, Record};
use oncely::{EffectKey, Error, Result, Tenant};
use serde::{Serialize, Serializer};

use crate::any::{Access, AnyLedger};

/// What a command read, and the ledger it read it from, so that every
/// answer (a "no record" above all) says which ledger it is about: a URL
/// that names another table than the application's reads another ledger.
#[derive(Debug, Clone, PartialEq)]
pub struct Read<T> {
    /// The ledger, as [`AnyLedger`]'s `Display` says it (backend, server
    /// and database, table): `postgres db:5432/app, table
    /// billing.effects`. Never a credential.
    pub ledger: String,
    /// What was read.
    pub value: T,
}

impl<T> Read<T> {
    /// `f` of the value, from the same ledger.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Read<U> {
        Read {
            ledger: self.ledger,
            value: f(self.value),
        }
    }
}

/// As JSON: the value with a `ledger` field added, to the object or to each
/// object of an array (the formats the commands have always printed stay
/// as they were); any other value (`null`) as it is.
impl<T: Serialize> Serialize for Read<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let mut value = serde_json::to_value(&self.value).map_err(serde::ser::Error::custom)?;
        let ledger = serde_json::Value::String(self.ledger.clone());
        match &mut value {
            serde_json::Value::Object(map) => {
                map.insert("ledger".to_owned(), ledger);
            }
            serde_json::Value::Array(items) => {
                for item in items {
                    if let serde_json::Value::Object(map) = item {
                        map.insert("ledger".to_owned(), ledger.clone());
                    }
                }
            }
            _ => {}
        }
        value.serialize(serializer)
    }
}

/// Reads the record of a displayed key (`tenant/kind:subject`). An invalid
/// key fails with [`oncely::Error::InvalidKey`] before anything connects.
pub async fn get(database_url: &str, key: &str) -> Result<Read<Option<Record>>> {
    let key = EffectKey::parse(key)?;
    with_ledger(
        database_url,
        Access::ReadOnly,
        |l| async move { l.get(&key).await },
    )
    .await
}

/// Lists up to `limit` abandoned at-most-once steps of `tenant`, oldest first.
pub async fn abandoned(database_url: &str, tenant: &str, limit: u64) -> Result<Read<Vec<Record>>> {
    let tenant = Tenant::parse(tenant)?;
    with_ledger(database_url, Access::ReadOnly, |l| async move {
        l.abandoned(&tenant, limit).await
    })
    .await
}

/// Lists abandoned at-most-once steps of one tenant or of every tenant
/// (`None`), optionally of one kind and since a time, oldest first. One
/// tenant alone is [`Ledger::abandoned`], which every backend answers; the rest
/// needs [`oncely::admin::Admin`] (the SQL backends).
pub async fn abandoned_in(
    database_url: &str,
    tenant: Option<&Tenant>,
    kind: Option<&str>,
    since: Option<&str>,
    limit: u64,
) -> Result<Read<Vec<Record>>> {
    match (tenant, kind, since) {
        (Some(t), None, None) => abandoned(database_url, t.as_str(), limit).await,
        _ => {
            let listing = crate::admin::Listing {
                tenant: tenant.cloned(),
                kind: kind.map(str::to_owned),
                since: since.map(str::to_owned),
                limit: u32::try_from(limit).unwrap_or(u32::MAX),
            };
            crate::admin::list_records(database_url, oncely::admin::Filter::Abandoned, &listing).await
        }
    }
}

/// How many records `prune` would delete now, deleting nothing (a dry run,
/// read-only). Needs [`oncely::admin::Admin`] (the SQL backends).
pub async fn prune_dry_run(database_url: &str) -> Result<Read<u64>> {
    let scheme = crate::any::Scheme::of_url(database_url)?;
    if !scheme.has_admin() {
        return Err(Error::Config(format!(
            "prune --dry-run is not available on the {} backend: it keeps no index to count \
             records past retention (only SQLite, PostgreSQL and MySQL ledgers offer it)",
            scheme.name()
        )));
    }
    with_ledger(database_url, Access::ReadOnly, |l| async move {
        oncely::admin::Admin::prunable(&l).await
    })
    .await
}

/// How `prune` deletes: at most `limit` records, in batches of `batch`, at
/// most `rows_per_second` (none: as fast as the database goes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrunePlan {
    /// Records to delete at most in this call.
    pub limit: u64,
    /// Records per batch (one transaction each).
    pub batch: u64,
    /// The rate limit, if any.
    pub rows_per_second: Option<u64>,
}

/// Deletes up to `plan.limit` completed or released records past their
/// retention (never a live lease, never an abandoned step) through
/// [`oncely::pruner::Pruner::drain`], in bounded batches at the plan's rate, calling
/// `on_batch` with each batch's count; returns how many went. A failed batch
/// ends the call with its error; the batches before it stay deleted.
pub async fn prune(
    database_url: &str,
    plan: PrunePlan,
    on_batch: impl FnMut(u64) + Send,
) -> Result<Read<u64>> {
    if plan.batch == 0 || plan.rows_per_second == Some(0) {
        return Err(Error::InvalidInput(
            "prune: --batch and --rate must be at least 1".to_owned(),
        ));
    }
    with_ledger(database_url, Access::Existing, |l| async move {
        let options = oncely::pruner::PrunerOptions::default().batch(plan.batch);
        let options = match plan.rows_per_second {
            Some(rate) => options.rows_per_second(rate),
            None => options.unlimited(),
        };
        let stats = oncely::pruner::Pruner::new(l, options)
            .drain(plan.limit, on_batch)
            .await?;
        Ok(stats.rows)
    })
    .await
}

/// What `migrate` found: the backend, now with its schema in place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MigrateReport {
    /// The backend's name.
    pub backend: &'static str,
    /// Whether claims can join the caller's transaction on this backend.
    pub caller_transaction: bool,
    /// What a completed record survives.
    pub durability: &'static str,
    /// Whose clock decides expiry.
    pub clock: &'static str,
}

/// Creates or upgrades the ledger's schema (or NATS bucket), checks it, and
/// reports the backend's capabilities. The only command (with `demo`) that
/// creates anything.
pub async fn migrate(database_url: &str) -> Result<Read<MigrateReport>> {
    with_ledger(database_url, Access::Migrate, |l| async move {
        let caps = l.capabilities();
        Ok(MigrateReport {
            backend: l.backend(),
            caller_transaction: caps.caller_transaction,
            durability: caps.durability,
            clock: caps.clock,
        })
    })
    .await
}

async fn with_ledger<T, F, Fut>(database_url: &str, access: Access, f: F) -> Result<Read<T>>
where
    F: FnOnce(AnyLedger) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let ledger = AnyLedger::open(database_url, access).await?;
    let result = f(ledger.clone()).await;
    ledger.close().await;
    Ok(Read {
        ledger: ledger.to_string(),
        value: result?,
    })
}

/// A [`Record`] as the commands print it: JSON-friendly, timestamps in RFC
/// 3339 UTC, the outcome as JSON when it is JSON.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RecordView {
    /// `tenant/kind:subject`.
    pub key: String,
    /// The tenant.
    pub tenant: String,
    /// The effect kind.
    pub kind: String,
    /// The business fact.
    pub subject: String,
    /// `in_progress`, `completed`, `released` or `abandoned`.
    pub state: &'static str,
    /// The latest lease's fence.
    pub fence: u64,
    /// Whether the step is at-most-once.
    pub at_most_once: bool,
    /// The request fingerprint (hex), if the first claim gave one.
    pub fingerprint: Option<String>,
    /// The stored outcome: JSON as stored, or `{"bytes": n}` if it is not JSON.
    pub outcome: Option<serde_json::Value>,
    /// The idempotency key the effect passed to external APIs.
    pub provider_key: String,
    /// When the key was first claimed.
    pub created_at: String,
    /// When the record last changed state.
    pub updated_at: String,
    /// When the current lease ends (in-progress records).
    pub lease_expires_at: Option<String>,
    /// Until when a completed or released record is kept.
    pub retain_until: String,
}

impl From<&Record> for RecordView {
    fn from(r: &Record) -> Self {
        RecordView {
            key: r.key.to_string(),
            tenant: r.key.tenant().as_str().to_owned(),
            kind: r.key.kind().to_owned(),
            subject: r.key.subject().to_owned(),
            state: r.state.as_str(),
            fence: r.fence,
            at_most_once: r.at_most_once,
            fingerprint: r.fingerprint.map(|f| f.to_hex()),
            outcome: r.outcome.as_ref().map(|o| {
                serde_json::from_slice(o.as_bytes())
                    .unwrap_or_else(|_| serde_json::json!({ "bytes": o.len() }))
            }),
            provider_key: r.key.provider_key(),
            created_at: rfc3339(r.created_at),
            updated_at: rfc3339(r.updated_at),
            lease_expires_at: r.lease_expires_at.map(rfc3339),
            retain_until: rfc3339(r.retain_until),
        }
    }
}

/// `2026-11-29T22:05:07.123456Z`. Times before 1970 print as the epoch
/// (no backend stores any).
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, day) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_micros()
    )
}

/// Howard Hinnant's days-to-civil algorithm (proleptic Gregorian calendar).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use oncely::backend::{Claim, Outcome};
    use oncely::{ClaimOptions, Error};

    #[test]
    fn rfc3339_formats_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        let t = UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20.123456Z");
        // A leap day.
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00.000000Z");
    }

    #[tokio::test]
    async fn bad_input_is_refused_before_connecting() {
        // The URL is unreachable: a round trip would fail differently.
        let url = "postgres://nobody@127.0.0.1:1/none";
        for key in ["", "no-slash", "t/no-colon", "t/:subject", "bad tenant/k:s"] {
            let err = get(url, key).await.unwrap_err();
            assert!(matches!(err, Error::InvalidKey { .. }), "{key:?}: {err:?}");
        }
        let err = abandoned(url, "bad/tenant", 10).await.unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{err:?}");
        let plan = PrunePlan {
            limit: 10,
            batch: 10,
            rows_per_second: None,
        };
        let err = prune("nope://x", plan, |_| {}).await.unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err:?}");
    }

    #[test]
    fn record_view_shows_outcome_as_json() {
        let key = EffectKey::new(&Tenant::new("acme").unwrap(), "capture", "order-1").unwrap();
        let ledger = oncely::MemoryLedger::new();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let record = rt.block_on(async {
            let Claim::Acquired(lease) = ledger.claim(&key, &ClaimOptions::default()).await.unwrap() else {
                panic!("fresh key")
            };
            ledger
                .complete(
                    &lease,
                    &Outcome::from_json(&serde_json::json!({"ok": "ch_1"})).unwrap(),
                )
                .await
                .unwrap();
            ledger.get(&key).await.unwrap().unwrap()
        });
        let v = serde_json::to_value(RecordView::from(&record)).unwrap();
        assert_eq!(v["key"], "acme/capture:order-1");
        assert_eq!(v["state"], "completed");
        assert_eq!(v["fence"], record.fence);
        assert_eq!(v["outcome"]["ok"], "ch_1");
        assert_eq!(v["provider_key"], key.provider_key());
        assert!(v["created_at"].as_str().unwrap().ends_with('Z'));
    }
}

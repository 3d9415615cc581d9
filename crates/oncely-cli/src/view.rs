//! Records as the operator commands show them: the stored record in JSON
//! ([`RecordView`]), and what an operator sees it as ([`Inspection`]: its
//! class on the backend's clock, and what its fence says about how often it
//! was granted).
//!
//! [`RecordView`] is not `Serialize` on [`Record`] itself: the commands'
//! JSON has RFC 3339 times ([`rfc3339`]), the key split into tenant, kind
//! and subject, the provider key, and the outcome as JSON when it is JSON
//! (`{"bytes": n}` when not; a sealed one as `{"encrypted": {"key_id": "k1",
//! "bytes": n}}`, never its bytes: [`outcome_json`]), none of which the core's record holds or
//! should format.

use oncely::backend::{Outcome, Record, RecordState};
use oncely::backend::{lease_live, to_micros};
use oncely::codec::{Envelope, describe_sealed};
use serde::Serialize;

use crate::time::rfc3339;

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
    /// The stored outcome: JSON as stored, or `{"bytes": n}` if it is not
    /// JSON, or `{"encrypted": {"key_id": .., "bytes": n}}` when it is sealed
    /// ([`outcome_json`]).
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
            outcome: r.outcome.as_ref().map(outcome_json),
            provider_key: r.key.provider_key(),
            created_at: rfc3339(r.created_at),
            updated_at: rfc3339(r.updated_at),
            lease_expires_at: r.lease_expires_at.map(rfc3339),
            retain_until: rfc3339(r.retain_until),
        }
    }
}

/// A stored outcome as JSON: the JSON it holds; a sealed one
/// ([`oncely::codec`]) as `{"encrypted": {"key_id": "k1", "bytes": 812,
/// "compressed": false}}` (a damaged envelope with `bytes` only), never its
/// bytes; anything else as `{"bytes": n}`.
pub fn outcome_json(o: &Outcome) -> serde_json::Value {
    if let Some(e) = Envelope::parse(o.as_bytes()) {
        return serde_json::json!({
            "encrypted": { "key_id": e.key_id(), "bytes": e.len(), "compressed": e.is_compressed() }
        });
    }
    if Envelope::is_sealed(o.as_bytes()) {
        return serde_json::json!({ "encrypted": { "bytes": o.len() } });
    }
    serde_json::from_slice(o.as_bytes()).unwrap_or_else(|_| serde_json::json!({ "bytes": o.len() }))
}

/// A stored outcome in one line: `812 bytes`, or for a sealed one
/// `encrypted (key k1, 812 bytes)` ([`describe_sealed`]).
pub fn outcome_summary(o: &Outcome) -> String {
    describe_sealed(o.as_bytes()).unwrap_or_else(|| format!("{} bytes", o.len()))
}

/// What an operator sees a record as, on the backend's clock when it was
/// read: `live`, `stuck` (lease ended, not at-most-once: the next claim takes
/// it over), `abandoned` (at-most-once, lease ended: reconcile it),
/// `completed` or `released`.
pub fn class_of(r: &Record) -> &'static str {
    match r.state {
        RecordState::Completed if r.is_erased() => "erased",
        RecordState::Completed => "completed",
        RecordState::Released => "released",
        RecordState::Abandoned => "abandoned",
        _ if lease_live(r.lease_expires_at, r.read_at) => "live",
        _ if r.at_most_once => "abandoned",
        _ => "stuck",
    }
}

/// What the stored fence says about how often the key was claimed. Nothing
/// counts claims; the fence is derived: a first claim's fence is its clock
/// in microseconds, equal to `created_at`, and every later grant (a
/// takeover of an ended lease, a claim after a release or a forget) writes
/// `max(fence + 1, clock)`, above it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Claims {
    /// `Some(false)`: granted once (fence = `created_at` in µs);
    /// `Some(true)`: granted at least twice; `None`: the fence is not derived
    /// from this clock (a record from a schema before clock fences).
    pub claimed_again: Option<bool>,
    /// `1`, `2 or more` (the exact count is not stored) or `unknown`.
    pub grants: &'static str,
    /// When the latest grant was written, read from the fence (µs), when
    /// it was granted again.
    pub latest_grant_at: Option<String>,
}

impl Claims {
    /// Derives it from the record's fence and `created_at`.
    pub fn of(r: &Record) -> Self {
        let created = to_micros(r.created_at).ok().and_then(|c| u64::try_from(c).ok());
        match created {
            Some(c) if r.fence == c => Claims {
                claimed_again: Some(false),
                grants: "1",
                latest_grant_at: None,
            },
            Some(c) if r.fence > c => Claims {
                claimed_again: Some(true),
                grants: "2 or more",
                latest_grant_at: i64::try_from(r.fence)
                    .ok()
                    .map(|us| rfc3339(oncely::backend::from_micros(us))),
            },
            _ => Claims {
                claimed_again: None,
                grants: "unknown",
                latest_grant_at: None,
            },
        }
    }
}

/// One record as `inspect` and `history` show it: the stored record, what
/// an operator sees it as, and what is derived from it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Inspection {
    /// The record as stored.
    #[serde(flatten)]
    pub record: RecordView,
    /// `live`, `stuck`, `abandoned`, `completed`, `erased` (completed, its
    /// outcome erased) or `released` ([`class_of`]).
    pub class: &'static str,
    /// Seconds of lease left (negative: ended that long ago), in-progress
    /// records only.
    pub lease_left_seconds: Option<f64>,
    /// Size of the stored outcome in bytes.
    pub outcome_bytes: Option<usize>,
    /// The stored outcome in one line ([`outcome_summary`]): `812 bytes`, or
    /// `encrypted (key k1, 812 bytes)`.
    pub outcome_summary: Option<String>,
    /// Whether the first claim gave a request fingerprint.
    pub fingerprint_present: bool,
    /// What the fence says about how often the key was claimed (derived).
    pub claims: Claims,
    /// The backend's clock when the record was read.
    pub read_at: String,
}

impl From<&Record> for Inspection {
    fn from(r: &Record) -> Self {
        let lease_left_seconds = r.lease_expires_at.map(|e| match e.duration_since(r.read_at) {
            Ok(d) => d.as_secs_f64(),
            Err(e) => -e.duration().as_secs_f64(),
        });
        Inspection {
            record: RecordView::from(r),
            class: class_of(r),
            lease_left_seconds,
            outcome_bytes: r.outcome.as_ref().map(Outcome::len),
            outcome_summary: r.outcome.as_ref().map(outcome_summary),
            fingerprint_present: r.fingerprint.is_some(),
            claims: Claims::of(r),
            read_at: rfc3339(r.read_at),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use super::*;
    use oncely::backend::{Claim, Ledger};
    use oncely::{ClaimOptions, EffectKey, Tenant};

    pub(crate) fn record(fence_offset: i64, state: RecordState) -> Record {
        use oncely::backend::from_micros;
        let created_us = 1_796_000_000_000_000i64;
        let key = EffectKey::parse("acme/capture:o-1").unwrap();
        let mut r = Record {
            key,
            state,
            fence: u64::try_from(created_us + fence_offset).unwrap(),
            fingerprint: None,
            outcome: None,
            at_most_once: false,
            created_at: from_micros(created_us),
            updated_at: from_micros(created_us),
            lease_expires_at: None,
            retain_until: from_micros(created_us + 1),
            read_at: from_micros(created_us + 10),
        };
        if state == RecordState::InProgress {
            r.lease_expires_at = Some(from_micros(created_us + 5));
        }
        r
    }

    #[test]
    fn the_fence_tells_a_single_grant_from_several() {
        let once = Claims::of(&record(0, RecordState::Completed));
        assert_eq!((once.claimed_again, once.grants), (Some(false), "1"));
        assert_eq!(once.latest_grant_at, None);
        let again = Claims::of(&record(7, RecordState::Completed));
        assert_eq!((again.claimed_again, again.grants), (Some(true), "2 or more"));
        assert_eq!(
            again.latest_grant_at.as_deref(),
            Some("2026-11-30T00:53:20.000007Z")
        );
        // A fence below the clock (schema version 1's 1, 2, 3…): cannot tell.
        let mut old = record(0, RecordState::Completed);
        old.fence = 3;
        assert_eq!(Claims::of(&old).claimed_again, None);
    }

    #[test]
    fn classes_follow_the_clock_and_the_step_mode() {
        assert_eq!(class_of(&record(0, RecordState::InProgress)), "stuck");
        let mut amo = record(0, RecordState::InProgress);
        amo.at_most_once = true;
        assert_eq!(class_of(&amo), "abandoned");
        let mut live = record(0, RecordState::InProgress);
        live.lease_expires_at = Some(live.read_at + Duration::from_micros(1));
        assert_eq!(class_of(&live), "live");
        assert_eq!(class_of(&record(0, RecordState::Released)), "released");
        let mut done = record(0, RecordState::Completed);
        done.outcome = Some(Outcome::value(&"ch_1").unwrap());
        assert_eq!(class_of(&done), "completed");
        done.outcome = None;
        assert_eq!(class_of(&done), "erased");
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

    #[test]
    fn a_sealed_outcome_shows_as_encrypted_never_as_bytes() {
        use oncely::codec::{Keyring, OutcomeCodec, SecretKey};
        let keys = Keyring::new("k1", SecretKey::from_bytes([1; 32])).unwrap();
        let mut r = record(0, RecordState::Completed);
        let plain = Outcome::from_json(&serde_json::json!({"ok": "ch_secret"})).unwrap();
        let sealed = keys.seal(&r.key, &plain).unwrap();
        r.outcome = Some(sealed.clone());
        let v = serde_json::to_value(Inspection::from(&r)).unwrap();
        assert_eq!(
            v["outcome"],
            serde_json::json!({"encrypted": {"key_id": "k1", "bytes": sealed.len(), "compressed": false}})
        );
        let summary = format!("encrypted (key k1, {} bytes)", sealed.len());
        assert_eq!(v["outcome_summary"], summary.as_str());
        assert!(!v.to_string().contains("ch_secret"));
        r.outcome = Some(plain.clone());
        assert_eq!(outcome_summary(&plain), format!("{} bytes", plain.len()));
    }
}

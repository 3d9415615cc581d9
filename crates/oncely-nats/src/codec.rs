//! How effect keys and records are laid out in the bucket, and how a stored
//! value decodes into an [`oncely::backend::Record`] (the role `row.rs` plays in the
//! SQL backends).
//!
//! KV keys may hold only `[-/_=.a-zA-Z0-9]`, and `.` separates tokens, so a
//! displayed effect key cannot be used as it is. The KV key is
//! `<escaped tenant>.<blake3 hex of the displayed key>`; the displayed key
//! itself is stored in the value, so it round-trips byte for byte and a hash
//! collision would be detected (and refused) rather than merged.
//!
//! The horizon watermark of a tenant and kind lives in the same bucket at
//! `<escaped tenant>.horizon.<blake3 hex of the kind>`: three tokens where a
//! record key has two, so no record key can be a watermark key, and a
//! tenant's `<escaped tenant>.*` (its records) never lists its watermarks.

use std::time::{Duration, SystemTime};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use oncely::backend::{Fingerprint, Outcome, Record, RecordState};
use oncely::backend::{effective_state, from_micros};
use oncely::{EffectKey, Error, Result, Tenant};
use serde::{Deserialize, Serialize};

use crate::error::corrupt;

/// The key the server clock probe writes to. Escaped tenants never start with
/// `_oncely` (tenants starting with `_` are reserved and the only one is
/// `_global`) and every effect key contains a `.`, so it cannot collide.
pub(crate) const CLOCK_KEY: &str = "_oncely_clock";

/// The largest value this crate writes, in bytes: the outcome in base64 plus
/// the key and a few small fields. Buckets with a smaller `max_value_size`
/// are refused at connect time.
pub(crate) const MAX_VALUE_BYTES: usize = oncely::backend::MAX_OUTCOME_BYTES.div_ceil(3) * 4 + 2048;

/// Escapes a tenant into one KV key token: letters, digits, `-` and `_` stay,
/// everything else (`.`, `@`, `+`) becomes `=XX`. `=` never occurs in a
/// tenant, so the escaping is unambiguous, and the token has no `.`, so one
/// tenant's keys never match another tenant's prefix.
pub(crate) fn tenant_token(tenant: &Tenant) -> String {
    let mut out = String::with_capacity(tenant.as_str().len() + 8);
    for b in tenant.as_str().bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(b as char);
        } else {
            out.push_str(&format!("={b:02X}"));
        }
    }
    out
}

/// The KV key of an effect key.
pub(crate) fn kv_key(key: &EffectKey) -> String {
    let hash = blake3::Hasher::new_derive_key("oncely 2026 nats kv key")
        .update(key.as_str().as_bytes())
        .finalize();
    format!("{}.{}", tenant_token(key.tenant()), hash.to_hex())
}

/// The KV key of the horizon watermark of `tenant` and `kind`.
pub(crate) fn watermark_key(tenant: &Tenant, kind: &str) -> String {
    let hash = blake3::Hasher::new_derive_key("oncely 2026 nats horizon key")
        .update(kind.as_bytes())
        .finalize();
    format!("{}.horizon.{}", tenant_token(tenant), hash.to_hex())
}

/// The first token of the markers that serialise writes on old replicated
/// servers (`marker.rs`): `_oncely_cas.<revision>-<digest>`. Reserved as the clock
/// key is, so no record key starts with it.
pub(crate) const MARKER_PREFIX: &str = "_oncely_cas";

/// Whether a KV key holds an effect record (not the clock probe, not a
/// watermark, not a marker).
pub(crate) fn is_record_key(kv_key: &str) -> bool {
    !kv_key.starts_with("_oncely") && kv_key.matches('.').count() == 1
}

/// The value stored at an effect's KV key.
///
/// Timestamps of the revision itself are not stored: the server stamps every
/// revision, and lease expiry and retention are measured from that stamp
/// (`lease_us` and `retention_us` are lengths, not instants). `first_us` is
/// the only instant, carried from the first claim for reporting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Stored {
    /// Format version.
    pub v: u8,
    /// The displayed effect key.
    pub key: String,
    /// `in_progress`, `completed` or `released`.
    pub state: String,
    /// The fence of the latest lease.
    pub fence: u64,
    /// Request fingerprint, hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp: Option<String>,
    /// Outcome bytes, base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    /// At-most-once step.
    pub amo: bool,
    /// When the key was first claimed (server clock estimate), µs since epoch.
    pub first_us: i64,
    /// Lease length from this revision's server timestamp, µs.
    pub lease_us: u64,
    /// Retention from this revision's server timestamp, µs.
    pub retention_us: u64,
    /// `sent_at` (µs) of the claim that created this record, kept until the
    /// record's next write: that claim checks the horizon only *after* its
    /// create, so until a lease holder writes again (which proves the check
    /// passed) a takeover must not trust the record (see `horizon.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hz: Option<i64>,
}

impl Stored {
    pub(crate) fn state(&self) -> Result<RecordState> {
        match RecordState::parse(&self.state)? {
            RecordState::Abandoned => Err(Error::Serialization("stored state abandoned".into())),
            s => Ok(s),
        }
    }

    pub(crate) fn set_state(&mut self, s: RecordState) {
        self.state = s.as_str().to_owned();
    }

    pub(crate) fn fingerprint(&self) -> Result<Option<Fingerprint>> {
        self.fp.as_deref().map(Fingerprint::from_hex).transpose()
    }

    pub(crate) fn outcome(&self) -> Result<Option<Outcome>> {
        self.outcome
            .as_deref()
            .map(|s| {
                let bytes = B64
                    .decode(s)
                    .map_err(|e| Error::Serialization(format!("outcome: {e}")))?;
                Outcome::from_bytes(bytes)
            })
            .transpose()
    }

    pub(crate) fn set_outcome(&mut self, o: Option<&Outcome>) {
        self.outcome = o.map(|o| B64.encode(o.as_bytes()));
    }

    pub(crate) fn encode(&self) -> Result<bytes::Bytes> {
        Ok(serde_json::to_vec(self)?.into())
    }

    pub(crate) fn decode(raw: &[u8]) -> Result<Self> {
        let s: Stored = serde_json::from_slice(raw)?;
        if s.v != 1 {
            return Err(Error::Serialization(format!("unknown record version {}", s.v)));
        }
        Ok(s)
    }

    /// The effect key this value stores. With `expected` (the key whose KV
    /// key was read), another key is corrupt: a hash collision or a value
    /// copied by hand, never merged.
    pub(crate) fn effect_key(&self, expected: Option<&EffectKey>) -> Result<EffectKey> {
        let key =
            EffectKey::parse(&self.key).map_err(|e| corrupt(format!("stored key {:?}: {e}", self.key)))?;
        if let Some(exp) = expected
            && &key != exp
        {
            return Err(corrupt(format!("KV key of {exp} holds {key}")));
        }
        Ok(key)
    }

    /// The record this value describes: `at` is the server's stamp of its
    /// revision (leases and retentions are measured from it), `now` the
    /// server clock's estimate at the read.
    pub(crate) fn record(&self, key: EffectKey, at: SystemTime, now: SystemTime) -> Result<Record> {
        let stored = self.state()?;
        let lease_end = stored_end(at, self.lease_us, "lease")?;
        let state = effective_state(stored, self.amo, Some(lease_end), now);
        Ok(Record {
            key,
            state,
            fence: self.fence,
            fingerprint: self.fingerprint()?,
            outcome: self.outcome()?,
            at_most_once: self.amo,
            created_at: from_micros(self.first_us),
            updated_at: at,
            lease_expires_at: matches!(state, RecordState::InProgress | RecordState::Abandoned)
                .then_some(lease_end),
            retain_until: stored_end(at, self.retention_us, "retention")?,
            read_at: now.max(at),
        })
    }
}

/// Whole µs of a validated lease or retention (at most ten years).
pub(crate) fn length_us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// `at + us` for a length read from a stored record: checked, so a value
/// no oncely ledger wrote is reported as corrupt, never a panic.
fn stored_end(at: SystemTime, us: u64, what: &str) -> Result<SystemTime> {
    at.checked_add(Duration::from_micros(us)).ok_or_else(|| {
        corrupt(format!(
            "{what} of {us} µs from {at:?} ends past the representable time"
        ))
    })
}

/// The value at a watermark key: the newest `created_at` (µs) that prune
/// deleted, or was about to delete, among the records of a tenant and kind.
/// The tenant and kind are stored in clear so a hash collision is refused,
/// and so an operator reading the bucket knows what the number is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Watermark {
    /// Format version.
    pub v: u8,
    /// The tenant.
    pub tenant: String,
    /// The kind.
    pub kind: String,
    /// The watermark, µs since the Unix epoch.
    pub w_us: i64,
}

impl Watermark {
    pub(crate) fn encode(&self) -> Result<bytes::Bytes> {
        Ok(serde_json::to_vec(self)?.into())
    }

    /// Decodes the watermark of `tenant` and `kind`; anything else at its key
    /// is an error, never a lower horizon.
    pub(crate) fn decode(raw: &[u8], tenant: &Tenant, kind: &str) -> Result<Self> {
        let w: Watermark = serde_json::from_slice(raw)?;
        if w.v != 1 {
            return Err(Error::Serialization(format!("unknown watermark version {}", w.v)));
        }
        if w.tenant != tenant.as_str() || w.kind != kind {
            return Err(Error::Serialization(format!(
                "the watermark of {tenant}/{kind} holds {}/{}",
                w.tenant, w.kind
            )));
        }
        Ok(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_tokens_are_unambiguous_single_tokens() {
        let a = Tenant::new("acct-42.eu@x+y").unwrap();
        assert_eq!(tenant_token(&a), "acct-42=2Eeu=40x=2By");
        assert_eq!(tenant_token(&Tenant::global()), "_global");
        let dotted = Tenant::new("a.b").unwrap();
        let plain = Tenant::new("a").unwrap();
        assert!(!tenant_token(&dotted).contains('.'));
        assert_ne!(tenant_token(&dotted), tenant_token(&plain));
    }

    #[test]
    fn kv_keys_are_valid_and_distinct() {
        let t = Tenant::new("x+y@z").unwrap();
        let k1 = EffectKey::new(&t, "capture", "a/b c'd").unwrap();
        let k2 = EffectKey::new(&t, "capture", "a/b c'e").unwrap();
        let (a, b) = (kv_key(&k1), kv_key(&k2));
        assert_ne!(a, b);
        for k in [&a, &b] {
            assert!(
                k.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || b"-/_=.".contains(&c))
            );
            assert_eq!(k.matches('.').count(), 1);
        }
        assert_ne!(a, CLOCK_KEY);
    }

    #[test]
    fn values_round_trip() {
        let mut s = Stored {
            v: 1,
            key: "t/k:s".into(),
            state: "in_progress".into(),
            fence: 3,
            fp: None,
            outcome: None,
            amo: true,
            first_us: 5,
            lease_us: 6,
            retention_us: 7,
            hz: Some(8),
        };
        let o = Outcome::from_bytes(vec![0u8, 255, 10]).unwrap();
        s.set_outcome(Some(&o));
        s.set_state(RecordState::Completed);
        let back = Stored::decode(&s.encode().unwrap()).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.outcome().unwrap().unwrap(), o);
        assert_eq!(back.state().unwrap(), RecordState::Completed);
        assert!(Stored::decode(b"not json").is_err());
        // Records written before `hz` existed still decode.
        let old = br#"{"v":1,"key":"t/k:s","state":"completed","fence":1,"amo":false,"first_us":5,"lease_us":6,"retention_us":7}"#;
        assert_eq!(Stored::decode(old).unwrap().hz, None);
    }

    #[test]
    fn watermark_keys_never_look_like_records() {
        let t = Tenant::new("a.b@c").unwrap();
        let k = EffectKey::new(&t, "capture", "horizon").unwrap();
        let w = watermark_key(&t, "capture");
        assert!(w.starts_with(&format!("{}.", tenant_token(&t))));
        assert!(
            w.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"-/_=.".contains(&c))
        );
        assert!(is_record_key(&kv_key(&k)));
        assert!(!is_record_key(&w));
        assert!(!is_record_key(CLOCK_KEY));
        assert!(!is_record_key(&crate::marker::marker_key("t.x", 7, b"")));
        assert_ne!(w, watermark_key(&t, "receipt"));
        assert_ne!(w, watermark_key(&Tenant::new("a").unwrap(), "capture"));
        let v = Watermark {
            v: 1,
            tenant: t.as_str().to_owned(),
            kind: "capture".into(),
            w_us: 42,
        };
        let raw = v.encode().unwrap();
        assert_eq!(Watermark::decode(&raw, &t, "capture").unwrap(), v);
        assert!(Watermark::decode(&raw, &t, "receipt").is_err());
        assert!(Watermark::decode(b"{}", &t, "capture").is_err());
    }
}

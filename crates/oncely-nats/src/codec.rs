//! How effect keys and records are laid out in the bucket.
//!
//! KV keys may hold only `[-/_=.a-zA-Z0-9]`, and `.` separates tokens, so a
//! displayed effect key cannot be used as it is. The KV key is
//! `<escaped tenant>.<blake3 hex of the displayed key>`; the displayed key
//! itself is stored in the value, so it round-trips byte for byte and a hash
//! collision would be detected (and refused) rather than merged.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use oncely::{EffectKey, Error, Fingerprint, Outcome, RecordState, Result, Tenant};
use serde::{Deserialize, Serialize};

/// The key the server clock probe writes to. Escaped tenants never start with
/// `_oncely` (tenants starting with `_` are reserved and the only one is
/// `_global`) and every effect key contains a `.`, so it cannot collide.
pub(crate) const CLOCK_KEY: &str = "_oncely_clock";

/// The largest value this crate writes, in bytes: the outcome in base64 plus
/// the key and a few small fields. Buckets with a smaller `max_value_size`
/// are refused at connect time.
pub(crate) const MAX_VALUE_BYTES: usize = oncely::MAX_OUTCOME_BYTES.div_ceil(3) * 4 + 2048;

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
        };
        let o = Outcome::from_bytes(vec![0u8, 255, 10]).unwrap();
        s.set_outcome(Some(&o));
        s.set_state(RecordState::Completed);
        let back = Stored::decode(&s.encode().unwrap()).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.outcome().unwrap().unwrap(), o);
        assert_eq!(back.state().unwrap(), RecordState::Completed);
        assert!(Stored::decode(b"not json").is_err());
    }
}

//! The values a ledger stores and returns: fingerprints, outcomes, records,
//! leases, claims and claim options.

use std::fmt;
use std::time::{Duration, SystemTime};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::key::EffectKey;
pub use crate::state::RecordState;

/// Largest outcome the core accepts, in bytes (64 KiB).
///
/// Outcomes are results (an id, a status, an amount), not payloads; a
/// backend may declare a smaller limit in its [`Capabilities`](crate::ledger::Capabilities).
pub const MAX_OUTCOME_BYTES: usize = 64 * 1024;

/// BLAKE3 hash of a canonical request payload.
///
/// A claim that finds its key with another fingerprint fails with
/// [`Error::FingerprintMismatch`] and changes nothing.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of canonical bytes.
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Fingerprint(*blake3::hash(bytes).as_bytes())
    }

    /// The fingerprint of a serde value, serialized as JSON with object keys
    /// sorted, so field order does not change it.
    pub fn of_json<T: Serialize + ?Sized>(value: &T) -> Result<Self> {
        // serde_json's Map is a BTreeMap (no preserve_order), so going through
        // Value sorts every object's keys.
        let canonical = serde_json::to_vec(&serde_json::to_value(value)?)?;
        Ok(Fingerprint::of_bytes(&canonical))
    }

    /// The raw 32 bytes, as stored.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Rebuilds a stored fingerprint.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let arr: [u8; 32] = bytes
            .try_into()
            .map_err(|_| Error::Serialization(format!("fingerprint of {} bytes", bytes.len())))?;
        Ok(Fingerprint(arr))
    }

    /// Lowercase hex, for backends that store text.
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    /// Parses [`Fingerprint::to_hex`] output.
    pub fn from_hex(s: &str) -> Result<Self> {
        blake3::Hash::from_hex(s)
            .map(|h| Fingerprint(*h.as_bytes()))
            .map_err(|e| Error::Serialization(format!("fingerprint: {e}")))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

/// The serialized result of an effect (JSON bytes, at most
/// [`MAX_OUTCOME_BYTES`]), stored with the completed record and replayed to
/// duplicates byte for byte.
#[derive(Clone, PartialEq, Eq)]
pub struct Outcome(Vec<u8>);

impl Outcome {
    /// Serializes a value as the outcome.
    pub fn from_json<T: Serialize + ?Sized>(value: &T) -> Result<Self> {
        Outcome::from_bytes(serde_json::to_vec(value)?)
    }

    /// Takes bytes as the outcome, refusing more than [`MAX_OUTCOME_BYTES`].
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Self> {
        let bytes = bytes.into();
        if bytes.len() > MAX_OUTCOME_BYTES {
            return Err(Error::OutcomeTooLarge {
                size: bytes.len(),
                max: MAX_OUTCOME_BYTES,
            });
        }
        Ok(Outcome(bytes))
    }

    /// The stored bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the outcome is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Deserializes the outcome.
    pub fn to_value<T: DeserializeOwned>(&self) -> Result<T> {
        Ok(serde_json::from_slice(&self.0)?)
    }

    /// Consumes it into its bytes.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }

    /// The outcome [`Effects`](crate::Effects) and [`Job`](crate::Job) store
    /// for a handler that returned `value`: what a reconciler writes when the
    /// provider says the effect happened, so that duplicates replay it.
    pub fn value<T: Serialize + ?Sized>(value: &T) -> Result<Self> {
        Outcome::from_json(&StoredOutcome::Value(value))
    }

    /// The outcome stored for a terminal failure (replayed to duplicates as
    /// [`Error::Terminal`]). Messages longer than 4 KiB are cut at a
    /// character boundary.
    pub fn failure(message: &str) -> Result<Self> {
        Outcome::from_json(&StoredOutcome::<()>::Failed(truncate(message)))
    }

    /// Decodes an outcome written by [`Effects`](crate::Effects),
    /// [`Job`](crate::Job), [`Outcome::value`] or [`Outcome::failure`]: the
    /// handler's value or its stored terminal failure.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<StoredOutcome<T>> {
        self.to_value()
    }
}

/// What the runners store as an effect's outcome: the handler's value, or the
/// message of its terminal failure. Stored as JSON, `{"ok": value}` or
/// `{"err": "message"}`; read it back with [`Outcome::decode`] or
/// [`Record::stored`].
// Exhaustive by design (ARCHITECTURE.md, API boundaries): the stored JSON forms; a reader must know each.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StoredOutcome<T> {
    /// The handler's value.
    #[serde(rename = "ok")]
    Value(T),
    /// A terminal failure's message, replayed as [`Error::Terminal`].
    #[serde(rename = "err")]
    Failed(String),
}

impl<T> StoredOutcome<T> {
    /// The value, or the stored failure as [`Error::Terminal`] for `key`.
    pub fn into_result(self, key: &EffectKey) -> Result<T> {
        match self {
            StoredOutcome::Value(v) => Ok(v),
            StoredOutcome::Failed(message) => Err(Error::Terminal {
                key: key.to_string(),
                message,
            }),
        }
    }
}

/// Terminal messages are outcomes too; keep them well under the limit.
fn truncate(message: &str) -> String {
    const MAX: usize = 4096;
    if message.len() <= MAX {
        return message.to_owned();
    }
    let mut end = MAX;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &message[..end])
}

impl fmt::Debug for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match std::str::from_utf8(&self.0) {
            Ok(s) if s.len() <= 80 => write!(f, "Outcome({s})"),
            _ => write!(f, "Outcome({} bytes)", self.0.len()),
        }
    }
}

impl RecordState {
    /// Parses [`RecordState::as_str`] output.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "in_progress" => RecordState::InProgress,
            "completed" => RecordState::Completed,
            "released" => RecordState::Released,
            "abandoned" => RecordState::Abandoned,
            other => return Err(Error::Serialization(format!("unknown record state {other:?}"))),
        })
    }
}

/// One effect's record, as the ledger stores it. Timestamps come from the
/// backend's clock.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// The effect key.
    pub key: EffectKey,
    /// Where the record is in its life.
    pub state: RecordState,
    /// The fence of the latest lease: above every fence the key ever had,
    /// for the life of the ledger, prunes included (see [`Lease::fence`]).
    pub fence: u64,
    /// The request fingerprint of the first claim, if it gave one.
    pub fingerprint: Option<Fingerprint>,
    /// The stored outcome (completed records only; `None` on a completed
    /// record once it is erased, [`Record::is_erased`]).
    pub outcome: Option<Outcome>,
    /// Whether the record belongs to an at-most-once step.
    pub at_most_once: bool,
    /// When the key was first claimed.
    pub created_at: SystemTime,
    /// When the record last changed state.
    pub updated_at: SystemTime,
    /// When the current lease ends (in-progress records).
    pub lease_expires_at: Option<SystemTime>,
    /// Until when a completed or released record is kept.
    pub retain_until: SystemTime,
    /// The backend's clock when this record was read, so gaps are measured on
    /// one clock.
    pub read_at: SystemTime,
}

impl Record {
    /// Whether the record is a completed effect whose outcome was erased
    /// ([`Admin::erase`](crate::admin::Admin::erase)): completed, with no
    /// outcome. A completion always stores one, so only an erasure leaves a
    /// completed record without it. A claim of it fails with
    /// [`Error::Erased`]; the effect is never run again.
    pub fn is_erased(&self) -> bool {
        self.state == RecordState::Completed && self.outcome.is_none()
    }

    /// The stored outcome decoded as [`Outcome::decode`] does; `None` when
    /// the record holds no outcome (not completed).
    pub fn stored<T: DeserializeOwned>(&self) -> Result<Option<StoredOutcome<T>>> {
        self.outcome.as_ref().map(Outcome::decode).transpose()
    }

    /// A lease at this record's fence, for reconciling an abandoned step or a
    /// stuck claim: complete or release it as if you held it. Fails with
    /// [`Error::LeaseLost`] if the record moved on meanwhile.
    pub fn reconciliation_lease(&self) -> Lease {
        Lease {
            key: self.key.clone(),
            fence: self.fence,
            expires_at: self.lease_expires_at.unwrap_or(self.read_at),
            first_claimed_at: self.created_at,
            acquired_at: self.read_at,
            taken_over: false,
            at_most_once: self.at_most_once,
        }
    }
}

/// The right to perform an effect until [`Lease::expires_at`], fenced by
/// [`Lease::fence`].
///
/// Every write made with a lease (complete, renew, release, and the caller's
/// own fenced business writes) is refused once a later claimant holds a
/// higher fence. Only a ledger grants leases (backends build them with
/// [`backend::Grant`](crate::backend::Grant)); the fields are read through
/// accessors, so a lease cannot be put together from its parts by accident.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub(crate) key: EffectKey,
    pub(crate) fence: u64,
    pub(crate) expires_at: SystemTime,
    pub(crate) first_claimed_at: SystemTime,
    pub(crate) acquired_at: SystemTime,
    pub(crate) taken_over: bool,
    pub(crate) at_most_once: bool,
}

impl Lease {
    /// The effect key.
    pub fn key(&self) -> &EffectKey {
        &self.key
    }

    /// The fence token of this lease, to pass into fenced business writes
    /// (`UPDATE … WHERE id = $1 AND fence < $2`): strictly above every fence
    /// the key had before, for the life of the ledger (prunes included), so a
    /// stale holder can never match a later lease. Backends derive it from
    /// their clock (microseconds) or the previous fence + 1, whichever is
    /// higher ([`backend::next_fence`](crate::backend::next_fence)).
    pub fn fence(&self) -> u64 {
        self.fence
    }

    /// When the lease ends, on the backend's clock.
    pub fn expires_at(&self) -> SystemTime {
        self.expires_at
    }

    /// When the key was first claimed (by anyone), on the backend's clock.
    pub fn first_claimed_at(&self) -> SystemTime {
        self.first_claimed_at
    }

    /// When this lease was granted: the backend's clock at the moment the
    /// grant was written (after any wait on a lock), so
    /// `expires_at - acquired_at` is what was left of the lease then.
    pub fn acquired_at(&self) -> SystemTime {
        self.acquired_at
    }

    /// Whether this lease took over an expired lease or a released record.
    pub fn taken_over(&self) -> bool {
        self.taken_over
    }

    /// Whether the step is at-most-once.
    pub fn at_most_once(&self) -> bool {
        self.at_most_once
    }

    /// The provider idempotency key for this effect.
    pub fn provider_key(&self) -> String {
        self.key.provider_key()
    }

    /// The same lease with the end a renewal gave it (what
    /// [`Ledger::renew`](crate::ledger::Ledger::renew) returns).
    pub fn renewed_until(&self, expires_at: SystemTime) -> Lease {
        Lease {
            expires_at,
            ..self.clone()
        }
    }
}

/// The answer to a claim.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Claim {
    /// This caller holds the effect: perform it, then complete (or release).
    Acquired(Lease),
    /// The effect already happened; here is its record and outcome.
    Completed(Record),
    /// Another claimant holds a live lease.
    InProgress {
        /// The current holder's fence.
        fence: u64,
        /// When its lease ends, on the backend's clock.
        expires_at: SystemTime,
        /// When the key was first claimed, on the backend's clock.
        first_claimed_at: SystemTime,
        /// The backend's clock when this was read.
        read_at: SystemTime,
    },
    /// An at-most-once step was attempted and its lease ran out before it
    /// completed: it is not run again automatically.
    Abandoned(Record),
}

impl Claim {
    /// A short label for metrics and spans: `acquired`, `takeover`,
    /// `completed`, `in_progress`, `abandoned`.
    pub fn label(&self) -> &'static str {
        match self {
            Claim::Acquired(l) if l.taken_over => "takeover",
            Claim::Acquired(_) => "acquired",
            Claim::Completed(_) => "completed",
            Claim::InProgress { .. } => "in_progress",
            Claim::Abandoned(_) => "abandoned",
        }
    }
}

/// What a duplicate does when it finds the effect in progress elsewhere.
// Exhaustive by design (ARCHITECTURE.md, API boundaries): a duplicate waits (bounded) or does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnInProgress {
    /// Poll with bounded backoff for up to `max`, then fail with
    /// [`Error::InProgress`].
    Wait {
        /// The longest wait.
        max: Duration,
    },
    /// Fail at once with [`Error::InProgress`] (the broker redelivers later).
    Reject,
}

/// Options of a claim. `ClaimOptions::default()` gives a 30 s lease, 7 days
/// of retention, no fingerprint, `Wait { max: 30 s }`, and a safety margin
/// of a quarter of the lease. Start from a preset instead:
/// [`ClaimOptions::for_consumer`] for a broker consumer's handler (a short
/// wait, then the broker redelivers) and [`ClaimOptions::for_http`] for an
/// effect in an HTTP handler; each says why.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimOptions {
    /// How long the lease lasts before another claimant may take it over.
    pub lease: Duration,
    /// How long a completed or released record is kept. Must exceed the
    /// longest redelivery window, dead-letter replays included.
    pub retention: Duration,
    /// The request fingerprint, checked against the first claim's.
    pub fingerprint: Option<Fingerprint>,
    /// What [`Effects::run`](crate::Effects::run) does about a live lease elsewhere.
    pub on_in_progress: OnInProgress,
    /// At-most-once: an expired lease is reported as
    /// [`Claim::Abandoned`] instead of being taken over.
    pub at_most_once: bool,
    /// When the message was first produced (the broker's or the producer's
    /// timestamp). If the key is absent and this is at or before the
    /// ledger's horizon for the key's tenant and kind (the creation time of
    /// the newest record that `prune` deleted there), the record may have
    /// been pruned: the claim fails with [`Error::BeyondHorizon`] instead of
    /// running the effect again, whatever this claim's own retention.
    ///
    /// Without it, a claim cannot tell a pruned effect from a new one: a
    /// replay that arrives after its record was pruned runs again. Give it
    /// whenever the message carries its production time. It must lie between
    /// 1970 and 9999 ([`Error::InvalidInput`] otherwise).
    pub sent_at: Option<SystemTime>,
    /// Whether a terminal handler failure is stored and replayed to
    /// duplicates (`true`, the default) or released so a later delivery tries
    /// again.
    pub cache_failures: bool,
    /// The least lease that must be left, measured on the worker's
    /// monotonic clock from when the claim request was sent, for the runner
    /// to start the handler; a grant with less (a claim that waited on a
    /// lock, a slow round trip) is given back and claimed again. `None`: a
    /// quarter of the lease.
    pub safety_margin: Option<Duration>,
    /// Whether the claim's in-progress write may be acknowledged before it
    /// is flushed to disk (PostgreSQL: `synchronous_commit = off` for the
    /// claim's own transaction; the other backends write as they always
    /// do). The completion always waits for its flush. `false` by default.
    ///
    /// Only for an effect whose external call carries its provider
    /// idempotency key ([`Lease::provider_key`]): a database crash can then
    /// forget an acknowledged claim (and, on a synchronous standby, a
    /// failover can: the claim does not wait for the standby either), so a
    /// redelivery claims the key again and performs the effect a second time
    /// with the same provider key, which the provider deduplicates. Its
    /// fence is still above the forgotten one (fences follow the database
    /// clock). Refused for at-most-once steps ([`Error::InvalidInput`]),
    /// where the durable mark before the effect *is* the guarantee; claims
    /// in the caller's transaction commit with it, as it is configured.
    pub relaxed_claim: bool,
    /// Whether this claim is probably a duplicate of a completed effect:
    /// the broker says the message was delivered before (a delivery count
    /// above 1: `oncely_consumer::Context::redelivered`), or the runner
    /// claims again after the holder's completion woke it. A backend whose
    /// plain read costs its server less than a claim (Redis: `HMGET`
    /// against the claim script) then reads the record first and answers a
    /// completed effect (or an abandoned step, or another fingerprint) from
    /// it, and claims as usual otherwise: one round trip more for a
    /// redelivery that finds nothing done. The answer is the same either
    /// way; only its cost changes. `false` by default.
    pub redelivered: bool,
}

impl Default for ClaimOptions {
    fn default() -> Self {
        ClaimOptions {
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(7 * 24 * 3600),
            fingerprint: None,
            on_in_progress: OnInProgress::Wait {
                max: Duration::from_secs(30),
            },
            at_most_once: false,
            sent_at: None,
            cache_failures: true,
            safety_margin: None,
            relaxed_claim: false,
            redelivered: false,
        }
    }
}

impl ClaimOptions {
    /// The options for a broker consumer's handler: a 30 s lease, 7 days of
    /// retention, and a duplicate that finds the effect in progress elsewhere
    /// waits at most 200 ms before it fails with [`Error::InProgress`] (which
    /// `oncely-consumer` turns into a redelivery after its
    /// `in_progress_delay`).
    ///
    /// **The trade.** A consumer has a broker that redelivers, so a duplicate
    /// gains little by waiting: a long wait (the default's 30 s) holds one of
    /// the consumer's concurrency slots, and the broker's prefetch behind it,
    /// for as long as the first delivery runs, while a redelivery a moment
    /// later finds the effect completed and acks at once. A short wait still
    /// answers the common case where both copies arrive together and the
    /// first finishes within milliseconds. **Size the lease to the handler**
    /// with [`lease`](Self::lease): about twice its usual time and no less
    /// than its slowest external call; the runner
    /// ([`Effects::run`](crate::Effects::run)) renews it every third of its
    /// length while the handler runs, so a longer handler is safe, and a
    /// worker that dies is taken over once the lease ends: a shorter lease
    /// means a crashed worker's message is redone sooner, a longer one means
    /// fewer renewals. Pass [`sent_at`](Self::sent_at) from the message and
    /// [`redelivered`](Self::redelivered) from the delivery count.
    ///
    /// ```
    /// use std::time::Duration;
    /// use oncely::{ClaimOptions, OnInProgress};
    /// let opts = ClaimOptions::for_consumer().lease(Duration::from_secs(10));
    /// assert_eq!(opts.on_in_progress, OnInProgress::Wait { max: Duration::from_millis(200) });
    /// ```
    pub fn for_consumer() -> Self {
        ClaimOptions::default().on_in_progress(OnInProgress::Wait {
            max: Duration::from_millis(200),
        })
    }

    /// The options for an effect run inside an HTTP request handler: a 60 s
    /// lease, 24 hours of retention, and a duplicate request that finds the
    /// effect in progress waits up to 5 s for its outcome before it fails
    /// with [`Error::InProgress`] (answer it with a 409 and `Retry-After`).
    ///
    /// **The trade.** Nothing redelivers an HTTP request: the client is on
    /// the other end of the connection, waiting. A short wait gives a retry
    /// that raced its first attempt (a client timeout, a double click) the
    /// first attempt's answer instead of an error it must handle and retry;
    /// beyond a few seconds the wait ties up the connection and runs into the
    /// client's own timeout, so the bound is short, and an error is the
    /// answer after it. The lease outlives any request the server would
    /// still answer (renewed while the handler runs); the retention is what
    /// the IETF draft asks servers to publish as a key's lifetime, 24 hours
    /// here: lengthen it if your clients retry later than that.
    /// `oncely-tower`'s layer uses this lease and retention, but answers an
    /// in-flight duplicate at once with a 409 by default, as the draft
    /// describes; `IdempotencyLayer::on_in_flight` makes it wait.
    ///
    /// ```
    /// use std::time::Duration;
    /// use oncely::{ClaimOptions, OnInProgress};
    /// let opts = ClaimOptions::for_http();
    /// assert_eq!(opts.on_in_progress, OnInProgress::Wait { max: Duration::from_secs(5) });
    /// assert_eq!(opts.retention, Duration::from_secs(24 * 3600));
    /// ```
    pub fn for_http() -> Self {
        ClaimOptions::default()
            .lease(Duration::from_secs(60))
            .retention(Duration::from_secs(24 * 3600))
            .on_in_progress(OnInProgress::Wait {
                max: Duration::from_secs(5),
            })
    }

    /// Sets the lease length.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets the retention of completed records.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets the request fingerprint.
    pub fn fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// Sets [`ClaimOptions::relaxed_claim`](#structfield.relaxed_claim):
    /// the claim is acknowledged before its flush, the completion is not.
    pub fn relaxed_claim(mut self, yes: bool) -> Self {
        self.relaxed_claim = yes;
        self
    }

    /// Sets [`ClaimOptions::redelivered`](#structfield.redelivered): the
    /// claim is probably a duplicate of a completed effect.
    pub fn redelivered(mut self, yes: bool) -> Self {
        self.redelivered = yes;
        self
    }

    /// Sets the in-progress policy.
    pub fn on_in_progress(mut self, policy: OnInProgress) -> Self {
        self.on_in_progress = policy;
        self
    }

    /// Marks the claim at-most-once.
    pub fn at_most_once(mut self, yes: bool) -> Self {
        self.at_most_once = yes;
        self
    }

    /// Sets when the message was first produced (horizon check).
    pub fn sent_at(mut self, at: SystemTime) -> Self {
        self.sent_at = Some(at);
        self
    }

    /// Sets whether terminal failures are stored and replayed.
    pub fn cache_failures(mut self, yes: bool) -> Self {
        self.cache_failures = yes;
        self
    }

    /// Sets the safety margin (see [`ClaimOptions::safety_margin`]).
    pub fn safety_margin(mut self, margin: Duration) -> Self {
        self.safety_margin = Some(margin);
        self
    }

    /// The safety margin in effect: the one set, or a quarter of the lease.
    pub fn margin(&self) -> Duration {
        self.safety_margin.unwrap_or(self.lease / 4)
    }

    /// Checks the options before any round trip ([`Error::InvalidInput`]): a
    /// lease of at least 1 ms and at most a day, retention of at least the
    /// lease and at most ten years, a safety margin below the lease, and a
    /// `sent_at` between 1970 and 9999.
    pub fn validate(&self) -> Result<()> {
        if self.lease < Duration::from_millis(1) || self.lease > Duration::from_secs(86_400) {
            return Err(Error::InvalidInput(format!(
                "lease must be between 1 ms and 1 day, got {:?}",
                self.lease
            )));
        }
        if self.retention < self.lease || self.retention > Duration::from_secs(10 * 365 * 86_400) {
            return Err(Error::InvalidInput(format!(
                "retention must be at least the lease and at most 10 years, got {:?}",
                self.retention
            )));
        }
        if self.margin() >= self.lease {
            return Err(Error::InvalidInput(format!(
                "safety margin {:?} must be shorter than the lease {:?}",
                self.margin(),
                self.lease
            )));
        }
        if self.relaxed_claim && self.at_most_once {
            return Err(Error::InvalidInput(
                "relaxed_claim is refused for an at-most-once step: its durable mark before the effect \
                 is the guarantee (a crash that forgot it would perform the effect again)"
                    .to_owned(),
            ));
        }
        if let Some(at) = self.sent_at {
            crate::time::to_micros(at).map_err(|_| {
                Error::InvalidInput(format!("sent_at must lie between 1970 and 9999, got {at:?}"))
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;

    #[test]
    fn relaxed_claims_are_refused_for_at_most_once_steps() {
        let relaxed = ClaimOptions::default().relaxed_claim(true);
        relaxed.validate().unwrap();
        let e = relaxed.at_most_once(true).validate().unwrap_err();
        assert!(
            matches!(e, Error::InvalidInput(ref m) if m.contains("at-most-once")),
            "{e:?}"
        );
    }

    #[test]
    fn fingerprint_ignores_field_order() {
        let a = serde_json::json!({"amount": 10, "order": "o-1"});
        let b: serde_json::Value = serde_json::from_str(r#"{"order":"o-1","amount":10}"#).unwrap();
        assert_eq!(
            Fingerprint::of_json(&a).unwrap(),
            Fingerprint::of_json(&b).unwrap()
        );
        let c = serde_json::json!({"amount": 11, "order": "o-1"});
        assert_ne!(
            Fingerprint::of_json(&a).unwrap(),
            Fingerprint::of_json(&c).unwrap()
        );
        let f = Fingerprint::of_json(&a).unwrap();
        assert_eq!(Fingerprint::from_hex(&f.to_hex()).unwrap(), f);
        assert_eq!(Fingerprint::from_bytes(f.as_bytes()).unwrap(), f);
    }

    #[test]
    fn outcome_limit_is_exact() {
        assert!(Outcome::from_bytes(vec![b'1'; MAX_OUTCOME_BYTES]).is_ok());
        let e = Outcome::from_bytes(vec![b'1'; MAX_OUTCOME_BYTES + 1]).unwrap_err();
        assert!(
            matches!(e, Error::OutcomeTooLarge { size, max } if size == MAX_OUTCOME_BYTES + 1 && max == MAX_OUTCOME_BYTES)
        );
    }

    #[test]
    fn stored_outcomes_decode_publicly() {
        let k = EffectKey::parse("acme/capture:o-1").unwrap();
        let ok = Outcome::value(&serde_json::json!({"charge": "ch_1"})).unwrap();
        assert_eq!(ok.as_bytes(), br#"{"ok":{"charge":"ch_1"}}"#);
        match ok.decode::<serde_json::Value>().unwrap() {
            StoredOutcome::Value(v) => assert_eq!(v["charge"], "ch_1"),
            other => panic!("{other:?}"),
        }
        let failed = Outcome::failure("card declined").unwrap();
        assert_eq!(
            failed.decode::<u32>().unwrap(),
            StoredOutcome::Failed("card declined".into())
        );
        let e = failed.decode::<u32>().unwrap().into_result(&k).unwrap_err();
        assert!(matches!(e, Error::Terminal { ref message, .. } if message == "card declined"));
        let long = Outcome::failure(&"é".repeat(5000)).unwrap();
        assert!(long.len() < 4200);
        // A raw outcome that no runner wrote is a decoding error, not a value.
        assert!(Outcome::from_json(&7).unwrap().decode::<u32>().is_err());
    }

    #[test]
    fn options_validate() {
        assert!(ClaimOptions::default().validate().is_ok());
        assert!(ClaimOptions::default().lease(Duration::ZERO).validate().is_err());
        assert!(
            ClaimOptions::default()
                .lease(Duration::from_secs(60))
                .retention(Duration::from_secs(1))
                .validate()
                .is_err()
        );
        let bad = |o: ClaimOptions| matches!(o.validate(), Err(Error::InvalidInput(_)));
        assert!(bad(
            ClaimOptions::default().sent_at(UNIX_EPOCH - Duration::from_secs(1))
        ));
        assert!(bad(
            ClaimOptions::default().sent_at(UNIX_EPOCH + Duration::from_secs(1 << 40))
        ));
        assert!(bad(ClaimOptions::default().safety_margin(Duration::from_secs(30))));
        assert!(ClaimOptions::default().sent_at(UNIX_EPOCH).validate().is_ok());
        assert!(
            ClaimOptions::default()
                .sent_at(SystemTime::now())
                .validate()
                .is_ok()
        );
    }
}

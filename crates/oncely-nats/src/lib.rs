//! # oncely-nats
//!
//! An [`oncely`] effect ledger on a NATS JetStream key-value bucket: claims
//! are `create` (insert if absent) and revision-checked `update`s, so the
//! check and the claim are one atomic operation on the stream leader, and
//! with `replicas = 3` every acknowledged write is on a Raft quorum.
//!
//! ```no_run
//! use std::sync::Arc;
//! use oncely::{ClaimOptions, EffectKey, Effects, Tenant};
//! use oncely_nats::{NatsKvLedger, NatsKvOptions};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> oncely::Result<()> {
//! let ledger = NatsKvLedger::connect(
//!     "nats://n1:4222,nats://n2:4222,nats://n3:4222",
//!     NatsKvOptions::default().replicas(3),
//! )
//! .await?;
//! let effects = Effects::new(Arc::new(ledger));
//! let key = EffectKey::new(&Tenant::global(), "capture", "order-123")?;
//! let charge: String = effects
//!     .run(&key, &ClaimOptions::default(), |lease| async move {
//!         // call the provider with lease.provider_key() as its idempotency key
//!         Ok(format!("ch_{}", &lease.provider_key()[..8]))
//!     })
//!     .await?;
//! # let _ = charge; Ok(()) }
//! ```
//!
//! ## Guarantees and limits
//!
//! | | |
//! | --- | --- |
//! | atomic claim | `create` (expected last subject sequence 0) for an absent key; takeover of an expired or released record by `update` expecting the revision just read. A lost race re-reads and decides again. |
//! | caller's transaction | no: NATS has none. Use `ProviderKeyed` or `AtMostOnce` steps. |
//! | durability | JetStream file storage; a write is acknowledged once stored. |
//! | replication | `replicas = 3`: Raft, acknowledged after a quorum has it; survives the loss of one node. `replicas = 1`: none. |
//! | clock | NATS server timestamps of each revision; "now" is a lower bound of the server's clock (see below), never the worker's wall clock. |
//! | max key | [`oncely::MAX_KEY_BYTES`] (the displayed key is stored in the value; the KV key is `<tenant>.<blake3 hex>`). |
//! | max outcome | [`oncely::MAX_OUTCOME_BYTES`] (stored base64, far below JetStream's 1 MiB message limit). |
//! | fences | the server clock's µs (its lower bound, below) when a record is created, `max(previous + 1, clock µs)` on takeover ([`oncely::backend::next_fence`]): they grow for the life of the bucket, across prunes and `max_age` drops, as long as retentions are longer than the clock estimate's lag (a probe's round trip, below). |
//! | horizon | per tenant and kind: the later of a watermark that `prune` raises before it deletes, and `now - max_age` (what the bucket drops by itself). See below. |
//! | round trips | claim of a new key: 1 (2 with `sent_at`: the create, then the watermark). complete / release / renew: 1 when this ledger made the claim (it remembers the revision), else 2 (read, conditional write). |
//! | prune / abandoned | read the latest revision of every key (the whole bucket / one tenant's keys) through an ordered consumer: cost grows with the keys kept, so prune in batches off the hot path. Prune also writes each pruned tenant and kind's watermark once per call (2 round trips each). |
//! | retention | per claim, enforced by [`Ledger::prune`]; the bucket's `max_age` is the hard ceiling (a longer retention is refused). |
//!
//! ### Clocks
//!
//! A revision's server timestamp is when it was written; a record stores the
//! lease *length* and retention *length*, not instants, so expiry is "server
//! now - revision timestamp > lease". The server never sends its current
//! time, so each ledger keeps a lower bound of it: a probe write to a
//! reserved key, read back, renewed by the first operation after it is 2 s
//! old, advanced meanwhile by the worker's monotonic clock (0.1 % allowance
//! for rate differences), and raised by every timestamp the ledger reads.
//! It is never ahead of the server, and behind by at most a probe's round
//! trip plus 0.1 % of 2 s; leases therefore expire at most that late, never
//! early. A lease is enforced from the stamp of the revision that granted or
//! renewed it; the [`oncely::Lease`] a claim or renewal returns has
//! `acquired_at` = the estimate read just before that write (so at or before
//! the stamp) and `expires_at = acquired_at + length`: it never ends later
//! than the lease the server enforces, so the runner's deadline and safety
//! margin, computed from it, err on the safe side. Timestamps in
//! [`oncely::Record`] and [`oncely::Lease`] are server stamps or this
//! estimate. Cluster nodes' clocks must be in sync (NTP), as JetStream
//! itself assumes. A server clock outside 1970..9999 is an error
//! ([`oncely::Error::Backend`], not retryable), never a panic.
//!
//! ### Retention and `max_age`
//!
//! The bucket's `max_age` (default 30 days) drops any key not written for
//! that long. Claims whose retention exceeds the configured `max_age` are
//! refused before any round trip ([`oncely::Error::InvalidInput`]) so no
//! completed record vanishes before its retention ends. Shorter retention
//! is honoured by `prune`, which deletes completed and released records past
//! it with a revision-checked delete (a record changed meanwhile is left
//! alone). Limits that follow from `max_age`: an abandoned at-most-once step
//! (or a lease nobody takes over) disappears `max_age` after its last write,
//! so reconcile abandoned steps within `max_age`; and a deleted key leaves a
//! small delete marker until `max_age`. A key whose record was pruned or
//! dropped gets a fence above all its earlier ones when claimed again.
//! `max_age` must be at least 2 days (longer than the longest lease).
//!
//! ### Horizon
//!
//! [`Ledger::horizon`] of a tenant and kind is the later of two instants:
//! the newest `created_at` among the records `prune` deleted there (a
//! watermark kept in the bucket at `<tenant>.horizon.<blake3 hex of the
//! kind>`, raised with a revision-checked update *before* each delete), and
//! `now - max_age` of the bucket (a record untouched that long vanished, and
//! was created before). A claim of an absent key whose
//! [`oncely::ClaimOptions::sent_at`] is at or before the horizon fails with
//! [`oncely::Error::BeyondHorizon`] and leaves nothing behind: older than
//! `now - max_age` before any write; otherwise the claim creates the record,
//! then reads the watermark, and deletes exactly the revision it created if
//! the message is beyond it. That order (prune: raise, then delete; claim:
//! create, then read) is what makes a replay of a pruned effect unable to
//! run again; `horizon.rs` has the argument. A claim's own retention plays
//! no part. A record whose claimant died between its create and that check
//! is checked again by whoever takes its expired lease over. Without
//! `sent_at`, a claim cannot tell a replay of a pruned effect from new work:
//! it runs it; give messages their production time where replays can come
//! late. An existing record always answers for itself, however old the
//! message.
//!
//! ### Errors
//!
//! Cannot connect: [`oncely::Error::Unavailable`]. JetStream unavailable, no
//! quorum, timeouts: [`oncely::Error::Backend`] with `retryable: true`;
//! `connect` itself keeps asking for up to `open_timeout` (default 30 s)
//! while a cluster that just (re)started elects the bucket's leader. A
//! server running without JetStream: [`oncely::Error::Config`] at once. A
//! bucket with incompatible settings (history other than 1, a shorter
//! `max_age`, other replicas, memory storage, message or byte limits that
//! could drop live leases): [`oncely::Error::Config`], and nothing is
//! changed. Every write is one revision-checked message, so a dropped future
//! has either been applied by the server or not, never half, and a write
//! based on a stale read is refused rather than applied.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod clock;
mod codec;
mod horizon;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_nats::jetstream::{self, kv, stream};
use futures_util::StreamExt;
use oncely::backend::{
    answer_existing, check_outcome, effective_state, from_micros, is_beyond_horizon, next_fence, to_micros,
};
use oncely::{
    Capabilities, Claim, ClaimOptions, EffectKey, Error, Lease, Ledger, Outcome, Record, RecordState, Result,
    Tenant,
};

use crate::clock::ServerClock;
use crate::codec::{CLOCK_KEY, MAX_VALUE_BYTES, Stored, is_record_key, kv_key, tenant_token};

const BACKEND: &str = "nats";
/// How often one operation re-reads and retries after losing a race on the
/// same key before it gives up with a retryable error.
const MAX_ATTEMPTS: usize = 64;
/// How many leases' revisions a ledger remembers for one-round-trip completes.
const REVISION_CACHE: usize = 4096;
/// The longest lease [`ClaimOptions::validate`] allows.
const MAX_LEASE: Duration = Duration::from_secs(86_400);

/// Options of [`NatsKvLedger::connect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsKvOptions {
    /// The KV bucket (default `oncely_effects`).
    pub bucket: String,
    /// Replicas of the bucket's stream: 1, or 3 on a cluster (default 1).
    pub replicas: usize,
    /// The bucket's `max_age`: the longest retention a claim may ask for, and
    /// the age at which the server drops a key nobody wrote to (default 30
    /// days, at least 2 days).
    pub max_age: Duration,
    /// How long to wait for the initial connection (default 5 s).
    pub connect_timeout: Duration,
    /// How long to wait for a JetStream reply (default 5 s).
    pub request_timeout: Duration,
    /// How long [`NatsKvLedger::connect`] keeps asking while the bucket does
    /// not answer yet, as when a cluster that just restarted is still electing
    /// the stream's leader (default 30 s). Settings the ledger refuses fail at
    /// once.
    pub open_timeout: Duration,
    /// Whether `connect` creates the bucket when it does not exist (default
    /// `true`). With `false` a missing bucket is [`Error::Config`]: what
    /// operator commands that must not create anything (`oncely get`,
    /// `abandoned`, `prune`) ask for. An existing bucket's settings are
    /// checked either way.
    pub migrate: bool,
}

impl Default for NatsKvOptions {
    fn default() -> Self {
        NatsKvOptions {
            bucket: "oncely_effects".to_owned(),
            replicas: 1,
            max_age: Duration::from_secs(30 * 86_400),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            open_timeout: Duration::from_secs(30),
            migrate: true,
        }
    }
}

impl NatsKvOptions {
    /// Sets the bucket name.
    pub fn bucket(mut self, bucket: impl Into<String>) -> Self {
        self.bucket = bucket.into();
        self
    }

    /// Sets the replica count (1 or 3).
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// Sets the bucket's `max_age` (the retention ceiling).
    pub fn max_age(mut self, max_age: Duration) -> Self {
        self.max_age = max_age;
        self
    }

    /// Sets the connect timeout.
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// Sets the JetStream request timeout.
    pub fn request_timeout(mut self, t: Duration) -> Self {
        self.request_timeout = t;
        self
    }

    /// Sets how long `connect` waits for the bucket to answer.
    pub fn open_timeout(mut self, t: Duration) -> Self {
        self.open_timeout = t;
        self
    }

    /// Sets whether `connect` creates a missing bucket (see
    /// [`NatsKvOptions::migrate`](#structfield.migrate)).
    pub fn migrate(mut self, yes: bool) -> Self {
        self.migrate = yes;
        self
    }

    fn validate(&self) -> Result<()> {
        if self.bucket.is_empty()
            || !self
                .bucket
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(Error::Config(format!(
                "bucket name {:?} must be non-empty ASCII letters, digits, '_' or '-'",
                self.bucket
            )));
        }
        if !matches!(self.replicas, 1 | 3) {
            return Err(Error::Config(format!(
                "replicas must be 1 or 3, got {}",
                self.replicas
            )));
        }
        if self.max_age < 2 * MAX_LEASE {
            return Err(Error::Config(format!(
                "max_age must be at least 2 days (longer than the longest lease), got {:?}",
                self.max_age
            )));
        }
        Ok(())
    }
}

/// The revision a ledger last wrote for a lease it holds, so complete /
/// release / renew can write without reading first. A revision-checked write
/// with it succeeds only if nothing changed since, which is exactly the state
/// remembered here.
type RevisionCache = HashMap<String, (u64, Stored)>;

struct Inner {
    store: kv::Store,
    opts: NatsKvOptions,
    /// The bucket's own `max_age` (at least `opts.max_age`), `None` when
    /// unbounded: records untouched this long vanish, which bounds the horizon.
    bucket_max_age: Option<Duration>,
    clock: ServerClock,
    revisions: Mutex<RevisionCache>,
}

/// An effect ledger on a NATS JetStream KV bucket. Cheap to clone (shares the
/// connection).
#[derive(Clone)]
pub struct NatsKvLedger {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for NatsKvLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsKvLedger")
            .field("bucket", &self.inner.opts.bucket)
            .field("replicas", &self.inner.opts.replicas)
            .finish()
    }
}

fn backend_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("{what}: {e}"),
        retryable: true,
    }
}

/// A time read from the server that records cannot hold: the server's clock
/// is wrong (before 1970 or after 9999), not the caller's input.
fn clock_out_of_range(t: SystemTime) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("the NATS server's clock reads {t:?}, outside 1970..9999"),
        retryable: false,
    }
}

/// `t` in µs, for a time that came from the server's clock.
fn server_us(t: SystemTime) -> Result<i64> {
    to_micros(t).map_err(|_| clock_out_of_range(t))
}

/// `at + d` for a server time and a validated length (a lease, at most a
/// day): checked, so a broken server clock is an error, never a panic.
fn later(at: SystemTime, d: Duration) -> Result<SystemTime> {
    at.checked_add(d).ok_or_else(|| clock_out_of_range(at))
}

/// `at + us` for a length read from a stored record: checked, so a value
/// no oncely ledger wrote is reported as corrupt, never a panic.
fn stored_end(at: SystemTime, us: u64, what: &str) -> Result<SystemTime> {
    at.checked_add(Duration::from_micros(us))
        .ok_or_else(|| Error::Corrupt {
            backend: BACKEND,
            message: format!("{what} of {us} µs from {at:?} ends past the representable time"),
        })
}

/// Whole µs of a validated lease or retention (at most ten years).
fn length_us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// One message as read from the stream leader.
struct Raw {
    revision: u64,
    at: SystemTime,
    /// `None`: a delete or purge marker (the key is absent).
    payload: Option<bytes::Bytes>,
}

/// One key's latest revision as read from the stream leader.
struct Current {
    revision: u64,
    at: SystemTime,
    /// `None`: a delete or purge marker (the key is absent).
    value: Option<Stored>,
}

enum Write {
    Done(u64),
    Conflict,
}

impl NatsKvLedger {
    /// Connects to one server or a comma-separated list, opens the bucket and
    /// creates it if absent. A bucket that exists with settings this ledger
    /// cannot rely on fails with [`Error::Config`] and is left unchanged.
    pub async fn connect(urls: &str, opts: NatsKvOptions) -> Result<Self> {
        opts.validate()?;
        let addrs: Vec<async_nats::ServerAddr> = urls
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .enumerate()
            .map(|(i, s)| {
                // Name the address by position: it may carry a password.
                s.parse()
                    .map_err(|e| Error::Config(format!("NATS url #{} of the list: {e}", i + 1)))
            })
            .collect::<Result<_>>()?;
        if addrs.is_empty() {
            return Err(Error::Config("no NATS url given".into()));
        }
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(opts.connect_timeout)
            .request_timeout(Some(opts.request_timeout))
            .name("oncely")
            .connect(addrs)
            .await
            .map_err(|e| Error::Unavailable {
                backend: BACKEND,
                message: e.to_string(),
            })?;
        let js = jetstream::ContextBuilder::new()
            .timeout(opts.request_timeout)
            .build(client);
        // One deadline for opening the bucket and the first clock probe.
        let deadline = Deadline::after(opts.open_timeout);
        let store = open_bucket(&js, &opts, deadline).await?;
        Self::with_store(store, opts, deadline).await
    }

    /// Uses a bucket the caller opened. Its settings are checked as by
    /// [`NatsKvLedger::connect`] against `opts` (the bucket name is taken
    /// from the store).
    pub async fn from_store(store: kv::Store, opts: NatsKvOptions) -> Result<Self> {
        let opts = NatsKvOptions {
            bucket: store.name.clone(),
            ..opts
        };
        opts.validate()?;
        check_bucket(&store.stream.cached_info().config, &opts)?;
        let deadline = Deadline::after(opts.open_timeout);
        Self::with_store(store, opts, deadline).await
    }

    async fn with_store(store: kv::Store, opts: NatsKvOptions, deadline: Deadline) -> Result<Self> {
        let bucket_max_age = Some(store.stream.cached_info().config.max_age).filter(|a| !a.is_zero());
        let ledger = NatsKvLedger {
            inner: Arc::new(Inner {
                store,
                opts,
                bucket_max_age,
                clock: ServerClock::default(),
                revisions: Mutex::new(HashMap::new()),
            }),
        };
        // A replicated bucket just created answers only once its stream has
        // elected a leader; the first clock probe doubles as that wait.
        loop {
            match ledger.now().await {
                Ok(_) => return Ok(ledger),
                Err(e) if !deadline.passed() => {
                    tracing::debug!(error = %e, "bucket not ready yet");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The underlying bucket.
    pub fn store(&self) -> &kv::Store {
        &self.inner.store
    }

    /// The options in force.
    pub fn options(&self) -> &NatsKvOptions {
        &self.inner.opts
    }

    fn subject(&self, kv_key: &str) -> String {
        format!("{}{}", self.inner.store.prefix, kv_key)
    }

    /// A lower bound of the server's current time (see the crate docs), in
    /// whole microseconds (the unit records store, so a lease's
    /// `first_claimed_at` equals the stored one exactly) and within what
    /// records can hold (1970..9999; a server clock outside is an error).
    async fn now(&self) -> Result<SystemTime> {
        let t = self.now_exact().await?;
        server_us(t).map(from_micros)
    }

    async fn now_exact(&self) -> Result<SystemTime> {
        if let Some(now) = self.inner.clock.fresh_now() {
            return Ok(now);
        }
        let _single = self.inner.clock.probing.lock().await;
        if let Some(now) = self.inner.clock.fresh_now() {
            return Ok(now);
        }
        self.inner
            .store
            .put(CLOCK_KEY, bytes::Bytes::new())
            .await
            .map_err(|e| backend_err("clock probe", e))?;
        let msg = self
            .inner
            .store
            .stream
            .get_last_raw_message_by_subject(&self.subject(CLOCK_KEY))
            .await
            .map_err(|e| backend_err("clock probe", e))?;
        self.inner
            .clock
            .probed(SystemTime::from(msg.time), Instant::now());
        self.inner
            .clock
            .fresh_now()
            .ok_or_else(|| backend_err("clock probe", "no sample"))
    }

    /// Reads a key's latest message from the stream leader (a direct get may
    /// be answered by a lagging replica).
    async fn read_raw(&self, kv_key: &str) -> Result<Option<Raw>> {
        use async_nats::jetstream::stream::LastRawMessageErrorKind as K;
        let msg = match self
            .inner
            .store
            .stream
            .get_last_raw_message_by_subject(&self.subject(kv_key))
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == K::NoMessageFound => return Ok(None),
            Err(e) => return Err(backend_err("read", e)),
        };
        let at = SystemTime::from(msg.time);
        self.inner.clock.observe(at);
        let deleted = msg
            .headers
            .get("KV-Operation")
            .is_some_and(|op| matches!(op.as_str(), "DEL" | "PURGE"));
        Ok(Some(Raw {
            revision: msg.sequence,
            at,
            payload: (!deleted).then_some(msg.payload),
        }))
    }

    /// Reads a record's latest revision from the stream leader.
    async fn read(&self, kv_key: &str) -> Result<Option<Current>> {
        let Some(raw) = self.read_raw(kv_key).await? else {
            return Ok(None);
        };
        let value = raw
            .payload
            .map(|p| {
                Stored::decode(&p).map_err(|e| Error::Corrupt {
                    backend: BACKEND,
                    message: format!("value at {kv_key} is not an oncely record: {e}"),
                })
            })
            .transpose()?;
        Ok(Some(Current {
            revision: raw.revision,
            at: raw.at,
            value,
        }))
    }

    /// A record write that succeeds only if the key's latest revision is
    /// `revision` (0: the key has never been written, or its history is gone).
    async fn write(&self, kv_key: &str, value: &Stored, revision: u64) -> Result<Write> {
        self.write_raw(kv_key, value.encode()?, revision).await
    }

    /// [`NatsKvLedger::write`] of any value.
    async fn write_raw(&self, kv_key: &str, bytes: bytes::Bytes, revision: u64) -> Result<Write> {
        match self.inner.store.update(kv_key, bytes, revision).await {
            Ok(rev) => Ok(Write::Done(rev)),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(Write::Conflict),
            Err(e) => Err(backend_err("write", e)),
        }
    }

    fn remember(&self, kv_key: &str, revision: u64, value: Stored) {
        let mut c = self.inner.revisions.lock().unwrap_or_else(|p| p.into_inner());
        if c.len() >= REVISION_CACHE {
            // Leases that were never completed (crashed handlers, dropped
            // futures) would otherwise pile up; forgetting only costs a read.
            c.clear();
        }
        c.insert(kv_key.to_owned(), (revision, value));
    }

    fn recall(&self, kv_key: &str, fence: u64) -> Option<(u64, Stored)> {
        let mut c = self.inner.revisions.lock().unwrap_or_else(|p| p.into_inner());
        match c.get(kv_key) {
            Some((_, v)) if v.fence == fence => c.remove(kv_key),
            _ => None,
        }
    }

    fn check_retention(&self, retention: Duration) -> Result<()> {
        // A completed record must outlive its retention; the bucket would
        // drop it at max_age, so a longer retention is a promise we cannot
        // keep: refused up front, before any round trip.
        if retention > self.inner.opts.max_age {
            return Err(Error::InvalidInput(format!(
                "retention {retention:?} exceeds the bucket's max_age {:?}",
                self.inner.opts.max_age
            )));
        }
        Ok(())
    }

    fn decode_key(&self, stored: &Stored, expected: Option<&EffectKey>) -> Result<EffectKey> {
        let key = EffectKey::parse(&stored.key).map_err(|e| Error::Corrupt {
            backend: BACKEND,
            message: format!("stored key {:?}: {e}", stored.key),
        })?;
        if let Some(exp) = expected
            && &key != exp
        {
            return Err(Error::Corrupt {
                backend: BACKEND,
                message: format!("KV key of {exp} holds {key}"),
            });
        }
        Ok(key)
    }

    fn view(&self, key: EffectKey, s: &Stored, at: SystemTime, now: SystemTime) -> Result<Record> {
        let stored = s.state()?;
        let lease_end = stored_end(at, s.lease_us, "lease")?;
        let state = effective_state(stored, s.amo, Some(lease_end), now);
        Ok(Record {
            key,
            state,
            fence: s.fence,
            fingerprint: s.fingerprint()?,
            outcome: s.outcome()?,
            at_most_once: s.amo,
            created_at: from_micros(s.first_us),
            updated_at: at,
            lease_expires_at: matches!(state, RecordState::InProgress | RecordState::Abandoned)
                .then_some(lease_end),
            retain_until: stored_end(at, s.retention_us, "retention")?,
            read_at: now.max(at),
        })
    }

    async fn claim_inner(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        let kk = kv_key(key);
        // `validate` has checked it lies in 1970..9999.
        let sent_us = opts.sent_at.map(to_micros).transpose()?;
        // Most claims are of new keys: try the create first. A claim with
        // `sent_at` does too: its horizon check follows the create (see
        // horizon.rs for why that order).
        let mut known: Option<Option<Current>> = Some(None);
        // The fence of a record this claim removed (below): the new record's
        // fence goes above it whatever the clock estimates say.
        let mut floor: Option<u64> = None;
        for _ in 0..MAX_ATTEMPTS {
            let cur = match known.take() {
                Some(c) => c,
                None => self.read(&kk).await?,
            };
            // Read before the write is sent, so it is at most the server's
            // time when the write takes effect (the revision's stamp, from
            // which everyone else measures this lease): the lease we report,
            // `now + lease`, ends no later than the one the server enforces,
            // so the runner's deadline and safety margin err on the safe side.
            let now = self.now().await?;
            let (revision, prev) = match cur {
                None => (0, None),
                Some(Current {
                    revision,
                    value: None,
                    ..
                }) => (revision, None),
                Some(Current {
                    revision,
                    at,
                    value: Some(v),
                }) => (revision, Some((at, v))),
            };
            let Some((at, prev)) = prev else {
                // What the bucket dropped by age needs no round trip to know.
                if is_beyond_horizon(opts.sent_at, self.aged_out_before(now)) {
                    return Err(Error::BeyondHorizon { key: key.to_string() });
                }
                let now_us = server_us(now)?;
                let value = Stored {
                    v: 1,
                    key: key.to_string(),
                    state: RecordState::InProgress.as_str().to_owned(),
                    // The clock carries the order across prunes: the key's
                    // pruned record got its last fence at least its
                    // retention ago, on the same clock.
                    fence: next_fence(floor, now_us),
                    fp: opts.fingerprint.map(|f| f.to_hex()),
                    outcome: None,
                    amo: opts.at_most_once,
                    first_us: now_us,
                    lease_us: length_us(opts.lease),
                    retention_us: length_us(opts.retention),
                    hz: sent_us,
                };
                let lease = oncely::backend::Grant {
                    key: key.clone(),
                    fence: value.fence,
                    expires_at: later(now, opts.lease)?,
                    first_claimed_at: now,
                    acquired_at: now,
                    taken_over: false,
                    at_most_once: opts.at_most_once,
                }
                .into_lease();
                match self.write(&kk, &value, revision).await? {
                    Write::Done(rev) => {
                        if let Some(sent_at) = opts.sent_at {
                            self.check_created(key, &kk, rev, sent_at, now).await?;
                        }
                        self.remember(&kk, rev, value);
                        return Ok(Claim::Acquired(lease));
                    }
                    Write::Conflict => continue,
                }
            };
            self.decode_key(&prev, Some(key))?;
            let now = now.max(at);
            if let Some(answer) = answer_existing(key, opts, self.view(key.clone(), &prev, at, now)?)? {
                return Ok(answer);
            }
            // An expired lease whose creating claim may not have finished its
            // horizon check: if that check fails now, the record should never
            // have existed. Remove it (this revision only) and claim the
            // absent key, with this claim's own `sent_at`.
            if let Some(hz) = prev.hz
                && self.unchecked_is_beyond(key, hz, at).await?
            {
                tracing::warn!(effect_key = %key, "removing a record whose claim was beyond the horizon");
                self.undo_create(&kk, revision).await?;
                floor = floor.max(Some(prev.fence));
                continue;
            }
            let value = Stored {
                state: RecordState::InProgress.as_str().to_owned(),
                fence: next_fence(Some(prev.fence), server_us(now)?),
                fp: prev.fp.clone().or_else(|| opts.fingerprint.map(|f| f.to_hex())),
                outcome: None,
                amo: opts.at_most_once,
                lease_us: length_us(opts.lease),
                retention_us: length_us(opts.retention),
                hz: None,
                ..prev
            };
            let lease = oncely::backend::Grant {
                key: key.clone(),
                fence: value.fence,
                expires_at: later(now, opts.lease)?,
                first_claimed_at: from_micros(value.first_us),
                acquired_at: now,
                taken_over: true,
                at_most_once: opts.at_most_once,
            }
            .into_lease();
            match self.write(&kk, &value, revision).await? {
                Write::Done(rev) => {
                    self.remember(&kk, rev, value);
                    return Ok(Claim::Acquired(lease));
                }
                Write::Conflict => continue,
            }
        }
        Err(backend_err(
            "claim",
            format!("{key}: gave up after {MAX_ATTEMPTS} lost races"),
        ))
    }

    /// A write made with a lease: succeeds only while the record is in
    /// progress at the lease's fence. Returns the new value's revision.
    ///
    /// Every such write also clears the record's `hz` mark: a lease holder
    /// writes only after its claim returned, so that claim's horizon check
    /// passed. (A refused write is counted as a fence rejection by the
    /// runner, not here: telemetry is recorded in one place.)
    async fn fenced(&self, lease: &Lease, change: impl Fn(&mut Stored)) -> Result<(u64, Stored)> {
        let kk = kv_key(lease.key());
        if let Some((rev, mut value)) = self.recall(&kk, lease.fence()) {
            change(&mut value);
            value.hz = None;
            if let Write::Done(new_rev) = self.write(&kk, &value, rev).await? {
                return Ok((new_rev, value));
            }
        }
        let lost = || Error::LeaseLost {
            key: lease.key().to_string(),
            fence: lease.fence(),
        };
        for _ in 0..MAX_ATTEMPTS {
            let Some(Current {
                revision,
                value: Some(mut value),
                ..
            }) = self.read(&kk).await?
            else {
                return Err(lost());
            };
            self.decode_key(&value, Some(lease.key()))?;
            if value.fence != lease.fence() || value.state()? != RecordState::InProgress {
                return Err(lost());
            }
            change(&mut value);
            value.hz = None;
            match self.write(&kk, &value, revision).await? {
                Write::Done(new_rev) => return Ok((new_rev, value)),
                Write::Conflict => continue,
            }
        }
        Err(backend_err(
            "fenced write",
            format!("{}: gave up after {MAX_ATTEMPTS} lost races", lease.key()),
        ))
    }

    /// The latest revision of every record under `filter` (a subject), read by
    /// an ordered consumer that delivers the last message per subject.
    async fn scan(&self, filter: String) -> Result<Vec<(String, Current)>> {
        use async_nats::jetstream::consumer::{DeliverPolicy, ReplayPolicy, push};
        let consumer = self
            .inner
            .store
            .stream
            .create_consumer(push::OrderedConfig {
                deliver_subject: inbox(),
                filter_subject: filter,
                deliver_policy: DeliverPolicy::LastPerSubject,
                replay_policy: ReplayPolicy::Instant,
                description: Some("oncely scan".to_owned()),
                ..Default::default()
            })
            .await
            .map_err(|e| backend_err("scan", e))?;
        let mut out = Vec::new();
        // The consumer goes on delivering new writes after the snapshot; a
        // busy bucket would never let `pending` reach 0, so stop after as
        // many messages as the snapshot held (the live ones come first, in
        // stream order; anything rewritten since is recent anyway).
        let total = consumer.cached_info().num_pending;
        if total == 0 {
            return Ok(out);
        }
        let mut seen = 0u64;
        let mut messages = consumer.messages().await.map_err(|e| backend_err("scan", e))?;
        let prefix = self.inner.store.prefix.clone();
        loop {
            // The pending count can go stale if keys are removed while the
            // scan runs; an idle consumer means everything was delivered.
            let next = match tokio::time::timeout(Duration::from_secs(2), messages.next()).await {
                Ok(Some(m)) => m.map_err(|e| backend_err("scan", e))?,
                Ok(None) | Err(_) => break,
            };
            let info = next.info().map_err(|e| backend_err("scan", e))?;
            let (pending, revision, at) = (
                info.pending,
                info.stream_sequence,
                SystemTime::from(info.published),
            );
            let deleted = next
                .headers
                .as_ref()
                .and_then(|h| h.get("KV-Operation"))
                .is_some_and(|op| matches!(op.as_str(), "DEL" | "PURGE"));
            if let Some(k) = next.subject.strip_prefix(prefix.as_str())
                && is_record_key(k)
            {
                self.inner.clock.observe(at);
                let value = if deleted {
                    None
                } else {
                    match Stored::decode(&next.payload) {
                        Ok(v) => Some(v),
                        Err(e) => {
                            tracing::warn!(kv_key = k, error = %e, "skipping a value that is not an oncely record");
                            None
                        }
                    }
                };
                out.push((k.to_owned(), Current { revision, at, value }));
            }
            seen += 1;
            if pending == 0 || seen >= total {
                break;
            }
        }
        Ok(out)
    }
}

/// When `connect` stops waiting for the bucket. Checked: an `open_timeout`
/// too long for `Instant` (`Duration::MAX`) means no deadline, not a panic.
#[derive(Debug, Clone, Copy)]
struct Deadline(Option<Instant>);

impl Deadline {
    fn after(timeout: Duration) -> Self {
        Deadline(Instant::now().checked_add(timeout))
    }

    fn passed(self) -> bool {
        self.0.is_some_and(|d| Instant::now() >= d)
    }
}

fn inbox() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let mut h = blake3::Hasher::new();
    h.update(&std::process::id().to_le_bytes());
    h.update(&nanos.to_le_bytes());
    h.update(&SEQ.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    format!("_INBOX.oncely.{}", &h.finalize().to_hex()[..32])
}

/// Opens the bucket, creating it when absent, and checks its settings.
///
/// A stream just created on a cluster answers `STREAM.INFO` only once it has
/// elected a leader, so a request that times out (or any other retryable
/// error) is tried again until `deadline`. Settings this ledger cannot rely
/// on fail at once.
async fn open_bucket(js: &jetstream::Context, opts: &NatsKvOptions, deadline: Deadline) -> Result<kv::Store> {
    let mut last = String::new();
    let mut creates = 0;
    while creates < 3 {
        let existing = match existing_bucket(js, opts).await {
            Ok(found) => found,
            Err(e) if e.is_retryable() && !deadline.passed() => {
                tracing::debug!(error = %e, "bucket not answering yet; retrying");
                last = e.to_string();
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        match existing {
            Some(store) => return Ok(store),
            None if !opts.migrate => {
                return Err(Error::Config(format!(
                    "NATS KV bucket {} does not exist (nothing was created); run `oncely migrate`",
                    opts.bucket
                )));
            }
            None => {
                // The stream a KV bucket is made of, written out: the client's
                // create_key_value asks for account info in a newer shape
                // than NATS 2.9 sends.
                let created = js
                    .create_stream(stream::Config {
                        name: format!("KV_{}", opts.bucket),
                        description: Some("oncely effect ledger".to_owned()),
                        subjects: vec![format!("$KV.{}.>", opts.bucket)],
                        max_messages_per_subject: 1,
                        max_messages: -1,
                        max_bytes: -1,
                        max_age: opts.max_age,
                        max_message_size: -1,
                        storage: stream::StorageType::File,
                        num_replicas: opts.replicas,
                        allow_rollup: true,
                        deny_delete: true,
                        deny_purge: false,
                        allow_direct: true,
                        discard: stream::DiscardPolicy::New,
                        duplicate_window: Duration::from_secs(120),
                        ..Default::default()
                    })
                    .await;
                creates += 1;
                match created {
                    Ok(_) => continue,
                    // Another process may have created it meanwhile, with our
                    // settings or others: look again and judge what is there.
                    Err(e) => {
                        tracing::debug!(error = %e, "bucket create failed; re-reading");
                        last = format!("{e}: {:?}", std::error::Error::source(&e));
                    }
                }
            }
        }
    }
    Err(backend_err(
        "open bucket",
        format!("could not create or open bucket {}: {last}", opts.bucket),
    ))
}

async fn existing_bucket(js: &jetstream::Context, opts: &NatsKvOptions) -> Result<Option<kv::Store>> {
    use async_nats::jetstream::context::GetStreamErrorKind;
    match js.get_stream(format!("KV_{}", opts.bucket)).await {
        Ok(s) => check_bucket(&s.cached_info().config, opts)?,
        Err(e) => {
            return match e.kind() {
                GetStreamErrorKind::JetStream(j)
                    if j.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND =>
                {
                    Ok(None)
                }
                // Nobody subscribes to the JetStream API: the server runs
                // without JetStream. A restarting cluster answers late (a
                // timeout), never this, so waiting would not help.
                GetStreamErrorKind::Request if no_responders(&e) => Err(Error::Config(
                    "the NATS server has no JetStream (no responder on its JetStream API); \
                     start nats-server with -js or jetstream {} in its configuration"
                        .into(),
                )),
                _ => Err(backend_err("open bucket", e)),
            };
        }
    }
    js.get_key_value(&opts.bucket)
        .await
        .map(Some)
        .map_err(|e| backend_err("open bucket", e))
}

/// Whether a request failed because nothing listens on its subject.
fn no_responders(e: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::jetstream::context::{RequestError, RequestErrorKind};
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<RequestError>())
        .is_some_and(|r| r.kind() == RequestErrorKind::NoResponders)
}

/// Refuses a bucket whose settings could lose or drop records.
fn check_bucket(c: &stream::Config, opts: &NatsKvOptions) -> Result<()> {
    let mut problems = Vec::new();
    if c.max_messages_per_subject != 1 {
        problems.push(format!("history is {} (must be 1)", c.max_messages_per_subject));
    }
    if c.num_replicas.max(1) != opts.replicas {
        problems.push(format!(
            "replicas are {} (configured {})",
            c.num_replicas, opts.replicas
        ));
    }
    if c.storage != stream::StorageType::File {
        problems.push("storage is memory (must be file)".to_owned());
    }
    if !c.max_age.is_zero() && c.max_age < opts.max_age {
        problems.push(format!(
            "max_age is {:?}, shorter than the configured {:?}",
            c.max_age, opts.max_age
        ));
    }
    if c.max_messages > 0 {
        problems.push(format!(
            "max_msgs is {} (would drop live records)",
            c.max_messages
        ));
    }
    if c.max_bytes > 0 {
        problems.push(format!("max_bytes is {} (would drop live records)", c.max_bytes));
    }
    if c.max_message_size > 0 && (c.max_message_size as usize) < MAX_VALUE_BYTES {
        problems.push(format!(
            "max_value_size is {} (records need up to {MAX_VALUE_BYTES})",
            c.max_message_size
        ));
    }
    if c.sealed {
        problems.push("the bucket is sealed".to_owned());
    }
    if c.mirror.is_some() {
        problems.push("the bucket is a mirror (read-only)".to_owned());
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "NATS KV bucket {} is incompatible with oncely: {}; it was left unchanged",
            opts.bucket,
            problems.join("; ")
        )))
    }
}

impl Ledger for NatsKvLedger {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new("JetStream file storage", "NATS server timestamps")
            .replicated(self.inner.opts.replicas > 1)
    }

    // No span and no metrics here: the core's claim pipeline records each
    // claim once (a backend that did too would count every claim twice).
    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        self.check_retention(opts.retention)?;
        self.claim_inner(key, opts).await
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        check_outcome(outcome, oncely::MAX_OUTCOME_BYTES)?;
        self.fenced(lease, |v| {
            v.set_state(RecordState::Completed);
            v.set_outcome(Some(outcome));
        })
        .await?;
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.fenced(lease, |v| v.set_state(RecordState::Released)).await?;
        Ok(())
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        if extend_by < Duration::from_millis(1) || extend_by > MAX_LEASE {
            return Err(Error::InvalidInput(format!(
                "a lease must be extended by 1 ms to 1 day, got {extend_by:?}"
            )));
        }
        // Read before the write, as in a claim: the reported end is no later
        // than the one the server measures from the new revision's stamp.
        let now = self.now().await?;
        let expires_at = later(now, extend_by)?;
        let us = length_us(extend_by);
        let (rev, value) = self.fenced(lease, |v| v.lease_us = us).await?;
        self.remember(&kv_key(lease.key()), rev, value);
        Ok(lease.renewed_until(expires_at))
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        let Some(Current {
            at, value: Some(v), ..
        }) = self.read(&kv_key(key)).await?
        else {
            return Ok(None);
        };
        let now = self.now().await?;
        let k = self.decode_key(&v, Some(key))?;
        self.view(k, &v, at, now).map(Some)
    }

    async fn prune(&self, limit: u64) -> Result<u64> {
        let entries = self.scan(format!("{}>", self.inner.store.prefix)).await?;
        let now = self.now().await?;
        let prunable = |cur: &Current| {
            cur.value.as_ref().is_some_and(|v| {
                matches!(v.state(), Ok(RecordState::Completed | RecordState::Released))
                    && cur
                        .at
                        .checked_add(Duration::from_micros(v.retention_us))
                        .is_some_and(|end| end <= now)
            })
        };
        // This call's victims: KV key, revision, created_at (µs), effect key.
        let mut doomed = Vec::new();
        for (kk, cur) in entries {
            if u64::try_from(doomed.len()).unwrap_or(u64::MAX) >= limit {
                break;
            }
            let Some(v) = cur.value.as_ref().filter(|_| prunable(&cur)) else {
                continue;
            };
            match self.decode_key(v, None) {
                Ok(key) => doomed.push((kk, cur.revision, v.first_us, key)),
                // Its tenant and kind are unknown, so its horizon could not be
                // raised: left for an operator.
                Err(e) => {
                    tracing::warn!(kv_key = %kk, error = %e, "not pruning a record with an unreadable key")
                }
            }
        }
        // Before any delete, raise each tenant and kind's watermark to the
        // newest record about to go (see horizon.rs for why first). A record
        // that then is not deleted (taken over meanwhile) leaves the horizon
        // a little later than needed: refusing a late message is safe,
        // running a pruned effect again is not.
        let mut raised: HashMap<(Tenant, String), i64> = HashMap::new();
        for (_, _, first_us, key) in &doomed {
            let w = raised
                .entry((key.tenant().clone(), key.kind().to_owned()))
                .or_insert(*first_us);
            *w = (*w).max(*first_us);
        }
        for ((tenant, kind), w) in &raised {
            self.raise_watermark(tenant, kind, *w).await?;
        }
        let mut pruned = 0;
        for (kk, mut revision, mut first_us, key) in doomed {
            for _ in 0..MAX_ATTEMPTS {
                let group = (key.tenant().clone(), key.kind().to_owned());
                if raised.get(&group).is_none_or(|w| *w < first_us) {
                    // Claimed again since the scan and prunable again already
                    // (a retention of milliseconds): its own creation counts.
                    self.raise_watermark(key.tenant(), key.kind(), first_us).await?;
                    raised.insert(group, first_us);
                }
                // Revision-checked: a record taken over since the scan stays.
                match self.inner.store.delete_expect_revision(&kk, Some(revision)).await {
                    Ok(()) => {
                        pruned += 1;
                        break;
                    }
                    // Either the record changed, or the stream leader refused
                    // a matching revision (NATS 2.9 clusters do so under
                    // concurrent writes to other keys): read again and decide
                    // again, as a claim does.
                    Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                        match self.read(&kk).await? {
                            Some(c) if prunable(&c) => {
                                revision = c.revision;
                                first_us = c.value.as_ref().map_or(first_us, |v| v.first_us);
                            }
                            _ => break,
                        }
                    }
                    Err(e) => return Err(backend_err("prune", e)),
                }
            }
        }
        Ok(pruned)
    }

    async fn horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
        let now = self.now().await?;
        self.horizon_at(tenant, kind, now).await
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        let entries = self
            .scan(format!("{}{}.*", self.inner.store.prefix, tenant_token(tenant)))
            .await?;
        let now = self.now().await?;
        let mut out = Vec::new();
        for (kk, cur) in entries {
            let Some(v) = cur.value else { continue };
            let Ok(key) = self.decode_key(&v, None) else {
                continue;
            };
            if key.tenant() != tenant {
                continue;
            }
            // One unreadable record must not hide every abandoned step.
            let r = match self.view(key, &v, cur.at, now) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(kv_key = %kk, error = %e, "skipping an unreadable record");
                    continue;
                }
            };
            if r.state == RecordState::Abandoned {
                out.push(r);
            }
        }
        out.sort_by_key(|r| r.created_at);
        out.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        Ok(out)
    }
}

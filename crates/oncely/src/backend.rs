//! The backend kit: the rules every backend shares, written once, for the
//! authors of backend crates.
//!
//! A backend writes its atomic operations (a statement, a script, a
//! revision-checked update) and maps its rows; what a record *means* is
//! decided here, so that the backends cannot drift apart:
//!
//! - [`FromUrl`], [`OpenOptions`], [`Access`]: the one way every backend opens
//!   from a URL; [`UrlParams`]: its query parameters, any the backend and
//!   its driver do not read refused;
//! - [`Grant`]: how a backend builds the [`Lease`] a claim returns;
//! - [`answer_existing`]: what a claim answers when it finds a record it may
//!   not take over (and whether it may take it over at all);
//! - [`effective_state`]: an expired at-most-once lease reads as abandoned;
//! - [`next_fence`]: the fence of a new grant, above every fence the key ever
//!   had, prunes included;
//! - [`is_beyond_horizon`]: when a claim for an absent key must be refused
//!   because the ledger has pruned records at least that old;
//! - [`needs_refresh`]: when a grant written with a clock read before a lock
//!   wait must be refreshed before it is returned;
//! - [`check_outcome`], [`check_extension`]: the outcome size limit and the
//!   bounds of a renewal;
//! - [`report_unexpected_violation`]: the one telemetry call a backend makes;
//! - [`Backoff`]: the delays of every retry loop; [`retry`] and
//!   [`Attempts`]: the loop itself (a retryable error runs again after a
//!   pause, within a number of attempts or a window);
//! - [`fail_each`], [`copy_error`]: one failure as the answer of every slot
//!   of a batch; [`earlier_listings`], [`repeated_claim`],
//!   [`repeated_completion`]: what a key or lease listed twice in one batch
//!   answers (what the same call made again right after would);
//! - [`key_range`]: the range of keys an operator listing of a tenant (and
//!   kind) reads;
//! - [`to_micros`], [`from_micros`], [`duration_micros`]: the one time unit
//!   backends store (microseconds since the Unix epoch), with checked
//!   arithmetic.
//!
//! Backends written in another language (the Redis Lua scripts) restate
//! these rules; their comments point here.

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::key::EffectKey;
use crate::ledger::Ledger;
use crate::record::{Claim, ClaimOptions, Lease, MAX_OUTCOME_BYTES, Outcome, Record, RecordState};

pub use crate::retry::{Attempts, Backoff, retry};
pub use crate::scope::{KeyRange, key_range};
pub use crate::slots::{copy_error, earlier_listings, fail_each, repeated_claim, repeated_completion};

/// What an opener may do to the ledger's storage (tables, a bucket).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Create what is missing and upgrade it (the default of a backend's
    /// `connect`): `oncely migrate`, the demo, an application at startup.
    Migrate,
    /// Use what exists after checking it; create and upgrade nothing: writers
    /// that must not create a ledger by accident (`oncely prune`).
    Existing,
    /// Read only: create, migrate and write nothing, so a mistyped path is an
    /// error rather than a new empty ledger, and a role that may only read
    /// can use it (`oncely get`). The ledger refuses its own writes before
    /// any round trip. (One exception, documented by its crate: NATS learns
    /// the server's clock only by writing its clock probe key.)
    ReadOnly,
}

/// How [`FromUrl::from_url`] opens a ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpenOptions {
    /// What the opener may do to the storage.
    pub access: Access,
    /// How long to wait to connect (or for a pooled connection), when the
    /// caller wants a quicker answer than the backend's default (an operator
    /// at a terminal).
    pub connect_timeout: Option<Duration>,
}

impl OpenOptions {
    /// `access`, with the backend's own timeouts.
    pub fn new(access: Access) -> Self {
        OpenOptions {
            access,
            connect_timeout: None,
        }
    }

    /// Sets [`OpenOptions::connect_timeout`](#structfield.connect_timeout).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = Some(timeout);
        self
    }
}

/// A ledger that opens from a URL: the one shape every backend crate
/// offers, so that a tool (the `oncely` command) can pick the backend from a
/// URL with one line per backend. Each crate parses its own URLs, and its
/// query parameters through [`UrlParams`].
///
/// Its [`Display`](std::fmt::Display) says what the ledger reads, for an
/// operator: the backend, the server and database (or file), and the
/// table, bucket or key prefix (`postgres 127.0.0.1:5432/app, table
/// billing.effects`). It never shows a credential.
pub trait FromUrl: Ledger + std::fmt::Display + Sized {
    /// The URL schemes it opens, lowercase (`postgres`, `postgresql`).
    const SCHEMES: &'static [&'static str];

    /// Opens the ledger a URL names (one of [`FromUrl::SCHEMES`]). A
    /// malformed URL fails with [`Error::Config`] before anything connects,
    /// and its message never quotes the URL (it may carry a password).
    fn from_url(url: &str, options: OpenOptions) -> impl Future<Output = Result<Self>> + Send;
}

impl<L: FromUrl> FromUrl for std::sync::Arc<L> {
    const SCHEMES: &'static [&'static str] = L::SCHEMES;

    async fn from_url(url: &str, options: OpenOptions) -> Result<Self> {
        L::from_url(url, options).await.map(std::sync::Arc::new)
    }
}

/// The query parameters of a backend's URL (`?table=effects&sslmode=require`),
/// split into the ones the backend reads itself and the ones its driver
/// reads, so that a mistyped or unsupported parameter is refused with
/// [`Error::Config`] before anything connects, on every backend, instead of
/// being ignored (a driver that ignores `?tabel=x` would open the default
/// table, and an operator would read the wrong ledger).
///
/// A backend lists its own parameters and its driver's; a parameter it adds
/// joins its list. Its own parameters' values are percent-decoded as a
/// query string is (`+` is a space); the driver's are handed on untouched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlParams {
    own: Vec<(String, String)>,
    driver_url: String,
}

impl UrlParams {
    /// Reads the query string of `url` (after the first `?`, up to a `#`
    /// after it).
    /// `what` names the backend in messages (`PostgreSQL`); `own` lists the
    /// parameters the backend reads; `driver` those its driver reads, where
    /// an entry ending in `[…]` (`options[…]`) stands for any name with that
    /// stem and a bracketed part (`options[search_path]`).
    ///
    /// Fails with [`Error::Config`] on a parameter in neither list (naming
    /// it, unless it does not look like a name: it may be a mistyped
    /// credential, and messages never quote a URL), and on one of the
    /// backend's own given twice. Empty pairs (`?&a=1&`) are skipped.
    pub fn parse(url: &str, what: &str, own: &[&str], driver: &[&str]) -> Result<UrlParams> {
        // The first `?` starts the query wherever a `#` is: SQLite's driver
        // reads a `#` before it as part of the file name.
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let (query, fragment) = match query.split_once('#') {
            Some((q, f)) => (q, Some(f)),
            None => (query, None),
        };
        let mut params = UrlParams {
            own: Vec::new(),
            driver_url: base.to_owned(),
        };
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let Some((name, value)) = form_urlencoded::parse(pair.as_bytes()).next() else {
                continue;
            };
            if own.contains(&name.as_ref()) {
                if params.get(&name).is_some() {
                    return Err(Error::Config(format!(
                        "{what} URL parameter {name} is given twice"
                    )));
                }
                params.own.push((name.into_owned(), value.into_owned()));
            } else if driver.iter().any(|d| matches_param(d, &name)) {
                kept.push(pair);
            } else {
                return Err(unknown_param(what, &name, own, driver));
            }
        }
        if !kept.is_empty() {
            params.driver_url.push('?');
            params.driver_url.push_str(&kept.join("&"));
        }
        if let Some(f) = fragment {
            params.driver_url.push('#');
            params.driver_url.push_str(f);
        }
        Ok(params)
    }

    /// The value of one of the backend's own parameters, if the URL gives it.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.own.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The URL without the backend's own parameters: what its driver parses.
    pub fn driver_url(&self) -> &str {
        &self.driver_url
    }
}

fn matches_param(accepted: &str, name: &str) -> bool {
    match accepted.strip_suffix("[…]") {
        Some(stem) => name
            .strip_prefix(stem)
            .is_some_and(|rest| rest.len() > 2 && rest.starts_with('[') && rest.ends_with(']')),
        None => accepted == name,
    }
}

fn unknown_param(what: &str, name: &str, own: &[&str], driver: &[&str]) -> Error {
    let shown = if !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
    {
        format!(" '{name}'")
    } else {
        String::new()
    };
    let expected = match (own.is_empty(), driver.is_empty()) {
        (true, true) => "it takes none".to_owned(),
        (false, true) => format!("expected {}", own.join(", ")),
        (true, false) => format!("expected one its driver reads: {}", driver.join(", ")),
        (false, false) => format!(
            "expected {}, or one its driver reads: {}",
            own.join(", "),
            driver.join(", ")
        ),
    };
    Error::Config(format!("unknown {what} URL parameter{shown} ({expected})"))
}

/// Splits the authority of `url` (`scheme://[userinfo@]hosts[/…]`) into one
/// URL per host of a comma-separated list (`h1:5432,h2,[::1]:5433`), each
/// with the same user, path and query; a URL with one host comes back as it
/// is. An empty entry in the list (`h1,,h2`, a comma at either end) is
/// [`Error::Config`] naming `what` (`"PostgreSQL"`); messages never quote
/// the URL, which may hold a password. The host list of every SQL backend
/// that takes one (their drivers accept a single host).
pub fn split_hosts(url: &str, what: &str) -> Result<Vec<String>> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok(vec![url.to_owned()]);
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..]),
        None => ("", authority),
    };
    if !hosts.contains(',') {
        return Ok(vec![url.to_owned()]);
    }
    hosts
        .split(',')
        .map(|host| {
            if host.trim().is_empty() {
                Err(Error::Config(format!(
                    "the {what} URL's host list has an empty entry (h1,,h2, or a comma at either end)"
                )))
            } else {
                Ok(format!("{scheme}://{userinfo}{host}{tail}"))
            }
        })
        .collect()
}

/// The parts of a lease a backend has just granted. [`Grant::into_lease`]
/// makes the [`Lease`] its claim returns: only ledgers grant leases, and this
/// is how they build them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The effect key.
    pub key: EffectKey,
    /// The fence ([`next_fence`]).
    pub fence: u64,
    /// When the lease ends, on the backend's clock.
    pub expires_at: SystemTime,
    /// When the key was first claimed, on the backend's clock.
    pub first_claimed_at: SystemTime,
    /// The backend's clock when the grant was written (after any lock wait).
    pub acquired_at: SystemTime,
    /// Whether the grant took over an expired lease or a released record.
    pub taken_over: bool,
    /// Whether the step is at-most-once.
    pub at_most_once: bool,
}

impl From<&Lease> for Grant {
    /// The parts of an existing lease, to grant a changed one (a refreshed
    /// expiry and fence, in a backend that re-grants after a lock wait).
    fn from(l: &Lease) -> Self {
        Grant {
            key: l.key.clone(),
            fence: l.fence,
            expires_at: l.expires_at,
            first_claimed_at: l.first_claimed_at,
            acquired_at: l.acquired_at,
            taken_over: l.taken_over,
            at_most_once: l.at_most_once,
        }
    }
}

impl Grant {
    /// The lease.
    pub fn into_lease(self) -> Lease {
        Lease {
            key: self.key,
            fence: self.fence,
            expires_at: self.expires_at,
            first_claimed_at: self.first_claimed_at,
            acquired_at: self.acquired_at,
            taken_over: self.taken_over,
            at_most_once: self.at_most_once,
        }
    }
}

/// The latest instant a backend stores: 9999-12-31T23:59:59.999999Z, in
/// microseconds since the Unix epoch. Every timestamp (and every sum of a
/// timestamp and a lease or a retention) stays below 2^63 µs with room to
/// spare, and below 2^53 (exact in a Lua or JSON number) until the year 2255.
pub const MAX_MICROS: i64 = 253_402_300_799_999_999;

/// Microseconds since the Unix epoch, the unit backends store timestamps
/// in. Fails with [`Error::InvalidInput`] before 1970 or after
/// [`MAX_MICROS`], instead of wrapping into a time that means something else.
pub fn to_micros(t: SystemTime) -> Result<i64> {
    let us = t
        .duration_since(UNIX_EPOCH)
        .map_err(|e| Error::InvalidInput(format!("{t:?} is {:?} before 1970", e.duration())))?
        .as_micros();
    i64::try_from(us)
        .ok()
        .filter(|us| *us <= MAX_MICROS)
        .ok_or_else(|| Error::InvalidInput(format!("{t:?} is after the year 9999")))
}

/// The inverse of [`to_micros`]; any `i64` maps to a time (negative values
/// before 1970), so decoding a stored value never panics.
pub fn from_micros(us: i64) -> SystemTime {
    if us >= 0 {
        UNIX_EPOCH + Duration::from_micros(us.unsigned_abs())
    } else {
        UNIX_EPOCH - Duration::from_micros(us.unsigned_abs())
    }
}

/// A duration in whole microseconds, saturating at `i64::MAX`. Leases and
/// retentions are validated (at most ten years) before they get here.
pub fn duration_micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// The fence of a new grant: the backend clock's microseconds at the moment
/// the grant is written, or `previous + 1` if that is higher.
///
/// A fence must stay above every fence the key ever had, for the life of the
/// ledger. A takeover knows the previous fence; a claim of an absent key does
/// not (the record may have been pruned, with whatever fence it had), so the
/// clock carries the order: a pruned record's last fence was granted at least
/// its retention before the prune, so today's clock is above it. This holds
/// as long as the backend's clock never steps back by more than the shortest
/// retention in use; leases rely on that clock already.
///
/// Backends that compute the fence in SQL or Lua write the same expression
/// (`GREATEST(fence + 1, now_us)`), with `now_us` read after any lock wait.
pub fn next_fence(previous: Option<u64>, now_us: i64) -> u64 {
    let clock = u64::try_from(now_us).unwrap_or(0);
    match previous {
        None => clock.max(1),
        Some(p) => clock.max(p.saturating_add(1)),
    }
}

/// What a stored record is, as the contract reports it: an in-progress
/// at-most-once record whose lease ended at or before `now` is
/// [`RecordState::Abandoned`] (backends store it as in progress).
pub fn effective_state(
    stored: RecordState,
    at_most_once: bool,
    lease_expires_at: Option<SystemTime>,
    now: SystemTime,
) -> RecordState {
    if stored == RecordState::InProgress && at_most_once && lease_expires_at.is_some_and(|e| e <= now) {
        RecordState::Abandoned
    } else {
        stored
    }
}

/// Whether a lease that ends at `expires_at` has ended at `now` (expiry is
/// inclusive: a lease is live strictly before its end).
pub fn lease_live(expires_at: Option<SystemTime>, now: SystemTime) -> bool {
    expires_at.is_some_and(|e| e > now)
}

/// The answer to a claim that found `record` (read at `record.read_at` on the
/// backend's clock, with its state already made effective).
///
/// - both fingerprints present and different: [`Error::FingerprintMismatch`];
/// - completed: [`Claim::Completed`]; abandoned: [`Claim::Abandoned`];
/// - in progress with a live lease: [`Claim::InProgress`];
/// - `Ok(None)`: released, or an expired lease of a step that is not
///   at-most-once: the claim takes the record over (with
///   [`next_fence`]), in the same atomic operation that re-checks this
///   decision against the record's current version.
pub fn answer_existing(key: &EffectKey, opts: &ClaimOptions, record: Record) -> Result<Option<Claim>> {
    if let (Some(stored), Some(given)) = (record.fingerprint, opts.fingerprint)
        && stored != given
    {
        return Err(Error::FingerprintMismatch { key: key.to_string() });
    }
    Ok(match record.state {
        RecordState::Completed => Some(Claim::Completed(record)),
        RecordState::Abandoned => Some(Claim::Abandoned(record)),
        RecordState::InProgress => match record.lease_expires_at {
            Some(expires_at) if expires_at > record.read_at => Some(Claim::InProgress {
                fence: record.fence,
                expires_at,
                first_claimed_at: record.created_at,
                read_at: record.read_at,
            }),
            Some(_) | None if record.at_most_once => Some(Claim::Abandoned(Record {
                state: RecordState::Abandoned,
                ..record
            })),
            _ => None,
        },
        RecordState::Released => None,
    })
}

/// Whether a claim of an absent key whose message was produced at `sent_at`
/// must fail with [`Error::BeyondHorizon`]: the ledger has pruned a record
/// of this tenant and kind created at `watermark` or later than the message,
/// so the message's own record may have been among them.
///
/// Prune records the watermark (the newest `created_at` it deleted) before,
/// or atomically with, the delete; a claim compares against a watermark read
/// after it knows the key is absent.
pub fn is_beyond_horizon(sent_at: Option<SystemTime>, watermark: Option<SystemTime>) -> bool {
    matches!((sent_at, watermark), (Some(s), Some(w)) if s <= w)
}

/// Whether a grant must be refreshed (its expiry written again from the
/// clock after the write) before the claim returns it: less than half the
/// requested lease was left when it was written.
///
/// That happens when the statement read the clock, then waited on a lock
/// (a concurrent transaction holding the key), then wrote: the lease was
/// measured from before the wait. Returned as is, the next claimant could
/// take it over at once while this one runs. A backend whose statements read
/// the clock only after every wait never sees this; one that cannot ensure
/// it renews the lease (fenced) when this says so, or claims again if the
/// renewal finds it taken over.
pub fn needs_refresh(lease: &Lease, requested: Duration) -> bool {
    let left = lease
        .expires_at
        .duration_since(lease.acquired_at)
        .unwrap_or_default();
    left < requested / 2
}

/// The end state a fenced write leaves when it is applied: what
/// [`resolve_lost_write`] looks for in the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostWrite {
    /// A completion: the record is completed at the lease's fence.
    Complete,
    /// A release: the record is released at the lease's fence.
    Release,
}

impl LostWrite {
    fn done(self) -> RecordState {
        match self {
            LostWrite::Complete => RecordState::Completed,
            LostWrite::Release => RecordState::Released,
        }
    }
}

/// Resolves a fenced write (a completion or a release) whose answer was
/// lost (`lost`: the connection died during the statement or its commit, or
/// no answer came in time) from the record itself, never by guessing:
///
/// - the record is in the write's end state at the lease's fence: it was
///   applied, `Ok`;
/// - it is still in progress at that fence: nothing was applied, and the
///   write is made once more (`write_again`, fenced, so at most once; a
///   fence miss there means the first write landed meanwhile, and the
///   record is read again to say so);
/// - anything else: the lease is gone, [`Error::LeaseLost`].
///
/// `read` is tried again while it fails [`Error::Unavailable`] (a failover
/// under way: the backend is looking for the node that now takes writes)
/// for up to `within`; when the record cannot be read by then, or the write
/// made again fails otherwise, `lost` is the answer. One rule for every
/// backend that can lose an answer (PostgreSQL, MySQL/Galera).
pub async fn resolve_lost_write<R, RF, W, WF>(
    backend: &'static str,
    lease: &Lease,
    write: LostWrite,
    lost: Error,
    within: Duration,
    mut read: R,
    mut write_again: W,
) -> Result<()>
where
    R: FnMut() -> RF,
    RF: Future<Output = Result<Option<Record>>>,
    W: FnMut() -> WF,
    WF: Future<Output = Result<()>>,
{
    let done = write.done();
    let mut wrote_again = false;
    let give_up = std::time::Instant::now() + within;
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    loop {
        let record = match read().await {
            Ok(record) => record,
            Err(Error::Unavailable { .. }) if std::time::Instant::now() < give_up => {
                backoff
                    .wait(give_up.saturating_duration_since(std::time::Instant::now()))
                    .await;
                continue;
            }
            Err(_) => return Err(lost),
        };
        match record {
            Some(r) if r.fence == lease.fence() && r.state == done => {
                tracing::info!(
                    backend,
                    key = %lease.key(),
                    fence = lease.fence(),
                    "a write whose answer was lost had been applied"
                );
                return Ok(());
            }
            Some(r) if r.fence == lease.fence() && r.state == RecordState::InProgress && !wrote_again => {
                wrote_again = true;
                match write_again().await {
                    Ok(()) => return Ok(()),
                    // Applied meanwhile (the first write, late)? The record
                    // says.
                    Err(Error::LeaseLost { .. }) => {}
                    Err(_) => return Err(lost),
                }
            }
            _ => {
                return Err(Error::LeaseLost {
                    key: lease.key().to_string(),
                    fence: lease.fence(),
                });
            }
        }
    }
}

/// Reports a unique-constraint violation that a ledger's own statement hit on
/// something other than the effect key (an index someone added to the
/// ledger's table): logged and counted in
/// `oncely_unexpected_constraint_violations_total`. The backend then returns
/// [`Error::Corrupt`]; it is never taken for a duplicate. (A violation in a
/// handler's own write is reported by the runner, through
/// [`Ledger::unique_violation`].)
pub fn report_unexpected_violation(backend: &'static str, detail: &str) {
    crate::telemetry::unexpected_constraint_violation(backend, detail);
}

/// The longest a renewal may extend a lease (a day, like a claim's lease).
pub const MAX_EXTENSION: Duration = Duration::from_secs(86_400);

/// Refuses a renewal's `extend_by` outside 1 ms to [`MAX_EXTENSION`] with
/// [`Error::InvalidInput`], before any round trip.
pub fn check_extension(extend_by: Duration) -> Result<()> {
    if extend_by < Duration::from_millis(1) || extend_by > MAX_EXTENSION {
        return Err(Error::InvalidInput(format!(
            "a lease is extended by 1 ms to 1 day, got {extend_by:?}"
        )));
    }
    Ok(())
}

/// Refuses an outcome over `max` (the backend's limit, at most
/// [`MAX_OUTCOME_BYTES`]) with [`Error::OutcomeTooLarge`], before any write.
pub fn check_outcome(outcome: &Outcome, max: usize) -> Result<()> {
    let max = max.min(MAX_OUTCOME_BYTES);
    if outcome.len() > max {
        return Err(Error::OutcomeTooLarge {
            size: outcome.len(),
            max,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared rule for a lost write, against the memory ledger's real
    /// records: each branch, and that `read` failing past `within` gives
    /// back the original error.
    #[tokio::test]
    async fn a_lost_write_is_resolved_from_the_record() {
        use crate::memory::MemoryLedger;
        use std::sync::atomic::{AtomicUsize, Ordering};

        let ledger = MemoryLedger::new();
        let opts = ClaimOptions::default();
        let unavailable = || Error::Unavailable {
            backend: "test",
            message: "the answer was lost".into(),
        };
        let claim = |n: &str| {
            let key = EffectKey::new(&crate::Tenant::global(), "capture", n).unwrap();
            let (ledger, opts) = (&ledger, &opts);
            async move {
                match ledger.claim(&key, opts).await.unwrap() {
                    Claim::Acquired(l) => l,
                    other => panic!("{other:?}"),
                }
            }
        };
        let outcome = Outcome::from_json(&"ch_1").unwrap();
        let again = AtomicUsize::new(0);
        let resolve = |lease: Lease, write: LostWrite, within: Duration, applies: bool| {
            let (ledger, outcome, again) = (&ledger, &outcome, &again);
            async move {
                resolve_lost_write(
                    "test",
                    &lease,
                    write,
                    unavailable(),
                    within,
                    || ledger.get(lease.key()),
                    || async {
                        again.fetch_add(1, Ordering::SeqCst);
                        match (write, applies) {
                            (LostWrite::Complete, true) => ledger.complete(&lease, outcome).await,
                            (LostWrite::Release, true) => ledger.release(&lease).await,
                            // The first write landed meanwhile: this one
                            // misses its fence.
                            (_, false) => {
                                ledger.complete(&lease, outcome).await.unwrap();
                                Err(Error::LeaseLost {
                                    key: lease.key().to_string(),
                                    fence: lease.fence(),
                                })
                            }
                        }
                    },
                )
                .await
            }
        };
        let long = Duration::from_secs(5);

        // Applied: nothing is written again.
        let lease = claim("applied").await;
        ledger.complete(&lease, &outcome).await.unwrap();
        resolve(lease, LostWrite::Complete, long, true).await.unwrap();
        assert_eq!(again.swap(0, Ordering::SeqCst), 0);

        // Not applied (still in progress at the fence): written once more.
        let lease = claim("in-progress").await;
        let key = lease.key().clone();
        resolve(lease, LostWrite::Release, long, true).await.unwrap();
        assert_eq!(again.swap(0, Ordering::SeqCst), 1);
        assert_eq!(
            ledger.get(&key).await.unwrap().unwrap().state,
            RecordState::Released
        );

        // Written again, but the first write had landed meanwhile: the
        // record says it is applied.
        let lease = claim("late").await;
        resolve(lease, LostWrite::Complete, long, false).await.unwrap();
        assert_eq!(again.swap(0, Ordering::SeqCst), 1);

        // Another holder since (released, then claimed again at a higher
        // fence): the lease is gone, and nothing is written.
        let old = claim("taken").await;
        ledger.release(&old).await.unwrap();
        let _new = claim("taken").await;
        let e = resolve(old, LostWrite::Complete, long, true).await.unwrap_err();
        assert!(e.is_lease_lost(), "{e:?}");
        assert_eq!(again.swap(0, Ordering::SeqCst), 0);

        // The record cannot be read within the bound: the original error.
        let lease = claim("unreadable").await;
        let reads = AtomicUsize::new(0);
        let e = resolve_lost_write(
            "test",
            &lease,
            LostWrite::Complete,
            unavailable(),
            Duration::from_millis(200),
            || async {
                reads.fetch_add(1, Ordering::SeqCst);
                Err(Error::Unavailable {
                    backend: "test",
                    message: "failing over".into(),
                })
            },
            || async { panic!("nothing may be written without a read") },
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("the answer was lost"), "{e}");
        assert!(reads.load(Ordering::SeqCst) > 1, "the read is tried again");
    }

    #[test]
    fn a_host_list_splits_into_one_url_per_host() {
        assert_eq!(
            split_hosts(
                "postgres://u:p%40w@h1:5440,h2,[::1]:5442/db?sslmode=disable",
                "PostgreSQL"
            )
            .unwrap(),
            [
                "postgres://u:p%40w@h1:5440/db?sslmode=disable",
                "postgres://u:p%40w@h2/db?sslmode=disable",
                "postgres://u:p%40w@[::1]:5442/db?sslmode=disable",
            ]
        );
        assert_eq!(
            split_hosts("mysql://h1:1,h2:2", "MySQL").unwrap(),
            ["mysql://h1:1", "mysql://h2:2"]
        );
        assert_eq!(
            split_hosts("mysql://u@h/db", "MySQL").unwrap(),
            ["mysql://u@h/db"]
        );
        assert_eq!(split_hosts("sqlite:x.db", "SQLite").unwrap(), ["sqlite:x.db"]);
        for bad in [
            "mysql://u:s3cret@h1,,h2/db",
            "mysql://u:s3cret@h1,/db",
            "mysql://u:s3cret@,h1/db",
            "mysql://u:s3cret@h1, ,h2/db",
        ] {
            assert!(
                matches!(split_hosts(bad, "MySQL"), Err(Error::Config(m)) if !m.contains("s3cret") && m.contains("MySQL")),
                "{bad}"
            );
        }
    }

    #[test]
    fn micros_are_checked() {
        let now = SystemTime::now();
        let back = from_micros(to_micros(now).unwrap());
        assert!(now.duration_since(back).unwrap() < Duration::from_micros(1));
        assert_eq!(from_micros(-5), UNIX_EPOCH - Duration::from_micros(5));
        assert_eq!(to_micros(UNIX_EPOCH).unwrap(), 0);
        assert_eq!(to_micros(from_micros(MAX_MICROS)).unwrap(), MAX_MICROS);
        for bad in [
            UNIX_EPOCH - Duration::from_micros(1),
            from_micros(MAX_MICROS) + Duration::from_micros(1),
            // 2^64 µs ahead used to wrap to a time near now.
            UNIX_EPOCH + Duration::from_micros(u64::MAX) + Duration::from_secs(1),
        ] {
            assert!(matches!(to_micros(bad), Err(Error::InvalidInput(_))), "{bad:?}");
        }
        assert_eq!(from_micros(i64::MIN), UNIX_EPOCH - Duration::from_micros(1 << 63));
        assert_eq!(duration_micros(Duration::MAX), i64::MAX);
    }

    #[test]
    fn fences_follow_the_clock_and_never_repeat() {
        assert_eq!(next_fence(None, 0), 1);
        assert_eq!(next_fence(None, -7), 1);
        assert_eq!(next_fence(None, 1_000), 1_000);
        assert_eq!(next_fence(Some(1_000), 1_000), 1_001);
        assert_eq!(next_fence(Some(5), 1_000), 1_000);
        assert_eq!(next_fence(Some(u64::MAX), 1), u64::MAX);
    }

    #[test]
    fn url_params_split_own_from_the_driver_s() {
        let p = UrlParams::parse(
            "postgres://u:pw@h/db?sslmode=disable&schema=billing&table=effects&options[search_path]=x#f",
            "PostgreSQL",
            &["schema", "table"],
            &["sslmode", "options[…]"],
        )
        .unwrap();
        assert_eq!(
            (p.get("schema"), p.get("table")),
            (Some("billing"), Some("effects"))
        );
        assert_eq!(p.get("sslmode"), None);
        assert_eq!(
            p.driver_url(),
            "postgres://u:pw@h/db?sslmode=disable&options[search_path]=x#f"
        );
        // Only its own parameters: the driver gets the URL without a query.
        let p = UrlParams::parse("nats://n1?&bucket=a%2Db+c&", "NATS", &["bucket"], &[]).unwrap();
        assert_eq!((p.get("bucket"), p.driver_url()), (Some("a-b c"), "nats://n1"));
        let p = UrlParams::parse("memory:", "memory", &[], &[]).unwrap();
        assert_eq!(p.driver_url(), "memory:");
    }

    #[test]
    fn url_params_nobody_reads_are_refused_without_quoting_the_url() {
        for (url, says) in [
            (
                "postgres://u:s3cret@h/db?tabel=x",
                "unknown PostgreSQL URL parameter 'tabel' (expected schema, table, or one its driver \
                 reads: sslmode, options[…])",
            ),
            (
                "postgres://u:s3cret@h/db?table=a&table=b",
                "PostgreSQL URL parameter table is given twice",
            ),
            (
                "postgres://u@h/db?token:s3cret",
                "unknown PostgreSQL URL parameter (expected",
            ),
            (
                "postgres://u@h/db?options[]=s3cret",
                "unknown PostgreSQL URL parameter (expected",
            ),
        ] {
            let e = UrlParams::parse(
                url,
                "PostgreSQL",
                &["schema", "table"],
                &["sslmode", "options[…]"],
            )
            .unwrap_err();
            let Error::Config(m) = e else {
                panic!("{url}: {e:?}")
            };
            assert!(m.contains(says), "{url}: {m}");
            assert!(!m.contains("s3cret"), "{url}: {m}");
        }
        let e = UrlParams::parse("memory:?x=1", "memory", &[], &[]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "configuration: unknown memory URL parameter 'x' (it takes none)"
        );
    }

    #[test]
    fn horizon_is_inclusive_and_needs_both() {
        let w = UNIX_EPOCH + Duration::from_secs(100);
        assert!(is_beyond_horizon(Some(w), Some(w)));
        assert!(is_beyond_horizon(Some(w - Duration::from_secs(1)), Some(w)));
        assert!(!is_beyond_horizon(Some(w + Duration::from_micros(1)), Some(w)));
        assert!(!is_beyond_horizon(None, Some(w)));
        assert!(!is_beyond_horizon(Some(w), None));
    }
}

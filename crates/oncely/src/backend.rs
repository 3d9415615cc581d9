//! The backend kit: the door for the authors of backend crates. It holds
//! the contract a backend implements and every rule the backends share,
//! written once; an application using oncely needs none of it (its door is
//! the crate root).
//!
//! **The contract.** [`Ledger`] (claim, complete, release, renew, get,
//! prune) with its [`Capabilities`], and [`TransactionalLedger`] for a
//! backend whose claims can join the caller's transaction; the types they
//! speak: [`Claim`], [`Lease`], [`Record`], [`RecordState`], [`Outcome`],
//! [`StoredOutcome`], [`Fingerprint`], with the size limits
//! [`MAX_KEY_BYTES`], [`MAX_KIND_BYTES`], [`MAX_TENANT_BYTES`],
//! [`MAX_OUTCOME_BYTES`]. Waking waiters: [`Watch`], [`Notifier`]. The
//! operator's side of a ledger is [`crate::admin`]; opening one from a URL
//! is [`crate::open`].
//!
//! **Around a ledger.** [`Coalescing`] wraps any ledger and gathers the
//! concurrent claims and completions of many tasks into one `claim_many` /
//! `complete_many` statement (a lone caller goes straight through).
//!
//! **The rules.** A backend writes its atomic operations (a statement, a
//! script, a revision-checked update) and maps its rows; what a record
//! *means* is decided here, so that the backends cannot drift apart:
//!
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
//! - [`resolve_lost_write`]: what a fenced write whose answer was lost did;
//! - [`forget_refusal`]: why a forget that changed nothing was refused;
//! - [`check_outcome`], [`check_extension`]: the outcome size limit and the
//!   bounds of a renewal; [`check_subject`]: a subject given without a key
//!   (an erasure's);
//! - [`erasable`]: which records an erasure empties now, and which it
//!   leaves pending;
//! - [`report_unexpected_violation`]: the one telemetry call a backend makes;
//! - [`Backoff`]: the delays of every retry loop; [`retry`] and
//!   [`Attempts`]: the loop itself (a retryable error runs again after a
//!   pause, within a number of attempts or a window);
//! - [`fail_each`], [`copy_error`]: one failure as the answer of every slot
//!   of a batch; [`earlier_listings`], [`repeated_claim`],
//!   [`repeated_completion`]: what a key or lease listed twice in one batch
//!   answers (what the same call made again right after would);
//! - [`filter_where`]: what a record is as an operator sees it (live,
//!   stuck, abandoned, …), as one WHERE condition for every SQL backend;
//! - [`key_range`], [`scope_where`]: the range of keys an operator listing
//!   of a tenant (and kind) reads, and the one WHERE every SQL backend's
//!   listing builds from it;
//! - [`to_micros`], [`from_micros`], [`duration_micros`], [`MAX_MICROS`]: the
//!   one time unit backends store (microseconds since the Unix epoch), with
//!   checked arithmetic.
//!
//! Backends written in another language (the Redis Lua scripts) restate
//! these rules; their comments point here.

use std::future::Future;
use std::time::{Duration, SystemTime};

pub use crate::admin::erasable;
pub use crate::backoff::Backoff;
pub use crate::coalesce::{Coalescing, DEFAULT_MAX_BATCH, DEFAULT_MAX_IN_FLIGHT};
pub use crate::key::{MAX_KEY_BYTES, MAX_KIND_BYTES, MAX_TENANT_BYTES, check_subject};
pub use crate::ledger::{Capabilities, Ledger, TransactionalLedger};
pub use crate::record::{
    Claim, Fingerprint, Lease, MAX_OUTCOME_BYTES, Outcome, Record, RecordState, StoredOutcome,
};
pub use crate::time::{MAX_MICROS, duration_micros, from_micros, lease_live, to_micros};
pub use crate::watch::{NOTIFIED_FALLBACK, Notifier, Watch};

use crate::admin::{Class, classify};
use crate::error::{Error, Result};
use crate::key::EffectKey;
use crate::record::ClaimOptions;

pub use crate::retry::{Attempts, retry, retry_with};
pub use crate::scope::{FilterSql, KeyRange, filter_where, key_range, scope_where};
pub use crate::slots::{copy_error, earlier_listings, fail_each, repeated_claim, repeated_completion};

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

/// The answer to a claim that found `record` (read at `record.read_at` on the
/// backend's clock, with its state already made effective).
///
/// - completed and erased ([`Record::is_erased`]): [`Error::Erased`],
///   whatever fingerprint the claim gives (the stored one was erased with
///   the outcome, so there is nothing to compare, and the effect happened);
/// - both fingerprints present and different: [`Error::FingerprintMismatch`];
/// - completed: [`Claim::Completed`]; abandoned: [`Claim::Abandoned`];
/// - in progress with a live lease: [`Claim::InProgress`];
/// - `Ok(None)`: released, or an expired lease of a step that is not
///   at-most-once: the claim takes the record over (with
///   [`next_fence`]), in the same atomic operation that re-checks this
///   decision against the record's current version.
pub fn answer_existing(key: &EffectKey, opts: &ClaimOptions, record: Record) -> Result<Option<Claim>> {
    if record.is_erased() {
        return Err(Error::Erased { key: key.to_string() });
    }
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

/// Why a [`Admin::forget`](crate::admin::Admin::forget) that changed nothing was refused, from the record
/// as it is now (read after the fenced write found nothing to change, only
/// to name the reason): the one rule every backend reports with.
pub fn forget_refusal(key: &EffectKey, fence: u64, now: Option<Record>) -> Error {
    let Some(r) = now else {
        return Error::NotFound { key: key.to_string() };
    };
    if r.fence != fence {
        return Error::LeaseLost {
            key: key.to_string(),
            fence,
        };
    }
    match classify(&r, r.read_at) {
        Some(Class::Live) => Error::InProgress {
            key: key.to_string(),
            fence: r.fence,
        },
        _ => Error::NotCompleted {
            key: key.to_string(),
            state: r.state,
        },
    }
}

/// The end state a fenced write leaves when it is applied: what
/// [`resolve_lost_write`] looks for in the record.
// Exhaustive by design (ARCHITECTURE.md, API boundaries): the two fenced writes whose answer can be lost.
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
    use std::time::UNIX_EPOCH;

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
    fn fences_follow_the_clock_and_never_repeat() {
        assert_eq!(next_fence(None, 0), 1);
        assert_eq!(next_fence(None, -7), 1);
        assert_eq!(next_fence(None, 1_000), 1_000);
        assert_eq!(next_fence(Some(1_000), 1_000), 1_001);
        assert_eq!(next_fence(Some(5), 1_000), 1_000);
        assert_eq!(next_fence(Some(u64::MAX), 1), u64::MAX);
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

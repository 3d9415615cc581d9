//! The one claim → run → settle pipeline behind [`Effects::run`],
//! [`Job::step`] and [`Job::step_in`]: every rule about what a claim's
//! answer means, when a handler may start, and what its result writes lives
//! here once.
//!
//! [`Effects::run`]: crate::Effects::run
//! [`Job::step`]: crate::Job::step
//! [`Job::step_in`]: crate::Job::step_in

use std::future::Future;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backend::check_outcome;
use crate::error::{BoxError, Error, Result};
use crate::flight::{Answer, Flights, Holding};
use crate::held::{HeldLease, with_renewal};
use crate::key::EffectKey;
use crate::ledger::{Ledger, TransactionalLedger};
use crate::record::{Claim, ClaimOptions, Lease, OnInProgress, Outcome};
use crate::telemetry;
use crate::watch::Watch;

/// How a handler failed.
///
/// `?` on any error gives [`Failure::Retryable`]: the claim is released and
/// the next delivery runs the handler again. [`Failure::terminal`] stores the
/// failure as the outcome (unless [`ClaimOptions::cache_failures`] is off), so
/// every duplicate gets the same failure back instead of trying again.
// Exhaustive by design (ARCHITECTURE.md, API boundaries): the model's two failure classes.
#[derive(Debug)]
pub enum Failure {
    /// Another attempt may succeed (a timeout, a 503).
    Retryable(BoxError),
    /// Another attempt would fail the same way (card declined, bad request).
    Terminal(String),
}

impl Failure {
    /// A terminal failure with a message that is stored and replayed.
    pub fn terminal(message: impl Into<String>) -> Self {
        Failure::Terminal(message.into())
    }

    /// A retryable failure.
    pub fn retryable(e: impl Into<BoxError>) -> Self {
        Failure::Retryable(e.into())
    }
}

impl<E: Into<BoxError>> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure::Retryable(e.into())
    }
}

/// How many grants in a row may arrive too short before the claim gives up
/// (each one is released first, so the next delivery finds the key free).
const STALE_GRANTS: usize = 3;

/// What a claim resolved to, once the in-progress policy was applied.
pub(crate) enum Resolved {
    /// This caller holds the lease, which it received in time to use.
    Lease(Lease, Instant),
    /// The effect completed before; its stored outcome.
    Stored(Outcome),
}

/// Records a claim's answer once (metrics, the span's `result`), and turns
/// the answers that are not a lease into the runner's result.
fn observe(ledger: &impl Ledger, key: &EffectKey, claim: &Claim, took: Duration) {
    let label = claim.label();
    telemetry::claim_recorded(ledger.backend(), key, label, took);
    tracing::Span::current().record("result", label);
    match claim {
        Claim::Completed(record) => telemetry::duplicate_seen(key, true, record.created_at, record.read_at),
        Claim::InProgress {
            first_claimed_at,
            read_at,
            ..
        } => telemetry::duplicate_seen(key, false, *first_claimed_at, *read_at),
        Claim::Acquired(lease) => {
            tracing::Span::current().record("fence", lease.fence);
        }
        Claim::Abandoned(_) => {}
    }
}

fn stored(key: &EffectKey, claim: Claim) -> Result<Outcome> {
    match claim {
        // A completed record without its outcome was erased (the ledger
        // answers `Error::Erased` itself; a record read otherwise says so too).
        Claim::Completed(record) => record
            .outcome
            .ok_or_else(|| Error::Erased { key: key.to_string() }),
        Claim::Abandoned(_) => Err(Error::Abandoned { key: key.to_string() }),
        Claim::InProgress { fence, .. } => Err(Error::InProgress {
            key: key.to_string(),
            fence,
        }),
        Claim::Acquired(_) => unreachable!("a lease is not a stored outcome"),
    }
}

/// Claims `key` with the in-progress policy applied, and never returns a
/// lease with less than the safety margin left on this worker's clock.
///
/// The lease's local deadline is the claim's send time plus what the
/// backend said was left when it wrote the grant: the lease ends no earlier
/// than that, whatever the round trip did. A grant that arrives with less
/// than [`ClaimOptions::margin`] left is released (fenced) and claimed again.
///
/// Given the runner's [`Flights`], a duplicate under `Wait` first waits for
/// this process's own holder of the key, if there is one, and takes its
/// acknowledged outcome without a round trip; so does one the ledger found
/// in progress at a fence this process holds.
pub(crate) async fn claim<L: Ledger>(
    ledger: &L,
    key: &EffectKey,
    opts: &ClaimOptions,
    flights: Option<&Flights>,
) -> Result<Resolved> {
    let started = Instant::now();
    let wait_max = match opts.on_in_progress {
        OnInProgress::Reject => Duration::ZERO,
        OnInProgress::Wait { max } => max,
    };
    if let Some(flights) = flights.filter(|_| !wait_max.is_zero())
        && let Some(answer) = flights.wait(key, opts, None, started + wait_max).await
    {
        return Ok(answered_in_process(key, answer));
    }
    let mut watch: Option<Watch> = None;
    let mut stale = 0;
    // Once woken, the effect has most likely completed: the claims after a
    // wake-up say so (`ClaimOptions::redelivered`), and a backend whose
    // plain read is cheaper answers from it.
    let mut woken: Option<ClaimOptions> = None;
    loop {
        let sent = Instant::now();
        let claim = ledger.claim(key, woken.as_ref().unwrap_or(opts)).await?;
        observe(ledger, key, &claim, sent.elapsed());
        match claim {
            Claim::Acquired(lease) => {
                let granted = lease
                    .expires_at
                    .duration_since(lease.acquired_at)
                    .unwrap_or_default();
                let deadline = sent + granted;
                let left = deadline.saturating_duration_since(Instant::now());
                if left > opts.margin() {
                    return Ok(Resolved::Lease(lease, deadline));
                }
                telemetry::stale_grant(key, left);
                release(ledger, &lease).await.or_else(ignore_lost)?;
                stale += 1;
                if stale >= STALE_GRANTS {
                    return Err(Error::Backend {
                        backend: ledger.backend(),
                        message: format!(
                            "{key}: {stale} leases in a row arrived with less than the safety margin ({:?}) left",
                            opts.margin()
                        ),
                        retryable: true,
                    });
                }
            }
            Claim::InProgress {
                fence,
                expires_at,
                read_at,
                ..
            } => {
                let waited = started.elapsed();
                if waited >= wait_max {
                    return Err(Error::InProgress {
                        key: key.to_string(),
                        fence,
                    });
                }
                // The holder is this process's own: wait for it in memory.
                if let Some(flights) = flights
                    && let Some(answer) = flights.wait(key, opts, Some(fence), started + wait_max).await
                {
                    return Ok(answered_in_process(key, answer));
                }
                let w = match watch.as_mut() {
                    Some(w) => w,
                    None => {
                        let w = watch.insert(ledger.watch(key).await);
                        if w.is_notified() {
                            // Subscribed now: the holder may have finished
                            // between the claim and the subscription, so look
                            // once more before waiting for a notification.
                            continue;
                        }
                        w
                    }
                };
                // Never wait past the holder's expiry (we may take over
                // then) or past our own deadline.
                let until_expiry = expires_at
                    .duration_since(read_at)
                    .unwrap_or_default()
                    .saturating_add(Duration::from_millis(1));
                w.changed(Instant::now() + until_expiry.min(wait_max - waited))
                    .await;
                if woken.is_none() && !opts.redelivered {
                    woken = Some(opts.clone().redelivered(true));
                }
            }
            other => return stored(key, other).map(Resolved::Stored),
        }
    }
}

/// A duplicate answered by this process's holder: counted as a suppressed
/// duplicate, as a claim that found the effect completed would be.
fn answered_in_process(key: &EffectKey, answer: Answer) -> Resolved {
    tracing::Span::current().record("result", "completed_in_process");
    telemetry::duplicate_seen(key, true, answer.first_claimed_at, answer.read_at);
    Resolved::Stored(answer.outcome)
}

/// [`claim`] on the caller's transaction: no waiting (the transaction would
/// hold its locks meanwhile; the broker's redelivery is the better wait) and
/// no safety margin (the claim's row stays locked by the transaction until it
/// ends, so nobody can take it over while the step runs).
pub(crate) async fn claim_in<L: TransactionalLedger>(
    ledger: &L,
    conn: &mut L::Connection,
    key: &EffectKey,
    opts: &ClaimOptions,
) -> Result<Resolved> {
    let sent = Instant::now();
    let claim = ledger.claim_in(conn, key, opts).await?;
    observe(ledger, key, &claim, sent.elapsed());
    match claim {
        Claim::Acquired(lease) => {
            let granted = lease
                .expires_at
                .duration_since(lease.acquired_at)
                .unwrap_or_default();
            Ok(Resolved::Lease(lease, sent + granted))
        }
        other => stored(key, other).map(Resolved::Stored),
    }
}

/// Runs `f` under `lease` with renewal, handing it the [`HeldLease`].
pub(crate) async fn run_held<L, T, F, Fut>(
    ledger: &L,
    lease: &Lease,
    deadline: Instant,
    opts: &ClaimOptions,
    f: F,
) -> Result<T, Failure>
where
    L: Ledger,
    F: FnOnce(HeldLease) -> Fut,
    Fut: Future<Output = Result<T, Failure>>,
{
    let (held, lost) = HeldLease::new(lease.clone(), deadline);
    with_renewal(ledger, &held, lost, opts.lease, f(held.clone())).await
}

/// What a handler's result writes, decided once for every runner.
pub(crate) enum Settlement<T> {
    /// Store this outcome, then answer with the result.
    Complete(Outcome, Result<T>),
    /// Give the key back (a later delivery runs it again), then fail.
    Release(Error),
    /// Leave the claim as it is and fail: an at-most-once effect that may
    /// have happened but whose outcome is not stored must not be released
    /// (the next delivery would repeat it); it is abandoned when its lease
    /// ends and waits for reconciliation.
    Keep(Error),
}

/// The one rule for a handler's result:
/// - a value is stored (within the backend's outcome limit); one that
///   cannot be stored releases the key, except in an at-most-once step;
/// - a retryable failure releases the key, unless the ledger's driver says it
///   is a unique violation of the handler's own: never a duplicate, a bug,
///   reported as the non-retryable [`Error::ConstraintViolation`]; an
///   [`Error`] the handler passed on is returned as it is;
/// - a terminal failure is stored and replayed when failures are cached,
///   released otherwise.
///
/// An at-most-once step whose handler started is never released by the
/// runner, except on the handler's own retryable failure (its way of saying
/// that the effect certainly did not happen): whatever else went wrong, the
/// effect may have happened, and a released step would be performed again
/// by the next delivery. It is completed, or kept ([`Settlement::Keep`]) to be
/// abandoned when its lease ends and reconciled.
pub(crate) fn settlement<L: Ledger, T: Serialize>(
    ledger: &L,
    lease: &Lease,
    opts: &ClaimOptions,
    result: Result<T, Failure>,
) -> Settlement<T> {
    let key = &lease.key;
    // The effect may have happened: give the key back only where a second
    // run is safe.
    let give_back = |e: Error, why: &str| {
        if lease.at_most_once {
            tracing::error!(effect_key = %key, error = %e,
                "at-most-once effect may have happened ({why}); \
                 left to be abandoned and reconciled");
            Settlement::Keep(e)
        } else {
            Settlement::Release(e)
        }
    };
    match result {
        Ok(value) => {
            let encoded = Outcome::value(&value)
                .and_then(|o| check_outcome(&o, ledger.capabilities().max_outcome_bytes).map(|()| o));
            match encoded {
                Ok(outcome) => Settlement::Complete(outcome, Ok(value)),
                Err(e) => give_back(e, "it ran but its outcome cannot be stored"),
            }
        }
        Err(Failure::Retryable(e)) => match ledger.unique_violation(&*e) {
            Some(message) => {
                telemetry::unexpected_constraint_violation(ledger.backend(), &message);
                give_back(
                    Error::ConstraintViolation {
                        key: key.to_string(),
                        message,
                    },
                    "its handler hit an unexpected unique violation",
                )
            }
            // An oncely error the handler passed on with `?` (a lost lease,
            // an invalid key it built) keeps its own classification instead
            // of becoming a retryable handler failure.
            None => match e.downcast::<Error>() {
                Ok(e) => Settlement::Release(*e),
                Err(e) => Settlement::Release(Error::Handler(e)),
            },
        },
        Err(Failure::Terminal(message)) => {
            let stored = opts.cache_failures.then(|| Outcome::failure(&message));
            let terminal = Error::Terminal {
                key: key.to_string(),
                message,
            };
            match stored {
                Some(Ok(outcome)) => Settlement::Complete(outcome, Err(terminal)),
                Some(Err(e)) => give_back(e, "its terminal failure cannot be stored"),
                None => give_back(terminal, "it failed terminally and failures are not cached"),
            }
        }
    }
}

/// Applies a [`Settlement`] through the ledger's own connections. A
/// completion that fails for any reason but a lost lease leaves the effect
/// done and unrecorded: [`Error::OutcomeUnknown`], never the backend's error
/// alone (which says nothing ran).
///
/// A [`Holding`] given tells this process's waiters on the key how it landed:
/// the outcome once the ledger acknowledged its completion, else "ask the
/// ledger" (when it is dropped).
pub(crate) async fn settle<L: Ledger, T>(
    ledger: &L,
    lease: &Lease,
    settlement: Settlement<T>,
    holding: Option<Holding<'_>>,
) -> Result<T> {
    match settlement {
        Settlement::Complete(outcome, result) => {
            ledger.complete(lease, &outcome).await.map_err(|e| {
                fence_check(lease, &e);
                if e.is_lease_lost() {
                    return e;
                }
                tracing::warn!(effect_key = %lease.key, fence = lease.fence, error = %e,
                    "the effect ran but its completion was not recorded");
                Error::OutcomeUnknown {
                    key: lease.key.to_string(),
                    fence: lease.fence,
                    source: Box::new(e),
                }
            })?;
            if let Some(holding) = holding {
                holding.completed(&outcome);
            }
            result
        }
        Settlement::Release(e) => {
            release(ledger, lease).await?;
            Err(e)
        }
        Settlement::Keep(e) => Err(e),
    }
}

/// Applies a [`Settlement`] on the caller's transaction: a completion is
/// written there; a release is the caller's rollback (nothing of the claim
/// survives it).
pub(crate) async fn settle_in<L: TransactionalLedger, T>(
    ledger: &L,
    conn: &mut L::Connection,
    lease: &Lease,
    settlement: Settlement<T>,
) -> Result<T> {
    match settlement {
        Settlement::Complete(outcome, result) => {
            ledger
                .complete_in(conn, lease, &outcome)
                .await
                .inspect_err(|e| fence_check(lease, e))?;
            result
        }
        Settlement::Release(e) | Settlement::Keep(e) => Err(e),
    }
}

async fn release<L: Ledger>(ledger: &L, lease: &Lease) -> Result<()> {
    ledger.release(lease).await.inspect_err(|e| fence_check(lease, e))
}

fn ignore_lost(e: Error) -> Result<()> {
    if e.is_lease_lost() { Ok(()) } else { Err(e) }
}

fn fence_check(lease: &Lease, e: &Error) {
    if e.is_lease_lost() {
        telemetry::fence_rejected(&lease.key);
    }
}

/// Decodes a stored outcome into the caller's value or its stored failure.
pub(crate) fn decode<T: DeserializeOwned>(key: &EffectKey, outcome: &Outcome) -> Result<T> {
    outcome.decode::<T>()?.into_result(key)
}

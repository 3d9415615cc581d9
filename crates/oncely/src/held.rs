//! A lease while its handler runs: renewed in the background, and able to
//! tell the handler when it can no longer count on it.

use std::future::Future;
use std::ops::Deref;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::backoff::Backoff;
use crate::error::Error;
use crate::ledger::Ledger;
use crate::record::Lease;
use crate::telemetry;

/// The lease a handler runs under, as [`Effects::run`](crate::Effects::run)
/// hands it over. It dereferences to [`Lease`] (`lease.fence`,
/// `lease.provider_key()`), and it knows whether the lease still holds.
///
/// While the handler runs, the runner renews the lease every third of its
/// length, retrying failed renewals until the lease would end. The lease is
/// *lost* when a renewal is refused (another claimant took the key over) or
/// when its end passes without a successful renewal, measured
/// conservatively on this worker's monotonic clock. Check it before an
/// external call that must not happen twice:
///
/// ```
/// # use oncely::{Failure, HeldLease};
/// # async fn send(_: &str) {}
/// # async fn handler(lease: HeldLease) -> Result<(), Failure> {
/// lease.check()?; // LeaseLost: let the current holder do it
/// let idempotency_key = lease.provider_key();
/// tokio::select! {
///     _ = send(&idempotency_key) => Ok(()),
///     _ = lease.lost() => Err(Failure::retryable("lease lost while sending")),
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct HeldLease {
    lease: Lease,
    state: Arc<State>,
    lost: watch::Receiver<bool>,
}

#[derive(Debug)]
struct State {
    /// When the lease ends at the earliest, on this worker's clock.
    deadline: Mutex<Instant>,
}

impl HeldLease {
    /// A lease with its conservative local deadline, and the sender that
    /// marks it lost.
    pub(crate) fn new(lease: Lease, deadline: Instant) -> (Self, watch::Sender<bool>) {
        let (tx, rx) = watch::channel(false);
        let held = HeldLease {
            lease,
            state: Arc::new(State {
                deadline: Mutex::new(deadline),
            }),
            lost: rx,
        };
        (held, tx)
    }

    /// The lease as the ledger granted it (its latest renewal's expiry is
    /// not reflected here; see [`HeldLease::deadline`]).
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The earliest instant the lease may end, on this worker's monotonic
    /// clock: the claim's (or latest renewal's) send time plus what the
    /// backend said was left. Conservative: the lease ends no earlier.
    pub fn deadline(&self) -> Instant {
        *self.state.deadline.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn extend_to(&self, deadline: Instant) {
        *self.state.deadline.lock().unwrap_or_else(|p| p.into_inner()) = deadline;
    }

    /// Whether the lease is lost: a renewal was refused, its deadline passed,
    /// or the run it belonged to has ended.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow() || Instant::now() >= self.deadline() || self.lost.has_changed().is_err()
    }

    /// `Err(`[`Error::LeaseLost`]`)` when [`HeldLease::is_lost`]: call it
    /// before an effect that must not run under a lease someone else may
    /// hold by now.
    pub fn check(&self) -> Result<(), Error> {
        if self.is_lost() {
            return Err(Error::LeaseLost {
                key: self.lease.key.to_string(),
                fence: self.lease.fence,
            });
        }
        Ok(())
    }

    /// Resolves once the lease is lost (see [`HeldLease::is_lost`]); select
    /// on it next to a long call.
    pub async fn lost(&self) {
        let mut rx = self.lost.clone();
        loop {
            if *rx.borrow_and_update() {
                return;
            }
            let deadline = self.deadline();
            if Instant::now() >= deadline {
                return;
            }
            tokio::select! {
                changed = rx.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep_until(deadline.into()) => {}
            }
        }
    }
}

impl Deref for HeldLease {
    type Target = Lease;

    fn deref(&self) -> &Lease {
        &self.lease
    }
}

/// Runs `work` while renewing `held` every third of `lease_len`.
///
/// A renewal that fails for a passing reason (the backend briefly
/// unavailable, a timeout) is retried with backoff until the lease's local
/// deadline; one refused for a stale fence, or a deadline that passes, marks
/// the lease lost and ends the renewals. The handler is never cancelled
/// halfway through an effect: it learns through [`HeldLease::lost`], and the
/// completion that follows reports a lease taken over as
/// [`Error::LeaseLost`].
pub(crate) async fn with_renewal<L: Ledger, F: Future>(
    ledger: &L,
    held: &HeldLease,
    lost: watch::Sender<bool>,
    lease_len: Duration,
    work: F,
) -> F::Output {
    let renew = async {
        let period = (lease_len / 3).max(Duration::from_millis(1));
        let mut lease = held.lease.clone();
        loop {
            tokio::time::sleep(period).await;
            let mut backoff = Backoff::new(Duration::from_millis(10), period);
            loop {
                let sent = Instant::now();
                let deadline = held.deadline();
                if sent >= deadline {
                    tracing::warn!(effect_key = %lease.key, "lease ran out before a renewal succeeded");
                    let _ = lost.send(true);
                    return std::future::pending::<()>().await;
                }
                match tokio::time::timeout(deadline - sent, ledger.renew(&lease, lease_len)).await {
                    Ok(Ok(renewed)) => {
                        held.extend_to(sent + lease_len);
                        lease = renewed;
                        break;
                    }
                    Ok(Err(e)) if e.is_lease_lost() => {
                        telemetry::fence_rejected(&lease.key);
                        let _ = lost.send(true);
                        return std::future::pending::<()>().await;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(effect_key = %lease.key, error = %e, "lease renewal failed; retrying");
                        backoff
                            .wait(held.deadline().saturating_duration_since(Instant::now()))
                            .await;
                    }
                    // The deadline passed while the renewal was in flight.
                    Err(_) => {}
                }
            }
        }
    };
    tokio::pin!(work);
    tokio::select! {
        biased;
        out = &mut work => out,
        _ = renew => unreachable!("the renewal loop never ends"),
    }
}

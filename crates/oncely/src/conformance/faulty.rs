//! A ledger wrapper that injects faults, for the runner cases.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::ledger::{Capabilities, Ledger};
use crate::record::{Claim, Lease, Outcome, Record};
use crate::{ClaimOptions, EffectKey, Error, Result, Tenant};

/// A ledger that misbehaves on purpose around a real one, so the runner's
/// rules can be checked on every backend: it answers claims late (a slow
/// round trip), fails renewals (a backend that blips), and can take an
/// [`InjectedUniqueViolation`] for its driver's unique-constraint error.
#[derive(Debug, Clone)]
pub struct Faulty<L> {
    inner: L,
    claim_delay: Duration,
    renew_failures: Arc<AtomicU64>,
    renewals_failed: Arc<AtomicU64>,
    /// Watches from a notifier nobody notifies: every notification is lost.
    deaf: Option<Arc<crate::watch::Notifier>>,
    /// Whether [`InjectedUniqueViolation`] is reported as a unique violation.
    unique_violations: bool,
    /// Completions to fail before they reach the backend.
    complete_failures: Arc<AtomicU64>,
    /// Completions whose answer to lose after the backend applied them.
    complete_answers_lost: Arc<AtomicU64>,
    /// How long each completion waits before it is sent (or failed).
    complete_delay: Duration,
    /// Claims sent to the backend (each key of a batch counts).
    claims_sent: Arc<AtomicU64>,
}

/// A handler error that a [`Faulty::unique_violations`] ledger reports as a
/// unique-constraint violation of its driver: the runner's rule for such an
/// error can then be checked on backends whose handlers cannot raise one
/// (Redis, NATS) as on those that can.
#[derive(Debug, thiserror::Error)]
#[error("duplicate key value violates unique constraint \"{0}\" (injected by conformance::Faulty)")]
pub struct InjectedUniqueViolation(pub &'static str);

impl<L: Ledger> Faulty<L> {
    /// Passes everything through to `inner`.
    pub fn new(inner: L) -> Self {
        Faulty {
            inner,
            claim_delay: Duration::ZERO,
            renew_failures: Arc::new(AtomicU64::new(0)),
            renewals_failed: Arc::new(AtomicU64::new(0)),
            deaf: None,
            unique_violations: false,
            complete_failures: Arc::new(AtomicU64::new(0)),
            complete_answers_lost: Arc::new(AtomicU64::new(0)),
            complete_delay: Duration::ZERO,
            claims_sent: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Holds every completion `delay` before it is sent (or failed): a
    /// slow commit.
    pub fn complete_delay(mut self, delay: Duration) -> Self {
        self.complete_delay = delay;
        self
    }

    /// How many claims reached the backend through this ledger (each key
    /// of a `claim_many` counts once), shared by its clones.
    pub fn claims_sent(&self) -> u64 {
        self.claims_sent.load(Ordering::SeqCst)
    }

    /// Fails the next `n` completions with `Error::Unavailable` before they
    /// reach the backend (a connection that died before the write).
    pub fn fail_completions(self, n: u64) -> Self {
        self.complete_failures.store(n, Ordering::SeqCst);
        self
    }

    /// Applies the next `n` completions on the backend, then answers them
    /// with `Error::Unavailable` (a connection that died during the
    /// commit's acknowledgement).
    pub fn lose_completion_answers(self, n: u64) -> Self {
        self.complete_answers_lost.store(n, Ordering::SeqCst);
        self
    }

    /// Delivers every claim's answer `delay` after the backend gave it.
    pub fn claim_delay(mut self, delay: Duration) -> Self {
        self.claim_delay = delay;
        self
    }

    /// Fails the next `n` renewals with `Error::Unavailable` (`u64::MAX`:
    /// all of them).
    pub fn fail_renewals(self, n: u64) -> Self {
        self.renew_failures.store(n, Ordering::SeqCst);
        self
    }

    /// Loses every change notification: watches are notified ones that
    /// nobody ever wakes (only their fallback does).
    pub fn lose_notifications(mut self) -> Self {
        self.deaf = Some(Arc::new(crate::watch::Notifier::new()));
        self
    }

    /// Reports a handler's [`InjectedUniqueViolation`] as the driver's
    /// unique violation ([`Ledger::unique_violation`]).
    pub fn unique_violations(mut self) -> Self {
        self.unique_violations = true;
        self
    }

    /// How many renewals were failed on purpose.
    pub fn renewals_failed(&self) -> u64 {
        self.renewals_failed.load(Ordering::SeqCst)
    }
}

/// Takes one from a countdown of injected faults (`u64::MAX`: forever).
fn take_one(n: &AtomicU64) -> bool {
    n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| match n {
        0 => None,
        u64::MAX => Some(u64::MAX),
        n => Some(n - 1),
    })
    .is_ok()
}

impl<L: Ledger> Ledger for Faulty<L> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        self.claims_sent.fetch_add(1, Ordering::SeqCst);
        let claim = self.inner.claim(key, opts).await;
        tokio::time::sleep(self.claim_delay).await;
        claim
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        let unavailable = |what: &str| Error::Unavailable {
            backend: self.inner.backend(),
            message: format!("{what} on purpose (conformance::Faulty)"),
        };
        tokio::time::sleep(self.complete_delay).await;
        if take_one(&self.complete_failures) {
            return Err(unavailable("completion failed"));
        }
        self.inner.complete(lease, outcome).await?;
        if take_one(&self.complete_answers_lost) {
            return Err(unavailable("completion's answer lost"));
        }
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.inner.release(lease).await
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        if take_one(&self.renew_failures) {
            self.renewals_failed.fetch_add(1, Ordering::SeqCst);
            return Err(Error::Unavailable {
                backend: self.inner.backend(),
                message: "renewal failed on purpose (conformance::Faulty)".into(),
            });
        }
        self.inner.renew(lease, extend_by).await
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        self.inner.get(key).await
    }

    async fn prune(&self, limit: u64) -> Result<u64> {
        self.inner.prune(limit).await
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        self.inner.abandoned(tenant, limit).await
    }

    async fn horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
        self.inner.horizon(tenant, kind).await
    }

    fn unique_violation(&self, error: &(dyn std::error::Error + 'static)) -> Option<String> {
        match error.downcast_ref::<InjectedUniqueViolation>() {
            Some(e) if self.unique_violations => Some(e.to_string()),
            _ => self.inner.unique_violation(error),
        }
    }

    async fn watch(&self, key: &EffectKey) -> crate::watch::Watch {
        match &self.deaf {
            Some(n) => n.watch(key),
            None => self.inner.watch(key).await,
        }
    }
}

//! The runner most users touch: claim → run → complete, and duplicates get
//! the stored outcome back.

use std::future::Future;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tracing::Instrument;

use crate::error::{BoxError, Error, Result};
use crate::job::Job;
use crate::key::{EffectKey, Tenant};
use crate::ledger::Ledger;
use crate::record::{Claim, ClaimOptions, Lease, OnInProgress, Outcome};
use crate::telemetry;

/// How a handler failed.
///
/// `?` on any error gives [`Failure::Retryable`]: the claim is released and
/// the next delivery runs the handler again. [`Failure::terminal`] stores the
/// failure as the outcome (unless [`ClaimOptions::cache_failures`] is off), so
/// every duplicate gets the same failure back instead of trying again.
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

/// What [`Effects`] stores: the handler's value, or its terminal failure.
#[derive(Serialize, Deserialize)]
pub(crate) enum Envelope<T> {
    #[serde(rename = "ok")]
    Ok(T),
    #[serde(rename = "err")]
    Err(String),
}

/// Runs effects once against a [`Ledger`].
#[derive(Debug, Clone)]
pub struct Effects<L> {
    ledger: L,
}

impl<L: Ledger> Effects<L> {
    /// A runner over a ledger.
    pub fn new(ledger: L) -> Self {
        Effects { ledger }
    }

    /// The ledger underneath.
    pub fn ledger(&self) -> &L {
        &self.ledger
    }

    /// A job with several effects on one business subject (an order): each
    /// [`Job::step`] gets its own key `tenant/kind:subject`, so a redelivery
    /// resumes at the first unfinished step. `job_type` names the job in error
    /// messages; it is not part of the step keys, so two job types that
    /// perform the same effect on the same subject share its record.
    pub fn job(&self, tenant: &Tenant, job_type: &str, subject: &str) -> Job<'_, L> {
        Job::new(self, tenant, job_type, subject)
    }

    /// Claims `key`, runs `f` if this caller acquired it, and stores its
    /// outcome. A duplicate gets the stored outcome back without running `f`;
    /// one that finds the effect in flight waits or is rejected according to
    /// [`ClaimOptions::on_in_progress`], and never reports success it did not see.
    ///
    /// While `f` runs, the lease is renewed every third of its length, so a
    /// slow but live handler is not taken over.
    pub async fn run<T, F, Fut>(&self, key: &EffectKey, opts: &ClaimOptions, f: F) -> Result<T>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(Lease) -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        opts.validate()?;
        let span = tracing::info_span!(
            "oncely.claim",
            effect_key = %key,
            tenant = %key.tenant(),
            kind = key.kind(),
            fence = tracing::field::Empty,
            result = tracing::field::Empty,
        );
        async move {
            let lease = match self.claim_with_policy(key, opts).await? {
                Resolved::Lease(lease) => lease,
                Resolved::Stored(outcome) => return decode(key, &outcome),
            };
            tracing::Span::current().record("fence", lease.fence);
            let result = with_renewal(&self.ledger, &lease, opts.lease, f(lease.clone())).await;
            self.settle(&lease, opts, result).await
        }
        .instrument(span)
        .await
    }

    /// Claims with the in-progress policy applied: a lease to run under, or
    /// the stored outcome of a completed effect.
    pub(crate) async fn claim_with_policy(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Resolved> {
        let started = Instant::now();
        let mut backoff = Duration::from_millis(5);
        loop {
            let t0 = Instant::now();
            let claim = self.ledger.claim(key, opts).await?;
            let label = claim.label();
            telemetry::claim_recorded(self.ledger.backend(), key, label, t0.elapsed());
            tracing::Span::current().record("result", label);
            match claim {
                Claim::Acquired(lease) => return Ok(Resolved::Lease(lease)),
                Claim::Completed(record) => {
                    telemetry::duplicate_seen(key, true, record.created_at, record.read_at);
                    let outcome = record.outcome.ok_or_else(|| Error::Corrupt {
                        backend: self.ledger.backend(),
                        message: format!("{key}: completed record without an outcome"),
                    })?;
                    return Ok(Resolved::Stored(outcome));
                }
                Claim::Abandoned(_) => return Err(Error::Abandoned { key: key.to_string() }),
                Claim::InProgress {
                    fence,
                    expires_at,
                    first_claimed_at,
                    read_at,
                } => {
                    telemetry::duplicate_seen(key, false, first_claimed_at, read_at);
                    let max = match opts.on_in_progress {
                        OnInProgress::Reject => Duration::ZERO,
                        OnInProgress::Wait { max } => max,
                    };
                    let waited = started.elapsed();
                    if waited >= max {
                        return Err(Error::InProgress {
                            key: key.to_string(),
                            fence,
                        });
                    }
                    // Never sleep past the holder's expiry (we may take over
                    // then) or past our own deadline.
                    let until_expiry = expires_at
                        .duration_since(read_at)
                        .unwrap_or_default()
                        .saturating_add(Duration::from_millis(1));
                    let nap = backoff.min(until_expiry).min(max - waited);
                    tokio::time::sleep(nap).await;
                    backoff = (backoff * 2).min(Duration::from_millis(250));
                }
            }
        }
    }

    /// Completes or releases the lease according to the handler's result.
    pub(crate) async fn settle<T: Serialize>(
        &self,
        lease: &Lease,
        opts: &ClaimOptions,
        result: Result<T, Failure>,
    ) -> Result<T> {
        let key = &lease.key;
        match result {
            Ok(value) => {
                let outcome = match Outcome::from_json(&Envelope::Ok(&value)) {
                    Ok(o) => o,
                    Err(e) => {
                        // Nothing stored: give the key back so the ledger is
                        // as it was, and say why.
                        self.release_quietly(lease).await;
                        return Err(e);
                    }
                };
                self.complete(lease, &outcome).await?;
                Ok(value)
            }
            Err(Failure::Retryable(e)) => {
                self.release(lease).await?;
                Err(Error::Handler(e))
            }
            Err(Failure::Terminal(message)) => {
                if opts.cache_failures {
                    let outcome = Outcome::from_json(&Envelope::<()>::Err(truncate(&message)))?;
                    self.complete(lease, &outcome).await?;
                } else {
                    self.release(lease).await?;
                }
                Err(Error::Terminal {
                    key: key.to_string(),
                    message,
                })
            }
        }
    }

    pub(crate) async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        self.ledger
            .complete(lease, outcome)
            .await
            .inspect_err(|e| fence_check(lease, e))
    }

    pub(crate) async fn release(&self, lease: &Lease) -> Result<()> {
        self.ledger
            .release(lease)
            .await
            .inspect_err(|e| fence_check(lease, e))
    }

    pub(crate) async fn release_quietly(&self, lease: &Lease) {
        if let Err(e) = self.release(lease).await {
            tracing::warn!(effect_key = %lease.key, error = %e, "release after a failed outcome");
        }
    }
}

/// The span every claim runs in (the same fields as [`Effects::run`]'s).
pub(crate) fn claim_span(key: &EffectKey) -> tracing::Span {
    tracing::info_span!(
        "oncely.claim",
        effect_key = %key,
        tenant = %key.tenant(),
        kind = key.kind(),
        fence = tracing::field::Empty,
        result = tracing::field::Empty,
    )
}

pub(crate) enum Resolved {
    Lease(Lease),
    Stored(Outcome),
}

pub(crate) fn fence_check(lease: &Lease, e: &Error) {
    if e.is_lease_lost() {
        telemetry::fence_rejected(&lease.key);
    }
}

/// Decodes a stored envelope into the caller's value or its stored failure.
pub(crate) fn decode<T: DeserializeOwned>(key: &EffectKey, outcome: &Outcome) -> Result<T> {
    match outcome.to_value::<Envelope<T>>()? {
        Envelope::Ok(v) => Ok(v),
        Envelope::Err(message) => Err(Error::Terminal {
            key: key.to_string(),
            message,
        }),
    }
}

/// Terminal messages are outcomes too; keep them well under the limit.
pub(crate) fn truncate(message: &str) -> String {
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

/// Runs `work` while renewing `lease` every third of `lease_len`. A failed
/// renewal stops renewing (the completion then reports the lost lease); it
/// never cancels the handler halfway through an effect.
pub(crate) async fn with_renewal<L: Ledger, F: Future>(
    ledger: &L,
    lease: &Lease,
    lease_len: Duration,
    work: F,
) -> F::Output {
    let renew = async {
        let period = (lease_len / 3).max(Duration::from_millis(1));
        loop {
            tokio::time::sleep(period).await;
            if let Err(e) = ledger.renew(lease, lease_len).await {
                if e.is_lease_lost() {
                    telemetry::fence_rejected(&lease.key);
                }
                tracing::warn!(effect_key = %lease.key, error = %e, "lease renewal failed; no longer renewing");
                return std::future::pending::<()>().await;
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

//! The runner most users touch: claim → run → complete, and duplicates get
//! the stored outcome back.

use std::future::Future;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

use crate::error::Result;
use crate::held::HeldLease;
use crate::job::Job;
use crate::key::{EffectKey, Tenant};
use crate::ledger::Ledger;
use crate::pipeline::{self, Failure, Resolved};
use crate::record::ClaimOptions;
use crate::telemetry;

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
    /// [`Job::step`] gets its own key, so a redelivery resumes at the first
    /// unfinished step. `job_type` names the job in error messages; it is not
    /// part of the step keys, so two job types that perform the same effect
    /// on the same subject share its record.
    pub fn job(&self, tenant: &Tenant, job_type: &str, subject: &str) -> Job<'_, L> {
        Job::new(&self.ledger, tenant, job_type, subject)
    }

    /// Claims `key`, runs `f` if this caller acquired it, and stores its
    /// outcome. A duplicate gets the stored outcome back without running `f`;
    /// one that finds the effect in flight waits or is rejected according to
    /// [`ClaimOptions::on_in_progress`], and never reports success it did not see.
    ///
    /// `f` starts only if the lease has more than
    /// [`ClaimOptions::margin`] left on this worker's clock (a grant that
    /// arrives later is given back and claimed again). While `f` runs, the
    /// lease is renewed every third of its length, retrying failed renewals
    /// until it would end; [`HeldLease::lost`] tells `f` when it can no
    /// longer count on it, and a completion refused because another claimant
    /// took over fails with [`Error::LeaseLost`](crate::Error::LeaseLost).
    ///
    /// What `f`'s result writes: a value is stored and replayed; a retryable
    /// failure releases the key; a terminal one is stored (or released, see
    /// [`ClaimOptions::cache_failures`]); a value too large to store releases
    /// the key, except in an at-most-once claim, which has already had its
    /// effect and is left to be abandoned and reconciled.
    pub async fn run<T, F, Fut>(&self, key: &EffectKey, opts: &ClaimOptions, f: F) -> Result<T>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(HeldLease) -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        opts.validate()?;
        let ledger = &self.ledger;
        async move {
            let (lease, deadline) = match pipeline::claim(ledger, key, opts).await? {
                Resolved::Lease(lease, deadline) => (lease, deadline),
                Resolved::Stored(outcome) => return pipeline::decode(key, &outcome),
            };
            let result = pipeline::run_held(ledger, &lease, deadline, opts, f).await;
            let settlement = pipeline::settlement(ledger, &lease, opts, result);
            pipeline::settle(ledger, &lease, settlement).await
        }
        .instrument(telemetry::claim_span(key))
        .await
    }
}

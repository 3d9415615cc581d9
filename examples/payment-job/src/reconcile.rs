//! Reconciling the payment job against its provider and mailer.
//!
//! Two of the job's steps can be left in doubt by a crash:
//!
//! - `capture` (provider-keyed) can be **stuck**: the worker died after its
//!   claim, before or after the provider call, and no redelivery came to take
//!   it over. The provider lists charges by idempotency key, so
//!   [`FakeProvider::charge_by_key`] with the step's provider key tells
//!   whether money moved: yes → complete the step with that charge (a
//!   redelivery then replays it instead of calling the provider); no →
//!   release it (a redelivery captures, with the same key).
//! - `receipt` (at most once) can be **abandoned**: the worker died between
//!   the mark and the completion, so the receipt went out zero times or
//!   once. The mailer's message log ([`FakeMailer::log`]) says which: sent →
//!   complete the step; not sent → release it (the next delivery sends it);
//!   the log no longer covers the order → unknown, the step stays listed for
//!   a human.
//!
//! Anything else is unknown to this reconciler.

use std::sync::Arc;

use oncely::BoxError;
use oncely::admin::Admin;
use oncely::backend::{Outcome, Record};
use oncely::reconcile::{Doubt, Reconcile, Reconciler, Report, Verdict};

use crate::{Db, FakeMailer, FakeProvider, MailLog, Pipeline};

/// Asks the payment provider about `capture` steps and the mailer about
/// `receipt` steps.
#[derive(Debug, Clone)]
pub struct PaymentReconciler {
    /// The payment provider.
    pub provider: Arc<FakeProvider>,
    /// The mailer.
    pub mailer: Arc<FakeMailer>,
}

impl PaymentReconciler {
    /// The reconciler of a pipeline's provider and mailer.
    pub fn of<D>(p: &Pipeline<D>) -> Self {
        PaymentReconciler {
            provider: p.provider.clone(),
            mailer: p.mailer.clone(),
        }
    }
}

impl Reconciler for PaymentReconciler {
    async fn check(&self, record: &Record, _doubt: Doubt) -> Result<Verdict, BoxError> {
        let key = &record.key;
        Ok(match key.kind() {
            // What the step sent as the idempotency key.
            "capture" => match self.provider.charge_by_key(&key.provider_key()).await? {
                // The value the step's closure would have returned.
                Some(charge) => Verdict::Done(Outcome::value(&charge)?),
                None => Verdict::NotDone,
            },
            "receipt" => match self.mailer.log(key.subject()).await {
                // The receipt step returns `()`.
                MailLog::Sent(_) => Verdict::Done(Outcome::value(&())?),
                MailLog::NotSent => Verdict::NotDone,
                MailLog::Gone => Verdict::Unknown,
            },
            _ => Verdict::Unknown,
        })
    }
}

/// One reconciliation pass over a pipeline's tenant: every stuck lease,
/// then every abandoned step, oldest first, listed through the ledger's
/// operator view ([`Admin`]).
pub async fn reconcile<D: Db + Admin>(p: &Pipeline<D>, dry_run: bool) -> oncely::Result<Report> {
    let reconciler = PaymentReconciler::of(p);
    Reconcile::new(&p.db, &reconciler)
        .dry_run(dry_run)
        .batch_size(50)
        // The takeover of a stuck capture keeps the job's retention.
        .claim_options(p.opts.clone().lease(std::time::Duration::from_secs(30)))
        .doubtful(&p.tenant)
        .await
}

//! The runner most users touch: claim → run → complete, and duplicates get
//! the stored outcome back.

use std::future::Future;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

use crate::coalesce::Coalescing;
use crate::error::Result;
use crate::flight::Flights;
use crate::held::HeldLease;
use crate::job::Job;
use crate::key::{EffectKey, Tenant};
use crate::ledger::Ledger;
use crate::pipeline::{self, Failure, Resolved};
use crate::record::ClaimOptions;
use crate::telemetry;

/// Runs effects once against a [`Ledger`].
///
/// Two things happen underneath when many tasks share one runner (clones
/// share them too), and neither changes an answer:
///
/// - **Coalescing**: the concurrent claims and completions of the
///   runner's tasks are gathered into one
///   [`claim_many`](Ledger::claim_many) or
///   [`complete_many`](Ledger::complete_many) statement while the previous
///   one is in flight ([`Coalescing`]); a lone caller goes straight to the
///   ledger. On where the backend measured it faster
///   ([`Capabilities::coalescing`](crate::backend::Capabilities::coalescing):
///   PostgreSQL, MySQL/MariaDB on one server, SQLite and Redis), off on
///   NATS (whose batches are pipelined single writes: gathering them only
///   queued them), on a Galera cluster and on the memory ledger;
///   [`Effects::coalescing`] overrides it.
/// - **Single-flight**: a duplicate under [`OnInProgress::Wait`] that
///   arrives while a task of this runner holds its key waits for that task
///   in memory, and gets the outcome once the ledger has acknowledged its
///   completion, without a round trip of its own. Any other ending (a
///   release, a lost lease, a failed completion, a lease that may have
///   ended) sends it to the ledger as usual. Duplicates in other processes
///   are woken by the ledger's notifications, as before.
///
/// [`OnInProgress::Wait`]: crate::OnInProgress::Wait
#[derive(Debug, Clone)]
pub struct Effects<L> {
    ledger: Coalescing<L>,
    flights: Arc<Flights>,
}

impl<L: Ledger + 'static> Effects<L> {
    /// A runner over a ledger, coalescing its tasks' claims and completions
    /// where the backend says that is faster
    /// ([`Capabilities::coalescing`](crate::backend::Capabilities::coalescing)).
    pub fn new(ledger: L) -> Self {
        let on = ledger.capabilities().coalescing;
        let ledger = Coalescing::new(ledger);
        ledger.set_enabled(on);
        Effects {
            ledger,
            flights: Arc::default(),
        }
    }

    /// Turns coalescing on or off for this runner and its clones (the
    /// default is the backend's): off, every claim and completion is its
    /// own statement, as on the bare ledger. Single-flight stays on either
    /// way (it never costs a round trip).
    pub fn coalescing(self, on: bool) -> Self {
        self.ledger.set_enabled(on);
        self
    }

    /// The ledger underneath.
    pub fn ledger(&self) -> &L {
        self.ledger.inner()
    }

    /// A job with several effects on one business subject (an order): each
    /// [`Job::step`] gets its own key, so a redelivery resumes at the first
    /// unfinished step. `job_type` names the job in error messages; it is not
    /// part of the step keys, so two job types that perform the same effect
    /// on the same subject share its record.
    pub fn job(&self, tenant: &Tenant, job_type: &str, subject: &str) -> Job<'_, Coalescing<L>> {
        Job::new(&self.ledger, Some(&self.flights), tenant, job_type, subject)
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
        self.run_reported(key, opts, f).await.map(|ran| ran.value)
    }

    /// [`Effects::run`], telling the caller how its answer came about:
    /// [`How::Ran`] when `f` ran in this call and its outcome was stored,
    /// [`How::Replayed`] when the effect had completed before (possibly
    /// while this call waited for another holder) and its stored outcome was
    /// returned without running `f`.
    ///
    /// A consumer loop acks either way; the difference is what it logs and
    /// counts (a suppressed duplicate). Errors are those of
    /// [`Effects::run`]: a stored terminal failure replayed to a duplicate is
    /// [`Error::Terminal`](crate::Error::Terminal) as it was the first time.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use oncely::{ClaimOptions, EffectKey, Effects, How, MemoryLedger, Tenant};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> oncely::Result<()> {
    /// let effects = Effects::new(Arc::new(MemoryLedger::new()));
    /// let key = EffectKey::new(&Tenant::global(), "capture", "order-7")?;
    /// let opts = ClaimOptions::default();
    /// let first = effects.run_reported(&key, &opts, |_| async { Ok(7) }).await?;
    /// let again = effects.run_reported(&key, &opts, |_| async { Ok(8) }).await?;
    /// assert_eq!((first.value, first.how), (7, How::Ran));
    /// assert_eq!((again.value, again.how), (7, How::Replayed));
    /// # Ok(()) }
    /// ```
    pub async fn run_reported<T, F, Fut>(
        &self,
        key: &EffectKey,
        opts: &ClaimOptions,
        f: F,
    ) -> Result<Reported<T>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(HeldLease) -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        opts.validate()?;
        let ledger = &self.ledger;
        async move {
            let flights = &*self.flights;
            let (lease, deadline) = match pipeline::claim(ledger, key, opts, Some(flights)).await? {
                Resolved::Lease(lease, deadline) => (lease, deadline),
                Resolved::Stored(outcome) => {
                    return pipeline::decode(key, &outcome).map(|value| Reported {
                        value,
                        how: How::Replayed,
                    });
                }
            };
            let holding = flights.hold(&lease, opts, deadline);
            let result = pipeline::run_held(ledger, &lease, deadline, opts, f).await;
            let settlement = pipeline::settlement(ledger, &lease, opts, result);
            pipeline::settle(ledger, &lease, settlement, Some(holding))
                .await
                .map(|value| Reported { value, how: How::Ran })
        }
        .instrument(telemetry::claim_span(key))
        .await
    }
}

/// How a runner's answer came about (see [`Effects::run_reported`]).
// Exhaustive by design (ARCHITECTURE.md, API boundaries): ran or replayed, nothing else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum How {
    /// The handler ran in this call and its outcome was stored.
    Ran,
    /// The effect had completed before; its stored outcome was returned and
    /// the handler did not run (a suppressed duplicate).
    Replayed,
}

impl How {
    /// `ran` or `replayed`, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            How::Ran => "ran",
            How::Replayed => "replayed",
        }
    }

    /// Whether the stored outcome was replayed.
    pub fn is_replayed(self) -> bool {
        self == How::Replayed
    }

    /// How a delivery that ran two effects came about: [`How::Ran`] when
    /// either ran (something happened in this delivery: a job that replayed
    /// its capture and ran its receipt), [`How::Replayed`] only when both
    /// were replayed (the delivery was a pure duplicate). Also `a | b`.
    ///
    /// ```
    /// use oncely::How;
    /// assert_eq!(How::Replayed.combine(How::Ran), How::Ran);
    /// assert_eq!(How::Replayed | How::Replayed, How::Replayed);
    /// let steps = [How::Replayed, How::Ran, How::Replayed];
    /// assert_eq!(steps.into_iter().fold(How::Replayed, How::combine), How::Ran);
    /// ```
    pub fn combine(self, other: How) -> How {
        if self == How::Ran || other == How::Ran {
            How::Ran
        } else {
            How::Replayed
        }
    }
}

/// [`How::combine`].
impl std::ops::BitOr for How {
    type Output = How;
    fn bitor(self, other: How) -> How {
        self.combine(other)
    }
}

/// [`How::combine`], in place.
impl std::ops::BitOrAssign for How {
    fn bitor_assign(&mut self, other: How) {
        *self = self.combine(other);
    }
}

impl std::fmt::Display for How {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A runner's value and [`How`] it came about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reported<T> {
    /// The effect's outcome: the handler's value or the stored one.
    pub value: T,
    /// Whether the handler ran now or the stored outcome was replayed.
    pub how: How,
}

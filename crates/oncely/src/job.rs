//! Resumable multi-step jobs; the user-facing docs live on [`Job`].

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

use crate::error::{Error, Result};
use crate::flight::Flights;
use crate::held::HeldLease;
use crate::key::{EffectKey, Tenant};
use crate::ledger::{Ledger, TransactionalLedger};
use crate::pipeline::{self, Failure, Resolved};
use crate::record::{ClaimOptions, Fingerprint, Lease, OnInProgress, Record};
use crate::telemetry;

/// How a [`Job::step`] is made safe to run twice (see [`Job`] for the
/// window each leaves open). The third mode, transactional, is
/// [`Job::step_in`]: it needs the caller's transaction, so it is a method of
/// its own rather than a value `step` could be handed by mistake.
// Exhaustive by design (ARCHITECTURE.md, API boundaries): the job model's modes; a new one is a new contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepMode {
    /// A lease, renewed while the closure runs; the closure passes
    /// [`StepContext::provider_key`] to an API that deduplicates on it. A
    /// crash re-runs the step after the lease expires, with the same key.
    ProviderKeyed,
    /// The attempt is recorded before the closure runs; a crash before the
    /// completion abandons the step for reconciliation instead of re-running
    /// it.
    AtMostOnce,
}

impl StepMode {
    /// `provider_keyed` or `at_most_once`.
    pub fn as_str(self) -> &'static str {
        Mode::Leased(self).as_str()
    }
}

impl fmt::Display for StepMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A step's mode as a job records it: one kind, one mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Mode {
    Transactional,
    Leased(StepMode),
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Transactional => "transactional",
            Mode::Leased(StepMode::ProviderKeyed) => "provider_keyed",
            Mode::Leased(StepMode::AtMostOnce) => "at_most_once",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a step's closure gets: the step's key, its provider key and the
/// lease's fence.
#[derive(Debug, Clone)]
pub struct StepContext {
    lease: HeldLease,
    mode: Option<StepMode>,
}

impl StepContext {
    /// The step's effect key (`tenant/kind:subject`).
    pub fn key(&self) -> &EffectKey {
        &self.lease.key
    }

    /// The idempotency key to send to an external API: the same for every
    /// attempt of this step, forever.
    pub fn provider_key(&self) -> String {
        self.lease.provider_key()
    }

    /// The lease's fence, for conditional business writes
    /// (`… WHERE id = $1 AND fence < $2`): a later holder always has a higher
    /// one.
    pub fn fence(&self) -> u64 {
        self.lease.fence
    }

    /// The lease this attempt runs under.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The lease with its renewal state: [`HeldLease::lost`] resolves when
    /// this attempt can no longer count on it (check it before a call that
    /// must not happen twice). In a transactional step the claim's row stays
    /// locked by the transaction, so the lease cannot be taken over while the
    /// transaction is open.
    pub fn held(&self) -> &HeldLease {
        &self.lease
    }

    /// The mode of a [`Job::step`]; `None` in a transactional step
    /// ([`Job::step_in`]).
    pub fn mode(&self) -> Option<StepMode> {
        self.mode
    }
}

/// The future a [`Job::step_in`] closure returns: boxed, because it borrows
/// the caller's connection for as long as it runs.
pub type StepFuture<'c, T> = Pin<Box<dyn Future<Output = Result<T, Failure>> + Send + 'c>>;

/// Resumable multi-step jobs: one effect key per step, so a redelivery
/// resumes at the first unfinished step instead of redoing or skipping
/// everything.
///
/// A job that captures a payment, marks the order paid and sends a receipt has
/// three effects. With one status flag, a crash after the capture leaves the
/// retry two bad choices: capture again, or never send the receipt. A [`Job`]
/// gives each step its own [`EffectKey`] (`tenant/kind:subject`): a completed
/// step answers with its stored outcome without running again, and the first
/// unfinished one runs.
///
/// # The three step modes
///
/// | mode | use it for | what a crash can leave behind |
/// | --- | --- | --- |
/// | transactional ([`Job::step_in`]) | writes to the same SQL database as the ledger | nothing: the claim, the step's writes and the completion commit in the caller's transaction, or none of them do |
/// | [`StepMode::ProviderKeyed`] ([`Job::step`]) | an external API that honours an idempotency key (payments) | a crash after the call and before the completion re-runs the step once the lease expires, with the **same** [`StepContext::provider_key`]; the provider answers the repeat with its first result. Without key support at the provider, that one window is a second effect |
/// | [`StepMode::AtMostOnce`] ([`Job::step`]) | an external effect nobody deduplicates (email, push, SMS) | the attempt is recorded before the closure runs; a crash between that mark and the completion leaves the step [`Abandoned`](crate::record::RecordState::Abandoned): never run again automatically, listed by [`Ledger::abandoned`] for reconciliation. The effect happened zero times or once, and the ledger cannot tell which |
///
/// A step that is naturally idempotent (set a field to a fixed value, upsert
/// on a natural key) needs no key at all: just run it.
///
/// A duplicate step under [`OnInProgress::Wait`] that arrives while another
/// task of the same [`Effects`](crate::Effects) runner holds it (the second
/// delivery of a job, handled by this process while the first still runs)
/// waits for that task in memory and replays its outcome once the ledger
/// has acknowledged the completion, without a claim of its own: the
/// runner's single-flight, as for [`Effects::run`](crate::Effects::run).
/// Transactional steps reject such a duplicate instead (their completion is
/// acknowledged only by the caller's commit).
///
/// ## The exact windows
///
/// - **Transactional.** None for the writes inside the transaction, provided
///   the caller commits the same transaction it passed in (and only then acks
///   the message). A duplicate that arrives meanwhile waits on the database's
///   lock (the unique index on PostgreSQL, the write lock on SQLite) and then
///   sees the step completed. Anything the closure does *outside* the
///   transaction (an HTTP call) is not covered: use another mode for it.
/// - **ProviderKeyed.** Between the provider call and the completion. A re-run
///   happens only after the lease expires (the lease is renewed every third of
///   its length while the closure runs, so a slow but live worker keeps it).
///   A worker that stalls past its lease (a long pause, a partition) is a
///   zombie: the step may run again elsewhere while it is still going. The
///   provider key makes the provider call safe; for your own writes, pass
///   [`StepContext::fence`] into a conditional write
///   (`UPDATE orders SET … , fence = $2 WHERE id = $1 AND fence < $2`), so
///   the zombie's write matches no row, and its completion fails with
///   [`Error::LeaseLost`].
/// - **AtMostOnce.** Between the durable mark and the completion: a crash
///   there (before the send, during it, or after it and before the
///   completion) abandons the step once its lease expires. Duplicates then get
///   [`Error::Abandoned`] instead of a second email; an operator (or a
///   reconciliation job that asks the mail provider) settles it with
///   [`Record::reconciliation_lease`]. Return [`Failure::Retryable`] from an
///   at-most-once closure only when the effect certainly did not happen: it
///   releases the step and the next delivery tries again. Nothing else
///   releases an at-most-once step whose closure started (an unexpected
///   unique violation, a terminal failure that is not cached, an outcome
///   too large to store): the effect may have happened, so the step is left
///   to be abandoned and reconciled.
///
/// # Bad input
///
/// Each of these is a clear error that leaves the ledger as it was:
/// - a step kind used with two modes in one job: [`Error::Misuse`] before any
///   round trip;
/// - a key that fails validation (kind, subject, discriminator):
///   [`Error::InvalidKey`] before any round trip;
/// - a redelivery whose payload changed while its key did not
///   ([`Job::fingerprint`]): [`Error::FingerprintMismatch`] from the first
///   step's claim, which changes nothing;
/// - an outcome over the limit ([`MAX_OUTCOME_BYTES`](crate::record::MAX_OUTCOME_BYTES)
///   or the backend's smaller one): [`Error::OutcomeTooLarge`], nothing
///   stored. A provider-keyed step is released (the next delivery re-runs it
///   with the same provider key); a transactional one is in the caller's
///   transaction, which the caller rolls back. An at-most-once step has
///   already performed its effect, so it is *not* released (that would
///   repeat it): it is left to be abandoned and reconciled.
///
/// # Example
///
/// ```
/// use std::sync::Arc;
/// use oncely::{Effects, MemoryLedger, StepMode, Tenant};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> oncely::Result<()> {
/// let effects = Effects::new(Arc::new(MemoryLedger::new()));
/// let tenant = Tenant::new("acme")?;
/// let job = effects.job(&tenant, "payment", "order-123");
///
/// let charge: String = job
///     .step("capture", StepMode::ProviderKeyed, |ctx| async move {
///         // provider.capture(amount, idempotency_key = ctx.provider_key())
///         Ok(format!("ch_{}", &ctx.provider_key()[..8]))
///     })
///     .await?;
/// job.step("receipt", StepMode::AtMostOnce, |_ctx| async move {
///     // mailer.send(receipt): nobody deduplicates it, so at most once
///     Ok(())
/// })
/// .await?;
///
/// // A redelivery resumes after the last completed step: here, nothing runs.
/// let again = effects.job(&tenant, "payment", "order-123");
/// let replayed: String = again
///     .step("capture", StepMode::ProviderKeyed, |_| async { Ok("never".to_owned()) })
///     .await?;
/// assert_eq!(replayed, charge);
/// # Ok(()) }
/// ```
///
/// # Options
///
/// All steps of a job share its [`ClaimOptions`] (lease, retention,
/// in-progress policy, fingerprint); the mode decides the rest.
pub struct Job<'a, L> {
    ledger: &'a L,
    /// The runner's single-flight table, when the job came from
    /// [`Effects::job`](crate::Effects::job): a duplicate step in this
    /// process waits for the holder in memory.
    flights: Option<&'a Flights>,
    tenant: Tenant,
    job_type: String,
    subject: String,
    opts: ClaimOptions,
    modes: Mutex<HashMap<String, Mode>>,
}

impl<L> fmt::Debug for Job<'_, L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Job")
            .field("tenant", &self.tenant)
            .field("job_type", &self.job_type)
            .field("subject", &self.subject)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl<'a, L: Ledger> Job<'a, L> {
    pub(crate) fn new(
        ledger: &'a L,
        flights: Option<&'a Flights>,
        tenant: &Tenant,
        job_type: &str,
        subject: &str,
    ) -> Self {
        Job {
            ledger,
            flights,
            tenant: tenant.clone(),
            job_type: job_type.to_owned(),
            subject: subject.to_owned(),
            opts: ClaimOptions::default(),
            modes: Mutex::new(HashMap::new()),
        }
    }

    /// Sets the options every step claims with (lease, retention, in-progress
    /// policy, `sent_at`, failure caching, fingerprint). `at_most_once` is
    /// ignored: the step's mode decides it. A fingerprint set earlier with
    /// [`Job::fingerprint`] is kept unless `opts` carries one.
    pub fn options(mut self, opts: ClaimOptions) -> Self {
        let fingerprint = opts.fingerprint.or(self.opts.fingerprint);
        self.opts = opts;
        self.opts.fingerprint = fingerprint;
        self
    }

    /// Sets the request fingerprint that every step's claim carries: a
    /// redelivery with an altered payload under the same subject fails with
    /// [`Error::FingerprintMismatch`] at its first step and changes nothing.
    pub fn fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.opts.fingerprint = Some(fingerprint);
        self
    }

    /// [`Job::fingerprint`] of a serde payload ([`Fingerprint::of_json`]).
    pub fn fingerprint_of<P: Serialize + ?Sized>(self, payload: &P) -> Result<Self> {
        Ok(self.fingerprint(Fingerprint::of_json(payload)?))
    }

    /// The tenant.
    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }

    /// The job type given to [`Effects::job`](crate::Effects::job).
    pub fn job_type(&self) -> &str {
        &self.job_type
    }

    /// The business subject (`order-123`).
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The key of a step: `tenant/kind:subject`, or
    /// `tenant/kind:subject:discriminator` for an effect legitimately repeated
    /// on one subject (a second invoice on the same order). Validated before
    /// any round trip.
    ///
    /// The subject and the discriminator are escaped (`\` → `\\`, `:` →
    /// `\:`) before they are joined, so the encoding is injective: job
    /// `order-1` step `invoice` with discriminator `invoice-2` and job
    /// `order-1:invoice-2` step `invoice` are two effects
    /// (`order-1:invoice-2` and `order-1\:invoice-2`). Subjects without `:`
    /// or `\` keep their plain form.
    pub fn step_key(&self, kind: &str, discriminator: Option<&str>) -> Result<EffectKey> {
        // The job type is a label, but a bad one is still bad input.
        EffectKey::new(&self.tenant, &self.job_type, &self.subject)
            .map_err(|e| Error::invalid_key(format!("job type or subject: {e}")))?;
        let mut subject = escape_part(&self.subject);
        if let Some(d) = discriminator {
            if d.is_empty() || d.trim() != d {
                return Err(Error::invalid_key(
                    "discriminator must be non-empty, without leading or trailing whitespace",
                ));
            }
            subject.push(':');
            subject.push_str(&escape_part(d));
        }
        EffectKey::new(&self.tenant, kind, subject)
    }

    /// The stored record of a step, if any.
    pub async fn step_record(&self, kind: &str, discriminator: Option<&str>) -> Result<Option<Record>> {
        let key = self.step_key(kind, discriminator)?;
        self.ledger.get(&key).await
    }

    /// Runs a [`ProviderKeyed`](StepMode::ProviderKeyed) or
    /// [`AtMostOnce`](StepMode::AtMostOnce) step keyed `tenant/kind:subject`:
    /// returns the stored outcome if the step already completed, runs `f`
    /// otherwise and stores what it returns.
    ///
    /// While `f` runs, its lease is renewed every third of its length. A
    /// duplicate that finds the step in flight waits or fails according to
    /// the job's [`OnInProgress`] policy; an abandoned at-most-once step gives
    /// [`Error::Abandoned`]. Transactional steps go through
    /// [`Job::step_in`]: `step` has no such mode to be handed.
    ///
    /// ```compile_fail
    /// # use oncely::{Effects, MemoryLedger, StepMode, Tenant};
    /// # async fn f(effects: Effects<MemoryLedger>) {
    /// let job = effects.job(&Tenant::global(), "payment", "order-1");
    /// let _ = job.step("mark-paid", StepMode::Transactional, |_| async { Ok(()) }).await;
    /// # }
    /// ```
    pub async fn step<T, F, Fut>(&self, kind: &str, mode: StepMode, f: F) -> Result<T>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(StepContext) -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        self.run_step(kind, None, mode, f).await
    }

    /// [`Job::step`] for an effect repeated on one subject: the key's subject
    /// is `subject:discriminator` (`order-1:invoice-2`).
    pub async fn step_with<T, F, Fut>(
        &self,
        kind: &str,
        discriminator: &str,
        mode: StepMode,
        f: F,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(StepContext) -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        self.run_step(kind, Some(discriminator), mode, f).await
    }

    async fn run_step<T, F, Fut>(
        &self,
        kind: &str,
        discriminator: Option<&str>,
        mode: StepMode,
        f: F,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(StepContext) -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        let (key, opts) = self.prepare(kind, discriminator, Mode::Leased(mode))?;
        let (ledger, flights) = (self.ledger, self.flights);
        let span = telemetry::claim_span(&key);
        async move {
            let (lease, deadline) = match pipeline::claim(ledger, &key, &opts, flights).await? {
                Resolved::Lease(lease, deadline) => (lease, deadline),
                Resolved::Stored(outcome) => return pipeline::decode(&key, &outcome),
            };
            let holding = flights.map(|f| f.hold(&lease, &opts, deadline));
            let result = pipeline::run_held(ledger, &lease, deadline, &opts, |held| {
                f(StepContext {
                    lease: held,
                    mode: Some(mode),
                })
            })
            .await;
            let settlement = pipeline::settlement(ledger, &lease, &opts, result);
            pipeline::settle(ledger, &lease, settlement, holding).await
        }
        .instrument(span)
        .await
    }

    /// Validates everything that can be checked before a round trip, then
    /// records the kind's mode for this job.
    fn prepare(
        &self,
        kind: &str,
        discriminator: Option<&str>,
        mode: Mode,
    ) -> Result<(EffectKey, ClaimOptions)> {
        let key = self.step_key(kind, discriminator)?;
        let mut opts = self.opts.clone();
        opts.at_most_once = mode == Mode::Leased(StepMode::AtMostOnce);
        if mode == Mode::Transactional {
            // Waiting inside a transaction would hold its locks; a live lease
            // elsewhere is rare here (a claim committed without completion)
            // and the broker's redelivery is the better wait.
            opts.on_in_progress = OnInProgress::Reject;
        }
        opts.validate()?;
        let mut modes = self.modes.lock().unwrap_or_else(|p| p.into_inner());
        match modes.get(kind) {
            Some(&prev) if prev != mode => {
                return Err(Error::Misuse(format!(
                    "step {kind:?} of job {:?} was run as {prev} and now as {mode}; one kind, one mode",
                    self.job_type
                )));
            }
            Some(_) => {}
            None => {
                modes.insert(kind.to_owned(), mode);
            }
        }
        Ok((key, opts))
    }
}

impl<L: TransactionalLedger> Job<'_, L> {
    /// Runs a transactional step on the caller's
    /// open transaction: the claim, `f`'s writes (made on the connection it
    /// receives) and the completion all go through `conn`, so they commit or
    /// roll back together.
    ///
    /// **The caller commits.** Several transactional steps (and other writes)
    /// can share one transaction, which costs one commit per job. Commit when
    /// this returns `Ok`; on `Err`, roll back (drop the transaction), and
    /// nothing of the step remains. If the step already completed, `f` does not
    /// run and its stored outcome is returned.
    ///
    /// `conn` must be inside a transaction (`&mut *tx`): on a bare connection
    /// the claim would commit on its own and the step would lose its
    /// atomicity. A duplicate that finds the step leased elsewhere fails at
    /// once with [`Error::InProgress`] instead of waiting while it holds the
    /// transaction's locks. A terminal failure is written as the step's
    /// outcome on the transaction: commit to store it (duplicates replay it),
    /// roll back to let a later delivery try again.
    ///
    /// The closure returns a boxed [`StepFuture`] because it borrows the
    /// connection for as long as it runs; anything else it uses must be
    /// moved in (clone ids and handles first).
    ///
    /// ```
    /// use oncely::{Job, StepMode};
    /// use oncely::backend::TransactionalLedger;
    ///
    /// // With oncely-postgres, `L::Connection` is `sqlx::PgConnection` and
    /// // the closure runs `sqlx::query(..).execute(&mut *conn)`.
    /// async fn mark_paid<L: TransactionalLedger>(
    ///     job: &Job<'_, L>,
    ///     tx: &mut L::Connection,
    /// ) -> oncely::Result<()> {
    ///     job.step_in("mark-paid", tx, |_conn, ctx| {
    ///         Box::pin(async move {
    ///             // UPDATE orders SET status = 'paid', fence = $2
    ///             //  WHERE id = $1 AND fence < $2      -- $2 = ctx.fence()
    ///             let _ = ctx.fence();
    ///             Ok(())
    ///         })
    ///     })
    ///     .await
    /// }
    /// ```
    pub async fn step_in<T, F>(&self, kind: &str, conn: &mut L::Connection, f: F) -> Result<T>
    where
        T: Serialize + DeserializeOwned,
        F: for<'c> FnOnce(&'c mut L::Connection, StepContext) -> StepFuture<'c, T>,
    {
        self.run_step_in(kind, None, conn, f).await
    }

    /// [`Job::step_in`] for an effect repeated on one subject
    /// (`subject:discriminator`).
    pub async fn step_in_with<T, F>(
        &self,
        kind: &str,
        discriminator: &str,
        conn: &mut L::Connection,
        f: F,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned,
        F: for<'c> FnOnce(&'c mut L::Connection, StepContext) -> StepFuture<'c, T>,
    {
        self.run_step_in(kind, Some(discriminator), conn, f).await
    }

    async fn run_step_in<T, F>(
        &self,
        kind: &str,
        discriminator: Option<&str>,
        conn: &mut L::Connection,
        f: F,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned,
        F: for<'c> FnOnce(&'c mut L::Connection, StepContext) -> StepFuture<'c, T>,
    {
        let (key, opts) = self.prepare(kind, discriminator, Mode::Transactional)?;
        let ledger = self.ledger;
        let span = telemetry::claim_span(&key);
        async move {
            let (lease, deadline) = match pipeline::claim_in(ledger, conn, &key, &opts).await? {
                Resolved::Lease(lease, deadline) => (lease, deadline),
                Resolved::Stored(outcome) => return pipeline::decode(&key, &outcome),
            };
            // No renewal: the transaction holds the claim's row until it ends.
            let (held, _run) = HeldLease::new(lease.clone(), deadline);
            let ctx = StepContext {
                lease: held,
                mode: None,
            };
            let result = f(&mut *conn, ctx).await;
            let settlement = pipeline::settlement(ledger, &lease, &opts, result);
            pipeline::settle_in(ledger, conn, &lease, settlement).await
        }
        .instrument(span)
        .await
    }
}

/// Escapes `\` and `:` so that joining escaped parts with `:` is injective.
fn escape_part(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    for c in part.chars() {
        if matches!(c, '\\' | ':') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

//! Reconciliation: settling the records the ledger cannot settle alone by
//! asking the provider what happened.
//!
//! Two kinds of record are in doubt ([`Doubt`]):
//!
//! - an **abandoned** at-most-once step ([`RecordState::Abandoned`]): its
//!   lease ran out between the durable mark and the completion, so the email
//!   went out zero times or once, and the ledger never runs it again by
//!   itself;
//! - a **stuck** lease: a provider-keyed (or plain) claim in progress whose
//!   lease ended and that nobody completed. The next delivery would take it
//!   over and run it again with the same provider key; reconciliation settles
//!   it without waiting for one (a message that was dead-lettered, a consumer
//!   that is down).
//!
//! A [`Reconciler`] asks the provider about one record and answers a
//! [`Verdict`]; [`Reconcile`] pages through doubtful records oldest first,
//! asks, and applies each answer through *fenced* ledger writes:
//!
//! | verdict | abandoned step | stuck lease |
//! | --- | --- | --- |
//! | [`Verdict::Done`] | complete with the provider's outcome, fenced by [`Record::reconciliation_lease`] | take the lease over with [`Ledger::claim`] (fence + 1), then complete with the provider's outcome |
//! | [`Verdict::NotDone`] | release: the next delivery of its message runs the step | take the lease over, then release it: the next delivery runs the step (with the same provider key) |
//! | [`Verdict::Unknown`] | nothing is written: the step stays listed | nothing is written: the lease stays as it was |
//!
//! A release only lets the *next delivery* perform the step: one must still
//! be coming. A consumer must therefore never ack a delivery whose step is
//! abandoned, but hold it (redeliver it later) until the step is settled;
//! `oncely-consumer` does (its `abandoned_delay`), and dead-letters it with
//! the reason `abandoned` and the key once it has been delivered as often
//! as it allows, for a person to replay. A released record is listed in
//! the [`Report`] ([`Resolution::Released`]) so that whoever runs the
//! reconciliation can replay the messages of those with no delivery left.
//!
//! No write is ever made with a guessed lease. An abandoned step is written
//! at the fence the listing read, so if anyone moved it on meanwhile the
//! write fails with [`Error::LeaseLost`], changes nothing, and is counted as
//! [`Resolution::Moved`]. A stuck lease is first taken over by a claim, which
//! the backend decides atomically; if the claim answers anything but a
//! takeover (the holder completed after all, another worker holds a live
//! lease), the record moved on and is left alone. The provider is asked
//! *before* any write, so an [`Verdict::Unknown`] leaves the ledger exactly
//! as it was.
//!
//! A claim also takes over a *released* record, so a stuck lease that
//! another run (a second replica of your reconciliation job) released
//! between this run's listing and its claim is taken over and settled again
//! with this run's answer. That is harmless: a release is repeated, or a
//! completion stores what the provider says happened (a charge, once made,
//! stays made); both runs count it.
//!
//! # What the provider's answer is worth
//!
//! The provider is asked before anything is written, and a worker whose
//! lease ended may not be dead: stalled (a pause, a partition) between its
//! claim and its call, it can still reach the provider after the answer.
//! Its own completion is then refused by the fence, but the effect happened.
//! For a stuck provider-keyed step that is harmless: the step re-runs with
//! the same provider key, and the provider answers with the first result.
//! For an abandoned at-most-once step, a "not done" that a zombie overtakes
//! means a second email. [`Reconcile::grace`] leaves records alone until
//! their lease ended long enough ago (on the backend's clock) that no
//! worker of yours can still be running the step; set it to more than your
//! longest stall.
//!
//! A run is bounded ([`Reconcile::batch_size`], [`Reconcile::max_records`]),
//! paced ([`Reconcile::rate_limit`], records per second), can be a dry run
//! that writes nothing ([`Reconcile::dry_run`]), and returns a [`Report`].
//! Each record is handled in an `oncely.reconcile` span carrying its effect
//! key and counted in `oncely_reconciled_total{kind,doubt,result}` (see
//! [`telemetry`](mod@crate::telemetry)).
//!
//! Where the records come from is a [`Source`]. On a ledger with the
//! operator view ([`Admin`]: the SQL backends and the memory ledger),
//! [`Query`] pages through [`Admin::records`] with its cursor, and
//! [`Reconcile::doubtful`] settles a tenant's stuck leases and abandoned
//! steps in one run. On any ledger, [`Abandoned`] lists a tenant's
//! abandoned steps through [`Ledger::abandoned`], and [`Keys`] reads given
//! keys through [`Ledger::get`] (stuck leases you know of, where the
//! backend cannot list them: Redis, NATS). [`Chain`] runs one source after
//! another.
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use oncely::reconcile::{Doubt, Reconcile, Reconciler, Verdict};
//! use oncely::{BoxError, ClaimOptions, EffectKey, MemoryLedger, Tenant};
//! use oncely::backend::{Ledger, Outcome, Record};
//!
//! /// Asks the mail provider whether the receipt went out.
//! struct Mailer;
//!
//! impl Reconciler for Mailer {
//!     async fn check(&self, record: &Record, _doubt: Doubt) -> Result<Verdict, BoxError> {
//!         // provider.lookup(record.key.provider_key()).await?
//!         let sent = record.key.subject() == "order-1";
//!         Ok(if sent {
//!             Verdict::Done(Outcome::value(&"sent")?)
//!         } else {
//!             Verdict::NotDone
//!         })
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> oncely::Result<()> {
//! let ledger = Arc::new(MemoryLedger::new());
//! let tenant = Tenant::new("acme")?;
//! // A worker marks the receipt step (at most once) and dies before
//! // completing it; once its lease ends, the step is abandoned.
//! let key = EffectKey::new(&tenant, "receipt", "order-1")?;
//! ledger.claim(&key, &ClaimOptions::default().at_most_once(true)).await?;
//! ledger.advance(Duration::from_secs(60));
//! assert_eq!(ledger.abandoned(&tenant, 10).await?.len(), 1);
//!
//! let report = Reconcile::new(&ledger, &Mailer).abandoned(&tenant).await?;
//! assert_eq!((report.examined, report.completed), (1, 1));
//! assert!(ledger.abandoned(&tenant, 10).await?.is_empty());
//! # Ok(()) }
//! ```
//!
//! A scheduled job on a SQL ledger (anything with [`Admin`]), gentle with
//! the provider and leaving recent crashes to their redeliveries:
//!
//! ```
//! use std::time::Duration;
//! use oncely::admin::Admin;
//! use oncely::reconcile::{Reconcile, Reconciler};
//! use oncely::Tenant;
//!
//! async fn nightly<L: Admin>(ledger: &L, provider: &impl Reconciler, tenant: &Tenant) -> oncely::Result<()> {
//!     let report = Reconcile::new(ledger, provider)
//!         .batch_size(200)
//!         .rate_limit(20.0)                  // records per second
//!         .grace(Duration::from_secs(600))   // leases that ended 10+ minutes ago
//!         .max_records(10_000)
//!         .doubtful(tenant)                  // stuck leases, then abandoned steps
//!         .await?;
//!     tracing::info!(
//!         completed = report.completed, released = report.released,
//!         unknown = report.unknown, moved = report.moved, errors = report.errors,
//!         "reconciled"
//!     );
//!     Ok(())
//! }
//! ```
//!
//! Cancel safety: dropping a run between records loses nothing. Dropped
//! after a stuck lease was taken over and before its write, the
//! reconciler's lease simply expires and the record is stuck again, at a
//! higher fence.

use std::collections::HashSet;
use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use tracing::Instrument;

use crate::admin::{Admin, Cursor, Filter, MAX_PAGE, RecordQuery};
use crate::error::{BoxError, Error, Result};
use crate::key::{EffectKey, Tenant};
use crate::ledger::Ledger;
use crate::record::{Claim, ClaimOptions, Lease, Outcome, Record, RecordState};
use crate::telemetry;

/// Why a record needs reconciliation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Doubt {
    /// An at-most-once step whose lease ran out before it completed: the
    /// effect happened zero times or once.
    Abandoned,
    /// A claim in progress (not at-most-once) whose lease ended without a
    /// completion: the holder crashed or stalled, before or after the
    /// provider call.
    Stuck,
}

impl Doubt {
    /// Whether `record` is in doubt, and why: abandoned (listed as such, or
    /// an at-most-once claim whose lease has ended), stuck (any other claim
    /// in progress whose lease has ended, on the backend's clock as of
    /// [`Record::read_at`]), or `None` (completed, released, or a live
    /// lease).
    pub fn of(record: &Record) -> Option<Doubt> {
        match record.state {
            RecordState::Abandoned => Some(Doubt::Abandoned),
            RecordState::InProgress => {
                let ended = record.lease_expires_at.is_none_or(|at| at <= record.read_at);
                match (ended, record.at_most_once) {
                    (false, _) => None,
                    (true, true) => Some(Doubt::Abandoned),
                    (true, false) => Some(Doubt::Stuck),
                }
            }
            _ => None,
        }
    }

    /// `abandoned` or `stuck` (metric and span label).
    pub fn as_str(self) -> &'static str {
        match self {
            Doubt::Abandoned => "abandoned",
            Doubt::Stuck => "stuck",
        }
    }
}

/// What the provider says about one doubtful record.
// Exhaustive by design (ARCHITECTURE.md, API boundaries): all a provider can say.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// The effect happened: complete the record with this outcome, so that
    /// duplicates replay it. Build it as the runners do, with
    /// [`Outcome::value`] (or [`Outcome::failure`] for a terminal failure the
    /// provider reported).
    Done(Outcome),
    /// The effect certainly did not happen: release the record so the next
    /// delivery of its message runs it (see the [module docs](self) on why
    /// an abandoned step's delivery must be held, not acked, until then).
    NotDone,
    /// The provider cannot tell (yet): write nothing; the record stays listed.
    Unknown,
}

impl Verdict {
    /// `done`, `not_done` or `unknown` (span label).
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Done(_) => "done",
            Verdict::NotDone => "not_done",
            Verdict::Unknown => "unknown",
        }
    }
}

/// Asks the provider what happened to one doubtful record.
///
/// Look the effect up by what the step sent the provider: its
/// [`EffectKey::provider_key`] for a provider-keyed call, or whatever the
/// step tagged the message with. Answer [`Verdict::NotDone`] only when the
/// provider is certain: a released at-most-once step runs again. An error
/// is counted and leaves the record as it was.
pub trait Reconciler: Send + Sync {
    /// The provider's answer for `record`.
    fn check(&self, record: &Record, doubt: Doubt) -> impl Future<Output = Result<Verdict, BoxError>> + Send;
}

impl<R: Reconciler + ?Sized> Reconciler for &R {
    fn check(&self, record: &Record, doubt: Doubt) -> impl Future<Output = Result<Verdict, BoxError>> + Send {
        (**self).check(record, doubt)
    }
}

impl<R: Reconciler + ?Sized> Reconciler for std::sync::Arc<R> {
    fn check(&self, record: &Record, doubt: Doubt) -> impl Future<Output = Result<Verdict, BoxError>> + Send {
        (**self).check(record, doubt)
    }
}

/// One page from a [`Source`].
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Page {
    /// Records to examine, oldest first.
    pub records: Vec<Record>,
    /// Keys the source was asked about that have no record (counted as
    /// skipped).
    pub absent: Vec<EffectKey>,
}

impl Page {
    /// A page of records.
    pub fn records(records: Vec<Record>) -> Self {
        Page {
            records,
            absent: Vec::new(),
        }
    }
}

/// Where a run's records come from: successive pages, each of records not
/// handed out before in this run, oldest first; an empty page ends the run.
pub trait Source<L: Ledger + ?Sized>: Send {
    /// The next page of at most `limit` records.
    fn next_page(&mut self, ledger: &L, limit: usize) -> impl Future<Output = Result<Page>> + Send;
}

/// The abandoned at-most-once steps of a tenant, through
/// [`Ledger::abandoned`].
///
/// That listing has no cursor, and a step the reconciler leaves alone
/// ([`Verdict::Unknown`], a moved record, an error) stays in it; so each
/// page asks for as many more as were handed out before and skips those.
/// A run over `n` records reads `O(n² / batch)` rows: bound long backlogs
/// with [`Reconcile::max_records`].
#[derive(Debug, Clone)]
pub struct Abandoned {
    tenant: Tenant,
    seen: HashSet<EffectKey>,
    done: bool,
}

impl Abandoned {
    /// The abandoned steps of `tenant`.
    pub fn new(tenant: &Tenant) -> Self {
        Abandoned {
            tenant: tenant.clone(),
            seen: HashSet::new(),
            done: false,
        }
    }
}

impl<L: Ledger + ?Sized> Source<L> for Abandoned {
    async fn next_page(&mut self, ledger: &L, limit: usize) -> Result<Page> {
        if self.done || limit == 0 {
            return Ok(Page::default());
        }
        let ask = self.seen.len().saturating_add(limit);
        let listed = ledger
            .abandoned(&self.tenant, u64::try_from(ask).unwrap_or(u64::MAX))
            .await?;
        let whole = listed.len() < ask;
        let mut fresh: Vec<Record> = listed
            .into_iter()
            .filter(|r| !self.seen.contains(&r.key))
            .collect();
        if whole && fresh.len() <= limit {
            // The whole listing fit and this page takes all of it that was
            // not handed out before.
            self.done = true;
        }
        fresh.truncate(limit);
        self.seen.extend(fresh.iter().map(|r| r.key.clone()));
        Ok(Page::records(fresh))
    }
}

/// Given keys, read one by one through [`Ledger::get`], oldest record first
/// within each page: how to reconcile stuck leases you know of (from an
/// alert, a dead-letter queue, a log query) while the ledger cannot list
/// them. Records that are not in doubt are skipped.
#[derive(Debug, Clone)]
pub struct Keys {
    keys: std::vec::IntoIter<EffectKey>,
}

impl Keys {
    /// These keys (a key given twice is examined once).
    pub fn new(keys: impl IntoIterator<Item = EffectKey>) -> Self {
        let mut seen = HashSet::new();
        let keys: Vec<EffectKey> = keys.into_iter().filter(|k| seen.insert(k.clone())).collect();
        Keys {
            keys: keys.into_iter(),
        }
    }
}

impl<L: Ledger + ?Sized> Source<L> for Keys {
    async fn next_page(&mut self, ledger: &L, limit: usize) -> Result<Page> {
        let mut page = Page::default();
        for key in self.keys.by_ref().take(limit) {
            match ledger.get(&key).await? {
                Some(record) => page.records.push(record),
                None => page.absent.push(key),
            }
        }
        page.records.sort_by_key(|r| r.created_at);
        Ok(page)
    }
}

/// One source until it runs dry, then another: stuck leases you know of
/// after a tenant's abandoned steps, for one [`Report`].
#[derive(Debug, Clone)]
pub struct Chain<A, B> {
    first: Option<A>,
    second: B,
}

impl<A, B> Chain<A, B> {
    /// `first`, then `second`.
    pub fn new(first: A, second: B) -> Self {
        Chain {
            first: Some(first),
            second,
        }
    }
}

impl<L: Ledger + ?Sized, A: Source<L>, B: Source<L>> Source<L> for Chain<A, B> {
    async fn next_page(&mut self, ledger: &L, limit: usize) -> Result<Page> {
        if let Some(first) = self.first.as_mut() {
            let page = first.next_page(ledger, limit).await?;
            if !page.records.is_empty() || !page.absent.is_empty() {
                return Ok(page);
            }
            self.first = None;
        }
        self.second.next_page(ledger, limit).await
    }
}

/// The records an [`Admin`] query lists, page after page with its cursor:
/// [`Query::stuck`] and [`Query::abandoned`] list a tenant's stuck leases
/// and abandoned steps; [`Query::new`] takes any narrower or wider query
/// (one kind, records since an instant, every tenant). A record settled
/// during the run falls out of the query while the cursor moves past it,
/// so each is examined once, oldest first, at one query per page.
#[derive(Debug, Clone)]
pub struct Query {
    query: RecordQuery,
    done: bool,
}

impl Query {
    /// The records `query` lists (its `after` is where the run starts; its
    /// `limit` is replaced by the run's batch size, at most
    /// [`MAX_PAGE`]).
    pub fn new(query: RecordQuery) -> Self {
        Query { query, done: false }
    }

    /// The stuck leases of `tenant` ([`Filter::Stuck`]).
    pub fn stuck(tenant: &Tenant) -> Self {
        Query::new(RecordQuery::tenant(tenant).filter(Filter::Stuck))
    }

    /// The abandoned steps of `tenant` ([`Filter::Abandoned`]).
    pub fn abandoned(tenant: &Tenant) -> Self {
        Query::new(RecordQuery::tenant(tenant).filter(Filter::Abandoned))
    }
}

impl<L: Admin + ?Sized> Source<L> for Query {
    async fn next_page(&mut self, ledger: &L, limit: usize) -> Result<Page> {
        if self.done || limit == 0 {
            return Ok(Page::default());
        }
        let n = u32::try_from(limit).unwrap_or(u32::MAX).min(MAX_PAGE);
        let query = self.query.clone().limit(n);
        let records = ledger.records(&query).await?;
        match records.last() {
            Some(last) if records.len() >= n as usize => {
                self.query = self.query.clone().after(Some(Cursor::after(last)));
            }
            _ => self.done = true,
        }
        Ok(Page::records(records))
    }
}

/// What became of one examined record.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Resolution {
    /// Completed with the provider's outcome (in a dry run: would be).
    Completed,
    /// Released for a retry (in a dry run: would be).
    Released,
    /// The provider could not tell; nothing was written.
    Unknown,
    /// The record moved on between the listing and the write (completed,
    /// released or taken over by someone else); nothing was overwritten.
    Moved,
    /// Not in doubt when read (completed, released, a live lease, a lease
    /// that ended within [`Reconcile::grace`], or no record at all);
    /// nothing was asked or written.
    Skipped,
    /// The provider or the ledger failed; the record is as it was (or, for
    /// a stuck lease taken over, will be stuck again when the reconciler's
    /// lease ends).
    Error(String),
}

impl Resolution {
    /// `completed`, `released`, `unknown`, `moved`, `skipped` or `error`
    /// (metric and span label).
    pub fn as_str(&self) -> &'static str {
        match self {
            Resolution::Completed => "completed",
            Resolution::Released => "released",
            Resolution::Unknown => "unknown",
            Resolution::Moved => "moved",
            Resolution::Skipped => "skipped",
            Resolution::Error(_) => "error",
        }
    }
}

/// One examined record in a [`Report`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Entry {
    /// The effect key.
    pub key: EffectKey,
    /// Why it was in doubt (`None`: it was not, or there was no record).
    pub doubt: Option<Doubt>,
    /// The record's fence when it was read (0 when there was no record).
    pub fence: u64,
    /// What became of it.
    pub resolution: Resolution,
}

/// What a run did (in a dry run: what it would have done). `examined` is
/// the sum of the other counts.
///
/// As JSON (`Serialize`): the counts, `dry_run` and `aborted`, not the
/// entries, which a tool prints with what it knows of each (the `oncely`
/// command adds its check command's answers).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Report {
    /// Whether this was a dry run (nothing was written).
    pub dry_run: bool,
    /// Records (and absent keys) looked at.
    pub examined: u64,
    /// Completed with the provider's outcome.
    pub completed: u64,
    /// Released for a retry.
    pub released: u64,
    /// Left as they were because the provider could not tell.
    pub unknown: u64,
    /// Moved on between the listing and the write; left alone.
    pub moved: u64,
    /// Not in doubt when read, within the grace, or absent; left alone.
    pub skipped: u64,
    /// The provider or the ledger failed on them; left as they were.
    pub errors: u64,
    /// Every examined record, in the order examined.
    #[serde(skip)]
    pub entries: Vec<Entry>,
    /// Why the run stopped early: the listing failed (the records examined
    /// before are in the report). `None`: the run went through.
    pub aborted: Option<String>,
}

impl Report {
    fn add(&mut self, entry: Entry) {
        self.examined += 1;
        let count = match entry.resolution {
            Resolution::Completed => &mut self.completed,
            Resolution::Released => &mut self.released,
            Resolution::Unknown => &mut self.unknown,
            Resolution::Moved => &mut self.moved,
            Resolution::Skipped => &mut self.skipped,
            Resolution::Error(_) => &mut self.errors,
        };
        *count += 1;
        self.entries.push(entry);
    }

    /// The entry of `key`, if it was examined.
    pub fn entry(&self, key: &EffectKey) -> Option<&Entry> {
        self.entries.iter().find(|e| &e.key == key)
    }
}

/// A reconciliation run: pages through doubtful records, asks a
/// [`Reconciler`] about each, and applies the answers through fenced writes
/// (see the [module docs](self)).
///
/// Defaults: pages of 100, no record limit, no rate limit, not a dry run,
/// no grace, and stuck leases taken over with a 30 s lease and the default retention
/// of [`ClaimOptions`] (the retention the record keeps once completed or
/// released).
pub struct Reconcile<'a, L: ?Sized, R: ?Sized> {
    ledger: &'a L,
    reconciler: &'a R,
    batch_size: usize,
    max_records: Option<u64>,
    rate_limit: Option<f64>,
    dry_run: bool,
    grace: Duration,
    claim: ClaimOptions,
}

// By hand: derived impls would ask the ledger and the reconciler to be
// `Clone` and `Debug`, and only references to them are held.
impl<L: ?Sized, R: ?Sized> Clone for Reconcile<'_, L, R> {
    fn clone(&self) -> Self {
        Reconcile {
            claim: self.claim.clone(),
            ..*self
        }
    }
}

impl<L: ?Sized, R: ?Sized> std::fmt::Debug for Reconcile<'_, L, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconcile")
            .field("batch_size", &self.batch_size)
            .field("max_records", &self.max_records)
            .field("rate_limit", &self.rate_limit)
            .field("dry_run", &self.dry_run)
            .field("grace", &self.grace)
            .field("claim", &self.claim)
            .finish_non_exhaustive()
    }
}

impl<'a, L: Ledger + ?Sized, R: Reconciler + ?Sized> Reconcile<'a, L, R> {
    /// A run over `ledger` asking `reconciler`.
    pub fn new(ledger: &'a L, reconciler: &'a R) -> Self {
        Reconcile {
            ledger,
            reconciler,
            batch_size: 100,
            max_records: None,
            rate_limit: None,
            dry_run: false,
            grace: Duration::ZERO,
            claim: ClaimOptions::default(),
        }
    }

    /// Leaves alone (as [`Resolution::Skipped`], nothing asked) the records
    /// whose lease ended less than `grace` before they were read, on the
    /// backend's clock: a worker that stalled past its lease may still be
    /// about to call the provider (see the [module docs](self)). Default:
    /// zero, every ended lease is in doubt.
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// How many records each page asks the source for (at least 1).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// Stops after examining `n` records.
    pub fn max_records(mut self, n: u64) -> Self {
        self.max_records = Some(n);
        self
    }

    /// Examines at most `per_second` records per second (the provider's
    /// rate limit, the ledger's load); it must be positive and finite, or
    /// the run fails with [`Error::InvalidInput`] before any round trip.
    pub fn rate_limit(mut self, per_second: f64) -> Self {
        self.rate_limit = Some(per_second);
        self
    }

    /// Asks the reconciler but writes nothing: the report says what the run
    /// would have done.
    pub fn dry_run(mut self, yes: bool) -> Self {
        self.dry_run = yes;
        self
    }

    /// The options of the claim that takes a stuck lease over: its lease
    /// (long enough for one write) and retention (what the record keeps
    /// once completed or released). `at_most_once`, `fingerprint` and
    /// `sent_at` are ignored: the claim is not at-most-once, carries the
    /// record's own fingerprint, and no `sent_at`.
    pub fn claim_options(mut self, opts: ClaimOptions) -> Self {
        self.claim = opts;
        self
    }

    /// Reconciles the abandoned at-most-once steps of `tenant`
    /// ([`Abandoned`]).
    pub async fn abandoned(&self, tenant: &Tenant) -> Result<Report> {
        self.run(Abandoned::new(tenant)).await
    }

    /// Reconciles the records of these keys, stuck leases and abandoned
    /// steps alike ([`Keys`]); the others are skipped.
    pub async fn keys(&self, keys: impl IntoIterator<Item = EffectKey>) -> Result<Report> {
        self.run(Keys::new(keys)).await
    }

    /// Reconciles what `source` lists. Fails only if the options are
    /// invalid ([`Error::InvalidInput`], before any round trip). A record
    /// that fails is counted in [`Report::errors`] and the run goes on; a
    /// listing that fails stops the run, which returns what it did so far
    /// with [`Report::aborted`] set.
    pub async fn run<S: Source<L>>(&self, mut source: S) -> Result<Report> {
        let mut claim = self.claim.clone();
        claim.at_most_once = false;
        claim.fingerprint = None;
        claim.sent_at = None;
        claim.validate()?;
        let mut pace = match self.rate_limit {
            Some(r) if r.is_finite() && r > 0.0 => {
                let period = Duration::try_from_secs_f64(1.0 / r).unwrap_or(Duration::MAX);
                // A rate too high to measure is no limit (and a zero period
                // would make the interval panic).
                (!period.is_zero()).then(|| {
                    let mut i = tokio::time::interval(period);
                    i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    i
                })
            }
            Some(r) => {
                return Err(Error::InvalidInput(format!(
                    "rate limit must be a positive number of records per second, got {r}"
                )));
            }
            None => None,
        };
        let mut report = Report {
            dry_run: self.dry_run,
            ..Report::default()
        };
        let span = telemetry::reconcile_run_span(self.ledger.backend(), self.dry_run);
        async {
            loop {
                let left = match self.max_records {
                    Some(max) => max.saturating_sub(report.examined),
                    None => u64::MAX,
                };
                if left == 0 {
                    break;
                }
                let limit = usize::try_from(left).unwrap_or(usize::MAX).min(self.batch_size);
                let page = match source.next_page(self.ledger, limit).await {
                    Ok(page) => page,
                    Err(e) => {
                        // What was written so far stays in the report.
                        tracing::warn!(error = %e, "listing failed; reconciliation run stopped");
                        report.aborted = Some(e.to_string());
                        break;
                    }
                };
                if page.records.is_empty() && page.absent.is_empty() {
                    break;
                }
                for key in page.absent {
                    if report.examined >= self.max_records.unwrap_or(u64::MAX) {
                        break;
                    }
                    telemetry::reconciled(&key, None, Resolution::Skipped.as_str(), self.dry_run);
                    report.add(Entry {
                        key,
                        doubt: None,
                        fence: 0,
                        resolution: Resolution::Skipped,
                    });
                }
                for record in page.records {
                    if report.examined >= self.max_records.unwrap_or(u64::MAX) {
                        break;
                    }
                    if let Some(pace) = pace.as_mut() {
                        pace.tick().await;
                    }
                    report.add(self.one(record, &claim).await);
                }
            }
        }
        .instrument(span)
        .await;
        Ok(report)
    }

    /// Examines one record, in its own span.
    async fn one(&self, record: Record, claim: &ClaimOptions) -> Entry {
        let doubt = Doubt::of(&record);
        let span = telemetry::reconcile_span(&record.key, record.fence, doubt.map(Doubt::as_str));
        let resolution = self.resolve(&record, doubt, claim).instrument(span.clone()).await;
        span.record("result", resolution.as_str());
        telemetry::reconciled(
            &record.key,
            doubt.map(Doubt::as_str),
            resolution.as_str(),
            self.dry_run,
        );
        Entry {
            key: record.key,
            doubt,
            fence: record.fence,
            resolution,
        }
    }

    async fn resolve(&self, record: &Record, doubt: Option<Doubt>, claim: &ClaimOptions) -> Resolution {
        let Some(doubt) = doubt else {
            return Resolution::Skipped;
        };
        if let Some(ended) = record.lease_expires_at
            && ended
                .checked_add(self.grace)
                .is_none_or(|safe| record.read_at < safe)
        {
            return Resolution::Skipped;
        }
        let verdict = match self.reconciler.check(record, doubt).await {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(effect_key = %record.key, error = %e, "reconciler failed; record left as it was");
                return Resolution::Error(format!("reconciler: {e}"));
            }
        };
        tracing::Span::current().record("verdict", verdict.as_str());
        let done = match verdict {
            Verdict::Unknown => return Resolution::Unknown,
            Verdict::Done(outcome) => Some(outcome),
            Verdict::NotDone => None,
        };
        if self.dry_run {
            return if done.is_some() {
                Resolution::Completed
            } else {
                Resolution::Released
            };
        }
        let lease = match doubt {
            // The record's own fence: a write fails if anyone moved it on.
            Doubt::Abandoned => record.reconciliation_lease(),
            // Never a write with a guessed lease: the backend decides the
            // takeover atomically, and fences out the stalled holder.
            Doubt::Stuck => match self.takeover(record, claim).await {
                Ok(Claim::Acquired(lease)) if lease.taken_over() => lease,
                Ok(Claim::Acquired(lease)) => {
                    // The record vanished (completed, then pruned) and this
                    // claim inserted a fresh one: give it back untouched.
                    if let Err(e) = self.ledger.release(&lease).await {
                        tracing::warn!(effect_key = %record.key, error = %e,
                            "could not give back a fresh claim; it will expire");
                    }
                    return Resolution::Moved;
                }
                Ok(other) => {
                    tracing::info!(effect_key = %record.key, claim = other.label(),
                        "stuck lease moved on before reconciliation; left alone");
                    return Resolution::Moved;
                }
                Err(e) => return Resolution::Error(format!("takeover claim: {e}")),
            },
        };
        tracing::Span::current().record("fence", lease.fence());
        self.write(&lease, doubt, done).await
    }

    /// The claim that takes a stuck lease over, counted like every claim
    /// (`oncely_claims_total`, and `oncely_lease_takeovers_total` when it
    /// takes over).
    async fn takeover(&self, record: &Record, claim: &ClaimOptions) -> Result<Claim> {
        let opts = ClaimOptions {
            // The record's own: a key reused for another payload since the
            // listing fails the claim instead of being settled.
            fingerprint: record.fingerprint,
            ..claim.clone()
        };
        let started = std::time::Instant::now();
        let answer = self.ledger.claim(&record.key, &opts).await?;
        telemetry::claim_recorded(
            self.ledger.backend(),
            &record.key,
            answer.label(),
            started.elapsed(),
        );
        Ok(answer)
    }

    async fn write(&self, lease: &Lease, doubt: Doubt, done: Option<Outcome>) -> Resolution {
        let (result, resolution) = match &done {
            Some(outcome) => (self.ledger.complete(lease, outcome).await, Resolution::Completed),
            None => (self.ledger.release(lease).await, Resolution::Released),
        };
        match result {
            Ok(()) => resolution,
            Err(Error::LeaseLost { .. }) => {
                telemetry::fence_rejected(lease.key());
                tracing::info!(effect_key = %lease.key(), fence = lease.fence(),
                    "record moved on before the reconciliation write; nothing overwritten");
                Resolution::Moved
            }
            Err(e) => {
                if doubt == Doubt::Stuck && done.is_some() {
                    // Our takeover lease would otherwise sit until it ends;
                    // released, the next delivery re-runs the step with the
                    // same provider key and the provider answers it.
                    let _ = self.ledger.release(lease).await;
                }
                Resolution::Error(format!("{}: {e}", resolution.as_str()))
            }
        }
    }
}

impl<L: Admin + ?Sized, R: Reconciler + ?Sized> Reconcile<'_, L, R> {
    /// Reconciles every doubtful record of `tenant` through the
    /// [`Admin`] listing: its stuck leases, then its abandoned steps, each
    /// oldest first ([`Query::stuck`], [`Query::abandoned`]).
    pub async fn doubtful(&self, tenant: &Tenant) -> Result<Report> {
        self.run(Chain::new(Query::stuck(tenant), Query::abandoned(tenant)))
            .await
    }

    /// Reconciles the stuck leases of `tenant` ([`Query::stuck`]).
    pub async fn stuck(&self, tenant: &Tenant) -> Result<Report> {
        self.run(Query::stuck(tenant)).await
    }
}

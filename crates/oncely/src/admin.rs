//! The operator's view of a ledger: list records across a tenant (or all
//! tenants), count them per kind, deliberately let a completed effect run
//! again, and erase a subject's stored outcomes on a data-protection request
//! without letting its effects run again ([`Admin::erase`]). An optional capability, separate from [`Ledger`]: the SQL backends
//! and [`MemoryLedger`](crate::MemoryLedger) implement it; Redis and NATS
//! JetStream KV do not (their stores have no secondary index to list or
//! count records by tenant and kind without scanning every key), and the
//! `oncely` command says so when asked on those backends.
//!
//! Everything here is decided on the backend's clock, read by the same
//! statement that reads the records: a lease is live strictly before its
//! `lease_expires_at` ([`backend::lease_live`](crate::backend::lease_live)).
//!
//! | what an operator sees | stored as | [`Filter`] |
//! | --- | --- | --- |
//! | live | in progress, lease not ended | [`Filter::Live`] |
//! | stuck | in progress, lease ended, **not** at-most-once: the next claim takes it over with `fence + 1` | [`Filter::Stuck`] |
//! | abandoned | in progress, lease ended, at-most-once: never re-run automatically, reconcile it | [`Filter::Abandoned`] |
//! | completed | completed, outcome stored | [`Filter::State`]`(Completed)` |
//! | released | released, the next claim takes it over | [`Filter::State`]`(Released)` |
//!
//! Duplicates suppressed are **not** stored: a duplicate of a completed
//! effect is a read, not a write, by design (one round trip, nothing
//! written). Count them with the
//! [`oncely_duplicates_suppressed_total`](crate::telemetry::DUPLICATES_SUPPRESSED_TOTAL)
//! metric (tools that print [`KindStats`] should say so, as `oncely stats`
//! does).

use std::future::Future;
use std::time::SystemTime;

use crate::error::Result;
use crate::key::{EffectKey, Tenant};
use crate::ledger::Ledger;
use crate::record::{Outcome, Record, RecordState};

/// The largest page [`Admin::records`] returns; a larger
/// [`RecordQuery::limit`] is cut to it.
pub const MAX_PAGE: u32 = 1000;

/// Which records [`Admin::records`] lists, judged on the backend's clock when
/// the query runs (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Filter {
    /// Every record.
    #[default]
    Any,
    /// Records whose state, as [`Ledger::get`] reports it, is this one:
    /// `InProgress` is live and stuck leases (an expired at-most-once lease
    /// reports `Abandoned`).
    State(RecordState),
    /// In progress with a lease that has not ended.
    Live,
    /// In progress, lease ended, not at-most-once: a worker died or stalled
    /// and nobody has claimed the key since. The next claim takes it over
    /// (with `fence + 1`); an operator can resolve it meanwhile.
    Stuck,
    /// At-most-once, lease ended before completion: never re-run
    /// automatically; reconcile it (same as `State(Abandoned)`).
    Abandoned,
}

/// Where a page of [`Admin::records`] starts: strictly after this record in
/// the listing order (`created_at`, then the displayed key, byte order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// The last listed record's `created_at`.
    pub created_at: SystemTime,
    /// The last listed record's key.
    pub key: EffectKey,
}

impl Cursor {
    /// The cursor after `record` (the last of a page).
    pub fn after(record: &Record) -> Self {
        Cursor {
            created_at: record.created_at,
            key: record.key.clone(),
        }
    }
}

/// What [`Admin::records`] lists: the filters (all optional, combined with
/// AND), a cursor and a page size. `RecordQuery::default()` lists the first
/// [`MAX_PAGE`] records of every tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordQuery {
    /// One tenant, or `None` for every tenant (an operator view across
    /// tenants: callers ask for it explicitly).
    pub tenant: Option<Tenant>,
    /// One kind (`capture`).
    pub kind: Option<String>,
    /// One subject (`order-123`), exactly.
    pub subject: Option<String>,
    /// Which states.
    pub filter: Filter,
    /// Only records created at or after this instant.
    pub since: Option<SystemTime>,
    /// Start after this record ([`Cursor::after`] the last of the previous
    /// page).
    pub after: Option<Cursor>,
    /// At most this many records (1 to [`MAX_PAGE`]; 0 and larger values are
    /// read as [`MAX_PAGE`]).
    pub limit: u32,
}

impl Default for RecordQuery {
    fn default() -> Self {
        RecordQuery {
            tenant: None,
            kind: None,
            subject: None,
            filter: Filter::Any,
            since: None,
            after: None,
            limit: MAX_PAGE,
        }
    }
}

impl RecordQuery {
    /// Every record of every tenant (set the filters with the builders).
    pub fn all_tenants() -> Self {
        RecordQuery::default()
    }

    /// The records of one tenant.
    pub fn tenant(tenant: &Tenant) -> Self {
        RecordQuery {
            tenant: Some(tenant.clone()),
            ..RecordQuery::default()
        }
    }

    /// Only this kind.
    pub fn kind(mut self, kind: impl Into<String>) -> Self {
        self.kind = Some(kind.into());
        self
    }

    /// Only this subject.
    pub fn subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = Some(subject.into());
        self
    }

    /// Only these states.
    pub fn filter(mut self, filter: Filter) -> Self {
        self.filter = filter;
        self
    }

    /// Only records created at or after `at`.
    pub fn since(mut self, at: SystemTime) -> Self {
        self.since = Some(at);
        self
    }

    /// Start after this cursor.
    pub fn after(mut self, cursor: Option<Cursor>) -> Self {
        self.after = cursor;
        self
    }

    /// At most `n` records (see [`RecordQuery::limit`](#structfield.limit)).
    pub fn limit(mut self, n: u32) -> Self {
        self.limit = n;
        self
    }

    /// The page size in effect: [`RecordQuery::limit`](#structfield.limit)
    /// bounded to 1..=[`MAX_PAGE`].
    pub fn page_size(&self) -> u32 {
        if self.limit == 0 {
            MAX_PAGE
        } else {
            self.limit.min(MAX_PAGE)
        }
    }

    /// Whether `record` (its state already made effective, read at `now` on
    /// the backend's clock) passes every filter and lies after the cursor:
    /// the rule every backend's query restates, written once (the memory
    /// ledger and the conformance suite use it).
    pub fn matches(&self, record: &Record, now: SystemTime) -> bool {
        let k = &record.key;
        self.tenant.as_ref().is_none_or(|t| k.tenant() == t)
            && self.kind.as_deref().is_none_or(|x| k.kind() == x)
            && self.subject.as_deref().is_none_or(|x| k.subject() == x)
            && self.since.is_none_or(|s| record.created_at >= s)
            && self.after.as_ref().is_none_or(|c| {
                (record.created_at, k.as_str().as_bytes()) > (c.created_at, c.key.as_str().as_bytes())
            })
            && classify(record, now).is_some_and(|class| self.filter.admits(record.state, class))
    }
}

impl Filter {
    fn admits(self, state: RecordState, class: Class) -> bool {
        match self {
            Filter::Any => true,
            Filter::State(s) => s == state,
            Filter::Live => class == Class::Live,
            Filter::Stuck => class == Class::Stuck,
            Filter::Abandoned => class == Class::Abandoned,
        }
    }
}

/// The five classes of [`KindStats`], one per record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    Live,
    Stuck,
    Abandoned,
    Completed,
    Released,
}

/// The class of a record whose state is already effective, at `now`.
pub(crate) fn classify(r: &Record, now: SystemTime) -> Option<Class> {
    Some(match r.state {
        RecordState::Completed => Class::Completed,
        RecordState::Released => Class::Released,
        RecordState::Abandoned => Class::Abandoned,
        RecordState::InProgress if crate::time::lease_live(r.lease_expires_at, now) => Class::Live,
        RecordState::InProgress if r.at_most_once => Class::Abandoned,
        RecordState::InProgress => Class::Stuck,
    })
}

/// The records of one tenant and kind, counted by what an operator sees,
/// on the backend's clock at [`KindStats::read_at`].
///
/// Duplicates suppressed are not here: they are reads, never stored (see
/// the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KindStats {
    /// The tenant.
    pub tenant: Tenant,
    /// The kind.
    pub kind: String,
    /// In progress with a live lease.
    pub live: u64,
    /// In progress, lease ended, not at-most-once ([`Filter::Stuck`]).
    pub stuck: u64,
    /// At-most-once, lease ended ([`Filter::Abandoned`]).
    pub abandoned: u64,
    /// Completed.
    pub completed: u64,
    /// Released (including forgotten effects, see [`Admin::forget`]).
    pub released: u64,
    /// The oldest `created_at` among the live ones.
    pub oldest_live: Option<SystemTime>,
    /// The oldest `created_at` among the stuck ones.
    pub oldest_stuck: Option<SystemTime>,
    /// The oldest `created_at` among the abandoned ones.
    pub oldest_abandoned: Option<SystemTime>,
    /// The backend's clock when the counts were taken.
    pub read_at: SystemTime,
}

impl KindStats {
    /// Empty counts for a tenant and kind, read at `read_at` (backends fill
    /// the fields in).
    pub fn new(tenant: Tenant, kind: impl Into<String>, read_at: SystemTime) -> Self {
        KindStats {
            tenant,
            kind: kind.into(),
            live: 0,
            stuck: 0,
            abandoned: 0,
            completed: 0,
            released: 0,
            oldest_live: None,
            oldest_stuck: None,
            oldest_abandoned: None,
            read_at,
        }
    }

    /// Every record counted.
    pub fn total(&self) -> u64 {
        self.live + self.stuck + self.abandoned + self.completed + self.released
    }

    /// Counts one record (its state already effective) read at `now`: how the
    /// memory ledger and the conformance suite build stats from records.
    pub fn count(&mut self, r: &Record, now: SystemTime) {
        let oldest = |slot: &mut Option<SystemTime>| {
            *slot = Some(slot.map_or(r.created_at, |o| o.min(r.created_at)));
        };
        match classify(r, now) {
            Some(Class::Live) => {
                self.live += 1;
                oldest(&mut self.oldest_live);
            }
            Some(Class::Stuck) => {
                self.stuck += 1;
                oldest(&mut self.oldest_stuck);
            }
            Some(Class::Abandoned) => {
                self.abandoned += 1;
                oldest(&mut self.oldest_abandoned);
            }
            Some(Class::Completed) => self.completed += 1,
            Some(Class::Released) => self.released += 1,
            None => {}
        }
    }
}

/// What [`Admin::erase`] did to one subject's records, on the backend's
/// clock at [`Erasure::at`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Erasure {
    /// The completed and released records of the subject: they hold no
    /// outcome and no fingerprint now (whether this call or an earlier one
    /// removed them). A completed one answers every later claim with
    /// [`Error::Erased`](crate::Error::Erased).
    pub erased: Vec<EffectKey>,
    /// The subject's records in progress (a live lease, a stuck one, an
    /// abandoned at-most-once step), left unchanged: their holder (or the
    /// reconciliation) may still store an outcome. Erase again once they
    /// are settled.
    pub pending: Vec<EffectKey>,
    /// The subject's outbox messages ([`outbox`](crate::outbox)) that the
    /// relay is done with (sent, or failed for good): their payload,
    /// headers, ordering key and last error are empty now (whether this
    /// call or an earlier one emptied them). Their key, state and times
    /// stay; [`Outbox::prune_sent`](crate::outbox::Outbox::prune_sent)
    /// deletes sent ones as before.
    pub messages: Vec<EffectKey>,
    /// The subject's outbox messages not sent yet, left unchanged: the
    /// relay still has to deliver them. Erase again once they are sent.
    pub messages_pending: Vec<EffectKey>,
    /// The backend's clock when the erasure was written.
    pub at: SystemTime,
}

impl Erasure {
    /// An erasure at `at` that found nothing (backends fill the lists in).
    pub fn new(at: SystemTime) -> Self {
        Erasure {
            erased: Vec::new(),
            pending: Vec::new(),
            messages: Vec::new(),
            messages_pending: Vec::new(),
            at,
        }
    }

    /// Lists `key` by its `state`: erased when [`erasable`], pending
    /// otherwise; returns whether it is erasable (the record's outcome and
    /// fingerprint are to be removed). How every backend sorts what it found.
    pub fn add(&mut self, key: EffectKey, state: RecordState) -> bool {
        let erasable = erasable(state);
        if erasable {
            self.erased.push(key);
        } else {
            self.pending.push(key);
        }
        erasable
    }

    /// Lists the outbox message `key` (stored in the outbox state `state`:
    /// `pending`, `sent` or `failed`) as emptied or pending; returns whether
    /// it is to be emptied (the relay is done with it). `None` when the
    /// message is not `subject`'s (a backend's subject match is a text
    /// expression; this is the check on the parsed key) or the key does not
    /// parse. How every backend sorts the messages it found.
    pub fn add_message(&mut self, key: &str, subject: &str, state: &str) -> Option<bool> {
        let key = EffectKey::parse(key).ok().filter(|k| k.subject() == subject)?;
        let done = state != "pending";
        if done {
            self.messages.push(key);
        } else {
            self.messages_pending.push(key);
        }
        Some(done)
    }

    /// Sorts the outbox rows an erasure found, each `(id, key, state)` as
    /// the backend reads it, with [`Erasure::add_message`]; returns the ids
    /// of the messages to empty. A row that cannot be read fails the whole
    /// erasure (its transaction is not committed).
    pub fn add_messages<I>(
        &mut self,
        rows: impl IntoIterator<Item = Result<(I, String, String)>>,
        subject: &str,
    ) -> Result<Vec<I>> {
        let mut ids = Vec::new();
        for row in rows {
            let (id, key, state) = row?;
            if self.add_message(&key, subject, &state) == Some(true) {
                ids.push(id);
            }
        }
        Ok(ids)
    }

    /// Whether every record and outbox message of the subject is erased
    /// (none is pending).
    pub fn is_complete(&self) -> bool {
        self.pending.is_empty() && self.messages_pending.is_empty()
    }

    /// The lists in key order (backends return rows in no set order).
    pub fn sorted(mut self) -> Self {
        for list in [
            &mut self.erased,
            &mut self.pending,
            &mut self.messages,
            &mut self.messages_pending,
        ] {
            list.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        }
        self
    }
}

/// Whether [`Admin::erase`] removes a record's outcome and fingerprint now
/// (completed or released), rather than leaving it pending (in progress:
/// live, stuck or abandoned, whose holder or reconciliation may still store
/// an outcome). The rule every backend's statement restates, written once.
pub fn erasable(state: RecordState) -> bool {
    matches!(state, RecordState::Completed | RecordState::Released)
}

/// Operator capabilities of a ledger, beyond the [`Ledger`] contract: list,
/// count, and deliberately forget. Implemented by the SQL backends and
/// [`MemoryLedger`](crate::MemoryLedger); not by Redis or NATS (see the
/// [module docs](self)). Proven by the admin conformance cases
/// ([`admin_conformance_tests!`](crate::conformance::admin_conformance_tests), feature
/// `conformance`).
///
/// Rules every implementation follows:
/// - reads write nothing and work on a ledger opened read-only;
/// - states are judged on the backend's clock read by the same statement
///   ([`Filter`]);
/// - [`Admin::records`] lists oldest first (`created_at`, then the displayed
///   key in byte order), at most [`RecordQuery::page_size`] records after the
///   cursor: paging with [`Cursor::after`] the last record lists each record
///   that exists throughout exactly once;
/// - [`Admin::forget`] is one fenced conditional write, never a delete and
///   never a read followed by an unconditional write.
pub trait Admin: Ledger {
    /// Lists records, oldest first, one page at a time.
    fn records(&self, query: &RecordQuery) -> impl Future<Output = Result<Vec<Record>>> + Send;

    /// Counts records per tenant and kind (one tenant, or all with `None`),
    /// ordered by tenant, then kind. Kinds without records are absent.
    fn stats(&self, tenant: Option<&Tenant>) -> impl Future<Output = Result<Vec<KindStats>>> + Send;

    /// Lets a completed effect run again, on purpose (an operator decided its
    /// outcome is wrong and the effect must be redone).
    ///
    /// One fenced conditional write: the record, if it is completed **at
    /// exactly `fence`**, becomes [`RecordState::Released`] with its outcome
    /// removed, kept (not deleted) for its retention counted from now. The
    /// next claim takes it over with a fence above `fence`, so fences stay
    /// above every earlier one without relying on the clock (a delete would),
    /// and the business writes of the earlier run, fenced with `fence`, can be
    /// told from the new run's. The request fingerprint stays: the effect runs
    /// again for the same request (another payload is still refused).
    ///
    /// Refused, changing nothing:
    /// [`Error::NotFound`](crate::Error::NotFound) when there is no record;
    /// [`Error::LeaseLost`](crate::Error::LeaseLost) when its fence is not
    /// `fence` (it moved on since the caller read it);
    /// [`Error::InProgress`](crate::Error::InProgress) for a live lease;
    /// [`Error::NotCompleted`](crate::Error::NotCompleted) for any other
    /// state (released, stuck, abandoned: resolve those instead).
    fn forget(&self, key: &EffectKey, fence: u64) -> impl Future<Output = Result<()>> + Send;

    /// How many records [`Ledger::prune`] would delete now (completed or
    /// released, past their retention), deleting nothing: a dry run.
    fn prunable(&self) -> impl Future<Output = Result<u64>> + Send;

    /// Erases what the ledger holds of one subject's requests and results,
    /// now, on a data-protection request (a right-to-erasure), without
    /// reopening the subject's effects.
    ///
    /// Every record of `tenant` whose subject is exactly `subject` (any
    /// kind), completed or released ([`erasable`]), loses its stored
    /// outcome and its request fingerprint, in one statement (or one
    /// transaction). What the guarantee needs stays: the key, the state,
    /// the fence, `created_at` and the retention, so
    /// - a duplicate of an erased **completed** effect fails with
    ///   [`Error::Erased`](crate::Error::Erased): never a re-run, never the
    ///   erased value ([`Record::is_erased`]);
    /// - a released one is taken over by the next claim with a higher fence,
    ///   as before (a release means "run it again");
    /// - fences keep growing across it, and prune deletes the record at the
    ///   end of its retention like any other.
    ///
    /// Records in progress are left unchanged and listed in
    /// [`Erasure::pending`]: a live holder (or a zombie past its lease, or
    /// the reconciliation of an abandoned step) may still store an outcome.
    /// Erase again once they are settled. Erasing twice is harmless.
    ///
    /// A ledger with an [`Outbox`](crate::outbox::Outbox) also empties, in
    /// the same transaction, the payload, headers, ordering key and last
    /// error of the subject's outbox messages that the relay is done with
    /// (sent, or failed for good; [`Erasure::messages`]), and lists the
    /// ones still to be sent in [`Erasure::messages_pending`], unchanged.
    fn erase(&self, tenant: &Tenant, subject: &str) -> impl Future<Output = Result<Erasure>> + Send;

    /// What [`Admin::erase`] would do now, writing nothing: a dry run. The
    /// same statements run in a transaction that is rolled back instead of
    /// committed (the subject's rows are locked for that long), so the
    /// lists, outbox messages included, are the ones `erase` would return
    /// at this moment, by the same rule. Needs a writable ledger, as
    /// `erase` does.
    fn erase_dry_run(&self, tenant: &Tenant, subject: &str) -> impl Future<Output = Result<Erasure>> + Send;

    /// Replaces the stored outcome of a completed record, at exactly
    /// `fence` and only while it still holds exactly `expected`, with
    /// `outcome`: one conditional write (what re-encrypting stored outcomes
    /// under a new key does). `Ok(true)` when it wrote; `Ok(false)`, having
    /// changed nothing, when the record is absent, not completed at `fence`,
    /// erased, or holds another outcome (someone moved it on meanwhile).
    fn replace_outcome(
        &self,
        key: &EffectKey,
        fence: u64,
        expected: &Outcome,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<bool>> + Send;
}

impl<A: Admin + ?Sized> Admin for &A {
    fn records(&self, query: &RecordQuery) -> impl Future<Output = Result<Vec<Record>>> + Send {
        (**self).records(query)
    }
    fn stats(&self, tenant: Option<&Tenant>) -> impl Future<Output = Result<Vec<KindStats>>> + Send {
        (**self).stats(tenant)
    }
    fn forget(&self, key: &EffectKey, fence: u64) -> impl Future<Output = Result<()>> + Send {
        (**self).forget(key, fence)
    }
    fn prunable(&self) -> impl Future<Output = Result<u64>> + Send {
        (**self).prunable()
    }
    fn erase(&self, tenant: &Tenant, subject: &str) -> impl Future<Output = Result<Erasure>> + Send {
        (**self).erase(tenant, subject)
    }
    fn erase_dry_run(&self, tenant: &Tenant, subject: &str) -> impl Future<Output = Result<Erasure>> + Send {
        (**self).erase_dry_run(tenant, subject)
    }
    fn replace_outcome(
        &self,
        key: &EffectKey,
        fence: u64,
        expected: &Outcome,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).replace_outcome(key, fence, expected, outcome)
    }
}

impl<A: Admin + ?Sized> Admin for std::sync::Arc<A> {
    fn records(&self, query: &RecordQuery) -> impl Future<Output = Result<Vec<Record>>> + Send {
        (**self).records(query)
    }
    fn stats(&self, tenant: Option<&Tenant>) -> impl Future<Output = Result<Vec<KindStats>>> + Send {
        (**self).stats(tenant)
    }
    fn forget(&self, key: &EffectKey, fence: u64) -> impl Future<Output = Result<()>> + Send {
        (**self).forget(key, fence)
    }
    fn prunable(&self) -> impl Future<Output = Result<u64>> + Send {
        (**self).prunable()
    }
    fn erase(&self, tenant: &Tenant, subject: &str) -> impl Future<Output = Result<Erasure>> + Send {
        (**self).erase(tenant, subject)
    }
    fn erase_dry_run(&self, tenant: &Tenant, subject: &str) -> impl Future<Output = Result<Erasure>> + Send {
        (**self).erase_dry_run(tenant, subject)
    }
    fn replace_outcome(
        &self,
        key: &EffectKey,
        fence: u64,
        expected: &Outcome,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).replace_outcome(key, fence, expected, outcome)
    }
}

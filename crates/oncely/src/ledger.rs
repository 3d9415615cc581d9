//! The backend contract.

use std::future::Future;
use std::time::{Duration, SystemTime};

use crate::error::Result;
use crate::key::{EffectKey, Tenant};
use crate::record::{Claim, ClaimOptions, Lease, Outcome, Record};
use crate::watch::Watch;

/// What a backend offers, declared so that callers and the conformance suite
/// can tell a missing capability from a bug. Backends build it with
/// [`Capabilities::new`] and the setters; callers read the fields.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Claims can join the caller's own database transaction
    /// (`claim_in` / `complete_in`), so a local write commits with its claim.
    pub caller_transaction: bool,
    /// What a completed record survives (one line, for docs and the CLI).
    pub durability: &'static str,
    /// Whether records are replicated to other machines before a claim returns.
    pub replicated: bool,
    /// Whose clock decides lease expiry and retention.
    pub clock: &'static str,
    /// Longest displayed effect key the backend stores, in bytes.
    pub max_key_bytes: usize,
    /// Largest outcome the backend stores, in bytes.
    pub max_outcome_bytes: usize,
    /// Whether gathering concurrent calls into one
    /// [`claim_many`](Ledger::claim_many) /
    /// [`complete_many`](Ledger::complete_many) measured faster than
    /// sending each on its own (`oncely bench`): the default of
    /// [`Effects::new`](crate::Effects::new), which
    /// [`Effects::coalescing`](crate::Effects::coalescing) overrides.
    pub coalescing: bool,
}

impl Capabilities {
    /// A backend whose records survive `durability` and whose `clock`
    /// decides expiry; no caller transaction, not replicated, no coalescing
    /// by default, and the core's key and outcome limits until the setters
    /// say otherwise.
    pub fn new(durability: &'static str, clock: &'static str) -> Self {
        Capabilities {
            caller_transaction: false,
            durability,
            replicated: false,
            clock,
            max_key_bytes: crate::key::MAX_KEY_BYTES,
            max_outcome_bytes: crate::record::MAX_OUTCOME_BYTES,
            coalescing: false,
        }
    }

    /// Sets [`Capabilities::coalescing`](#structfield.coalescing).
    pub fn coalescing(mut self, yes: bool) -> Self {
        self.coalescing = yes;
        self
    }

    /// Sets [`Capabilities::caller_transaction`](#structfield.caller_transaction).
    pub fn caller_transaction(mut self, yes: bool) -> Self {
        self.caller_transaction = yes;
        self
    }

    /// Sets [`Capabilities::replicated`](#structfield.replicated).
    pub fn replicated(mut self, yes: bool) -> Self {
        self.replicated = yes;
        self
    }

    /// Sets [`Capabilities::max_key_bytes`](#structfield.max_key_bytes) (at
    /// most the core's [`MAX_KEY_BYTES`](crate::key::MAX_KEY_BYTES)).
    pub fn max_key_bytes(mut self, n: usize) -> Self {
        self.max_key_bytes = n.min(crate::key::MAX_KEY_BYTES);
        self
    }

    /// Sets [`Capabilities::max_outcome_bytes`](#structfield.max_outcome_bytes)
    /// (at most the core's [`MAX_OUTCOME_BYTES`](crate::record::MAX_OUTCOME_BYTES)).
    pub fn max_outcome_bytes(mut self, n: usize) -> Self {
        self.max_outcome_bytes = n.min(crate::record::MAX_OUTCOME_BYTES);
        self
    }
}

/// An effect ledger: one implementation per backend crate.
///
/// Every method is one atomic operation on the backend (one round trip where
/// the backend allows it), decided by the backend's clock *at the moment the
/// write takes effect* (after any wait on a lock, never a statement's or a
/// transaction's start time), and cancel-safe: a dropped future never loses a
/// committed claim or leaves one half-written.
///
/// The rules every backend follows (the conformance suite checks each; the
/// shared decisions are written once in [`backend`](crate::backend)):
/// - `claim` on an absent key inserts an in-progress record whose fence is
///   [`next_fence`](crate::backend::next_fence)`(None, now)`: above every
///   fence the key ever had, even if its record was pruned. If
///   [`ClaimOptions::sent_at`] is at or before the ledger's horizon for the
///   key's tenant and kind ([`Ledger::horizon`]), it inserts nothing and fails
///   with [`Error::BeyondHorizon`](crate::Error::BeyondHorizon).
/// - `claim` on an existing key first compares fingerprints (both present and
///   different: [`Error::FingerprintMismatch`](crate::Error::FingerprintMismatch),
///   nothing changes); then a completed record answers [`Claim::Completed`], a
///   live lease [`Claim::InProgress`], an expired at-most-once lease
///   [`Claim::Abandoned`], and an expired lease or a released record is taken
///   over with [`next_fence`](crate::backend::next_fence)`(Some(fence), now)`
///   ([`answer_existing`](crate::backend::answer_existing)).
/// - A granted lease reports `acquired_at` as the clock when the grant was
///   written and never has less than half its length left then
///   ([`needs_refresh`](crate::backend::needs_refresh)): a claim that waited
///   on a lock must not hand out a lease that ended while it waited.
/// - `complete`, `release` and `renew` succeed only while the record is in
///   progress at the lease's fence (an expired lease that nobody took over
///   still counts); otherwise they fail with
///   [`Error::LeaseLost`](crate::Error::LeaseLost) and change nothing.
/// - `complete` and `release` keep the record until `now + retention` (the
///   retention given at claim time). `prune` deletes only completed and
///   released records past that point: never a lease, never an abandoned
///   step; and it raises the horizon of each tenant and kind it deletes from
///   to the newest `created_at` it deleted, before or atomically with the
///   delete.
pub trait Ledger: Send + Sync {
    /// The backend's name for metrics and spans (`memory`, `sqlite`, `postgres`…).
    fn backend(&self) -> &'static str;

    /// What this backend offers.
    fn capabilities(&self) -> Capabilities;

    /// Claims the effect atomically: the check and the claim are one operation.
    fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> impl Future<Output = Result<Claim>> + Send;

    /// Stores the outcome and marks the effect completed, fenced by the lease.
    fn complete(&self, lease: &Lease, outcome: &Outcome) -> impl Future<Output = Result<()>> + Send;

    /// Gives the key back so the next delivery retries, fenced by the lease.
    fn release(&self, lease: &Lease) -> impl Future<Output = Result<()>> + Send;

    /// Extends the lease to `now + extend_by` on the backend's clock, fenced.
    fn renew(&self, lease: &Lease, extend_by: Duration) -> impl Future<Output = Result<Lease>> + Send;

    /// Reads one record.
    fn get(&self, key: &EffectKey) -> impl Future<Output = Result<Option<Record>>> + Send;

    /// Deletes up to `limit` completed or released records past their
    /// retention; returns how many it deleted.
    fn prune(&self, limit: u64) -> impl Future<Output = Result<u64>> + Send;

    /// Lists up to `limit` abandoned at-most-once steps of a tenant, oldest
    /// first, for reconciliation.
    fn abandoned(&self, tenant: &Tenant, limit: u64) -> impl Future<Output = Result<Vec<Record>>> + Send;

    /// The horizon of a tenant and kind: the newest `created_at` among the
    /// records `prune` deleted there (or what else the backend knows it may
    /// have lost, such as a bucket's maximum age), on the backend's clock.
    /// `None`: nothing of this tenant and kind was ever pruned. A claim whose
    /// `sent_at` is at or before it fails with `BeyondHorizon` when its key
    /// is absent.
    fn horizon(&self, tenant: &Tenant, kind: &str)
    -> impl Future<Output = Result<Option<SystemTime>>> + Send;

    /// A subscription to changes of `key`'s record, taken when a claim found
    /// the effect in progress: the waiting duplicate is woken when the holder
    /// completes or releases, instead of polling. The default is a polling
    /// [`Watch`]; a backend with change notifications (an in-process
    /// [`Notifier`](crate::watch::Notifier), PostgreSQL `LISTEN`, Redis
    /// pub/sub, a NATS subject) returns a notified one. A lost notification
    /// costs latency, never a wrong answer: the runner claims again when the
    /// watch wakes, and again after a bounded fallback.
    fn watch(&self, key: &EffectKey) -> impl Future<Output = Watch> + Send {
        let _ = key;
        std::future::ready(Watch::polling())
    }

    /// Claims several keys, one answer per key in the order given, as if each
    /// were claimed on its own (a key listed twice: the first occurrence
    /// acquires, the second finds it in progress). Backends answer in one
    /// statement or one script call per slot where they can; the default
    /// claims one after the other.
    fn claim_many(
        &self,
        keys: &[EffectKey],
        opts: &ClaimOptions,
    ) -> impl Future<Output = Result<Vec<Result<Claim>>>> + Send {
        async move {
            opts.validate()?;
            let mut answers = Vec::with_capacity(keys.len());
            for key in keys {
                answers.push(self.claim(key, opts).await);
            }
            Ok(answers)
        }
    }

    /// Completes several leases, one answer per lease in the order given, as
    /// if each were completed on its own (each fenced by its lease). The
    /// default completes one after the other.
    fn complete_many(&self, items: &[(Lease, Outcome)]) -> impl Future<Output = Vec<Result<()>>> + Send {
        async move {
            let mut answers = Vec::with_capacity(items.len());
            for (lease, outcome) in items {
                answers.push(self.complete(lease, outcome).await);
            }
            answers
        }
    }

    /// Whether a handler's error is a unique-constraint violation raised by
    /// this backend's driver (a write of the handler's own, in the ledger's
    /// database). The runners never take it for a duplicate: the claim
    /// answers duplicates itself, so such a violation is a bug in the guard
    /// or the data, reported as the non-retryable
    /// [`Error::ConstraintViolation`](crate::Error::ConstraintViolation) and
    /// counted. Backends without such errors keep the default, `None`;
    /// otherwise the driver's message.
    fn unique_violation(&self, error: &(dyn std::error::Error + 'static)) -> Option<String> {
        let _ = error;
        None
    }
}

/// Forwards every [`Ledger`] method through a pointer type.
macro_rules! forward_ledger {
    ($($ptr:ty),*) => {$(
        impl<L: Ledger + ?Sized> Ledger for $ptr {
            fn backend(&self) -> &'static str {
                (**self).backend()
            }
            fn capabilities(&self) -> Capabilities {
                (**self).capabilities()
            }
            fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> impl Future<Output = Result<Claim>> + Send {
                (**self).claim(key, opts)
            }
            fn complete(&self, lease: &Lease, outcome: &Outcome) -> impl Future<Output = Result<()>> + Send {
                (**self).complete(lease, outcome)
            }
            fn release(&self, lease: &Lease) -> impl Future<Output = Result<()>> + Send {
                (**self).release(lease)
            }
            fn renew(&self, lease: &Lease, extend_by: Duration) -> impl Future<Output = Result<Lease>> + Send {
                (**self).renew(lease, extend_by)
            }
            fn get(&self, key: &EffectKey) -> impl Future<Output = Result<Option<Record>>> + Send {
                (**self).get(key)
            }
            fn prune(&self, limit: u64) -> impl Future<Output = Result<u64>> + Send {
                (**self).prune(limit)
            }
            fn abandoned(&self, tenant: &Tenant, limit: u64) -> impl Future<Output = Result<Vec<Record>>> + Send {
                (**self).abandoned(tenant, limit)
            }
            fn horizon(
                &self,
                tenant: &Tenant,
                kind: &str,
            ) -> impl Future<Output = Result<Option<SystemTime>>> + Send {
                (**self).horizon(tenant, kind)
            }
            fn unique_violation(&self, error: &(dyn std::error::Error + 'static)) -> Option<String> {
                (**self).unique_violation(error)
            }
            fn watch(&self, key: &EffectKey) -> impl Future<Output = Watch> + Send {
                (**self).watch(key)
            }
            fn claim_many(
                &self,
                keys: &[EffectKey],
                opts: &ClaimOptions,
            ) -> impl Future<Output = Result<Vec<Result<Claim>>>> + Send {
                (**self).claim_many(keys, opts)
            }
            fn complete_many(&self, items: &[(Lease, Outcome)]) -> impl Future<Output = Vec<Result<()>>> + Send {
                (**self).complete_many(items)
            }
        }
    )*};
}

forward_ledger!(&L, std::sync::Arc<L>);

/// A ledger on a SQL database whose claims can join the caller's open
/// transaction, so the claim, the business writes and the completion commit
/// together (the `Transactional` step mode): exactly once for local writes.
///
/// `Connection` is the driver's connection type (`sqlx::PgConnection`,
/// `sqlx::SqliteConnection`); callers pass `&mut *tx`. Inside a transaction a
/// concurrent duplicate blocks on the unique index until the first commits,
/// then sees [`Claim::Completed`] (or acquires, if the first rolled back).
/// Leases still apply: a claim left by a transaction that committed without
/// completing is taken over after it expires, like any other.
pub trait TransactionalLedger: Ledger {
    /// The driver's connection type.
    type Connection: Send;

    /// The driver's transaction (`sqlx::Transaction<'static, _>`): dereferences
    /// to the connection that `claim_in` and `complete_in` take.
    type Transaction: Send + std::ops::DerefMut<Target = Self::Connection>;

    /// Begins a transaction on the ledger's pool, cancel-safely (a dropped
    /// future never leaves a pooled connection inside a transaction), in the
    /// mode the backend's claims need (SQLite: `BEGIN IMMEDIATE`).
    fn begin(&self) -> impl Future<Output = Result<Self::Transaction>> + Send;

    /// Commits a transaction from [`TransactionalLedger::begin`].
    fn commit(&self, tx: Self::Transaction) -> impl Future<Output = Result<()>> + Send;

    /// Rolls a transaction back (dropping it does too, later).
    fn rollback(&self, tx: Self::Transaction) -> impl Future<Output = Result<()>> + Send;

    /// [`Ledger::claim`] on the caller's connection, inside its transaction.
    fn claim_in(
        &self,
        conn: &mut Self::Connection,
        key: &EffectKey,
        opts: &ClaimOptions,
    ) -> impl Future<Output = Result<Claim>> + Send;

    /// [`Ledger::complete`] on the caller's connection, inside its transaction.
    fn complete_in(
        &self,
        conn: &mut Self::Connection,
        lease: &Lease,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<()>> + Send;
}

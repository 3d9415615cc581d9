//! The backend contract.

use std::future::Future;
use std::time::Duration;

use crate::error::Result;
use crate::key::{EffectKey, Tenant};
use crate::record::{Claim, ClaimOptions, Lease, Outcome, Record};

/// What a backend offers, declared so that callers and the conformance suite
/// can tell a missing capability from a bug.
#[derive(Debug, Clone, PartialEq, Eq)]
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
}

/// An effect ledger: one implementation per backend crate.
///
/// Every method is one atomic operation on the backend (one round trip where
/// the backend allows it), decided by the backend's clock, and cancel-safe: a
/// dropped future never loses a committed claim or leaves one half-written.
///
/// The rules every backend follows (the conformance suite checks each):
/// - `claim` on an absent key inserts an in-progress record with fence 1. If
///   [`ClaimOptions::sent_at`] is older than the retention, it inserts nothing
///   and fails with [`Error::BeyondHorizon`](crate::Error::BeyondHorizon).
/// - `claim` on an existing key first compares fingerprints (both present and
///   different: [`Error::FingerprintMismatch`](crate::Error::FingerprintMismatch),
///   nothing changes); then a completed record answers [`Claim::Completed`], a
///   live lease [`Claim::InProgress`], an expired at-most-once lease
///   [`Claim::Abandoned`], and an expired lease or a released record is taken
///   over with `fence + 1`.
/// - `complete`, `release` and `renew` succeed only while the record is in
///   progress at the lease's fence (an expired lease that nobody took over
///   still counts); otherwise they fail with
///   [`Error::LeaseLost`](crate::Error::LeaseLost) and change nothing.
/// - `complete` and `release` keep the record until `now + retention` (the
///   retention given at claim time). `prune` deletes only completed and
///   released records past that point: never a lease, never an abandoned step.
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
}

impl<L: Ledger + ?Sized> Ledger for std::sync::Arc<L> {
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
}

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

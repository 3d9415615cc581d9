//! # oncely
//!
//! Brokers deliver at least once; payments, emails and ledger entries must
//! happen once. oncely makes the *effect* of a delivery happen once: a
//! second, third or concurrent delivery of the same work changes nothing, and
//! a caller who asks again gets the original outcome back.
//!
//! The check and the claim are one atomic database operation (a unique
//! constraint, `INSERT … ON CONFLICT DO NOTHING RETURNING`), never a read
//! followed by a write. Keys come from the effect (`capture:order-123`), not
//! from the delivery.
//!
//! ```
//! use std::sync::Arc;
//! use oncely::{ClaimOptions, EffectKey, Effects, MemoryLedger, Tenant};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> oncely::Result<()> {
//! let effects = Effects::new(Arc::new(MemoryLedger::new()));
//! let key = EffectKey::new(&Tenant::global(), "capture", "order-123")?;
//! let opts = ClaimOptions::default();
//!
//! let first: String = effects.run(&key, &opts, |lease| async move {
//!     // call the provider with lease.provider_key() as its idempotency key
//!     Ok(format!("ch_{}", &lease.provider_key()[..8]))
//! }).await?;
//! // A redelivery does not charge again: it gets the first outcome back.
//! let again: String = effects.run(&key, &opts, |_| async { Ok("never".to_owned()) }).await?;
//! assert_eq!(first, again);
//! # Ok(()) }
//! ```
//!
//! A job with several effects (capture, mark paid, send a receipt) gives each
//! its own key with [`Effects::job`]: a redelivery resumes at the first
//! unfinished step. [`Job`] explains the three [`StepMode`]s
//! (transactional, provider-keyed, at-most-once) and the window each leaves
//! open. What a crash leaves in doubt (an abandoned at-most-once step, a
//! stuck lease) is settled by asking the provider: see [`reconcile`].
//!
//! Backends: [`MemoryLedger`] here for unit tests; `oncely-sqlite` (the
//! embedded default) and `oncely-postgres` in their own crates. Every backend
//! passes the same [`conformance`] suite.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod admin;
pub mod backend;
mod effects;
mod error;
mod held;
mod job;
mod key;
mod ledger;
mod memory;
mod pipeline;
mod pruner;
pub mod reconcile;
mod record;
mod retry;
mod scope;
mod slots;
pub mod telemetry;
pub mod watch;

#[cfg(feature = "conformance")]
pub mod conformance;

pub use admin::Admin;
pub use effects::{Effects, How, Ran};
pub use error::{BoxError, Error, Result};
pub use held::HeldLease;
pub use job::{Job, StepContext, StepFuture, StepMode};
pub use key::{EffectKey, MAX_KEY_BYTES, MAX_KIND_BYTES, MAX_TENANT_BYTES, Tenant};
pub use ledger::{Capabilities, Ledger, TransactionalLedger};
pub use memory::MemoryLedger;
pub use pipeline::Failure;
pub use pruner::{Pruner, PrunerHandle, PrunerOptions, PrunerStats};
pub use record::{
    Claim, ClaimOptions, Fingerprint, Lease, MAX_OUTCOME_BYTES, OnInProgress, Outcome, Record, RecordState,
    StoredOutcome,
};
pub use watch::Watch;

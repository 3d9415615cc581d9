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
//! In a broker consumer, claim with [`ClaimOptions::for_consumer`]; in an
//! HTTP handler, with [`ClaimOptions::for_http`]: each says what it trades.
//!
//! A job with several effects (capture, mark paid, send a receipt) gives each
//! its own key with [`Effects::job`]: a redelivery resumes at the first
//! unfinished step. [`Job`] explains the three [`StepMode`]s
//! (transactional, provider-keyed, at-most-once) and the window each leaves
//! open. What a crash leaves in doubt (an abandoned at-most-once step, a
//! stuck lease) is settled by asking the provider: see [`reconcile`].
//!
//! ## Two doors
//!
//! The crate root is the application's API and nothing else: [`Effects`],
//! [`Job`] with [`StepMode`] and [`StepContext`], [`EffectKey`] and
//! [`Tenant`], [`ClaimOptions`] and [`OnInProgress`], [`HeldLease`], what a
//! run reports ([`Reported`], [`How`], [`Failure`]), [`Error`] and [`Result`], and
//! [`MemoryLedger`] for unit tests. Everything else has one path in a
//! module:
//!
//! - [`backend`]: the door for backend authors: the [`Ledger`](backend::Ledger)
//!   contract, the records and leases it speaks, and every rule the backends
//!   share (fences, horizons, lost writes, time units, backoff);
//! - [`open`]: opening a ledger from a URL (`FromUrl`), for tools;
//! - [`codec`]: stored outcomes encrypted at rest ([`Sealed`](codec::Sealed)
//!   around any ledger, key rotation);
//! - [`admin`]: the operator's listings and repairs; [`reconcile`]: settling
//!   what a crash left in doubt; [`pruner`]: deleting records past their
//!   retention; [`telemetry`]: the names of every span, event and metric;
//! - `conformance` (feature `conformance`): the suite every backend passes.
//!
//! ## Layout
//!
//! This crate holds no database driver. The backends are their own crates:
//! `oncely-sqlite` (the embedded default), `oncely-postgres`, `oncely-mysql`
//! (MySQL, MariaDB and Galera), `oncely-redis` (single server, Sentinel,
//! Cluster) and `oncely-nats` (JetStream key-value); each passes the same
//! conformance suite. Around them: `oncely-consumer` (broker consumers:
//! RabbitMQ, NATS JetStream, Redis Streams, apalis), `oncely-tower` (the HTTP
//! `Idempotency-Key` layer), `oncely-testkit` (test helpers),
//! `oncely-any` (one ledger type for every backend, picked from a URL),
//! `oncely-bench` (the duplicate-storm bench) and `oncely-cli` (the `oncely`
//! command).
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod admin;
pub mod backend;
mod backoff;
mod coalesce;
pub mod codec;
mod effects;
mod error;
mod flight;
mod held;
mod job;
mod key;
mod ledger;
mod memory;
pub mod open;
pub mod outbox;
mod pipeline;
pub mod pruner;
pub mod reconcile;
mod record;
mod retry;
mod scope;
mod slots;
mod state;
pub mod telemetry;
mod time;
mod watch;

#[cfg(feature = "conformance")]
pub mod conformance;

pub use effects::{Effects, How, Reported};
pub use error::{BoxError, Error, Result};
pub use held::HeldLease;
pub use job::{Job, StepContext, StepFuture, StepMode};
pub use key::{EffectKey, SubjectKey, Tenant};
pub use memory::MemoryLedger;
pub use pipeline::Failure;
pub use record::{ClaimOptions, OnInProgress};

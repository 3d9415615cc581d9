//! # oncely-postgres
//!
//! The PostgreSQL backend of [oncely]: an effect ledger in one table,
//! claimed with one statement per claim, that can also join the caller's own
//! transaction so that the claim, the business writes and the completion
//! commit together.
//!
//! ## Quick start
//!
//! ```no_run
//! use oncely::{ClaimOptions, EffectKey, Effects, Tenant};
//! use oncely_postgres::PgLedger;
//!
//! #[tokio::main]
//! async fn main() -> oncely::Result<()> {
//!     // Connects, runs the embedded migrations (idempotent) and checks the table.
//!     let ledger = PgLedger::connect("postgres://app@db/app").await?;
//!     let effects = Effects::new(ledger);
//!     let key = EffectKey::new(&Tenant::global(), "capture", "order-123")?;
//!     let charge: String = effects
//!         .run(&key, &ClaimOptions::default(), |lease| async move {
//!             // call the payment provider with lease.provider_key() as its idempotency key
//!             Ok(format!("ch_{}", &lease.provider_key()[..8]))
//!         })
//!         .await?;
//!     println!("charged: {charge}");
//!     Ok(())
//! }
//! ```
//!
//! ## Read next
//!
//! The rest is in [`guide`]: opening from a URL, read-only access, the guarantees and limits, waiting duplicates, replication and failover, batches, pruning, cancel safety and the schema.
//!
//! - Exactly once for local writes: `claim_in`
//! - Read-only access
//! - Opening from a URL
//! - Guarantees and limits
//! - Waiting duplicates
//! - Replication and failover
//! - Batches
//! - Pruning tens of millions of rows
//! - Cancel safety
//! - Schema
//!
//! [`Access::Existing`]: oncely::open::Access::Existing
//! [`Access::Migrate`]: oncely::open::Access::Migrate
//! [`Access::ReadOnly`]: oncely::open::Access::ReadOnly
//! [`Claim::Completed`]: oncely::backend::Claim::Completed
//! [`Claim::InProgress`]: oncely::backend::Claim::InProgress
//! [`Claim::Acquired`]: oncely::backend::Claim::Acquired
//! [`ClaimOptions::sent_at`]: oncely::ClaimOptions::sent_at
//! [`ClaimOptions::relaxed_claim`]: field@oncely::ClaimOptions::relaxed_claim
//! [`Error::Backend`]: oncely::Error::Backend
//! [`Error::BeyondHorizon`]: oncely::Error::BeyondHorizon
//! [`Error::Config`]: oncely::Error::Config
//! [`Error::LeaseLost`]: oncely::Error::LeaseLost
//! [`Error::OutcomeUnknown`]: oncely::Error::OutcomeUnknown
//! [`Error::ConstraintViolation`]: oncely::Error::ConstraintViolation
//! [`Error::Unavailable`]: oncely::Error::Unavailable
//! [`FromUrl`]: oncely::open::FromUrl
//! [`Ledger::abandoned`]: oncely::backend::Ledger::abandoned
//! [`Ledger::get`]: oncely::backend::Ledger::get
//! [`Ledger::horizon`]: oncely::backend::Ledger::horizon
//! [`Ledger::unique_violation`]: oncely::backend::Ledger::unique_violation
//! [`TransactionalLedger`]: oncely::backend::TransactionalLedger
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod guide;

// The crate by concern: `options` (the builder and the URL), `ledger` (the
// ledger type, one statement per operation), `guard` (the leaked-transaction
// guard: the one retry loop), `sql` (every statement, each beside its
// binding and the row type it decodes, by column name), `schema`
// (migrations and the schema check),
// `error` (driver errors to `oncely::Error`).
mod batch;
mod conn;
mod error;
mod guard;
mod hosts;
mod ledger;
mod notify;
mod options;
mod outbox;
mod schema;
mod sql;
mod token;

pub use crate::ledger::PgLedger;
pub use crate::notify::ListenerStatus;
pub use crate::options::PgLedgerOptions;
/// The connection a caller's transaction derefs to, for
/// [`TransactionalLedger::claim_in`](oncely::backend::TransactionalLedger::claim_in).
pub use sqlx::PgConnection;

//! # oncely-sqlite
//!
//! The SQLite backend of [oncely]: the embedded default effect
//! ledger. One file, no server; the ledger table can live in the same
//! database as your business tables, so a claim, your writes and the
//! completion commit in one transaction. So can an event you publish: the
//! transactional outbox ([`oncely::outbox`], table `<table>_outbox`) takes
//! messages in that transaction, and a relay publishes them once it has
//! committed.
//!
//! ```no_run
//! use oncely::{ClaimOptions, EffectKey, Effects, Tenant};
//! use oncely_sqlite::SqliteLedger;
//!
//! #[tokio::main]
//! async fn main() -> oncely::Result<()> {
//!     // Creates the file if it is missing, turns on WAL and runs the migrations.
//!     let ledger = SqliteLedger::connect("sqlite:data/app.db").await?;
//!     let effects = Effects::new(ledger);
//!     let key = EffectKey::new(&Tenant::global(), "capture", "order-123")?;
//!     let charge: String = effects
//!         .run(&key, &ClaimOptions::default(), |lease| async move {
//!             // Call the provider with lease.provider_key() as its idempotency key.
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
//! The rest is in [`guide`]: claims inside your transaction, opening the database, the guarantees and limits, and where things are.
//!
//! - Claims inside your transaction
//! - Opening the database
//! - Guarantees and limits
//! - Where things are
//!
//! [`TransactionalLedger`]: oncely::backend::TransactionalLedger
//! [`Claim::Completed`]: oncely::backend::Claim::Completed
//! [`Error::BeyondHorizon`]: oncely::Error::BeyondHorizon
//! [`Error::Config`]: oncely::Error::Config
//! [`Error::Unavailable`]: oncely::Error::Unavailable
//! [`Error::Backend`]: oncely::Error::Backend
//! [`Error::ConstraintViolation`]: oncely::Error::ConstraintViolation
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod guide;

mod batch;
mod durability;
mod error;
mod ledger;
mod notify;
mod options;
mod outbox;
mod schema;
mod sql;

pub use crate::error::map_error;
pub use crate::ledger::SqliteLedger;
pub use crate::options::{SqliteLedgerOptions, SqliteSynchronous};
/// The connection [`TransactionalLedger::claim_in`](oncely::backend::TransactionalLedger::claim_in)
/// takes (`&mut *tx` of a transaction from [`SqliteLedger::begin`]).
pub use sqlx::sqlite::SqliteConnection;

// The README's Rust examples are compiled as doc tests by `examples/readme`,
// which has every dependency they name (the HTTP layer, the consumer).

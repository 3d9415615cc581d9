//! # oncely-mysql
//!
//! The MySQL 8 / MariaDB 10.5+ backend of [oncely]: an effect ledger in one
//! InnoDB table (plus a small horizon table), whose claims can also join the
//! caller's own transaction (`claim_in` / `complete_in`), so a business write
//! and its claim commit together; and a transactional outbox beside it
//! (`<table>_outbox`, [`oncely::outbox`]), whose messages are enqueued in
//! that transaction too.
//!
//! ```no_run
//! use oncely::backend::{Claim, Ledger, Outcome, TransactionalLedger};
//! use oncely::{ClaimOptions, EffectKey, Tenant};
//! use oncely_mysql::MySqlLedger;
//!
//! #[tokio::main]
//! async fn main() -> oncely::Result<()> {
//!     let ledger = MySqlLedger::connect("mysql://root@127.0.0.1:3306/test").await?;
//!     let key = EffectKey::new(&Tenant::global(), "capture", "order-123")?;
//!
//!     // Standalone claim (ProviderKeyed / AtMostOnce steps).
//!     if let Claim::Acquired(lease) = ledger.claim(&key, &ClaimOptions::default()).await? {
//!         // … call the provider with lease.provider_key() …
//!         ledger.complete(&lease, &Outcome::from_json(&"ch_1")?).await?;
//! }
//!
//! // Transactional step: the claim, the business write and the completion
//! // commit (or roll back) together.
//! let receipt = EffectKey::new(&Tenant::global(), "ledger-entry", "order-123")?;
//! let mut tx = ledger.begin().await?;
//! if let Claim::Acquired(lease) = ledger.claim_in(&mut *tx, &receipt, &ClaimOptions::default()).await? {
//!     // sqlx::query("INSERT INTO entries …").execute(&mut *tx).await?;
//!     ledger.complete_in(&mut *tx, &lease, &Outcome::from_json(&"entry-1")?).await?;
//! }
//! ledger.commit(tx).await?;
//!     Ok(())
//! }
//! ```
//!
//! ## Read next
//!
//! The rest is in [`guide`]: URL forms, the guarantees and limits, Galera and host lists, the clock, waiting, batches, why each statement is written as it is, the outbox, the schema and cancel safety.
//!
//! - URL forms
//! - Guarantees and limits
//! - Galera
//! - Host lists and failover
//! - The clock, and a claim that waited
//! - A duplicate is a read
//! - Waiting
//! - Batches
//! - Why `ON DUPLICATE KEY UPDATE` and not `INSERT IGNORE`
//! - How a claim learns what happened
//! - The horizon
//! - The outbox
//! - Schema, migrations, read-only
//! - Strict mode and keys
//! - Cancel safety
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod guide;

// Where things are: one concern per module.
mod batch; // claim_many and complete_many: a read, then one statement for the keys that need a write
mod claim; // the claim: its statement's forms, what its row means, the refresh after a lock wait, the horizon
mod error; // driver errors to oncely::Error, unique violations
mod guard; // running on the pool: one retry loop, the operation timeout, the leaked-transaction guard
mod hosts; // a URL's host list, the check of every new connection, moving to another host
mod ledger; // MySqlLedger: constructors, Ledger, TransactionalLedger, FromUrl
mod options; // MySqlLedgerOptions, this backend's URLs
mod outbox; // the transactional outbox: enqueue in the caller's transaction, the relay's claim and fenced writes
mod prune; // prune's batches: lock the watermarks, raise them, delete
mod row; // reading a result to its end (first, only)
mod schema; // migrations and the check of the tables
mod server; // what the server supports, asked once
mod sql; // every statement, bound by one function each beside its row; one file per concern

pub use crate::ledger::MySqlLedger;
pub use crate::options::{DEFAULT_TABLE, MySqlLedgerOptions};
/// The connection a caller's transaction runs on (`claim_in` /
/// `complete_in` take `&mut MySqlConnection`; pass `&mut *tx`).
pub use sqlx::MySqlConnection;

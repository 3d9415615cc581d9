//! # oncely-redis
//!
//! The Redis and Redis Cluster backend of [oncely]: an effect ledger
//! in which every operation (claim, complete, release, renew, get) is one Lua
//! script, so the check and the write are one atomic step on the server and
//! one round trip from the worker. Lease expiry, retention and fences are
//! decided by the server's clock (`redis.call('TIME')`, read inside the
//! script that writes), never by a worker's.
//!
//! ```no_run
//! use std::sync::Arc;
//! use oncely::{ClaimOptions, EffectKey, Effects, Tenant};
//! use oncely_redis::RedisLedger;
//!
//! #[tokio::main]
//! async fn main() -> oncely::Result<()> {
//!     // A server that persists (appendonly yes); one that does not is
//!     // refused unless the URL says ?ephemeral=true (see Durability).
//!     let ledger = RedisLedger::connect("redis://127.0.0.1:6379").await?;
//!     // A Redis Cluster, through any of its nodes:
//!     // RedisLedger::connect("redis+cluster://10.0.0.1:7000,10.0.0.2:7000").await?;
//!     // The primary Sentinel names, followed across failovers, each lease
//!     // write acknowledged only once a replica has it:
//!     // RedisLedger::connect("redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster?wait_replicas=1").await?;
//!     let effects = Effects::new(Arc::new(ledger));
//!     let key = EffectKey::new(&Tenant::new("acme")?, "capture", "order-123")?;
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
//! The rest is in [`guide`]: opening, the guarantees and limits, records, the horizon, durability, replication with Sentinel and WAIT, waiting, batches, errors and cancellation.
//!
//! - Opening
//! - Guarantees and limits
//! - Records
//! - Horizon
//! - Durability: what the server configuration gives
//! - Replication: Sentinel and `WAIT`
//! - Waiting
//! - Batches
//! - Errors and cancellation
//! - Where things are
//!
//! [`Error::Backend`]: oncely::Error::Backend
//! [`Error::BeyondHorizon`]: oncely::Error::BeyondHorizon
//! [`Error::Config`]: oncely::Error::Config
//! [`Error::Corrupt`]: oncely::Error::Corrupt
//! [`Error::Unavailable`]: oncely::Error::Unavailable
//! [`ClaimOptions::sent_at`]: oncely::ClaimOptions::sent_at
//! [`Ledger::horizon`]: oncely::backend::Ledger::horizon
//! [`is_beyond_horizon`]: oncely::backend::is_beyond_horizon
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod guide;

mod batch;
mod conn;
mod durability;
mod error;
mod horizon;
mod keys;
mod ledger;
mod lua;
mod notify;
mod options;
mod reply;
mod sentinel;

pub use ledger::RedisLedger;
pub use options::{RedisLedgerOptions, RedisUrl};

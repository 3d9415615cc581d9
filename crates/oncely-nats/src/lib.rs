//! # oncely-nats
//!
//! An [`oncely`] effect ledger on a NATS JetStream key-value bucket: claims
//! are `create` (insert if absent) and revision-checked `update`s, so the
//! check and the claim are one atomic operation on the stream leader, and
//! with `replicas = 3` every acknowledged write is on a Raft quorum (in its
//! servers' OS caches: see Durability for when it reaches their disks).
//!
//! ```no_run
//! use std::sync::Arc;
//! use oncely::{ClaimOptions, EffectKey, Effects, Tenant};
//! use oncely_nats::NatsKvLedger;
//!
//! #[tokio::main]
//! async fn main() -> oncely::Result<()> {
//!     let ledger = NatsKvLedger::connect("nats://n1:4222,n2:4222,n3:4222?replicas=3").await?;
//!     let effects = Effects::new(Arc::new(ledger));
//!     let key = EffectKey::new(&Tenant::global(), "capture", "order-123")?;
//!     let charge: String = effects
//!         .run(&key, &ClaimOptions::default(), |lease| async move {
//!             // call the provider with lease.provider_key() as its idempotency key
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
//! The rest is in [`guide`]: opening, the guarantees and limits (durability, replicated buckets, clocks, retention, the horizon, waiting, batches, errors) and the source layout.
//!
//! - Opening
//! - Guarantees and limits
//! - Source layout
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod guide;

mod batch;
mod bucket;
mod claim;
mod clock;
mod codec;
mod error;
mod horizon;
mod kv;
mod ledger;
mod marker;
mod notify;
mod options;
mod prune;

pub use ledger::NatsKvLedger;
pub use options::{NatsKvLedgerOptions, NatsUrl};

//! # oncely-consumer: plug oncely into a message consumer
//!
//! The glue between a broker and [`oncely::Effects`] is where duplicates
//! come back: acking before the effect is stored, nacking in a tight loop
//! while another worker holds the lease, keying on the broker's message id.
//! This crate is that glue, once, for any broker:
//!
//! - a [`Handler`] decodes the payload, derives every effect key from it and
//!   runs its effects with [`Effects::run_reported`](oncely::Effects::run_reported)
//!   (or a [`Job`](oncely::Job)), reporting whether they ran now or were
//!   replayed;
//! - a [`Consumer`] takes [`Delivery`]s from a [`Source`] with bounded
//!   concurrency and maps each result to ack, delayed redelivery or
//!   dead-letter (the table is on [`Consumer`]): a duplicate is acked, an
//!   effect in progress elsewhere comes back after a delay instead of
//!   holding a consumer slot for the other holder's lease, a message that
//!   can never succeed (undecodable, oversized, missing a key field, a stored
//!   terminal failure, too many retries) is dead-lettered with its reason
//!   and counted, never redelivered forever;
//! - shutdown stops taking deliveries, lets the in-flight ones finish (or
//!   redelivers them once the grace ends), and settles every one.
//!
//! A broker adapter implements [`Source`] and [`Delivery`] (a few dozen
//! lines); [`memory::MemoryBroker`] is one in process, for tests. Adapters
//! in this crate, each behind its feature:
//!
//! | feature | module | broker |
//! | --- | --- | --- |
//! | `rabbitmq` | `rabbitmq` | RabbitMQ through lapin: manual acks, prefetch, a quorum queue with its dead-letter exchange |
//! | `nats` | `nats` | NATS JetStream pull consumers through async-nats: `AckWait`, `MaxDeliver`, in-progress acks, a dead-letter stream and `+TERM` |
//! | `redis-streams` | `redis_streams` | Redis Streams through redis-rs: a consumer group, `XACK`, `XAUTOCLAIM` for deliveries stuck on a dead consumer, a dead-letter stream |
//! | `kafka` | `kafka` | Kafka consumer groups through rdkafka (bundled librdkafka): offsets committed in order per partition once handling finished, revocation waits for in-flight handlers, pause/resume for backpressure, a dead-letter topic |
//! | `apalis` | `apalis` | not a broker: an apalis 1.x tower layer that makes a job handler idempotent |
//!
//! ```
//! use std::sync::Arc;
//! use oncely::{ClaimOptions, EffectKey, Effects, How, MemoryLedger, Tenant};
//! use oncely_consumer::memory::MemoryBroker;
//! use oncely_consumer::{Consumer, ConsumerOptions, Context, Handler, HandlerError, json};
//!
//! #[derive(serde::Deserialize)]
//! struct Capture { order_id: Option<String>, amount: i64 }
//!
//! struct Payments { effects: Effects<Arc<MemoryLedger>> }
//!
//! impl Handler for Payments {
//!     type Message = Capture;
//!     fn decode(&self, payload: &[u8]) -> Result<Capture, String> { json(payload) }
//!     async fn handle(&self, msg: Capture, _: Context) -> Result<How, HandlerError> {
//!         let order = msg.order_id.ok_or(HandlerError::missing_field("order_id"))?;
//!         let key = EffectKey::new(&Tenant::global(), "capture", &order)?;
//!         let opts = ClaimOptions::default();
//!         let ran = self.effects.run_reported(&key, &opts, |lease| async move {
//!             Ok(format!("charged {} with key {}", msg.amount, lease.provider_key()))
//!         }).await?;
//!         Ok(ran.how)
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let broker = MemoryBroker::new();
//! broker.publish(r#"{"order_id":"order-1","amount":1250}"#);
//! broker.publish(r#"{"order_id":"order-1","amount":1250}"#); // re-published
//! broker.publish(r#"{"amount":1250}"#); // no order id: dead-lettered
//! let consumer = Consumer::new("payments", Payments { effects: Effects::new(Arc::new(MemoryLedger::new())) })
//!     .options(ConsumerOptions::default().concurrency(4));
//! let b = broker.clone();
//! let stats = consumer
//!     .run(broker.source(), async move {
//!         while b.pending() > 0 { tokio::time::sleep(std::time::Duration::from_millis(5)).await }
//!     })
//!     .await
//!     .unwrap();
//! assert_eq!((stats.ran, stats.replayed, stats.dead_lettered), (1, 1, 1));
//! assert!(broker.dead_letters()[0].reason.starts_with("missing_field"));
//! # }
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

#[cfg(feature = "apalis")]
pub mod apalis;
mod broker;
mod consumer;
mod handler;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod memory;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis-streams")]
pub mod redis_streams;
pub mod telemetry;

pub use broker::{BrokerError, Delivery, Source};
pub use consumer::{Action, Consumer, ConsumerOptions, Stats};
pub use handler::{Context, Handler, HandlerError, json};

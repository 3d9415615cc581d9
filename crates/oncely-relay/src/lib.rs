//! # oncely-relay
//!
//! The brokers an outbox's messages are published to. An application
//! enqueues a message in the same transaction as its business writes
//! ([`oncely::outbox::TransactionalOutbox::enqueue_in`], on the SQL
//! ledgers); a [`Relay`] publishes the committed messages with one of the
//! publishers here, waits for the broker's confirmation, and only then
//! marks them sent. `oncely relay --database-url … --to …` runs one from
//! the command line.
//!
//! ```no_run
//! use oncely::outbox::{Relay, RelayOptions};
//! use oncely_postgres::PgLedger;
//! use oncely_relay::AnyPublisher;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = PgLedger::connect("postgres://app@db/app").await?;
//! let broker = AnyPublisher::connect("nats://127.0.0.1:4222").await?;
//! let relay = Relay::new(outbox, broker, RelayOptions::default())?;
//! relay.run_until(async { tokio::signal::ctrl_c().await.ok(); }).await;
//! # Ok(()) }
//! ```
//!
//! The application's side, in one transaction with the business write and
//! the step that names the message (a `Job::step_in`):
//!
//! ```no_run
//! use oncely::backend::TransactionalLedger;
//! use oncely::outbox::{Message, TransactionalOutbox};
//! use oncely::{Effects, Failure, StepFuture, Tenant};
//! use oncely_postgres::PgLedger;
//!
//! async fn mark_paid(effects: &Effects<PgLedger>, ledger: &PgLedger, order: &str, charge: &str) -> oncely::Result<()> {
//!     let job = effects.job(&Tenant::global(), "payment", order);
//!     let event = Message::json("order-events", &serde_json::json!({ "order": order, "charge": charge }))?;
//!     let mut tx = ledger.begin().await?;
//!     let (outbox, order, charge) = (ledger.clone(), order.to_owned(), charge.to_owned());
//!     job.step_in("mark-paid", &mut *tx, move |conn, step| {
//!         Box::pin(async move {
//!             sqlx::query("UPDATE orders SET status = 'paid', charge_id = $2 WHERE id = $1")
//!                 .bind(&order)
//!                 .bind(&charge)
//!                 .execute(&mut *conn)
//!                 .await
//!                 .map_err(Failure::retryable)?;
//!             // Named by the step's key: the step never enqueues twice.
//!             outbox.enqueue_in(conn, step.key(), &event).await?;
//!             Ok(())
//!         }) as StepFuture<'_, ()>
//!     })
//!     .await?;
//!     ledger.commit(tx).await // the order, the event and the step: one commit
//! }
//! ```
//!
//! | broker | feature | `--to` | destination | message id | what drops a copy published twice |
//! | --- | --- | --- | --- | --- | --- |
//! | RabbitMQ | `rabbitmq` | `amqp://user:pass@host:5672/vhost[?exchange=NAME]` | routing key (default exchange: a queue name) | `message-id` property | the consumer's oncely ledger |
//! | NATS JetStream | `nats` | `nats://host:4222[,host:4223…]` | subject | `Nats-Msg-Id` header | the stream, within its duplicate window; after it, the consumer's ledger |
//! | Redis Streams | `redis` | `redis://host:6379[/db]` | stream key | `message_id` field | the consumer's oncely ledger |
//! | Kafka | `kafka` | `kafka://host:9092[,host:port…][?librdkafka.property=value&…]` | topic (the ordering key is the record key) | `oncely-message-id` header | the idempotent producer, within one producer session; after it, the consumer's ledger |
//!
//! Every copy of a message carries the same id, derived from the effect key
//! that named it ([`Pending::message_id`](oncely::outbox::Pending::message_id)),
//! so a relay that publishes a message again (it died between the broker's
//! confirmation and its mark, or stalled past its lease) never makes the
//! downstream effect happen twice: a consumer running oncely keys that
//! effect on the event, and the second copy replays it.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use oncely::outbox::{Pending, PublishError, Publisher};

pub use oncely::outbox::{Relay, RelayOptions};

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;

/// A publisher picked from a URL's scheme, for tools (`oncely relay
/// --to`): each broker whose feature is on.
#[derive(Debug)]
#[non_exhaustive]
pub enum AnyPublisher {
    /// `amqp://`, `amqps://`.
    #[cfg(feature = "rabbitmq")]
    Rabbit(rabbitmq::RabbitPublisher),
    /// `nats://`.
    #[cfg(feature = "nats")]
    Nats(nats::JetStreamPublisher),
    /// `redis://`, `rediss://`.
    #[cfg(feature = "redis")]
    Redis(redis::StreamPublisher),
    /// `kafka://`.
    #[cfg(feature = "kafka")]
    Kafka(kafka::KafkaPublisher),
}

impl AnyPublisher {
    /// Connects to the broker `url` names (see the crate docs for the
    /// forms). An unknown scheme, a broker whose feature is off or an
    /// unknown query parameter is a permanent [`PublishError`].
    pub async fn connect(url: &str) -> Result<Self, PublishError> {
        let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
        match scheme.as_deref() {
            #[cfg(feature = "rabbitmq")]
            Some("amqp" | "amqps") => {
                let params = oncely::open::UrlParams::parse(url, "RabbitMQ", &["exchange"], &[])
                    .map_err(|e| PublishError::permanent(e.to_string()))?;
                let exchange = params.get("exchange").unwrap_or("");
                Ok(AnyPublisher::Rabbit(
                    rabbitmq::RabbitPublisher::connect(params.driver_url(), exchange).await?,
                ))
            }
            #[cfg(feature = "nats")]
            Some("nats" | "tls") => Ok(AnyPublisher::Nats(nats::JetStreamPublisher::connect(url).await?)),
            #[cfg(feature = "redis")]
            Some("redis" | "rediss") => Ok(AnyPublisher::Redis(redis::StreamPublisher::connect(url).await?)),
            #[cfg(feature = "kafka")]
            Some("kafka") => {
                let rest = &url["kafka://".len()..];
                let (brokers, query) = rest.split_once('?').unwrap_or((rest, ""));
                let mut props = Vec::new();
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    let Some((k, v)) = pair.split_once('=') else {
                        return Err(PublishError::permanent(format!(
                            "kafka: {pair:?} in the URL's query is not NAME=VALUE (a librdkafka property)"
                        )));
                    };
                    props.push((k.to_owned(), v.to_owned()));
                }
                Ok(AnyPublisher::Kafka(
                    kafka::KafkaPublisher::connect(brokers, &props).await?,
                ))
            }
            _ => Err(PublishError::permanent(format!(
                "no broker for {url:?}: give amqp://, nats://, redis:// or kafka:// (this build has: {})",
                AnyPublisher::schemes().join(", ")
            ))),
        }
    }

    /// The schemes this build can publish to.
    pub fn schemes() -> Vec<&'static str> {
        let mut s = Vec::new();
        if cfg!(feature = "rabbitmq") {
            s.push("amqp");
        }
        if cfg!(feature = "nats") {
            s.push("nats");
        }
        if cfg!(feature = "redis") {
            s.push("redis");
        }
        if cfg!(feature = "kafka") {
            s.push("kafka");
        }
        s
    }
}

impl Publisher for AnyPublisher {
    async fn publish(&self, message: &Pending) -> Result<(), PublishError> {
        match self {
            #[cfg(feature = "rabbitmq")]
            AnyPublisher::Rabbit(p) => p.publish(message).await,
            #[cfg(feature = "nats")]
            AnyPublisher::Nats(p) => p.publish(message).await,
            #[cfg(feature = "redis")]
            AnyPublisher::Redis(p) => p.publish(message).await,
            #[cfg(feature = "kafka")]
            AnyPublisher::Kafka(p) => p.publish(message).await,
            #[allow(unreachable_patterns)]
            _ => {
                let _ = message;
                Err(PublishError::permanent("no broker feature is enabled"))
            }
        }
    }

    fn describe(&self) -> String {
        match self {
            #[cfg(feature = "rabbitmq")]
            AnyPublisher::Rabbit(p) => p.describe(),
            #[cfg(feature = "nats")]
            AnyPublisher::Nats(p) => p.describe(),
            #[cfg(feature = "redis")]
            AnyPublisher::Redis(p) => p.describe(),
            #[cfg(feature = "kafka")]
            AnyPublisher::Kafka(p) => p.describe(),
            #[allow(unreachable_patterns)]
            _ => "no broker".to_owned(),
        }
    }
}

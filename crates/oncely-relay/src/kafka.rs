//! Kafka through rdkafka (feature `kafka`; librdkafka built from the
//! sources rdkafka bundles).
//!
//! | outbox message | Kafka |
//! | --- | --- |
//! | destination | the topic |
//! | ordering key | the record's key: every message of one key goes to one partition, in order |
//! | message id | the `oncely-message-id` header |
//! | headers | record headers |
//! | confirmed | the delivery report of an idempotent producer (`enable.idempotence=true`, `acks=all`): the message is on every in-sync replica, written once however often the producer retried it within its session |
//!
//! Kafka keeps no record of message ids across producer sessions: a copy
//! published again by a relay that died between the delivery report and
//! its mark is a second record, and the consumer's oncely ledger drops it
//! (it keys its effect on the event, as every oncely consumer does).

use std::time::Duration;

use oncely::outbox::{Pending, PublishError, Publisher};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};

pub use rdkafka;

/// The header that carries the message id.
pub const MESSAGE_ID_HEADER: &str = "oncely-message-id";

/// How long a message may wait in the producer's queue (librdkafka retries
/// within it) before the publish fails and the relay retries it.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// Publishes to the topics of one Kafka cluster through an idempotent
/// producer (librdkafka reconnects by itself).
#[derive(Clone)]
pub struct KafkaPublisher {
    producer: FutureProducer,
    brokers: String,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("brokers", &self.brokers)
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// A publisher on `brokers` (`host:port[,host:port…]`) with further
    /// librdkafka properties (`security.protocol`, `linger.ms`, …); the
    /// producer is always idempotent with `acks=all`. Asks the cluster for
    /// its metadata at once, so an unreachable cluster is an error here.
    pub async fn connect(brokers: &str, props: &[(String, String)]) -> Result<Self, PublishError> {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", brokers);
        config.set("message.timeout.ms", DELIVERY_TIMEOUT.as_millis().to_string());
        for (k, v) in props {
            config.set(k, v);
        }
        config.set("enable.idempotence", "true");
        config.set("acks", "all");
        let producer: FutureProducer = config
            .create()
            .map_err(|e| PublishError::permanent(format!("kafka: {e}")))?;
        let probe = producer.clone();
        tokio::task::spawn_blocking(move || {
            probe
                .client()
                .fetch_metadata(None, Duration::from_secs(10))
                .map(|_| ())
        })
        .await
        .map_err(|e| PublishError::retryable(format!("kafka: {e}")))?
        .map_err(|e| PublishError::retryable(format!("kafka: no answer from {brokers}: {e}")))?;
        Ok(KafkaPublisher {
            producer,
            brokers: brokers.to_owned(),
        })
    }

    /// A publisher on a producer made elsewhere; make it idempotent
    /// (`enable.idempotence=true`), or a retried send may be written twice.
    pub fn new(producer: FutureProducer, brokers: &str) -> Self {
        KafkaPublisher {
            producer,
            brokers: brokers.to_owned(),
        }
    }
}

impl Publisher for KafkaPublisher {
    async fn publish(&self, message: &Pending) -> Result<(), PublishError> {
        let id = message.message_id();
        let mut headers = OwnedHeaders::new_with_capacity(message.headers.len() + 1);
        for (name, value) in &message.headers {
            headers = headers.insert(Header {
                key: name.as_str(),
                value: Some(value.as_str()),
            });
        }
        headers = headers.insert(Header {
            key: MESSAGE_ID_HEADER,
            value: Some(id.as_str()),
        });
        let record = FutureRecord::to(&message.destination)
            .key(message.ordering_key.as_str())
            .payload(message.payload.as_slice())
            .headers(headers);
        match self.producer.send(record, DELIVERY_TIMEOUT).await {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(PublishError::retryable(format!(
                "kafka: no delivery report for {} on {}: {e}",
                id, message.destination
            ))),
        }
    }

    fn describe(&self) -> String {
        format!("kafka {}", self.brokers)
    }
}

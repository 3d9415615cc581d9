//! NATS JetStream pull consumers through async-nats (feature `nats`).
//!
//! | loop action | what the adapter does |
//! | --- | --- |
//! | ack | `+ACK`, waiting for the server's confirmation (a double ack): an ack that may not have landed is an error, and the redelivery is a replay |
//! | redeliver after `delay` | `-NAK` with the delay (JetStream redelivers it then) |
//! | dead-letter with a reason | publish a copy to the dead-letter subject (its own stream) with the headers `Oncely-Reason` and `Oncely-Broker-Id`, wait for the stream's ack, then `+TERM` so JetStream never redelivers it; the copy keeps the message's `Nats-Msg-Id`, so a second dead-lettering after a crash is deduplicated by the stream |
//! | ack deadline | the consumer's `AckWait`; the loop sends `+WPI` (in progress) every [`ConsumerOptions::extend_every`](crate::ConsumerOptions::extend_every): keep it well below `AckWait` |
//! | delivery count | the message's `delivered` from its reply subject |
//!
//! `MaxDeliver` on the consumer is the server's own bound; keep
//! [`ConsumerOptions::max_deliveries`](crate::ConsumerOptions::max_deliveries)
//! below it, so the loop dead-letters with a reason before JetStream stops
//! redelivering silently.

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::{self, Context, stream};
use futures_util::StreamExt;

use crate::broker::{BrokerError, Delivery, Source};

pub use async_nats;

/// Header with the reason of a dead-lettered message.
pub const REASON_HEADER: &str = "Oncely-Reason";
/// Header with the broker id (`stream:sequence`) of a dead-lettered message.
pub const BROKER_ID_HEADER: &str = "Oncely-Broker-Id";

/// A work stream, its durable pull consumer and its dead-letter stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JetStreamTopology {
    /// The work stream.
    pub stream: String,
    /// The subject it captures (and the consumer filters on).
    pub subject: String,
    /// The durable pull consumer every worker shares (`{stream}_workers`).
    pub consumer: String,
    /// The dead-letter stream (`{stream}_DEAD`).
    pub dead_letter_stream: String,
    /// The subject dead-letters are published to (`{subject}.dead`).
    pub dead_letter_subject: String,
    /// How long JetStream waits for an ack before redelivering (30 s).
    pub ack_wait: Duration,
    /// Deliveries after which JetStream stops redelivering (50).
    pub max_deliver: i64,
}

impl JetStreamTopology {
    /// The topology of `stream` capturing `subject`, with the default names.
    pub fn new(stream: &str, subject: &str) -> Self {
        JetStreamTopology {
            stream: stream.to_owned(),
            subject: subject.to_owned(),
            consumer: format!("{stream}_workers"),
            dead_letter_stream: format!("{stream}_DEAD"),
            dead_letter_subject: format!("{subject}.dead"),
            ack_wait: Duration::from_secs(30),
            max_deliver: 50,
        }
    }

    /// Sets [`JetStreamTopology::ack_wait`].
    pub fn ack_wait(mut self, d: Duration) -> Self {
        self.ack_wait = d;
        self
    }

    /// Sets [`JetStreamTopology::max_deliver`].
    pub fn max_deliver(mut self, n: i64) -> Self {
        self.max_deliver = n;
        self
    }

    /// Creates the streams and the durable consumer if they are missing.
    pub async fn declare(&self, js: &Context) -> Result<(), BrokerError> {
        let work = js
            .get_or_create_stream(stream::Config {
                name: self.stream.clone(),
                subjects: vec![self.subject.clone()],
                ..stream::Config::default()
            })
            .await
            .map_err(BrokerError::new)?;
        js.get_or_create_stream(stream::Config {
            name: self.dead_letter_stream.clone(),
            subjects: vec![self.dead_letter_subject.clone()],
            ..stream::Config::default()
        })
        .await
        .map_err(BrokerError::new)?;
        work.get_or_create_consumer::<pull::Config>(
            &self.consumer,
            pull::Config {
                durable_name: Some(self.consumer.clone()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: self.ack_wait,
                max_deliver: self.max_deliver,
                filter_subject: self.subject.clone(),
                ..pull::Config::default()
            },
        )
        .await
        .map_err(BrokerError::new)?;
        Ok(())
    }

    /// The durable consumer, for its info (`num_pending`,
    /// `num_ack_pending`).
    pub async fn consumer(&self, js: &Context) -> Result<PullConsumer, BrokerError> {
        js.get_stream(&self.stream)
            .await
            .map_err(BrokerError::new)?
            .get_consumer(&self.consumer)
            .await
            .map_err(BrokerError::new)
    }

    /// Deletes both streams (and so the consumer).
    pub async fn delete(&self, js: &Context) -> Result<(), BrokerError> {
        js.delete_stream(&self.stream).await.map_err(BrokerError::new)?;
        js.delete_stream(&self.dead_letter_stream)
            .await
            .map_err(BrokerError::new)?;
        Ok(())
    }
}

/// One worker's pull subscription to the durable consumer.
pub struct JetStreamSource {
    messages: pull::Stream,
    js: Context,
    dead_letter_subject: String,
}

impl std::fmt::Debug for JetStreamSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamSource")
            .field("dead_letter_subject", &self.dead_letter_subject)
            .finish_non_exhaustive()
    }
}

impl JetStreamSource {
    /// Starts pulling from the topology's durable consumer, at most `batch`
    /// messages per pull request.
    ///
    /// Pass the consumer's concurrency: a pulled message's `AckWait` runs
    /// while it waits in the client's buffer for a free handler slot, and a
    /// large batch behind slow handlers is redelivered to other workers
    /// before anyone has started on it (harmless with oncely, but wasted
    /// work).
    pub async fn subscribe(
        js: &Context,
        topology: &JetStreamTopology,
        batch: usize,
    ) -> Result<Self, BrokerError> {
        let messages = topology
            .consumer(js)
            .await?
            .stream()
            .max_messages_per_batch(batch.max(1))
            .heartbeat(Duration::from_secs(5))
            .expires(Duration::from_secs(30))
            .messages()
            .await
            .map_err(BrokerError::new)?;
        Ok(JetStreamSource {
            messages,
            js: js.clone(),
            dead_letter_subject: topology.dead_letter_subject.clone(),
        })
    }
}

impl Source for JetStreamSource {
    type Delivery = JetStreamDelivery;

    async fn next(&mut self) -> Result<Option<JetStreamDelivery>, BrokerError> {
        match self.messages.next().await {
            Some(Ok(msg)) => {
                let (broker_id, count) = match msg.info() {
                    Ok(info) => (
                        format!("{}:{}", info.stream, info.stream_sequence),
                        u32::try_from(info.delivered).ok(),
                    ),
                    Err(_) => (msg.subject.to_string(), None),
                };
                Ok(Some(JetStreamDelivery {
                    msg,
                    js: self.js.clone(),
                    dead_letter_subject: self.dead_letter_subject.clone(),
                    broker_id,
                    count,
                }))
            }
            Some(Err(e)) => Err(BrokerError::new(e)),
            None => Err(BrokerError::new("the pull subscription ended")),
        }
    }
}

/// A delivery from JetStream.
pub struct JetStreamDelivery {
    msg: jetstream::Message,
    js: Context,
    dead_letter_subject: String,
    broker_id: String,
    count: Option<u32>,
}

impl std::fmt::Debug for JetStreamDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamDelivery")
            .field("broker_id", &self.broker_id)
            .field("count", &self.count)
            .finish_non_exhaustive()
    }
}

impl Delivery for JetStreamDelivery {
    fn payload(&self) -> &[u8] {
        &self.msg.payload
    }

    fn broker_id(&self) -> &str {
        &self.broker_id
    }

    fn delivery_count(&self) -> Option<u32> {
        self.count
    }

    async fn ack(self) -> Result<(), BrokerError> {
        self.msg.double_ack().await.map_err(BrokerError)
    }

    async fn nack(self, delay: Duration) -> Result<(), BrokerError> {
        let delay = (!delay.is_zero()).then_some(delay);
        self.msg.ack_with(AckKind::Nak(delay)).await.map_err(BrokerError)
    }

    async fn dead_letter(self, reason: &str) -> Result<(), BrokerError> {
        let mut headers = self.msg.headers.clone().unwrap_or_default();
        headers.insert(REASON_HEADER, reason.replace(['\r', '\n'], " ").as_str());
        headers.insert(BROKER_ID_HEADER, self.broker_id.as_str());
        // The copy keeps the message's `Nats-Msg-Id` (or gets its stream
        // sequence as one), so the dead-letter stream stores it once even if
        // a crash between the copy and the `+TERM` dead-letters it again.
        if headers.get("Nats-Msg-Id").is_none() {
            headers.insert("Nats-Msg-Id", self.broker_id.as_str());
        }
        self.js
            .publish_with_headers(
                self.dead_letter_subject.clone(),
                headers,
                self.msg.payload.clone(),
            )
            .await
            .map_err(BrokerError::new)?
            .await
            .map_err(BrokerError::new)?;
        self.msg.double_ack_with(AckKind::Term).await.map_err(BrokerError)
    }

    async fn extend(&self) -> Result<(), BrokerError> {
        self.msg.ack_with(AckKind::Progress).await.map_err(BrokerError)
    }
}

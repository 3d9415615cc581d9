//! RabbitMQ through lapin (feature `rabbitmq`): manual acks, a prefetch
//! window, a quorum queue that dead-letters to an exchange of its own.
//!
//! | loop action | what the adapter does |
//! | --- | --- |
//! | ack | `basic.ack` |
//! | redeliver after `delay` | RabbitMQ has no delayed requeue: the delivery stays unacked (it holds a prefetch slot, not a handler slot) for `delay`, then `basic.nack` with requeue. Keep the prefetch above the consumer's concurrency |
//! | dead-letter with a reason | publish a copy to the dead-letter exchange with the headers `x-oncely-reason` and `x-oncely-broker-id`, wait for the broker's confirm, then ack. A crash between the two dead-letters it twice, never zero times |
//! | delivery count | the quorum queue's `x-delivery-count` header (+1) |
//!
//! A dropped connection ends the [`Source`] with an error; the broker
//! requeues every unacked delivery of that connection, and the acks that
//! the in-flight handlers then attempt fail (counted as settle errors).
//! Reconnect and run the consumer again: the effects those handlers stored
//! are replayed to the redeliveries.

use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery as LapinDelivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection, ExchangeKind};

use crate::broker::{BrokerError, Delivery, Source};

pub use lapin;

/// Header with the reason of a dead-lettered message.
pub const REASON_HEADER: &str = "x-oncely-reason";
/// Header with the broker id of a dead-lettered message.
pub const BROKER_ID_HEADER: &str = "x-oncely-broker-id";

fn err(e: lapin::Error) -> BrokerError {
    BrokerError::new(e)
}

/// A work queue and its dead-letter destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RabbitTopology {
    /// The work queue (a durable quorum queue).
    pub queue: String,
    /// The fanout exchange dead-lettered messages go to (`{queue}.dlx`).
    pub dead_letter_exchange: String,
    /// The queue bound to it (`{queue}.dead`).
    pub dead_letter_queue: String,
}

impl RabbitTopology {
    /// The topology of `queue`, with the default dead-letter names.
    pub fn for_queue(queue: &str) -> Self {
        RabbitTopology {
            queue: queue.to_owned(),
            dead_letter_exchange: format!("{queue}.dlx"),
            dead_letter_queue: format!("{queue}.dead"),
        }
    }

    /// Declares the dead-letter exchange and queue, and the work queue as a
    /// quorum queue (it counts deliveries) whose own dead-letters (a
    /// `delivery-limit` reached, a reject) go to the same exchange.
    /// Idempotent.
    pub async fn declare(&self, channel: &Channel) -> Result<(), BrokerError> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                self.dead_letter_exchange.as_str().into(),
                ExchangeKind::Fanout,
                durable,
                FieldTable::default(),
            )
            .await
            .map_err(err)?;
        let queue = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(
                self.dead_letter_queue.as_str().into(),
                queue,
                FieldTable::default(),
            )
            .await
            .map_err(err)?;
        channel
            .queue_bind(
                self.dead_letter_queue.as_str().into(),
                self.dead_letter_exchange.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(err)?;
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(self.dead_letter_exchange.as_str().into()),
        );
        channel
            .queue_declare(self.queue.as_str().into(), queue, args)
            .await
            .map_err(err)?;
        Ok(())
    }

    /// Deletes the work queue, the dead-letter queue and the exchange.
    pub async fn delete(&self, channel: &Channel) -> Result<(), BrokerError> {
        for q in [&self.queue, &self.dead_letter_queue] {
            channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(err)?;
        }
        channel
            .exchange_delete(
                self.dead_letter_exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await
            .map_err(err)
    }
}

/// One consumer's subscription to a work queue, on a channel of its own.
#[derive(Debug)]
pub struct RabbitSource {
    consumer: lapin::Consumer,
    channel: Channel,
    dead_letter_exchange: ShortString,
}

impl RabbitSource {
    /// Opens a channel on `connection` in confirm mode, sets the prefetch
    /// window and starts consuming `topology.queue` with manual acks.
    /// `prefetch` should exceed the consumer's concurrency (deliveries
    /// waiting for a delayed redelivery hold prefetch slots).
    ///
    /// Give each consumer a connection of its own and close it once
    /// [`Consumer::run`](crate::Consumer::run) returns: with lapin 4.12, two
    /// subscriptions sharing a connection can fail it with `UNEXPECTED-FRAME`
    /// (a `basic.cancel-ok`) when one of them is dropped.
    pub async fn subscribe(
        connection: &Connection,
        topology: &RabbitTopology,
        prefetch: u16,
        consumer_tag: &str,
    ) -> Result<Self, BrokerError> {
        let channel = connection.create_channel().await.map_err(err)?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(err)?;
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(err)?;
        let consumer = channel
            .basic_consume(
                topology.queue.as_str().into(),
                consumer_tag.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(err)?;
        Ok(RabbitSource {
            consumer,
            channel,
            dead_letter_exchange: topology.dead_letter_exchange.as_str().into(),
        })
    }
}

impl Source for RabbitSource {
    type Delivery = RabbitDelivery;

    async fn next(&mut self) -> Result<Option<RabbitDelivery>, BrokerError> {
        match self.consumer.next().await {
            Some(Ok(delivery)) => Ok(Some(RabbitDelivery::new(
                delivery,
                self.channel.clone(),
                self.dead_letter_exchange.clone(),
            ))),
            Some(Err(e)) => Err(err(e)),
            None => Err(BrokerError::new("the consumer's channel or connection closed")),
        }
    }
}

/// A delivery from RabbitMQ.
#[derive(Debug)]
pub struct RabbitDelivery {
    delivery: LapinDelivery,
    channel: Channel,
    dead_letter_exchange: ShortString,
    broker_id: String,
    count: Option<u32>,
}

impl RabbitDelivery {
    fn new(delivery: LapinDelivery, channel: Channel, dead_letter_exchange: ShortString) -> Self {
        let broker_id = match delivery.properties.message_id() {
            Some(id) => id.as_str().to_owned(),
            None => format!("tag-{}", delivery.delivery_tag),
        };
        let returned = delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("x-delivery-count"))
            .and_then(as_u32);
        let count = match returned {
            Some(n) => Some(n.saturating_add(1)),
            // A classic queue only says whether it was delivered before.
            None if delivery.redelivered => None,
            None => Some(1),
        };
        RabbitDelivery {
            delivery,
            channel,
            dead_letter_exchange,
            broker_id,
            count,
        }
    }

    /// Whether RabbitMQ flagged this delivery as a redelivery.
    pub fn redelivered(&self) -> bool {
        self.delivery.redelivered
    }
}

fn as_u32(v: &AMQPValue) -> Option<u32> {
    let n: i64 = match v {
        AMQPValue::ShortShortInt(n) => (*n).into(),
        AMQPValue::ShortShortUInt(n) => (*n).into(),
        AMQPValue::ShortInt(n) => (*n).into(),
        AMQPValue::ShortUInt(n) => (*n).into(),
        AMQPValue::LongInt(n) => (*n).into(),
        AMQPValue::LongUInt(n) => (*n).into(),
        AMQPValue::LongLongInt(n) => *n,
        _ => return None,
    };
    u32::try_from(n).ok()
}

fn settled(what: &str, r: Result<bool, lapin::Error>) -> Result<(), BrokerError> {
    match r {
        Ok(true) => Ok(()),
        Ok(false) => Err(BrokerError::new(format!(
            "{what} not sent: the channel closed or the delivery was already settled"
        ))),
        Err(e) => Err(err(e)),
    }
}

impl Delivery for RabbitDelivery {
    fn payload(&self) -> &[u8] {
        &self.delivery.data
    }

    fn broker_id(&self) -> &str {
        &self.broker_id
    }

    fn delivery_count(&self) -> Option<u32> {
        self.count
    }

    async fn ack(self) -> Result<(), BrokerError> {
        settled("ack", self.delivery.acker.ack(BasicAckOptions::default()).await)
    }

    async fn nack(self, delay: Duration) -> Result<(), BrokerError> {
        let requeue = BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        };
        if delay.is_zero() {
            return settled("nack", self.delivery.acker.nack(requeue).await);
        }
        let (acker, id) = (self.delivery.acker, self.broker_id);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            if let Err(e) = settled("nack", acker.nack(requeue).await) {
                // The connection is gone, so the broker requeued it already.
                tracing::debug!(broker_id = id, error = %e, "delayed nack not sent");
            }
        });
        Ok(())
    }

    async fn dead_letter(self, reason: &str) -> Result<(), BrokerError> {
        let mut headers = self.delivery.properties.headers().clone().unwrap_or_default();
        headers.insert(
            REASON_HEADER.into(),
            AMQPValue::LongString(LongString::from(reason)),
        );
        headers.insert(
            BROKER_ID_HEADER.into(),
            AMQPValue::LongString(LongString::from(self.broker_id.as_str())),
        );
        let properties = self.delivery.properties.clone().with_headers(headers);
        let confirm = self
            .channel
            .basic_publish(
                self.dead_letter_exchange.clone(),
                self.delivery.routing_key.clone(),
                BasicPublishOptions::default(),
                &self.delivery.data,
                properties,
            )
            .await
            .map_err(err)?
            .await
            .map_err(err)?;
        if !confirm.is_ack() {
            return Err(BrokerError::new("the broker refused the dead-letter copy"));
        }
        settled("ack", self.delivery.acker.ack(BasicAckOptions::default()).await)
    }
}

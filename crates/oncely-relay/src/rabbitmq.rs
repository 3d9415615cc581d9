//! RabbitMQ through lapin (feature `rabbitmq`).
//!
//! | outbox message | AMQP |
//! | --- | --- |
//! | destination | the routing key, on the exchange the publisher was made with (`""`: the default exchange, where the routing key names a queue) |
//! | message id | the `message-id` property |
//! | headers | the `headers` table, as long strings |
//! | confirmed | a publisher confirm (`basic.ack`); the message is persistent (delivery mode 2) and mandatory: one no queue receives comes back, and is retried (a queue may be declared later) |
//!
//! RabbitMQ keeps no record of message ids: a copy published again (a relay
//! that died between the confirm and its mark) reaches the queue again, and
//! the consumer's oncely ledger drops it (it keys its effect on the event,
//! as every oncely consumer does).

use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use oncely::outbox::{Pending, PublishError, Publisher};
use tokio::sync::Mutex;

pub use lapin;

/// Publishes to one exchange of a RabbitMQ server, reconnecting after a
/// connection or channel failure (the next publish opens a new one).
pub struct RabbitPublisher {
    url: String,
    exchange: String,
    channel: Mutex<Option<(Connection, Channel)>>,
}

impl std::fmt::Debug for RabbitPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitPublisher")
            .field("exchange", &self.exchange)
            .finish_non_exhaustive()
    }
}

fn retryable(what: &str, e: impl std::fmt::Display) -> PublishError {
    PublishError::retryable(format!("rabbitmq: {what}: {e}"))
}

impl RabbitPublisher {
    /// A publisher to `exchange` (`""`: the default exchange) of the server
    /// at `url` (`amqp://user:pass@host:port/vhost`). Connects at once, so
    /// a wrong URL or an unreachable server is an error here.
    pub async fn connect(url: &str, exchange: &str) -> Result<Self, PublishError> {
        let publisher = RabbitPublisher {
            url: url.to_owned(),
            exchange: exchange.to_owned(),
            channel: Mutex::new(None),
        };
        let opened = publisher.open().await?;
        *publisher.channel.lock().await = Some(opened);
        Ok(publisher)
    }

    async fn open(&self) -> Result<(Connection, Channel), PublishError> {
        let conn = Connection::connect(&self.url, ConnectionProperties::default())
            .await
            .map_err(|e| retryable("connect", e))?;
        let channel = conn
            .create_channel()
            .await
            .map_err(|e| retryable("open a channel", e))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| retryable("confirm mode", e))?;
        Ok((conn, channel))
    }

    async fn channel(&self) -> Result<Channel, PublishError> {
        let mut slot = self.channel.lock().await;
        if let Some((conn, channel)) = slot.as_ref()
            && conn.status().connected()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        let (conn, channel) = self.open().await?;
        *slot = Some((conn, channel.clone()));
        Ok(channel)
    }
}

impl Publisher for RabbitPublisher {
    async fn publish(&self, message: &Pending) -> Result<(), PublishError> {
        let channel = self.channel().await?;
        let mut headers = FieldTable::default();
        for (name, value) in &message.headers {
            headers.insert(
                ShortString::from(name.as_str()),
                AMQPValue::LongString(LongString::from(value.as_str())),
            );
        }
        let properties = BasicProperties::default()
            .with_message_id(ShortString::from(message.message_id()))
            .with_delivery_mode(2)
            .with_headers(headers);
        let confirm = channel
            .basic_publish(
                self.exchange.as_str().into(),
                message.destination.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &message.payload,
                properties,
            )
            .await
            .map_err(|e| retryable("publish", e))?
            .await
            .map_err(|e| retryable("confirm", e))?;
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(PublishError::retryable(format!(
                "rabbitmq: no queue is bound to routing key {:?} on exchange {:?}: the message came back",
                message.destination, self.exchange
            ))),
            Confirmation::Nack(_) => Err(PublishError::retryable(
                "rabbitmq: the broker refused the message (basic.nack)",
            )),
            Confirmation::NotRequested => Err(PublishError::retryable(
                "rabbitmq: the channel is not in confirm mode",
            )),
        }
    }

    fn describe(&self) -> String {
        let host = self.url.rsplit('@').next().unwrap_or(&self.url);
        let host = host.trim_start_matches("amqp://").trim_start_matches("amqps://");
        format!("rabbitmq {host}, exchange {:?}", self.exchange)
    }
}

//! What the loop needs from a broker: a source of deliveries, and a
//! delivery that can be acked, redelivered later or dead-lettered.

use std::future::Future;
use std::time::Duration;

use oncely::BoxError;

/// A broker operation failed (the connection dropped, a channel closed).
#[derive(Debug, thiserror::Error)]
#[error("broker: {0}")]
pub struct BrokerError(#[source] pub BoxError);

impl BrokerError {
    /// A broker error from anything that converts into a boxed error.
    pub fn new(e: impl Into<BoxError>) -> Self {
        BrokerError(e.into())
    }
}

/// One message as the broker handed it over, and the three ways to settle
/// it. Settling consumes the delivery, so each is settled once.
///
/// A delivery dropped without being settled is the broker's business: every
/// broker redelivers it once the consumer's connection or ack deadline ends.
pub trait Delivery: Send + Sync + 'static {
    /// The message body.
    fn payload(&self) -> &[u8];

    /// The broker's id of this message, for logs only: a re-published
    /// message gets a new one, so it never becomes part of an effect key.
    fn broker_id(&self) -> &str;

    /// How many times the broker has delivered this message, this delivery
    /// included, where the broker tells (`None` otherwise).
    fn delivery_count(&self) -> Option<u32>;

    /// Done: the broker forgets the message.
    fn ack(self) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Deliver it again after `delay` (zero: as soon as the broker likes).
    fn nack(self, delay: Duration) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Never deliver it again here: move it to the dead-letter destination
    /// with `reason`.
    fn dead_letter(self, reason: &str) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Tell the broker the message is still being worked on, where it has an
    /// ack deadline (JetStream's in-progress ack). The loop calls it every
    /// [`ConsumerOptions::extend_every`](crate::ConsumerOptions::extend_every)
    /// while the handler runs. The default does nothing.
    fn extend(&self) -> impl Future<Output = Result<(), BrokerError>> + Send {
        async { Ok(()) }
    }
}

/// Where deliveries come from: one consumer's subscription.
pub trait Source: Send + 'static {
    /// The deliveries this source yields.
    type Delivery: Delivery;

    /// The next delivery; `Ok(None)` when the source has closed for good.
    /// An error ends the loop (after the in-flight deliveries are settled),
    /// so its caller can reconnect.
    fn next(&mut self) -> impl Future<Output = Result<Option<Self::Delivery>, BrokerError>> + Send;
}

//! NATS JetStream through async-nats (feature `nats`).
//!
//! | outbox message | JetStream |
//! | --- | --- |
//! | destination | the subject (a stream must capture it) |
//! | message id | the `Nats-Msg-Id` header: the stream drops a copy published again within its duplicate window (`duplicate_window`, 2 minutes by default) |
//! | headers | message headers |
//! | confirmed | the stream's publish ack; a copy the stream dropped as a duplicate is acked too (its first copy is stored) |
//!
//! A copy published after the duplicate window (a relay stalled longer than
//! that) is stored again; the consumer's oncely ledger drops it.

use async_nats::HeaderMap;
use async_nats::jetstream::{self, Context};
use oncely::outbox::{Pending, PublishError, Publisher};

pub use async_nats;

/// Publishes to the JetStream of a NATS server or cluster. The client
/// reconnects by itself; a publish while it is disconnected fails after the
/// ack timeout and is retried by the relay.
#[derive(Clone)]
pub struct JetStreamPublisher {
    context: Context,
    server: String,
}

impl std::fmt::Debug for JetStreamPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamPublisher")
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

impl JetStreamPublisher {
    /// A publisher on `client`'s JetStream; `server` names it in logs.
    pub fn new(client: async_nats::Client, server: &str) -> Self {
        JetStreamPublisher {
            context: jetstream::new(client),
            server: server.to_owned(),
        }
    }

    /// Connects to `url` (`nats://host:port`, several separated by commas).
    pub async fn connect(url: &str) -> Result<Self, PublishError> {
        let client = async_nats::connect(url)
            .await
            .map_err(|e| PublishError::retryable(format!("nats: connect to {url}: {e}")))?;
        Ok(JetStreamPublisher::new(client, url))
    }
}

impl Publisher for JetStreamPublisher {
    async fn publish(&self, message: &Pending) -> Result<(), PublishError> {
        let mut headers = HeaderMap::new();
        for (name, value) in &message.headers {
            headers.insert(name.as_str(), value.as_str());
        }
        headers.insert("Nats-Msg-Id", message.message_id().as_str());
        let ack = self
            .context
            .publish_with_headers(
                message.destination.clone(),
                headers,
                message.payload.clone().into(),
            )
            .await
            .map_err(|e| PublishError::retryable(format!("nats: publish to {}: {e}", message.destination)))?;
        ack.await
            .map_err(|e| PublishError::retryable(format!("nats: no ack for {}: {e}", message.destination)))?;
        Ok(())
    }

    fn describe(&self) -> String {
        format!("nats {}", self.server)
    }
}

//! Redis Streams through redis-rs (feature `redis`).
//!
//! | outbox message | Redis Streams |
//! | --- | --- |
//! | destination | the stream key |
//! | message id | the entry's `message_id` field (entry ids are the server's) |
//! | headers | one field each, named `h:<name>` |
//! | payload | the `payload` field |
//! | confirmed | the `XADD` reply |
//!
//! Redis keeps no record of message ids: a copy published again (a relay
//! that died between the reply and its mark) is a second entry, and the
//! consumer's oncely ledger drops it. The server's persistence decides what
//! a crash of Redis itself keeps.

use oncely::outbox::{Pending, PublishError, Publisher};
use redis::aio::ConnectionManager;

pub use redis;

/// The field of an entry that carries the payload.
pub const PAYLOAD_FIELD: &str = "payload";
/// The field of an entry that carries the message id.
pub const MESSAGE_ID_FIELD: &str = "message_id";
/// The prefix of the fields that carry headers.
pub const HEADER_PREFIX: &str = "h:";

/// Publishes to the streams of one Redis server, reconnecting by itself
/// (redis-rs's connection manager).
#[derive(Clone)]
pub struct StreamPublisher {
    conn: ConnectionManager,
    server: String,
}

impl std::fmt::Debug for StreamPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamPublisher")
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

impl StreamPublisher {
    /// Connects to `url` (`redis://host:port/db`).
    pub async fn connect(url: &str) -> Result<Self, PublishError> {
        let client =
            redis::Client::open(url).map_err(|e| PublishError::permanent(format!("redis: {url}: {e}")))?;
        let conn = ConnectionManager::new(client)
            .await
            .map_err(|e| PublishError::retryable(format!("redis: connect: {e}")))?;
        let server = url.rsplit('@').next().unwrap_or(url).to_owned();
        Ok(StreamPublisher { conn, server })
    }
}

impl Publisher for StreamPublisher {
    async fn publish(&self, message: &Pending) -> Result<(), PublishError> {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&message.destination)
            .arg("*")
            .arg(MESSAGE_ID_FIELD)
            .arg(message.message_id())
            .arg(PAYLOAD_FIELD)
            .arg(&message.payload);
        for (name, value) in &message.headers {
            cmd.arg(format!("{HEADER_PREFIX}{name}")).arg(value);
        }
        let mut conn = self.conn.clone();
        cmd.query_async::<String>(&mut conn).await.map_err(|e| {
            let text = format!("redis: XADD {}: {e}", message.destination);
            // A key of another type: never a stream, whatever the retries.
            if e.code() == Some("WRONGTYPE") {
                PublishError::permanent(text)
            } else {
                PublishError::retryable(text)
            }
        })?;
        Ok(())
    }

    fn describe(&self) -> String {
        format!("redis {}", self.server.trim_start_matches("redis://"))
    }
}

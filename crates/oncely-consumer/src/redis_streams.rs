//! Redis Streams through redis-rs (feature `redis-streams`): a consumer
//! group, `XACK`, and `XAUTOCLAIM` for deliveries stuck on a dead consumer.
//!
//! | loop action | what the adapter does |
//! | --- | --- |
//! | ack | `XACK` |
//! | redeliver after `delay` | the entry stays pending; `XCLAIM … IDLE` sets its idle time so that `XAUTOCLAIM` (by any consumer of the group) takes it once `delay` has passed (at the latest after the claim idle time) |
//! | dead-letter with a reason | `XACK` and, if the entry was still pending, `XADD` to the dead-letter stream (`payload`, `reason`, `broker_id`), in one script: dead-lettered once |
//! | ack deadline | Redis has none, but a pending entry idle for the claim idle time is taken over: the loop's in-progress heartbeat is `XCLAIM … JUSTID` to itself, resetting the idle time. Keep [`ConsumerOptions::extend_every`](crate::ConsumerOptions::extend_every) well below the claim idle time |
//! | delivery count | 1 for a new entry, the group's delivery counter (`XPENDING`) for a claimed one |
//!
//! A consumer that dies leaves its entries pending; the others claim them
//! with `XAUTOCLAIM` once they have been idle for the claim idle time.
//!
//! On Redis Cluster, give the stream a hash tag (`{payments}`) so that it
//! and its dead-letter stream (`{payments}:dead`) share a slot.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::{Client, Value};

use crate::broker::{BrokerError, Delivery, Source};

pub use redis;

/// The field that holds the payload of an entry.
pub const PAYLOAD_FIELD: &str = "payload";

/// Acks the entry and, only if it was still pending, copies it to the
/// dead-letter stream: one atomic script, so an entry is dead-lettered once
/// even when two consumers hold it.
const DEAD_LETTER_LUA: &str = r"
local n = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if n == 1 then
  redis.call('XADD', KEYS[2], '*', 'payload', ARGV[3], 'reason', ARGV[4], 'broker_id', ARGV[2])
end
return n
";

/// How long a blocking read waits for new entries (below redis-rs's
/// default response timeout).
const BLOCK: Duration = Duration::from_millis(200);

/// A stream, its consumer group and its dead-letter stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisStreamTopology {
    /// The work stream.
    pub stream: String,
    /// The consumer group every worker joins (`workers`).
    pub group: String,
    /// The dead-letter stream (`{stream}:dead`): fields `payload`,
    /// `reason`, `broker_id`.
    pub dead_letter_stream: String,
}

impl RedisStreamTopology {
    /// The topology of `stream`, with the default names.
    pub fn new(stream: &str) -> Self {
        RedisStreamTopology {
            stream: stream.to_owned(),
            group: "workers".to_owned(),
            dead_letter_stream: format!("{stream}:dead"),
        }
    }

    /// Creates the group (and the stream) if missing, reading from the
    /// stream's start.
    pub async fn declare(&self, conn: &mut MultiplexedConnection) -> Result<(), BrokerError> {
        let created: Result<Value, _> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.stream)
            .arg(&self.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(conn)
            .await;
        match created {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(BrokerError::new(e)),
        }
    }

    /// How many entries the group has delivered and not yet acked.
    pub async fn pending(&self, conn: &mut MultiplexedConnection) -> Result<u64, BrokerError> {
        let v: Value = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(&self.group)
            .query_async(conn)
            .await
            .map_err(BrokerError::new)?;
        match v {
            Value::Array(items) => Ok(items.first().and_then(as_int).unwrap_or(0)),
            other => Err(unexpected("XPENDING", &other)),
        }
    }

    /// Deletes both streams (and so the group).
    pub async fn delete(&self, conn: &mut MultiplexedConnection) -> Result<(), BrokerError> {
        redis::cmd("DEL")
            .arg(&self.stream)
            .arg(&self.dead_letter_stream)
            .query_async::<Value>(conn)
            .await
            .map_err(BrokerError::new)?;
        Ok(())
    }
}

fn as_int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(n) => u64::try_from(*n).ok(),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

fn as_string(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn unexpected(what: &str, v: &Value) -> BrokerError {
    BrokerError::new(format!("unexpected {what} reply: {v:?}"))
}

/// `[[id, [field, value, …]], …]` into (id, payload); an entry deleted
/// from the stream while pending has no fields and no payload.
fn entries(v: &Value) -> Vec<(String, Option<Vec<u8>>)> {
    let Value::Array(list) = v else { return Vec::new() };
    list.iter()
        .filter_map(|e| {
            let Value::Array(parts) = e else { return None };
            let id = as_string(parts.first()?)?;
            let payload = match parts.get(1) {
                Some(Value::Array(fields)) => fields
                    .chunks(2)
                    .find(|kv| as_string(&kv[0]).as_deref() == Some(PAYLOAD_FIELD))
                    .and_then(|kv| match kv.get(1) {
                        Some(Value::BulkString(b)) => Some(b.clone()),
                        _ => None,
                    }),
                _ => None,
            };
            Some((id, payload))
        })
        .collect()
}

/// One worker of the group: a consumer name, a connection for blocking
/// reads and one for acks.
pub struct RedisStreamSource {
    reader: MultiplexedConnection,
    writer: MultiplexedConnection,
    topology: RedisStreamTopology,
    consumer: String,
    batch: usize,
    claim_idle: Duration,
    cursor: String,
    last_claim: Option<Instant>,
    buffer: VecDeque<RedisStreamDelivery>,
}

impl std::fmt::Debug for RedisStreamSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamSource")
            .field("topology", &self.topology)
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

impl RedisStreamSource {
    /// Joins the group as `consumer`, reading at most `batch` entries at a
    /// time (pass the consumer's concurrency) and claiming entries that have
    /// been pending on any consumer for `claim_idle`.
    pub async fn subscribe(
        client: &Client,
        topology: &RedisStreamTopology,
        consumer: &str,
        batch: usize,
        claim_idle: Duration,
    ) -> Result<Self, BrokerError> {
        let reader = client
            .get_multiplexed_async_connection()
            .await
            .map_err(BrokerError::new)?;
        let writer = client
            .get_multiplexed_async_connection()
            .await
            .map_err(BrokerError::new)?;
        Ok(RedisStreamSource {
            reader,
            writer,
            topology: topology.clone(),
            consumer: consumer.to_owned(),
            batch: batch.max(1),
            claim_idle,
            cursor: "0-0".to_owned(),
            last_claim: None,
            buffer: VecDeque::new(),
        })
    }

    fn delivery(&self, id: String, payload: Option<Vec<u8>>, count: Option<u32>) -> RedisStreamDelivery {
        RedisStreamDelivery {
            conn: self.writer.clone(),
            topology: self.topology.clone(),
            consumer: self.consumer.clone(),
            claim_idle: self.claim_idle,
            id,
            payload: payload.unwrap_or_default(),
            count,
        }
    }

    /// Claims entries idle on any consumer for `claim_idle`.
    async fn autoclaim(&mut self) -> Result<(), BrokerError> {
        let v: Value = redis::cmd("XAUTOCLAIM")
            .arg(&self.topology.stream)
            .arg(&self.topology.group)
            .arg(&self.consumer)
            .arg(self.claim_idle.as_millis() as u64)
            .arg(&self.cursor)
            .arg("COUNT")
            .arg(self.batch)
            .query_async(&mut self.reader)
            .await
            .map_err(BrokerError::new)?;
        let Value::Array(parts) = &v else {
            return Err(unexpected("XAUTOCLAIM", &v));
        };
        self.cursor = parts
            .first()
            .and_then(as_string)
            .unwrap_or_else(|| "0-0".to_owned());
        for (id, payload) in entries(parts.get(1).unwrap_or(&Value::Nil)) {
            let count = self.delivery_count(&id).await?;
            let d = self.delivery(id, payload, count);
            self.buffer.push_back(d);
        }
        Ok(())
    }

    async fn delivery_count(&mut self, id: &str) -> Result<Option<u32>, BrokerError> {
        let v: Value = redis::cmd("XPENDING")
            .arg(&self.topology.stream)
            .arg(&self.topology.group)
            .arg(id)
            .arg(id)
            .arg(1)
            .query_async(&mut self.reader)
            .await
            .map_err(BrokerError::new)?;
        let count = match &v {
            Value::Array(rows) => match rows.first() {
                Some(Value::Array(row)) => row.get(3).and_then(as_int),
                _ => None,
            },
            _ => None,
        };
        Ok(count.and_then(|n| u32::try_from(n).ok()))
    }
}

impl Source for RedisStreamSource {
    type Delivery = RedisStreamDelivery;

    async fn next(&mut self) -> Result<Option<RedisStreamDelivery>, BrokerError> {
        loop {
            if let Some(d) = self.buffer.pop_front() {
                return Ok(Some(d));
            }
            if self
                .last_claim
                .is_none_or(|at| at.elapsed() >= self.claim_idle / 4)
            {
                self.last_claim = Some(Instant::now());
                self.autoclaim().await?;
                if !self.buffer.is_empty() {
                    continue;
                }
            }
            let v: Value = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(&self.topology.group)
                .arg(&self.consumer)
                .arg("COUNT")
                .arg(self.batch)
                .arg("BLOCK")
                .arg(BLOCK.as_millis() as u64)
                .arg("STREAMS")
                .arg(&self.topology.stream)
                .arg(">")
                .query_async(&mut self.reader)
                .await
                .map_err(BrokerError::new)?;
            if let Value::Array(streams) = &v {
                for s in streams {
                    let Value::Array(kv) = s else { continue };
                    for (id, payload) in entries(kv.get(1).unwrap_or(&Value::Nil)) {
                        let d = self.delivery(id, payload, Some(1));
                        self.buffer.push_back(d);
                    }
                }
            }
        }
    }
}

/// A delivery from a Redis stream.
pub struct RedisStreamDelivery {
    conn: MultiplexedConnection,
    topology: RedisStreamTopology,
    consumer: String,
    claim_idle: Duration,
    id: String,
    payload: Vec<u8>,
    count: Option<u32>,
}

impl std::fmt::Debug for RedisStreamDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamDelivery")
            .field("id", &self.id)
            .field("count", &self.count)
            .finish_non_exhaustive()
    }
}

impl RedisStreamDelivery {
    /// `XCLAIM` to this consumer with the given idle time, keeping the
    /// delivery counter (`JUSTID`).
    async fn reclaim(&self, idle: Duration) -> Result<(), BrokerError> {
        redis::cmd("XCLAIM")
            .arg(&self.topology.stream)
            .arg(&self.topology.group)
            .arg(&self.consumer)
            .arg(0)
            .arg(&self.id)
            .arg("IDLE")
            .arg(idle.as_millis() as u64)
            .arg("JUSTID")
            .query_async::<Value>(&mut self.conn.clone())
            .await
            .map_err(BrokerError::new)?;
        Ok(())
    }
}

impl Delivery for RedisStreamDelivery {
    fn payload(&self) -> &[u8] {
        &self.payload
    }

    fn broker_id(&self) -> &str {
        &self.id
    }

    fn delivery_count(&self) -> Option<u32> {
        self.count
    }

    async fn ack(mut self) -> Result<(), BrokerError> {
        let n: i64 = redis::cmd("XACK")
            .arg(&self.topology.stream)
            .arg(&self.topology.group)
            .arg(&self.id)
            .query_async(&mut self.conn)
            .await
            .map_err(BrokerError::new)?;
        if n == 1 {
            Ok(())
        } else {
            Err(BrokerError::new(format!("{} was no longer pending", self.id)))
        }
    }

    async fn nack(self, delay: Duration) -> Result<(), BrokerError> {
        // Claimable by XAUTOCLAIM once idle for claim_idle: start it at
        // claim_idle - delay.
        self.reclaim(self.claim_idle.saturating_sub(delay)).await
    }

    async fn dead_letter(mut self, reason: &str) -> Result<(), BrokerError> {
        let acked: i64 = redis::cmd("EVAL")
            .arg(DEAD_LETTER_LUA)
            .arg(2)
            .arg(&self.topology.stream)
            .arg(&self.topology.dead_letter_stream)
            .arg(&self.topology.group)
            .arg(&self.id)
            .arg(&self.payload)
            .arg(reason)
            .query_async(&mut self.conn)
            .await
            .map_err(BrokerError::new)?;
        if acked == 1 {
            Ok(())
        } else {
            Err(BrokerError::new(format!("{} was no longer pending", self.id)))
        }
    }

    async fn extend(&self) -> Result<(), BrokerError> {
        self.reclaim(Duration::ZERO).await
    }
}

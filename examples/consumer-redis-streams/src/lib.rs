//! # consumer-redis-streams: oncely behind a Redis Streams consumer group
//!
//! The few lines a user writes are [`Payments`]: decode the message, derive
//! the effect keys from the order id (never from the entry id), run each
//! effect with [`Effects::run_reported`] and say whether anything ran.
//! [`run`] wires it to a Redis stream with `oncely-consumer`: a consumer
//! group and a dead-letter stream, two consumers, duplicates (the same order
//! added twice) and poison messages, then reports what happened.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncely::backend::Ledger;
use oncely::{ClaimOptions, EffectKey, Effects, How, Tenant};
use oncely_consumer::redis_streams::redis::{self, Client, Value};
use oncely_consumer::redis_streams::{PAYLOAD_FIELD, RedisStreamSource, RedisStreamTopology};
use oncely_consumer::{Consumer, ConsumerOptions, Context, Handler, HandlerError, Stats, json};
use oncely_testkit::fakes::{FakeMailer, FakeProvider};
use oncely_testkit::{Drain, Progress};
use serde::{Deserialize, Serialize};

/// The message: pay for an order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PayOrder {
    /// The order (every effect key comes from it). Optional so that a
    /// message without it is dead-lettered as missing a key field.
    pub order_id: Option<String>,
    /// Cents.
    pub amount: i64,
}

/// Capture the payment (provider-keyed), then send the receipt (at most
/// once).
pub struct Payments<L> {
    /// The runner over the ledger.
    pub effects: Effects<L>,
    /// The tenant of every key.
    pub tenant: Tenant,
    /// The payment provider (honours idempotency keys).
    pub provider: Arc<FakeProvider>,
    /// The mailer (does not).
    pub mailer: Arc<FakeMailer>,
}

impl<L: Ledger + 'static> Handler for Payments<L> {
    type Message = PayOrder;

    fn decode(&self, payload: &[u8]) -> Result<PayOrder, String> {
        json(payload)
    }

    async fn handle(&self, msg: PayOrder, _ctx: Context) -> Result<How, HandlerError> {
        let order = msg.order_id.ok_or(HandlerError::missing_field("order_id"))?;
        // A short wait for a holder elsewhere, then the broker redelivers.
        let opts = ClaimOptions::for_consumer();
        let capture = EffectKey::new(&self.tenant, "capture", &order)?;
        let captured = self
            .effects
            .run_reported(&capture, &opts, |lease| {
                let order = &order;
                async move {
                    let key = lease.provider_key();
                    Ok(self.provider.capture(&key, order, msg.amount).await)
                }
            })
            .await?;
        let receipt = EffectKey::new(&self.tenant, "receipt", &order)?;
        let sent = self
            .effects
            .run_reported(&receipt, &opts.clone().at_most_once(true), |_| async {
                self.mailer.send_receipt(&order).await;
                Ok(())
            })
            .await?;
        // Ran if either step ran; replayed only if both were.
        Ok(captured.how | sent.how)
    }
}

/// What [`run`] saw.
#[derive(Debug, Clone)]
pub struct Summary {
    /// The consumers' stats, summed.
    pub stats: Stats,
    /// Orders captured exactly once at the provider.
    pub captured_once: usize,
    /// Orders published.
    pub orders: usize,
    /// Messages in the dead-letter queue.
    pub dead_lettered: u32,
}

/// Adds `orders` orders (each twice) and two poison messages to a fresh
/// stream on `redis_url`, consumes them with two consumers of one group
/// over `ledger`, and deletes the streams.
pub async fn run<L: Ledger + Clone + 'static>(
    ledger: L,
    redis_url: &str,
    orders: usize,
) -> anyhow::Result<Summary> {
    let client = Client::open(redis_url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    let topology = RedisStreamTopology::new(&format!("consumer-redis-streams:{nanos:x}"));
    topology
        .declare(&mut conn)
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    // Delete the streams whatever happens.
    let outcome = async {
        let mut conn = conn.clone();
        let mut publish: Vec<Vec<u8>> = Vec::new();
        for _copy in 0..2 {
            for i in 0..orders {
                let msg = PayOrder {
                    order_id: Some(format!("order-{i}")),
                    amount: 1000 + i as i64,
                };
                publish.push(serde_json::to_vec(&msg)?);
            }
        }
        publish.push(b"{not json".to_vec());
        publish.push(br#"{"amount":5}"#.to_vec());
        for payload in publish {
            let _: String = redis::cmd("XADD")
                .arg(&topology.stream)
                .arg("*")
                .arg(PAYLOAD_FIELD)
                .arg(payload)
                .query_async(&mut conn)
                .await?;
        }

        let tenant = Tenant::new(format!("example-{nanos:x}"))?;
        let provider = Arc::new(FakeProvider::new(true));
        let mailer = Arc::new(FakeMailer::default());
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut runs = Vec::new();
        let mut consumers = Vec::new();
        for c in 0..2 {
            let handler = Payments {
                effects: Effects::new(ledger.clone()),
                tenant: tenant.clone(),
                provider: provider.clone(),
                mailer: mailer.clone(),
            };
            let consumer = Arc::new(
                Consumer::new(format!("payments-{c}"), handler).options(
                    ConsumerOptions::default()
                        .concurrency(4)
                        .in_progress_delay(Duration::from_millis(200))
                        .extend_every(Duration::from_secs(3)),
                ),
            );
            consumers.push(consumer.clone());
            let source = RedisStreamSource::subscribe(
                &client,
                &topology,
                &format!("payments-{c}"),
                4,
                Duration::from_secs(10),
            )
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
            let mut stop = stop_rx.clone();
            runs.push(tokio::spawn(async move {
                consumer
                    .run(source, async move {
                        let _ = stop.wait_for(|s| *s).await;
                    })
                    .await
            }));
        }
        // Until everything was settled and nothing has moved for a moment
        // (the test kit's drain, any broker).
        let mut dead_lettered = 0;
        Drain::default()
            .until(async || {
                let pending = topology
                    .pending(&mut conn)
                    .await
                    .map_err(|e| anyhow::anyhow!(e))?;
                let dead: Value = redis::cmd("XLEN")
                    .arg(&topology.dead_letter_stream)
                    .query_async(&mut conn)
                    .await?;
                let dead = match dead {
                    Value::Int(n) => n,
                    _ => 0,
                };
                dead_lettered = dead as u32;
                let seen = consumers.iter().fold(Stats::default(), |s, c| s.plus(c.stats()));
                let drained =
                    provider.captures().len() == orders && pending == 0 && dead == 2 && seen.in_flight() == 0;
                Ok::<_, anyhow::Error>(Progress::new(
                    drained,
                    seen.ran + seen.replayed + seen.dead_lettered,
                ))
            })
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        stop_tx.send(true)?;
        let mut stats = Stats::default();
        for r in runs {
            stats = stats.plus(r.await?.map_err(|e| anyhow::anyhow!(e))?);
        }
        Ok::<_, anyhow::Error>(Summary {
            stats,
            captured_once: provider.captures().values().filter(|n| **n == 1).count(),
            orders,
            dead_lettered,
        })
    }
    .await;
    topology.delete(&mut conn).await.map_err(|e| anyhow::anyhow!(e))?;
    outcome
}

//! # consumer-kafka: oncely behind a Kafka consumer group
//!
//! The few lines a user writes are [`Payments`]: decode the message, derive
//! the effect keys from the order id (never from the topic, partition and
//! offset, which change when a producer re-publishes or a topic is
//! mirrored), run each effect with [`Effects::run_reported`] and say whether
//! anything ran. [`run`] wires it to Kafka with `oncely-consumer`: a topic
//! and its dead-letter topic, two members of one consumer group, duplicates
//! (the same order published twice, at two offsets) and poison messages,
//! then prints what happened and checks that every order was captured once.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncely::backend::Ledger;
use oncely::{ClaimOptions, EffectKey, Effects, How, OnInProgress, Tenant};
use oncely_consumer::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use oncely_consumer::kafka::rdkafka::client::DefaultClientContext;
use oncely_consumer::kafka::rdkafka::producer::FutureRecord;
use oncely_consumer::kafka::{KafkaConfig, KafkaSource};
use oncely_consumer::{Consumer, ConsumerOptions, Context, Handler, HandlerError, Stats, json};
use oncely_testkit::fakes::{FakeMailer, FakeProvider};
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
        // Wait a little for a holder elsewhere, then let the broker come back.
        let opts = ClaimOptions::default().on_in_progress(OnInProgress::Wait {
            max: Duration::from_millis(200),
        });
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
        Ok(if captured.how == How::Ran || sent.how == How::Ran {
            How::Ran
        } else {
            How::Replayed
        })
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
    /// Partitions taken from a member by a rebalance (the second member
    /// joining, and each member's close).
    pub partitions_revoked: u64,
}

/// Publishes `orders` orders (each twice, at two offsets) and two poison
/// messages to a fresh 4-partition topic on `brokers`, and consumes them with
/// two members of one group over `ledger`.
pub async fn run<L: Ledger + Clone + 'static>(
    ledger: L,
    brokers: &str,
    orders: usize,
) -> anyhow::Result<Summary> {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    let topic = format!("consumer-kafka-{nanos:x}");
    let config = KafkaConfig::new(brokers, &format!("{topic}-payments"), &[&topic])
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .set("fetch.wait.max.ms", "50");
    let admin: AdminClient<DefaultClientContext> = config.producer_config().create()?;
    let created = admin
        .create_topics(
            [
                &NewTopic::new(&topic, 4, TopicReplication::Fixed(1)),
                &NewTopic::new(&config.dead_letter_topic, 1, TopicReplication::Fixed(1)),
            ],
            &AdminOptions::new(),
        )
        .await?;
    for r in created {
        r.map_err(|(t, e)| anyhow::anyhow!("create topic {t}: {e}"))?;
    }

    // Keyed by order: both copies of an order land on one partition.
    let producer = config.producer()?;
    let mut publish = Vec::new();
    for _copy in 0..2 {
        for i in 0..orders {
            let msg = PayOrder {
                order_id: Some(format!("order-{i}")),
                amount: 1000 + i as i64,
            };
            publish.push((format!("order-{i}"), serde_json::to_vec(&msg)?));
        }
    }
    publish.push(("poison-1".into(), b"{not json".to_vec()));
    publish.push(("poison-2".into(), br#"{"amount":5}"#.to_vec()));
    for (key, payload) in &publish {
        producer
            .send(
                FutureRecord::to(&topic).key(key).payload(payload),
                Duration::from_secs(30),
            )
            .await
            .map_err(|(e, _)| anyhow::anyhow!("publish {key}: {e}"))?;
    }

    let tenant = Tenant::new(format!("example-{nanos:x}"))?;
    let provider = Arc::new(FakeProvider::new(true));
    let mailer = Arc::new(FakeMailer::default());
    let mut runs = Vec::new();
    let mut consumers = Vec::new();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
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
                    .in_progress_delay(Duration::from_millis(200)),
            ),
        );
        consumers.push(consumer.clone());
        let source = KafkaSource::subscribe(&config)?;
        let handle = source.handle();
        let mut stop = stop_rx.clone();
        runs.push(tokio::spawn(async move {
            let stats = consumer
                .run(source, async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await;
            // The source commits what finished and leaves the group.
            handle.closed().await;
            stats.map(|s| (s, handle.partitions_revoked()))
        }));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        // Every message settled once: ran, replayed or dead-lettered.
        let seen = consumers.iter().fold(Stats::default(), |s, c| s.plus(c.stats()));
        let settled = seen.ran + seen.replayed + seen.dead_lettered;
        if provider.captures().len() == orders && seen.in_flight() == 0 && settled >= publish.len() as u64 {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "not done after two minutes: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_tx.send(true)?;
    let mut stats = Stats::default();
    let mut partitions_revoked = 0;
    for r in runs {
        let (s, revoked) = r.await?.map_err(|e| anyhow::anyhow!(e))?;
        stats = stats.plus(s);
        partitions_revoked += revoked;
    }
    Ok(Summary {
        stats,
        captured_once: provider.captures().values().filter(|n| **n == 1).count(),
        orders,
        partitions_revoked,
    })
}

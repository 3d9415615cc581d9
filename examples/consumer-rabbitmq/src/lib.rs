//! # consumer-rabbitmq: oncely behind a RabbitMQ consumer
//!
//! The few lines a user writes are [`Payments`]: decode the message, derive
//! the effect keys from the order id (never from the broker's message id),
//! run each effect with [`Effects::run_reported`] and say whether anything
//! ran. [`run`] wires it to RabbitMQ with `oncely-consumer`: a queue and its
//! dead-letter destination, two consumers, duplicates (the same order
//! published twice with two message ids) and poison messages, then prints
//! what happened and checks that every order was captured once.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncely::backend::Ledger;
use oncely::{ClaimOptions, EffectKey, Effects, How, Tenant};
use oncely_consumer::rabbitmq::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use oncely_consumer::rabbitmq::lapin::types::FieldTable;
use oncely_consumer::rabbitmq::lapin::{BasicProperties, Connection, ConnectionProperties};
use oncely_consumer::rabbitmq::{RabbitSource, RabbitTopology};
use oncely_consumer::{Consumer, ConsumerOptions, Context, Handler, HandlerError, Stats, json};
use oncely_testkit::fakes::{FakeMailer, FakeProvider};
use oncely_testkit::{Drain, KillSwitch, Progress};
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
    /// The capture's lease, sized to the handler (`run` keeps
    /// [`ClaimOptions::for_consumer`]'s 30 s); renewed while it runs.
    pub lease: Duration,
    /// Where a test may kill this consumer the way a crash does: between
    /// the provider's capture and its completion. Never armed outside
    /// tests, where a point returns at once.
    pub crash_points: KillSwitch,
}

impl<L: Ledger + 'static> Handler for Payments<L> {
    type Message = PayOrder;

    fn decode(&self, payload: &[u8]) -> Result<PayOrder, String> {
        json(payload)
    }

    async fn handle(&self, msg: PayOrder, _ctx: Context) -> Result<How, HandlerError> {
        let order = msg.order_id.ok_or(HandlerError::missing_field("order_id"))?;
        // A short wait for a holder elsewhere, then the broker redelivers.
        let opts = ClaimOptions::for_consumer().lease(self.lease);
        let capture = EffectKey::new(&self.tenant, "capture", &order)?;
        let captured = self
            .effects
            .run_reported(&capture, &opts, |lease| {
                let order = &order;
                async move {
                    let key = lease.provider_key();
                    let charge = self.provider.capture(&key, order, msg.amount).await;
                    self.crash_points.point().await;
                    Ok(charge)
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

/// Publishes `orders` orders (each twice, with two message ids) and two
/// poison messages to a fresh queue on `amqp_url`, consumes them with two
/// consumers over `ledger`, and deletes the queue.
pub async fn run<L: Ledger + Clone + 'static>(
    ledger: L,
    amqp_url: &str,
    orders: usize,
) -> anyhow::Result<Summary> {
    let conn = Connection::connect(amqp_url, ConnectionProperties::default()).await?;
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    let topology = RabbitTopology::for_queue(&format!("consumer-rabbitmq-{nanos:x}"));
    let admin = conn.create_channel().await?;
    topology.declare(&admin).await.map_err(|e| anyhow::anyhow!(e))?;
    // Delete the queue or streams whatever happens.
    let outcome = async {
        let producer = conn.create_channel().await?;
        producer.confirm_select(ConfirmSelectOptions::default()).await?;
        let mut publish = Vec::new();
        for copy in ["a", "b"] {
            for i in 0..orders {
                let msg = PayOrder {
                    order_id: Some(format!("order-{i}")),
                    amount: 1000 + i as i64,
                };
                publish.push((format!("order-{i}-{copy}"), serde_json::to_vec(&msg)?));
            }
        }
        publish.push(("poison-1".into(), b"{not json".to_vec()));
        publish.push(("poison-2".into(), br#"{"amount":5}"#.to_vec()));
        for (id, payload) in &publish {
            let props = BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_delivery_mode(2);
            let queue = topology.queue.as_str().into();
            let confirm = producer
                .basic_publish("".into(), queue, BasicPublishOptions::default(), payload, props)
                .await?
                .await?;
            anyhow::ensure!(confirm.is_ack(), "the broker refused {id}");
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
                lease: Duration::from_secs(30),
                crash_points: KillSwitch::new(),
            };
            let consumer = Arc::new(
                Consumer::new(format!("payments-{c}"), handler).options(
                    ConsumerOptions::default()
                        .concurrency(4)
                        .in_progress_delay(Duration::from_millis(200)),
                ),
            );
            consumers.push(consumer.clone());
            // One connection per consumer, as one per process would be.
            let own = Connection::connect(amqp_url, ConnectionProperties::default()).await?;
            let source = RabbitSource::subscribe(&own, &topology, 8, &format!("payments-{c}"))
                .await
                .map_err(|e| anyhow::anyhow!(e))?;
            let mut stop = stop_rx.clone();
            runs.push(tokio::spawn(async move {
                let stats = consumer
                    .run(source, async move {
                        let _ = stop.wait_for(|s| *s).await;
                    })
                    .await;
                let _ = own.close(200, "stopped".into()).await;
                stats
            }));
        }
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        // Until every published message was settled once and nothing has
        // moved for a moment (the test kit's drain, any broker).
        let mut dead_lettered = 0;
        Drain::default()
            .until(async || {
                let queued = admin
                    .queue_declare(topology.queue.as_str().into(), passive, FieldTable::default())
                    .await?
                    .message_count();
                dead_lettered = admin
                    .queue_declare(
                        topology.dead_letter_queue.as_str().into(),
                        passive,
                        FieldTable::default(),
                    )
                    .await?
                    .message_count();
                // The queue's count is of ready messages only: one delivered
                // into a consumer's prefetch and not yet handled is in neither
                // it nor `in_flight`, so wait until every published message has
                // been acked (ran, replayed or dead-lettered) once.
                let seen = consumers.iter().fold(Stats::default(), |s, c| s.plus(c.stats()));
                let settled = seen.ran + seen.replayed + seen.dead_lettered;
                let drained = provider.captures().len() == orders
                    && queued == 0
                    && dead_lettered == 2
                    && seen.in_flight() == 0
                    && settled == publish.len() as u64;
                Ok::<_, anyhow::Error>(Progress::new(drained, settled))
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
    topology.delete(&admin).await.map_err(|e| anyhow::anyhow!(e))?;
    conn.close(200, "done".into()).await?;
    outcome
}

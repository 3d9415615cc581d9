//! # outbox-payments: publishing `order.paid` as part of the payment
//!
//! A payment consumer whose job has an event to publish. Publishing after
//! the commit would lose `order.paid` if the process died in between;
//! publishing before it would announce a payment that might still roll
//! back. So the event is written to the outbox in the same transaction that
//! marks the order paid:
//!
//! 1. [`Payments`] consumes `PayOrder` from RabbitMQ (every order published
//!    twice, under two message ids) and captures the payment with the step's
//!    provider key;
//! 2. in one PostgreSQL transaction, the `mark-paid` step's claim, the
//!    fenced `UPDATE` of the order, the `order.paid` message
//!    ([`TransactionalOutbox::enqueue_in`], named by the step's key) and the
//!    step's completion commit together, or none of them;
//! 3. a [`Relay`] publishes committed messages to the events queue, waits
//!    for RabbitMQ's confirm, then marks them sent (two relays run, as two
//!    processes would);
//! 4. [`Receipts`] consumes `order.paid` and sends the receipt at most once,
//!    keyed on the order (a copy published twice is a replay).
//!
//! [`run`] does all of it against real RabbitMQ and PostgreSQL and counts
//! what happened at each stage.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncely::backend::TransactionalLedger;
use oncely::outbox::{Message, Relay, RelayOptions, TransactionalOutbox};
use oncely::{ClaimOptions, EffectKey, Effects, How, StepFuture, StepMode, Tenant};
use oncely_consumer::rabbitmq::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use oncely_consumer::rabbitmq::lapin::types::FieldTable;
use oncely_consumer::rabbitmq::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use oncely_consumer::rabbitmq::{RabbitSource, RabbitTopology};
use oncely_consumer::{Consumer, ConsumerOptions, Context, Handler, HandlerError, Stats, json};
use oncely_postgres::PgLedger;
use oncely_relay::rabbitmq::RabbitPublisher;
use oncely_testkit::fakes::{Charge, FakeMailer, FakeProvider};
use serde::{Deserialize, Serialize};

/// The command: pay for an order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PayOrder {
    /// The order (every effect key comes from it); optional so that a
    /// message without it is dead-lettered as missing a key field.
    pub order_id: Option<String>,
    /// Cents.
    pub amount: i64,
}

/// The event: an order was paid.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderPaid {
    /// The order.
    pub order_id: String,
    /// The provider's charge.
    pub charge_id: String,
    /// Cents.
    pub amount: i64,
}

/// The orders table of this example (the application's own table, in the
/// ledger's database).
pub const ORDERS_TABLE: &str = "outbox_payments_orders";

/// A consumer waits briefly for a duplicate's holder elsewhere, then lets
/// the broker redeliver.
fn claim_options() -> ClaimOptions {
    ClaimOptions::for_consumer()
}

/// Capture, then mark paid and enqueue `order.paid` in one transaction.
pub struct Payments {
    /// The runner over the ledger.
    pub effects: Effects<PgLedger>,
    /// The ledger (its transactions and its outbox).
    pub ledger: PgLedger,
    /// The tenant of every key.
    pub tenant: Tenant,
    /// The payment provider (honours idempotency keys).
    pub provider: Arc<FakeProvider>,
    /// Where `order.paid` goes (the events queue).
    pub events: String,
}

impl Handler for Payments {
    type Message = PayOrder;

    fn decode(&self, payload: &[u8]) -> Result<PayOrder, String> {
        json(payload)
    }

    async fn handle(&self, msg: PayOrder, ctx: Context) -> Result<How, HandlerError> {
        let order = msg.order_id.ok_or(HandlerError::missing_field("order_id"))?;
        let job = self
            .effects
            .job(&self.tenant, "payment", &order)
            .options(claim_options().redelivered(ctx.redelivered()));
        let ran = Arc::new(AtomicBool::new(false));
        let charge: Charge = job
            .step("capture", StepMode::ProviderKeyed, |step| {
                let (order, ran) = (&order, &*ran);
                async move {
                    ran.store(true, Ordering::Relaxed);
                    Ok(self
                        .provider
                        .capture(&step.provider_key(), order, msg.amount)
                        .await)
                }
            })
            .await?;

        // The order's row, the event and the step's completion: one commit.
        let event = Message::json(
            &self.events,
            &OrderPaid {
                order_id: order.clone(),
                charge_id: charge.id.clone(),
                amount: charge.amount,
            },
        )?
        .header("type", "order.paid")?;
        let mut tx = self.ledger.begin().await?;
        let (ledger, ran_ref) = (self.ledger.clone(), ran.clone());
        let (id, charge_id) = (order.clone(), charge.id.clone());
        job.step_in("mark-paid", &mut *tx, move |conn, step| {
            Box::pin(async move {
                ran_ref.store(true, Ordering::Relaxed);
                let fence = i64::try_from(step.fence()).unwrap_or(i64::MAX);
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "UPDATE {ORDERS_TABLE} SET status = 'paid', charge_id = $2, fence = $3 \
                     WHERE id = $1 AND fence < $3"
                )))
                .bind(&id)
                .bind(&charge_id)
                .bind(fence)
                .execute(&mut *conn)
                .await
                .map_err(oncely::Failure::retryable)?;
                // Named by the step's key: the same step never enqueues twice.
                ledger.enqueue_in(conn, step.key(), &event).await?;
                Ok(())
            }) as StepFuture<'_, ()>
        })
        .await?;
        self.ledger.commit(tx).await?;
        Ok(if ran.load(Ordering::Relaxed) {
            How::Ran
        } else {
            How::Replayed
        })
    }
}

/// Sends the receipt of a paid order, at most once.
pub struct Receipts {
    /// The runner over the ledger.
    pub effects: Effects<PgLedger>,
    /// The tenant of every key.
    pub tenant: Tenant,
    /// The mailer (does not deduplicate).
    pub mailer: Arc<FakeMailer>,
}

impl Handler for Receipts {
    type Message = OrderPaid;

    fn decode(&self, payload: &[u8]) -> Result<OrderPaid, String> {
        json(payload)
    }

    async fn handle(&self, event: OrderPaid, ctx: Context) -> Result<How, HandlerError> {
        // Keyed on the order, never on the broker's message: a copy of the
        // event published twice is a duplicate of this effect.
        let key = EffectKey::new(&self.tenant, "receipt", &event.order_id)?;
        let opts = claim_options().at_most_once(true).redelivered(ctx.redelivered());
        let sent = self
            .effects
            .run_reported(&key, &opts, |_| async {
                self.mailer.send_receipt(&event.order_id).await;
                Ok(())
            })
            .await?;
        Ok(sent.how)
    }
}

/// What [`run`] saw at each stage.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Orders paid for (each published twice, plus one poison message).
    pub orders: usize,
    /// Orders the provider captured exactly once.
    pub captured_once: usize,
    /// Orders marked paid.
    pub marked_paid: usize,
    /// `order.paid` messages in the outbox (one per order).
    pub events_enqueued: u64,
    /// Copies the relays published (a relay that publishes a message again
    /// adds one).
    pub events_published: u64,
    /// Deliveries of `order.paid` the receipt consumers handled.
    pub events_delivered: u64,
    /// Receipts sent.
    pub receipts_sent: u64,
    /// Orders whose receipt went out more than once (must be 0).
    pub duplicate_receipts: usize,
    /// The payment consumers' counts.
    pub payments: Stats,
    /// The receipt consumers' counts.
    pub receipts: Stats,
}

async fn publish(channel: &Channel, queue: &str, id: &str, payload: &[u8]) -> anyhow::Result<()> {
    let props = BasicProperties::default()
        .with_message_id(id.into())
        .with_delivery_mode(2);
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            payload,
            props,
        )
        .await?
        .await?;
    anyhow::ensure!(confirm.is_ack(), "the broker refused {id}");
    Ok(())
}

/// Runs the whole pipeline for `orders` orders against RabbitMQ at
/// `amqp_url` and the ledger `ledger` (PostgreSQL), with fresh queues and
/// a fresh tenant, and deletes the queues at the end.
pub async fn run(ledger: PgLedger, amqp_url: &str, orders: usize) -> anyhow::Result<Summary> {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    let run_id = format!("{nanos:x}");
    let tenant = Tenant::new(format!("outbox-example-{run_id}"))?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {ORDERS_TABLE} (id text PRIMARY KEY, amount bigint NOT NULL, \
           status text NOT NULL, charge_id text, fence bigint NOT NULL DEFAULT 0)"
    )))
    .execute(ledger.pool())
    .await?;
    let order_ids: Vec<String> = (0..orders).map(|i| format!("{run_id}-order-{i}")).collect();
    for (i, id) in order_ids.iter().enumerate() {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {ORDERS_TABLE} (id, amount, status) VALUES ($1, $2, 'pending')"
        )))
        .bind(id)
        .bind(1000 + i as i64)
        .execute(ledger.pool())
        .await?;
    }

    let conn = Connection::connect(amqp_url, ConnectionProperties::default()).await?;
    let admin = conn.create_channel().await?;
    let commands = RabbitTopology::for_queue(&format!("outbox-payments-{run_id}"));
    let events = RabbitTopology::for_queue(&format!("outbox-payments-events-{run_id}"));
    commands.declare(&admin).await.map_err(|e| anyhow::anyhow!(e))?;
    events.declare(&admin).await.map_err(|e| anyhow::anyhow!(e))?;
    let outcome = pipeline(
        &ledger, amqp_url, &conn, &admin, &commands, &events, &tenant, &order_ids,
    )
    .await;
    commands.delete(&admin).await.map_err(|e| anyhow::anyhow!(e))?;
    events.delete(&admin).await.map_err(|e| anyhow::anyhow!(e))?;
    conn.close(200, "done".into()).await?;
    outcome
}

#[allow(clippy::too_many_arguments)]
async fn pipeline(
    ledger: &PgLedger,
    amqp_url: &str,
    conn: &Connection,
    admin: &Channel,
    commands: &RabbitTopology,
    events: &RabbitTopology,
    tenant: &Tenant,
    order_ids: &[String],
) -> anyhow::Result<Summary> {
    let producer = conn.create_channel().await?;
    producer.confirm_select(ConfirmSelectOptions::default()).await?;
    for copy in ["a", "b"] {
        for (i, id) in order_ids.iter().enumerate() {
            let msg = PayOrder {
                order_id: Some(id.clone()),
                amount: 1000 + i as i64,
            };
            publish(
                &producer,
                &commands.queue,
                &format!("{id}-{copy}"),
                &serde_json::to_vec(&msg)?,
            )
            .await?;
        }
    }
    publish(&producer, &commands.queue, "poison", br#"{"amount":5}"#).await?;

    let provider = Arc::new(FakeProvider::new(true));
    let mailer = Arc::new(FakeMailer::default());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let consumer_options = ConsumerOptions::default()
        .concurrency(4)
        .in_progress_delay(Duration::from_millis(200));

    let mut payment_runs = Vec::new();
    let mut payment_consumers = Vec::new();
    let mut receipt_runs = Vec::new();
    let mut receipt_consumers = Vec::new();
    for c in 0..2 {
        let own = Connection::connect(amqp_url, ConnectionProperties::default()).await?;
        let source = RabbitSource::subscribe(&own, commands, 8, &format!("payments-{c}"))
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        let consumer = Arc::new(
            Consumer::new(
                format!("payments-{c}"),
                Payments {
                    effects: Effects::new(ledger.clone()),
                    ledger: ledger.clone(),
                    tenant: tenant.clone(),
                    provider: provider.clone(),
                    events: events.queue.clone(),
                },
            )
            .options(consumer_options.clone()),
        );
        payment_consumers.push(consumer.clone());
        let stop = stopped(stop_rx.clone());
        payment_runs.push(tokio::spawn(async move {
            let stats = consumer.run(source, stop).await;
            let _ = own.close(200, "stopped".into()).await;
            stats
        }));

        let own = Connection::connect(amqp_url, ConnectionProperties::default()).await?;
        let source = RabbitSource::subscribe(&own, events, 8, &format!("receipts-{c}"))
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        let consumer = Arc::new(
            Consumer::new(
                format!("receipts-{c}"),
                Receipts {
                    effects: Effects::new(ledger.clone()),
                    tenant: tenant.clone(),
                    mailer: mailer.clone(),
                },
            )
            .options(consumer_options.clone()),
        );
        receipt_consumers.push(consumer.clone());
        let stop = stopped(stop_rx.clone());
        receipt_runs.push(tokio::spawn(async move {
            let stats = consumer.run(source, stop).await;
            let _ = own.close(200, "stopped".into()).await;
            stats
        }));
    }
    // Two relays, as two processes would run them.
    let mut relays = Vec::new();
    for _ in 0..2 {
        let relay = Relay::new(
            ledger.clone(),
            RabbitPublisher::connect(amqp_url, "").await?,
            RelayOptions {
                idle: Duration::from_millis(50),
                retention: None,
                ..RelayOptions::default()
            },
        )?;
        let stop = stopped(stop_rx.clone());
        relays.push(tokio::spawn(async move { relay.run_until(stop).await }));
    }

    let orders = order_ids.len();
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let paid = payment_consumers
            .iter()
            .fold(Stats::default(), |s, c| s.plus(c.stats()));
        let receipts = receipt_consumers
            .iter()
            .fold(Stats::default(), |s, c| s.plus(c.stats()));
        let queued = admin
            .queue_declare(events.queue.as_str().into(), passive, FieldTable::default())
            .await?
            .message_count();
        let settled = |s: &Stats| s.ran + s.replayed + s.dead_lettered;
        if settled(&paid) == 2 * orders as u64 + 1
            && paid.in_flight() == 0
            && outbox_count(ledger, tenant, Some("pending")).await? == 0
            && queued == 0
            && receipts.in_flight() == 0
            && mailer.sends().len() == orders
        {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "not done after two minutes"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_tx.send(true)?;
    let mut published = 0;
    for r in relays {
        let pass = r.await?;
        published += pass.sent + pass.fenced;
    }
    let mut payments = Stats::default();
    for r in payment_runs {
        payments = payments.plus(r.await?.map_err(|e| anyhow::anyhow!(e))?);
    }
    let mut receipts = Stats::default();
    for r in receipt_runs {
        receipts = receipts.plus(r.await?.map_err(|e| anyhow::anyhow!(e))?);
    }
    let marked_paid: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {ORDERS_TABLE} WHERE id = ANY($1) AND status = 'paid'"
    )))
    .bind(order_ids)
    .fetch_one(ledger.pool())
    .await?;
    let enqueued = outbox_count(ledger, tenant, None).await?;
    let sends = mailer.sends();
    Ok(Summary {
        orders,
        captured_once: provider.captures().values().filter(|n| **n == 1).count(),
        marked_paid: usize::try_from(marked_paid).unwrap_or(0),
        events_enqueued: enqueued,
        events_published: published,
        events_delivered: receipts.ran + receipts.replayed,
        receipts_sent: sends.values().map(|n| u64::from(*n)).sum(),
        duplicate_receipts: sends.values().filter(|n| **n > 1).count(),
        payments,
        receipts,
    })
}

/// This run's messages in the outbox (its tenant's), in `state` if given.
async fn outbox_count(ledger: &PgLedger, tenant: &Tenant, state: Option<&str>) -> anyhow::Result<u64> {
    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {LEDGER_TABLE}_outbox WHERE tenant = $1 AND ($2::text IS NULL OR state = $2)"
    )))
    .bind(tenant.as_str())
    .bind(state)
    .fetch_one(ledger.pool())
    .await?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// The ledger table this example uses (its outbox is `<table>_outbox`).
pub const LEDGER_TABLE: &str = "outbox_payments";

/// Opens the example's ledger on `url` (PostgreSQL).
pub async fn ledger(url: &str) -> oncely::Result<PgLedger> {
    PgLedger::connect_with(
        url,
        oncely_postgres::PgLedgerOptions::default().table(LEDGER_TABLE),
    )
    .await
}

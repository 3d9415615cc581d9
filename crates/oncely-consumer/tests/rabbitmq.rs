//! End to end on RabbitMQ (feature `rabbitmq`), with the PostgreSQL and the
//! SQLite ledgers: 500 payment messages, 30 % of them re-published as new
//! messages with new broker ids, 4 poison messages, 4 consumers, and at
//! least 20 consumer connections killed mid-handler without an ack (the
//! broker redelivers). A receipt abandoned meanwhile is held by the consumer
//! and reconciled from the mailer's log. At the end: every order captured
//! exactly once and one receipt for each, nothing left unacked or queued,
//! the poison messages in the dead-letter queue with their reasons.
//!
//! `ONCELY_RABBITMQ_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`);
//! skipped when RabbitMQ is not there unless `ONCELY_REQUIRE_SERVICES=1`.

mod common;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::Payments;
use futures_util::FutureExt;
use oncely::backend::Ledger;
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely_consumer::rabbitmq::lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use oncely_consumer::rabbitmq::lapin::types::{AMQPValue, FieldTable};
use oncely_consumer::rabbitmq::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use oncely_consumer::rabbitmq::{REASON_HEADER, RabbitSource, RabbitTopology};
use oncely_consumer::{Consumer, ConsumerOptions, Stats};
use payment_job::{FakeMailer, FakeProvider};
use tokio::sync::{Mutex, watch};

const ORDERS: usize = 500;
const CONSUMERS: usize = 4;
const KILLS: usize = 20;

async fn connect() -> Option<(String, Connection)> {
    let url = service_url(
        "ONCELY_RABBITMQ_URL",
        Some("amqp://guest:guest@127.0.0.1:5672/%2f"),
    )?;
    match Connection::connect(&url, ConnectionProperties::default()).await {
        Ok(c) => Some((url, c)),
        Err(e) => skip_or_fail(&format!("RabbitMQ at {url}: {e}")),
    }
}

async fn queue_len(ch: &Channel, queue: &str) -> u32 {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    ch.queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .unwrap()
        .message_count()
}

/// The whole end-to-end run, at most (it takes seconds).
const E2E_BOUND: Duration = Duration::from_secs(150);
/// One connect or close of a consumer's connection, at most: a killed
/// connection's close may never be answered.
const BROKER_CALL: Duration = Duration::from_secs(5);

async fn e2e<L: Ledger + Clone + 'static>(ledger: L, label: &str) {
    let Some((url, setup)) = connect().await else {
        return;
    };
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    let queue = format!("oncely-e2e-{label}-{}-{nanos:x}", std::process::id());
    let topology = RabbitTopology::for_queue(&queue);
    let admin = setup.create_channel().await.unwrap();
    topology.declare(&admin).await.unwrap();
    // Delete the queues and the exchange whatever happens, then report.
    // Bounded, so that a broker call that never answers fails the test with
    // a message instead of hanging the run.
    let run = async {
        if tokio::time::timeout(
            E2E_BOUND,
            exercise(ledger, label, &url, &setup, &admin, &topology),
        )
        .await
        .is_err()
        {
            panic!("rabbitmq/{label}: the end-to-end run did not finish within {E2E_BOUND:?} (stuck)");
        }
    };
    let outcome = AssertUnwindSafe(run).catch_unwind().await;
    topology.delete(&admin).await.unwrap();
    let _ = setup.close(200, "done".into()).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

async fn exercise<L: Ledger + Clone + 'static>(
    ledger: L,
    label: &str,
    url: &str,
    setup: &Connection,
    admin: &Channel,
    topology: &RabbitTopology,
) {
    let queue = &topology.queue;

    // The producer: publisher confirms, a message id per publication.
    let producer = setup.create_channel().await.unwrap();
    producer
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let common::Publications {
        orders,
        payloads,
        republished,
        poison,
    } = common::publications(ORDERS);
    let mut confirms = Vec::new();
    for (id, payload) in &payloads {
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2);
        confirms.push(
            producer
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    payload,
                    props,
                )
                .await
                .unwrap(),
        );
    }
    for c in confirms {
        assert!(
            c.await.unwrap().is_ack(),
            "the broker confirmed every publication"
        );
    }

    // Four consumers; each reconnects when its connection is killed.
    let tenant = fresh_tenant();
    let provider = Arc::new(FakeProvider::new(true));
    let mailer = Arc::new(FakeMailer::default());
    let opts = ConsumerOptions::default()
        .concurrency(4)
        .max_payload_bytes(4096)
        .in_progress_delay(Duration::from_millis(100))
        .abandoned_delay(Duration::from_millis(100))
        .backoff(Duration::from_millis(20), Duration::from_millis(500))
        .max_deliveries(100)
        .shutdown_grace(Duration::from_secs(10));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut consumers = Vec::new();
    let mut handles = Vec::new();
    let mut tasks = Vec::new();
    for c in 0..CONSUMERS {
        let handler = Payments::new(ledger.clone(), tenant.clone(), provider.clone(), mailer.clone());
        let consumer = Arc::new(Consumer::new(format!("rabbit-{label}-{c}"), handler).options(opts.clone()));
        let slot: Arc<Mutex<Option<Arc<Connection>>>> = Arc::default();
        consumers.push(consumer.clone());
        handles.push(slot.clone());
        let (url, topology, stop_rx) = (url.to_owned(), topology.clone(), stop_rx.clone());
        tasks.push(tokio::spawn(async move {
            while !*stop_rx.borrow() {
                let connect = Connection::connect(&url, ConnectionProperties::default());
                let conn = match tokio::time::timeout(BROKER_CALL, connect).await {
                    Ok(Ok(c)) => Arc::new(c),
                    Ok(Err(_)) | Err(_) => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                *slot.lock().await = Some(conn.clone());
                let Ok(source) = RabbitSource::subscribe(&conn, &topology, 8, &format!("c{c}")).await else {
                    continue;
                };
                let mut stop = stop_rx.clone();
                let _ = consumer
                    .run(source, async move {
                        let _ = stop.wait_for(|s| *s).await;
                    })
                    .await;
                let _ = tokio::time::timeout(BROKER_CALL, conn.close(200, "consumer stopped".into())).await;
            }
        }));
    }

    // Kill a consumer's connection while it has a handler running, at
    // least 20 times.
    let mut kills = 0;
    let mut turn = 0;
    while kills < KILLS {
        tokio::time::sleep(Duration::from_millis(10)).await;
        turn = (turn + 1) % CONSUMERS;
        if consumers[turn].stats().in_flight() == 0 {
            continue;
        }
        let conn = handles[turn].lock().await.take();
        if let Some(conn) = conn {
            let _ = tokio::time::timeout(
                BROKER_CALL,
                conn.close(320, "killed by the test mid-handler".into()),
            )
            .await;
            kills += 1;
        }
        assert!(
            provider.captures().len() < ORDERS || kills >= KILLS,
            "every order was captured before {KILLS} kills ({kills})"
        );
    }

    // Wait until every order is captured, the poison is dead-lettered and
    // the queue has stayed empty with nothing in flight for a while (a
    // delayed redelivery may still be due).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
    let mut quiet = 0;
    let mut reconciled = 0;
    while quiet < 5 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not done: {} captured, queue {}, dead {}",
            provider.captures().len(),
            queue_len(admin, queue).await,
            queue_len(admin, &topology.dead_letter_queue).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        reconciled += common::reconcile_abandoned(&ledger, &tenant, &provider, &mailer).await;
        let in_flight: u64 = consumers.iter().map(|c| c.stats().in_flight()).sum();
        let done = provider.captures().len() == ORDERS
            && mailer.sends().len() == ORDERS
            && queue_len(admin, queue).await == 0
            && queue_len(admin, &topology.dead_letter_queue).await == poison.len() as u32
            && in_flight == 0;
        quiet = if done { quiet + 1 } else { 0 };
    }
    stop_tx.send(true).unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    let stats = consumers.iter().fold(Stats::default(), |s, c| s.plus(c.stats()));
    let redelivered: u64 = consumers
        .iter()
        .map(|c| c.handler().redelivered.load(Ordering::Relaxed))
        .sum();

    // Nothing left unacked: every consumer connection is closed, so an
    // unacked message would be back in the queue now.
    assert_eq!(queue_len(admin, queue).await, 0, "messages left in {queue}");
    let captures = provider.captures();
    for o in &orders {
        assert_eq!(captures.get(o), Some(&1), "{o}");
    }
    assert_eq!(captures.len(), ORDERS, "only the orders, never the declined one");
    let sends = mailer.sends();
    let abandoned: Vec<String> = ledger
        .abandoned(&tenant, 10_000)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.key.subject().to_owned())
        .collect();
    assert_eq!(abandoned, Vec::<String>::new(), "left abandoned");
    for o in &orders {
        assert_eq!(sends.get(o), Some(&1), "{o}: receipts");
    }
    // The poison, dead-lettered once each with its reason.
    let mut dead = Vec::new();
    while let Some(m) = admin
        .basic_get(
            topology.dead_letter_queue.as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
    {
        let id = m.delivery.properties.message_id().clone().unwrap().to_string();
        let reason = match m
            .delivery
            .properties
            .headers()
            .as_ref()
            .unwrap()
            .inner()
            .get(REASON_HEADER)
        {
            Some(AMQPValue::LongString(s)) => s.to_string(),
            other => panic!("{id}: no reason header: {other:?}"),
        };
        dead.push((id, reason));
    }
    dead.sort();
    let classes: Vec<(&str, &str)> = dead
        .iter()
        .map(|(id, r)| (id.as_str(), r.split(':').next().unwrap()))
        .collect();
    assert_eq!(
        classes,
        [
            ("poison-declined", "terminal"),
            ("poison-missing", "missing_field"),
            ("poison-oversized", "oversized"),
            ("poison-undecodable", "undecodable"),
        ],
        "{dead:?}"
    );
    assert!(dead[0].1.contains("card declined"), "{dead:?}");
    // An order's capture and receipt may run in two handler calls (a
    // redelivery takes the receipt while the first call is between its
    // steps); the provider's and the mailer's counts above say each effect
    // ran once.
    assert!(
        (ORDERS as u64..=2 * ORDERS as u64).contains(&stats.ran),
        "{stats:?}"
    );
    assert!(stats.replayed >= republished as u64, "{stats:?}");
    assert!(redelivered >= 1 && stats.settle_errors >= 1, "{stats:?}");
    eprintln!(
        "rabbitmq/{label}: {ORDERS} orders, {republished} re-published, {} poison; {kills} connections killed \
         mid-handler; {redelivered} redeliveries; {} suppressed duplicates; {} in progress elsewhere; \
         {} settlements refused by a killed channel; {} dead-lettered; {reconciled} abandoned receipts reconciled",
        poison.len(),
        stats.replayed,
        stats.in_progress,
        stats.settle_errors,
        stats.dead_lettered
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_end_to_end_with_postgres() {
    let Some(ledger) = common::postgres().await else {
        return;
    };
    e2e(ledger, "pg").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_end_to_end_with_sqlite() {
    let (ledger, _dir) = common::sqlite().await;
    e2e(ledger, "sqlite").await;
}

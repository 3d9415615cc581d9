//! End to end on NATS JetStream (feature `nats`), with the PostgreSQL and
//! the SQLite ledgers: 500 payment messages, 30 % re-published as new
//! messages, 4 poison messages, 4 pull consumers on one durable consumer,
//! and at least 20 consumers killed mid-handler (the task aborted, its
//! handlers dropped where they were, its connection closed, nothing acked:
//! JetStream redelivers after `AckWait`). A receipt step a kill abandoned is
//! held by the consumer while the test reconciles it from the mailer's log.
//! At the end: every order captured exactly once and one receipt for each,
//! nothing pending or awaiting an ack, the poison in the dead-letter stream
//! with its reasons.
//!
//! `ONCELY_NATS_URL` (default `nats://127.0.0.1:4222`); skipped when NATS is
//! not there unless `ONCELY_REQUIRE_SERVICES=1`.

mod common;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::Payments;
use futures_util::FutureExt;
use oncely::Tenant;
use oncely::backend::Ledger;
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely_consumer::nats::async_nats::{self, HeaderMap, jetstream};
use oncely_consumer::nats::{JetStreamSource, JetStreamTopology, REASON_HEADER};
use oncely_consumer::{Consumer, ConsumerOptions, Stats};
use payment_job::{FakeMailer, FakeProvider};
use tokio::sync::watch;
use tokio::task::JoinHandle;

const ORDERS: usize = 500;
const CONSUMERS: usize = 4;
const KILLS: usize = 20;

async fn e2e<L: Ledger + Clone + 'static>(ledger: L, label: &str) {
    let Some(url) = service_url("ONCELY_NATS_URL", Some("nats://127.0.0.1:4222")) else {
        return;
    };
    let client = match async_nats::connect(&url).await {
        Ok(c) => c,
        Err(e) => return skip_or_fail(&format!("NATS at {url}: {e}")).unwrap_or(()),
    };
    let js = jetstream::new(client);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    let tag = format!("{label}_{}_{nanos:x}", std::process::id());
    let topology = JetStreamTopology::new(&format!("ONCELY_E2E_{tag}"), &format!("oncely.e2e.{tag}"))
        .ack_wait(Duration::from_secs(1))
        .max_deliver(60);
    topology.declare(&js).await.unwrap();
    let outcome = AssertUnwindSafe(exercise(ledger, label, &url, &js, &topology))
        .catch_unwind()
        .await;
    topology.delete(&js).await.unwrap();
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

struct Worker<L> {
    consumer: Arc<Consumer<Payments<L>>>,
    task: JoinHandle<()>,
}

#[allow(clippy::too_many_arguments)]
fn spawn_worker<L: Ledger + Clone + 'static>(
    name: String,
    url: &str,
    topology: &JetStreamTopology,
    ledger: &L,
    tenant: &Tenant,
    provider: &Arc<FakeProvider>,
    mailer: &Arc<FakeMailer>,
    stop: &watch::Receiver<bool>,
) -> Worker<L> {
    let mut handler = Payments::new(ledger.clone(), tenant.clone(), provider.clone(), mailer.clone());
    // A short lease: a killed handler's lease ends soon, and the redelivery
    // takes the effect over.
    handler.opts = handler.opts.clone().lease(Duration::from_millis(1000));
    let opts = ConsumerOptions::default()
        .concurrency(4)
        .max_payload_bytes(4096)
        .in_progress_delay(Duration::from_millis(200))
        .abandoned_delay(Duration::from_millis(100))
        .backoff(Duration::from_millis(20), Duration::from_millis(500))
        .max_deliveries(40)
        .extend_every(Duration::from_millis(300))
        .shutdown_grace(Duration::from_secs(10));
    let consumer = Arc::new(Consumer::new(name, handler).options(opts));
    let (c, url, topology, stop) = (consumer.clone(), url.to_owned(), topology.clone(), stop.clone());
    let task = tokio::spawn(async move {
        while !*stop.borrow() {
            let Ok(client) = async_nats::connect(&url).await else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            let js = jetstream::new(client);
            let Ok(source) = JetStreamSource::subscribe(&js, &topology, 4).await else {
                continue;
            };
            let mut stop = stop.clone();
            let _ = c
                .run(source, async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await;
        }
    });
    Worker { consumer, task }
}

async fn exercise<L: Ledger + Clone + 'static>(
    ledger: L,
    label: &str,
    url: &str,
    js: &jetstream::Context,
    topology: &JetStreamTopology,
) {
    // Publish, each publication acknowledged by the stream.
    let common::Publications {
        orders,
        payloads,
        republished,
        poison,
    } = common::publications(ORDERS);
    let mut acks = Vec::new();
    for (id, payload) in payloads {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", id.as_str());
        headers.insert("Test-Id", id.as_str());
        acks.push(
            js.publish_with_headers(topology.subject.clone(), headers, payload.into())
                .await
                .unwrap(),
        );
    }
    for a in acks {
        a.await.unwrap();
    }

    let tenant = fresh_tenant();
    let provider = Arc::new(FakeProvider::new(true));
    let mailer = Arc::new(FakeMailer::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut generation = 0;
    let spawn = |slot: usize, generation: &mut usize| {
        *generation += 1;
        spawn_worker(
            format!("nats-{label}-{slot}-{generation}"),
            url,
            topology,
            &ledger,
            &tenant,
            &provider,
            &mailer,
            &stop_rx,
        )
    };
    let mut workers: Vec<Worker<L>> = (0..CONSUMERS).map(|slot| spawn(slot, &mut generation)).collect();
    let mut killed: Vec<Arc<Consumer<Payments<L>>>> = Vec::new();

    // Kill a worker with a handler running: abort it where it is.
    let mut kills = 0;
    let mut turn = 0;
    while kills < KILLS {
        tokio::time::sleep(Duration::from_millis(20)).await;
        turn = (turn + 1) % CONSUMERS;
        if workers[turn].consumer.stats().in_flight() == 0 {
            continue;
        }
        let fresh = spawn(turn, &mut generation);
        let old = std::mem::replace(&mut workers[turn], fresh);
        old.task.abort();
        let _ = old.task.await;
        killed.push(old.consumer);
        kills += 1;
        assert!(
            provider.captures().len() < ORDERS || kills >= KILLS,
            "every order was captured before {KILLS} kills ({kills})"
        );
    }

    let dead_stream = || async { js.get_stream(&topology.dead_letter_stream).await.unwrap() };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(50);
    let mut quiet = 0;
    let mut reconciled = 0;
    while quiet < 5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        reconciled += common::reconcile_abandoned(&ledger, &tenant, &provider, &mailer).await;
        let mut consumer = topology.consumer(js).await.unwrap();
        let info = consumer.info().await.unwrap().clone();
        let dead = dead_stream().await.info().await.unwrap().state.messages;
        let in_flight: u64 = workers.iter().map(|w| w.consumer.stats().in_flight()).sum();
        assert!(
            tokio::time::Instant::now() < deadline,
            "not done: {} captured, pending {}, ack pending {}, dead {dead}",
            provider.captures().len(),
            info.num_pending,
            info.num_ack_pending
        );
        let done = provider.captures().len() == ORDERS
            && mailer.sends().len() == ORDERS
            && info.num_pending == 0
            && info.num_ack_pending == 0
            && dead == poison.len() as u64
            && in_flight == 0;
        quiet = if done { quiet + 1 } else { 0 };
    }
    stop_tx.send(true).unwrap();
    for w in &mut workers {
        (&mut w.task).await.unwrap();
    }
    let all: Vec<&Arc<Consumer<Payments<L>>>> =
        workers.iter().map(|w| &w.consumer).chain(killed.iter()).collect();
    let stats = all.iter().fold(Stats::default(), |s, c| s.plus(c.stats()));
    let redelivered: u64 = all
        .iter()
        .map(|c| c.handler().redelivered.load(Ordering::Relaxed))
        .sum();

    let info = topology.consumer(js).await.unwrap().info().await.unwrap().clone();
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0), "{info:?}");
    let captures = provider.captures();
    for o in &orders {
        assert_eq!(captures.get(o), Some(&1), "{o}");
    }
    assert_eq!(captures.len(), ORDERS);
    let sends = mailer.sends();
    let abandoned: Vec<String> = ledger
        .abandoned(&tenant, 10_000)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.key.subject().to_owned())
        .collect();
    // Every receipt exactly once: one abandoned by a killed worker was held
    // by the consumer, reconciled from the mailer's log, then sent (or
    // completed) by its held delivery.
    assert_eq!(abandoned, Vec::<String>::new(), "left abandoned");
    for o in &orders {
        assert_eq!(sends.get(o), Some(&1), "{o}: receipts");
    }
    let dead = dead_stream().await;
    let mut letters = Vec::new();
    for seq in 1..=poison.len() as u64 {
        let m = dead.get_raw_message(seq).await.unwrap();
        let id = m.headers.get("Test-Id").unwrap().as_str().to_owned();
        let reason = m.headers.get(REASON_HEADER).unwrap().as_str().to_owned();
        letters.push((id, reason));
    }
    letters.sort();
    let classes: Vec<(&str, &str)> = letters
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
        "{letters:?}"
    );
    // A re-published copy is suppressed as a replay, or held as abandoned
    // when a killed handler left its order's receipt for reconciliation.
    assert!(
        stats.replayed + stats.abandoned >= republished as u64,
        "{stats:?}"
    );
    assert!(redelivered >= KILLS as u64, "{stats:?}");
    eprintln!(
        "nats/{label}: {ORDERS} orders, {republished} re-published, {} poison; {kills} consumers killed \
         mid-handler; {redelivered} redeliveries; {} suppressed duplicates ({} replayed, {} held as abandoned, \
         {reconciled} abandoned receipts reconciled); {} in progress elsewhere; {} dead-lettered",
        poison.len(),
        stats.replayed + stats.abandoned,
        stats.replayed,
        stats.abandoned,
        stats.in_progress,
        stats.dead_lettered
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_end_to_end_with_postgres() {
    let Some(ledger) = common::postgres().await else {
        return;
    };
    e2e(ledger, "pg").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_end_to_end_with_sqlite() {
    let (ledger, _dir) = common::sqlite().await;
    e2e(ledger, "sqlite").await;
}

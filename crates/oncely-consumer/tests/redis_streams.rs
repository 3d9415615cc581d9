//! End to end on Redis Streams (feature `redis-streams`), with the
//! PostgreSQL and the SQLite ledgers: 500 payment messages, 30 %
//! re-published as new entries, 4 poison messages, 4 consumers of one
//! group, and at least 20 consumers killed mid-handler (the task aborted,
//! its handlers dropped where they were, its connections closed, nothing
//! acked: the entries stay pending on the dead consumer until another
//! claims them with `XAUTOCLAIM`). A receipt step a kill abandoned is held by
//! the consumer while the test reconciles it from the mailer's log. At the
//! end: every order captured exactly once and one receipt for each, nothing
//! pending in the group, the poison in the dead-letter stream with its
//! reasons.
//!
//! `ONCELY_REDIS_URL` (default `redis://127.0.0.1:6379`); skipped when Redis
//! is not there unless `ONCELY_REQUIRE_SERVICES=1`.

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
use oncely_consumer::redis_streams::redis::aio::MultiplexedConnection;
use oncely_consumer::redis_streams::redis::{self, Client, Value};
use oncely_consumer::redis_streams::{PAYLOAD_FIELD, RedisStreamSource, RedisStreamTopology};
use oncely_consumer::{Consumer, ConsumerOptions, Stats};
use payment_job::{FakeMailer, FakeProvider};
use tokio::sync::watch;
use tokio::task::JoinHandle;

const ORDERS: usize = 500;
const CONSUMERS: usize = 4;
const KILLS: usize = 20;

const CLAIM_IDLE: Duration = Duration::from_millis(1000);

async fn e2e<L: Ledger + Clone + 'static>(ledger: L, label: &str) {
    let Some(url) = service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379")) else {
        return;
    };
    let client = Client::open(url.as_str()).unwrap();
    let mut conn = match client.get_multiplexed_async_connection().await {
        Ok(c) => c,
        Err(e) => return skip_or_fail(&format!("Redis at {url}: {e}")).unwrap_or(()),
    };
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    let topology = RedisStreamTopology::new(&format!("oncely-e2e:{label}:{}:{nanos:x}", std::process::id()));
    topology.declare(&mut conn).await.unwrap();
    let outcome = AssertUnwindSafe(exercise(ledger, label, &client, &mut conn, &topology))
        .catch_unwind()
        .await;
    topology.delete(&mut conn).await.unwrap();
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

async fn dead_letters(
    conn: &mut MultiplexedConnection,
    topology: &RedisStreamTopology,
) -> Vec<(String, String)> {
    let v: Value = redis::cmd("XRANGE")
        .arg(&topology.dead_letter_stream)
        .arg("-")
        .arg("+")
        .query_async(conn)
        .await
        .unwrap();
    let Value::Array(entries) = v else { panic!("{v:?}") };
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        other => panic!("{other:?}"),
    };
    entries
        .iter()
        .map(|e| {
            let Value::Array(parts) = e else { panic!("{e:?}") };
            let Value::Array(fields) = &parts[1] else {
                panic!("{e:?}")
            };
            let field = |name: &str| {
                fields
                    .chunks(2)
                    .find(|kv| text(&kv[0]) == name)
                    .map(|kv| text(&kv[1]))
                    .unwrap()
            };
            (field(PAYLOAD_FIELD), field("reason"))
        })
        .collect()
}

struct Worker<L> {
    consumer: Arc<Consumer<Payments<L>>>,
    task: JoinHandle<()>,
}

#[allow(clippy::too_many_arguments)]
fn spawn_worker<L: Ledger + Clone + 'static>(
    name: String,
    client: &Client,
    topology: &RedisStreamTopology,
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
        .extend_every(Duration::from_millis(250))
        .shutdown_grace(Duration::from_secs(10));
    let consumer = Arc::new(Consumer::new(name, handler).options(opts));
    let (c, client, topology, stop) = (consumer.clone(), client.clone(), topology.clone(), stop.clone());
    let task = tokio::spawn(async move {
        let me = c.name().to_owned();
        while !*stop.borrow() {
            let Ok(source) = RedisStreamSource::subscribe(&client, &topology, &me, 4, CLAIM_IDLE).await
            else {
                tokio::time::sleep(Duration::from_millis(20)).await;
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
    client: &Client,
    conn: &mut MultiplexedConnection,
    topology: &RedisStreamTopology,
) {
    // Publish, each publication acknowledged by the stream.
    let common::Publications {
        orders,
        payloads,
        republished,
        poison,
    } = common::publications(ORDERS);
    let total = payloads.len();
    for (_, payload) in &payloads {
        let _: String = redis::cmd("XADD")
            .arg(&topology.stream)
            .arg("*")
            .arg(PAYLOAD_FIELD)
            .arg(payload.as_slice())
            .query_async(conn)
            .await
            .unwrap();
    }

    let tenant = fresh_tenant();
    let provider = Arc::new(FakeProvider::new(true));
    let mailer = Arc::new(FakeMailer::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut generation = 0;
    let spawn = |slot: usize, generation: &mut usize| {
        *generation += 1;
        spawn_worker(
            format!("redis-{label}-{slot}-{generation}"),
            client,
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

    let deadline = tokio::time::Instant::now() + Duration::from_secs(50);
    let mut quiet = 0;
    let mut reconciled = 0;
    while quiet < 5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        reconciled += common::reconcile_abandoned(&ledger, &tenant, &provider, &mailer).await;
        let pending = topology.pending(conn).await.unwrap();
        let dead = dead_letters(conn, topology).await.len();
        let in_flight: u64 = workers.iter().map(|w| w.consumer.stats().in_flight()).sum();
        assert!(
            tokio::time::Instant::now() < deadline,
            "not done: {} captured, pending {pending}, dead {dead}",
            provider.captures().len(),
        );
        let done = provider.captures().len() == ORDERS
            && mailer.sends().len() == ORDERS
            && pending == 0
            && dead == poison.len()
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

    assert_eq!(topology.pending(conn).await.unwrap(), 0, "entries left pending");
    // Every entry was read by the group: nothing is left undelivered.
    let groups: Value = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(&topology.stream)
        .query_async(conn)
        .await
        .unwrap();
    let Value::Array(groups) = groups else {
        panic!("{groups:?}")
    };
    let Value::Array(group) = &groups[0] else {
        panic!("{groups:?}")
    };
    let field = |name: &str| {
        group
            .chunks(2)
            .find(|kv| matches!(&kv[0], Value::BulkString(b) if b == name.as_bytes()))
            .map(|kv| kv[1].clone())
    };
    assert_eq!(field("lag"), Some(Value::Int(0)), "{group:?}");
    assert_eq!(field("entries-read"), Some(Value::Int(total as i64)), "{group:?}");
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
    let by_payload: std::collections::HashMap<Vec<u8>, &str> =
        poison.iter().map(|(id, p)| (p.clone(), *id)).collect();
    let mut letters: Vec<(String, String)> = dead_letters(conn, topology)
        .await
        .into_iter()
        .map(|(payload, reason)| (by_payload[payload.as_bytes()].to_owned(), reason))
        .collect();
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
        "redis-streams/{label}: {ORDERS} orders, {republished} re-published, {} poison; {kills} consumers killed \
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
async fn redis_streams_end_to_end_with_postgres() {
    let Some(ledger) = common::postgres().await else {
        return;
    };
    e2e(ledger, "pg").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_end_to_end_with_sqlite() {
    let (ledger, _dir) = common::sqlite().await;
    e2e(ledger, "sqlite").await;
}

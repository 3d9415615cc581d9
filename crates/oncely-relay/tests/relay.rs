//! The relay on real brokers (RabbitMQ, NATS JetStream, Redis Streams, Kafka
//! on Tansu), from
//! an outbox on PostgreSQL, through every crash the issue names:
//!
//! - committed messages wait for a relay (a crash between commit and
//!   publish): the relay started later publishes them;
//! - a relay dies after the broker confirmed a batch and before marking it
//!   (and one dies in the middle of a batch): the next relay publishes
//!   those messages again, and the downstream effect still happens once;
//! - two relays race on one outbox;
//! - the broker is unreachable for a while (a proxy in front of it cuts
//!   every connection): the messages wait, none is lost. Kafka clients
//!   connect to the address the broker advertises, past any proxy, so for
//!   Kafka the broker goes down inside rdkafka's in-process MockCluster.
//!
//! Downstream, every delivered copy runs its effect through oncely (a
//! receipt keyed on the event, on a PostgreSQL ledger), as a consumer would:
//! each effect must run exactly once, and the first copies of each ordering
//! key's messages must arrive in the order they were enqueued.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use oncely::backend::TransactionalLedger;
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::outbox::{
    Message, Outbox, Pending, PublishError, Publisher, Relay, RelayOptions, TransactionalOutbox,
};
use oncely::{ClaimOptions, EffectKey, Effects, Tenant};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use oncely_relay::AnyPublisher;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// Ordering keys (orders) and messages per order.
const ORDERS: usize = 6;
const EVENTS: usize = 5;
const N: usize = ORDERS * EVENTS;

#[derive(Clone, Copy, Debug)]
enum Broker {
    Rabbit,
    Nats,
    Redis,
    Kafka,
}

impl Broker {
    fn all() -> [Broker; 4] {
        [Broker::Rabbit, Broker::Nats, Broker::Redis, Broker::Kafka]
    }

    fn url(self) -> Option<String> {
        match self {
            Broker::Rabbit => service_url("ONCELY_AMQP_URL", Some("amqp://guest:guest@127.0.0.1:5672/%2f")),
            Broker::Nats => service_url("ONCELY_NATS_URL", Some("nats://127.0.0.1:4222")),
            Broker::Redis => service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379")),
            Broker::Kafka => kafka_brokers().map(|b| format!("kafka://{b}")),
        }
    }

    /// `url` with its host and port replaced by `127.0.0.1:port` (the
    /// proxy's).
    fn through(self, url: &str, port: u16) -> String {
        let (scheme, rest) = url.split_once("://").unwrap();
        let (auth, rest) = match rest.rsplit_once('@') {
            Some((a, r)) => (format!("{a}@"), r),
            None => (String::new(), rest),
        };
        let path = rest.find('/').map_or("", |i| &rest[i..]);
        format!("{scheme}://{auth}127.0.0.1:{port}{path}")
    }

    fn target(self, url: &str) -> String {
        let rest = url.split_once("://").unwrap().1;
        let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
        rest.split('/').next().unwrap().to_owned()
    }
}

/// Where one case's messages go, and how to read back what arrived.
struct Destination {
    broker: Broker,
    url: String,
    /// The queue, subject or stream the messages are published to.
    name: String,
    /// NATS: the stream capturing `name`.
    stream: String,
}

impl Destination {
    async fn create(broker: Broker, url: &str, label: &str) -> Destination {
        let unique = format!("oncely-relay-{label}-{}", fresh_tenant());
        match broker {
            Broker::Rabbit => {
                use oncely_consumer::rabbitmq::lapin::options::QueueDeclareOptions;
                use oncely_consumer::rabbitmq::lapin::types::FieldTable;
                use oncely_consumer::rabbitmq::lapin::{Connection, ConnectionProperties};
                let conn = Connection::connect(url, ConnectionProperties::default())
                    .await
                    .unwrap();
                let ch = conn.create_channel().await.unwrap();
                ch.queue_declare(
                    unique.as_str().into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
                let _ = conn.close(200, "declared".into()).await;
                Destination {
                    broker,
                    url: url.to_owned(),
                    name: unique,
                    stream: String::new(),
                }
            }
            Broker::Nats => {
                let client = async_nats(url).await;
                let js = oncely_consumer::nats::async_nats::jetstream::new(client);
                let stream = unique.replace(['.', '/'], "_").to_uppercase();
                let subject = format!("{}.orders", stream.to_lowercase());
                js.create_stream(oncely_consumer::nats::async_nats::jetstream::stream::Config {
                    name: stream.clone(),
                    subjects: vec![subject.clone()],
                    ..Default::default()
                })
                .await
                .unwrap();
                Destination {
                    broker,
                    url: url.to_owned(),
                    name: subject,
                    stream,
                }
            }
            Broker::Kafka => {
                use oncely_relay::kafka::rdkafka::admin::{
                    AdminClient, AdminOptions, NewTopic, TopicReplication,
                };
                use oncely_relay::kafka::rdkafka::client::DefaultClientContext;
                let brokers = url.trim_start_matches("kafka://");
                let admin: AdminClient<DefaultClientContext> =
                    oncely_relay::kafka::rdkafka::ClientConfig::new()
                        .set("bootstrap.servers", brokers)
                        .create()
                        .unwrap();
                let topic = NewTopic::new(&unique, 3, TopicReplication::Fixed(1));
                for r in admin.create_topics([&topic], &AdminOptions::new()).await.unwrap() {
                    r.unwrap();
                }
                Destination {
                    broker,
                    url: url.to_owned(),
                    name: unique,
                    stream: String::new(),
                }
            }
            Broker::Redis => Destination {
                broker,
                url: url.to_owned(),
                name: unique,
                stream: String::new(),
            },
        }
    }

    /// Every copy that arrived, in the broker's order: (message id,
    /// payload).
    async fn arrived(&self) -> Vec<(String, Vec<u8>)> {
        match self.broker {
            Broker::Rabbit => {
                use oncely_consumer::rabbitmq::lapin::options::BasicGetOptions;
                use oncely_consumer::rabbitmq::lapin::{Connection, ConnectionProperties};
                let conn = Connection::connect(&self.url, ConnectionProperties::default())
                    .await
                    .unwrap();
                let ch = conn.create_channel().await.unwrap();
                let mut out = Vec::new();
                while let Some(m) = ch
                    .basic_get(self.name.as_str().into(), BasicGetOptions { no_ack: false })
                    .await
                    .unwrap()
                {
                    let id = m
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|s| s.to_string())
                        .unwrap_or_default();
                    out.push((id, m.data.clone()));
                }
                // Not acked: closing the channel puts them back, so a later
                // read sees them all again.
                let _ = conn.close(200, "read".into()).await;
                out
            }
            Broker::Nats => {
                let js = oncely_consumer::nats::async_nats::jetstream::new(async_nats(&self.url).await);
                let mut stream = js.get_stream(&self.stream).await.unwrap();
                let last = stream.info().await.unwrap().state.last_sequence;
                let mut out = Vec::new();
                for seq in 1..=last {
                    let m = stream.get_raw_message(seq).await.unwrap();
                    let id = m
                        .headers
                        .get("Nats-Msg-Id")
                        .map(|v| v.to_string())
                        .unwrap_or_default();
                    out.push((id, m.payload.to_vec()));
                }
                out
            }
            Broker::Kafka => kafka_arrived(self.url.trim_start_matches("kafka://"), &self.name).await,
            Broker::Redis => {
                let client = oncely_relay::redis::redis::Client::open(self.url.as_str()).unwrap();
                let mut conn = client.get_multiplexed_async_connection().await.unwrap();
                let entries: Vec<(String, HashMap<String, Vec<u8>>)> =
                    oncely_relay::redis::redis::cmd("XRANGE")
                        .arg(&self.name)
                        .arg("-")
                        .arg("+")
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                entries
                    .into_iter()
                    .map(|(_, f)| {
                        (
                            String::from_utf8(f[oncely_relay::redis::MESSAGE_ID_FIELD].clone()).unwrap(),
                            f[oncely_relay::redis::PAYLOAD_FIELD].clone(),
                        )
                    })
                    .collect()
            }
        }
    }
}

/// The Kafka bootstrap servers: `ONCELY_KAFKA_BROKERS`, or the Tansu that
/// `scripts/kafka-broker.sh up` starts (it returns at once when the port
/// answers).
fn kafka_brokers() -> Option<String> {
    if let Ok(b) = std::env::var("ONCELY_KAFKA_BROKERS") {
        return Some(b);
    }
    static UP: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    let up = UP.get_or_init(|| {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/kafka-broker.sh");
        match std::process::Command::new("bash")
            .arg(script)
            .arg("up")
            .stdin(std::process::Stdio::null())
            .output()
        {
            Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned()),
            Ok(out) => Err(format!(
                "{script} up failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => Err(format!("{script}: {e}")),
        }
    });
    match up {
        Ok(b) => Some(b.clone()),
        Err(e) => skip_or_fail(e),
    }
}

/// Every record of `topic` (all partitions, from the start), as (message
/// id, payload): read until nothing more comes for two seconds.
async fn kafka_arrived(brokers: &str, topic: &str) -> Vec<(String, Vec<u8>)> {
    use oncely_relay::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
    use oncely_relay::kafka::rdkafka::message::{Headers, Message};
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = oncely_relay::kafka::rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", format!("reader-{}", fresh_tenant()))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        // Assigned, not subscribed: no group to join, every partition
        // from its start.
        let partitions = c
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .unwrap()
            .topics()[0]
            .partitions()
            .len();
        let mut tpl = oncely_relay::kafka::rdkafka::TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(&topic, p as i32, oncely_relay::kafka::rdkafka::Offset::Beginning)
                .unwrap();
        }
        c.assign(&tpl).unwrap();
        let mut out = Vec::new();
        let start = Instant::now();
        let mut last = Instant::now();
        while start.elapsed() < Duration::from_secs(3) || last.elapsed() < Duration::from_secs(2) {
            if start.elapsed() > Duration::from_secs(60) {
                break;
            }
            if let Some(Ok(m)) = c.poll(Duration::from_millis(100)) {
                let id = m
                    .headers()
                    .and_then(|h| {
                        h.iter()
                            .find(|h| h.key == oncely_relay::kafka::MESSAGE_ID_HEADER)
                            .and_then(|h| h.value.map(|v| String::from_utf8_lossy(v).into_owned()))
                    })
                    .unwrap_or_default();
                out.push((id, m.payload().unwrap_or_default().to_vec()));
                last = Instant::now();
            }
        }
        drop(c);
        out
    })
    .await
    .unwrap()
}

async fn async_nats(url: &str) -> oncely_consumer::nats::async_nats::Client {
    oncely_consumer::nats::async_nats::connect(url).await.unwrap()
}

/// An outbox of its own (a table per case) on PostgreSQL, and a downstream
/// ledger for the consumer's effects.
async fn ledgers(label: &str) -> Option<(PgLedger, PgLedger)> {
    let url = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )?;
    let table = format!("oncely_relay_{label}");
    let outbox = match PgLedger::connect_with(&url, PgLedgerOptions::default().table(&table)).await {
        Ok(l) => l,
        Err(e) => return skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DELETE FROM {table}_outbox")))
        .execute(outbox.pool())
        .await
        .unwrap();
    let downstream = PgLedger::connect_with(&url, PgLedgerOptions::default().table("oncely_relay_receipts"))
        .await
        .unwrap();
    Some((outbox, downstream))
}

/// Enqueues the case's messages, each in a transaction of its own (as many
/// handlers would): `EVENTS` per order, `ORDERS` orders.
async fn enqueue_all(outbox: &PgLedger, t: &Tenant, dest: &str) {
    for e in 0..EVENTS {
        for o in 0..ORDERS {
            let key = EffectKey::new(t, format!("event-{e}"), format!("order-{o}")).unwrap();
            let body = serde_json::json!({"order": format!("order-{o}"), "event": e});
            let msg = Message::json(dest, &body)
                .unwrap()
                .header("content-type", "application/json")
                .unwrap();
            let mut tx = outbox.begin().await.unwrap();
            outbox.enqueue_in(&mut tx, &key, &msg).await.unwrap();
            outbox.commit(tx).await.unwrap();
        }
    }
}

fn options() -> RelayOptions {
    RelayOptions {
        batch: 8,
        lease: Duration::from_secs(2),
        idle: Duration::from_millis(50),
        max_attempts: 10_000,
        retry_delay: Duration::from_millis(50),
        max_retry_delay: Duration::from_millis(500),
        retention: None,
    }
}

/// Runs relays until the outbox holds nothing pending.
async fn drain<P: Publisher + 'static>(outbox: &PgLedger, relays: Vec<Relay<PgLedger, P>>) {
    let done = Arc::new(Notify::new());
    let mut tasks = Vec::new();
    for relay in relays {
        let done = done.clone();
        tasks.push(tokio::spawn(
            async move { relay.run_until(done.notified()).await },
        ));
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let stats = outbox.outbox_stats().await.unwrap();
        if stats.pending == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the outbox was not drained: {stats:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    done.notify_waiters();
    for t in tasks {
        t.abort();
        let _ = t.await;
    }
}

/// The consumer's side: every copy runs its effect (a receipt keyed on the
/// event) through oncely; each must run once, and the first copies of each
/// order's events must come in order. Returns how many copies arrived.
async fn check_downstream(downstream: &PgLedger, t: &Tenant, arrived: &[(String, Vec<u8>)]) -> usize {
    let effects = Effects::new(downstream.clone());
    let runs: Arc<std::sync::Mutex<HashMap<String, usize>>> = Arc::default();
    let mut first_seen: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut ids = HashSet::new();
    for (id, payload) in arrived {
        let body: serde_json::Value = serde_json::from_slice(payload).unwrap();
        let order = body["order"].as_str().unwrap().to_owned();
        let event = body["event"].as_u64().unwrap();
        let expected = EffectKey::new(t, format!("event-{event}"), &order)
            .unwrap()
            .provider_key();
        assert_eq!(id, &expected, "the message id is the effect key's provider key");
        if ids.insert(id.clone()) {
            first_seen.entry(order.clone()).or_default().push(event);
        }
        let key = EffectKey::new(t, "receipt", format!("{order}-event-{event}")).unwrap();
        let runs = runs.clone();
        effects
            .run(&key, &ClaimOptions::default(), |_| async move {
                *runs
                    .lock()
                    .unwrap()
                    .entry(format!("{order}#{event}"))
                    .or_default() += 1;
                Ok(())
            })
            .await
            .unwrap();
    }
    let runs = runs.lock().unwrap();
    assert_eq!(runs.len(), N, "every message's effect ran");
    assert!(runs.values().all(|&n| n == 1), "an effect ran twice: {runs:?}");
    assert_eq!(first_seen.len(), ORDERS);
    for (order, events) in &first_seen {
        assert_eq!(
            events,
            &(0..EVENTS as u64).collect::<Vec<_>>(),
            "{order}: its events were first published out of order"
        );
    }
    arrived.len()
}

/// A publisher that counts what the broker confirmed and dies (never
/// returns again) once it has confirmed `die_after` messages: the relay
/// task is then aborted, as a crash would stop it. It publishes one message
/// at a time, so dying after 3 of a batch of 8 leaves 5 unpublished.
struct Dying {
    inner: AnyPublisher,
    one_at_a_time: tokio::sync::Mutex<()>,
    confirmed: AtomicUsize,
    die_after: usize,
    dead: Notify,
    died: AtomicBool,
}

impl Publisher for Dying {
    async fn publish(&self, message: &Pending) -> Result<(), PublishError> {
        let _turn = self.one_at_a_time.lock().await;
        if self.died.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.publish(message).await?;
        if self.confirmed.fetch_add(1, Ordering::SeqCst) + 1 >= self.die_after {
            self.died.store(true, Ordering::SeqCst);
            self.dead.notify_one();
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

/// Committed messages wait for a relay; the relay publishes them all once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn committed_messages_wait_for_a_relay() {
    for broker in Broker::all() {
        let Some(url) = broker.url() else { return };
        let Some((outbox, downstream)) = ledgers("waiting").await else {
            return;
        };
        let t = fresh_tenant();
        let dest = Destination::create(broker, &url, "waiting").await;
        enqueue_all(&outbox, &t, &dest.name).await;
        // The "crash": nobody publishes for a while; nothing is lost.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            dest.arrived().await.is_empty(),
            "{broker:?}: published without a relay"
        );
        assert_eq!(outbox.outbox_stats().await.unwrap().pending, N as u64);
        let relay = Relay::new(
            outbox.clone(),
            AnyPublisher::connect(&url).await.unwrap(),
            options(),
        )
        .unwrap();
        drain(&outbox, vec![relay]).await;
        let copies = check_downstream(&downstream, &t, &dest.arrived().await).await;
        assert_eq!(copies, N, "{broker:?}: one copy each");
        eprintln!(
            "{broker:?}: {N} messages committed before any relay ran, {copies} copies published, each effect once"
        );
    }
}

/// A relay dies once the broker confirmed messages it has not marked sent
/// (after a whole batch, and in the middle of one); the next relay
/// publishes them again once the lease ends, and every effect downstream
/// still runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_that_dies_before_marking_publishes_again() {
    for broker in Broker::all() {
        // A pass claims one message per order: a batch is ORDERS messages.
        for (label, die_after) in [("after-batch", ORDERS), ("mid-batch", 3)] {
            let Some(url) = broker.url() else { return };
            let Some((outbox, downstream)) = ledgers(&format!("dies_{}", label.replace('-', "_"))).await
            else {
                return;
            };
            let t = fresh_tenant();
            let dest = Destination::create(broker, &url, label).await;
            enqueue_all(&outbox, &t, &dest.name).await;
            let dying = Arc::new(Dying {
                inner: AnyPublisher::connect(&url).await.unwrap(),
                one_at_a_time: tokio::sync::Mutex::new(()),
                confirmed: AtomicUsize::new(0),
                die_after,
                dead: Notify::new(),
                died: AtomicBool::new(false),
            });
            let relay = Relay::new(outbox.clone(), dying.clone(), options()).unwrap();
            let task = tokio::spawn(async move { relay.run_until(std::future::pending()).await });
            dying.dead.notified().await;
            task.abort();
            let _ = task.await;
            let stats = outbox.outbox_stats().await.unwrap();
            assert_eq!(
                stats.pending, N as u64,
                "{broker:?} {label}: nothing was marked sent: {stats:?}"
            );
            let confirmed = dying.confirmed.load(Ordering::SeqCst);
            let relay = Relay::new(
                outbox.clone(),
                AnyPublisher::connect(&url).await.unwrap(),
                options(),
            )
            .unwrap();
            drain(&outbox, vec![relay]).await;
            let copies = check_downstream(&downstream, &t, &dest.arrived().await).await;
            match broker {
                // The stream drops the copies within its duplicate window.
                Broker::Nats => assert_eq!(copies, N, "{label}"),
                _ => assert!(
                    copies >= N + confirmed.min(die_after),
                    "{broker:?} {label}: {copies} copies"
                ),
            }
            eprintln!(
                "{broker:?} {label}: the relay died after {confirmed} confirmed and unmarked; \
                 {copies} copies of {N} messages arrived, each effect once"
            );
        }
    }
}

/// Two relays on one outbox: every message published, each effect once,
/// each order's events in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_race() {
    for broker in Broker::all() {
        let Some(url) = broker.url() else { return };
        let Some((outbox, downstream)) = ledgers("race").await else {
            return;
        };
        let t = fresh_tenant();
        let dest = Destination::create(broker, &url, "race").await;
        enqueue_all(&outbox, &t, &dest.name).await;
        let mut relays = Vec::new();
        for _ in 0..2 {
            relays.push(
                Relay::new(
                    outbox.clone(),
                    AnyPublisher::connect(&url).await.unwrap(),
                    options(),
                )
                .unwrap(),
            );
        }
        drain(&outbox, relays).await;
        let copies = check_downstream(&downstream, &t, &dest.arrived().await).await;
        eprintln!("{broker:?}: two relays, {copies} copies of {N} messages, each effect once");
    }
}

/// A TCP proxy in front of a broker that can cut every connection and
/// refuse new ones for a while.
struct Proxy {
    port: u16,
    up: Arc<AtomicBool>,
    cut: Arc<Notify>,
}

impl Proxy {
    async fn start(target: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(AtomicBool::new(true));
        let cut = Arc::new(Notify::new());
        let (up2, cut2) = (up.clone(), cut.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if !up2.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let (target, cut) = (target.clone(), cut2.clone());
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(&target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut.notified() => {}
                    }
                });
            }
        });
        Proxy { port, up, cut }
    }

    fn down(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.cut.notify_waiters();
    }

    fn up(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

/// The broker is unreachable for a while: the relay's publishes fail and
/// are retried, the messages wait in the outbox, and once the broker is
/// back every one is published and its effect runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broker_down_for_a_while_loses_nothing() {
    // Kafka: `kafka_broker_down_for_a_while_loses_nothing_mock_cluster`.
    for broker in Broker::all().into_iter().filter(|b| !matches!(b, Broker::Kafka)) {
        let Some(url) = broker.url() else { return };
        let Some((outbox, downstream)) = ledgers("down").await else {
            return;
        };
        let t = fresh_tenant();
        let dest = Destination::create(broker, &url, "down").await;
        let proxy = Proxy::start(broker.target(&url)).await;
        let publisher = AnyPublisher::connect(&broker.through(&url, proxy.port))
            .await
            .unwrap();
        proxy.down();
        enqueue_all(&outbox, &t, &dest.name).await;
        let relay = Relay::new(outbox.clone(), publisher, options()).unwrap();
        let done = Arc::new(Notify::new());
        let d2 = done.clone();
        let task = tokio::spawn(async move { relay.run_until(d2.notified()).await });
        tokio::time::sleep(Duration::from_secs(2)).await;
        let stats = outbox.outbox_stats().await.unwrap();
        assert_eq!(
            stats.pending, N as u64,
            "{broker:?}: while the broker is down, everything waits: {stats:?}"
        );
        assert_eq!(stats.failed, 0);
        assert!(dest.arrived().await.is_empty());
        proxy.up();
        let deadline = Instant::now() + Duration::from_secs(120);
        while outbox.outbox_stats().await.unwrap().pending > 0 {
            assert!(
                Instant::now() < deadline,
                "{broker:?}: not drained after the broker came back"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        done.notify_waiters();
        let pass = task.await.unwrap();
        let copies = check_downstream(&downstream, &t, &dest.arrived().await).await;
        eprintln!(
            "{broker:?}: broker down 2 s; {} publishes retried, {copies} copies of {N} messages, each effect once",
            pass.retried
        );
    }
}

/// An outbox whose first marks stall (a long pause of the relay's process
/// between the broker's confirmation and its mark).
struct StallingMarks {
    inner: PgLedger,
    stall: Duration,
    stalls_left: AtomicUsize,
}

impl Outbox for StallingMarks {
    async fn claim_messages(&self, limit: u32, lease: Duration) -> oncely::Result<Vec<Pending>> {
        self.inner.claim_messages(limit, lease).await
    }
    async fn mark_sent(&self, tickets: &[oncely::outbox::Ticket]) -> oncely::Result<Vec<bool>> {
        if self
            .stalls_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            tokio::time::sleep(self.stall).await;
        }
        self.inner.mark_sent(tickets).await
    }
    async fn retry_later(
        &self,
        ticket: oncely::outbox::Ticket,
        delay: Duration,
        error: &str,
    ) -> oncely::Result<bool> {
        self.inner.retry_later(ticket, delay, error).await
    }
    async fn mark_failed(&self, ticket: oncely::outbox::Ticket, error: &str) -> oncely::Result<bool> {
        self.inner.mark_failed(ticket, error).await
    }
    async fn prune_sent(&self, older_than: Duration, limit: u32) -> oncely::Result<u64> {
        self.inner.prune_sent(older_than, limit).await
    }
    async fn outbox_stats(&self) -> oncely::Result<oncely::outbox::OutboxStats> {
        self.inner.outbox_stats().await
    }
}

/// A relay that stalls past its lease is fenced out: another relay claims
/// its messages and publishes them; the stalled one's late marks are
/// refused (counted as fenced), and every effect downstream runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_relay_is_fenced_out() {
    for broker in Broker::all() {
        let Some(url) = broker.url() else { return };
        let Some((outbox, downstream)) = ledgers("stalled").await else {
            return;
        };
        let t = fresh_tenant();
        let dest = Destination::create(broker, &url, "stalled").await;
        enqueue_all(&outbox, &t, &dest.name).await;
        let stalled = Relay::new(
            StallingMarks {
                inner: outbox.clone(),
                stall: Duration::from_secs(3),
                stalls_left: AtomicUsize::new(1),
            },
            AnyPublisher::connect(&url).await.unwrap(),
            options(),
        )
        .unwrap();
        let first = tokio::spawn(async move { stalled.pass().await.unwrap() });
        // Its lease (2 s) ends while it stalls: the second relay takes over.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let second = Relay::new(
            outbox.clone(),
            AnyPublisher::connect(&url).await.unwrap(),
            options(),
        )
        .unwrap();
        let taken = second.pass().await.unwrap();
        assert_eq!(
            (taken.claimed, taken.sent),
            (ORDERS as u64, ORDERS as u64),
            "{broker:?}: {taken:?}"
        );
        let late = first.await.unwrap();
        assert_eq!(
            late.fenced, ORDERS as u64,
            "{broker:?}: the stalled relay wrote after its lease: {late:?}"
        );
        assert_eq!(late.sent, 0);
        drain(&outbox, vec![second]).await;
        let copies = check_downstream(&downstream, &t, &dest.arrived().await).await;
        eprintln!(
            "{broker:?}: a relay stalled past its lease; its {} late marks refused; {copies} copies of {N} messages, each effect once",
            late.fenced
        );
    }
}

/// Kafka's broker down for a while. A proxy cannot cut a Kafka client off
/// (it connects to the address the broker advertises), and Tansu cannot be
/// stopped for one test while others use it, so the broker goes down inside
/// rdkafka's in-process MockCluster: the idempotent producer holds the
/// messages, the outbox keeps them pending, and once the broker is back
/// every one is published and its effect runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_broker_down_for_a_while_loses_nothing_mock_cluster() {
    use oncely_relay::kafka::rdkafka::mocking::MockCluster;
    let Some((outbox, downstream)) = ledgers("kafka_down").await else {
        return;
    };
    let mock = MockCluster::new(1).unwrap();
    let url = format!("kafka://{}", mock.bootstrap_servers());
    let topic = format!("down-{}", fresh_tenant());
    mock.create_topic(&topic, 3, 1).unwrap();
    let t = fresh_tenant();
    let publisher = AnyPublisher::connect(&url).await.unwrap();
    mock.broker_down(1).unwrap();
    enqueue_all(&outbox, &t, &topic).await;
    let relay = Relay::new(outbox.clone(), publisher, options()).unwrap();
    let done = Arc::new(Notify::new());
    let d2 = done.clone();
    let task = tokio::spawn(async move { relay.run_until(d2.notified()).await });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stats = outbox.outbox_stats().await.unwrap();
    assert_eq!(
        stats.pending, N as u64,
        "while the broker is down, everything waits: {stats:?}"
    );
    assert_eq!(stats.failed, 0);
    mock.broker_up(1).unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while outbox.outbox_stats().await.unwrap().pending > 0 {
        assert!(
            Instant::now() < deadline,
            "not drained after the broker came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    done.notify_waiters();
    let pass = task.await.unwrap();
    let arrived = kafka_arrived(url.trim_start_matches("kafka://"), &topic).await;
    let copies = check_downstream(&downstream, &t, &arrived).await;
    eprintln!(
        "Kafka (MockCluster): broker down 2 s; {} publishes retried, {copies} copies of {N} messages, each effect once",
        pass.retried
    );
    drop(mock);
}

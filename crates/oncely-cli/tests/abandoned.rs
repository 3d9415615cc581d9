//! An abandoned at-most-once step, end to end on RabbitMQ and PostgreSQL:
//! a worker marks the receipt step and dies before sending it; the
//! redelivery finds the step abandoned and the consumer holds it (never
//! acks it); reconciliation answers "not done"; the next delivery then sends
//! the receipt, exactly once, and acks. The verdict reaches the ledger three
//! ways, one test each: `oncely::reconcile::Reconcile` in code, `oncely
//! reconcile --check`, and `oncely resolve --released`.
//!
//! Before the consumer held such deliveries, the redelivery was acked: the
//! release had no delivery left to perform it, and the receipt was sent
//! zero times with nobody told.
//!
//! `ONCELY_RABBITMQ_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! `ONCELY_POSTGRES_URL`; skipped when either is absent unless
//! `ONCELY_REQUIRE_SERVICES=1`.

mod common;

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{oncely, stderr, stdout};
use futures_util::FutureExt;
use oncely::backend::{Ledger, Outcome, Record, RecordState};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::reconcile::{Doubt, Reconcile, Reconciler, Verdict};
use oncely::{BoxError, ClaimOptions, EffectKey, Effects, How, StepMode, Tenant};
use oncely_consumer::rabbitmq::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use oncely_consumer::rabbitmq::lapin::types::FieldTable;
use oncely_consumer::rabbitmq::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use oncely_consumer::rabbitmq::{RabbitSource, RabbitTopology};
use oncely_consumer::{Consumer, ConsumerOptions, Context, Handler, HandlerError, json};
use oncely_postgres::PgLedger;
use tokio::sync::Notify;

/// The receipt's lease: short, so the dead worker's step is abandoned soon.
const LEASE: Duration = Duration::from_millis(800);

/// A mailer nobody deduplicates. Until `healthy`, a send never returns: the
/// worker "dies" there, after the step's durable mark and before the send.
#[derive(Default)]
struct Mailer {
    sends: Mutex<HashMap<String, usize>>,
    healthy: std::sync::atomic::AtomicBool,
    stuck: Notify,
}

impl Mailer {
    async fn send(&self, order: &str) {
        if !self.healthy.load(std::sync::atomic::Ordering::SeqCst) {
            self.stuck.notify_one();
            std::future::pending::<()>().await;
        }
        *self.sends.lock().unwrap().entry(order.to_owned()).or_default() += 1;
    }

    fn sent(&self, order: &str) -> usize {
        self.sends.lock().unwrap().get(order).copied().unwrap_or(0)
    }
}

#[derive(serde::Deserialize)]
struct Paid {
    order: String,
}

/// The job's receipt step, at most once, keyed on the order.
struct Receipts {
    effects: Effects<PgLedger>,
    tenant: Tenant,
    mailer: Arc<Mailer>,
}

impl Handler for Receipts {
    type Message = Paid;

    fn decode(&self, payload: &[u8]) -> Result<Paid, String> {
        json(payload)
    }

    async fn handle(&self, msg: Paid, _: Context) -> Result<How, HandlerError> {
        let job = self
            .effects
            .job(&self.tenant, "order-paid", &msg.order)
            .options(ClaimOptions::default().lease(LEASE));
        let mailer = &self.mailer;
        let order = &msg.order;
        job.step("receipt", StepMode::AtMostOnce, |_ctx| async move {
            mailer.send(order).await;
            Ok(())
        })
        .await?;
        Ok(How::Ran)
    }
}

/// The mailer's log as a reconciler: not sent → not done.
struct MailLog(Arc<Mailer>);

impl Reconciler for MailLog {
    async fn check(&self, record: &Record, _doubt: Doubt) -> Result<Verdict, BoxError> {
        Ok(match self.0.sent(record.key.subject()) {
            0 => Verdict::NotDone,
            _ => Verdict::Done(Outcome::value(&())?),
        })
    }
}

/// How the "not done" verdict reaches the ledger.
#[derive(Debug, Clone, Copy)]
enum Via {
    /// `oncely::reconcile::Reconcile` in code.
    Library,
    /// `oncely reconcile --check`.
    Reconcile,
    /// `oncely resolve --released`.
    Resolve,
}

async fn rabbitmq() -> Option<(String, Connection)> {
    let url = service_url(
        "ONCELY_RABBITMQ_URL",
        Some("amqp://guest:guest@127.0.0.1:5672/%2f"),
    )?;
    match Connection::connect(&url, ConnectionProperties::default()).await {
        Ok(c) => Some((url, c)),
        Err(e) => skip_or_fail(&format!("RabbitMQ at {url}: {e}")),
    }
}

async fn postgres() -> Option<(String, PgLedger)> {
    let url = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )?;
    match PgLedger::connect(&url).await {
        Ok(l) => Some((url, l)),
        Err(e) => skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
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

/// Runs `consumer` on its own connection until `stop` is notified; returns
/// the connection so the test can kill it.
async fn start(
    url: &str,
    topology: &RabbitTopology,
    consumer: Arc<Consumer<Receipts>>,
    tag: &str,
) -> (Arc<Connection>, Arc<Notify>, tokio::task::JoinHandle<()>) {
    let conn = Arc::new(
        Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap(),
    );
    let source = RabbitSource::subscribe(&conn, topology, 16, tag).await.unwrap();
    let stop = Arc::new(Notify::new());
    let stopped = stop.clone();
    let task = tokio::spawn(async move {
        let _ = consumer
            .run(source, async move { stopped.notified().await })
            .await;
    });
    (conn, stop, task)
}

async fn scenario(via: Via) {
    let Some((pg_url, ledger)) = postgres().await else {
        return;
    };
    let Some((url, setup)) = rabbitmq().await else {
        return;
    };
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    let queue = format!("oncely-abandoned-{via:?}-{}-{nanos:x}", std::process::id());
    let topology = RabbitTopology::for_queue(&queue);
    let admin = setup.create_channel().await.unwrap();
    topology.declare(&admin).await.unwrap();
    let outcome = AssertUnwindSafe(exercise(via, &pg_url, ledger, &url, &setup, &admin, &topology))
        .catch_unwind()
        .await;
    topology.delete(&admin).await.unwrap();
    let _ = setup.close(200, "done".into()).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

async fn exercise(
    via: Via,
    pg_url: &str,
    ledger: PgLedger,
    url: &str,
    setup: &Connection,
    admin: &Channel,
    topology: &RabbitTopology,
) {
    let tenant = fresh_tenant();
    let order = "order-1";
    let key = EffectKey::new(&tenant, "receipt", order).unwrap();
    let mailer = Arc::new(Mailer::default());
    let receipts = || Receipts {
        effects: Effects::new(ledger.clone()),
        tenant: tenant.clone(),
        mailer: mailer.clone(),
    };
    let opts = ConsumerOptions::default()
        .in_progress_delay(Duration::from_millis(100))
        .abandoned_delay(Duration::from_millis(200))
        .max_deliveries(10_000);

    let producer = setup.create_channel().await.unwrap();
    producer
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirm = producer
        .basic_publish(
            "".into(),
            topology.queue.as_str().into(),
            BasicPublishOptions::default(),
            format!(r#"{{"order":"{order}"}}"#).as_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap();
    assert!(confirm.await.unwrap().is_ack());

    // The first worker marks the receipt step, then dies before the send:
    // its task is gone and its connection with it (the broker requeues).
    let first = Arc::new(Consumer::new("receipts-dying", receipts()).options(opts.clone()));
    let (conn, _stop, task) = start(url, topology, first, "dying").await;
    tokio::time::timeout(Duration::from_secs(30), mailer.stuck.notified())
        .await
        .expect("the first delivery reached the send");
    task.abort();
    let _ = task.await;
    let _ = conn.close(320, "the worker died".into()).await;

    // A healthy worker takes the redelivery. Once the dead worker's lease
    // has ended, the step is abandoned: the delivery is held, not acked,
    // and nothing is sent.
    mailer.healthy.store(true, std::sync::atomic::Ordering::SeqCst);
    let second = Arc::new(Consumer::new("receipts", receipts()).options(opts.clone()));
    let (conn, stop, task) = start(url, topology, second.clone(), "healthy").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while second.stats().abandoned < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never held: {:?}",
            second.stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(mailer.sent(order), 0, "an abandoned step was performed again");
    assert_eq!(second.stats().ran, 0, "{:?}", second.stats());
    let record = ledger.get(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Abandoned, "{record:?}");

    // Reconciliation asks the mailer: not sent.
    match via {
        Via::Library => {
            let report = Reconcile::new(&ledger, &MailLog(mailer.clone()))
                .abandoned(&tenant)
                .await
                .unwrap();
            assert_eq!((report.examined, report.released), (1, 1), "{report:?}");
        }
        Via::Reconcile => {
            let (tenant, pg_url, key) = (tenant.to_string(), pg_url.to_owned(), key.to_string());
            let out = tokio::task::spawn_blocking(move || {
                oncely(&[
                    "reconcile",
                    "--tenant",
                    &tenant,
                    "--check",
                    "echo not-done",
                    "--database-url",
                    &pg_url,
                ])
            })
            .await
            .unwrap();
            assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
            // The operator is told the step needs a delivery, and which.
            let printed = stdout(&out);
            assert!(
                printed.contains(&format!("released abandoned ({key})")),
                "{printed}"
            );
            assert!(printed.contains("dead-letter"), "{printed}");
        }
        Via::Resolve => {
            let (key, pg_url) = (key.to_string(), pg_url.to_owned());
            let out = tokio::task::spawn_blocking(move || {
                oncely(&["resolve", &key, "--released", "--json", "--database-url", &pg_url])
            })
            .await
            .unwrap();
            assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
            let printed: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
            assert_eq!(printed["was"], "abandoned", "{printed}");
            let next = printed["next"].as_str().expect("what happens next is said");
            assert!(
                next.contains("next delivery") && next.contains("dead-letter"),
                "{next}"
            );
        }
    }

    // The held delivery comes back and sends the receipt, once, and is
    // acked; later looks change nothing.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut quiet = 0;
    while quiet < 5 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the receipt was never sent after the not-done verdict: {} sent, {:?}, queue {}",
            mailer.sent(order),
            second.stats(),
            queue_len(admin, &topology.queue).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let s = second.stats();
        let done = mailer.sent(order) == 1
            && s.ran == 1
            && s.in_flight() == 0
            && queue_len(admin, &topology.queue).await == 0;
        quiet = if done { quiet + 1 } else { 0 };
    }
    stop.notify_one();
    task.await.unwrap();
    let _ = conn.close(200, "done".into()).await;
    assert_eq!(mailer.sent(order), 1, "the receipt was sent once");
    assert_eq!(queue_len(admin, &topology.queue).await, 0, "nothing left unacked");
    assert_eq!(queue_len(admin, &topology.dead_letter_queue).await, 0);
    let record = ledger.get(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed, "{record:?}");
    assert!(record.fence > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_receipt_is_sent_once_after_reconcile_finds_it_not_done() {
    scenario(Via::Library).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_receipt_is_sent_once_after_oncely_reconcile_answers_not_done() {
    scenario(Via::Reconcile).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_receipt_is_sent_once_after_oncely_resolve_released() {
    scenario(Via::Resolve).await;
}

//! The loop's own rules, without a database: retries give up into the
//! dead-letter destination, shutdown finishes or redelivers in-flight
//! deliveries, the broker's ack deadline is extended while a handler runs,
//! dead-letters are counted in the metric, and each handler result maps to
//! its broker action.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use oncely::How;
use oncely_consumer::memory::{MemoryBroker, MemoryDelivery, MemorySource};
use oncely_consumer::{
    Action, BrokerError, Consumer, ConsumerOptions, Context, Delivery, Handler, HandlerError, Source,
    telemetry,
};

/// A handler that sleeps, then answers with what it was built with.
struct Scripted {
    sleep: Duration,
    answer: fn() -> Result<How, HandlerError>,
    calls: AtomicUsize,
}

impl Scripted {
    fn new(sleep: Duration, answer: fn() -> Result<How, HandlerError>) -> Self {
        Scripted {
            sleep,
            answer,
            calls: AtomicUsize::new(0),
        }
    }
}

impl Handler for Scripted {
    type Message = Vec<u8>;

    fn decode(&self, payload: &[u8]) -> Result<Vec<u8>, String> {
        Ok(payload.to_vec())
    }

    async fn handle(&self, _: Vec<u8>, _: Context) -> Result<How, HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(self.sleep).await;
        (self.answer)()
    }
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A handler that always fails retryably is redelivered with backoff and
/// dead-lettered on its last allowed delivery: never an endless loop. The
/// dead-letter is counted in `oncely_consumer_dead_letters_total`.
#[tokio::test]
async fn retryable_failures_give_up_into_the_dead_letter_destination() {
    oncely::conformance::metrics_snapshotter(); // the recorder, before anything is counted
    let broker = MemoryBroker::new();
    broker.publish("m");
    let handler = Scripted::new(Duration::ZERO, || {
        Err(HandlerError::retry("503 from the provider"))
    });
    let consumer = Consumer::new("retry-gives-up", handler).options(
        ConsumerOptions::default()
            .max_deliveries(4)
            .backoff(Duration::from_millis(1), Duration::from_millis(5)),
    );
    let b = broker.clone();
    let stats = consumer
        .run(
            broker.source(),
            until("the dead letter", move || b.pending() == 0),
        )
        .await
        .unwrap();
    assert_eq!(consumer.handler().calls.load(Ordering::SeqCst), 4);
    assert_eq!((stats.retried, stats.dead_lettered), (3, 1), "{stats:?}");
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0]
            .reason
            .starts_with("max_deliveries: gave up after 4 deliveries")
            && dead[0].reason.contains("503 from the provider"),
        "{}",
        dead[0].reason
    );
    assert_eq!(
        oncely::conformance::counter(
            telemetry::DEAD_LETTERS_TOTAL,
            &[("consumer", "retry-gives-up"), ("reason", "max_deliveries")]
        ),
        1
    );
}

/// Shutdown stops taking deliveries and lets the in-flight ones finish
/// within the grace: they are acked, and the queued one stays queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_in_flight_deliveries_within_the_grace() {
    let broker = MemoryBroker::new();
    for _ in 0..3 {
        broker.publish("m");
    }
    let handler = Scripted::new(Duration::from_millis(150), || Ok(How::Ran));
    let consumer = Consumer::new("graceful", handler).options(
        ConsumerOptions::default()
            .concurrency(2)
            .shutdown_grace(Duration::from_secs(5)),
    );
    let b = broker.clone();
    let stats = consumer
        .run(
            broker.source(),
            until("two in flight", move || b.counts().delivered == 2),
        )
        .await
        .unwrap();
    assert_eq!(
        (stats.received, stats.ran, stats.shutdown),
        (2, 2, 0),
        "{stats:?}"
    );
    assert_eq!(broker.counts().acked, 2);
    assert_eq!(broker.pending(), 1, "the third was never taken");
}

/// Past the grace, in-flight handlers are dropped and their deliveries
/// redelivered at once: nothing is lost or left unsettled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_past_the_grace_redelivers_in_flight_deliveries() {
    let broker = MemoryBroker::new();
    for _ in 0..2 {
        broker.publish("m");
    }
    let handler = Scripted::new(Duration::from_secs(30), || Ok(How::Ran));
    let consumer = Consumer::new("impatient", handler).options(
        ConsumerOptions::default()
            .concurrency(2)
            .shutdown_grace(Duration::from_millis(20)),
    );
    let b = broker.clone();
    let stats = consumer
        .run(
            broker.source(),
            until("two in flight", move || b.counts().delivered == 2),
        )
        .await
        .unwrap();
    assert_eq!(
        (stats.ran, stats.shutdown, stats.settle_errors),
        (0, 2, 0),
        "{stats:?}"
    );
    let counts = broker.counts();
    assert_eq!((counts.acked, counts.redelivered), (0, 2), "{counts:?}");
    assert_eq!(broker.pending(), 2, "both back in the queue");
}

/// A source whose deliveries count `extend` calls (JetStream's in-progress
/// ack is one).
struct Extending(MemorySource, Arc<AtomicU32>);
struct ExtendingDelivery(MemoryDelivery, Arc<AtomicU32>);

impl Source for Extending {
    type Delivery = ExtendingDelivery;
    async fn next(&mut self) -> Result<Option<ExtendingDelivery>, BrokerError> {
        Ok(self.0.next().await?.map(|d| ExtendingDelivery(d, self.1.clone())))
    }
}

impl Delivery for ExtendingDelivery {
    fn payload(&self) -> &[u8] {
        self.0.payload()
    }
    fn broker_id(&self) -> &str {
        self.0.broker_id()
    }
    fn delivery_count(&self) -> Option<u32> {
        self.0.delivery_count()
    }
    async fn ack(self) -> Result<(), BrokerError> {
        self.0.ack().await
    }
    async fn nack(self, delay: Duration) -> Result<(), BrokerError> {
        self.0.nack(delay).await
    }
    async fn dead_letter(self, reason: &str) -> Result<(), BrokerError> {
        self.0.dead_letter(reason).await
    }
    async fn extend(&self) -> Result<(), BrokerError> {
        self.1.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// While a handler runs, the broker's ack deadline is extended every
/// `extend_every`.
#[tokio::test]
async fn the_ack_deadline_is_extended_while_the_handler_runs() {
    let broker = MemoryBroker::new();
    broker.publish("m");
    let extends = Arc::new(AtomicU32::new(0));
    let handler = Scripted::new(Duration::from_millis(120), || Ok(How::Ran));
    let consumer = Consumer::new("extending", handler)
        .options(ConsumerOptions::default().extend_every(Duration::from_millis(20)));
    let b = broker.clone();
    consumer
        .run(
            Extending(broker.source(), extends.clone()),
            until("the ack", move || b.counts().acked == 1),
        )
        .await
        .unwrap();
    let n = extends.load(Ordering::SeqCst);
    assert!((3..=6).contains(&n), "{n} extensions in 120 ms at 20 ms");
}

/// A source that fails ends the loop with its error, after the in-flight
/// delivery is settled.
#[tokio::test]
async fn a_failing_source_ends_the_loop_after_settling_in_flight() {
    struct Failing(MemorySource, bool);
    impl Source for Failing {
        type Delivery = MemoryDelivery;
        async fn next(&mut self) -> Result<Option<MemoryDelivery>, BrokerError> {
            if std::mem::replace(&mut self.1, true) {
                return Err(BrokerError::new("connection reset"));
            }
            self.0.next().await
        }
    }
    let broker = MemoryBroker::new();
    broker.publish("m");
    let consumer = Consumer::new(
        "failing",
        Scripted::new(Duration::from_millis(30), || Ok(How::Ran)),
    );
    let err = consumer
        .run(Failing(broker.source(), false), std::future::pending())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("connection reset"), "{err}");
    assert_eq!(broker.counts().acked, 1);
}

/// The mapping table of `Consumer`, one row each.
#[test]
fn each_result_maps_to_its_broker_action() {
    let opts = ConsumerOptions::default()
        .in_progress_delay(Duration::from_millis(700))
        .backoff(Duration::from_millis(100), Duration::from_secs(1))
        .max_deliveries(5);
    let decide = |r, n| Action::decide(r, n, &opts);
    assert_eq!(decide(Ok(How::Ran), 1), Action::Ack("ran"));
    assert_eq!(decide(Ok(How::Replayed), 1), Action::Ack("replayed"));
    let key = "t/capture:o-1".to_owned();
    let in_progress = oncely::Error::InProgress {
        key: key.clone(),
        fence: 3,
    };
    assert!(matches!(decide(Err(in_progress.into()), 9),
        Action::Redeliver { result: "in_progress", delay, .. } if delay == Duration::from_millis(700)));
    let lost = oncely::Error::LeaseLost {
        key: key.clone(),
        fence: 3,
    };
    assert!(matches!(
        decide(Err(lost.into()), 1),
        Action::Redeliver {
            result: "in_progress",
            ..
        }
    ));
    // The effect ran, its completion was not recorded: redelivered (it
    // replays, or is taken over once the lease ends), never acked.
    let unknown = oncely::Error::OutcomeUnknown {
        key: key.clone(),
        fence: 3,
        source: Box::new(oncely::Error::Unavailable {
            backend: "test",
            message: "connection reset".into(),
        }),
    };
    assert!(matches!(
        decide(Err(unknown.into()), 1),
        Action::Redeliver { result: "retry", .. }
    ));
    let abandoned = oncely::Error::Abandoned { key: key.clone() };
    assert!(matches!(
        decide(Err(abandoned.into()), 1),
        Action::Redeliver { result: "abandoned", delay, .. } if delay == Duration::from_secs(60)
    ));
    let abandoned = oncely::Error::Abandoned { key: key.clone() };
    assert!(matches!(
        decide(Err(abandoned.into()), 100),
        Action::DeadLetter { class: "abandoned", reason } if reason.contains(&key)
    ));
    let terminal = oncely::Error::Terminal {
        key: key.clone(),
        message: "declined".into(),
    };
    assert!(matches!(
        decide(Err(terminal.into()), 1),
        Action::DeadLetter {
            class: "terminal",
            ..
        }
    ));
    // Ran once, its outcome erased on a data-protection request: nothing is
    // left to do, and a redelivery would only be refused again.
    let erased = oncely::Error::Erased { key: key.clone() };
    assert_eq!(decide(Err(erased.into()), 1), Action::Ack("erased"));
    let mismatch = oncely::Error::FingerprintMismatch { key };
    assert!(matches!(
        decide(Err(mismatch.into()), 1),
        Action::DeadLetter {
            class: "rejected",
            ..
        }
    ));
    let unavailable = oncely::Error::Unavailable {
        backend: "postgres",
        message: "down".into(),
    };
    assert!(matches!(decide(Err(unavailable.into()), 3),
        Action::Redeliver { result: "retry", delay, .. } if delay == Duration::from_millis(400)));
    assert!(matches!(
        decide(Err(HandlerError::retry("x")), 5),
        Action::DeadLetter {
            class: "max_deliveries",
            ..
        }
    ));
    assert!(matches!(
        decide(Err(HandlerError::retry("x")), 30),
        Action::DeadLetter {
            class: "max_deliveries",
            ..
        }
    ));
    assert!(matches!(decide(Err(HandlerError::missing_field("order_id")), 1),
        Action::DeadLetter { class: "missing_field", reason } if reason.contains("order_id")));
    assert!(matches!(
        decide(Err(HandlerError::poison("bad")), 1),
        Action::DeadLetter { class: "poison", .. }
    ));
    assert_eq!(opts.backoff_for(1), Duration::from_millis(100));
    assert_eq!(opts.backoff_for(20), Duration::from_secs(1));
}

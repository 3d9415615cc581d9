//! The consumer loop over the in-process broker, with the SQLite and the
//! PostgreSQL ledgers: duplicates, re-publications, killed connections and
//! poison messages; an effect in progress elsewhere.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{PayMsg, Payments};
use oncely::backend::{Claim, Ledger};
use oncely::conformance::fresh_tenant;
use oncely::{ClaimOptions, EffectKey, OnInProgress};
use oncely_consumer::memory::MemoryBroker;
use oncely_consumer::{Consumer, ConsumerOptions, Stats};
use payment_job::{FakeMailer, FakeProvider};
use tokio::sync::watch;

fn options() -> ConsumerOptions {
    ConsumerOptions::default()
        .concurrency(2)
        .max_payload_bytes(4096)
        .in_progress_delay(Duration::from_millis(50))
        .abandoned_delay(Duration::from_millis(50))
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .max_deliveries(50)
}

/// 80 orders, 30 % re-published as new messages, 4 poison messages, 4
/// consumers of 2 slots each, and the consumers' connections killed at
/// least 10 times mid-handler (their acks then fail and the broker
/// redelivers). A receipt abandoned by a kill is held by the consumer and
/// reconciled from the mailer's log meanwhile. Every order is captured
/// once and gets exactly one receipt, nothing is left pending, and exactly
/// the poison messages are dead-lettered, with their reasons.
async fn payments_once_under_duplicates_kills_and_poison<L: Ledger + Clone + 'static>(ledger: L, name: &str) {
    let tenant = fresh_tenant();
    let provider = Arc::new(FakeProvider::new(true));
    let mailer = Arc::new(FakeMailer::default());
    let broker = MemoryBroker::new();
    let orders: Vec<String> = (0..80).map(|i| format!("order-{i}")).collect();
    for (i, o) in orders.iter().enumerate() {
        broker.publish(PayMsg::order(o, 1000 + i as i64));
    }
    let republished = orders.len() * 3 / 10;
    for (i, o) in orders
        .iter()
        .enumerate()
        .step_by(orders.len() / republished)
        .take(republished)
    {
        broker.publish(PayMsg::order(o, 1000 + i as i64));
    }
    broker.publish("{not json");
    broker.publish(r#"{"amount":5}"#);
    broker.publish(
        serde_json::to_vec(&PayMsg {
            order_id: Some("order-big".into()),
            amount: 1,
            decline: false,
            pad: "x".repeat(5000),
        })
        .unwrap(),
    );
    broker.publish(
        serde_json::to_vec(&PayMsg {
            order_id: Some("order-declined".into()),
            amount: 1,
            decline: true,
            pad: String::new(),
        })
        .unwrap(),
    );

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut consumers = Vec::new();
    for c in 0..4 {
        let handler = Payments::new(ledger.clone(), tenant.clone(), provider.clone(), mailer.clone());
        let consumer = Consumer::new(format!("{name}-{c}"), handler).options(options());
        let (source, mut stop) = (broker.source(), stop_rx.clone());
        consumers.push(tokio::spawn(async move {
            consumer
                .run(source, async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await
                .unwrap()
        }));
    }
    // Kill the connections whenever something is in flight, at least 10
    // times (each kill that finds deliveries in flight counts).
    let mut kills = 0;
    while kills < 10 {
        tokio::time::sleep(Duration::from_millis(7)).await;
        if broker.kill_connections() > 0 {
            kills += 1;
        }
        assert!(
            broker.pending() > 0 || kills >= 10,
            "the queue drained before 10 kills ({kills})"
        );
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut reconciled = 0;
    while broker.pending() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} messages still pending",
            broker.pending()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
        reconciled += common::reconcile_abandoned(&ledger, &tenant, &provider, &mailer).await;
    }
    stop_tx.send(true).unwrap();
    let mut stats = Stats::default();
    for c in consumers {
        let s = c.await.unwrap();
        stats.received += s.received;
        stats.ran += s.ran;
        stats.replayed += s.replayed;
        stats.abandoned += s.abandoned;
        stats.in_progress += s.in_progress;
        stats.retried += s.retried;
        stats.dead_lettered += s.dead_lettered;
        stats.settle_errors += s.settle_errors;
    }
    let counts = broker.counts();
    eprintln!("{name}: {stats:?}\n{name}: {counts:?}\n{name}: {reconciled} abandoned receipts reconciled");

    // Every order captured exactly once; the declined one never.
    let captures = provider.captures();
    for o in &orders {
        assert_eq!(captures.get(o), Some(&1), "{o}: {captures:?}");
    }
    assert_eq!(captures.len(), orders.len(), "{captures:?}");
    // Every receipt exactly once: an abandoned one was held, reconciled,
    // and then sent (or completed) by its held delivery.
    let sends = mailer.sends();
    for o in &orders {
        assert_eq!(sends.get(o), Some(&1), "{o}: receipts");
    }
    assert!(ledger.abandoned(&tenant, 1000).await.unwrap().is_empty());
    // Nothing pending; the poison messages dead-lettered with their reasons.
    assert_eq!(broker.pending(), 0);
    let mut reasons: Vec<String> = broker
        .dead_letters()
        .iter()
        .map(|d| d.reason.split(':').next().unwrap().to_owned())
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        ["missing_field", "oversized", "terminal", "undecodable"],
        "{:?}",
        broker.dead_letters()
    );
    let declined = broker
        .dead_letters()
        .into_iter()
        .find(|d| d.reason.starts_with("terminal"))
        .unwrap();
    assert!(declined.reason.contains("card declined"), "{}", declined.reason);
    // Each order's capture and receipt ran in one or two handler calls (a
    // redelivery may take the receipt while the first call is between its
    // steps); every other delivery of an order was a replay.
    let n = orders.len() as u64;
    assert!((n..=2 * n).contains(&stats.ran), "{stats:?}");
    assert!(stats.replayed >= republished as u64, "{stats:?}");
    assert!(counts.killed >= 10, "{counts:?}");
    assert!(
        stats.settle_errors >= 1,
        "killed deliveries' acks are refused: {stats:?}"
    );
    assert_eq!(stats.received, counts.delivered, "{stats:?} {counts:?}");
}

/// With one consumer slot, an order whose capture is leased elsewhere is
/// redelivered after the in-progress delay instead of holding the slot:
/// the next order is captured while the first is still held; once the
/// holder releases, the first is captured, once.
async fn in_progress_elsewhere_is_redelivered_without_blocking<L: Ledger + Clone + 'static>(ledger: L) {
    let tenant = fresh_tenant();
    let provider = Arc::new(FakeProvider::new(true));
    let mailer = Arc::new(FakeMailer::default());
    let key = EffectKey::new(&tenant, "capture", "order-held").unwrap();
    let Claim::Acquired(lease) = ledger
        .claim(&key, &ClaimOptions::default().lease(Duration::from_secs(30)))
        .await
        .unwrap()
    else {
        panic!("a fresh key is acquired")
    };
    let broker = MemoryBroker::new();
    broker.publish(PayMsg::order("order-held", 1));
    broker.publish(PayMsg::order("order-free", 2));
    let mut handler = Payments::new(ledger.clone(), tenant.clone(), provider.clone(), mailer.clone());
    handler.opts = handler.opts.clone().on_in_progress(OnInProgress::Reject);
    let consumer = Arc::new(Consumer::new("held", handler).options(options().concurrency(1)));
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let (c, source) = (consumer.clone(), broker.source());
    let run = tokio::spawn(async move {
        c.run(source, async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        })
        .await
        .unwrap()
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !provider.captures().contains_key("order-free") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the free order was blocked behind the held one"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!provider.captures().contains_key("order-held"));
    // Redelivered more than once while held, never blocking.
    while consumer.stats().in_progress < 2 {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", consumer.stats());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    ledger.release(&lease).await.unwrap();
    while broker.pending() > 0 {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", consumer.stats());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop_tx.send(true).unwrap();
    let stats = run.await.unwrap();
    let want: BTreeMap<String, u32> = [("order-free".to_owned(), 1), ("order-held".to_owned(), 1)].into();
    assert_eq!(provider.captures(), want);
    assert_eq!((stats.ran, stats.dead_lettered), (2, 0), "{stats:?}");
    assert!(broker.counts().delivered >= 4, "{:?}", broker.counts());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_payments_once_under_duplicates_kills_and_poison() {
    let (ledger, _dir) = common::sqlite().await;
    payments_once_under_duplicates_kills_and_poison(ledger, "sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_payments_once_under_duplicates_kills_and_poison() {
    let Some(ledger) = common::postgres().await else {
        return;
    };
    payments_once_under_duplicates_kills_and_poison(ledger, "postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_in_progress_elsewhere_is_redelivered_without_blocking() {
    let (ledger, _dir) = common::sqlite().await;
    in_progress_elsewhere_is_redelivered_without_blocking(ledger).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_in_progress_elsewhere_is_redelivered_without_blocking() {
    let Some(ledger) = common::postgres().await else {
        return;
    };
    in_progress_elsewhere_is_redelivered_without_blocking(ledger).await;
}

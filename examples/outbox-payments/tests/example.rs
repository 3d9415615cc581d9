//! The example's `run` on RabbitMQ and PostgreSQL: every order captured
//! once, marked paid with its `order.paid` message in one transaction, the
//! message published by the relays and delivered, and exactly one receipt
//! per order although every order was published twice. Skipped without the
//! services unless `ONCELY_REQUIRE_SERVICES=1`.

use oncely::conformance::{service_url, skip_or_fail};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_order_paid_once_and_every_receipt_sent_once() {
    let Some(amqp) = service_url(
        "ONCELY_RABBITMQ_URL",
        Some("amqp://guest:guest@127.0.0.1:5672/%2f"),
    ) else {
        return;
    };
    let Some(pg) = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    ) else {
        return;
    };
    if let Err(e) = oncely_consumer::rabbitmq::lapin::Connection::connect(&amqp, Default::default()).await {
        skip_or_fail::<()>(&format!("RabbitMQ at {amqp}: {e}"));
        return;
    }
    let ledger = match outbox_payments::ledger(&pg).await {
        Ok(l) => l,
        Err(e) => {
            skip_or_fail::<()>(&format!("PostgreSQL at {pg}: {e}"));
            return;
        }
    };
    let s = outbox_payments::run(ledger, &amqp, 30).await.unwrap();
    eprintln!("{s:?}");
    assert_eq!(s.captured_once, 30, "{s:?}");
    assert_eq!(s.marked_paid, 30, "{s:?}");
    assert_eq!(
        s.events_enqueued, 30,
        "one order.paid per order, though each was paid for twice: {s:?}"
    );
    assert!(s.events_published >= 30, "{s:?}");
    assert!(s.events_delivered >= 30, "{s:?}");
    assert_eq!(s.receipts_sent, 30, "{s:?}");
    assert_eq!(s.duplicate_receipts, 0, "{s:?}");
    // Each order's second command was a duplicate: replayed, not run again.
    assert!(s.payments.replayed >= 1, "{s:?}");
    assert_eq!(s.payments.dead_lettered, 1, "the poison message: {s:?}");
}

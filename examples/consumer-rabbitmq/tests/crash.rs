//! A consumer killed mid-handler, as a crash kills it: after the provider
//! captured, before the capture was completed. Its connection goes with it
//! (the test kit's `KillSwitch`), RabbitMQ redelivers the unacked message to
//! the other consumer, which takes the capture over once the dead one's
//! lease ends and calls the provider again with the same idempotency key:
//! money moves once, the receipt goes out once. Skipped without RabbitMQ
//! unless `ONCELY_REQUIRE_SERVICES=1`.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use consumer_rabbitmq::{PayOrder, Payments};
use oncely::conformance::{service_url, skip_or_fail};
use oncely::{Effects, Tenant};
use oncely_consumer::rabbitmq::lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use oncely_consumer::rabbitmq::lapin::types::FieldTable;
use oncely_consumer::rabbitmq::lapin::{BasicProperties, Connection, ConnectionProperties};
use oncely_consumer::rabbitmq::{RabbitSource, RabbitTopology};
use oncely_consumer::{Consumer, ConsumerOptions, Stats};
use oncely_testkit::{Drain, FakeMailer, FakeProvider, KillSwitch, Progress};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_after_the_capture_is_finished_once_by_the_other() {
    let Some(amqp) = service_url(
        "ONCELY_RABBITMQ_URL",
        Some("amqp://guest:guest@127.0.0.1:5672/%2f"),
    ) else {
        return;
    };
    let admin_conn = match Connection::connect(&amqp, ConnectionProperties::default()).await {
        Ok(c) => c,
        Err(e) => {
            skip_or_fail::<()>(&format!("RabbitMQ at {amqp}: {e}"));
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("ledger.db").display());
    let ledger = oncely_sqlite::SqliteLedger::connect(&url).await.unwrap();
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    let topology = RabbitTopology::for_queue(&format!("consumer-rabbitmq-crash-{nanos:x}"));
    let admin = admin_conn.create_channel().await.unwrap();
    topology.declare(&admin).await.unwrap();
    let payload = serde_json::to_vec(&PayOrder {
        order_id: Some("order-1".into()),
        amount: 1250,
    })
    .unwrap();
    admin
        .basic_publish(
            "".into(),
            topology.queue.as_str().into(),
            BasicPublishOptions::default(),
            &payload,
            BasicProperties::default()
                .with_message_id("m-1".into())
                .with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();

    let tenant = Tenant::new(format!("crash-{nanos:x}")).unwrap();
    let provider = Arc::new(FakeProvider::new(true));
    let mailer = Arc::new(FakeMailer::default());
    let consumer = |name: &str, crash_points: KillSwitch| {
        Arc::new(
            Consumer::new(
                name.to_owned(),
                Payments {
                    effects: Effects::new(ledger.clone()),
                    tenant: tenant.clone(),
                    provider: provider.clone(),
                    mailer: mailer.clone(),
                    lease: Duration::from_secs(1),
                    crash_points,
                },
            )
            .options(ConsumerOptions::default().in_progress_delay(Duration::from_millis(200))),
        )
    };

    // The first consumer dies at its first point: after the capture.
    let switch = KillSwitch::new();
    let doomed_conn = Connection::connect(&amqp, ConnectionProperties::default())
        .await
        .unwrap();
    let doomed_source = RabbitSource::subscribe(&doomed_conn, &topology, 8, "doomed")
        .await
        .unwrap();
    let doomed = consumer("doomed", switch.clone());
    switch.on_kill(move || {
        // What a dead process takes with it: its connection, so the broker
        // redelivers what it had not acked.
        tokio::spawn(async move {
            let _ = doomed_conn.close(320, "killed".into()).await;
        });
    });
    switch.arm(1);
    let died = switch
        .run(doomed.run(doomed_source, std::future::pending()))
        .await;
    assert!(died.is_none(), "the consumer was killed, not stopped");
    assert_eq!((provider.calls(), mailer.sends().len()), (1, 0));

    // The survivor gets the redelivery and finishes the job.
    let survivor_conn = Connection::connect(&amqp, ConnectionProperties::default())
        .await
        .unwrap();
    let survivor_source = RabbitSource::subscribe(&survivor_conn, &topology, 8, "survivor")
        .await
        .unwrap();
    let survivor = consumer("survivor", KillSwitch::new());
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let run = {
        let survivor = survivor.clone();
        tokio::spawn(async move {
            survivor
                .run(survivor_source, async move {
                    let _ = stop_rx.wait_for(|s| *s).await;
                })
                .await
        })
    };
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    Drain::default()
        .until(async || {
            let queued = admin
                .queue_declare(topology.queue.as_str().into(), passive, FieldTable::default())
                .await?
                .message_count();
            let seen: Stats = survivor.stats();
            let drained = queued == 0 && seen.in_flight() == 0 && seen.ran == 1;
            Ok::<_, oncely_consumer::rabbitmq::lapin::Error>(Progress::new(drained, seen.ran))
        })
        .await
        .unwrap();
    stop_tx.send(true).unwrap();
    run.await.unwrap().unwrap();
    let _ = survivor_conn.close(200, "done".into()).await;
    topology.delete(&admin).await.unwrap();

    assert_eq!(provider.captures().get("order-1"), Some(&1), "captured once");
    assert_eq!(
        provider.calls(),
        2,
        "the survivor called again, with the same key"
    );
    assert_eq!(mailer.sends().get("order-1"), Some(&1), "one receipt");
}

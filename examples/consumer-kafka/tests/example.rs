//! The example's `run` on Kafka (the Tansu broker `scripts/kafka-broker.sh
//! up` starts, or `ONCELY_KAFKA_BROKERS`) with a SQLite ledger: every order
//! captured once although each was published twice, the two poison messages
//! dead-lettered. Skipped without a broker unless `ONCELY_REQUIRE_SERVICES=1`.

use oncely::conformance::skip_or_fail;

fn brokers() -> Option<String> {
    if let Ok(b) = std::env::var("ONCELY_KAFKA_BROKERS") {
        return Some(b);
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/kafka-broker.sh");
    match std::process::Command::new("bash").arg(script).arg("up").output() {
        Ok(out) if out.status.success() => Some(String::from_utf8_lossy(&out.stdout).trim().to_owned()),
        Ok(out) => skip_or_fail(&format!(
            "{script} up: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => skip_or_fail(&format!("{script}: {e}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_order_is_captured_once_and_poison_is_dead_lettered() {
    let Some(brokers) = brokers() else { return };
    let dir = std::env::temp_dir().join(format!("consumer-kafka-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite:{}", dir.join("ledger.db").display());
    let ledger = oncely_sqlite::SqliteLedger::connect(&url).await.unwrap();
    let s = consumer_kafka::run(ledger, &brokers, 20).await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(s.captured_once, 20, "{s:?}");
    assert_eq!(s.stats.dead_lettered, 2, "{s:?}");
    // Each of the 40 order messages settled at least once: its effects ran,
    // or (a duplicate, or a redelivery after a rebalance) were replayed.
    assert!(s.stats.ran + s.stats.replayed >= 40, "{s:?}");
    assert!(s.stats.replayed >= 1, "{s:?}");
}

//! The example's `run` on Redis Streams with a SQLite ledger: every order
//! captured once although each was published twice, the two poison
//! messages dead-lettered. Skipped without Redis unless
//! `ONCELY_REQUIRE_SERVICES=1`.

use oncely::conformance::{service_url, skip_or_fail};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_order_is_captured_once_and_poison_is_dead_lettered() {
    let Some(broker) = service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379")) else {
        return;
    };
    let client = oncely_consumer::redis_streams::redis::Client::open(broker.as_str()).unwrap();
    if let Err(e) = client.get_multiplexed_async_connection().await {
        skip_or_fail::<()>(&format!("Redis at {broker}: {e}"));
        return;
    }
    let dir = std::env::temp_dir().join(format!("consumer-redis-streams-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite:{}", dir.join("ledger.db").display());
    let ledger = oncely_sqlite::SqliteLedger::connect(&url).await.unwrap();
    let s = consumer_redis_streams::run(ledger, &broker, 20).await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(s.captured_once, 20, "{s:?}");
    assert_eq!(s.dead_lettered, 2, "{s:?}");
    // Each of the 40 order messages acked once: its effects ran, or (a
    // duplicate) were replayed.
    assert_eq!(s.stats.ran + s.stats.replayed, 40, "{s:?}");
    assert!(s.stats.replayed >= 1, "{s:?}");
}

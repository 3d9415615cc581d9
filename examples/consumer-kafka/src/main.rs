//! ```text
//! consumer-kafka [LEDGER_URL]   # default: a SQLite file in a temp directory
//! ```
//! `KAFKA_BROKERS` (default `127.0.0.1:9092`; `scripts/kafka-broker.sh up`
//! starts one) names the cluster; `LEDGER_URL` may be `sqlite:path` or
//! `postgres://…`.

use consumer_kafka::run;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let dir = std::env::temp_dir().join(format!("consumer-kafka-{}", std::process::id()));
    let summary = match std::env::args().nth(1) {
        Some(url) if url.starts_with("postgres") => {
            run(oncely_postgres::PgLedger::connect(&url).await?, &brokers, 50).await
        }
        other => {
            std::fs::create_dir_all(&dir)?;
            let url = other.unwrap_or_else(|| format!("sqlite:{}", dir.join("ledger.db").display()));
            run(oncely_sqlite::SqliteLedger::connect(&url).await?, &brokers, 50).await
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    let s = summary?;
    println!(
        "{} orders published twice + 2 poison: {} captured exactly once; deliveries: {} ran, {} replayed (suppressed duplicates), {} in progress elsewhere, {} dead-lettered; {} partitions revoked",
        s.orders,
        s.captured_once,
        s.stats.ran,
        s.stats.replayed,
        s.stats.in_progress,
        s.stats.dead_lettered,
        s.partitions_revoked
    );
    anyhow::ensure!(
        s.captured_once == s.orders,
        "an order was not captured exactly once"
    );
    Ok(())
}

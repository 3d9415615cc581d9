//! ```text
//! consumer-nats [LEDGER_URL]   # default: a SQLite file in a temp directory
//! ```
//! `NATS_URL` (default `nats://127.0.0.1:4222`) names the
//! broker; `LEDGER_URL` may be `sqlite:path` or `postgres://…`.

use consumer_nats::run;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let broker = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let dir = std::env::temp_dir().join(format!("consumer-nats-{}", std::process::id()));
    let summary = match std::env::args().nth(1) {
        Some(url) if url.starts_with("postgres") => {
            run(oncely_postgres::PgLedger::connect(&url).await?, &broker, 50).await
        }
        other => {
            std::fs::create_dir_all(&dir)?;
            let url = other.unwrap_or_else(|| format!("sqlite:{}", dir.join("ledger.db").display()));
            run(oncely_sqlite::SqliteLedger::connect(&url).await?, &broker, 50).await
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    let s = summary?;
    println!(
        "{} orders published twice + 2 poison: {} captured exactly once; deliveries: {} ran, {} replayed (suppressed duplicates), {} in progress elsewhere, {} dead-lettered",
        s.orders, s.captured_once, s.stats.ran, s.stats.replayed, s.stats.in_progress, s.dead_lettered
    );
    anyhow::ensure!(
        s.captured_once == s.orders,
        "an order was not captured exactly once"
    );
    Ok(())
}

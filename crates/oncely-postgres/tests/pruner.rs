//! The background pruner on PostgreSQL, on a table of its own (emptied
//! first, so the pruner's counts are exact).

use oncely::conformance::{service_url, skip_or_fail};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::postgres::PgPoolOptions;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pruner_prunes_due_records_in_bounded_batches() {
    let Some(url) = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    ) else {
        return;
    };
    let pool = match PgPoolOptions::new().max_connections(8).connect(&url).await {
        Ok(pool) => pool,
        Err(e) => return skip_or_fail(&format!("PostgreSQL at {url}: {e}")).unwrap_or(()),
    };
    let ledger = PgLedger::from_pool_with(pool.clone(), PgLedgerOptions::default().table("oncely_pruner_test"))
        .expect("valid options");
    ledger.migrate().await.expect("migrations run");
    sqlx::raw_sql("TRUNCATE oncely_pruner_test")
        .execute(&pool)
        .await
        .unwrap();
    oncely::conformance::pruner_prunes_due_records_in_bounded_batches(ledger, true).await;
}

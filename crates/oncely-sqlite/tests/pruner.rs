//! The background pruner on SQLite, on a database file of its own (so the
//! pruner's counts are exact).

use oncely_sqlite::{SqliteLedger, SqliteLedgerOptions, SqliteSynchronous};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pruner_prunes_due_records_in_bounded_batches() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite:{}", dir.path().join("pruner.db").display());
    let ledger = SqliteLedger::connect_with(
        &url,
        SqliteLedgerOptions::default().synchronous(SqliteSynchronous::Normal),
    )
    .await
    .expect("open the temporary SQLite database");
    oncely::conformance::pruner_prunes_due_records_in_bounded_batches(ledger, true).await;
}

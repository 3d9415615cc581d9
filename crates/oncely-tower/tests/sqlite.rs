//! The layer on SQLite (a fresh database file per test).

mod common;

use std::sync::Arc;

use oncely_sqlite::{SqliteLedger, SqliteLedgerOptions};

async fn open() -> Option<(Arc<SqliteLedger>, tempfile::TempDir)> {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("tower.db").display());
    let ledger = SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().max_connections(8))
        .await
        .unwrap();
    Some((Arc::new(ledger), dir))
}

layer_tests!(open);

/// A ledger that cannot be reached fails closed: 503, and the handler does
/// not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_ledger_fails_closed() {
    let (ledger, _dir) = open().await.unwrap();
    let (app, counts) = common::app(ledger.clone(), |l| l);
    ledger.pool().close().await;
    let answer = common::post_req("/charges", "alice", "\"k\"", "{}")
        .send(&app)
        .await;
    assert_eq!(answer.status, 503);
    assert_eq!(
        answer.problem()["type"],
        "tag:oncely.dev,2026:idempotency:ledger-unavailable"
    );
    assert_eq!(counts.charges.load(std::sync::atomic::Ordering::SeqCst), 0);
}

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

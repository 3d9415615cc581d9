//! The shared conformance suite on a temporary database file.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use oncely_sqlite::{SqliteLedger, SqliteLedgerOptions, SqliteSynchronous};

/// One temporary directory per test process (a file per test in it), removed when the process ends
/// normally (left in the system temp dir otherwise).
fn dir() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"))
}

async fn ledger() -> Option<SqliteLedger> {
    // Every test gets its own runtime, so each opens its own pool (a pool's
    // connections belong to the runtime that made them), and its own file:
    // SQLite has one writer per file, and the suite's short leases should not
    // wait on another test's write lock. 70 connections so the 64 racers each
    // run on their own connection.
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let path = dir()
        .path()
        .join(format!("conformance-{}.db", SEQ.fetch_add(1, Ordering::Relaxed)));
    let url = format!("sqlite:{}", path.display());
    // synchronous=NORMAL: the suite's 300 ms leases start at the claim's
    // timestamp, and an fsync per commit on a busy disk could eat most of
    // that before the next step looks. No behaviour the suite checks depends
    // on fsync (tests/sqlite.rs reopens a file under the default FULL).
    let options = SqliteLedgerOptions::default()
        .max_connections(70)
        .synchronous(SqliteSynchronous::Normal);
    let ledger = SqliteLedger::connect_with(&url, options)
        .await
        .expect("open the temporary SQLite database");
    Some(ledger)
}

oncely::conformance::conformance_tests!(ledger);
oncely::conformance::transactional_conformance_tests!(ledger);
oncely::conformance::admin_conformance_tests!(ledger);

/// The outbox suite: each case on a file of its own (a relay's claim takes
/// any due message of its outbox).
async fn outbox(_case: &'static str) -> Option<SqliteLedger> {
    ledger().await
}

oncely::conformance::outbox_conformance_tests!(outbox);

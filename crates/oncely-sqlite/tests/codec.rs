//! The outcome codec on SQLite: nothing plain in `sqlite3 .dump`, rotation,
//! typed key errors, the caller's transaction, and the conformance suites
//! through the wrapper. Each test on a file of its own.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use oncely::conformance as c;
use oncely_sqlite::SqliteLedger;

fn dir() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"))
}

async fn ledger() -> (SqliteLedger, PathBuf) {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let path = dir()
        .path()
        .join(format!("codec-{}.db", SEQ.fetch_add(1, Ordering::Relaxed)));
    let ledger = SqliteLedger::connect(&format!("sqlite:{}", path.display()))
        .await
        .expect("open the temporary SQLite database");
    (ledger, path)
}

#[tokio::test]
async fn a_dump_holds_no_plain_outcome() {
    let (ledger, path) = ledger().await;
    c::codec_dump_holds_no_plain_outcome(
        ledger,
        || oncely_testkit::dump::sqlite(&path).expect("sqlite3 .dump runs"),
        oncely_testkit::dump::contains,
    )
    .await;
}

/// A ledger on a file of its own, for the shared codec cases.
async fn on_its_own_file() -> Option<SqliteLedger> {
    Some(ledger().await.0)
}

oncely::conformance::codec_conformance_tests!(on_its_own_file);

#[tokio::test]
async fn seals_in_the_callers_transaction() {
    c::codec_seals_in_the_callers_transaction(ledger().await.0).await;
}

/// The shared conformance suites, plain and transactional, through the
/// wrapper on SQLite: the contract holds with every outcome sealed.
mod through_the_wrapper {
    use oncely::codec::{Keyring, Sealed, SecretKey};
    use oncely_sqlite::{SqliteLedger, SqliteLedgerOptions, SqliteSynchronous};

    async fn ledger() -> Option<Sealed<SqliteLedger, Keyring>> {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let path = super::dir()
            .path()
            .join(format!("sealed-{}.db", SEQ.fetch_add(1, Ordering::Relaxed)));
        // As tests/conformance.rs opens its files: a connection per racer,
        // synchronous=NORMAL for the suite's short leases.
        let options = SqliteLedgerOptions::default()
            .max_connections(70)
            .synchronous(SqliteSynchronous::Normal);
        let inner = SqliteLedger::connect_with(&format!("sqlite:{}", path.display()), options)
            .await
            .expect("open the temporary SQLite database");
        let keys = Keyring::new("k1", SecretKey::from_bytes([4; 32])).unwrap();
        Some(Sealed::new(inner, keys))
    }

    oncely::conformance::conformance_tests!(ledger);
    oncely::conformance::transactional_conformance_tests!(ledger);
}

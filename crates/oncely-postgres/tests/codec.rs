//! The outcome codec on PostgreSQL: nothing plain in `pg_dump`, rotation,
//! typed key errors, the caller's transaction, and the conformance suites
//! through the wrapper. On a table of its own
//! (`oncely_codec`); each case on a fresh tenant.

use oncely::conformance::{self as c, service_url, skip_or_fail};
use oncely_postgres::{PgLedger, PgLedgerOptions};

const TABLE: &str = "oncely_codec";

fn url() -> Option<String> {
    service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )
}

async fn ledger() -> Option<PgLedger> {
    ledger_with(PgLedgerOptions::default().table(TABLE)).await
}

async fn ledger_with(options: PgLedgerOptions) -> Option<PgLedger> {
    // Connecting migrates; one at a time, so two tests never create the
    // table at once.
    static CONNECT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let url = url()?;
    let _one = CONNECT.lock().await;
    match PgLedger::connect_with(&url, options).await {
        Ok(l) => Some(l),
        Err(e) => skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
    }
}

#[tokio::test]
async fn a_dump_holds_no_plain_outcome() {
    let (Some(ledger), Some(url)) = (ledger().await, url()) else {
        return;
    };
    c::codec_dump_holds_no_plain_outcome(
        ledger,
        || oncely_testkit::dump::postgres(&url, &format!("public.{TABLE}")).expect("pg_dump runs"),
        oncely_testkit::dump::contains,
    )
    .await;
}

oncely::conformance::codec_conformance_tests!(ledger);

#[tokio::test]
async fn seals_in_the_callers_transaction() {
    let Some(ledger) = ledger().await else { return };
    c::codec_seals_in_the_callers_transaction(ledger).await;
}

/// The shared conformance suites, plain and transactional, through the
/// wrapper on PostgreSQL: the contract holds with every outcome sealed.
mod through_the_wrapper {
    use oncely::codec::{Keyring, Sealed, SecretKey};

    use super::*;

    async fn ledger() -> Option<Sealed<PgLedger, Keyring>> {
        // A connection per racer of the suite's races.
        let inner = ledger_with(PgLedgerOptions::default().table(TABLE).max_connections(70)).await?;
        let keys = Keyring::new("k1", SecretKey::from_bytes([4; 32])).unwrap();
        Some(Sealed::new(inner, keys))
    }

    oncely::conformance::conformance_tests!(ledger);
    oncely::conformance::transactional_conformance_tests!(ledger);
}

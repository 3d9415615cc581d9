//! The outcome codec on MySQL and MariaDB: nothing plain in `mysqldump`
//! (raw and `--hex-blob`), rotation,
//! typed key errors, the caller's transaction, and the conformance suites
//! through the wrapper. On a table of its own
//! (`oncely_codec`); each case on a fresh tenant.

use oncely::conformance::{self as c, service_url, skip_or_fail};
use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};

const TABLE: &str = "oncely_codec";

fn url() -> Option<String> {
    service_url("ONCELY_MYSQL_URL", Some("mysql://root@127.0.0.1:3306/test"))
}

async fn ledger() -> Option<MySqlLedger> {
    ledger_with(MySqlLedgerOptions::default().table(TABLE)).await
}

async fn ledger_with(options: MySqlLedgerOptions) -> Option<MySqlLedger> {
    // Connecting migrates; one at a time, so two tests never create the
    // table at once.
    static CONNECT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let url = url()?;
    let _one = CONNECT.lock().await;
    match MySqlLedger::connect_with(&url, options).await {
        Ok(l) => Some(l),
        Err(e) => skip_or_fail(&format!("MySQL at {url}: {e}")),
    }
}

#[tokio::test]
async fn a_dump_holds_no_plain_outcome() {
    let Some(ledger) = ledger().await else { return };
    // The default server; a URL naming another one is dumped from there.
    let (host, port, database) = dump_target(&url().expect("set when the ledger opened"));
    c::codec_dump_holds_no_plain_outcome(
        ledger,
        || oncely_testkit::dump::mysql(&host, port, &database, TABLE).expect("mysqldump runs"),
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

/// Host, port and database of a `mysql://user@host:port/db` URL (root
/// without a password is what `dump::mysql` logs in as).
fn dump_target(url: &str) -> (String, u16, String) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let (authority, path) = rest.split_once('/').unwrap_or((rest, "test"));
    let database = path.split('?').next().unwrap_or("test").to_owned();
    let (host, port) = authority.split_once(':').unwrap_or((authority, "3306"));
    (host.to_owned(), port.parse().expect("a port number"), database)
}

/// The shared conformance suites, plain and transactional, through the
/// wrapper on MySQL: the contract holds with every outcome sealed.
mod through_the_wrapper {
    use oncely::codec::{Keyring, Sealed, SecretKey};

    use super::*;

    async fn ledger() -> Option<Sealed<MySqlLedger, Keyring>> {
        // A connection per racer of the suite's races.
        let inner = ledger_with(MySqlLedgerOptions::default().table(TABLE).max_connections(70)).await?;
        let keys = Keyring::new("k1", SecretKey::from_bytes([4; 32])).unwrap();
        Some(Sealed::new(inner, keys))
    }

    oncely::conformance::conformance_tests!(ledger);
    oncely::conformance::transactional_conformance_tests!(ledger);
}

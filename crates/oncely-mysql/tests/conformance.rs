//! The shared conformance suite, run against MariaDB / MySQL twice: with the
//! server's own claim path (RETURNING on MariaDB 10.5+) and with the MySQL 8
//! path (ODKU, then a locking read) forced, so both are proven on one server.

use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};

async fn ledger_with(returning: Option<bool>) -> Option<MySqlLedger> {
    let url = oncely::conformance::service_url("ONCELY_MYSQL_URL", Some("mysql://root@127.0.0.1:3306/test"))?;
    // The race runs 64 claimants at once; each holds a connection only for
    // one statement, but 70 lets them all be in flight together.
    let opts = MySqlLedgerOptions::default()
        .max_connections(70)
        .returning(returning);
    match MySqlLedger::connect_with(&url, opts).await {
        Ok(l) => Some(l),
        Err(e) => oncely::conformance::skip_or_fail(&format!("MySQL at {url}: {e}")),
    }
}

mod detected {
    use super::*;

    async fn ledger() -> Option<MySqlLedger> {
        ledger_with(None).await
    }

    oncely::conformance_tests!(ledger);
}

mod two_statement {
    use super::*;

    async fn ledger() -> Option<MySqlLedger> {
        ledger_with(Some(false)).await
    }

    oncely::conformance_tests!(ledger);
}

//! The layer on PostgreSQL (`ONCELY_POSTGRES_URL`, by default the loopback
//! server's `test` database; each test has its own tenant).

mod common;

use std::sync::Arc;

use oncely::conformance::{service_url, skip_or_fail};
use oncely_postgres::PgLedger;

async fn open() -> Option<(Arc<PgLedger>, ())> {
    let url = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )?;
    match PgLedger::connect(&url).await {
        Ok(ledger) => Some((Arc::new(ledger), ())),
        Err(e) => skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
    }
}

layer_tests!(open);

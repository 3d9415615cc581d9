//! Databases for the tests: a fresh SQLite file, or the PostgreSQL server
//! from `ONCELY_POSTGRES_URL` (loopback default; skipped when unreachable
//! unless `ONCELY_REQUIRE_SERVICES=1`).

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use oncely::Tenant;
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely_postgres::PgLedger;
use oncely_sqlite::{SqliteLedger, SqliteLedgerOptions, SqliteSynchronous};
use payment_job::{Db, FakeProvider, Pipeline};

/// A fresh SQLite database in a temporary directory (kept alive by the
/// returned guard).
pub async fn sqlite() -> (SqliteLedger, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("payments.db").display());
    // NORMAL still survives a process crash, which is what these tests
    // inject; FULL only adds power-loss safety and costs an fsync per commit.
    let opts = SqliteLedgerOptions::default()
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(30));
    let db = SqliteLedger::connect_with(&url, opts).await.unwrap();
    db.create_orders().await.unwrap();
    (db, dir)
}

/// The PostgreSQL server, or `None` (after saying so) when it is absent.
pub async fn postgres() -> Option<PgLedger> {
    let url = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )?;
    match PgLedger::connect(&url).await {
        Ok(db) => {
            db.create_orders().await.unwrap();
            Some(db)
        }
        Err(e) => skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
    }
}

/// A unique prefix for order ids on a shared database.
pub fn prefix(t: &Tenant) -> String {
    format!("{}-", t.as_str())
}

/// A pipeline on `db` with a fresh tenant and short leases, so redeliveries
/// take crashed steps over quickly.
pub fn pipeline<D: Db>(db: D, honour_keys: bool) -> Arc<Pipeline<D>> {
    Arc::new(Pipeline::new(
        db,
        fresh_tenant(),
        Arc::new(FakeProvider::new(honour_keys)),
        Duration::from_millis(250),
        Duration::from_secs(3),
    ))
}

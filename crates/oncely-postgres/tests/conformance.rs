//! The shared conformance suite on PostgreSQL.

use oncely::conformance::{service_url, skip_or_fail};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::postgres::PgPoolOptions;

/// Migrations run once per test binary; every test then builds its own pool
/// (a pool's sockets belong to the runtime of the test that opened them).
static MIGRATED: tokio::sync::Mutex<bool> = tokio::sync::Mutex::const_new(false);

async fn ledger() -> Option<PgLedger> {
    let url = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )?;
    // Above the suite's 64 racers, so every racer holds its own connection and
    // the race is decided by the unique index, not by pool queueing.
    let pool = match PgPoolOptions::new()
        .max_connections(70)
        .acquire_timeout(std::time::Duration::from_secs(30))
        .connect(&url)
        .await
    {
        Ok(pool) => pool,
        Err(e) => return skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
    };
    let ledger = PgLedger::from_pool_with(pool, PgLedgerOptions::default().table("oncely_conformance"))
        .expect("valid options");
    let mut migrated = MIGRATED.lock().await;
    if !*migrated {
        ledger.migrate().await.expect("migrations run");
        *migrated = true;
    }
    drop(migrated);
    Some(ledger)
}

oncely::conformance::conformance_tests!(ledger);
oncely::conformance::transactional_conformance_tests!(ledger);
oncely::conformance::admin_conformance_tests!(ledger);

/// Three ledgers with pools of their own on the one server, as three
/// processes would have: the multi-node suite's cases hold for them too (a
/// waiter in one is woken by a completion in another through NOTIFY).
async fn processes() -> Option<Vec<PgLedger>> {
    let mut nodes = Vec::new();
    for _ in 0..3 {
        nodes.push(ledger().await?);
    }
    Some(nodes)
}

oncely::conformance::nodes_conformance_tests!(processes);
oncely::conformance::transactional_nodes_conformance_tests!(processes);

/// A ledger on a table of its own per outbox case (`oncely_ob_<case>`,
/// emptied first): a relay's claim takes any due message of its outbox.
async fn outbox(case: &'static str) -> Option<PgLedger> {
    let url = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )?;
    let pool = match PgPoolOptions::new()
        .max_connections(70)
        .acquire_timeout(std::time::Duration::from_secs(30))
        .connect(&url)
        .await
    {
        Ok(pool) => pool,
        Err(e) => return skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
    };
    let table: String = format!("oncely_ob_{case}").chars().take(40).collect();
    let ledger = PgLedger::from_pool_with(pool.clone(), PgLedgerOptions::default().table(&table))
        .expect("valid options");
    ledger.migrate().await.expect("migrations run");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DELETE FROM {table}_outbox")))
        .execute(&pool)
        .await
        .expect("the outbox emptied");
    Some(ledger)
}

oncely::conformance::outbox_conformance_tests!(outbox);

//! The shared conformance suite through a two-host URL whose first host is
//! a synchronous standby (`scripts/pg-standby.sh`, ports 5442/5443): every
//! new connection of the pool skips the standby and lands on the primary,
//! and every rule holds there. (The multi-node suite does not apply: a
//! primary with standbys has one writable node.)

mod common;

use std::sync::OnceLock;
use std::time::Duration;

use oncely_postgres::{PgLedger, PgLedgerOptions};

const PORT: u16 = 5442;

static MIGRATED: tokio::sync::Mutex<bool> = tokio::sync::Mutex::const_new(false);

async fn ledger() -> Option<PgLedger> {
    static URL: OnceLock<Option<String>> = OnceLock::new();
    let url = URL.get_or_init(|| common::pair(PORT, "sync")).clone()?;
    // The standby first: `?target_session_attrs=read-write` skips it.
    let (primary, standby) = (format!("127.0.0.1:{PORT}"), format!("127.0.0.1:{}", PORT + 1));
    let url = url.replace(&format!("{primary},{standby}"), &format!("{standby},{primary}"));
    assert!(url.contains(&format!("@{standby},{primary}/")), "{url}");
    // Above the suite's 64 racers, as in tests/conformance.rs.
    let options = PgLedgerOptions::default()
        .table("oncely_conformance_hosts")
        .max_connections(70)
        .acquire_timeout(Duration::from_secs(30))
        .operation_timeout(Duration::from_secs(60))
        .migrate(false);
    let mut migrated = MIGRATED.lock().await;
    if !*migrated {
        PgLedger::connect_with(&url, options.clone().migrate(true))
            .await
            .expect("connects to the primary through the host list");
        *migrated = true;
    }
    drop(migrated);
    Some(PgLedger::connect_with(&url, options).await.expect("connects"))
}

oncely::conformance::conformance_tests!(ledger);
oncely::conformance::transactional_conformance_tests!(ledger);
oncely::conformance::admin_conformance_tests!(ledger);

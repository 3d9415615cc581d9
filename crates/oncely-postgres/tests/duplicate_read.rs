//! A duplicate of a completed effect, or of one in progress under a live
//! lease, is a read: the claim takes no row lock, no transaction id, and
//! writes no row, so its commit never waits on a disk flush.
//!
//! Measured on this test's own rows and session, so that other clients
//! writing to the same server change nothing: each row's `xmin`, `xmax` and
//! `ctid` are the same after 200 duplicate claims as before (an update
//! would leave a new row version, a row lock the locking transaction's id
//! in `xmax`), and 200 duplicate claims run in a transaction the test owns
//! leave it without a transaction id (`pg_current_xact_id_if_assigned()`:
//! PostgreSQL assigns one at a transaction's first write or row lock). The
//! claim statement that locked the row failed both.

use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome, TransactionalLedger};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::{ClaimOptions, EffectKey};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::{AssertSqlSafe, PgConnection};

const TABLE: &str = "oncely_pg_duplicates";
const N: usize = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_of_completed_and_live_effects_write_nothing() {
    let Some(url) = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    ) else {
        return;
    };
    let ledger = match PgLedger::connect_with(&url, PgLedgerOptions::default().table(TABLE)).await {
        Ok(l) => l,
        Err(e) => {
            skip_or_fail::<()>(&format!("PostgreSQL at {url}: {e}"));
            return;
        }
    };
    let t = fresh_tenant();
    let opts = ClaimOptions::default().lease(Duration::from_secs(600));
    let completed: Vec<EffectKey> = (0..N)
        .map(|i| EffectKey::new(&t, "capture", format!("done-{i}")).unwrap())
        .collect();
    let live: Vec<EffectKey> = (0..N)
        .map(|i| EffectKey::new(&t, "capture", format!("live-{i}")).unwrap())
        .collect();
    for k in &completed {
        match ledger.claim(k, &opts).await.unwrap() {
            Claim::Acquired(l) => ledger.complete(&l, &Outcome::value(&1).unwrap()).await.unwrap(),
            other => panic!("{other:?}"),
        }
    }
    for k in &live {
        assert!(matches!(
            ledger.claim(k, &opts).await.unwrap(),
            Claim::Acquired(_)
        ));
    }

    for (what, keys) in [("completed", &completed), ("in progress", &live)] {
        let before = versions(ledger.pool().acquire().await.unwrap().as_mut(), keys).await;
        assert_eq!(before.len(), N, "{what}: rows");
        // No transaction locks the rows yet (else the check below would
        // compare two locked states).
        for (key, _, xmax, _) in &before {
            assert_eq!(xmax, "0", "{what}: {key} locked before the duplicates");
        }

        // Autocommit, as a consumer claims: one statement per claim.
        for k in keys.iter() {
            duplicate(&ledger, k).await;
        }
        let after = versions(ledger.pool().acquire().await.unwrap().as_mut(), keys).await;
        assert_eq!(
            after, before,
            "{what}: {N} duplicate claims changed their rows' versions (key, xmin, xmax, ctid)"
        );

        // The same statement in a transaction of our own: a write or a row
        // lock would have given it a transaction id.
        let mut tx = ledger.begin().await.unwrap();
        for k in keys.iter() {
            duplicate_in(&ledger, &mut tx, k).await;
        }
        let xid: Option<String> = sqlx::query_scalar("SELECT pg_current_xact_id_if_assigned()::text")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(xid, None, "{what}: {N} duplicate claims in one transaction wrote");
        let inside = versions(&mut tx, keys).await;
        ledger.rollback(tx).await.unwrap();
        assert_eq!(
            inside, before,
            "{what}: duplicate claims in a transaction changed the rows"
        );
    }
}

/// One duplicate claim, answered as a duplicate.
async fn duplicate(ledger: &PgLedger, k: &EffectKey) {
    match ledger.claim(k, &ClaimOptions::default()).await.unwrap() {
        Claim::Completed(_) | Claim::InProgress { .. } => {}
        other => panic!("{k}: {other:?}"),
    }
}

/// One duplicate claim on `conn`'s open transaction, answered as a duplicate.
async fn duplicate_in(ledger: &PgLedger, conn: &mut PgConnection, k: &EffectKey) {
    match ledger.claim_in(conn, k, &ClaimOptions::default()).await.unwrap() {
        Claim::Completed(_) | Claim::InProgress { .. } => {}
        other => panic!("{k}: {other:?}"),
    }
}

/// Each key's current row version: (key, xmin, xmax, ctid), in key order.
async fn versions(conn: &mut PgConnection, keys: &[EffectKey]) -> Vec<(String, String, String, String)> {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT key, xmin::text, xmax::text, ctid::text FROM {TABLE} WHERE key = ANY($1) ORDER BY key"
    )))
    .bind(keys.iter().map(EffectKey::as_str).collect::<Vec<_>>())
    .fetch_all(conn)
    .await
    .unwrap()
}

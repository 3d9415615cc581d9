//! The background pruner on PostgreSQL, on a table of its own (emptied
//! first, so the pruner's counts are exact).

use oncely::conformance::{service_url, skip_or_fail};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::postgres::PgPoolOptions;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pruner_prunes_due_records_in_bounded_batches() {
    let Some(url) = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    ) else {
        return;
    };
    let pool = match PgPoolOptions::new().max_connections(8).connect(&url).await {
        Ok(pool) => pool,
        Err(e) => return skip_or_fail(&format!("PostgreSQL at {url}: {e}")).unwrap_or(()),
    };
    let ledger = PgLedger::from_pool_with(
        pool.clone(),
        PgLedgerOptions::default().table("oncely_pruner_test"),
    )
    .expect("valid options");
    ledger.migrate().await.expect("migrations run");
    sqlx::raw_sql("TRUNCATE oncely_pruner_test")
        .execute(&pool)
        .await
        .unwrap();
    oncely::conformance::pruner_prunes_due_records_in_bounded_batches(ledger, true).await;
}

/// Prune batches search from where the previous batch stopped (a cursor on
/// `retain_until`), and a row they skipped because a claim held it is still
/// deleted by the next `prune(u64::MAX)`: it starts from the oldest again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_row_skipped_behind_the_cursor_is_pruned_by_the_next_pass() {
    use std::time::Duration;

    use oncely::backend::{Claim, Ledger, TransactionalLedger};
    use oncely::{ClaimOptions, EffectKey, Tenant};

    let Some(url) = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    ) else {
        return;
    };
    let pool = match PgPoolOptions::new().max_connections(8).connect(&url).await {
        Ok(pool) => pool,
        Err(e) => return skip_or_fail(&format!("PostgreSQL at {url}: {e}")).unwrap_or(()),
    };
    let ledger = PgLedger::from_pool_with(
        pool.clone(),
        PgLedgerOptions::default().table("oncely_pruner_cursor"),
    )
    .expect("valid options");
    ledger.migrate().await.expect("migrations run");
    sqlx::raw_sql("TRUNCATE oncely_pruner_cursor")
        .execute(&pool)
        .await
        .unwrap();
    let t = Tenant::new("cursor").unwrap();
    let brief = ClaimOptions::default()
        .lease(Duration::from_millis(100))
        .retention(Duration::from_millis(300));
    let keys: Vec<EffectKey> = (0..12)
        .map(|i| EffectKey::new(&t, "capture", format!("k-{i:02}")).unwrap())
        .collect();
    for k in &keys {
        let Claim::Acquired(lease) = ledger.claim(k, &brief).await.unwrap() else {
            panic!("{k} not acquired");
        };
        ledger.release(&lease).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    // A caller's transaction takes the oldest over and holds it: prune skips it.
    let mut tx = ledger.begin().await.unwrap();
    assert!(matches!(
        ledger.claim_in(&mut tx, &keys[0], &brief).await.unwrap(),
        Claim::Acquired(_)
    ));
    assert_eq!(ledger.prune(5).await.unwrap(), 5);
    assert!(ledger.get(&keys[0]).await.unwrap().is_some());
    // Rolled back: released and due again, behind the cursor.
    ledger.rollback(tx).await.unwrap();
    assert_eq!(ledger.prune(u64::MAX).await.unwrap(), 7);
    for k in &keys {
        assert!(ledger.get(k).await.unwrap().is_none(), "{k} was not pruned");
    }
    assert_eq!(ledger.prune(u64::MAX).await.unwrap(), 0);
}

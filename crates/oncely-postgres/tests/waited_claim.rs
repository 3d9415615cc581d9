//! A duplicate whose claim waited on the key's lock while the first
//! delivery's claim inserted the key is answered in one run of the claim
//! statement.
//!
//! The statement's own snapshot is taken before it waits on the lock, so it
//! cannot see a row committed during the wait; the claim reads the records
//! through `<table>_current`, whose query takes its snapshot after the lock
//! (schema version 5). Before it, such a claim found nothing, was refused
//! by the unique index, reported the key `missing` and ran the whole
//! statement again.
//!
//! Measured on the waiting claim's own transaction, which counts only its
//! own work: the function was called once (`pg_stat_xact_user_functions`),
//! and the table was scanned fewer than twice as often as by a claim that
//! found the same kind of row without waiting
//! (`pg_stat_xact_user_tables`, the function's query included). Run again,
//! the statement would repeat every scan of that claim on top of its first
//! run's (its read and the insert's conflict check): at least twice as
//! many.

use std::time::{Duration, Instant};

use oncely::backend::{Claim, Ledger, Outcome, TransactionalLedger};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::{ClaimOptions, EffectKey};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::{AssertSqlSafe, PgConnection};

const TABLE: &str = "oncely_pg_waited";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_waited_on_the_lock_is_answered_in_one_run() {
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
    let outcome = Outcome::value(&"captured").unwrap();

    // What a duplicate's claim of a completed record costs when nothing
    // holds the key: the baseline.
    let seen = EffectKey::new(&t, "capture", "seen").unwrap();
    let Claim::Acquired(lease) = ledger.claim(&seen, &opts).await.unwrap() else {
        panic!("a fresh key is acquired");
    };
    ledger.complete(&lease, &outcome).await.unwrap();
    let mut tx = ledger.begin().await.unwrap();
    let before = scans(&mut tx).await;
    let claim = ledger.claim_in(&mut tx, &seen, &opts).await.unwrap();
    assert!(matches!(claim, Claim::Completed(_)), "{claim:?}");
    let unwaited = scans(&mut tx).await - before;
    ledger.rollback(tx).await.unwrap();
    assert!(unwaited > 0, "the claim read the table");

    // The first delivery claims in its transaction and holds the key's lock
    // (its row is not committed yet); the duplicate's claim waits on it.
    let key = EffectKey::new(&t, "capture", "waited").unwrap();
    let mut first = ledger.begin().await.unwrap();
    let Claim::Acquired(lease) = ledger.claim_in(&mut first, &key, &opts).await.unwrap() else {
        panic!("a fresh key is acquired");
    };
    let mut second = ledger.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *second)
        .await
        .unwrap();
    sqlx::query("SET LOCAL track_functions = 'pl'")
        .execute(&mut *second)
        .await
        .unwrap();
    let before = scans(&mut second).await;
    let waiting = {
        let (ledger, key, opts) = (ledger.clone(), key.clone(), opts.clone());
        tokio::spawn(async move {
            let claim = ledger.claim_in(&mut second, &key, &opts).await;
            (second, claim)
        })
    };
    wait_for_lock(&ledger, pid).await;
    ledger.complete_in(&mut first, &lease, &outcome).await.unwrap();
    ledger.commit(first).await.unwrap();

    let (mut second, claim) = waiting.await.unwrap();
    match claim.unwrap() {
        Claim::Completed(r) => assert_eq!(r.outcome.unwrap().as_bytes(), outcome.as_bytes()),
        other => panic!("the duplicate that waited gets the outcome: {other:?}"),
    }
    let waited = scans(&mut second).await - before;
    let reads: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_xact_user_functions \
         WHERE funcname = '{TABLE}_current'"
    )))
    .fetch_one(&mut *second)
    .await
    .unwrap();
    ledger.rollback(second).await.unwrap();
    assert_eq!(
        reads, 1,
        "the row committed during the wait is read on a fresh snapshot"
    );
    assert!(
        waited < 2 * unwaited,
        "a claim that waited on the lock scanned the table {waited} times, one that did not {unwaited}: \
         the statement ran again"
    );
}

/// Scans of the test's table by the current transaction so far.
async fn scans(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT coalesce(sum(coalesce(seq_scan, 0) + coalesce(idx_scan, 0)), 0)::bigint \
         FROM pg_stat_xact_user_tables WHERE relname = '{TABLE}'"
    )))
    .fetch_one(conn)
    .await
    .unwrap()
}

/// Until the session `pid` waits on a lock (the key's advisory lock).
async fn wait_for_lock(ledger: &PgLedger, pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: bool = sqlx::query_scalar(
            "SELECT coalesce((SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1), false)",
        )
        .bind(pid)
        .fetch_one(ledger.pool())
        .await
        .unwrap();
        if waiting {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the duplicate's claim never waited on the lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

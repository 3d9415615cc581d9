//! `ClaimOptions::relaxed_claim`: the claim is acknowledged before its WAL
//! flush (`synchronous_commit = off` for the claim's own transaction), the
//! completion still waits for its flush, and a claim in the caller's
//! transaction leaves that transaction's setting alone.
//!
//! WAL flushes are read from `pg_stat_wal.wal_sync`, which counts the whole
//! server's, and which each backend reports at most once a second: the
//! ledger has one connection, which runs the jobs one after the other and is
//! told to report at once (`pg_stat_force_next_flush()`) before each
//! reading; the comparison leaves room for other clients' flushes.

use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome, TransactionalLedger};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::{ClaimOptions, EffectKey};
use oncely_postgres::{PgLedger, PgLedgerOptions};

const TABLE: &str = "oncely_pg_relaxed";
const JOBS: usize = 300;

async fn ledger() -> Option<PgLedger> {
    let url = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )?;
    let options = PgLedgerOptions::default().table(TABLE).max_connections(1);
    match PgLedger::connect_with(&url, options).await {
        Ok(l) => Some(l),
        Err(e) => skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
    }
}

async fn wal_syncs(ledger: &PgLedger) -> i64 {
    // The pool's one connection reports its counts when this statement
    // ends; the next reads them.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(ledger.pool())
        .await
        .unwrap();
    sqlx::query_scalar("SELECT wal_sync FROM pg_stat_wal")
        .fetch_one(ledger.pool())
        .await
        .unwrap()
}

/// `JOBS` sequential claim + complete jobs; the server's WAL flushes per job.
async fn flushes_per_job(ledger: &PgLedger, opts: &ClaimOptions, subject: &str) -> f64 {
    let t = fresh_tenant();
    let before = wal_syncs(ledger).await;
    for i in 0..JOBS {
        let k = EffectKey::new(&t, "capture", format!("{subject}-{i}")).unwrap();
        match ledger.claim(&k, opts).await.unwrap() {
            Claim::Acquired(l) => ledger.complete(&l, &Outcome::value(&i).unwrap()).await.unwrap(),
            other => panic!("{other:?}"),
        }
    }
    (wal_syncs(ledger).await - before) as f64 / JOBS as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relaxed_claim_is_acknowledged_before_its_flush_and_its_completion_is_not() {
    let Some(ledger) = ledger().await else { return };
    let durable = ClaimOptions::default().lease(Duration::from_secs(60));
    let relaxed = durable.clone().relaxed_claim(true);
    // Warm the pool and the statements.
    flushes_per_job(&ledger, &relaxed, "warm").await;
    let d = flushes_per_job(&ledger, &durable, "durable").await;
    let r = flushes_per_job(&ledger, &relaxed, "relaxed").await;
    println!("WAL flushes per job: durable claim {d:.2}, relaxed claim {r:.2}");
    let flushing: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(ledger.pool())
        .await
        .unwrap();
    let fsync: String = sqlx::query_scalar("SHOW fsync")
        .fetch_one(ledger.pool())
        .await
        .unwrap();
    if flushing == "off" || fsync == "off" {
        eprintln!(
            "the server does not flush per commit (synchronous_commit {flushing}, fsync {fsync}): nothing to compare"
        );
        return;
    }
    // Two flushes per durable job, fewer where another client's commit
    // shared one (group commit); one per relaxed job, its completion's.
    assert!(
        d >= 1.5,
        "a durable claim + completion flushed {d:.2} times per job, not about 2"
    );
    assert!(
        r >= 0.8,
        "the completion of a relaxed claim must still flush: {r:.2} per job"
    );
    assert!(
        r <= d - 0.6,
        "a relaxed claim still waited for its flush: {r:.2} against {d:.2} per job"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relaxed_claim_in_the_callers_transaction_leaves_its_setting_alone() {
    let Some(ledger) = ledger().await else { return };
    let k = EffectKey::new(&fresh_tenant(), "capture", "in-tx").unwrap();
    let mut tx = ledger.begin().await.unwrap();
    let before: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let claim = ledger
        .claim_in(&mut tx, &k, &ClaimOptions::default().relaxed_claim(true))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired(_)), "{claim:?}");
    let after: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(
        before, after,
        "a claim in the caller's transaction changed how that transaction commits"
    );
    ledger.rollback(tx).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relaxed_at_most_once_claim_is_refused_before_any_round_trip() {
    let Some(ledger) = ledger().await else { return };
    let k = EffectKey::new(&fresh_tenant(), "receipt", "amo").unwrap();
    let opts = ClaimOptions::default().at_most_once(true).relaxed_claim(true);
    let e = ledger.claim(&k, &opts).await.unwrap_err();
    assert!(e.is_invalid_input(), "{e:?}");
    assert!(ledger.get(&k).await.unwrap().is_none());
}

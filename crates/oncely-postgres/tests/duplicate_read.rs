//! A duplicate of a completed effect, or of one in progress under a live
//! lease, is a read: the claim takes no row lock, no transaction id, and
//! writes no WAL, so its commit never waits on a disk flush.
//!
//! Measured on the server: the WAL insert position before and after 200
//! duplicate claims, and the rows' `xmax` (a row lock would leave the
//! locking transaction's id there). The WAL position is the whole server's,
//! so this file holds this one test (test binaries run one at a time) and
//! the measurement is repeated a few times, keeping the lowest: anything
//! else writing (autovacuum, another client) can only add to it. The claim
//! statement that locked the row wrote about 120 bytes per duplicate.

use std::time::Duration;

use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::{Claim, ClaimOptions, EffectKey, Ledger, Outcome};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::AssertSqlSafe;

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
        // A first round of duplicates lets the server do its own
        // housekeeping on these pages (hint bits, pruning the versions the
        // completions left), which a read may write once.
        duplicates(&ledger, keys).await;
        let mut lowest = u64::MAX;
        for _ in 0..3 {
            let before = wal(&ledger).await;
            duplicates(&ledger, keys).await;
            lowest = lowest.min(wal(&ledger).await - before);
        }
        assert!(
            lowest < (N as u64) * 8,
            "{N} duplicates of {what} effects wrote {lowest} bytes of WAL"
        );
        // No transaction locked the rows: a lock would have left its id.
        let locked: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {TABLE} WHERE key = ANY($1) AND xmax::text <> '0'"
        )))
        .bind(keys.iter().map(EffectKey::as_str).collect::<Vec<_>>())
        .fetch_one(ledger.pool())
        .await
        .unwrap();
        assert_eq!(locked, 0, "{what}: rows locked by duplicates");
    }
}

/// One duplicate claim of each key, answered as a duplicate.
async fn duplicates(ledger: &PgLedger, keys: &[EffectKey]) {
    for k in keys {
        match ledger.claim(k, &ClaimOptions::default()).await.unwrap() {
            Claim::Completed(_) | Claim::InProgress { .. } => {}
            other => panic!("{k}: {other:?}"),
        }
    }
}

/// The server's WAL insert position, in bytes.
async fn wal(ledger: &PgLedger) -> u64 {
    let lsn: i64 = sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
        .fetch_one(ledger.pool())
        .await
        .unwrap();
    lsn as u64
}

//! A unique violation on a business table inside `Job::step_in` is a bug in
//! the guard or the data, never a duplicate: the runner reports the
//! non-retryable `Error::ConstraintViolation` and counts it. (Its own test
//! binary: the counter has no labels, and other tests provoke violations of
//! their own.)

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use oncely::backend::{Ledger, RecordState};
use oncely::conformance::{counter, fresh_tenant, metrics_snapshotter};
use oncely::telemetry::UNEXPECTED_CONSTRAINT_VIOLATIONS_TOTAL;
use oncely::{Effects, Error};
use oncely_sqlite::SqliteLedger;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unique_violation_in_step_in_is_a_constraint_violation() {
    metrics_snapshotter();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("constraint.db").display());
    let ledger = SqliteLedger::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE invoices (number TEXT NOT NULL UNIQUE, order_id TEXT NOT NULL)")
        .execute(ledger.pool())
        .await
        .unwrap();
    sqlx::query("INSERT INTO invoices VALUES ('INV-1', 'order-0')")
        .execute(ledger.pool())
        .await
        .unwrap();
    let effects = Effects::new(ledger.clone());
    let tenant = fresh_tenant();
    let before = counter(UNEXPECTED_CONSTRAINT_VIOLATIONS_TOTAL, &[]);
    let ran = Arc::new(AtomicUsize::new(0));

    // The closure propagates the driver's error with `?`, or maps it with
    // `oncely_sqlite::map_error` first: both are recognised.
    for (n, mapped) in [(1, false), (2, true)] {
        let job = effects.job(&tenant, "billing", &format!("order-{n}"));
        let mut tx = ledger.begin().await.unwrap();
        let ran = ran.clone();
        let e = job
            .step_in("invoice", &mut tx, move |conn, _ctx| {
                Box::pin(async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    // A bug: the invoice number is already taken.
                    let insert = sqlx::query("INSERT INTO invoices VALUES ('INV-1', ?1)")
                        .bind(format!("order-{n}"))
                        .execute(conn)
                        .await;
                    if mapped {
                        insert.map_err(oncely_sqlite::map_error)?;
                    } else {
                        insert?;
                    }
                    Ok(())
                })
            })
            .await
            .unwrap_err();
        match &e {
            Error::ConstraintViolation { key, message } => {
                assert!(key.contains(&format!("order-{n}")), "{key}");
                assert!(
                    message.contains("UNIQUE constraint failed: invoices.number"),
                    "{message}"
                );
            }
            other => panic!("expected ConstraintViolation, got {other:?}"),
        }
        assert!(!e.is_retryable(), "a consumer would redeliver forever: {e:?}");
        // The caller rolls back, as on any error: nothing of the step stays.
        oncely::backend::TransactionalLedger::rollback(&ledger, tx)
            .await
            .unwrap();
        assert!(job.step_record("invoice", None).await.unwrap().is_none());
        assert_eq!(
            counter(UNEXPECTED_CONSTRAINT_VIOLATIONS_TOTAL, &[]),
            before + n,
            "counted once per violation"
        );
    }
    assert_eq!(ran.load(Ordering::SeqCst), 2);

    // The ledger's own answer to a duplicate is never such an error.
    let job = effects.job(&tenant, "billing", "order-3");
    for _ in 0..2 {
        let mut tx = ledger.begin().await.unwrap();
        job.step_in("invoice", &mut tx, |conn, _ctx| {
            Box::pin(async move {
                sqlx::query("INSERT INTO invoices VALUES ('INV-3', 'order-3')")
                    .execute(conn)
                    .await?;
                Ok(())
            })
        })
        .await
        .unwrap();
        oncely::backend::TransactionalLedger::commit(&ledger, tx)
            .await
            .unwrap();
    }
    let r = job.step_record("invoice", None).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Completed);
    assert_eq!(counter(UNEXPECTED_CONSTRAINT_VIOLATIONS_TOTAL, &[]), before + 2);
}

/// `Ledger::unique_violation` walks the source chain: a driver error wrapped
/// in another error is still found; other errors are not violations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unique_violation_walks_the_source_chain() {
    #[derive(Debug)]
    struct Wrapped(sqlx::Error);
    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("saving the invoice")
        }
    }
    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("chain.db").display());
    let ledger = SqliteLedger::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE t (id INTEGER PRIMARY KEY, code TEXT UNIQUE, n INTEGER NOT NULL)")
        .execute(ledger.pool())
        .await
        .unwrap();
    sqlx::query("INSERT INTO t VALUES (1, 'a', 0)")
        .execute(ledger.pool())
        .await
        .unwrap();
    let fail = |sql: &'static str| {
        let pool = ledger.pool().clone();
        async move { sqlx::query(sql).execute(&pool).await.unwrap_err() }
    };
    // UNIQUE (2067) and PRIMARY KEY (1555).
    for sql in [
        "INSERT INTO t VALUES (2, 'a', 0)",
        "INSERT INTO t VALUES (1, 'b', 0)",
    ] {
        let e = Wrapped(fail(sql).await);
        let message = ledger.unique_violation(&e).expect("found in the chain");
        assert!(message.contains("constraint failed"), "{message}");
    }
    // NOT NULL is a constraint, but not a unique one; nor is a missing table.
    for sql in ["INSERT INTO t VALUES (3, 'c', NULL)", "SELECT * FROM missing"] {
        let e = Wrapped(fail(sql).await);
        assert_eq!(ledger.unique_violation(&e), None, "{sql}");
    }
}

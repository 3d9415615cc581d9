//! The Job API on real databases: transactional steps commit or vanish with
//! the caller's transaction, concurrent duplicates of a transactional step
//! run it once, a slow provider-keyed step keeps its lease, and bad input
//! (an outcome over the limit, a mode conflict, an altered payload) is a
//! clear error that leaves the ledger and the orders as they were.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, UNIX_EPOCH};

use oncely::backend::{Claim, MAX_OUTCOME_BYTES, Record, RecordState};
use oncely::conformance::fresh_tenant;
use oncely::{ClaimOptions, Effects, Error, Failure, OnInProgress, StepFuture, StepMode, Tenant};
use payment_job::{Db, Order};

fn frozen(r: Option<Record>) -> Option<Record> {
    r.map(|mut r| {
        r.read_at = UNIX_EPOCH;
        r
    })
}

async fn order<D: Db>(db: &D, id: &str) -> Order {
    db.orders(&[id.to_owned()]).await.unwrap().remove(0)
}

async fn setup<D: Db>(db: &D) -> (Tenant, String) {
    let t = fresh_tenant();
    let id = format!("{}order-1", common::prefix(&t));
    db.insert_order(&id, 500).await.unwrap();
    (t, id)
}

/// The closure of a mark-paid step.
fn mark_paid<D: Db>(
    id: &str,
    ran: &Arc<AtomicUsize>,
) -> impl for<'c> FnOnce(&'c mut D::Connection, oncely::StepContext) -> StepFuture<'c, String> {
    let (id, ran) = (id.to_owned(), ran.clone());
    move |conn, ctx| {
        Box::pin(async move {
            ran.fetch_add(1, Ordering::SeqCst);
            D::mark_paid(conn, &id, "ch_1", ctx.fence()).await?;
            Ok(format!("paid at fence {}", ctx.fence()))
        })
    }
}

async fn transactional_commits_or_vanishes<D: Db>(db: D) {
    let (t, id) = setup(&db).await;
    let effects = Effects::new(db.clone());
    let ran = Arc::new(AtomicUsize::new(0));
    let job = effects.job(&t, "payment", &id);

    // Rolled back (a crash before the commit): nothing remains.
    let mut tx = db.begin().await.unwrap();
    let out: String = job
        .step_in("mark-paid", &mut *tx, mark_paid::<D>(&id, &ran))
        .await
        .unwrap();
    assert!(out.starts_with("paid at fence "), "{out}");
    drop(tx);
    assert!(job.step_record("mark-paid", None).await.unwrap().is_none());
    assert_eq!(order(&db, &id).await.status, "pending");

    // Committed: the claim, the write and the completion together.
    let mut tx = db.begin().await.unwrap();
    let out: String = job
        .step_in("mark-paid", &mut *tx, mark_paid::<D>(&id, &ran))
        .await
        .unwrap();
    db.commit(tx).await.unwrap();
    let r = job.step_record("mark-paid", None).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Completed);
    assert_eq!(out, format!("paid at fence {}", r.fence));
    assert!(!r.at_most_once);
    let o = order(&db, &id).await;
    assert_eq!((o.status.as_str(), o.paid_writes), ("paid", 1));

    // A redelivery gets the stored outcome; the closure does not run.
    let mut tx = db.begin().await.unwrap();
    let again: String = effects
        .job(&t, "payment", &id)
        .step_in("mark-paid", &mut *tx, mark_paid::<D>(&id, &ran))
        .await
        .unwrap();
    db.commit(tx).await.unwrap();
    assert_eq!(again, out);
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    assert_eq!(order(&db, &id).await.paid_writes, 1);
}

async fn concurrent_duplicates_run_once<D: Db>(db: D) {
    let (t, id) = setup(&db).await;
    let ran = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (db, t, id, ran) = (db.clone(), t.clone(), id.clone(), ran.clone());
            tokio::spawn(async move {
                let effects = Effects::new(db.clone());
                let job = effects.job(&t, "payment", &id);
                let mut tx = db.begin().await.unwrap();
                let out: String = job
                    .step_in("mark-paid", &mut *tx, mark_paid::<D>(&id, &ran))
                    .await
                    .unwrap();
                db.commit(tx).await.unwrap();
                out
            })
        })
        .collect();
    let mut outs = Vec::new();
    for task in tasks {
        outs.push(task.await.unwrap());
    }
    outs.dedup();
    assert_eq!(outs.len(), 1, "every duplicate got the one outcome: {outs:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 1, "one duplicate ran the step");
    assert_eq!(order(&db, &id).await.paid_writes, 1);
}

async fn bad_input_changes_nothing<D: Db>(db: D) {
    let (t, id) = setup(&db).await;
    let effects = Effects::new(db.clone());
    let ran = Arc::new(AtomicUsize::new(0));

    // An outcome over the limit: an error, and the transaction it was
    // written on is rolled back: no record, no order change.
    let job = effects.job(&t, "payment", &id);
    let mut tx = db.begin().await.unwrap();
    let e = job
        .step_in("mark-paid", &mut *tx, |conn, ctx| {
            let id = id.clone();
            Box::pin(async move {
                D::mark_paid(conn, &id, "ch_1", ctx.fence()).await?;
                Ok("x".repeat(MAX_OUTCOME_BYTES))
            }) as StepFuture<'_, String>
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::OutcomeTooLarge { .. }), "{e:?}");
    drop(tx);
    assert!(job.step_record("mark-paid", None).await.unwrap().is_none());
    assert_eq!(order(&db, &id).await.paid_writes, 0);

    // A provider-keyed step with an outcome over the limit is released:
    // nothing stored, the next delivery re-runs it with the same key.
    let e = job
        .step("capture", StepMode::ProviderKeyed, |_| async {
            Ok("x".repeat(MAX_OUTCOME_BYTES))
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::OutcomeTooLarge { .. }), "{e:?}");
    let r = job.step_record("capture", None).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Released);
    assert!(r.outcome.is_none());

    // A kind used with another mode: refused before any round trip.
    let job = effects.job(&t, "payment", &id);
    job.step("capture", StepMode::ProviderKeyed, |_| async {
        Ok("ch_1".to_owned())
    })
    .await
    .unwrap();
    let before = frozen(job.step_record("capture", None).await.unwrap());
    let mut tx = db.begin().await.unwrap();
    let e = job
        .step_in("capture", &mut *tx, mark_paid::<D>(&id, &ran))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Misuse(_)), "{e:?}");
    drop(tx);
    let e = job
        .step("capture", StepMode::AtMostOnce, |_| async {
            Ok("ch_2".to_owned())
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Misuse(_)), "{e:?}");
    assert_eq!(frozen(job.step_record("capture", None).await.unwrap()), before);
    assert_eq!(ran.load(Ordering::SeqCst), 0);

    // A redelivery whose payload was altered: a fingerprint mismatch at its
    // first step, on either path, and nothing changes.
    let msg = serde_json::json!({"order": id, "amount": 500});
    let job = effects.job(&t, "refund", &id).fingerprint_of(&msg).unwrap();
    let mut tx = db.begin().await.unwrap();
    job.step_in("refund-row", &mut *tx, |_, _| {
        Box::pin(async { Ok(1) }) as StepFuture<'_, i32>
    })
    .await
    .unwrap();
    db.commit(tx).await.unwrap();
    let before = frozen(job.step_record("refund-row", None).await.unwrap());
    let altered = serde_json::json!({"order": id, "amount": 50_000});
    let job = effects.job(&t, "refund", &id).fingerprint_of(&altered).unwrap();
    let mut tx = db.begin().await.unwrap();
    let e = job
        .step_in("refund-row", &mut *tx, |_, _| {
            Box::pin(async { Ok(2) }) as StepFuture<'_, i32>
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::FingerprintMismatch { .. }), "{e:?}");
    drop(tx);
    assert_eq!(frozen(job.step_record("refund-row", None).await.unwrap()), before);

    // A terminal failure is stored with the transaction and replayed.
    let job = effects.job(&t, "payment", &id);
    for _ in 0..2 {
        let mut tx = db.begin().await.unwrap();
        let e = job
            .step_in("void", &mut *tx, |_, _| {
                Box::pin(async { Err(Failure::terminal("already settled")) }) as StepFuture<'_, ()>
            })
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Terminal { message, .. } if message == "already settled"),
            "{e:?}"
        );
        db.commit(tx).await.unwrap();
    }
}

async fn slow_step_keeps_its_lease<D: Db>(db: D) {
    let (t, id) = setup(&db).await;
    let effects = Effects::new(db.clone());
    // Wide margins: a renewal every ~330 ms against a 1 s lease.
    let lease = Duration::from_secs(1);
    let opts = ClaimOptions::default()
        .lease(lease)
        .on_in_progress(OnInProgress::Reject);
    let key = effects.job(&t, "export", &id).step_key("upload", None).unwrap();
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let slow = {
        let effects = effects.clone();
        let (t, id, opts) = (t.clone(), id.clone(), opts.clone());
        tokio::spawn(async move {
            effects
                .job(&t, "export", &id)
                .options(opts)
                .step("upload", StepMode::ProviderKeyed, |_| async {
                    let _ = started_tx.send(());
                    tokio::time::sleep(Duration::from_millis(2500)).await;
                    Ok(())
                })
                .await
        })
    };
    started.await.unwrap();
    let mut seen_live = 0;
    let mut first_fence = None;
    while !slow.is_finished() {
        match db.claim(&key, &opts).await.unwrap() {
            Claim::InProgress { fence, .. } => {
                assert_eq!(*first_fence.get_or_insert(fence), fence);
                seen_live += 1;
            }
            Claim::Completed(_) => break,
            other => panic!("a live step was {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    slow.await.unwrap().unwrap();
    assert!(seen_live > 0);
    let r = db.get(&key).await.unwrap().unwrap();
    assert_eq!(
        (r.state, Some(r.fence)),
        (RecordState::Completed, first_fence),
        "renewed, never taken over"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_job_steps() {
    let (db, _dir) = common::sqlite().await;
    transactional_commits_or_vanishes(db.clone()).await;
    concurrent_duplicates_run_once(db.clone()).await;
    bad_input_changes_nothing(db.clone()).await;
    slow_step_keeps_its_lease(db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_job_steps() {
    let Some(db) = common::postgres().await else {
        return;
    };
    transactional_commits_or_vanishes(db.clone()).await;
    concurrent_duplicates_run_once(db.clone()).await;
    bad_input_changes_nothing(db.clone()).await;
    slow_step_keeps_its_lease(db).await;
}

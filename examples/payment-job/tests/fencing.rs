//! Fencing that reaches the business data, on SQLite and PostgreSQL: a worker
//! that stalls past its lease (a zombie) is taken over; the new holder's
//! fenced write lands; the zombie's conditional write
//! (`UPDATE … WHERE id = $1 AND fence < $2`) matches no row, and its
//! `complete` and `renew` fail with `LeaseLost`.

mod common;

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use oncely::backend::{Claim, RecordState};
use oncely::{ClaimOptions, Effects, OnInProgress, StepMode};
use payment_job::Db;
use tokio::sync::oneshot;

async fn fenced_write<D: Db>(db: &D, id: &str, by: &str, fence: u64) -> u64 {
    let mut tx = db.begin().await.unwrap();
    let rows = D::mark_paid(&mut tx, id, by, fence).await.unwrap();
    db.commit(tx).await.unwrap();
    rows
}

/// The raw ledger API: the zombie holds a fence, a later claimant takes the
/// expired lease over with a higher one.
async fn zombie_with_the_ledger<D: Db>(db: D) {
    let t = oncely::conformance::fresh_tenant();
    let id = format!("{}order-z", common::prefix(&t));
    db.insert_order(&id, 100).await.unwrap();
    let key = oncely::EffectKey::new(&t, "ship", &id).unwrap();
    let opts = ClaimOptions::default().lease(Duration::from_millis(200));
    let Claim::Acquired(zombie) = db.claim(&key, &opts).await.unwrap() else {
        panic!()
    };
    // The zombie stalls; the backend's clock lets its lease run out.
    let holder = loop {
        match db.claim(&key, &opts).await.unwrap() {
            Claim::Acquired(l) => break l,
            Claim::InProgress { .. } => tokio::time::sleep(Duration::from_millis(50)).await,
            other => panic!("{other:?}"),
        }
    };
    assert!(holder.fence() > zombie.fence());
    assert!(holder.taken_over());
    assert_eq!(fenced_write(&db, &id, "holder", holder.fence()).await, 1);
    db.complete(&holder, &oncely::backend::Outcome::from_json(&"shipped").unwrap())
        .await
        .unwrap();

    // The zombie wakes up and carries on as if it still held the lease.
    assert_eq!(fenced_write(&db, &id, "zombie", zombie.fence()).await, 0);
    let e = db
        .complete(&zombie, &oncely::backend::Outcome::from_json(&"zombie").unwrap())
        .await
        .unwrap_err();
    assert!(e.is_lease_lost(), "{e:?}");
    let e = db.renew(&zombie, Duration::from_secs(1)).await.unwrap_err();
    assert!(e.is_lease_lost(), "{e:?}");

    let order = &db.orders(std::slice::from_ref(&id)).await.unwrap()[0];
    assert_eq!(order.charge_id.as_deref(), Some("holder"));
    assert_eq!(order.fence, i64::try_from(holder.fence()).unwrap());
    assert_eq!(order.paid_writes, 1);
    let r = db.get(&key).await.unwrap().unwrap();
    assert_eq!((r.state, r.fence), (RecordState::Completed, holder.fence()));
    assert_eq!(r.outcome.unwrap().to_value::<String>().unwrap(), "shipped");
}

/// The same through the Job API. The zombie's step future is simply not
/// polled for a while, as a paused process would not run: its lease
/// renewals stop with it.
async fn zombie_with_a_job<D: Db>(db: D) {
    let t = oncely::conformance::fresh_tenant();
    let id = format!("{}order-j", common::prefix(&t));
    db.insert_order(&id, 100).await.unwrap();
    let effects = Effects::new(db.clone());
    let opts = ClaimOptions::default()
        .lease(Duration::from_millis(200))
        .on_in_progress(OnInProgress::Wait {
            max: Duration::from_secs(10),
        });

    let (reached_tx, reached) = oneshot::channel();
    let (resume_tx, resume) = oneshot::channel::<()>();
    let zombie_job = effects.job(&t, "fulfil", &id).options(opts.clone());
    let (db2, id2) = (db.clone(), id.clone());
    let mut zombie = pin!(
        zombie_job.step("ship", StepMode::ProviderKeyed, |ctx| async move {
            let _ = reached_tx.send(ctx.fence());
            let _ = resume.await;
            Ok(fenced_write(&db2, &id2, "zombie", ctx.fence()).await)
        })
    );
    let zombie_fence = poll_until(&mut zombie, reached).await;

    // Meanwhile a redelivery waits out the lease and takes the step over.
    let holder = effects.job(&t, "fulfil", &id).options(opts);
    let rows: u64 = holder
        .step("ship", StepMode::ProviderKeyed, |ctx| {
            let db = db.clone();
            let id = id.clone();
            async move {
                assert!(ctx.fence() > zombie_fence);
                Ok(fenced_write(&db, &id, "holder", ctx.fence()).await)
            }
        })
        .await
        .unwrap();
    assert_eq!(rows, 1);

    resume_tx.send(()).unwrap();
    let e = zombie.await.unwrap_err();
    assert!(e.is_lease_lost(), "{e:?}");
    let order = &db.orders(std::slice::from_ref(&id)).await.unwrap()[0];
    assert_eq!(order.charge_id.as_deref(), Some("holder"));
    assert_eq!(order.paid_writes, 1, "the zombie's write matched no row");
    let r = holder.step_record("ship", None).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Completed);
    assert!(r.fence > zombie_fence);
    assert_eq!(r.outcome.unwrap().as_bytes(), br#"{"ok":1}"#);
}

/// Polls `fut` until `signal` fires, then stops polling it.
async fn poll_until<F: Future + Unpin, T>(fut: &mut F, signal: oneshot::Receiver<T>) -> T
where
    F::Output: std::fmt::Debug,
{
    tokio::select! {
        out = fut => panic!("finished before the signal: {out:?}"),
        v = signal => v.unwrap(),
    }
}

#[tokio::test]
async fn sqlite_zombie_write_is_fenced_out() {
    let (db, _dir) = common::sqlite().await;
    zombie_with_the_ledger(db.clone()).await;
    zombie_with_a_job(db).await;
}

#[tokio::test]
async fn postgres_zombie_write_is_fenced_out() {
    let Some(db) = common::postgres().await else {
        return;
    };
    zombie_with_the_ledger(db.clone()).await;
    zombie_with_a_job(db).await;
}

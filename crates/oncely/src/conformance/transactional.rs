//! The transactional suite, for every [`TransactionalLedger`]: claims on
//! the caller's transaction.

use std::time::Duration;

use super::{acquired, fresh_tenant, key, opts};
use crate::backend::needs_refresh;
use crate::ledger::TransactionalLedger;
use crate::record::{Claim, Outcome, RecordState};

/// Transactional suite: a claim that waited on a lock held by another
/// transaction gets a lease measured from after the wait. A holds the key in
/// an open transaction; B's claim blocks on it; A rolls back after longer
/// than the lease; B acquires, and C, claiming at once, finds B's lease live.
pub async fn claim_after_a_lock_wait_gets_a_live_lease<L>(ledger: L)
where
    L: TransactionalLedger + Clone + 'static,
{
    let k = key(&fresh_tenant(), "capture", "waited");
    let lease = Duration::from_secs(1);
    let mut tx = ledger.begin().await.unwrap();
    acquired(ledger.claim_in(&mut *tx, &k, &opts().lease(lease)).await.unwrap());
    let b = {
        let (ledger, k) = (ledger.clone(), k.clone());
        tokio::spawn(async move { ledger.claim(&k, &opts().lease(lease)).await })
    };
    tokio::time::sleep(lease * 5 / 2).await;
    assert!(!b.is_finished(), "B did not wait for A's transaction");
    ledger.rollback(tx).await.unwrap();
    let b = acquired(b.await.unwrap().unwrap());
    assert!(
        !needs_refresh(&b, lease),
        "B's lease had ended before it was granted: {b:?}"
    );
    match ledger.claim(&k, &opts()).await.unwrap() {
        Claim::InProgress { fence, .. } => assert_eq!(fence, b.fence),
        other => panic!("B was granted a lease that had already ended: C got {other:?}"),
    }
}

/// Transactional suite: inside a long transaction, a claim's lease is
/// measured on the clock of the claim, not the transaction's start.
pub async fn claim_in_late_in_a_transaction_gets_a_live_lease<L>(ledger: L)
where
    L: TransactionalLedger + Clone + 'static,
{
    let k = key(&fresh_tenant(), "capture", "late-in-tx");
    let lease = Duration::from_millis(1500);
    let mut tx = ledger.begin().await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let l = acquired(ledger.claim_in(&mut *tx, &k, &opts().lease(lease)).await.unwrap());
    assert!(
        !needs_refresh(&l, lease),
        "the lease was measured from the transaction's start: {l:?}"
    );
    ledger.commit(tx).await.unwrap();
    match ledger.claim(&k, &opts()).await.unwrap() {
        Claim::InProgress { fence, .. } => assert_eq!(fence, l.fence),
        other => panic!("the claim's lease had ended at commit: {other:?}"),
    }
}

/// Transactional suite: the claim and the completion written on a
/// transaction commit or roll back with it. Rolled back, nothing of the
/// claim remains and the key is free; committed, the record is completed
/// with its outcome and a duplicate gets it back.
pub async fn claim_in_commits_and_rolls_back_with_the_transaction<L>(ledger: L)
where
    L: TransactionalLedger + Clone + 'static,
{
    let k = key(&fresh_tenant(), "mark-paid", "order-1");
    let mut tx = ledger.begin().await.unwrap();
    let l = acquired(ledger.claim_in(&mut *tx, &k, &opts()).await.unwrap());
    ledger
        .complete_in(&mut *tx, &l, &Outcome::from_json(&"rolled back").unwrap())
        .await
        .unwrap();
    ledger.rollback(tx).await.unwrap();
    assert!(
        ledger.get(&k).await.unwrap().is_none(),
        "a rolled-back claim left a record"
    );

    let mut tx = ledger.begin().await.unwrap();
    let l = acquired(ledger.claim_in(&mut *tx, &k, &opts()).await.unwrap());
    let outcome = Outcome::from_json(&"paid").unwrap();
    ledger.complete_in(&mut *tx, &l, &outcome).await.unwrap();
    // Not committed yet: another connection sees nothing completed.
    assert!(
        ledger
            .get(&k)
            .await
            .unwrap()
            .is_none_or(|r| r.state != RecordState::Completed)
    );
    ledger.commit(tx).await.unwrap();
    let r = ledger.get(&k).await.unwrap().unwrap();
    assert_eq!((r.state, r.fence), (RecordState::Completed, l.fence()));
    assert_eq!(r.outcome.as_ref(), Some(&outcome));
    match ledger.claim(&k, &opts()).await.unwrap() {
        Claim::Completed(r) => assert_eq!(r.outcome, Some(outcome)),
        other => panic!("a duplicate after the commit got {other:?}"),
    }
}

/// Transactional suite: a duplicate that arrives while the first claim's
/// transaction is open waits for it, then gets the committed outcome (never
/// an acquisition, never a success it did not see).
pub async fn duplicate_waits_for_the_transaction_and_sees_its_outcome<L>(ledger: L)
where
    L: TransactionalLedger + Clone + 'static,
{
    let k = key(&fresh_tenant(), "mark-paid", "order-2");
    let mut tx = ledger.begin().await.unwrap();
    let l = acquired(ledger.claim_in(&mut *tx, &k, &opts()).await.unwrap());
    let outcome = Outcome::from_json(&"paid once").unwrap();
    ledger.complete_in(&mut *tx, &l, &outcome).await.unwrap();
    let duplicate = {
        let (ledger, k) = (ledger.clone(), k.clone());
        tokio::spawn(async move { ledger.claim(&k, &opts()).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !duplicate.is_finished(),
        "the duplicate did not wait for the transaction"
    );
    ledger.commit(tx).await.unwrap();
    match duplicate.await.unwrap().unwrap() {
        Claim::Completed(r) => {
            assert_eq!(r.outcome, Some(outcome));
            assert_eq!(r.fence, l.fence());
        }
        other => panic!("the duplicate got {other:?}"),
    }
}

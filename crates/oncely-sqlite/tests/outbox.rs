//! The outbox on SQLite, beyond the shared suite: marking several messages
//! sent answers each ticket, and a message id is never handed out again,
//! even after the newest messages were pruned.

use std::time::Duration;

use oncely::backend::TransactionalLedger;
use oncely::conformance::fresh_tenant;
use oncely::outbox::{Enqueued, Message, Outbox, Pending, TransactionalOutbox};
use oncely::{EffectKey, Tenant};
use oncely_sqlite::SqliteLedger;

async fn open(dir: &tempfile::TempDir, name: &str) -> SqliteLedger {
    SqliteLedger::connect(&format!("sqlite:{}", dir.path().join(name).display()))
        .await
        .unwrap()
}

fn key(t: &Tenant, subject: &str) -> EffectKey {
    EffectKey::new(t, "order.paid", subject).unwrap()
}

async fn enqueue(ledger: &SqliteLedger, key: &EffectKey) -> u64 {
    let mut tx = ledger.begin().await.unwrap();
    let m = Message::new("orders", key.subject().as_bytes().to_vec()).unwrap();
    let e = ledger.enqueue_in(&mut tx, key, &m).await.unwrap();
    ledger.commit(tx).await.unwrap();
    match e {
        Enqueued::New(id) => id,
        Enqueued::Already => panic!("{key} already named a message"),
    }
}

/// Marking several messages sent (one statement) answers each ticket: a
/// live claim's is written; a stale one's (its lease taken over) and a sent
/// one's are not, whatever their place in the batch, and stale tickets
/// alone write nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_marks_answers_each_ticket() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = open(&dir, "marks.db").await;
    let t = fresh_tenant();
    for i in 0..3 {
        enqueue(&ledger, &key(&t, &format!("order-{i}"))).await;
    }
    let first = ledger.claim_messages(10, Duration::from_secs(1)).await.unwrap();
    assert_eq!(first.len(), 3);
    // Not a measure: the lease ends on SQLite's clock by then.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let second = ledger.claim_messages(10, Duration::from_secs(30)).await.unwrap();
    assert_eq!(second.len(), 3);
    assert_eq!(ledger.mark_sent(&[second[2].ticket()]).await.unwrap(), vec![true]);
    assert_eq!(
        ledger
            .mark_sent(&[first[0].ticket(), first[1].ticket()])
            .await
            .unwrap(),
        vec![false, false]
    );
    assert_eq!(ledger.outbox_stats().await.unwrap().sent, 1);
    let tickets = [
        first[0].ticket(),
        second[0].ticket(),
        second[2].ticket(),
        first[1].ticket(),
        second[1].ticket(),
    ];
    assert_eq!(
        ledger.mark_sent(&tickets).await.unwrap(),
        vec![false, true, false, false, true]
    );
    assert_eq!(ledger.outbox_stats().await.unwrap().sent, 3);
}

/// Ids give the relay its per-key order, so one is never handed out twice:
/// after every message, the newest included, was sent and pruned, the next
/// message still gets an id above them all (a plain rowid would start
/// again from the largest id left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_are_never_reused_after_a_prune() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = open(&dir, "ids.db").await;
    let t = fresh_tenant();
    let mut newest = 0;
    for i in 0..3 {
        newest = newest.max(enqueue(&ledger, &key(&t, &format!("order-{i}"))).await);
    }
    let claimed = ledger.claim_messages(10, Duration::from_secs(30)).await.unwrap();
    let tickets: Vec<_> = claimed.iter().map(Pending::ticket).collect();
    assert_eq!(ledger.mark_sent(&tickets).await.unwrap(), vec![true; 3]);
    assert_eq!(ledger.prune_sent(Duration::ZERO, 100).await.unwrap(), 3);
    let next = enqueue(&ledger, &key(&t, "order-3")).await;
    assert!(next > newest, "id {next} after {newest}");
}

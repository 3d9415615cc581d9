//! The outbox on MySQL / MariaDB, beyond the shared suite: a claim in
//! flight (its rows locked, its lease not yet committed) is passed over and
//! still holds back its ordering key; an enqueue that waits on another
//! transaction's uncommitted message of the same key; marking several
//! messages sent answers each ticket; the relay's writes on a pooled
//! connection someone else left inside a transaction.

use std::time::Duration;

use oncely::backend::TransactionalLedger;
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::outbox::{Enqueued, Message, Outbox, Pending, TransactionalOutbox};
use oncely::{EffectKey, Tenant};
use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};
use sqlx::{Connection, Executor, MySqlConnection};

fn url() -> Option<String> {
    service_url("ONCELY_MYSQL_URL", Some("mysql://root@127.0.0.1:3306/test"))
}

/// A ledger whose outbox no other test uses (`oncely_obt_<what>`, emptied
/// first): a claim takes any due message of its outbox.
async fn fresh(what: &str, opts: MySqlLedgerOptions) -> Option<MySqlLedger> {
    let url = url()?;
    let table = format!("oncely_obt_{what}");
    let ledger = match MySqlLedger::connect_with(&url, opts.table(&table)).await {
        Ok(l) => l,
        Err(e) => return skip_or_fail(&format!("MySQL at {url}: {e}")),
    };
    sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM `{table}_outbox`")))
        .execute(ledger.pool())
        .await
        .unwrap();
    Some(ledger)
}

fn key(t: &Tenant, kind: &str, subject: &str) -> EffectKey {
    EffectKey::new(t, kind, subject).unwrap()
}

fn message(body: &str) -> Message {
    Message::new("orders", body.as_bytes().to_vec()).unwrap()
}

async fn enqueue(ledger: &MySqlLedger, key: &EffectKey, body: &str) -> u64 {
    let mut tx = ledger.begin().await.unwrap();
    let e = ledger.enqueue_in(&mut tx, key, &message(body)).await.unwrap();
    ledger.commit(tx).await.unwrap();
    match e {
        Enqueued::New(id) => id,
        Enqueued::Already => panic!("{key} already named a message"),
    }
}

fn bodies(claimed: &[Pending]) -> Vec<String> {
    claimed
        .iter()
        .map(|m| String::from_utf8(m.payload.clone()).unwrap())
        .collect()
}

/// Another relay's claim holds the oldest message of `order-1` locked and
/// has not committed its lease yet. A claim now passes over that message
/// (`SKIP LOCKED`: it does not wait for the other claim), does not take
/// `order-1`'s next message (the locked one is still pending: the test of
/// the ordering key is a plain read, never a locking one that would skip
/// it too), and takes `order-2`'s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_in_flight_is_passed_over_and_holds_back_its_key() {
    let Some(ledger) = fresh("in_flight", MySqlLedgerOptions::default()).await else {
        return;
    };
    let t = fresh_tenant();
    let first = enqueue(&ledger, &key(&t, "event-0", "order-1"), "order-1#0").await;
    enqueue(&ledger, &key(&t, "event-1", "order-1"), "order-1#1").await;
    enqueue(&ledger, &key(&t, "event-0", "order-2"), "order-2#0").await;
    // The other relay's claim, between its lock and its commit.
    let mut other = MySqlConnection::connect(&url().unwrap()).await.unwrap();
    other.execute("BEGIN").await.unwrap();
    let locked: Vec<u64> =
        sqlx::query_scalar("SELECT id FROM oncely_obt_in_flight_outbox WHERE id = ? FOR UPDATE")
            .bind(first)
            .fetch_all(&mut other)
            .await
            .unwrap();
    assert_eq!(locked, vec![first]);
    let claimed = ledger.claim_messages(10, Duration::from_secs(30)).await.unwrap();
    assert_eq!(bodies(&claimed), vec!["order-2#0"]);
    other.execute("ROLLBACK").await.unwrap();
    // The other claim gave up: the first message is due again, and still
    // holds back its successor.
    let claimed = ledger.claim_messages(10, Duration::from_secs(30)).await.unwrap();
    assert_eq!(bodies(&claimed), vec!["order-1#0"]);
}

/// An enqueue whose key another transaction has enqueued and not yet
/// committed waits for it, then writes nothing if that one commits, and its
/// own message if that one rolls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_enqueue_waits_for_an_uncommitted_message_of_its_key() {
    let Some(ledger) = fresh("waits", MySqlLedgerOptions::default()).await else {
        return;
    };
    let t = fresh_tenant();
    for commit in [true, false] {
        let k = key(&t, "order.paid", &format!("order-{commit}"));
        let mut first = ledger.begin().await.unwrap();
        assert!(matches!(
            ledger
                .enqueue_in(&mut first, &k, &message("first"))
                .await
                .unwrap(),
            Enqueued::New(_)
        ));
        let second = {
            let (ledger, k) = (ledger.clone(), k.clone());
            tokio::spawn(async move {
                let mut tx = ledger.begin().await.unwrap();
                let e = ledger.enqueue_in(&mut tx, &k, &message("second")).await.unwrap();
                ledger.commit(tx).await.unwrap();
                e
            })
        };
        // Not a measure: whether the second enqueue is waiting yet or not,
        // its answer is the same.
        tokio::time::sleep(Duration::from_millis(200)).await;
        if commit {
            ledger.commit(first).await.unwrap();
            assert_eq!(second.await.unwrap(), Enqueued::Already);
        } else {
            ledger.rollback(first).await.unwrap();
            assert!(matches!(second.await.unwrap(), Enqueued::New(_)));
        }
        let claimed = ledger.claim_messages(10, Duration::from_secs(30)).await.unwrap();
        let want = if commit { "first" } else { "second" };
        assert_eq!(bodies(&claimed), vec![want]);
        let tickets: Vec<_> = claimed.iter().map(Pending::ticket).collect();
        assert_eq!(ledger.mark_sent(&tickets).await.unwrap(), vec![true]);
    }
}

/// Marking several messages sent (one transaction) answers each ticket:
/// a live claim's is written, a stale one's (its lease taken over) and a
/// sent one's are not, whatever their place in the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_marks_answers_each_ticket() {
    let Some(ledger) = fresh("batch_marks", MySqlLedgerOptions::default()).await else {
        return;
    };
    let t = fresh_tenant();
    for i in 0..3 {
        enqueue(
            &ledger,
            &key(&t, "order.paid", &format!("order-{i}")),
            &format!("{i}"),
        )
        .await;
    }
    let first = ledger.claim_messages(10, Duration::from_secs(1)).await.unwrap();
    assert_eq!(first.len(), 3);
    // Not a measure: the lease ends on the server's clock by then.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let second = ledger.claim_messages(10, Duration::from_secs(30)).await.unwrap();
    assert_eq!(second.len(), 3);
    assert_eq!(ledger.mark_sent(&[second[2].ticket()]).await.unwrap(), vec![true]);
    // Stale tickets alone write nothing: the live claims still hold.
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

/// Leaves the pool's only connection inside an open transaction that sqlx
/// does not know about (as a `pool.begin()` dropped between its `BEGIN` and
/// its return does).
async fn leak_a_transaction(ledger: &MySqlLedger) {
    let mut conn = ledger.pool().acquire().await.unwrap();
    conn.execute("BEGIN").await.unwrap();
}

/// Every relay write on a pooled connection that someone else left inside
/// a transaction is made for real (another pool sees it) and leaves the
/// connection outside any transaction: the claim's own transaction would
/// otherwise commit the stray one, and an autocommit write would commit
/// only with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_writes_on_a_leaked_transaction_are_made_for_real() {
    let Some(ledger) = fresh("leak", MySqlLedgerOptions::default().max_connections(1)).await else {
        return;
    };
    let Some(other) = fresh("leak", MySqlLedgerOptions::default().max_connections(1)).await else {
        return;
    };
    let t = fresh_tenant();
    for i in 0..4 {
        enqueue(&ledger, &key(&t, "order.paid", &format!("order-{i}")), "x").await;
    }
    let lease = Duration::from_secs(30);
    leak_a_transaction(&ledger).await;
    let claimed = ledger.claim_messages(10, lease).await.unwrap();
    assert_eq!(claimed.len(), 4);
    assert_eq!(
        other.outbox_stats().await.unwrap().claimed,
        4,
        "the claim committed"
    );
    leak_a_transaction(&ledger).await;
    assert_eq!(
        ledger.mark_sent(&[claimed[0].ticket()]).await.unwrap(),
        vec![true]
    );
    leak_a_transaction(&ledger).await;
    let both = [claimed[1].ticket(), claimed[2].ticket()];
    assert_eq!(ledger.mark_sent(&both).await.unwrap(), vec![true, true]);
    assert_eq!(other.outbox_stats().await.unwrap().sent, 3, "the marks committed");
    leak_a_transaction(&ledger).await;
    assert!(
        ledger
            .retry_later(claimed[3].ticket(), Duration::ZERO, "broker down")
            .await
            .unwrap()
    );
    assert_eq!(
        other.outbox_stats().await.unwrap().claimed,
        0,
        "the retry committed"
    );
    let again = ledger.claim_messages(10, lease).await.unwrap();
    assert_eq!(again.len(), 1);
    leak_a_transaction(&ledger).await;
    assert!(ledger.mark_failed(again[0].ticket(), "refused").await.unwrap());
    assert_eq!(
        other.outbox_stats().await.unwrap().failed,
        1,
        "the failure committed"
    );
    leak_a_transaction(&ledger).await;
    assert_eq!(ledger.prune_sent(Duration::ZERO, 100).await.unwrap(), 3);
    assert_eq!(other.outbox_stats().await.unwrap().sent, 0, "the prune committed");
    leak_a_transaction(&ledger).await;
    assert!(ledger.claim_messages(10, lease).await.unwrap().is_empty());
    let open: u64 = sqlx::query_scalar("SELECT @@in_transaction")
        .fetch_one(ledger.pool())
        .await
        .unwrap();
    assert_eq!(open, 0);
}

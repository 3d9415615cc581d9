//! The transactional outbox's contract ([`crate::outbox`]), on a backend
//! that implements [`TransactionalOutbox`]. Every case gets an outbox of its
//! own (the factory's argument names the case), because a relay's claim
//! takes any due message of the outbox, whoever enqueued it.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use super::{fresh_tenant, key};
use crate::admin::Admin;
use crate::error::Error;
use crate::outbox::{Enqueued, Message, Pending, TransactionalOutbox};

/// The lease of the cases' claims: long enough to outlast a slow statement,
/// short enough to expire inside a test.
const LEASE: Duration = Duration::from_secs(1);
/// How long to wait for [`LEASE`] to end on the backend's clock.
const LEASE_WAIT: Duration = Duration::from_millis(1600);

async fn enqueue<L: TransactionalOutbox>(ledger: &L, key: &crate::EffectKey, message: &Message) -> Enqueued {
    let mut tx = ledger.begin().await.unwrap();
    let e = ledger.enqueue_in(&mut tx, key, message).await.unwrap();
    ledger.commit(tx).await.unwrap();
    e
}

fn message(destination: &str, body: &str) -> Message {
    Message::new(destination, body.as_bytes().to_vec()).unwrap()
}

/// A message commits with the caller's transaction or not at all, and one
/// effect key names one message: a second enqueue, in the same transaction
/// or a later one, writes nothing.
pub async fn outbox_enqueue_commits_with_the_transaction<L: TransactionalOutbox + 'static>(ledger: L) {
    let t = fresh_tenant();
    let rolled = key(&t, "order.paid", "order-1");
    let mut tx = ledger.begin().await.unwrap();
    assert!(matches!(
        ledger
            .enqueue_in(&mut tx, &rolled, &message("orders", "rolled back"))
            .await
            .unwrap(),
        Enqueued::New(_)
    ));
    ledger.rollback(tx).await.unwrap();
    assert!(
        ledger.claim_messages(10, LEASE).await.unwrap().is_empty(),
        "a rolled-back enqueue left a message"
    );

    let k = key(&t, "order.paid", "order-2");
    let mut tx = ledger.begin().await.unwrap();
    let first = ledger
        .enqueue_in(&mut tx, &k, &message("orders", "first"))
        .await
        .unwrap();
    assert!(matches!(first, Enqueued::New(_)));
    assert_eq!(
        ledger
            .enqueue_in(&mut tx, &k, &message("orders", "again"))
            .await
            .unwrap(),
        Enqueued::Already
    );
    ledger.commit(tx).await.unwrap();
    assert_eq!(
        enqueue(&ledger, &k, &message("orders", "later")).await,
        Enqueued::Already
    );

    let claimed = ledger.claim_messages(10, LEASE).await.unwrap();
    assert_eq!(claimed.len(), 1, "{claimed:?}");
    let m = &claimed[0];
    assert_eq!((m.key.clone(), m.destination.as_str()), (k.clone(), "orders"));
    assert_eq!(m.payload, b"first");
    assert_eq!(m.attempts, 1);
    assert_eq!(m.message_id(), k.provider_key());
    assert_eq!(m.ordering_key, format!("{}/order-2", t));
    assert_eq!(ledger.mark_sent(&[m.ticket()]).await.unwrap(), vec![true]);
    assert!(
        ledger.claim_messages(10, LEASE).await.unwrap().is_empty(),
        "a sent message is claimed again"
    );
    // Sent already: an enqueue of its key still writes nothing.
    assert_eq!(
        enqueue(&ledger, &k, &message("orders", "late")).await,
        Enqueued::Already
    );
}

/// Headers, payload bytes and an explicit ordering key round-trip.
pub async fn outbox_messages_round_trip<L: TransactionalOutbox + 'static>(ledger: L) {
    let t = fresh_tenant();
    let k = key(&t, "order.paid", "order-1");
    let payload: Vec<u8> = (0..=255u8).collect();
    let m = Message::new("orders.paid", payload.clone())
        .unwrap()
        .header("content-type", "application/octet-stream")
        .unwrap()
        .header("x-trace", "abc déf")
        .unwrap()
        .ordering_key("customer-7")
        .unwrap();
    enqueue(&ledger, &k, &m).await;
    let claimed = ledger.claim_messages(10, LEASE).await.unwrap();
    assert_eq!(claimed.len(), 1);
    let p = &claimed[0];
    assert_eq!(p.payload, payload);
    assert_eq!(p.destination, "orders.paid");
    assert_eq!(p.ordering_key, "customer-7");
    assert_eq!(
        p.headers,
        vec![
            ("content-type".to_owned(), "application/octet-stream".to_owned()),
            ("x-trace".to_owned(), "abc déf".to_owned()),
        ]
    );
    assert!(p.lease_expires_at > p.enqueued_at);
}

/// A claim takes only the oldest unsent message of each ordering key, so
/// each key's messages are published in the order they were enqueued.
pub async fn outbox_claims_each_ordering_key_in_order<L: TransactionalOutbox + 'static>(ledger: L) {
    let t = fresh_tenant();
    for (subject, n) in [("order-1", 3), ("order-2", 2)] {
        for i in 0..n {
            let k = key(&t, &format!("event-{i}"), subject);
            enqueue(&ledger, &k, &message("orders", &format!("{subject}#{i}"))).await;
        }
    }
    let mut published: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for round in 0..4 {
        let claimed = ledger.claim_messages(10, LEASE).await.unwrap();
        let keys: HashSet<&str> = claimed.iter().map(|m| m.ordering_key.as_str()).collect();
        assert_eq!(
            keys.len(),
            claimed.len(),
            "round {round}: two messages of one ordering key: {claimed:?}"
        );
        // Claimed but not marked: the next message of the key waits.
        assert!(
            ledger.claim_messages(10, LEASE).await.unwrap().is_empty(),
            "round {round}: a later message was claimed while an earlier one was held"
        );
        for m in &claimed {
            published
                .entry(m.ordering_key.clone())
                .or_default()
                .push(String::from_utf8(m.payload.clone()).unwrap());
        }
        let tickets: Vec<_> = claimed.iter().map(Pending::ticket).collect();
        assert!(ledger.mark_sent(&tickets).await.unwrap().into_iter().all(|w| w));
    }
    assert_eq!(
        published,
        BTreeMap::from([
            (
                format!("{t}/order-1"),
                vec![
                    "order-1#0".to_owned(),
                    "order-1#1".to_owned(),
                    "order-1#2".to_owned()
                ]
            ),
            (
                format!("{t}/order-2"),
                vec!["order-2#0".to_owned(), "order-2#1".to_owned()]
            ),
        ])
    );
}

/// A claim whose lease ended is taken over with a higher fence; the
/// first relay's marks are refused, the second's accepted, and a sent
/// message is never claimed again.
pub async fn outbox_claims_are_fenced<L: TransactionalOutbox + 'static>(ledger: L) {
    let t = fresh_tenant();
    let k = key(&t, "order.paid", "order-1");
    enqueue(&ledger, &k, &message("orders", "paid")).await;
    let first = ledger.claim_messages(10, LEASE).await.unwrap();
    assert_eq!(first.len(), 1);
    assert!(
        ledger.claim_messages(10, LEASE).await.unwrap().is_empty(),
        "held under a live lease"
    );
    tokio::time::sleep(LEASE_WAIT).await;
    let second = ledger.claim_messages(10, LEASE).await.unwrap();
    assert_eq!(second.len(), 1, "an ended lease is taken over");
    assert!(second[0].fence > first[0].fence);
    assert_eq!(second[0].attempts, 2);
    let stale = first[0].ticket();
    assert_eq!(ledger.mark_sent(&[stale]).await.unwrap(), vec![false]);
    assert!(!ledger.retry_later(stale, Duration::ZERO, "late").await.unwrap());
    assert!(!ledger.mark_failed(stale, "late").await.unwrap());
    assert_eq!(ledger.mark_sent(&[second[0].ticket()]).await.unwrap(), vec![true]);
    assert_eq!(
        ledger.mark_sent(&[second[0].ticket()]).await.unwrap(),
        vec![false],
        "sent once"
    );
    tokio::time::sleep(LEASE_WAIT).await;
    assert!(ledger.claim_messages(10, LEASE).await.unwrap().is_empty());
    let stats = ledger.outbox_stats().await.unwrap();
    assert_eq!((stats.pending, stats.sent), (0, 1));
}

/// [`RACERS`](super::RACERS) relays claim at once: every message is held by
/// exactly one of them.
pub async fn outbox_concurrent_claims_one_holder<L: TransactionalOutbox + Clone + 'static>(ledger: L) {
    let t = fresh_tenant();
    const N: usize = 40;
    for i in 0..N {
        enqueue(
            &ledger,
            &key(&t, "order.paid", &format!("order-{i}")),
            &message("orders", "x"),
        )
        .await;
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(super::RACERS));
    let mut tasks = Vec::new();
    for _ in 0..super::RACERS {
        let (ledger, barrier) = (ledger.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            ledger.claim_messages(3, Duration::from_secs(30)).await.unwrap()
        }));
    }
    let mut seen = HashSet::new();
    for task in tasks {
        for m in task.await.unwrap() {
            assert!(seen.insert(m.id), "message {} claimed twice", m.id);
        }
    }
    assert_eq!(seen.len(), N, "every due message was claimed by someone");
}

/// A message given back waits for its delay; a failed one is never claimed
/// again and no longer holds back its ordering key; the counts say so.
pub async fn outbox_retries_and_failures<L: TransactionalOutbox + 'static>(ledger: L) {
    let t = fresh_tenant();
    let first = key(&t, "event-0", "order-1");
    let second = key(&t, "event-1", "order-1");
    enqueue(&ledger, &first, &message("orders", "0")).await;
    enqueue(&ledger, &second, &message("orders", "1")).await;
    let c = ledger.claim_messages(10, Duration::from_secs(30)).await.unwrap();
    assert_eq!(c.len(), 1);
    assert!(
        ledger
            .retry_later(c[0].ticket(), Duration::from_secs(60), "broker down")
            .await
            .unwrap()
    );
    assert!(
        ledger
            .claim_messages(10, Duration::from_secs(30))
            .await
            .unwrap()
            .is_empty(),
        "a message waiting for its retry is not claimed, and holds back its key"
    );
    let stats = ledger.outbox_stats().await.unwrap();
    assert_eq!((stats.pending, stats.claimed, stats.failed), (2, 0, 0));
    assert!(stats.oldest_pending.is_some());

    let other = key(&t, "event-0", "order-2");
    enqueue(&ledger, &other, &message("orders", "x")).await;
    let c = ledger.claim_messages(10, Duration::from_secs(30)).await.unwrap();
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].key, other);
    assert!(
        ledger
            .retry_later(c[0].ticket(), Duration::ZERO, "once more")
            .await
            .unwrap()
    );
    let c = ledger.claim_messages(10, Duration::from_secs(30)).await.unwrap();
    assert_eq!(c.len(), 1, "a retry without delay is due at once");
    assert_eq!(c[0].attempts, 2);
    assert!(
        ledger
            .mark_failed(c[0].ticket(), "refused for good")
            .await
            .unwrap()
    );
    assert!(
        ledger
            .claim_messages(10, Duration::from_secs(30))
            .await
            .unwrap()
            .is_empty()
    );
    let stats = ledger.outbox_stats().await.unwrap();
    assert_eq!((stats.pending, stats.failed), (2, 1));
}

/// Prune deletes sent messages past the age given, never pending ones.
pub async fn outbox_prune_deletes_only_sent<L: TransactionalOutbox + 'static>(ledger: L) {
    let t = fresh_tenant();
    for i in 0..3 {
        enqueue(
            &ledger,
            &key(&t, "order.paid", &format!("order-{i}")),
            &message("orders", "x"),
        )
        .await;
    }
    let c = ledger.claim_messages(2, Duration::from_secs(30)).await.unwrap();
    assert_eq!(c.len(), 2);
    let tickets: Vec<_> = c.iter().map(Pending::ticket).collect();
    ledger.mark_sent(&tickets).await.unwrap();
    assert_eq!(
        ledger.prune_sent(Duration::from_secs(3600), 100).await.unwrap(),
        0,
        "too recent"
    );
    assert_eq!(
        ledger.prune_sent(Duration::ZERO, 1).await.unwrap(),
        1,
        "bounded by its limit"
    );
    assert_eq!(ledger.prune_sent(Duration::ZERO, 100).await.unwrap(), 1);
    let stats = ledger.outbox_stats().await.unwrap();
    assert_eq!((stats.pending, stats.sent), (1, 0));
    // A pruned message's key could be enqueued again: the effect's own
    // record (kept as long) is what stops its step from running twice.
}

/// [`Admin::erase`] and the outbox: the subject's messages the relay is
/// done with (one sent, one failed) are emptied in the erasure and listed in
/// [`Erasure::messages`](crate::admin::Erasure::messages); one still to be
/// sent is listed in `messages_pending` and left whole (the relay still
/// claims it with its payload, headers and ordering key). Messages of
/// another subject are not touched: one whose subject ends like this one's
/// (`x:cust-42`), and this subject in another tenant. Erasing again lists
/// the same.
pub async fn outbox_erase_empties_what_the_relay_is_done_with<L: TransactionalOutbox + Admin + 'static>(
    ledger: L,
) {
    let t = fresh_tenant();
    let subject = "cust-42";
    let sent = key(&t, "mail.sent", subject);
    let failed = key(&t, "mail.failed", subject);
    let waiting = key(&t, "mail.waiting", subject);
    let lookalike = key(&t, "mail.sent", &format!("x:{subject}"));
    let elsewhere = key(&fresh_tenant(), "mail.sent", subject);
    let body = |k: &crate::EffectKey| {
        Message::new("mail", format!("to alice@example.com about {k}").into_bytes())
            .unwrap()
            .header("to", "alice@example.com")
            .unwrap()
    };
    // The subject's messages share their default ordering key, so the relay
    // takes them one at a time, in order.
    enqueue(&ledger, &sent, &body(&sent)).await;
    let c = ledger.claim_messages(10, LEASE).await.unwrap();
    assert_eq!(c.iter().map(|m| &m.key).collect::<Vec<_>>(), [&sent]);
    assert_eq!(ledger.mark_sent(&[c[0].ticket()]).await.unwrap(), [true]);
    enqueue(&ledger, &failed, &body(&failed)).await;
    let c = ledger.claim_messages(10, LEASE).await.unwrap();
    assert_eq!(c.iter().map(|m| &m.key).collect::<Vec<_>>(), [&failed]);
    assert!(ledger.mark_failed(c[0].ticket(), "refused").await.unwrap());
    for k in [&waiting, &lookalike, &elsewhere] {
        enqueue(&ledger, k, &body(k)).await;
    }

    // A dry run lists the same messages, in the transaction it rolls back.
    let dry = ledger.erase_dry_run(&t, subject).await.unwrap();
    for _ in 0..2 {
        let erasure = ledger.erase(&t, subject).await.unwrap();
        assert_eq!(
            (&dry.messages, &dry.messages_pending),
            (&erasure.messages, &erasure.messages_pending)
        );
        let mut done = vec![sent.clone(), failed.clone()];
        done.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        assert_eq!(erasure.messages, done);
        assert_eq!(erasure.messages_pending, std::slice::from_ref(&waiting));
        assert!(erasure.erased.is_empty() && erasure.pending.is_empty());
        assert!(!erasure.is_complete(), "a message still to be sent is pending");
    }

    let mut c = ledger.claim_messages(10, LEASE).await.unwrap();
    c.sort_by(|a, b| a.key.as_str().cmp(b.key.as_str()));
    let mut expected = vec![waiting.clone(), lookalike.clone(), elsewhere.clone()];
    expected.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    assert_eq!(c.iter().map(|m| m.key.clone()).collect::<Vec<_>>(), expected);
    for m in &c {
        assert_eq!(m.payload, body(&m.key).payload(), "{}", m.key);
        assert_eq!(m.headers, [("to".to_owned(), "alice@example.com".to_owned())]);
        assert_eq!(m.ordering_key, format!("{}/{}", m.key.tenant(), m.key.subject()));
    }
    // Sent now, the last one is emptied by the next erasure.
    let tickets: Vec<_> = c
        .iter()
        .filter(|m| m.key == waiting)
        .map(Pending::ticket)
        .collect();
    assert_eq!(ledger.mark_sent(&tickets).await.unwrap(), [true]);
    let erasure = ledger.erase(&t, subject).await.unwrap();
    assert_eq!(erasure.messages.len(), 3);
    assert!(erasure.messages_pending.is_empty() && erasure.is_complete());
}

/// Bad messages are refused before any round trip.
pub async fn outbox_bad_messages_are_refused<L: TransactionalOutbox + 'static>(_ledger: L) {
    let bad = [
        Message::new("", b"x".to_vec()).err(),
        Message::new("a\nb", b"x".to_vec()).err(),
        Message::new("x".repeat(256), b"x".to_vec()).err(),
        Message::new("orders", vec![0u8; crate::outbox::MAX_PAYLOAD_BYTES + 1]).err(),
        message("orders", "x").header("bad name", "v").err(),
        message("orders", "x")
            .header("a", "1")
            .unwrap()
            .header("A", "2")
            .err(),
        message("orders", "x").header("h", "line\nbreak").err(),
        message("orders", "x").ordering_key("").err(),
    ];
    for (i, e) in bad.into_iter().enumerate() {
        assert!(matches!(e, Some(Error::InvalidInput(_))), "case {i}: {e:?}");
    }
}

/// Generates the outbox suite: one `#[tokio::test]` per case, each calling
/// `$make(case_name).await` (an `async fn(&'static str) -> Option<L>`
/// returning a ledger whose outbox no other case uses; `None` skips).
#[doc(hidden)]
#[macro_export]
macro_rules! __outbox_conformance_tests {
    ($make:path) => {
        $crate::__outbox_conformance_tests!(@each $make;
            outbox_enqueue_commits_with_the_transaction,
            outbox_messages_round_trip,
            outbox_claims_each_ordering_key_in_order,
            outbox_claims_are_fenced,
            outbox_concurrent_claims_one_holder,
            outbox_retries_and_failures,
            outbox_prune_deletes_only_sent,
            outbox_bad_messages_are_refused,
            outbox_erase_empties_what_the_relay_is_done_with,
        );
    };
    (@each $make:path; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                if let Some(ledger) = $make(stringify!($name)).await {
                    $crate::conformance::$name(ledger).await;
                }
            }
        )*
    };
}

//! The kit's helpers: the fakes count what a test asserts on, the drain
//! waits for late redeliveries, the kill switch stops a handler where a
//! crash would and a redelivery finishes the effect once.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use oncely::{ClaimOptions, EffectKey, Effects, Failure, How, MemoryLedger, Tenant};
use oncely_testkit::{Drain, FakeMailer, FakeProvider, KillSwitch, MailLog, NotDrained, Progress};

#[tokio::test]
async fn the_fake_provider_honours_keys_and_counts_calls() {
    let honest = FakeProvider::new(true);
    let first = honest.capture("k-1", "order-1", 1250).await;
    let again = honest.capture("k-1", "order-1", 1250).await;
    let other = honest.capture("k-2", "order-2", 990).await;
    assert_eq!(first, again);
    assert_ne!(first.id, other.id);
    assert_eq!(honest.calls(), 3);
    assert_eq!(honest.captures().get("order-1"), Some(&1));
    assert_eq!(honest.charge_by_key("k-1").await.unwrap(), Some(first));

    // One that ignores keys captures on every call: what the kit's users
    // assert their handlers never rely on.
    let careless = FakeProvider::new(false);
    careless.capture("k-1", "order-1", 1250).await;
    careless.capture("k-1", "order-1", 1250).await;
    assert_eq!(careless.captures().get("order-1"), Some(&2));

    let mailer = FakeMailer::default();
    assert_eq!(mailer.log("order-1").await, MailLog::NotSent);
    mailer.send_receipt("order-1").await;
    mailer.send_receipt("order-1").await;
    assert_eq!(mailer.sends().get("order-1"), Some(&2));
    assert_eq!(mailer.log("order-1").await, MailLog::Sent(2));
}

/// A queue whose one failing message comes back only after a delay: the
/// drain returns once it has been handled, not at the first empty queue.
#[tokio::test]
async fn drain_waits_for_a_late_redelivery() {
    let queue = Arc::new(Mutex::new((1..=20).collect::<VecDeque<u32>>()));
    let handled = Arc::new(AtomicU64::new(0));
    let in_flight = Arc::new(AtomicU64::new(0));
    let worker = {
        let (queue, handled, in_flight) = (queue.clone(), handled.clone(), in_flight.clone());
        tokio::spawn(async move {
            let mut failed_once = false;
            loop {
                let Some(n) = queue.lock().unwrap().pop_front() else {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                };
                if n == 7 && !failed_once {
                    // Fails; the broker redelivers it later (not in flight meanwhile).
                    failed_once = true;
                    let queue = queue.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(150)).await;
                        queue.lock().unwrap().push_back(n);
                    });
                    continue;
                }
                in_flight.fetch_add(1, Ordering::SeqCst);
                tokio::task::yield_now().await;
                handled.fetch_add(1, Ordering::SeqCst);
                in_flight.fetch_sub(1, Ordering::SeqCst);
            }
        })
    };
    let last = Drain::default()
        .idle(Duration::from_millis(400))
        .until(async || {
            let empty = queue.lock().unwrap().is_empty();
            let busy = in_flight.load(Ordering::SeqCst);
            let n = handled.load(Ordering::SeqCst);
            Ok::<_, std::convert::Infallible>(Progress::new(empty && busy == 0, n))
        })
        .await
        .unwrap();
    assert_eq!(last.activity, 20, "the redelivered message was handled too");
    assert_eq!(handled.load(Ordering::SeqCst), 20);
    worker.abort();

    // A probe that never drains times out with its last answer.
    let err = Drain::default()
        .timeout(Duration::from_millis(50))
        .until(async || Ok::<_, std::convert::Infallible>(Progress::new(false, 3)))
        .await
        .unwrap_err();
    assert!(
        matches!(err, NotDrained::TimedOut(Some(p)) if p.activity == 3),
        "{err}"
    );
}

/// A consumer killed between the provider's capture and the completion:
/// the hook (its connection) goes with it, the effect stays claimed, and
/// the redelivery after the lease captures again with the same provider
/// key, which the provider deduplicates: money moved once.
#[tokio::test]
async fn a_consumer_killed_mid_handler_is_finished_once_by_the_redelivery() {
    let effects = Effects::new(MemoryLedger::new());
    let provider = Arc::new(FakeProvider::new(true));
    let key = EffectKey::new(&Tenant::new("kit").unwrap(), "capture", "order-1").unwrap();
    let opts = ClaimOptions::for_consumer().lease(Duration::from_millis(200));
    let handle = async |switch: &KillSwitch| {
        let provider = &provider;
        effects
            .run_reported(&key, &opts, |lease| async move {
                let charge = provider.capture(&lease.provider_key(), "order-1", 1250).await;
                switch.point().await; // the process may die here
                Ok::<_, Failure>(charge.id)
            })
            .await
    };

    let crashing = KillSwitch::new();
    let connection_open = Arc::new(AtomicU64::new(1));
    crashing.on_kill({
        let connection_open = connection_open.clone();
        move || connection_open.store(0, Ordering::SeqCst)
    });
    crashing.arm(1);
    assert!(
        crashing.run(handle(&crashing)).await.is_none(),
        "killed, not finished"
    );
    assert!(crashing.is_killed());
    assert_eq!(connection_open.load(Ordering::SeqCst), 0, "the hook ran");
    assert_eq!(provider.calls(), 1);

    // The redelivery: another process, its own switch, never armed. It
    // waits out the dead holder's lease (the runner retries InProgress).
    let survivor = KillSwitch::new();
    let ran = loop {
        match survivor.run(handle(&survivor)).await.unwrap() {
            Ok(ran) => break ran,
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(ran.how, How::Ran);
    assert_eq!(provider.calls(), 2, "called again, with the same key");
    assert_eq!(provider.captures().get("order-1"), Some(&1), "captured once");

    // A third delivery is a pure duplicate; with the capture's Ran, the
    // delivery that replayed one step and ran another reports Ran.
    let dup = survivor.run(handle(&survivor)).await.unwrap().unwrap();
    assert_eq!(dup.how, How::Replayed);
    assert_eq!(dup.how | ran.how, How::Ran);
    assert_eq!(dup.how | dup.how, How::Replayed);
    assert_eq!(provider.calls(), 2);
}

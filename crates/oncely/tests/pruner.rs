//! The background pruner on the in-memory ledger, whose clock the tests
//! move with `MemoryLedger::advance`: counts and bounds, never durations.

use std::sync::Arc;
use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome};
use oncely::conformance::{CountingPrunes, pruner_prunes_due_records_in_bounded_batches};
use oncely::pruner::{Pruner, PrunerOptions};
use oncely::{ClaimOptions, EffectKey, MemoryLedger, Tenant};

async fn completed(ledger: &MemoryLedger, key: &EffectKey, retention: Duration) {
    let opts = ClaimOptions::default()
        .lease(Duration::from_millis(500))
        .retention(retention);
    let Claim::Acquired(lease) = ledger.claim(key, &opts).await.unwrap() else {
        panic!("{key} was not acquired");
    };
    ledger
        .complete(&lease, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
}

/// Waits until `done` holds, failing after many tries (a deadline against a
/// hang, not a timing assertion).
async fn eventually(mut done: impl FnMut() -> bool) {
    for _ in 0..5_000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("never happened");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prunes_what_expired_in_bounded_batches_and_nothing_else() {
    let ledger = Arc::new(MemoryLedger::new());
    let t = Tenant::new("acme").unwrap();
    let hour = Duration::from_secs(3_600);
    for i in 0..95 {
        completed(
            &ledger,
            &EffectKey::new(&t, "capture", format!("old-{i}")).unwrap(),
            hour,
        )
        .await;
    }
    ledger.advance(2 * hour);
    let young: Vec<EffectKey> = (0..6)
        .map(|i| EffectKey::new(&t, "capture", format!("young-{i}")).unwrap())
        .collect();
    for k in &young {
        completed(&ledger, k, hour).await;
    }

    let counting = CountingPrunes::new(ledger.clone());
    let handle = Pruner::new(
        counting.clone(),
        PrunerOptions::default()
            .batch(10)
            .unlimited()
            .idle(Duration::from_millis(10)),
    )
    .spawn();
    eventually(|| handle.stats().rows >= 95).await;
    // Several idle passes that find nothing: the count stays put.
    let batches = handle.stats().batches;
    eventually(|| handle.stats().batches >= batches + 3).await;
    let stats = handle.stop().await;

    assert_eq!(stats.rows, 95, "{stats:?}");
    assert_eq!(stats.errors, 0);
    let calls = counting.calls();
    assert!(
        calls.iter().all(|&(limit, n)| limit == 10 && n <= 10),
        "{calls:?}"
    );
    // 95 rows at 10 a call: nine full batches, one of 5, then empty passes.
    assert_eq!(calls.iter().filter(|c| c.1 == 10).count(), 9, "{calls:?}");
    assert_eq!(calls.iter().map(|c| c.1).sum::<u64>(), 95);
    assert_eq!(stats.batches, calls.len() as u64);
    for k in &young {
        assert!(
            ledger.get(k).await.unwrap().is_some(),
            "{k} was pruned before its time"
        );
    }
    assert!(ledger.horizon(&t, "capture").await.unwrap().is_some());

    // What expires later is pruned by a later pass of a new pruner.
    ledger.advance(2 * hour);
    let handle = Pruner::new(ledger.clone(), PrunerOptions::default().batch(4).unlimited()).spawn();
    eventually(|| handle.stats().rows == 6).await;
    assert_eq!(handle.stop().await.rows, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_spaces_batches_out_and_stop_cuts_the_wait_short() {
    let ledger = Arc::new(MemoryLedger::new());
    let t = Tenant::new("acme").unwrap();
    for i in 0..50 {
        completed(
            &ledger,
            &EffectKey::new(&t, "capture", format!("k-{i}")).unwrap(),
            Duration::from_secs(1),
        )
        .await;
    }
    ledger.advance(Duration::from_secs(10));
    // One row a second with batches of 5: after the first batch the pruner
    // owes five seconds; a stop must not wait them out (the test would
    // hit its own deadline if it did).
    let counting = CountingPrunes::new(ledger.clone());
    let handle = Pruner::new(
        counting.clone(),
        PrunerOptions::default().batch(5).rows_per_second(1),
    )
    .spawn();
    eventually(|| handle.stats().batches >= 1).await;
    let stats = tokio::time::timeout(Duration::from_secs(4), handle.stop())
        .await
        .expect("stop waited out the rate limit");
    assert_eq!(stats.batches, 1, "{stats:?}");
    assert_eq!(stats.rows, 5);
    assert_eq!(counting.calls(), vec![(5, 5)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_handle_stops_the_pruner() {
    let ledger = Arc::new(MemoryLedger::new());
    let counting = CountingPrunes::new(ledger.clone());
    let handle = Pruner::new(
        counting.clone(),
        PrunerOptions::default().idle(Duration::from_millis(5)),
    )
    .spawn();
    eventually(|| handle.stats().batches >= 2).await;
    drop(handle);
    // Once the task has seen the drop, the calls stop growing.
    let mut last = counting.calls().len();
    let mut same = 0;
    eventually(|| {
        let now = counting.calls().len();
        same = if now == last { same + 1 } else { 0 };
        last = now;
        same >= 20
    })
    .await;
}

/// Dropped while a backlog keeps it busy (no rate limit, so it never
/// rests): it stops at its next batch, long before the backlog is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_handle_stops_a_busy_pruner() {
    let ledger = Arc::new(MemoryLedger::new());
    let t = Tenant::new("acme").unwrap();
    for i in 0..20_000 {
        completed(
            &ledger,
            &EffectKey::new(&t, "capture", format!("k-{i}")).unwrap(),
            Duration::from_secs(1),
        )
        .await;
    }
    ledger.advance(Duration::from_secs(10));
    let counting = CountingPrunes::new(ledger.clone());
    let handle = Pruner::new(counting.clone(), PrunerOptions::default().batch(1).unlimited()).spawn();
    eventually(|| handle.stats().batches >= 10).await;
    drop(handle);
    let mut last = counting.calls().len();
    let mut same = 0;
    eventually(|| {
        let now = counting.calls().len();
        same = if now == last { same + 1 } else { 0 };
        last = now;
        same >= 20
    })
    .await;
    assert!(
        last < 10_000,
        "the pruner went on after its handle was dropped: {last} batches"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shared_pruner_case_on_memory() {
    pruner_prunes_due_records_in_bounded_batches(Arc::new(MemoryLedger::new()), true).await;
}

#[tokio::test]
async fn drain_prunes_what_is_due_in_bounded_batches_then_returns() {
    let ledger = Arc::new(MemoryLedger::new());
    let t = Tenant::new("acme").unwrap();
    let hour = Duration::from_secs(3_600);
    for i in 0..25 {
        completed(
            &ledger,
            &EffectKey::new(&t, "capture", format!("old-{i}")).unwrap(),
            hour,
        )
        .await;
    }
    ledger.advance(2 * hour);
    let young = EffectKey::new(&t, "capture", "young").unwrap();
    completed(&ledger, &young, hour).await;

    let counting = CountingPrunes::new(ledger.clone());
    let pruner = Pruner::new(counting.clone(), PrunerOptions::default().batch(10).unlimited());
    // At most 12 rows: a batch of 10, then one cut to the 2 left.
    let mut seen = Vec::new();
    let stats = pruner.drain(12, |rows| seen.push(rows)).await.unwrap();
    assert_eq!((stats.rows, stats.batches), (12, 2), "{stats:?}");
    assert_eq!(seen, [10, 2]);
    assert_eq!(counting.calls(), [(10, 10), (2, 2)]);
    // Then everything due: 10, then a short batch of 3 ends the call.
    let stats = pruner.drain(u64::MAX, |_| {}).await.unwrap();
    assert_eq!((stats.rows, stats.batches), (13, 2), "{stats:?}");
    assert!(ledger.get(&young).await.unwrap().is_some(), "not due: kept");
    // Nothing due: one empty batch, and back.
    let stats = pruner.drain(u64::MAX, |_| {}).await.unwrap();
    assert_eq!((stats.rows, stats.batches), (0, 1));
}

//! `Effects::run_reported`: the runner tells its caller whether the effect
//! ran now or its stored outcome was replayed. Written as conformance-style
//! cases (plain async functions over any `Ledger`), run here on the memory
//! ledger.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use oncely::backend::Ledger;
use oncely::{
    ClaimOptions, EffectKey, Effects, Error, Failure, How, MemoryLedger, OnInProgress, Reported, Tenant,
};

fn key(tenant: &str, subject: &str) -> EffectKey {
    EffectKey::new(&Tenant::new(tenant).unwrap(), "capture", subject).unwrap()
}

fn opts() -> ClaimOptions {
    ClaimOptions::default().lease(Duration::from_secs(5))
}

/// The first run reports `Ran`; a sequential duplicate reports `Replayed`
/// with the first value, and its closure never runs.
async fn first_ran_then_replayed<L: Ledger + 'static>(ledger: L) {
    let effects = Effects::new(ledger);
    let k = key("reported-seq", "order-1");
    let runs = AtomicUsize::new(0);
    let mut seen = Vec::new();
    for attempt in 0..3u32 {
        let ran: Reported<u32> = effects
            .run_reported(&k, &opts(), |_| {
                runs.fetch_add(1, Ordering::SeqCst);
                async move { Ok(attempt) }
            })
            .await
            .unwrap();
        seen.push((ran.value, ran.how));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(seen, [(0, How::Ran), (0, How::Replayed), (0, How::Replayed)]);
}

/// 16 concurrent deliveries that wait for the holder: exactly one reports
/// `Ran`, the other 15 `Replayed`, and the closure ran once.
async fn concurrent_one_ran_rest_replayed<L: Ledger + 'static>(ledger: L) {
    let effects = Arc::new(Effects::new(ledger));
    let k = key("reported-conc", "order-2");
    let runs = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let mut tasks = Vec::new();
    for worker in 0..16u32 {
        let (effects, k, runs, barrier) = (effects.clone(), k.clone(), runs.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let opts = opts().on_in_progress(OnInProgress::Wait {
                max: Duration::from_secs(10),
            });
            effects
                .run_reported(&k, &opts, |_| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    Ok(worker)
                })
                .await
                .unwrap()
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let ran: Vec<&Reported<u32>> = results.iter().filter(|r| r.how == How::Ran).collect();
    assert_eq!(ran.len(), 1, "{results:?}");
    let winner = ran[0].value;
    assert!(
        results.iter().all(|r| r.value == winner),
        "every duplicate gets the winner's value: {results:?}"
    );
    assert_eq!(results.iter().filter(|r| r.how.is_replayed()).count(), 15);
}

/// A retryable failure releases the key: the next delivery reports `Ran`
/// (it really ran), not `Replayed`.
async fn retry_after_release_reports_ran<L: Ledger + 'static>(ledger: L) {
    let effects = Effects::new(ledger);
    let k = key("reported-retry", "order-3");
    let failed = effects
        .run_reported::<u32, _, _>(&k, &opts(), |_| async { Err(Failure::retryable("503")) })
        .await;
    assert!(failed.is_err_and(|e| e.is_retryable()));
    let ran = effects
        .run_reported(&k, &opts(), |_| async { Ok(5u32) })
        .await
        .unwrap();
    assert_eq!(
        ran,
        Reported {
            value: 5,
            how: How::Ran
        }
    );
}

/// A terminal failure is an error for the first run and for the replay
/// alike (the stored failure is replayed, not reported as a value).
async fn terminal_failure_is_replayed_as_error<L: Ledger + 'static>(ledger: L) {
    let effects = Effects::new(ledger);
    let k = key("reported-terminal", "order-4");
    for _ in 0..2 {
        let r = effects
            .run_reported::<u32, _, _>(&k, &opts(), |_| async { Err(Failure::terminal("card declined")) })
            .await;
        assert!(
            matches!(&r, Err(Error::Terminal { message, .. }) if message == "card declined"),
            "{r:?}"
        );
    }
}

/// `run` is `run_reported` without the report: both see the same record.
async fn run_and_run_reported_share_records<L: Ledger + 'static>(ledger: L) {
    let effects = Effects::new(ledger);
    let k = key("reported-shared", "order-5");
    let first: String = effects
        .run(&k, &opts(), |_| async { Ok("ch_1".to_owned()) })
        .await
        .unwrap();
    let again = effects
        .run_reported(&k, &opts(), |_| async { Ok("ch_2".to_owned()) })
        .await
        .unwrap();
    assert_eq!(
        again,
        Reported {
            value: first,
            how: How::Replayed
        }
    );
    assert_eq!(How::Ran.as_str(), "ran");
    assert_eq!(How::Replayed.to_string(), "replayed");
}

#[tokio::test]
async fn memory_first_ran_then_replayed() {
    first_ran_then_replayed(Arc::new(MemoryLedger::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_concurrent_one_ran_rest_replayed() {
    concurrent_one_ran_rest_replayed(Arc::new(MemoryLedger::new())).await;
}

#[tokio::test]
async fn memory_retry_after_release_reports_ran() {
    retry_after_release_reports_ran(Arc::new(MemoryLedger::new())).await;
}

#[tokio::test]
async fn memory_terminal_failure_is_replayed_as_error() {
    terminal_failure_is_replayed_as_error(Arc::new(MemoryLedger::new())).await;
}

#[tokio::test]
async fn memory_run_and_run_reported_share_records() {
    run_and_run_reported_share_records(Arc::new(MemoryLedger::new())).await;
}

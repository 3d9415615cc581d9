//! 200 orders, each delivered 8 times by 8 concurrent workers, with crashes
//! at random boundaries (seeded: `ONCELY_SEED` replays a run) and leases
//! short enough that crashed steps are taken over. Then the same without
//! the provider's idempotency-key support, to show what is and is not
//! guaranteed then.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use payment_job::{Boundary, Db, Delivered, Pipeline, SimConfig, SimReport, check, simulate};

fn seed() -> u64 {
    let seed = std::env::var("ONCELY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos() as u64
        });
    eprintln!("ONCELY_SEED={seed}");
    seed
}

fn summary(r: &SimReport) -> String {
    let mut by: BTreeMap<Boundary, u32> = BTreeMap::new();
    for m in r.crashes.values() {
        for (b, n) in m {
            *by.entry(*b).or_default() += n;
        }
    }
    format!("crashes {by:?}, redeliveries after errors {:?}", r.errors)
}

async fn run<D: Db>(p: Arc<Pipeline<D>>, orders: usize, honour_keys: bool) -> SimReport {
    let seed = seed();
    let cfg = SimConfig {
        orders,
        deliveries: 8,
        workers: 8,
        crash_percent: 20,
        crash_attempts: 3,
        seed,
        prefix: common::prefix(&p.tenant),
    };
    let report = simulate(p.clone(), &cfg).await.unwrap();
    eprintln!("{}", summary(&report));
    assert_eq!(
        report.acked,
        orders * 8,
        "every delivery acked (ONCELY_SEED={seed})"
    );
    let crashes: u32 = report.crashes.values().flat_map(|m| m.values()).sum();
    assert!(crashes > 0, "crashes were injected (ONCELY_SEED={seed})");
    // Crashed steps were taken over by later deliveries.
    let takeovers = p.capture_takeovers.load(std::sync::atomic::Ordering::SeqCst);
    let capture_crashes: u32 = report
        .orders
        .iter()
        .map(|o| {
            report.crashes_at(&o.order_id, Boundary::AfterCaptureClaim)
                + report.crashes_at(&o.order_id, Boundary::AfterCaptureCall)
        })
        .sum();
    eprintln!("{takeovers} lease takeovers");
    assert!(
        takeovers >= u64::from(capture_crashes),
        "every crashed capture was taken over (ONCELY_SEED={seed})"
    );
    let bad = check(&p, &report, honour_keys).await.unwrap();
    assert!(bad.is_empty(), "ONCELY_SEED={seed}: {bad:#?}");

    // One more full redelivery changes nothing.
    let before = p.snapshot(&report.orders).await.unwrap();
    for o in &report.orders {
        assert!(
            matches!(p.deliver(o, None).await, Ok(Delivered::Acked { .. })),
            "ONCELY_SEED={seed}: final redelivery of {}",
            o.order_id
        );
    }
    assert_eq!(
        p.snapshot(&report.orders).await.unwrap(),
        before,
        "ONCELY_SEED={seed}"
    );
    report
}

/// With key support: exactly one capture per order whatever crashed.
async fn with_keys<D: Db>(db: D) {
    run(common::pipeline(db, true), 200, true).await;
}

/// Without key support, each provider call whose step did not complete (a
/// crash after the call, a lease lost meanwhile) is a second capture: the
/// ledger alone cannot close that window. Every other order is still
/// captured exactly once, and the receipts and the order rows are as
/// guaranteed as before (`check` asserts all of it).
async fn without_keys<D: Db>(db: D) {
    let p = common::pipeline(db, false);
    let report = run(p.clone(), 100, false).await;
    let captures = p.provider.captures();
    let doubled: Vec<_> = captures.iter().filter(|(_, n)| **n > 1).collect();
    let window: u32 = report.calls_not_completed.values().sum();
    eprintln!(
        "without provider keys: {} orders captured more than once, {window} provider calls in the open window",
        doubled.len()
    );
    assert_eq!(
        captures.values().sum::<u32>() as usize,
        report.orders.len() + window as usize,
        "one capture per order plus one per call in the window"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_concurrent_crashes() {
    let (db, _dir) = common::sqlite().await;
    with_keys(db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_concurrent_crashes_without_provider_keys() {
    let (db, _dir) = common::sqlite().await;
    without_keys(db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_concurrent_crashes() {
    let Some(db) = common::postgres().await else {
        return;
    };
    with_keys(db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_concurrent_crashes_without_provider_keys() {
    let Some(db) = common::postgres().await else {
        return;
    };
    without_keys(db).await;
}

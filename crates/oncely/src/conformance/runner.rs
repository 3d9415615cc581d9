//! The runner cases: `Effects::run` (and so `Job::step`, which shares its
//! pipeline) over a real backend: duplicates, the in-progress policy,
//! failures, the safety margin, renewal and telemetry.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use super::{
    Faulty, SHORT_LEASE, SHORT_LEASE_WAIT, acquired, counter, fresh_tenant, key, metrics_snapshotter, opts,
};
use crate::ledger::Ledger;
use crate::record::{Claim, Outcome, RecordState};
use crate::{ClaimOptions, EffectKey, Effects, Error, Failure, OnInProgress, telemetry};

/// `Effects::run` twice in a row: the effect happens once and the second
/// call returns the first outcome.
pub async fn run_sequential_duplicate_runs_once<L: Ledger + 'static>(ledger: L) {
    let effects = Effects::new(ledger);
    let k = key(&fresh_tenant(), "capture", "order-11");
    let performed = AtomicUsize::new(0);
    let mut outcomes = Vec::new();
    for attempt in 0..2 {
        let out: String = effects
            .run(&k, &opts(), |lease| {
                performed.fetch_add(1, Ordering::SeqCst);
                async move { Ok(format!("charge-{attempt}-{}", lease.fence)) }
            })
            .await
            .unwrap();
        outcomes.push(out);
    }
    assert_eq!(performed.load(Ordering::SeqCst), 1);
    assert!(outcomes[0].starts_with("charge-0-"), "{outcomes:?}");
    assert_eq!(outcomes[0], outcomes[1]);
}

/// 32 concurrent deliveries of one message: performed once, and all 32 get
/// the same outcome.
pub async fn run_concurrent_deliveries_run_once<L: Ledger + Clone + 'static>(ledger: L) {
    let effects = Arc::new(Effects::new(ledger));
    let k = key(&fresh_tenant(), "capture", "order-12");
    let performed = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(32));
    let mut tasks = Vec::new();
    for worker in 0..32u32 {
        let (effects, k, performed, barrier) =
            (effects.clone(), k.clone(), performed.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let policy = OnInProgress::Wait {
                max: Duration::from_secs(30),
            };
            effects
                .run(&k, &opts().on_in_progress(policy), |_| async move {
                    performed.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Ok(worker)
                })
                .await
                .unwrap()
        }));
    }
    let mut seen = HashSet::new();
    for t in tasks {
        seen.insert(t.await.unwrap());
    }
    assert_eq!(
        performed.load(Ordering::SeqCst),
        1,
        "the effect ran more than once"
    );
    assert_eq!(seen.len(), 1, "all deliveries see the one outcome: {seen:?}");
}

/// A duplicate that finds the effect in flight under `Reject` gets
/// `Error::InProgress`, never a success it did not see.
pub async fn run_in_progress_is_rejected_not_skipped<L: Ledger + Clone + 'static>(ledger: L) {
    let effects = Effects::new(ledger.clone());
    let k = key(&fresh_tenant(), "capture", "order-13");
    let holder = acquired(ledger.claim(&k, &opts()).await.unwrap());
    let ran = AtomicUsize::new(0);
    let e = effects
        .run(&k, &opts().on_in_progress(OnInProgress::Reject), |_| {
            ran.fetch_add(1, Ordering::SeqCst);
            async { Ok(()) }
        })
        .await
        .unwrap_err();
    assert!(e.is_in_progress() && e.is_retryable(), "{e:?}");
    let waited = effects
        .run(
            &k,
            &opts().on_in_progress(OnInProgress::Wait {
                max: Duration::from_millis(200),
            }),
            |_| {
                ran.fetch_add(1, Ordering::SeqCst);
                async { Ok(()) }
            },
        )
        .await
        .unwrap_err();
    assert!(waited.is_in_progress(), "{waited:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    ledger
        .complete(
            &holder,
            &Outcome::from_json(&serde_json::json!({"ok": 7})).unwrap(),
        )
        .await
        .unwrap();
    let v: u32 = effects.run(&k, &opts(), |_| async { Ok(0) }).await.unwrap();
    assert_eq!(v, 7);
}

/// A retryable failure releases the claim and the next delivery performs
/// the effect; a terminal failure is stored and replayed.
pub async fn run_failures_follow_policy<L: Ledger + 'static>(ledger: L) {
    let effects = Effects::new(ledger);
    let t = fresh_tenant();
    let k = key(&t, "capture", "order-14");
    let first = AtomicU64::new(0);
    let e = effects
        .run::<u32, _, _>(&k, &opts(), |l| {
            first.store(l.fence, Ordering::SeqCst);
            async { Err(Failure::retryable("provider timed out")) }
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Handler(_)) && e.is_retryable(), "{e:?}");
    let v: u64 = effects
        .run(&k, &opts(), |l| async move { Ok(l.fence) })
        .await
        .unwrap();
    assert!(
        v > first.load(Ordering::SeqCst),
        "the retry ran under a new fence"
    );

    let k2 = key(&t, "capture", "order-15");
    let tries = AtomicUsize::new(0);
    for _ in 0..3 {
        let e = effects
            .run::<u32, _, _>(&k2, &opts(), |_| {
                tries.fetch_add(1, Ordering::SeqCst);
                async { Err(Failure::terminal("card declined")) }
            })
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Terminal { message, .. } if message == "card declined"),
            "{e:?}"
        );
        assert!(!e.is_retryable());
    }
    assert_eq!(
        tries.load(Ordering::SeqCst),
        1,
        "a stored failure is replayed, not retried"
    );

    let k3 = key(&t, "capture", "order-16");
    for _ in 0..2 {
        let _ = effects
            .run::<u32, _, _>(&k3, &opts().cache_failures(false), |_| {
                tries.fetch_add(1, Ordering::SeqCst);
                async { Err(Failure::terminal("declined")) }
            })
            .await;
    }
    assert_eq!(
        tries.load(Ordering::SeqCst),
        3,
        "with cache_failures(false) each delivery tries again"
    );
}

/// A grant that arrives with less than the safety margin left (the answer
/// took longer than the lease) never starts the handler: the runner gives it
/// back and, when every grant arrives too late, fails retryably.
pub async fn run_never_starts_on_an_expired_lease<L: Ledger + 'static>(ledger: L) {
    let ledger = Arc::new(ledger);
    let k = key(&fresh_tenant(), "capture", "late-grant");
    let lease = Duration::from_millis(400);
    let slow = Effects::new(Faulty::new(ledger.clone()).claim_delay(Duration::from_millis(500)));
    let ran = AtomicUsize::new(0);
    let e = slow
        .run::<u32, _, _>(&k, &opts().lease(lease), |_| {
            ran.fetch_add(1, Ordering::SeqCst);
            async { Ok(1) }
        })
        .await
        .unwrap_err();
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "the handler ran on a lease that had ended"
    );
    assert!(e.is_retryable(), "{e:?}");
    // Each late grant was given back: the next delivery finds the key free.
    assert_eq!(
        ledger.get(&k).await.unwrap().unwrap().state,
        RecordState::Released
    );
    let v: u32 = Effects::new(ledger)
        .run(&k, &opts().lease(lease), |_| async { Ok(2) })
        .await
        .unwrap();
    assert_eq!(v, 2);
}

/// One failed renewal does not end renewal: a handler running for several
/// lease lengths keeps its lease (a competitor never acquires) and completes.
pub async fn renewal_survives_a_transient_failure<L: Ledger + Clone + 'static>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "renew-blip");
    let flaky = Faulty::new(ledger.clone()).fail_renewals(1);
    let effects = Effects::new(flaky.clone());
    // Longer than SHORT_LEASE: with 300 ms, one failed renewal left a retry
    // under 200 ms to land, which a loaded machine (the whole suite running
    // in parallel on two cores) sometimes missed.
    let lease = Duration::from_secs(1);
    let stop = Arc::new(AtomicBool::new(false));
    let stolen = Arc::new(AtomicUsize::new(0));
    let out: u32 = effects
        .run(&k, &opts().lease(lease), |held| {
            let (ledger, k, stop, stolen) = (ledger.clone(), k.clone(), stop.clone(), stolen.clone());
            // A competitor claims every 20 ms while the handler runs.
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    if let Claim::Acquired(l) = ledger.claim(&k, &opts().lease(lease)).await.unwrap() {
                        stolen.fetch_add(1, Ordering::SeqCst);
                        let _ = ledger.release(&l).await;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
            async move {
                tokio::time::sleep(lease * 3).await;
                assert!(!held.is_lost(), "renewal gave up after one failure");
                Ok(7)
            }
        })
        .await
        .unwrap();
    stop.store(true, Ordering::SeqCst);
    assert_eq!(out, 7);
    assert_eq!(
        stolen.load(Ordering::SeqCst),
        0,
        "the key was taken over while its handler ran"
    );
    assert_eq!(flaky.renewals_failed(), 1);
    assert!(matches!(
        ledger.claim(&k, &opts()).await.unwrap(),
        Claim::Completed(_)
    ));
}

/// When renewals keep failing, the handler learns that its lease is lost
/// before anyone can take it over, and a completion after a takeover is
/// reported as `LeaseLost`, never as success.
pub async fn handler_learns_its_lease_is_lost<L: Ledger + Clone + 'static>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "renew-down");
    let effects = Effects::new(Faulty::new(ledger.clone()).fail_renewals(u64::MAX));
    let e = effects
        .run::<u32, _, _>(&k, &opts().lease(SHORT_LEASE), |held| {
            let (ledger, k) = (ledger.clone(), k.clone());
            async move {
                tokio::select! {
                    _ = held.lost() => {}
                    _ = tokio::time::sleep(Duration::from_secs(30)) => panic!("never told the lease was lost"),
                }
                assert!(held.is_lost());
                assert!(held.check().unwrap_err().is_lease_lost());
                // Meanwhile its lease ends on the backend and another worker
                // takes the key over.
                tokio::time::sleep(SHORT_LEASE_WAIT).await;
                let other = acquired(ledger.claim(&k, &opts()).await.unwrap());
                assert!(other.fence > held.fence);
                Ok(1)
            }
        })
        .await
        .unwrap_err();
    assert!(e.is_lease_lost(), "{e:?}");
}

/// `Effects::run` of an at-most-once effect whose value is too large to
/// store does not release the key: the effect happened, so the next delivery
/// finds it abandoned instead of repeating it.
pub async fn run_at_most_once_unstorable_outcome_is_not_repeated<L: Ledger + 'static>(ledger: L) {
    let max = ledger.capabilities().max_outcome_bytes;
    let effects = Effects::new(ledger);
    let k = key(&fresh_tenant(), "receipt", "huge");
    let amo = opts().lease(SHORT_LEASE).at_most_once(true);
    let sent = AtomicUsize::new(0);
    let e = effects
        .run::<String, _, _>(&k, &amo, |_| {
            sent.fetch_add(1, Ordering::SeqCst);
            async move { Ok("x".repeat(max)) }
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::OutcomeTooLarge { .. }), "{e:?}");
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    let e = effects
        .run::<String, _, _>(&k, &amo, |_| {
            sent.fetch_add(1, Ordering::SeqCst);
            async { Ok(String::new()) }
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Abandoned { .. }), "{e:?}");
    assert_eq!(
        sent.load(Ordering::SeqCst),
        1,
        "the at-most-once effect ran twice"
    );
}

/// Runs an at-most-once effect whose handler fails with `fail` after it
/// started, then a redelivery once the lease ended: the handler must have
/// run once, the first run's error must satisfy `first`, and the redelivery
/// must find the step abandoned instead of performing it again.
async fn at_most_once_failure_is_not_repeated<L: Ledger + 'static>(
    ledger: L,
    amo: ClaimOptions,
    fail: impl Fn() -> Failure,
    first: impl Fn(&Error) -> bool,
) {
    let effects = Effects::new(ledger);
    let k = key(&fresh_tenant(), "receipt", "order-1");
    let amo = amo.lease(SHORT_LEASE).at_most_once(true);
    let sent = AtomicUsize::new(0);
    let e = effects
        .run::<String, _, _>(&k, &amo, |_| {
            // The mail went out; then something failed.
            sent.fetch_add(1, Ordering::SeqCst);
            let failure = fail();
            async move { Err(failure) }
        })
        .await
        .unwrap_err();
    assert!(first(&e), "{e:?}");
    let record = effects.ledger().get(&k).await.unwrap().expect("the mark stays");
    assert_eq!(
        record.state,
        RecordState::InProgress,
        "an at-most-once step whose handler ran was released: {record:?}"
    );
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    let e = effects
        .run::<String, _, _>(&k, &amo, |_| {
            sent.fetch_add(1, Ordering::SeqCst);
            async { Ok(String::new()) }
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Abandoned { .. }), "{e:?}");
    assert_eq!(
        sent.load(Ordering::SeqCst),
        1,
        "the at-most-once effect ran twice"
    );
}

/// An at-most-once handler that hits an unexpected unique violation (a bug
/// in its own writes, reported as [`Error::ConstraintViolation`]) may have
/// performed its effect already: the step is not released, so the next
/// delivery finds it abandoned instead of repeating it.
pub async fn run_at_most_once_constraint_violation_is_not_repeated<L: Ledger + 'static>(ledger: L) {
    at_most_once_failure_is_not_repeated(
        super::Faulty::new(ledger).unique_violations(),
        opts(),
        || Failure::retryable(super::InjectedUniqueViolation("receipts_pkey")),
        |e| matches!(e, Error::ConstraintViolation { message, .. } if message.contains("receipts_pkey")),
    )
    .await;
}

/// An at-most-once handler's terminal failure with failures not cached
/// ([`ClaimOptions::cache_failures`] off) is not released either: the step
/// is left to be abandoned and reconciled, never performed again.
pub async fn run_at_most_once_uncached_terminal_failure_is_not_repeated<L: Ledger + 'static>(ledger: L) {
    at_most_once_failure_is_not_repeated(
        ledger,
        opts().cache_failures(false),
        || Failure::terminal("the mail server hung up after DATA"),
        |e| matches!(e, Error::Terminal { .. }),
    )
    .await;
}

/// A completion that fails after the handler ran is
/// [`Error::OutcomeUnknown`] (retryable), never the backend's "nothing
/// ran": when it never reached the backend, the next delivery takes the
/// effect over once the lease ends, at a higher fence, and runs it again
/// (why effects carry provider keys); when it was applied and only its
/// answer was lost, the next delivery replays the outcome.
pub async fn run_completion_failure_is_outcome_unknown<L: Ledger + Clone + 'static>(ledger: L) {
    let t = fresh_tenant();
    let short = opts().lease(SHORT_LEASE);
    let runs = AtomicUsize::new(0);
    // Never reached the backend.
    let failing = Effects::new(super::Faulty::new(ledger.clone()).fail_completions(1));
    let k = key(&t, "capture", "order-1");
    let first = failing
        .run::<u32, _, _>(&k, &short, |l| {
            runs.fetch_add(1, Ordering::SeqCst);
            let fence = l.fence;
            async move { Ok(u32::try_from(fence % 1000).unwrap()) }
        })
        .await
        .unwrap_err();
    let Error::OutcomeUnknown { fence, source, .. } = &first else {
        panic!("expected OutcomeUnknown, got {first:?}");
    };
    assert!(first.is_retryable() && first.is_outcome_unknown());
    assert!(matches!(**source, Error::Unavailable { .. }), "{source:?}");
    let r = failing.ledger().get(&k).await.unwrap().unwrap();
    assert_eq!((r.state, r.fence), (RecordState::InProgress, *fence));
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    failing
        .run::<u32, _, _>(&k, &short, |l| {
            runs.fetch_add(1, Ordering::SeqCst);
            assert!(l.fence > *fence, "the repeat runs at a higher fence");
            async { Ok(2) }
        })
        .await
        .unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the unrecorded effect was taken over and run again"
    );

    // Applied, its answer lost.
    let k = key(&t, "capture", "order-2");
    let lost = Effects::new(super::Faulty::new(ledger).lose_completion_answers(1));
    let e = lost
        .run::<u32, _, _>(&k, &short, |_| async { Ok(7) })
        .await
        .unwrap_err();
    assert!(e.is_outcome_unknown(), "{e:?}");
    let replayed: u32 = lost
        .run(&k, &short, |_| async { Ok::<u32, Failure>(8) })
        .await
        .unwrap();
    assert_eq!(replayed, 7, "the completion had landed: replayed, not run again");
}

/// Telemetry is recorded once per claim, by the runner: a scripted run gives
/// exactly the documented counts (a backend that records its own would
/// double them).
pub async fn telemetry_counts_each_claim_once<L: Ledger + 'static>(ledger: L) {
    let ledger = Arc::new(ledger);
    metrics_snapshotter();
    let t = fresh_tenant();
    // The kind is a metric label: one no other test uses isolates the counts.
    let kind = format!("tm{}", t.as_str().replace(['.', '@', '+'], "-"));
    let k = |s: &str| key(&t, &kind, s);
    let effects = Effects::new(ledger.clone());
    let run = |key: EffectKey, o: ClaimOptions| {
        let effects = &effects;
        async move { effects.run(&key, &o, |_| async { Ok(1u32) }).await }
    };
    run(k("fresh"), opts()).await.unwrap();
    run(k("fresh"), opts()).await.unwrap();
    acquired(
        ledger
            .claim(&k("expired"), &opts().lease(SHORT_LEASE))
            .await
            .unwrap(),
    );
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    run(k("expired"), opts()).await.unwrap();
    acquired(ledger.claim(&k("busy"), &opts()).await.unwrap());
    let e = run(k("busy"), opts().on_in_progress(OnInProgress::Reject))
        .await
        .unwrap_err();
    assert!(e.is_in_progress(), "{e:?}");
    let backend = ledger.backend();
    let claims = |result: &str| {
        counter(
            telemetry::CLAIMS_TOTAL,
            &[("backend", backend), ("kind", &kind), ("result", result)],
        )
    };
    assert_eq!(
        [
            claims("acquired"),
            claims("completed"),
            claims("takeover"),
            claims("in_progress")
        ],
        [1, 1, 1, 1],
        "oncely_claims_total by result: acquired, completed, takeover, in_progress"
    );
    assert_eq!(counter(telemetry::CLAIMS_TOTAL, &[("kind", &kind)]), 4);
    assert_eq!(
        counter(telemetry::DUPLICATES_SUPPRESSED_TOTAL, &[("kind", &kind)]),
        1
    );
    assert_eq!(counter(telemetry::LEASE_TAKEOVERS_TOTAL, &[("kind", &kind)]), 1);
}

/// A duplicate that waits is answered when the holder finishes: it gets the
/// completed outcome (its handler never runs), or acquires after a release.
pub async fn run_waiter_is_answered_when_the_holder_finishes<L: Ledger + Clone + 'static>(ledger: L) {
    for release in [false, true] {
        let k = key(&fresh_tenant(), "capture", "waited-on");
        let holder = acquired(
            ledger
                .claim(&k, &opts().lease(Duration::from_secs(60)))
                .await
                .unwrap(),
        );
        let waiter = {
            let (ledger, k) = (ledger.clone(), k.clone());
            tokio::spawn(async move {
                let wait = OnInProgress::Wait {
                    max: Duration::from_secs(30),
                };
                Effects::new(ledger)
                    .run(&k, &opts().on_in_progress(wait), |_| async {
                        Ok("waiter ran".to_owned())
                    })
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiter.is_finished(), "the waiter did not wait");
        if release {
            ledger.release(&holder).await.unwrap();
        } else {
            ledger
                .complete(&holder, &Outcome::value(&"holder ran").unwrap())
                .await
                .unwrap();
        }
        let want = if release { "waiter ran" } else { "holder ran" };
        assert_eq!(waiter.await.unwrap().unwrap(), want);
    }
}

/// A notification that never comes costs latency, not the answer: with a
/// watch that is never woken, the waiter still gets the holder's outcome.
pub async fn run_waiter_survives_a_lost_notification<L: Ledger + Clone + 'static>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "lost-notification");
    let holder = acquired(
        ledger
            .claim(&k, &opts().lease(Duration::from_secs(60)))
            .await
            .unwrap(),
    );
    let deaf = Faulty::new(ledger.clone()).lose_notifications();
    let waiter = {
        let k = k.clone();
        tokio::spawn(async move {
            let wait = OnInProgress::Wait {
                max: Duration::from_secs(30),
            };
            Effects::new(deaf)
                .run(&k, &opts().on_in_progress(wait), |_| async { Ok(0u32) })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    ledger
        .complete(&holder, &Outcome::value(&7u32).unwrap())
        .await
        .unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), 7);
}

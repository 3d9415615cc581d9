//! The single-flight cases: a duplicate that arrives while the same runner
//! holds its key is answered from memory, with the outcome the holder's
//! acknowledged completion wrote, and with nothing else.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::{Faulty, fresh_tenant, key, opts};
use crate::ledger::Ledger;
use crate::record::Fingerprint;
use crate::{ClaimOptions, Effects, Error, How, OnInProgress, StepMode};

/// How many in-process duplicates wait on one holder.
const WAITERS: usize = 16;

fn waiting(max: Duration) -> ClaimOptions {
    opts().on_in_progress(OnInProgress::Wait { max })
}

/// Waits until `n` handlers have started.
async fn started(count: &AtomicUsize, n: usize) {
    for _ in 0..2000 {
        if count.load(Ordering::SeqCst) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{n} handlers never started");
}

/// 16 duplicates of one message arrive in the same process while its first
/// delivery runs the handler: none of them sends a claim (the ledger sees
/// exactly one, the holder's, while they wait and after they are answered),
/// and each gets the holder's outcome as a replay.
pub async fn single_flight_answers_local_duplicates_without_a_claim<L: Ledger + 'static>(ledger: L) {
    let faulty = Faulty::new(Arc::new(ledger));
    let effects = Arc::new(Effects::new(faulty.clone()));
    let k = key(&fresh_tenant(), "capture", "order-single-flight");
    let ran = Arc::new(AtomicUsize::new(0));
    let go = Arc::new(tokio::sync::Notify::new());
    let holder = {
        let (effects, k, ran, go) = (effects.clone(), k.clone(), ran.clone(), go.clone());
        tokio::spawn(async move {
            effects
                .run_reported(&k, &waiting(Duration::from_secs(30)), |_| async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    go.notified().await;
                    Ok(41_u32)
                })
                .await
        })
    };
    started(&ran, 1).await;
    let mut duplicates = Vec::new();
    for _ in 0..WAITERS {
        let (effects, k, ran) = (effects.clone(), k.clone(), ran.clone());
        duplicates.push(tokio::spawn(async move {
            effects
                .run_reported(&k, &waiting(Duration::from_secs(30)), |_| async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok(0_u32)
                })
                .await
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        faulty.claims_sent(),
        1,
        "in-process duplicates of a held key sent claims of their own"
    );
    assert!(
        duplicates.iter().all(|d| !d.is_finished()),
        "a duplicate answered before the holder"
    );
    go.notify_one();
    let first = holder.await.unwrap().unwrap();
    assert_eq!((first.value, first.how), (41, How::Ran));
    for d in duplicates {
        let got = d.await.unwrap().unwrap();
        assert_eq!((got.value, got.how), (41, How::Replayed));
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1, "the handler ran more than once");
    assert_eq!(
        faulty.claims_sent(),
        1,
        "a duplicate claimed after it was answered"
    );
}

/// The second delivery of a job arrives in the same process while the
/// first still runs its provider-keyed step: the duplicate's step sends no
/// claim (the ledger sees only the holder's), waits for the holder in
/// memory and replays its outcome; the step ran once.
pub async fn single_flight_answers_a_jobs_duplicate_step<L: Ledger + 'static>(ledger: L) {
    let faulty = Faulty::new(Arc::new(ledger));
    let effects = Arc::new(Effects::new(faulty.clone()));
    let tenant = fresh_tenant();
    let ran = Arc::new(AtomicUsize::new(0));
    let go = Arc::new(tokio::sync::Notify::new());
    let delivery = |value: u32, go: Option<Arc<tokio::sync::Notify>>| {
        let (effects, tenant, ran) = (effects.clone(), tenant.clone(), ran.clone());
        tokio::spawn(async move {
            let job = effects
                .job(&tenant, "payment", "order-job-flight")
                .options(waiting(Duration::from_secs(30)));
            job.step("capture", StepMode::ProviderKeyed, |_| async move {
                ran.fetch_add(1, Ordering::SeqCst);
                if let Some(go) = go {
                    go.notified().await;
                }
                Ok(value)
            })
            .await
        })
    };
    let holder = delivery(41, Some(go.clone()));
    started(&ran, 1).await;
    let duplicates: Vec<_> = (0..WAITERS).map(|_| delivery(0, None)).collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        faulty.claims_sent(),
        1,
        "in-process duplicates of a held step sent claims of their own"
    );
    assert!(
        duplicates.iter().all(|d| !d.is_finished()),
        "a duplicate step answered before the holder"
    );
    go.notify_one();
    assert_eq!(holder.await.unwrap().unwrap(), 41);
    for d in duplicates {
        assert_eq!(
            d.await.unwrap().unwrap(),
            41,
            "a duplicate step did not replay the holder's outcome"
        );
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1, "the step ran more than once");
    assert_eq!(
        faulty.claims_sent(),
        1,
        "a duplicate step claimed after it was answered"
    );
}

/// The holder's completion is slow and then fails (the effect ran; nothing
/// was recorded): its in-process duplicates stay waiting while it is in
/// flight, and are then sent to the ledger, which still shows the effect in
/// progress. None of them ever gets the value the holder computed but the
/// ledger never acknowledged.
pub async fn single_flight_never_answers_an_unacknowledged_outcome<L: Ledger + 'static>(ledger: L) {
    let faulty = Faulty::new(Arc::new(ledger))
        .fail_completions(1)
        .complete_delay(Duration::from_millis(300));
    let effects = Arc::new(Effects::new(faulty.clone()));
    let k = key(&fresh_tenant(), "capture", "order-unacknowledged");
    let long = waiting(Duration::from_secs(30)).lease(Duration::from_secs(30));
    let ran = Arc::new(AtomicUsize::new(0));
    let holder = {
        let (effects, k, ran, long) = (effects.clone(), k.clone(), ran.clone(), long.clone());
        tokio::spawn(async move {
            effects
                .run::<u32, _, _>(&k, &long, |_| async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Ok(41)
                })
                .await
        })
    };
    started(&ran, 1).await;
    let short = waiting(Duration::from_millis(1_500)).lease(Duration::from_secs(30));
    let mut duplicates = Vec::new();
    for _ in 0..4 {
        let (effects, k, ran, short) = (effects.clone(), k.clone(), ran.clone(), short.clone());
        duplicates.push(tokio::spawn(async move {
            effects
                .run::<u32, _, _>(&k, &short, |_| async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok(0)
                })
                .await
        }));
    }
    // The handler has returned; its completion is in flight (300 ms).
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(
        duplicates.iter().all(|d| !d.is_finished()),
        "a duplicate answered while the completion was in flight"
    );
    let e = holder.await.unwrap().unwrap_err();
    assert!(matches!(e, Error::OutcomeUnknown { .. }), "{e:?}");
    for d in duplicates {
        match d.await.unwrap() {
            Err(Error::InProgress { .. }) => {}
            other => panic!("a duplicate of an unrecorded effect must find it in progress: {other:?}"),
        }
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "the handler ran again under a live lease"
    );
}

/// An in-process duplicate that claims differently from the holder (another
/// request fingerprint, or `Reject`) is not answered from memory: the
/// ledger answers it at once, as it would answer another process.
pub async fn single_flight_answers_only_the_same_request<L: Ledger + 'static>(ledger: L) {
    let effects = Arc::new(Effects::new(ledger));
    let k = key(&fresh_tenant(), "refund", "refund-fingerprint");
    let first = waiting(Duration::from_secs(30)).fingerprint(Fingerprint::of_bytes(b"amount=10"));
    let ran = Arc::new(AtomicUsize::new(0));
    let go = Arc::new(tokio::sync::Notify::new());
    let holder = {
        let (effects, k, ran, go, first) =
            (effects.clone(), k.clone(), ran.clone(), go.clone(), first.clone());
        tokio::spawn(async move {
            effects
                .run::<u32, _, _>(&k, &first, |_| async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    go.notified().await;
                    Ok(10)
                })
                .await
        })
    };
    started(&ran, 1).await;
    let other = waiting(Duration::from_secs(30)).fingerprint(Fingerprint::of_bytes(b"amount=99"));
    let e = tokio::time::timeout(
        Duration::from_secs(5),
        effects.run::<u32, _, _>(&k, &other, |_| async { Ok(99) }),
    )
    .await
    .expect("a duplicate with another fingerprint waited for the holder")
    .unwrap_err();
    assert!(matches!(e, Error::FingerprintMismatch { .. }), "{e:?}");
    let rejecting = opts()
        .on_in_progress(OnInProgress::Reject)
        .fingerprint(Fingerprint::of_bytes(b"amount=10"));
    let e = tokio::time::timeout(
        Duration::from_secs(5),
        effects.run::<u32, _, _>(&k, &rejecting, |_| async { Ok(10) }),
    )
    .await
    .expect("a Reject duplicate waited for the holder")
    .unwrap_err();
    assert!(matches!(e, Error::InProgress { .. }), "{e:?}");
    go.notify_one();
    assert_eq!(holder.await.unwrap().unwrap(), 10);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

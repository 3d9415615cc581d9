//! The ledger cases: the `Ledger` contract, one behaviour each, called
//! directly on the backend.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{
    RACERS, Rng, SHORT_LEASE, SHORT_LEASE_WAIT, acquired, fresh_tenant, key, opts, prune_until_gone,
};
use crate::ledger::Ledger;
use crate::record::{Claim, Fingerprint, Outcome, RecordState};
use crate::{EffectKey, Effects, Error};

/// The first claim of a key acquires a fence (at least 1) and the record is
/// in progress at that fence.
pub async fn first_claim_acquires<L: Ledger + 'static>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "order-1");
    assert!(ledger.get(&k).await.unwrap().is_none());
    let lease = acquired(ledger.claim(&k, &opts()).await.unwrap());
    assert!(lease.fence >= 1);
    assert!(!lease.taken_over);
    assert!(lease.expires_at > lease.acquired_at);
    let r = ledger.get(&k).await.unwrap().expect("record exists after claim");
    assert_eq!(r.state, RecordState::InProgress);
    assert_eq!(r.fence, lease.fence);
    assert_eq!(r.key, k);
}

/// A sequential duplicate gets `Completed` with the byte-identical outcome.
pub async fn sequential_duplicate_returns_outcome<L: Ledger + 'static>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "order-2");
    let lease = acquired(ledger.claim(&k, &opts()).await.unwrap());
    let outcome =
        Outcome::from_bytes(br#"{"charge":"ch_1","amount":1250,"note":"\u00e9 \"q\""}"#.to_vec()).unwrap();
    ledger.complete(&lease, &outcome).await.unwrap();
    for _ in 0..2 {
        match ledger.claim(&k, &opts()).await.unwrap() {
            Claim::Completed(r) => {
                assert_eq!(r.state, RecordState::Completed);
                assert_eq!(r.outcome.as_ref().unwrap().as_bytes(), outcome.as_bytes());
                assert_eq!(r.fence, lease.fence);
            }
            other => panic!("expected Completed, got {other:?}"),
        }
    }
}

/// [`RACERS`] tasks claim one key at once; exactly one acquires and every
/// other sees it in progress.
pub async fn concurrent_claims_one_winner<L: Ledger + Clone + 'static>(ledger: L) {
    let t = fresh_tenant();
    for round in 0..3 {
        let k = key(&t, "capture", &format!("race-{round}"));
        let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
        let mut tasks = Vec::new();
        for _ in 0..RACERS {
            let (ledger, k, barrier) = (ledger.clone(), k.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                ledger.claim(&k, &opts()).await.unwrap()
            }));
        }
        let (mut won, mut busy) = (Vec::new(), Vec::new());
        for t in tasks {
            match t.await.unwrap() {
                Claim::Acquired(l) => won.push(l.fence),
                Claim::InProgress { fence, .. } => busy.push(fence),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(won.len(), 1, "exactly one of {RACERS} claimants must acquire");
        assert_eq!(busy.len(), RACERS - 1);
        assert!(
            busy.iter().all(|f| *f == won[0]),
            "every loser saw the winner's fence"
        );
    }
}

/// A released key is acquired again by the next claim, at a higher fence.
pub async fn release_then_claim_acquires<L: Ledger + 'static>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "order-3");
    let l1 = acquired(ledger.claim(&k, &opts()).await.unwrap());
    ledger.release(&l1).await.unwrap();
    assert_eq!(
        ledger.get(&k).await.unwrap().unwrap().state,
        RecordState::Released
    );
    let l2 = acquired(ledger.claim(&k, &opts()).await.unwrap());
    assert!(l2.fence > l1.fence, "a fence is never reused");
    assert!(l2.taken_over);
    // The first holder cannot release or complete the second holder's claim.
    assert!(ledger.release(&l1).await.unwrap_err().is_lease_lost());
}

/// An expired lease is taken over with a higher fence; a live one is not.
pub async fn expired_lease_is_taken_over<L: Ledger + 'static>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "order-4");
    let short = opts().lease(SHORT_LEASE);
    let l1 = acquired(ledger.claim(&k, &short).await.unwrap());
    assert!(matches!(
        ledger.claim(&k, &short).await.unwrap(),
        Claim::InProgress { fence, .. } if fence == l1.fence
    ));
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    let l2 = acquired(ledger.claim(&k, &short).await.unwrap());
    assert!(l2.fence > l1.fence);
    assert!(l2.taken_over);
    assert_eq!(l2.first_claimed_at, l1.first_claimed_at);
    assert_eq!(ledger.get(&k).await.unwrap().unwrap().fence, l2.fence);
}

/// [`RACERS`] tasks race to take over one expired lease: exactly one takes
/// it over, above the old fence, and every other one sees it in progress at
/// the new holder's fence.
pub async fn concurrent_takeovers_one_winner<L: Ledger + Clone + 'static>(ledger: L) {
    let t = fresh_tenant();
    let short = opts().lease(SHORT_LEASE);
    for round in 0..3 {
        let k = key(&t, "capture", &format!("takeover-race-{round}"));
        let first = acquired(ledger.claim(&k, &short).await.unwrap());
        tokio::time::sleep(SHORT_LEASE_WAIT).await;
        let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
        let mut tasks = Vec::new();
        for _ in 0..RACERS {
            let (ledger, k, barrier) = (ledger.clone(), k.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                ledger.claim(&k, &opts()).await.unwrap()
            }));
        }
        let (mut won, mut busy) = (Vec::new(), Vec::new());
        for t in tasks {
            match t.await.unwrap() {
                Claim::Acquired(l) => won.push(l),
                Claim::InProgress { fence, .. } => busy.push(fence),
                other => panic!("unexpected {other:?}"),
            }
        }
        let fences: Vec<u64> = won.iter().map(|l| l.fence).collect();
        assert_eq!(
            won.len(),
            1,
            "exactly one of {RACERS} may take the lease over: {fences:?}"
        );
        assert!(won[0].taken_over && won[0].fence > first.fence);
        assert!(
            busy.iter().all(|f| *f == won[0].fence),
            "every loser saw the new holder"
        );
    }
}

/// Complete, renew and release with a stale fence fail with `LeaseLost` and
/// leave the record as the new holder has it.
pub async fn stale_fence_is_rejected<L: Ledger + 'static>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "order-5");
    let short = opts().lease(SHORT_LEASE);
    let zombie = acquired(ledger.claim(&k, &short).await.unwrap());
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    let holder = acquired(ledger.claim(&k, &opts()).await.unwrap());
    let before = ledger.get(&k).await.unwrap().unwrap();
    let o = Outcome::from_json(&"zombie").unwrap();
    let e = ledger.complete(&zombie, &o).await.unwrap_err();
    assert!(
        matches!(e, Error::LeaseLost { fence, .. } if fence == zombie.fence),
        "{e:?}"
    );
    assert!(
        ledger
            .renew(&zombie, Duration::from_secs(60))
            .await
            .unwrap_err()
            .is_lease_lost()
    );
    assert!(ledger.release(&zombie).await.unwrap_err().is_lease_lost());
    let after = ledger.get(&k).await.unwrap().unwrap();
    assert_eq!(after.state, RecordState::InProgress);
    assert_eq!(after.fence, holder.fence);
    assert!(holder.fence > zombie.fence);
    assert_eq!(after.lease_expires_at, before.lease_expires_at);
    assert!(after.outcome.is_none());
    // The real holder completes; the zombie still cannot overwrite it.
    let real = Outcome::from_json(&"holder").unwrap();
    ledger.complete(&holder, &real).await.unwrap();
    assert!(ledger.complete(&zombie, &o).await.unwrap_err().is_lease_lost());
    assert!(
        ledger.complete(&holder, &o).await.unwrap_err().is_lease_lost(),
        "completing twice is refused"
    );
    let done = ledger.get(&k).await.unwrap().unwrap();
    assert_eq!(done.state, RecordState::Completed);
    assert_eq!(done.outcome.unwrap(), real);
}

/// Renewal keeps a live holder from being taken over past its first expiry.
pub async fn renew_extends_the_lease<L: Ledger + 'static>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "order-6");
    let short = opts().lease(SHORT_LEASE);
    let l = acquired(ledger.claim(&k, &short).await.unwrap());
    let renewed = ledger.renew(&l, Duration::from_secs(30)).await.unwrap();
    assert_eq!(renewed.fence, l.fence);
    assert!(renewed.expires_at > l.expires_at);
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    assert!(matches!(
        ledger.claim(&k, &short).await.unwrap(),
        Claim::InProgress { fence, .. } if fence == l.fence
    ));
    ledger
        .complete(&renewed, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
}

/// A claim with another fingerprint fails and changes nothing, in progress
/// and completed alike; the same fingerprint passes.
pub async fn fingerprint_mismatch_changes_nothing<L: Ledger + 'static>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "order-7");
    let fp1 = Fingerprint::of_json(&serde_json::json!({"amount": 100})).unwrap();
    let fp2 = Fingerprint::of_json(&serde_json::json!({"amount": 999})).unwrap();
    let short = opts().lease(SHORT_LEASE).fingerprint(fp1);
    let l = acquired(ledger.claim(&k, &short).await.unwrap());
    let before = ledger.get(&k).await.unwrap().unwrap();
    assert_eq!(before.fingerprint, Some(fp1));
    let e = ledger.claim(&k, &opts().fingerprint(fp2)).await.unwrap_err();
    assert!(matches!(e, Error::FingerprintMismatch { .. }), "{e:?}");
    // Even with the lease expired, a mismatch must not take it over.
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    let e = ledger.claim(&k, &opts().fingerprint(fp2)).await.unwrap_err();
    assert!(matches!(e, Error::FingerprintMismatch { .. }), "{e:?}");
    let mid = ledger.get(&k).await.unwrap().unwrap();
    assert_eq!(
        (mid.fence, mid.state, mid.lease_expires_at),
        (before.fence, before.state, before.lease_expires_at)
    );
    ledger
        .complete(&l, &Outcome::from_json(&"ok").unwrap())
        .await
        .unwrap();
    assert!(matches!(
        ledger.claim(&k, &opts().fingerprint(fp2)).await.unwrap_err(),
        Error::FingerprintMismatch { .. }
    ));
    assert!(matches!(
        ledger.claim(&k, &opts().fingerprint(fp1)).await.unwrap(),
        Claim::Completed(_)
    ));
    assert_eq!(
        ledger.get(&k).await.unwrap().unwrap().state,
        RecordState::Completed
    );
}

/// A claim flagged as a redelivery ([`ClaimOptions::redelivered`](crate::ClaimOptions::redelivered), which
/// lets a backend answer from a plain read) answers exactly as any claim, in
/// every state a record can be in: a fresh key is acquired, a live lease is
/// in progress and stays so, a completed effect replays its outcome, another
/// fingerprint is refused, a released record and an expired lease are taken
/// over with a higher fence, an expired at-most-once step is abandoned.
pub async fn redelivered_claims_answer_as_any_claim<L: Ledger + 'static>(ledger: L) {
    let t = fresh_tenant();
    let again = |o: crate::record::ClaimOptions| o.redelivered(true);
    let fp = Fingerprint::of_json(&serde_json::json!({"amount": 100})).unwrap();
    let other = Fingerprint::of_json(&serde_json::json!({"amount": 999})).unwrap();
    let outcome = Outcome::from_json(&"ch_1").unwrap();

    let fresh = key(&t, "capture", "redelivered-fresh");
    let live = acquired(ledger.claim(&fresh, &again(opts())).await.unwrap());
    assert!(matches!(
        ledger.claim(&fresh, &again(opts())).await.unwrap(),
        Claim::InProgress { fence, .. } if fence == live.fence
    ));

    let done = key(&t, "capture", "redelivered-done");
    let l = acquired(ledger.claim(&done, &opts().fingerprint(fp)).await.unwrap());
    ledger.complete(&l, &outcome).await.unwrap();
    for o in [again(opts().fingerprint(fp)), again(opts())] {
        match ledger.claim(&done, &o).await.unwrap() {
            Claim::Completed(r) => {
                assert_eq!(r.outcome.unwrap().as_bytes(), outcome.as_bytes());
                assert_eq!((r.fence, r.state), (l.fence, RecordState::Completed));
            }
            other => panic!("{other:?}"),
        }
    }
    let e = ledger
        .claim(&done, &again(opts().fingerprint(other)))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::FingerprintMismatch { .. }), "{e:?}");

    let released = key(&t, "capture", "redelivered-released");
    let l = acquired(ledger.claim(&released, &opts()).await.unwrap());
    ledger.release(&l).await.unwrap();
    let l2 = acquired(ledger.claim(&released, &again(opts())).await.unwrap());
    assert!(l2.taken_over && l2.fence > l.fence);

    let expired = key(&t, "capture", "redelivered-expired");
    let amo = key(&t, "receipt", "redelivered-expired");
    let l = acquired(ledger.claim(&expired, &opts().lease(SHORT_LEASE)).await.unwrap());
    let a = acquired(
        ledger
            .claim(&amo, &opts().lease(SHORT_LEASE).at_most_once(true))
            .await
            .unwrap(),
    );
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    let l2 = acquired(ledger.claim(&expired, &again(opts())).await.unwrap());
    assert!(l2.taken_over && l2.fence > l.fence);
    match ledger
        .claim(&amo, &again(opts().at_most_once(true)))
        .await
        .unwrap()
    {
        Claim::Abandoned(r) => assert_eq!(r.fence, a.fence),
        other => panic!("expected Abandoned, got {other:?}"),
    }
    assert_eq!(
        ledger.get(&fresh).await.unwrap().unwrap().fence,
        live.fence,
        "nothing a redelivered claim did moved the live lease"
    );
}

/// The same subject under two tenants, and under two kinds, are four
/// independent effects.
pub async fn tenants_and_kinds_are_independent<L: Ledger + 'static>(ledger: L) {
    let (a, b) = (fresh_tenant(), fresh_tenant());
    let keys = [
        key(&a, "capture", "order-8"),
        key(&b, "capture", "order-8"),
        key(&a, "receipt", "order-8"),
        key(&b, "receipt", "order-8"),
    ];
    for (i, k) in keys.iter().enumerate() {
        let l = acquired(ledger.claim(k, &opts()).await.unwrap());
        ledger
            .complete(&l, &Outcome::from_json(&i).unwrap())
            .await
            .unwrap();
    }
    for (i, k) in keys.iter().enumerate() {
        let r = ledger.get(k).await.unwrap().unwrap();
        assert_eq!(r.outcome.unwrap().to_value::<usize>().unwrap(), i);
        assert_eq!(r.key.tenant(), k.tenant());
    }
}

/// Keys with quotes, `%`, `_`, backslashes, unicode and SQL metacharacters
/// round-trip exactly and never match each other as patterns.
pub async fn awkward_keys_round_trip<L: Ledger + 'static>(ledger: L) {
    let t = fresh_tenant();
    let subjects = [
        "o'1",
        "o\"2",
        "100%",
        "100_",
        "1000",
        "a\\b",
        "x'; DROP TABLE oncely_effects; --",
        "ünïcødé-注文-🧾",
        "*",
        "?",
        "{a}[b]",
        "$1",
        "order:123:invoice:2",
        "a/b",
    ];
    for (i, s) in subjects.iter().enumerate() {
        let k = key(&t, "capture", s);
        let l = acquired(ledger.claim(&k, &opts()).await.unwrap());
        ledger
            .complete(&l, &Outcome::from_json(&i).unwrap())
            .await
            .unwrap();
    }
    for (i, s) in subjects.iter().enumerate() {
        let k = key(&t, "capture", s);
        let r = ledger.get(&k).await.unwrap().unwrap();
        assert_eq!(r.key.subject(), *s);
        assert_eq!(r.key, k);
        assert_eq!(r.outcome.unwrap().to_value::<usize>().unwrap(), i, "{s}");
    }
    assert!(ledger.get(&key(&t, "capture", "100")).await.unwrap().is_none());
    assert!(ledger.get(&key(&t, "capture", "o")).await.unwrap().is_none());
}

/// Bad input fails with a typed error and never reaches the ledger.
pub async fn invalid_input_is_rejected<L: Ledger + 'static>(ledger: L) {
    let t = fresh_tenant();
    for bad in ["", "a\0b", "line\nbreak", " lead"] {
        assert!(
            matches!(EffectKey::new(&t, "capture", bad), Err(Error::InvalidKey { .. })),
            "{bad:?}"
        );
    }
    assert!(EffectKey::new(&t, "cap:ture", "x").is_err());
    assert!(EffectKey::new(&t, "capture", "x".repeat(crate::key::MAX_KEY_BYTES)).is_err());
    let k = key(&t, "capture", "order-9");
    let e = ledger.claim(&k, &opts().lease(Duration::ZERO)).await.unwrap_err();
    assert!(e.is_invalid_input(), "{e:?}");
    // A renewal out of bounds is refused the same way by every backend
    // (backend::check_extension), and the lease stays as it was.
    let held = acquired(
        ledger
            .claim(&key(&t, "capture", "renew-bounds"), &opts())
            .await
            .unwrap(),
    );
    for bad in [Duration::ZERO, Duration::from_secs(2 * 86_400)] {
        let e = ledger.renew(&held, bad).await.unwrap_err();
        assert!(matches!(e, Error::InvalidInput(_)), "{bad:?}: {e:?}");
    }
    assert!(
        ledger.get(&k).await.unwrap().is_none(),
        "a refused claim wrote nothing"
    );
    // The longest valid key is stored whole, if the backend declares it.
    let max = ledger.capabilities().max_key_bytes;
    let overhead = format!("{t}/capture:").len();
    let long = key(&t, "capture", &"k".repeat(max - overhead));
    let l = acquired(ledger.claim(&long, &opts()).await.unwrap());
    ledger
        .complete(&l, &Outcome::from_json(&0).unwrap())
        .await
        .unwrap();
    assert_eq!(ledger.get(&long).await.unwrap().unwrap().key.as_str().len(), max);
}

/// An outcome at the backend's limit round-trips; one over it is refused and
/// the record stays in progress.
pub async fn outcome_size_limit<L: Ledger + 'static>(ledger: L) {
    let t = fresh_tenant();
    let max = ledger.capabilities().max_outcome_bytes;
    assert!(max <= crate::record::MAX_OUTCOME_BYTES);
    let at = Outcome::from_bytes(format!("\"{}\"", "x".repeat(max - 2)).into_bytes()).unwrap();
    assert_eq!(at.len(), max);
    let k = key(&t, "capture", "big");
    let l = acquired(ledger.claim(&k, &opts()).await.unwrap());
    ledger.complete(&l, &at).await.unwrap();
    match ledger.claim(&k, &opts()).await.unwrap() {
        Claim::Completed(r) => assert_eq!(r.outcome.unwrap().as_bytes(), at.as_bytes()),
        other => panic!("{other:?}"),
    }
    let k2 = key(&t, "capture", "too-big");
    let l2 = acquired(ledger.claim(&k2, &opts()).await.unwrap());
    let over = vec![b'1'; max + 1];
    match Outcome::from_bytes(over) {
        Err(e) => assert!(matches!(e, Error::OutcomeTooLarge { .. })),
        Ok(o) => {
            let e = ledger.complete(&l2, &o).await.unwrap_err();
            assert!(matches!(e, Error::OutcomeTooLarge { .. }), "{e:?}");
        }
    }
    let r = ledger.get(&k2).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::InProgress);
    assert!(r.outcome.is_none());
}

/// Prune deletes completed and released records past retention, and never a
/// live lease, a young record or an abandoned step.
pub async fn prune_keeps_what_it_must<L: Ledger + 'static>(ledger: L) {
    let t = fresh_tenant();
    let brief = opts()
        .lease(Duration::from_millis(100))
        .retention(Duration::from_millis(300));
    let done = key(&t, "capture", "done");
    let released = key(&t, "capture", "released");
    let live = key(&t, "capture", "live");
    let young = key(&t, "capture", "young");
    let abandoned = key(&t, "receipt", "abandoned");
    let l = acquired(ledger.claim(&done, &brief).await.unwrap());
    ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    let l = acquired(ledger.claim(&released, &brief).await.unwrap());
    ledger.release(&l).await.unwrap();
    acquired(
        ledger
            .claim(
                &live,
                &opts()
                    .lease(Duration::from_secs(60))
                    .retention(Duration::from_secs(60)),
            )
            .await
            .unwrap(),
    );
    acquired(
        ledger
            .claim(&abandoned, &brief.clone().at_most_once(true))
            .await
            .unwrap(),
    );
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    let l = acquired(ledger.claim(&young, &opts()).await.unwrap());
    ledger
        .complete(&l, &Outcome::from_json(&2).unwrap())
        .await
        .unwrap();
    // Other tests prune the same table concurrently and may delete these
    // records first, so the count proves nothing; what is gone does.
    ledger.prune(u64::MAX).await.unwrap();
    assert!(ledger.get(&done).await.unwrap().is_none());
    assert!(ledger.get(&released).await.unwrap().is_none());
    assert_eq!(
        ledger.get(&live).await.unwrap().unwrap().state,
        RecordState::InProgress
    );
    assert_eq!(
        ledger.get(&young).await.unwrap().unwrap().state,
        RecordState::Completed
    );
    assert_eq!(
        ledger.get(&abandoned).await.unwrap().unwrap().state,
        RecordState::Abandoned
    );
}

/// The horizon is what the ledger pruned, not the retention a claimant
/// passes: an old first delivery of a never-pruned kind is new work, and a
/// replay of a pruned effect fails with `BeyondHorizon` even when it claims
/// with a longer retention than the record had (a configuration change).
pub async fn beyond_horizon_is_detected<L: Ledger + 'static>(ledger: L) {
    let t = fresh_tenant();
    let hour_ago = SystemTime::now() - Duration::from_secs(3600);
    let brief = opts()
        .lease(Duration::from_millis(100))
        .retention(Duration::from_millis(300));
    let h0 = ledger.horizon(&t, "capture").await.unwrap();
    assert!(
        h0.is_none_or(|h| h < hour_ago),
        "nothing of this tenant was pruned: {h0:?}"
    );
    // A message delayed for an hour, first delivered now: nothing it could be
    // a duplicate of was pruned, so it runs, whatever its own retention.
    let k = key(&t, "capture", "late-first-delivery");
    let l = acquired(ledger.claim(&k, &brief.clone().sent_at(hour_ago)).await.unwrap());
    let created = ledger.get(&k).await.unwrap().unwrap().created_at;
    ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    // A replay while the record exists gets the record, however old it is.
    assert!(matches!(
        ledger.claim(&k, &opts().sent_at(hour_ago)).await.unwrap(),
        Claim::Completed(_)
    ));
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    prune_until_gone(&ledger, &k).await;
    let h = ledger
        .horizon(&t, "capture")
        .await
        .unwrap()
        .expect("prune recorded the horizon");
    assert!(
        h >= created,
        "horizon {h:?} is before the pruned record's creation {created:?}"
    );
    // The same replay, claiming with a week of retention, must not run again.
    let week = opts().retention(Duration::from_secs(7 * 86_400));
    let e = ledger
        .claim(&k, &week.clone().sent_at(hour_ago))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
    assert!(
        ledger.get(&k).await.unwrap().is_none(),
        "a refused claim wrote nothing"
    );
    // Other kinds and tenants keep their own horizon.
    acquired(
        ledger
            .claim(
                &key(&t, "receipt", "late-first-delivery"),
                &week.clone().sent_at(hour_ago),
            )
            .await
            .unwrap(),
    );
    acquired(
        ledger
            .claim(
                &key(&fresh_tenant(), "capture", "late-first-delivery"),
                &week.clone().sent_at(hour_ago),
            )
            .await
            .unwrap(),
    );
    // A message produced after the horizon is new work; one without
    // `sent_at` cannot be told from new work (documented).
    acquired(
        ledger
            .claim(
                &key(&t, "capture", "fresh"),
                &week.clone().sent_at(SystemTime::now()),
            )
            .await
            .unwrap(),
    );
    acquired(ledger.claim(&k, &week).await.unwrap());
}

/// Times the ledger cannot store (before 1970, past 9999) are refused with
/// `InvalidInput` before any write, by the ledger and by the runner; they
/// never panic or wrap into another time.
pub async fn out_of_range_times_are_refused<L: Ledger + 'static>(ledger: L) {
    let ledger = Arc::new(ledger);
    let t = fresh_tenant();
    let k = key(&t, "capture", "time-travel");
    let effects = Effects::new(ledger.clone());
    for at in [
        UNIX_EPOCH - Duration::from_secs(86_400),
        UNIX_EPOCH + Duration::from_secs(1 << 40),
        UNIX_EPOCH + Duration::from_micros(u64::MAX) + Duration::from_secs(1),
    ] {
        let e = ledger.claim(&k, &opts().sent_at(at)).await.unwrap_err();
        assert!(matches!(e, Error::InvalidInput(_)), "{at:?}: {e:?}");
        let e = effects
            .run::<u32, _, _>(&k, &opts().sent_at(at), |_| async { panic!("must not run") })
            .await
            .unwrap_err();
        assert!(
            matches!(e, Error::InvalidInput(_)) && e.is_invalid_input(),
            "{at:?}: {e:?}"
        );
    }
    assert!(ledger.get(&k).await.unwrap().is_none());
    // Far, but storable: a producer's clock in the future is never beyond the
    // horizon.
    let future = UNIX_EPOCH + Duration::from_secs(200 * 365 * 86_400);
    acquired(ledger.claim(&k, &opts().sent_at(future)).await.unwrap());
}

/// A fence is never reused for a key, across prune: a worker that stalled
/// with an old lease cannot match the lease of whoever claims the key after
/// its record was pruned, and that later holder's lease stays exclusive.
pub async fn fences_never_repeat_after_prune<L: Ledger + 'static>(ledger: L) {
    let t = fresh_tenant();
    let k = key(&t, "capture", "zombie");
    let brief = opts()
        .lease(Duration::from_millis(200))
        .retention(Duration::from_millis(300));
    let w1 = acquired(ledger.claim(&k, &brief).await.unwrap());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let w2 = acquired(ledger.claim(&k, &brief).await.unwrap());
    assert!(w2.fence > w1.fence);
    ledger.release(&w2).await.unwrap();
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    prune_until_gone(&ledger, &k).await;
    let w3 = acquired(ledger.claim(&k, &opts()).await.unwrap());
    assert!(
        w3.fence > w2.fence && w3.fence > w1.fence,
        "fence {} after prune repeats an earlier one ({}, {})",
        w3.fence,
        w1.fence,
        w2.fence
    );
    let o = Outcome::from_json(&"zombie").unwrap();
    for stale in [&w1, &w2] {
        assert!(ledger.release(stale).await.unwrap_err().is_lease_lost());
        assert!(ledger.complete(stale, &o).await.unwrap_err().is_lease_lost());
        assert!(
            ledger
                .renew(stale, Duration::from_secs(60))
                .await
                .unwrap_err()
                .is_lease_lost()
        );
    }
    match ledger.claim(&k, &opts()).await.unwrap() {
        Claim::InProgress { fence, .. } => assert_eq!(fence, w3.fence),
        other => panic!("W3's lease is live, yet a fourth claimant got {other:?}"),
    }
    ledger
        .complete(&w3, &Outcome::from_json(&"w3").unwrap())
        .await
        .unwrap();
    let r = ledger.get(&k).await.unwrap().unwrap();
    assert_eq!((r.state, r.fence), (RecordState::Completed, w3.fence));
}

/// An at-most-once claim whose lease runs out is `Abandoned`: not taken over,
/// listed for reconciliation, and resolvable with its reconciliation lease.
pub async fn at_most_once_is_abandoned_not_rerun<L: Ledger + 'static>(ledger: L) {
    let t = fresh_tenant();
    let k = key(&t, "receipt", "order-10");
    let amo = opts().lease(SHORT_LEASE).at_most_once(true);
    let l = acquired(ledger.claim(&k, &amo).await.unwrap());
    assert!(l.at_most_once);
    assert!(matches!(
        ledger.claim(&k, &amo).await.unwrap(),
        Claim::InProgress { .. }
    ));
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    let r = match ledger.claim(&k, &amo).await.unwrap() {
        Claim::Abandoned(r) => r,
        other => panic!("expected Abandoned, got {other:?}"),
    };
    assert_eq!(r.state, RecordState::Abandoned);
    assert_eq!(r.fence, l.fence, "an abandoned step is not taken over");
    let listed = ledger.abandoned(&t, 10).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, k);
    assert!(
        ledger.abandoned(&fresh_tenant(), 10).await.unwrap().is_empty(),
        "listing is per tenant"
    );
    // Reconciliation: the operator learns the mail did go out.
    let rl = listed[0].reconciliation_lease();
    ledger
        .complete(&rl, &Outcome::from_json(&"sent (reconciled)").unwrap())
        .await
        .unwrap();
    assert!(matches!(
        ledger.claim(&k, &amo).await.unwrap(),
        Claim::Completed(_)
    ));
    assert!(ledger.abandoned(&t, 10).await.unwrap().is_empty());
}

/// Claims and completions aborted at random points never lose a committed
/// result, and leave the ledger's connections clean: every later claim
/// persists and is visible to a fresh read.
pub async fn cancellation_is_safe<L: Ledger + Clone + 'static>(ledger: L) {
    cancellation_case(ledger, "cancellation_is_safe", false).await;
}

/// [`cancellation_is_safe`]'s body. `released`: whether an aborted claim
/// may leave its key released (a wrapper that gives a dropped claimant's
/// grant back, [`Coalescing`](crate::backend::Coalescing)).
pub(crate) async fn cancellation_case<L: Ledger + Clone + 'static>(ledger: L, label: &str, released: bool) {
    let t = fresh_tenant();
    let mut rng = Rng::from_env(label);
    let confirmed = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..200 {
        let (ledger, confirmed) = (ledger.clone(), confirmed.clone());
        let k = key(&t, "capture", &format!("c-{i}"));
        let budget = Duration::from_micros(rng.below(4000));
        let abort_after = Duration::from_micros(rng.below(4000));
        let task = tokio::spawn(async move {
            let _ = tokio::time::timeout(budget, async {
                if let Claim::Acquired(l) = ledger
                    .claim(&k, &opts().lease(Duration::from_secs(60)))
                    .await
                    .unwrap()
                {
                    ledger
                        .complete(&l, &Outcome::from_json(&i).unwrap())
                        .await
                        .unwrap();
                    confirmed.lock().unwrap().push((k, i));
                }
            })
            .await;
        });
        if i % 2 == 0 {
            let handle = task.abort_handle();
            tokio::spawn(async move {
                tokio::time::sleep(abort_after).await;
                handle.abort();
            });
        }
        tasks.push(task);
    }
    for task in tasks {
        let _ = task.await;
    }
    let confirmed = confirmed.lock().unwrap().clone();
    for (k, i) in &confirmed {
        let r = ledger
            .get(k)
            .await
            .unwrap()
            .expect("a confirmed completion is never lost");
        assert_eq!(r.state, RecordState::Completed);
        assert_eq!(r.outcome.unwrap().to_value::<usize>().unwrap(), *i);
    }
    // Every key is absent, in progress or completed: nothing half-written.
    for i in 0..200 {
        if let Some(r) = ledger.get(&key(&t, "capture", &format!("c-{i}"))).await.unwrap() {
            assert!(
                matches!(r.state, RecordState::InProgress | RecordState::Completed)
                    || (released && r.state == RecordState::Released),
                "{r:?}"
            );
        }
    }
    // The connections the aborted futures used are back in the pool; each of
    // these claims must commit, not vanish inside a transaction left open.
    for i in 0..100 {
        let k = key(&t, "after", &format!("a-{i}"));
        let l = acquired(ledger.claim(&k, &opts()).await.unwrap());
        ledger
            .complete(&l, &Outcome::from_json(&i).unwrap())
            .await
            .unwrap();
    }
    for i in 0..100 {
        let r = ledger.get(&key(&t, "after", &format!("a-{i}"))).await.unwrap();
        assert_eq!(
            r.map(|r| r.state),
            Some(RecordState::Completed),
            "after-{i} was lost"
        );
    }
}

/// The control experiment: the naive guard (read, act, write) double-applies
/// under the same concurrency that `run` survives, so these tests can fail.
pub async fn naive_guard_double_applies<L: Ledger + Clone + 'static>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "order-17");
    let performed = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(32));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (ledger, k, performed, barrier) = (ledger.clone(), k.clone(), performed.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let seen = ledger.get(&k).await.unwrap();
            // Every delivery has read before any acts: the race the guard
            // loses, made certain instead of left to the scheduler (on a
            // loaded machine the first writer could otherwise finish before
            // a slow reader reads, and the test would fail for the wrong
            // reason).
            barrier.wait().await;
            if seen.is_none() {
                performed.fetch_add(1, Ordering::SeqCst);
                if let Claim::Acquired(l) = ledger.claim(&k, &opts()).await.unwrap() {
                    ledger
                        .complete(&l, &Outcome::from_json(&()).unwrap())
                        .await
                        .unwrap();
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(
        performed.load(Ordering::SeqCst) > 1,
        "the naive guard should double-apply under 32 concurrent deliveries"
    );
}

/// `claim_many` answers each key in order, as claims one by one would: a new
/// key acquires, a completed one answers its record, a live lease is in
/// progress, a released or expired one is taken over, a key listed twice is
/// acquired once and found in progress the second time, and a fingerprint
/// mismatch fails its own slot only.
pub async fn claim_many_answers_each_key_in_order<L: Ledger + 'static>(ledger: L) {
    let t = fresh_tenant();
    let k = |s: &str| key(&t, "capture", s);
    let done = acquired(ledger.claim(&k("done"), &opts()).await.unwrap());
    ledger
        .complete(&done, &Outcome::from_json(&"done").unwrap())
        .await
        .unwrap();
    let live = acquired(ledger.claim(&k("live"), &opts()).await.unwrap());
    let released = acquired(ledger.claim(&k("released"), &opts()).await.unwrap());
    ledger.release(&released).await.unwrap();
    let expired = acquired(
        ledger
            .claim(&k("expired"), &opts().lease(SHORT_LEASE))
            .await
            .unwrap(),
    );
    let fp = Fingerprint::of_bytes(b"first payload");
    acquired(
        ledger
            .claim(&k("fingerprinted"), &opts().fingerprint(fp))
            .await
            .unwrap(),
    );
    tokio::time::sleep(SHORT_LEASE_WAIT).await;

    let keys = [
        k("new"),
        k("done"),
        k("live"),
        k("released"),
        k("expired"),
        k("new"),
        k("fingerprinted"),
    ];
    let other = Fingerprint::of_bytes(b"another payload");
    let answers = ledger
        .claim_many(&keys, &opts().fingerprint(other))
        .await
        .unwrap();
    assert_eq!(answers.len(), keys.len());
    let mut answers = answers.into_iter();
    let mut next = || answers.next().unwrap();
    let new = match next() {
        Ok(Claim::Acquired(l)) => l,
        other => panic!("new key: {other:?}"),
    };
    assert!(
        matches!(next(), Ok(Claim::Completed(r)) if r.outcome == Some(Outcome::from_json(&"done").unwrap()))
    );
    assert!(matches!(next(), Ok(Claim::InProgress { fence, .. }) if fence == live.fence()));
    assert!(matches!(next(), Ok(Claim::Acquired(l)) if l.taken_over() && l.fence() > released.fence()));
    assert!(matches!(next(), Ok(Claim::Acquired(l)) if l.taken_over() && l.fence() > expired.fence()));
    assert!(
        matches!(next(), Ok(Claim::InProgress { fence, .. }) if fence == new.fence()),
        "a key listed twice"
    );
    assert!(matches!(next(), Err(Error::FingerprintMismatch { .. })));
    // The batch's writes are real: the new key's lease holds.
    ledger
        .complete(&new, &Outcome::from_json(&"new").unwrap())
        .await
        .unwrap();
    assert_eq!(ledger.claim_many(&[], &opts()).await.unwrap().len(), 0);
    let e = ledger
        .claim_many(&keys, &opts().lease(Duration::ZERO))
        .await
        .unwrap_err();
    assert!(e.is_invalid_input(), "{e:?}");
}

/// Two batches that overlap, claimed at the same moment: every key is
/// acquired by exactly one of them, the other finds it in progress.
pub async fn overlapping_batches_acquire_each_key_once<L: Ledger + Clone + 'static>(ledger: L) {
    let t = fresh_tenant();
    let keys: Vec<EffectKey> = (0..40).map(|i| key(&t, "capture", &format!("b-{i}"))).collect();
    for round in 0..3 {
        let keys: Vec<EffectKey> = keys
            .iter()
            .map(|k| key(&t, "capture", &format!("{}-{round}", k.subject())))
            .collect();
        let (a, b) = (keys[..30].to_vec(), keys[10..].to_vec());
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let run = |batch: Vec<EffectKey>| {
            let (ledger, barrier) = (ledger.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let answers = ledger.claim_many(&batch, &opts()).await.unwrap();
                batch.into_iter().zip(answers).collect::<Vec<_>>()
            })
        };
        let (ra, rb) = (run(a), run(b));
        let mut won = std::collections::HashMap::new();
        for (k, answer) in ra.await.unwrap().into_iter().chain(rb.await.unwrap()) {
            match answer.unwrap() {
                Claim::Acquired(_) => *won.entry(k).or_insert(0) += 1,
                Claim::InProgress { .. } => {
                    won.entry(k).or_insert(0);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(won.len(), 40);
        assert!(won.values().all(|n| *n == 1), "each key acquired once: {won:?}");
    }
}

/// `complete_many` completes each lease in order, fenced by its own lease: a
/// stale one fails in its slot only.
pub async fn complete_many_is_fenced_per_lease<L: Ledger + 'static>(ledger: L) {
    let t = fresh_tenant();
    let a = acquired(ledger.claim(&key(&t, "capture", "a"), &opts()).await.unwrap());
    let stale = acquired(ledger.claim(&key(&t, "capture", "b"), &opts()).await.unwrap());
    ledger.release(&stale).await.unwrap();
    let b = acquired(ledger.claim(&key(&t, "capture", "b"), &opts()).await.unwrap());
    let c = acquired(ledger.claim(&key(&t, "capture", "c"), &opts()).await.unwrap());
    let o = |s: &str| Outcome::from_json(&s).unwrap();
    let answers = ledger
        .complete_many(&[
            (a.clone(), o("a")),
            (stale, o("stale")),
            (b.clone(), o("b")),
            (c.clone(), o("c")),
        ])
        .await;
    assert!(
        answers[0].is_ok() && answers[2].is_ok() && answers[3].is_ok(),
        "{answers:?}"
    );
    assert!(answers[1].as_ref().unwrap_err().is_lease_lost(), "{answers:?}");
    for (l, want) in [(&a, "a"), (&b, "b"), (&c, "c")] {
        let r = ledger.get(l.key()).await.unwrap().unwrap();
        assert_eq!((r.state, r.outcome), (RecordState::Completed, Some(o(want))));
    }
    assert!(ledger.complete_many(&[]).await.is_empty());
}

/// A key (or a lease) listed more than once in one batch: each later
/// listing gets what the same call made again right after the earlier one
/// would get (`Ledger::claim_many`, `Ledger::complete_many`). A claim
/// acquired first is in progress at that fence after; a completed, live,
/// abandoned or mismatched record answers the same again; a lease completed
/// first is lost after, and the stored outcome is the first one; a stale
/// lease beside the current one of its key fails alone.
pub async fn batch_duplicates_answer_as_sequential_calls<L: Ledger + 'static>(ledger: L) {
    let t = fresh_tenant();
    let k = |s: &str| key(&t, "capture", s);
    let o = |s: &str| Outcome::from_json(&s).unwrap();
    let done = acquired(ledger.claim(&k("done"), &opts()).await.unwrap());
    ledger.complete(&done, &o("done")).await.unwrap();
    let live = acquired(ledger.claim(&k("live"), &opts()).await.unwrap());
    let expired = acquired(
        ledger
            .claim(&k("expired"), &opts().lease(SHORT_LEASE))
            .await
            .unwrap(),
    );
    let fp = Fingerprint::of_bytes(b"first payload");
    acquired(
        ledger
            .claim(&k("fingerprinted"), &opts().fingerprint(fp))
            .await
            .unwrap(),
    );
    let at_most_once = opts().at_most_once(true).lease(SHORT_LEASE);
    acquired(ledger.claim(&k("abandoned"), &at_most_once).await.unwrap());
    tokio::time::sleep(SHORT_LEASE_WAIT).await;

    let keys = [
        k("new"),
        k("done"),
        k("live"),
        k("expired"),
        k("new"),
        k("done"),
        k("live"),
        k("expired"),
        k("new"),
    ];
    let answers = ledger.claim_many(&keys, &opts()).await.unwrap();
    assert_eq!(answers.len(), keys.len());
    let new = match &answers[0] {
        Ok(Claim::Acquired(l)) => l.clone(),
        other => panic!("new key, first listing: {other:?}"),
    };
    let taken = match &answers[3] {
        Ok(Claim::Acquired(l)) if l.taken_over() && l.fence() > expired.fence() => l.clone(),
        other => panic!("expired key, first listing: {other:?}"),
    };
    for (n, answer) in answers.iter().enumerate() {
        let ok = match (n % 4, answer) {
            (0, Ok(Claim::InProgress { fence, .. })) => n > 0 && *fence == new.fence(),
            (0, Ok(Claim::Acquired(_))) => n == 0,
            (1, Ok(Claim::Completed(r))) => r.fence == done.fence() && r.outcome == Some(o("done")),
            (2, Ok(Claim::InProgress { fence, .. })) => *fence == live.fence(),
            (3, Ok(Claim::InProgress { fence, .. })) => n > 3 && *fence == taken.fence(),
            (3, Ok(Claim::Acquired(_))) => n == 3,
            _ => false,
        };
        assert!(ok, "slot {n} ({}): {answer:?}", keys[n]);
    }

    // Refusals repeat: another payload, an abandoned at-most-once step.
    let other = Fingerprint::of_bytes(b"another payload");
    let answers = ledger
        .claim_many(
            &[k("fingerprinted"), k("fingerprinted")],
            &opts().fingerprint(other),
        )
        .await
        .unwrap();
    for (n, answer) in answers.iter().enumerate() {
        assert!(
            matches!(answer, Err(Error::FingerprintMismatch { .. })),
            "mismatched key, listing {n}: {answer:?}"
        );
    }
    let answers = ledger
        .claim_many(&[k("abandoned"), k("abandoned")], &at_most_once)
        .await
        .unwrap();
    for (n, answer) in answers.iter().enumerate() {
        assert!(
            matches!(answer, Ok(Claim::Abandoned(r)) if r.key == k("abandoned")),
            "abandoned step, listing {n}: {answer:?}"
        );
    }

    // The same lease twice: completed once, with the first outcome.
    let answers = ledger
        .complete_many(&[(new.clone(), o("first")), (new.clone(), o("second"))])
        .await;
    assert!(answers[0].is_ok(), "{answers:?}");
    assert!(
        answers[1].as_ref().is_err_and(Error::is_lease_lost),
        "a lease completed twice: {answers:?}"
    );
    let r = ledger.get(new.key()).await.unwrap().unwrap();
    assert_eq!(
        (r.state, r.fence, r.outcome),
        (RecordState::Completed, new.fence(), Some(o("first")))
    );

    // A stale lease and the current one of a key, each fenced on its own,
    // and the current one again: only its first listing completes.
    let answers = ledger
        .complete_many(&[
            (expired.clone(), o("stale")),
            (taken.clone(), o("taken")),
            (taken.clone(), o("again")),
        ])
        .await;
    assert!(
        answers[0].as_ref().is_err_and(Error::is_lease_lost),
        "stale lease: {answers:?}"
    );
    assert!(answers[1].is_ok(), "current lease: {answers:?}");
    assert!(
        answers[2].as_ref().is_err_and(Error::is_lease_lost),
        "current lease again: {answers:?}"
    );
    let r = ledger.get(taken.key()).await.unwrap().unwrap();
    assert_eq!(
        (r.state, r.fence, r.outcome),
        (RecordState::Completed, taken.fence(), Some(o("taken")))
    );
}

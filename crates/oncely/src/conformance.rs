//! The conformance suite every backend runs, unchanged (feature `conformance`).
//!
//! Plain async functions, one behaviour each, in the manner of object_store's
//! `integration.rs`. A backend crate runs them all from `tests/conformance.rs`:
//!
//! ```text
//! async fn ledger() -> Option<MyLedger> { /* None when the server is absent */ }
//! oncely::conformance_tests!(ledger);
//! ```
//!
//! Every function isolates itself with a fresh tenant, so the suite can run in
//! parallel against one database. Lease expiry is exercised with real, short
//! leases on the backend's own clock: no function fakes time.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::backend::needs_refresh;
use crate::{
    Capabilities, Claim, ClaimOptions, EffectKey, Effects, Error, Failure, Fingerprint, Lease, Ledger,
    OnInProgress, Outcome, Record, RecordState, Result, Tenant, TransactionalLedger, telemetry,
};

/// A lease short enough to expire inside a test.
pub const SHORT_LEASE: Duration = Duration::from_millis(300);
/// How long to wait for [`SHORT_LEASE`] to expire on the backend's clock.
pub const SHORT_LEASE_WAIT: Duration = Duration::from_millis(800);
/// How many claimants race for one key.
pub const RACERS: usize = 64;

/// Reads a service URL from `var`. When it is absent: fails if
/// `ONCELY_REQUIRE_SERVICES=1` (CI), else says so on stderr and returns `None`.
pub fn service_url(var: &str, default: Option<&str>) -> Option<String> {
    if let Ok(url) = std::env::var(var) {
        return Some(url);
    }
    if let Some(d) = default {
        return Some(d.to_owned());
    }
    skip_or_fail(&format!("{var} is not set"))
}

/// Skips (stderr, `None`) or, under `ONCELY_REQUIRE_SERVICES=1`, panics.
pub fn skip_or_fail<T>(why: &str) -> Option<T> {
    if std::env::var("ONCELY_REQUIRE_SERVICES").as_deref() == Ok("1") {
        panic!("required service missing: {why}");
    }
    eprintln!("skipping: {why} (set ONCELY_REQUIRE_SERVICES=1 to fail instead)");
    None
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A tenant no other test uses (process id, time and a counter).
pub fn fresh_tenant() -> Tenant {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    Tenant::new(format!(
        "t{}-{:x}-{}",
        std::process::id(),
        nanos & 0xffff_ffff_ffff,
        SEQ.fetch_add(1, Ordering::Relaxed)
    ))
    .expect("generated tenant is valid")
}

fn key(t: &Tenant, kind: &str, subject: &str) -> EffectKey {
    EffectKey::new(t, kind, subject).expect("test key is valid")
}

fn acquired(c: Claim) -> crate::Lease {
    match c {
        Claim::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn opts() -> ClaimOptions {
    ClaimOptions::default()
}

/// A tiny seeded xorshift, so the suite needs no RNG dependency; the seed is
/// printed so a failure can be replayed.
pub struct Rng(u64);

impl Rng {
    /// Seeded from `ONCELY_SEED` or the clock; prints the seed.
    pub fn from_env(label: &str) -> Self {
        let seed = std::env::var("ONCELY_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos() as u64
                    | 1
            });
        eprintln!("{label}: ONCELY_SEED={seed}");
        Rng(seed)
    }

    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// The first claim of a key acquires a fence (at least 1) and the record is
/// in progress at that fence.
pub async fn first_claim_acquires<L: Ledger>(ledger: L) {
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
pub async fn sequential_duplicate_returns_outcome<L: Ledger>(ledger: L) {
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
pub async fn release_then_claim_acquires<L: Ledger>(ledger: L) {
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
pub async fn expired_lease_is_taken_over<L: Ledger>(ledger: L) {
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

/// Complete, renew and release with a stale fence fail with `LeaseLost` and
/// leave the record as the new holder has it.
pub async fn stale_fence_is_rejected<L: Ledger>(ledger: L) {
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
pub async fn renew_extends_the_lease<L: Ledger>(ledger: L) {
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
pub async fn fingerprint_mismatch_changes_nothing<L: Ledger>(ledger: L) {
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

/// The same subject under two tenants, and under two kinds, are four
/// independent effects.
pub async fn tenants_and_kinds_are_independent<L: Ledger>(ledger: L) {
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
pub async fn awkward_keys_round_trip<L: Ledger>(ledger: L) {
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
pub async fn invalid_input_is_rejected<L: Ledger>(ledger: L) {
    let t = fresh_tenant();
    for bad in ["", "a\0b", "line\nbreak", " lead"] {
        assert!(
            matches!(EffectKey::new(&t, "capture", bad), Err(Error::InvalidKey { .. })),
            "{bad:?}"
        );
    }
    assert!(EffectKey::new(&t, "cap:ture", "x").is_err());
    assert!(EffectKey::new(&t, "capture", "x".repeat(crate::MAX_KEY_BYTES)).is_err());
    let k = key(&t, "capture", "order-9");
    let e = ledger.claim(&k, &opts().lease(Duration::ZERO)).await.unwrap_err();
    assert!(e.is_invalid_input(), "{e:?}");
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
pub async fn outcome_size_limit<L: Ledger>(ledger: L) {
    let t = fresh_tenant();
    let max = ledger.capabilities().max_outcome_bytes;
    assert!(max <= crate::MAX_OUTCOME_BYTES);
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
pub async fn prune_keeps_what_it_must<L: Ledger>(ledger: L) {
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

/// Calls `prune` until `key` is gone (other tests prune the same table
/// concurrently, and a backend may prune in batches).
pub async fn prune_until_gone<L: Ledger>(ledger: &L, key: &EffectKey) {
    for _ in 0..100 {
        ledger.prune(u64::MAX).await.unwrap();
        if ledger.get(key).await.unwrap().is_none() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{key} was never pruned");
}

/// The horizon is what the ledger pruned, not the retention a claimant
/// passes: an old first delivery of a never-pruned kind is new work, and a
/// replay of a pruned effect fails with `BeyondHorizon` even when it claims
/// with a longer retention than the record had (a configuration change).
pub async fn beyond_horizon_is_detected<L: Ledger>(ledger: L) {
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
pub async fn out_of_range_times_are_refused<L: Ledger>(ledger: L) {
    let t = fresh_tenant();
    let k = key(&t, "capture", "time-travel");
    let effects = Effects::new(&ledger);
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
pub async fn fences_never_repeat_after_prune<L: Ledger>(ledger: L) {
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
pub async fn at_most_once_is_abandoned_not_rerun<L: Ledger>(ledger: L) {
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
    let t = fresh_tenant();
    let mut rng = Rng::from_env("cancellation_is_safe");
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
                matches!(r.state, RecordState::InProgress | RecordState::Completed),
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

/// `Effects::run` twice in a row: the effect happens once and the second
/// call returns the first outcome.
pub async fn run_sequential_duplicate_runs_once<L: Ledger>(ledger: L) {
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
pub async fn run_failures_follow_policy<L: Ledger>(ledger: L) {
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
pub async fn run_never_starts_on_an_expired_lease<L: Ledger>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "late-grant");
    let lease = Duration::from_millis(400);
    let slow = Effects::new(Faulty::new(&ledger).claim_delay(Duration::from_millis(500)));
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
    let v: u32 = Effects::new(&ledger)
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
    let lease = SHORT_LEASE;
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
                tokio::time::sleep(lease * 5).await;
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
pub async fn run_at_most_once_unstorable_outcome_is_not_repeated<L: Ledger>(ledger: L) {
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

/// The process-wide metrics recorder of a conformance test binary
/// (`metrics-util`'s debugging recorder), installed on first use.
pub fn metrics_snapshotter() -> &'static metrics_util::debugging::Snapshotter {
    static SNAPSHOTTER: OnceLock<metrics_util::debugging::Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("a conformance test binary installs no other global metrics recorder");
        snapshotter
    })
}

/// The sum of the counters named `name` whose labels include all of
/// `labels`, since [`metrics_snapshotter`] was first called. (The debugging
/// recorder drains counters on every snapshot; the totals are kept here.)
pub fn counter(name: &str, labels: &[(&str, &str)]) -> u64 {
    static TOTALS: std::sync::Mutex<Vec<(metrics_util::CompositeKey, u64)>> =
        std::sync::Mutex::new(Vec::new());
    let mut totals = TOTALS.lock().unwrap_or_else(|p| p.into_inner());
    for (k, _, _, v) in metrics_snapshotter().snapshot().into_vec() {
        let metrics_util::debugging::DebugValue::Counter(c) = v else {
            continue;
        };
        match totals.iter_mut().find(|(seen, _)| *seen == k) {
            Some((_, total)) => *total += c,
            None => totals.push((k, c)),
        }
    }
    totals
        .iter()
        .filter(|(k, _)| {
            k.key().name() == name
                && labels
                    .iter()
                    .all(|(l, v)| k.key().labels().any(|x| x.key() == *l && x.value() == *v))
        })
        .map(|(_, c)| c)
        .sum()
}

/// Telemetry is recorded once per claim, by the runner: a scripted run gives
/// exactly the documented counts (a backend that records its own would
/// double them).
pub async fn telemetry_counts_each_claim_once<L: Ledger>(ledger: L) {
    metrics_snapshotter();
    let t = fresh_tenant();
    // The kind is a metric label: one no other test uses isolates the counts.
    let kind = format!("tm{}", t.as_str().replace(['.', '@', '+'], "-"));
    let k = |s: &str| key(&t, &kind, s);
    let effects = Effects::new(&ledger);
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

/// Transactional suite: a claim that waited on a lock held by another
/// transaction gets a lease measured from after the wait. A holds the key in
/// an open transaction; B's claim blocks on it; A rolls back after longer
/// than the lease; B acquires, and C, claiming at once, finds B's lease live.
pub async fn claim_after_a_lock_wait_gets_a_live_lease<L>(ledger: L)
where
    L: TransactionalLedger + Clone + 'static,
{
    let k = key(&fresh_tenant(), "capture", "waited");
    let lease = Duration::from_secs(1);
    let mut tx = ledger.begin().await.unwrap();
    acquired(ledger.claim_in(&mut *tx, &k, &opts().lease(lease)).await.unwrap());
    let b = {
        let (ledger, k) = (ledger.clone(), k.clone());
        tokio::spawn(async move { ledger.claim(&k, &opts().lease(lease)).await })
    };
    tokio::time::sleep(lease * 5 / 2).await;
    assert!(!b.is_finished(), "B did not wait for A's transaction");
    ledger.rollback(tx).await.unwrap();
    let b = acquired(b.await.unwrap().unwrap());
    assert!(
        !needs_refresh(&b, lease),
        "B's lease had ended before it was granted: {b:?}"
    );
    match ledger.claim(&k, &opts()).await.unwrap() {
        Claim::InProgress { fence, .. } => assert_eq!(fence, b.fence),
        other => panic!("B was granted a lease that had already ended: C got {other:?}"),
    }
}

/// Transactional suite: inside a long transaction, a claim's lease is
/// measured on the clock of the claim, not the transaction's start.
pub async fn claim_in_late_in_a_transaction_gets_a_live_lease<L>(ledger: L)
where
    L: TransactionalLedger + Clone + 'static,
{
    let k = key(&fresh_tenant(), "capture", "late-in-tx");
    let lease = Duration::from_millis(1500);
    let mut tx = ledger.begin().await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let l = acquired(ledger.claim_in(&mut *tx, &k, &opts().lease(lease)).await.unwrap());
    assert!(
        !needs_refresh(&l, lease),
        "the lease was measured from the transaction's start: {l:?}"
    );
    ledger.commit(tx).await.unwrap();
    match ledger.claim(&k, &opts()).await.unwrap() {
        Claim::InProgress { fence, .. } => assert_eq!(fence, l.fence),
        other => panic!("the claim's lease had ended at commit: {other:?}"),
    }
}

/// A ledger that misbehaves on purpose around a real one, so the runner's
/// rules can be checked on every backend: it answers claims late (a slow
/// round trip) and fails renewals (a backend that blips).
#[derive(Debug, Clone)]
pub struct Faulty<L> {
    inner: L,
    claim_delay: Duration,
    renew_failures: Arc<AtomicU64>,
    renewals_failed: Arc<AtomicU64>,
}

impl<L: Ledger> Faulty<L> {
    /// Passes everything through to `inner`.
    pub fn new(inner: L) -> Self {
        Faulty {
            inner,
            claim_delay: Duration::ZERO,
            renew_failures: Arc::new(AtomicU64::new(0)),
            renewals_failed: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Delivers every claim's answer `delay` after the backend gave it.
    pub fn claim_delay(mut self, delay: Duration) -> Self {
        self.claim_delay = delay;
        self
    }

    /// Fails the next `n` renewals with `Error::Unavailable` (`u64::MAX`:
    /// all of them).
    pub fn fail_renewals(self, n: u64) -> Self {
        self.renew_failures.store(n, Ordering::SeqCst);
        self
    }

    /// How many renewals were failed on purpose.
    pub fn renewals_failed(&self) -> u64 {
        self.renewals_failed.load(Ordering::SeqCst)
    }
}

impl<L: Ledger> Ledger for Faulty<L> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        let claim = self.inner.claim(key, opts).await;
        tokio::time::sleep(self.claim_delay).await;
        claim
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        self.inner.complete(lease, outcome).await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.inner.release(lease).await
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        let fail = self
            .renew_failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| match n {
                0 => None,
                u64::MAX => Some(u64::MAX),
                n => Some(n - 1),
            })
            .is_ok();
        if fail {
            self.renewals_failed.fetch_add(1, Ordering::SeqCst);
            return Err(Error::Unavailable {
                backend: self.inner.backend(),
                message: "renewal failed on purpose (conformance::Faulty)".into(),
            });
        }
        self.inner.renew(lease, extend_by).await
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        self.inner.get(key).await
    }

    async fn prune(&self, limit: u64) -> Result<u64> {
        self.inner.prune(limit).await
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        self.inner.abandoned(tenant, limit).await
    }

    async fn horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
        self.inner.horizon(tenant, kind).await
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
            if ledger.get(&k).await.unwrap().is_none() {
                performed.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
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

/// Runs `iters` calls of `op` spread over `tasks` tokio tasks and returns the
/// wall time: the shared driver of every backend's `benches/claim.rs`, so the
/// library and its hand-written baseline are timed the same way.
pub async fn spread<F, Fut>(iters: u64, tasks: u64, op: F) -> Duration
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let tasks = tasks.max(1);
    let op = Arc::new(op);
    let start = std::time::Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|i| {
            let op = op.clone();
            let n = iters / tasks + u64::from(i < iters % tasks);
            tokio::spawn(async move {
                for _ in 0..n {
                    op().await;
                }
            })
        })
        .collect();
    for h in handles {
        h.await.expect("benchmark task panicked");
    }
    start.elapsed()
}

/// Generates one `#[tokio::test]` per conformance function, each calling
/// `$make().await` (an `async fn() -> Option<L>`; `None` skips).
#[macro_export]
macro_rules! conformance_tests {
    ($make:path) => {
        $crate::conformance_tests!(@each $make;
            first_claim_acquires,
            sequential_duplicate_returns_outcome,
            concurrent_claims_one_winner,
            release_then_claim_acquires,
            expired_lease_is_taken_over,
            stale_fence_is_rejected,
            renew_extends_the_lease,
            fingerprint_mismatch_changes_nothing,
            tenants_and_kinds_are_independent,
            awkward_keys_round_trip,
            invalid_input_is_rejected,
            outcome_size_limit,
            prune_keeps_what_it_must,
            beyond_horizon_is_detected,
            out_of_range_times_are_refused,
            fences_never_repeat_after_prune,
            at_most_once_is_abandoned_not_rerun,
            cancellation_is_safe,
            run_sequential_duplicate_runs_once,
            run_concurrent_deliveries_run_once,
            run_in_progress_is_rejected_not_skipped,
            run_failures_follow_policy,
            run_never_starts_on_an_expired_lease,
            renewal_survives_a_transient_failure,
            handler_learns_its_lease_is_lost,
            run_at_most_once_unstorable_outcome_is_not_repeated,
            telemetry_counts_each_claim_once,
            naive_guard_double_applies,
        );
    };
    (@each $make:path; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                if let Some(ledger) = $make().await {
                    $crate::conformance::$name(ledger).await;
                }
            }
        )*
    };
}

/// Generates the transactional suite for a [`TransactionalLedger`]: one
/// `#[tokio::test]` per function, each calling `$make().await` (an
/// `async fn() -> Option<L>`; `None` skips). Run it next to
/// [`conformance_tests!`].
#[macro_export]
macro_rules! transactional_conformance_tests {
    ($make:path) => {
        $crate::conformance_tests!(@each $make;
            claim_after_a_lock_wait_gets_a_live_lease,
            claim_in_late_in_a_transaction_gets_a_live_lease,
        );
    };
}

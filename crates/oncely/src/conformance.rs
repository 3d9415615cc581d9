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
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use crate::{
    Claim, ClaimOptions, EffectKey, Effects, Error, Failure, Fingerprint, Ledger, OnInProgress, Outcome,
    RecordState, Tenant,
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

/// The first claim of a key acquires fence 1 and the record is in progress.
pub async fn first_claim_acquires<L: Ledger>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "order-1");
    assert!(ledger.get(&k).await.unwrap().is_none());
    let lease = acquired(ledger.claim(&k, &opts()).await.unwrap());
    assert_eq!(lease.fence, 1);
    assert!(!lease.taken_over);
    assert!(lease.expires_at > lease.acquired_at);
    let r = ledger.get(&k).await.unwrap().expect("record exists after claim");
    assert_eq!(r.state, RecordState::InProgress);
    assert_eq!(r.fence, 1);
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
                assert_eq!(r.fence, 1);
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
        let (mut won, mut busy) = (0, 0);
        for t in tasks {
            match t.await.unwrap() {
                Claim::Acquired(l) => {
                    assert_eq!(l.fence, 1);
                    won += 1
                }
                Claim::InProgress { fence, .. } => {
                    assert_eq!(fence, 1);
                    busy += 1
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(won, 1, "exactly one of {RACERS} claimants must acquire");
        assert_eq!(busy, RACERS - 1);
    }
}

/// A released key is acquired again by the next claim, at `fence + 1`.
pub async fn release_then_claim_acquires<L: Ledger>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "order-3");
    let l1 = acquired(ledger.claim(&k, &opts()).await.unwrap());
    ledger.release(&l1).await.unwrap();
    assert_eq!(
        ledger.get(&k).await.unwrap().unwrap().state,
        RecordState::Released
    );
    let l2 = acquired(ledger.claim(&k, &opts()).await.unwrap());
    assert_eq!(l2.fence, 2, "a fence is never reused");
    assert!(l2.taken_over);
    // The first holder cannot release or complete the second holder's claim.
    assert!(ledger.release(&l1).await.unwrap_err().is_lease_lost());
}

/// An expired lease is taken over with `fence + 1`; a live one is not.
pub async fn expired_lease_is_taken_over<L: Ledger>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "order-4");
    let short = opts().lease(SHORT_LEASE);
    let l1 = acquired(ledger.claim(&k, &short).await.unwrap());
    assert!(matches!(
        ledger.claim(&k, &short).await.unwrap(),
        Claim::InProgress { fence: 1, .. }
    ));
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    let l2 = acquired(ledger.claim(&k, &short).await.unwrap());
    assert_eq!(l2.fence, l1.fence + 1);
    assert!(l2.taken_over);
    assert_eq!(l2.first_claimed_at, l1.first_claimed_at);
    assert_eq!(ledger.get(&k).await.unwrap().unwrap().fence, 2);
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
    assert!(matches!(e, Error::LeaseLost { fence: 1, .. }), "{e:?}");
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
    assert_eq!(after.fence, 2);
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
        Claim::InProgress { fence: 1, .. }
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
    let n = ledger.prune(u64::MAX).await.unwrap();
    assert!(n >= 2, "pruned {n}");
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

/// A message older than the retention finds its key absent: the claim fails
/// with `BeyondHorizon` and writes nothing; a recent one acquires; an old
/// one whose record still exists gets the record.
pub async fn beyond_horizon_is_detected<L: Ledger>(ledger: L) {
    let t = fresh_tenant();
    let day = Duration::from_secs(86_400);
    let o = opts().retention(day);
    let old = SystemTime::now() - 2 * day;
    let k = key(&t, "capture", "late-replay");
    let e = ledger.claim(&k, &o.clone().sent_at(old)).await.unwrap_err();
    assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
    assert!(ledger.get(&k).await.unwrap().is_none());
    let fresh = key(&t, "capture", "fresh");
    let l = acquired(
        ledger
            .claim(&fresh, &o.clone().sent_at(SystemTime::now()))
            .await
            .unwrap(),
    );
    ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    assert!(matches!(
        ledger.claim(&fresh, &o.sent_at(old)).await.unwrap(),
        Claim::Completed(_)
    ));
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
    assert_eq!(r.fence, 1, "an abandoned step is not taken over");
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
            assert_eq!(r.fence, 1);
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
    assert_eq!(outcomes, vec!["charge-0-1".to_owned(), "charge-0-1".to_owned()]);
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
    let e = effects
        .run::<u32, _, _>(&k, &opts(), |_| async {
            Err(Failure::retryable("provider timed out"))
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Handler(_)) && e.is_retryable(), "{e:?}");
    let v: u32 = effects
        .run(&k, &opts(), |l| async move { Ok(l.fence as u32) })
        .await
        .unwrap();
    assert_eq!(v, 2, "the retry ran under a new fence");

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
            at_most_once_is_abandoned_not_rerun,
            cancellation_is_safe,
            run_sequential_duplicate_runs_once,
            run_concurrent_deliveries_run_once,
            run_in_progress_is_rejected_not_skipped,
            run_failures_follow_policy,
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

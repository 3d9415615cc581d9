//! A model of the ledger contract (the `Ledger` trait's doc comment), and a
//! runner that applies a random sequence of operations by several claimants
//! to a real ledger and to the model, comparing every answer.
//!
//! Run by `crates/oncely/tests/ledger_model.rs` (memory ledger) and
//! `examples/payment-job/tests/ledger_model.rs` (SQLite, PostgreSQL); any
//! backend can run it on itself with [`check`] and a proptest of [`ops`].
//!
//! Time is made deterministic without faking any clock: every claim takes a
//! long lease (60 s) that never runs out by itself; `Expire` shortens the
//! current lease to 1 ms with a fenced `renew` and then sleeps past it, and
//! `ShortLived` claims and completes with a 20 ms retention and sleeps past
//! it. So whether a lease has expired or a record may be pruned is known
//! exactly, on whatever clock the backend uses.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;

use super::fresh_tenant;
use crate::ledger::Ledger;
use crate::record::{Claim, Fingerprint, Lease, Outcome, RecordState};
use crate::{ClaimOptions, EffectKey, Error};

/// How many claimants a scenario has.
pub const CLAIMANTS: u8 = 3;
/// How many keys a scenario touches.
pub const KEYS: u8 = 3;
const LONG: Duration = Duration::from_secs(60);
const RETAIN: Duration = Duration::from_secs(3600);
const SHORT: Duration = Duration::from_millis(20);

/// One step of a scenario. `who` is a claimant (below [`CLAIMANTS`]), `key`
/// a key of the scenario (below [`KEYS`]).
#[derive(Debug, Clone)]
#[allow(missing_docs)] // the fields are named by each variant's doc
// Exhaustive by design (ARCHITECTURE.md, API boundaries): each step must be modelled.
pub enum Op {
    /// `who` claims `key`, at-most-once or not, with the key's usual payload
    /// fingerprint or an altered one.
    Claim {
        who: u8,
        key: u8,
        amo: bool,
        altered: bool,
    },
    /// `who` completes its latest lease on `key` (stale or not).
    Complete { who: u8, key: u8 },
    /// `who` releases its latest lease on `key`.
    Release { who: u8, key: u8 },
    /// `who` renews its latest lease on `key`.
    Renew { who: u8, key: u8 },
    /// The current lease on `key` runs out (if there is one).
    Expire { key: u8 },
    /// Reads `key`.
    Get { key: u8 },
    /// Prunes up to `limit` records.
    Prune { limit: u8 },
    /// Lists the tenant's abandoned steps.
    ListAbandoned,
    /// Claims `key` with a 20 ms retention, completes it if acquired, and
    /// waits until the retention is over.
    ShortLived { key: u8 },
}

/// One random step.
pub fn op() -> impl Strategy<Value = Op> {
    let who = 0..CLAIMANTS;
    let key = || 0..KEYS;
    prop_oneof![
        5 => (who.clone(), key(), any::<bool>(), prop::bool::weighted(0.1))
            .prop_map(|(who, key, amo, altered)| Op::Claim { who, key, amo, altered }),
        3 => (who.clone(), key()).prop_map(|(who, key)| Op::Complete { who, key }),
        2 => (who.clone(), key()).prop_map(|(who, key)| Op::Release { who, key }),
        1 => (who, key()).prop_map(|(who, key)| Op::Renew { who, key }),
        2 => key().prop_map(|key| Op::Expire { key }),
        2 => key().prop_map(|key| Op::Get { key }),
        1 => (1u8..5).prop_map(|limit| Op::Prune { limit }),
        1 => Just(Op::ListAbandoned),
        1 => key().prop_map(|key| Op::ShortLived { key }),
    ]
}

/// A scenario of 1 to `max - 1` random steps.
pub fn ops(max: usize) -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..max)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    InProgress { expired: bool },
    Completed,
    Released,
}

#[derive(Debug, Clone)]
struct Rec {
    st: St,
    fence: u64,
    amo: bool,
    altered_fp: bool,
    outcome: Option<Vec<u8>>,
    prunable: bool,
}

impl Rec {
    fn reported(&self) -> RecordState {
        match self.st {
            St::InProgress { expired: true } if self.amo => RecordState::Abandoned,
            St::InProgress { .. } => RecordState::InProgress,
            St::Completed => RecordState::Completed,
            St::Released => RecordState::Released,
        }
    }

    fn holds(&self, fence: u64) -> bool {
        matches!(self.st, St::InProgress { .. }) && self.fence == fence
    }
}

fn fp(key: u8, altered: bool) -> Fingerprint {
    Fingerprint::of_bytes(format!("payload-{key}-{altered}").as_bytes())
}

/// Applies `ops` to `ledger` and to the model; panics with the step number
/// and both answers at the first disagreement.
///
/// `exact_prune`: whether this run has the ledger to itself, so prune's count
/// can be predicted (on a shared database other tests' records count too).
pub async fn check<L: Ledger + 'static>(ledger: &L, ops: &[Op], exact_prune: bool) {
    let tenant = fresh_tenant();
    let keys: Vec<EffectKey> = (0..KEYS)
        .map(|k| EffectKey::new(&tenant, "step", format!("order-{k}")).unwrap())
        .collect();
    let mut recs: Vec<Option<Rec>> = vec![None; KEYS as usize];
    // The highest fence each key ever had: a new grant must exceed it, even
    // after the key's record was pruned.
    let mut ever = vec![0u64; KEYS as usize];
    let mut leases: HashMap<(u8, u8), Lease> = HashMap::new();
    let base = ClaimOptions::default().lease(LONG).retention(RETAIN);

    for (i, op) in ops.iter().enumerate() {
        let at = format!("step {i} {op:?}");
        match *op {
            Op::Claim {
                who,
                key,
                amo,
                altered,
            } => {
                let opts = base.clone().at_most_once(amo).fingerprint(fp(key, altered));
                let got = ledger.claim(&keys[key as usize], &opts).await;
                let rec = &mut recs[key as usize];
                if let Some(lease) = apply_claim(rec, &mut ever[key as usize], got, amo, altered, &at) {
                    leases.insert((who, key), lease);
                }
            }
            Op::Complete { who, key } | Op::Release { who, key } | Op::Renew { who, key } => {
                let Some(lease) = leases.get(&(who, key)).cloned() else {
                    continue;
                };
                let rec = recs[key as usize].as_mut().expect("a lease implies a record");
                let holds = rec.holds(lease.fence());
                let res = match op {
                    Op::Complete { .. } => {
                        let outcome = Outcome::from_json(&i).unwrap();
                        let r = ledger.complete(&lease, &outcome).await;
                        if r.is_ok() {
                            rec.st = St::Completed;
                            rec.outcome = Some(outcome.into_bytes());
                        }
                        r
                    }
                    Op::Release { .. } => {
                        let r = ledger.release(&lease).await;
                        if r.is_ok() {
                            rec.st = St::Released;
                        }
                        r
                    }
                    _ => match ledger.renew(&lease, LONG).await {
                        Ok(l) => {
                            assert_eq!(l.fence(), lease.fence(), "{at}: renew keeps the fence");
                            rec.st = St::InProgress { expired: false };
                            leases.insert((who, key), l);
                            Ok(())
                        }
                        Err(e) => Err(e),
                    },
                };
                match res {
                    Ok(()) => assert!(holds, "{at}: a write with a stale fence succeeded ({rec:?})"),
                    Err(Error::LeaseLost { fence, .. }) => {
                        assert!(!holds, "{at}: the holder's write was refused ({rec:?})");
                        assert_eq!(fence, lease.fence());
                    }
                    Err(e) => panic!("{at}: unexpected error {e:?}"),
                }
            }
            Op::Expire { key } => {
                let Some(rec) = recs[key as usize].as_mut() else {
                    continue;
                };
                if !matches!(rec.st, St::InProgress { .. }) {
                    continue;
                }
                let stored = ledger.get(&keys[key as usize]).await.unwrap().unwrap();
                ledger
                    .renew(&stored.reconciliation_lease(), Duration::from_millis(1))
                    .await
                    .unwrap_or_else(|e| panic!("{at}: shortening the live lease: {e:?}"));
                tokio::time::sleep(Duration::from_millis(6)).await;
                rec.st = St::InProgress { expired: true };
            }
            Op::Get { key } => {
                let got = ledger.get(&keys[key as usize]).await.unwrap();
                compare(&recs[key as usize], got.as_ref(), key, &at);
            }
            Op::Prune { limit } => {
                let n = ledger.prune(u64::from(limit)).await.unwrap();
                let prunable = recs.iter().flatten().filter(|r| r.prunable).count() as u64;
                if exact_prune {
                    assert_eq!(n, prunable.min(u64::from(limit)), "{at}: pruned count");
                }
                // Which ones went is the backend's choice; every other record
                // must be untouched.
                for k in 0..KEYS {
                    let got = ledger.get(&keys[k as usize]).await.unwrap();
                    let rec = &mut recs[k as usize];
                    if got.is_none() && rec.as_ref().is_some_and(|r| r.prunable) {
                        *rec = None;
                        leases.retain(|(_, kk), _| *kk != k);
                    }
                    compare(rec, got.as_ref(), k, &at);
                }
            }
            Op::ListAbandoned => {
                let mut got: Vec<String> = ledger
                    .abandoned(&tenant, 100)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|r| {
                        assert_eq!(r.state, RecordState::Abandoned, "{at}");
                        r.key.to_string()
                    })
                    .collect();
                got.sort();
                let want: Vec<String> = (0..KEYS)
                    .filter(|&k| {
                        recs[k as usize]
                            .as_ref()
                            .is_some_and(|r| r.reported() == RecordState::Abandoned)
                    })
                    .map(|k| keys[k as usize].to_string())
                    .collect();
                assert_eq!(got, want, "{at}: abandoned listing");
            }
            Op::ShortLived { key } => {
                let opts = ClaimOptions::default()
                    .lease(SHORT)
                    .retention(SHORT)
                    .fingerprint(fp(key, false));
                let got = ledger.claim(&keys[key as usize], &opts).await;
                let rec = &mut recs[key as usize];
                if let Some(lease) = apply_claim(rec, &mut ever[key as usize], got, false, false, &at) {
                    let outcome = Outcome::from_json(&i).unwrap();
                    // The 20 ms lease may have run out already; nobody took it
                    // over, so the completion still counts.
                    ledger
                        .complete(&lease, &outcome)
                        .await
                        .unwrap_or_else(|e| panic!("{at}: {e:?}"));
                    let r = rec.as_mut().unwrap();
                    r.st = St::Completed;
                    r.outcome = Some(outcome.into_bytes());
                    r.prunable = true;
                }
                tokio::time::sleep(SHORT + Duration::from_millis(15)).await;
            }
        }
    }
    // Finally every record agrees.
    for k in 0..KEYS {
        let got = ledger.get(&keys[k as usize]).await.unwrap();
        compare(&recs[k as usize], got.as_ref(), k, "final");
    }
}

/// Checks a claim's answer against the model and updates it; returns the
/// lease if the claim acquired.
fn apply_claim(
    rec: &mut Option<Rec>,
    ever: &mut u64,
    got: crate::Result<Claim>,
    amo: bool,
    altered: bool,
    at: &str,
) -> Option<Lease> {
    let Some(r) = rec.as_mut() else {
        let lease = match got {
            Ok(Claim::Acquired(l)) => l,
            other => panic!("{at}: absent key, expected Acquired, got {other:?}"),
        };
        assert_eq!((lease.taken_over(), lease.at_most_once()), (false, amo), "{at}");
        assert!(
            lease.fence() > *ever,
            "{at}: fence {} repeats one up to {ever}",
            lease.fence()
        );
        *ever = lease.fence();
        *rec = Some(Rec {
            st: St::InProgress { expired: false },
            fence: lease.fence(),
            amo,
            altered_fp: altered,
            outcome: None,
            prunable: false,
        });
        return Some(lease);
    };
    if r.altered_fp != altered {
        match got {
            Err(Error::FingerprintMismatch { .. }) => return None,
            other => panic!("{at}: expected FingerprintMismatch, got {other:?} ({r:?})"),
        }
    }
    let got = got.unwrap_or_else(|e| panic!("{at}: {e:?} ({r:?})"));
    match (r.st, got) {
        (St::Completed, Claim::Completed(stored)) => {
            assert_eq!(stored.fence, r.fence, "{at}");
            assert_eq!(stored.outcome.map(|o| o.into_bytes()), r.outcome, "{at}");
            None
        }
        (St::InProgress { expired: false }, Claim::InProgress { fence, .. }) => {
            assert_eq!(fence, r.fence, "{at}");
            None
        }
        (St::InProgress { expired: true }, Claim::Abandoned(stored)) if r.amo => {
            assert_eq!(stored.fence, r.fence, "{at}: an abandoned step is not taken over");
            assert_eq!(stored.state, RecordState::Abandoned, "{at}");
            None
        }
        (St::InProgress { expired: true } | St::Released, Claim::Acquired(lease))
            if !(r.amo && r.st == St::InProgress { expired: true }) =>
        {
            assert!(lease.fence() > *ever, "{at}: takeover raises the fence");
            assert!(lease.taken_over(), "{at}");
            assert_eq!(lease.at_most_once(), amo, "{at}");
            *ever = lease.fence();
            r.fence = lease.fence();
            r.st = St::InProgress { expired: false };
            r.amo = amo;
            r.prunable = false;
            r.outcome = None;
            Some(lease)
        }
        (_, other) => panic!("{at}: model {r:?}, ledger answered {other:?}"),
    }
}

fn compare(rec: &Option<Rec>, got: Option<&crate::record::Record>, key: u8, at: &str) {
    match (rec, got) {
        (None, None) => {}
        (Some(r), Some(g)) => {
            assert_eq!(g.state, r.reported(), "{at}: key {key} state ({r:?} vs {g:?})");
            assert_eq!(g.fence, r.fence, "{at}: key {key} fence");
            assert_eq!(
                g.fingerprint,
                Some(fp(key, r.altered_fp)),
                "{at}: key {key} fingerprint"
            );
            if r.st == St::Completed {
                assert_eq!(
                    g.outcome.as_ref().map(|o| o.as_bytes().to_vec()),
                    r.outcome,
                    "{at}: key {key} outcome"
                );
            }
            if matches!(r.st, St::InProgress { .. }) {
                assert_eq!(g.at_most_once, r.amo, "{at}: key {key} at-most-once flag");
                assert!(g.lease_expires_at.is_some(), "{at}: key {key} lease expiry");
            }
        }
        (r, g) => panic!("{at}: key {key}: model {r:?}, ledger {g:?}"),
    }
}

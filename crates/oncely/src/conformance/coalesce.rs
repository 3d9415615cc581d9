//! The coalescing cases: the backend's ledger wrapped in
//! [`Coalescing`](crate::backend::Coalescing), whose gathered batches must
//! answer every caller as its own call would, and whose dropped callers
//! never hold a key.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, SystemTime};

use super::{RACERS, acquired, fresh_tenant, key, opts};
use crate::backend::Coalescing;
use crate::ledger::{Capabilities, Ledger};
use crate::record::{Claim, Fingerprint, Lease, Outcome, Record, RecordState};
use crate::watch::Watch;
use crate::{ClaimOptions, EffectKey, Effects, Error, OnInProgress, Result, Tenant};

/// A ledger whose claims and completions (one or many) wait at a gate while
/// it is closed, so a case can hold a statement in flight, queue callers
/// behind it and see which batches were sent.
#[derive(Clone)]
struct Gated<L> {
    inner: L,
    closed: Arc<AtomicBool>,
    gate: Arc<tokio::sync::Semaphore>,
    entered: Arc<AtomicUsize>,
    claim_batches: Arc<Mutex<Vec<usize>>>,
    complete_batches: Arc<Mutex<Vec<usize>>>,
}

impl<L: Ledger> Gated<L> {
    fn new(inner: L) -> Self {
        Gated {
            inner,
            closed: Arc::new(AtomicBool::new(false)),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
            entered: Arc::new(AtomicUsize::new(0)),
            claim_batches: Arc::default(),
            complete_batches: Arc::default(),
        }
    }

    fn close(&self) {
        self.entered.store(0, Ordering::SeqCst);
        self.closed.store(true, Ordering::SeqCst);
        self.gate.forget_permits(usize::MAX);
    }

    /// Lets one waiting statement through.
    fn step(&self) {
        self.gate.add_permits(1);
    }

    fn open(&self) {
        self.closed.store(false, Ordering::SeqCst);
        self.gate.add_permits(1024);
    }

    async fn pass(&self) {
        self.entered.fetch_add(1, Ordering::SeqCst);
        if self.closed.load(Ordering::SeqCst) {
            self.gate.acquire().await.expect("gate never closes").forget();
        }
    }

    /// Waits until `n` statements have reached the gate since it closed.
    async fn reached(&self, n: usize) {
        for _ in 0..2000 {
            if self.entered.load(Ordering::SeqCst) >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("{n} statements never reached the gate");
    }
}

impl<L: Ledger> Ledger for Gated<L> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        self.pass().await;
        self.inner.claim(key, opts).await
    }
    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        self.pass().await;
        self.inner.complete(lease, outcome).await
    }
    fn release(&self, lease: &Lease) -> impl Future<Output = Result<()>> + Send {
        self.inner.release(lease)
    }
    fn renew(&self, lease: &Lease, extend_by: Duration) -> impl Future<Output = Result<Lease>> + Send {
        self.inner.renew(lease, extend_by)
    }
    fn get(&self, key: &EffectKey) -> impl Future<Output = Result<Option<Record>>> + Send {
        self.inner.get(key)
    }
    fn prune(&self, limit: u64) -> impl Future<Output = Result<u64>> + Send {
        self.inner.prune(limit)
    }
    fn abandoned(&self, tenant: &Tenant, limit: u64) -> impl Future<Output = Result<Vec<Record>>> + Send {
        self.inner.abandoned(tenant, limit)
    }
    fn horizon(
        &self,
        tenant: &Tenant,
        kind: &str,
    ) -> impl Future<Output = Result<Option<SystemTime>>> + Send {
        self.inner.horizon(tenant, kind)
    }
    fn watch(&self, key: &EffectKey) -> impl Future<Output = Watch> + Send {
        self.inner.watch(key)
    }
    async fn claim_many(&self, keys: &[EffectKey], opts: &ClaimOptions) -> Result<Vec<Result<Claim>>> {
        self.claim_batches.lock().unwrap().push(keys.len());
        self.pass().await;
        self.inner.claim_many(keys, opts).await
    }
    async fn complete_many(&self, items: &[(Lease, Outcome)]) -> Vec<Result<()>> {
        self.complete_batches.lock().unwrap().push(items.len());
        self.pass().await;
        self.inner.complete_many(items).await
    }
}

/// Polls `f` once: a coalesced call queues itself on its first poll.
async fn poll_once<F: Future>(f: &mut Pin<Box<F>>) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match f.as_mut().poll(cx) {
            Poll::Ready(v) => Some(v),
            Poll::Pending => None,
        })
    })
    .await
}

/// 64 concurrent claimants of one fresh key through one coalescing ledger:
/// exactly one acquires, every other finds it in progress at the winner's
/// fence (most of them answered by one gathered statement).
pub async fn coalesced_claimants_one_holder<L: Ledger + Clone + 'static>(ledger: L) {
    let ledger = Coalescing::new(ledger);
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
        assert_eq!(
            won.len(),
            1,
            "exactly one of {RACERS} coalesced claimants must acquire"
        );
        assert_eq!(busy.len(), RACERS - 1);
        assert!(
            busy.iter().all(|f| *f == won[0]),
            "every loser saw the winner's fence"
        );
    }
}

/// `Effects::run` on a coalescing ledger, 64 concurrent deliveries of one
/// message under `Wait`: the handler runs once and every delivery gets its
/// outcome (claims and completions gathered underneath).
pub async fn coalesced_runs_run_once<L: Ledger + Clone + 'static>(ledger: L) {
    let effects = Arc::new(Effects::new(Coalescing::new(ledger)));
    let k = key(&fresh_tenant(), "capture", "order-coalesced");
    let performed = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
    let mut tasks = Vec::new();
    for worker in 0..RACERS {
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

/// Callers queued behind a statement in flight are sent as one batch (one
/// per set of equal options) of mixed tenants and keys, and each gets what
/// its own call, made in queue order, would have: a fresh key acquires, a
/// completed one answers its outcome, a live lease is in progress, a key
/// queued twice is acquired once and found in progress at that fence, a
/// mismatched fingerprint fails alone. Completions likewise: each fenced by
/// its own lease, a stale one and a repeated one lost.
pub async fn coalesced_batch_answers_each_slot<L: Ledger + Clone + 'static>(ledger: L) {
    let gated = Gated::new(ledger);
    let ledger = Coalescing::new(gated.clone());
    let (t1, t2) = (fresh_tenant(), fresh_tenant());
    let o = |s: &str| Outcome::from_json(&s).unwrap();
    let done = acquired(ledger.claim(&key(&t1, "capture", "done"), &opts()).await.unwrap());
    ledger.complete(&done, &o("done")).await.unwrap();
    let live = acquired(ledger.claim(&key(&t2, "capture", "live"), &opts()).await.unwrap());
    let fp = opts().fingerprint(Fingerprint::of_bytes(b"first payload"));
    acquired(ledger.claim(&key(&t2, "capture", "fp"), &fp).await.unwrap());

    gated.close();
    let blocker = key(&t1, "capture", "blocker");
    let default = opts();
    let mut first = Box::pin(ledger.claim(&blocker, &default));
    assert!(poll_once(&mut first).await.is_none());
    gated.reached(1).await;
    let other = opts().fingerprint(Fingerprint::of_bytes(b"another payload"));
    let queued = [
        (key(&t1, "capture", "fresh"), opts()),
        (key(&t2, "capture", "fresh"), opts()),
        (key(&t1, "capture", "done"), opts()),
        (key(&t2, "capture", "fp"), other),
        (key(&t2, "capture", "live"), opts()),
        (key(&t1, "capture", "fresh"), opts()),
        (key(&t1, "refund", "fresh"), opts()),
    ];
    let mut calls: Vec<_> = queued.iter().map(|(k, o)| Box::pin(ledger.claim(k, o))).collect();
    for c in &mut calls {
        assert!(poll_once(c).await.is_none(), "a call behind one in flight waits");
    }
    gated.open();
    let blocker_lease = acquired(first.await.unwrap());
    let mut answers = Vec::new();
    for c in calls {
        answers.push(c.await);
    }
    assert_eq!(
        *gated.claim_batches.lock().unwrap(),
        [6, 1],
        "the queue went out as one batch per set of options"
    );
    let mut answers = answers.into_iter();
    let mut next = || answers.next().unwrap();
    let fresh1 = match next() {
        Ok(Claim::Acquired(l)) if !l.taken_over() => l,
        other => panic!("t1 fresh: {other:?}"),
    };
    let fresh2 = match next() {
        Ok(Claim::Acquired(l)) if !l.taken_over() => l,
        other => panic!("t2 fresh (another tenant, same kind and subject): {other:?}"),
    };
    assert!(
        matches!(next(), Ok(Claim::Completed(r)) if r.fence == done.fence() && r.outcome == Some(o("done"))),
        "completed key"
    );
    assert!(
        matches!(next(), Err(Error::FingerprintMismatch { .. })),
        "another payload"
    );
    assert!(
        matches!(next(), Ok(Claim::InProgress { fence, .. }) if fence == live.fence()),
        "live lease"
    );
    assert!(
        matches!(next(), Ok(Claim::InProgress { fence, .. }) if fence == fresh1.fence()),
        "a key queued twice"
    );
    let refund = match next() {
        Ok(Claim::Acquired(l)) => l,
        other => panic!("t1 refund (another kind): {other:?}"),
    };

    // Completions queued behind one in flight: one batch, fenced per lease.
    gated.close();
    let blocker_outcome = o("blocker");
    let mut first = Box::pin(ledger.complete(&blocker_lease, &blocker_outcome));
    assert!(poll_once(&mut first).await.is_none());
    gated.reached(1).await;
    let items = [
        (fresh1.clone(), o("fresh1")),
        (done.clone(), o("stale")),
        (fresh2.clone(), o("fresh2")),
        (fresh1.clone(), o("again")),
        (refund.clone(), o("refund")),
    ];
    let mut calls: Vec<_> = items
        .iter()
        .map(|(l, o)| Box::pin(ledger.complete(l, o)))
        .collect();
    for c in &mut calls {
        assert!(
            poll_once(c).await.is_none(),
            "a completion behind one in flight waits"
        );
    }
    gated.open();
    first.await.unwrap();
    let mut answers = Vec::new();
    for c in calls {
        answers.push(c.await);
    }
    assert_eq!(*gated.complete_batches.lock().unwrap(), [5], "one batch");
    assert!(answers[0].is_ok(), "{answers:?}");
    assert!(
        answers[1].as_ref().is_err_and(Error::is_lease_lost),
        "stale: {answers:?}"
    );
    assert!(answers[2].is_ok(), "{answers:?}");
    assert!(
        answers[3].as_ref().is_err_and(Error::is_lease_lost),
        "completed twice: {answers:?}"
    );
    assert!(answers[4].is_ok(), "{answers:?}");
    for (l, want) in [
        (&fresh1, "fresh1"),
        (&fresh2, "fresh2"),
        (&refund, "refund"),
        (&done, "done"),
    ] {
        let r = ledger.get(l.key()).await.unwrap().unwrap();
        assert_eq!(
            (r.state, r.outcome),
            (RecordState::Completed, Some(o(want))),
            "{}",
            l.key()
        );
    }
}

/// `Effects::new` gathers its tasks' claims exactly where the backend says
/// it should ([`Capabilities::coalescing`]): with a claim held in flight,
/// 8 more deliveries of fresh keys go out as one `claim_many` on a backend
/// that coalesces, and each as its own claim on one that does not; and
/// `Effects::coalescing` turns it the other way.
pub async fn effects_coalesce_as_the_backend_says<L: Ledger + Clone + 'static>(ledger: L) {
    let default = ledger.capabilities().coalescing;
    let t = fresh_tenant();
    for (round, on) in [(0, None), (1, Some(!default))] {
        let gated = Gated::new(ledger.clone());
        let effects = match on {
            None => Effects::new(gated.clone()),
            Some(on) => Effects::new(gated.clone()).coalescing(on),
        };
        gated.close();
        let run = |i: usize| {
            let (effects, k) = (effects.clone(), key(&t, "capture", &format!("r{round}-{i}")));
            tokio::spawn(async move { effects.run(&k, &opts(), |_| async { Ok(1_u8) }).await })
        };
        let first = run(0);
        gated.reached(1).await;
        let rest: Vec<_> = (1..=8).map(run).collect();
        // Time for the 8 to reach the ledger (queued, or at the gate).
        tokio::time::sleep(Duration::from_millis(200)).await;
        gated.open();
        first.await.unwrap().unwrap();
        for r in rest {
            r.await.unwrap().unwrap();
        }
        let batched = !gated.claim_batches.lock().unwrap().is_empty();
        assert_eq!(
            batched,
            on.unwrap_or(default),
            "round {round}: claims gathered {batched}, the backend's default is {default}"
        );
    }
}

/// A caller dropped while its batch is in flight: the batch still runs for
/// the others (their answers unaffected), and the lease granted to the
/// dropped caller is released at once, so its key is claimable right after
/// (taken over from the released record, long before the lease would end).
/// A caller dropped before its batch was sent is never claimed at all.
pub async fn coalesced_dropped_caller_leaves_no_lease<L: Ledger + Clone + 'static>(ledger: L) {
    let gated = Gated::new(ledger);
    let ledger = Coalescing::new(gated.clone());
    let t = fresh_tenant();
    let long = opts().lease(Duration::from_secs(300));
    let (ka, kb, kc, kd) = (
        key(&t, "capture", "a"),
        key(&t, "capture", "b"),
        key(&t, "capture", "c"),
        key(&t, "capture", "d"),
    );
    gated.close();
    let mut a = Box::pin(ledger.claim(&ka, &long));
    assert!(poll_once(&mut a).await.is_none());
    gated.reached(1).await;
    let mut b = Box::pin(ledger.claim(&kb, &long));
    let mut c = Box::pin(ledger.claim(&kc, &long));
    let mut d = Box::pin(ledger.claim(&kd, &long));
    assert!(poll_once(&mut b).await.is_none());
    assert!(poll_once(&mut c).await.is_none());
    assert!(poll_once(&mut d).await.is_none());
    drop(d);
    gated.step();
    let la = acquired(a.await.unwrap());
    // The queue's statement is in flight now: drop one of its callers.
    gated.reached(2).await;
    drop(b);
    gated.open();
    let lc = acquired(c.await.unwrap());
    assert_eq!(
        *gated.claim_batches.lock().unwrap(),
        [2],
        "b and c in one batch, d left out"
    );

    let again = ledger.claim(&kb, &long).await.unwrap();
    match &again {
        Claim::Acquired(l) => assert!(l.taken_over(), "b was claimed, then released: {again:?}"),
        other => panic!("the dropped caller's key is still held: {other:?}"),
    }
    assert_eq!(
        ledger.get(&kd).await.unwrap(),
        None,
        "a caller dropped before its batch was sent is not claimed"
    );
    for l in [&la, &lc] {
        let r = ledger.get(l.key()).await.unwrap().unwrap();
        assert_eq!(
            (r.state, r.fence),
            (RecordState::InProgress, l.fence()),
            "{}",
            l.key()
        );
        ledger
            .complete(l, &Outcome::from_json(&()).unwrap())
            .await
            .unwrap();
    }
}

/// Claims and completions through a coalescing ledger aborted at random
/// points never lose a committed result and leave it working
/// ([`cancellation_is_safe`](super::cancellation_is_safe), coalesced); an
/// aborted claimant's key may also be left released: its grant given back.
pub async fn coalesced_cancellation_is_safe<L: Ledger + Clone + 'static>(ledger: L) {
    super::ledger::cancellation_case(Coalescing::new(ledger), "coalesced_cancellation_is_safe", true).await;
}

//! Coalescing: concurrent claims and completions on one ledger gathered
//! into `claim_many` / `complete_many` statements.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::key::{EffectKey, Tenant};
use crate::ledger::{Capabilities, Ledger, TransactionalLedger};
use crate::record::{Claim, ClaimOptions, Lease, Outcome, Record};
use crate::slots::fail_each;
use crate::watch::Watch;

/// The most calls one gathered statement carries, unless
/// [`Coalescing::with_limits`] says otherwise.
pub const DEFAULT_MAX_BATCH: usize = 128;

/// How many claim statements (and completion statements) one coalescing
/// ledger keeps in flight before later calls queue, unless
/// [`Coalescing::with_limits`] says otherwise.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1;

/// A [`Ledger`] that gathers the concurrent [`claim`](Ledger::claim) and
/// [`complete`](Ledger::complete) calls of many tasks into one
/// [`claim_many`](Ledger::claim_many) or
/// [`complete_many`](Ledger::complete_many) of its inner ledger: one
/// statement, one round trip and one commit for many callers.
///
/// **How.** A call with nothing in flight goes straight to the inner
/// ledger, in the caller's own task: a lone, sequential caller pays nothing
/// (no extra task, no wait, two uncontended lock operations). While a claim
/// statement is in flight (or `max_in_flight` of them,
/// [`Coalescing::with_limits`]), later claims queue; when it returns, the
/// queue is sent as one `claim_many` (at most `max_batch` calls, only calls
/// with equal [`ClaimOptions`] share one), and so on until the queue is
/// empty. Completions queue behind completions the same way, and
/// independently of claims. So the gathering lasts exactly as long as the
/// previous statement: no timer, no added latency when the ledger is idle.
///
/// **Answers.** Each caller gets its own answer, the one the same call made
/// on its own would get: the inner batch answers per slot (a key listed by
/// two callers follows [`claim_many`](Ledger::claim_many)'s rule: the first
/// acquires, the second finds it in progress), and a failure of the whole
/// statement is every slot's error ([`fail_each`]).
///
/// **Cancellation.** A queued batch runs in a task of its own and to
/// completion, whoever is dropped meanwhile: dropping a caller never cancels
/// a statement other callers are waiting on. A claimant dropped before its
/// answer reached it never holds the key idle until its lease ends: a grant
/// made for it is released at once (the inner
/// [`release`](Ledger::release)), before the next statement is sent, so the
/// key is free for the next claim through this ledger. A caller dropped
/// while its claim was sent straight to the inner ledger (nothing was in
/// flight) is exactly the inner ledger's dropped claim. A dropped
/// completion completed or not, as the inner ledger's would have.
///
/// **When to wrap.** Many tasks sharing one ledger in one process (a
/// consumer with concurrency, a server's request handlers), on a backend
/// where a statement's round trip and commit cost more than its rows. On
/// PostgreSQL, 32 tasks delivering 5,000 jobs twice each (`Effects::run`,
/// `Wait`) ran a little over twice the deliveries per second through it,
/// and one statement in flight measured faster than two or four; one
/// sequential caller ran as fast as unwrapped. [`Effects`](crate::Effects)
/// wraps its ledger in one (shared by its clones) unless
/// [`Effects::coalescing`](crate::Effects::coalescing) turns it off; wrap a
/// ledger yourself where you call it directly from many tasks.
/// [`Coalescing::set_enabled`] switches a wrapper off and on.
/// Every other method (`release`, `renew`, `get`, `watch`, `claim_many`,
/// the transactional ones…) goes straight to the inner ledger.
///
/// Batches are driven with [`tokio::spawn`]: use it inside a Tokio runtime.
///
/// ```
/// use std::sync::Arc;
/// use oncely::{Effects, MemoryLedger};
/// use oncely::backend::Coalescing;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let effects = Arc::new(Effects::new(Coalescing::new(MemoryLedger::new())));
/// # let _ = effects;
/// # }
/// ```
pub struct Coalescing<L> {
    shared: Arc<Shared<L>>,
}

impl<L> Clone for Coalescing<L> {
    fn clone(&self) -> Self {
        Coalescing {
            shared: self.shared.clone(),
        }
    }
}

impl<L> std::fmt::Debug for Coalescing<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalescing")
            .field("max_batch", &self.shared.max_batch)
            .field("max_in_flight", &self.shared.max_in_flight)
            .finish_non_exhaustive()
    }
}

struct Shared<L> {
    inner: L,
    /// Off: every call goes straight to `inner`.
    enabled: AtomicBool,
    max_batch: usize,
    max_in_flight: usize,
    claims: Mutex<Queue<PendingClaim>>,
    completions: Mutex<Queue<PendingCompletion>>,
}

/// Calls waiting for a statement in flight, and how many are.
struct Queue<T> {
    /// Statements in flight (at most `max_in_flight`).
    in_flight: usize,
    waiting: Vec<T>,
}

impl<T> Queue<T> {
    const fn new() -> Self {
        Queue {
            in_flight: 0,
            waiting: Vec::new(),
        }
    }

    /// A statement's slot ends with nobody to drive the queue (no runtime):
    /// when it was the last, the waiting callers are dropped, and answer
    /// `Unavailable`.
    fn end_without_driver(&mut self) {
        self.in_flight -= 1;
        if self.in_flight == 0 {
            self.waiting.clear();
        }
    }
}

struct PendingClaim {
    key: EffectKey,
    opts: ClaimOptions,
    answer: oneshot::Sender<Result<Claim>>,
}

struct PendingCompletion {
    lease: Lease,
    outcome: Outcome,
    answer: oneshot::Sender<Result<()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while the lock was held left the queue consistent (every
    // change is one push or one drain): carry on.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<L: Ledger + 'static> Coalescing<L> {
    /// Wraps `inner`; statements carry at most [`DEFAULT_MAX_BATCH`] calls.
    pub fn new(inner: L) -> Self {
        Self::with_limits(inner, DEFAULT_MAX_BATCH, DEFAULT_MAX_IN_FLIGHT)
    }

    /// Wraps `inner`: statements carry at most `max_batch` calls, and at
    /// most `max_in_flight` claim statements (and as many completion
    /// statements) are in flight at once, calls beyond them queue (each at
    /// least 1).
    pub fn with_limits(inner: L, max_batch: usize, max_in_flight: usize) -> Self {
        Coalescing {
            shared: Arc::new(Shared {
                inner,
                enabled: AtomicBool::new(true),
                max_batch: max_batch.max(1),
                max_in_flight: max_in_flight.max(1),
                claims: Mutex::new(Queue::new()),
                completions: Mutex::new(Queue::new()),
            }),
        }
    }

    /// The inner ledger.
    pub fn inner(&self) -> &L {
        &self.shared.inner
    }

    /// Turns gathering on (the default) or off, for this ledger and its
    /// clones: off, each call goes straight to the inner ledger (calls
    /// already queued are still sent).
    pub fn set_enabled(&self, on: bool) {
        self.shared.enabled.store(on, Ordering::Relaxed);
    }

    /// Whether calls are gathered ([`Coalescing::set_enabled`]).
    pub fn is_enabled(&self) -> bool {
        self.shared.enabled.load(Ordering::Relaxed)
    }
}

/// Frees a queue's slot when its statement ends (or its caller is
/// dropped), or hands the queue to a driver task if callers are waiting.
struct Direct<'a, L: Ledger + 'static> {
    shared: &'a Arc<Shared<L>>,
    claims: bool,
}

impl<L: Ledger + 'static> Drop for Direct<'_, L> {
    fn drop(&mut self) {
        if self.claims {
            Shared::claims_done(self.shared);
        } else {
            Shared::completions_done(self.shared);
        }
    }
}

impl<L: Ledger + 'static> Shared<L> {
    /// The statement in flight returned: drive the queue, or go idle.
    fn claims_done(this: &Arc<Self>) {
        let mut q = lock(&this.claims);
        if q.waiting.is_empty() {
            q.in_flight -= 1;
        } else if let Ok(rt) = tokio::runtime::Handle::try_current() {
            drop(q);
            rt.spawn(this.clone().drive_claims());
        } else {
            // No runtime (one shutting down): nobody can drive the queue.
            // Its callers answer `Unavailable` (their senders dropped).
            q.end_without_driver();
        }
    }

    fn completions_done(this: &Arc<Self>) {
        let mut q = lock(&this.completions);
        if q.waiting.is_empty() {
            q.in_flight -= 1;
        } else if let Ok(rt) = tokio::runtime::Handle::try_current() {
            drop(q);
            rt.spawn(this.clone().drive_completions());
        } else {
            q.end_without_driver();
        }
    }

    /// The next claims to send: the oldest waiting call's options and up to
    /// `max_batch` calls with equal options, in order; callers already gone
    /// are left out. `None` (and idle) when nobody waits.
    fn next_claims(&self) -> Option<(ClaimOptions, Vec<PendingClaim>)> {
        let mut q = lock(&self.claims);
        q.waiting.retain(|p| !p.answer.is_closed());
        if q.waiting.is_empty() {
            q.in_flight -= 1;
            return None;
        }
        let opts = q.waiting[0].opts.clone();
        let mut batch = Vec::new();
        let mut rest = Vec::with_capacity(q.waiting.len());
        for p in q.waiting.drain(..) {
            if batch.len() < self.max_batch && p.opts == opts {
                batch.push(p);
            } else {
                rest.push(p);
            }
        }
        q.waiting = rest;
        Some((opts, batch))
    }

    async fn drive_claims(self: Arc<Self>) {
        let abandon = Abandon {
            queue: &self.claims,
            armed: true,
        };
        while let Some((opts, batch)) = self.next_claims() {
            let keys: Vec<EffectKey> = batch.iter().map(|p| p.key.clone()).collect();
            let answers = match self.inner.claim_many(&keys, &opts).await {
                Ok(answers) if answers.len() == batch.len() => answers,
                Ok(answers) => fail_each(
                    Error::Corrupt {
                        backend: self.inner.backend(),
                        message: format!("claim_many answered {} of {} keys", answers.len(), batch.len()),
                    },
                    batch.len(),
                ),
                Err(e) => fail_each(e, batch.len()),
            };
            // Answers first, so a dropped caller costs the others nothing;
            // then its grant is given back now rather than at the end of the
            // lease, before the next statement (a failed release leaves the
            // lease to expire, as a crashed holder's would).
            let mut orphans = Vec::new();
            for (p, answer) in batch.into_iter().zip(answers) {
                if let Err(Ok(Claim::Acquired(lease))) = p.answer.send(answer) {
                    orphans.push(lease);
                }
            }
            for lease in orphans {
                if let Err(e) = self.inner.release(&lease).await {
                    tracing::warn!(key = %lease.key(), fence = lease.fence(), error = %e,
                        "coalescing: releasing a dropped claimant's lease failed");
                }
            }
        }
        abandon.disarm();
    }

    fn next_completions(&self) -> Option<Vec<PendingCompletion>> {
        let mut q = lock(&self.completions);
        if q.waiting.is_empty() {
            q.in_flight -= 1;
            return None;
        }
        let n = q.waiting.len().min(self.max_batch);
        Some(q.waiting.drain(..n).collect())
    }

    async fn drive_completions(self: Arc<Self>) {
        let abandon = Abandon {
            queue: &self.completions,
            armed: true,
        };
        while let Some(batch) = self.next_completions() {
            let (items, answers): (Vec<(Lease, Outcome)>, Vec<_>) = batch
                .into_iter()
                .map(|p| ((p.lease, p.outcome), p.answer))
                .unzip();
            let results = self.inner.complete_many(&items).await;
            let results = if results.len() == items.len() {
                results
            } else {
                fail_each(
                    Error::Corrupt {
                        backend: self.inner.backend(),
                        message: format!(
                            "complete_many answered {} of {} leases",
                            results.len(),
                            items.len()
                        ),
                    },
                    items.len(),
                )
            };
            for (answer, result) in answers.into_iter().zip(results) {
                // A caller gone: its completion happened (or not) all the same.
                let _ = answer.send(result);
            }
        }
        abandon.disarm();
    }
}

/// A driver task dropped before its queue was empty (its runtime shut
/// down): its waiting callers answer `Unavailable` and the queue goes idle,
/// so the ledger still works on another runtime.
struct Abandon<'a, T> {
    queue: &'a Mutex<Queue<T>>,
    armed: bool,
}

impl<T> Abandon<'_, T> {
    /// The driver emptied its queue and left it idle itself.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl<T> Drop for Abandon<'_, T> {
    fn drop(&mut self) {
        if self.armed {
            let mut q = lock(self.queue);
            q.end_without_driver();
        }
    }
}

fn driver_gone(backend: &'static str) -> Error {
    Error::Unavailable {
        backend,
        message: "the coalescing driver stopped before answering (runtime shutting down)".into(),
    }
}

/// Admits a call: with fewer than `max_in_flight` statements in flight it
/// takes a slot and goes straight to the inner ledger (`None`); otherwise
/// it queues the request `make` builds around its answer's sender, for the
/// driver's next batch, and returns the receiver.
fn admit<T, A>(
    queue: &Mutex<Queue<T>>,
    max_in_flight: usize,
    make: impl FnOnce(oneshot::Sender<A>) -> T,
) -> Option<oneshot::Receiver<A>> {
    let mut q = lock(queue);
    if q.in_flight >= max_in_flight {
        let (tx, rx) = oneshot::channel();
        q.waiting.push(make(tx));
        Some(rx)
    } else {
        q.in_flight += 1;
        None
    }
}

impl<L: Ledger + 'static> Ledger for Coalescing<L> {
    fn backend(&self) -> &'static str {
        self.shared.inner.backend()
    }

    fn capabilities(&self) -> Capabilities {
        self.shared.inner.capabilities()
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        if !self.is_enabled() {
            return self.shared.inner.claim(key, opts).await;
        }
        let waiting = admit(&self.shared.claims, self.shared.max_in_flight, |answer| {
            PendingClaim {
                key: key.clone(),
                opts: opts.clone(),
                answer,
            }
        });
        match waiting {
            Some(rx) => rx.await.unwrap_or_else(|_| Err(driver_gone(self.backend()))),
            None => {
                let _direct = Direct {
                    shared: &self.shared,
                    claims: true,
                };
                self.shared.inner.claim(key, opts).await
            }
        }
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        if !self.is_enabled() {
            return self.shared.inner.complete(lease, outcome).await;
        }
        let waiting = admit(&self.shared.completions, self.shared.max_in_flight, |answer| {
            PendingCompletion {
                lease: lease.clone(),
                outcome: outcome.clone(),
                answer,
            }
        });
        match waiting {
            Some(rx) => rx.await.unwrap_or_else(|_| Err(driver_gone(self.backend()))),
            None => {
                let _direct = Direct {
                    shared: &self.shared,
                    claims: false,
                };
                self.shared.inner.complete(lease, outcome).await
            }
        }
    }

    fn release(&self, lease: &Lease) -> impl Future<Output = Result<()>> + Send {
        self.shared.inner.release(lease)
    }

    fn renew(&self, lease: &Lease, extend_by: Duration) -> impl Future<Output = Result<Lease>> + Send {
        self.shared.inner.renew(lease, extend_by)
    }

    fn get(&self, key: &EffectKey) -> impl Future<Output = Result<Option<Record>>> + Send {
        self.shared.inner.get(key)
    }

    fn prune(&self, limit: u64) -> impl Future<Output = Result<u64>> + Send {
        self.shared.inner.prune(limit)
    }

    fn abandoned(&self, tenant: &Tenant, limit: u64) -> impl Future<Output = Result<Vec<Record>>> + Send {
        self.shared.inner.abandoned(tenant, limit)
    }

    fn horizon(
        &self,
        tenant: &Tenant,
        kind: &str,
    ) -> impl Future<Output = Result<Option<SystemTime>>> + Send {
        self.shared.inner.horizon(tenant, kind)
    }

    fn watch(&self, key: &EffectKey) -> impl Future<Output = Watch> + Send {
        self.shared.inner.watch(key)
    }

    fn claim_many(
        &self,
        keys: &[EffectKey],
        opts: &ClaimOptions,
    ) -> impl Future<Output = Result<Vec<Result<Claim>>>> + Send {
        self.shared.inner.claim_many(keys, opts)
    }

    fn complete_many(&self, items: &[(Lease, Outcome)]) -> impl Future<Output = Vec<Result<()>>> + Send {
        self.shared.inner.complete_many(items)
    }

    fn unique_violation(&self, error: &(dyn std::error::Error + 'static)) -> Option<String> {
        self.shared.inner.unique_violation(error)
    }
}

/// Claims and completions inside the caller's transaction are the caller's
/// own statements: they go straight to the inner ledger, never gathered.
impl<L: TransactionalLedger + 'static> TransactionalLedger for Coalescing<L> {
    type Connection = L::Connection;
    type Transaction = L::Transaction;

    fn begin(&self) -> impl Future<Output = Result<Self::Transaction>> + Send {
        self.shared.inner.begin()
    }

    fn commit(&self, tx: Self::Transaction) -> impl Future<Output = Result<()>> + Send {
        self.shared.inner.commit(tx)
    }

    fn rollback(&self, tx: Self::Transaction) -> impl Future<Output = Result<()>> + Send {
        self.shared.inner.rollback(tx)
    }

    fn claim_in(
        &self,
        conn: &mut Self::Connection,
        key: &EffectKey,
        opts: &ClaimOptions,
    ) -> impl Future<Output = Result<Claim>> + Send {
        self.shared.inner.claim_in(conn, key, opts)
    }

    fn complete_in(
        &self,
        conn: &mut Self::Connection,
        lease: &Lease,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<()>> + Send {
        self.shared.inner.complete_in(conn, lease, outcome)
    }
}

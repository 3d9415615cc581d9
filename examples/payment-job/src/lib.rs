//! # payment-job: the reference multi-step job
//!
//! The payment job of `docs/design.md` ("Step modes"), for one order message:
//!
//! 1. claim `capture:{order}` and capture the payment with the step's provider
//!    key ([`StepMode::ProviderKeyed`]): a crash after the call re-runs it
//!    with the same key, and the provider answers with the first charge;
//! 2. mark the order paid on the database's own transaction
//!    ([`Job::step_in`](oncely::Job::step_in)): the claim, the fenced `UPDATE` and the
//!    completion commit together;
//! 3. claim `receipt:{order}` and send the receipt ([`StepMode::AtMostOnce`]):
//!    the mailer does not deduplicate, so a crash between the mark and the
//!    completion abandons the step for reconciliation rather than risk a
//!    second email;
//! 4. ack.
//!
//! The payment provider and the mailer are in-process fakes that count what
//! they do ([`FakeProvider`] honours idempotency keys unless told not to;
//! [`FakeMailer`] never deduplicates). Orders and the ledger live in a real
//! database: SQLite ([`oncely_sqlite::SqliteLedger`]) or PostgreSQL
//! ([`oncely_postgres::PgLedger`]), behind the small [`Db`] trait.
//!
//! [`Pipeline::deliver`] takes an optional [`Boundary`] at which the delivery
//! "crashes": its future is dropped there, as a killed process would stop,
//! so nothing after that point happens (an open transaction rolls back, the
//! lease stops being renewed). [`simulate`] runs many deliveries on many
//! workers with seeded random crashes and redelivers until every message is
//! acked.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use oncely::backend::{Record, StoredOutcome};
use oncely::{ClaimOptions, EffectKey, Effects, Error, OnInProgress, StepFuture, StepMode, Tenant};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

mod db;
mod reconcile;
pub use db::{Db, Order};
pub use reconcile::{PaymentReconciler, reconcile};
// The provider and the mailer are the test kit's fakes, the ones a user's
// own tests take too; re-exported under the names this crate always had.
pub use oncely_testkit::fakes::{Charge, FakeMailer, FakeProvider, MailLog, ProviderDown};

/// The message a broker delivers: pay for this order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderMsg {
    /// The order's id (the job's subject).
    pub order_id: String,
    /// The amount to capture, in cents.
    pub amount: i64,
}

/// A point in the pipeline where a delivery can crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Boundary {
    /// The capture step is claimed; the provider was not called.
    AfterCaptureClaim,
    /// The provider captured; the step is not completed.
    AfterCaptureCall,
    /// The mark-paid step is claimed inside the open transaction.
    AfterPaidClaim,
    /// The order row is updated; the transaction is not committed.
    AfterOrderUpdate,
    /// The transaction committed (order paid, step completed).
    AfterOrderCommit,
    /// The receipt step is durably marked as attempted; nothing was sent.
    AfterReceiptClaim,
    /// The receipt went out; the step is not completed.
    AfterSend,
    /// Everything is done; the broker was not acked.
    BeforeAck,
}

impl Boundary {
    /// Every boundary, in pipeline order.
    pub const ALL: [Boundary; 8] = [
        Boundary::AfterCaptureClaim,
        Boundary::AfterCaptureCall,
        Boundary::AfterPaidClaim,
        Boundary::AfterOrderUpdate,
        Boundary::AfterOrderCommit,
        Boundary::AfterReceiptClaim,
        Boundary::AfterSend,
        Boundary::BeforeAck,
    ];

    /// Whether a crash here is inside the at-most-once window of the receipt
    /// (the step is then abandoned, never re-run).
    pub fn in_receipt_window(self) -> bool {
        matches!(self, Boundary::AfterReceiptClaim | Boundary::AfterSend)
    }
}

/// How a delivery ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivered {
    /// All steps are done (or answered from the ledger) and the message is
    /// acked. `receipt_abandoned`: the receipt step was found abandoned by an
    /// earlier crash and is left for reconciliation.
    Acked {
        /// The receipt step is abandoned (listed for reconciliation).
        receipt_abandoned: bool,
    },
    /// The delivery crashed at this boundary; the broker will redeliver.
    Crashed(Boundary),
}

/// A delivery that failed without crashing (the broker redelivers it).
#[derive(Debug)]
pub struct DeliveryError {
    /// The step that failed: `capture`, `mark-paid`, `commit` or `receipt`.
    pub stage: &'static str,
    /// Whether the provider was called by this delivery before the failure.
    pub called_provider: bool,
    /// What went wrong.
    pub error: Error,
}

impl std::fmt::Display for DeliveryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.stage, self.error)
    }
}

impl std::error::Error for DeliveryError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// The crash hook of one delivery: pends forever at the chosen boundary after
/// telling the delivery to drop its future.
struct Hook {
    crash: Option<Boundary>,
    fired: Mutex<Option<oneshot::Sender<Boundary>>>,
    called_provider: AtomicBool,
}

impl Hook {
    async fn at(&self, b: Boundary) {
        if self.crash == Some(b) {
            if let Some(tx) = self.fired.lock().unwrap().take() {
                let _ = tx.send(b);
            }
            std::future::pending::<()>().await;
        }
    }
}

/// The payment job over a database `D`.
pub struct Pipeline<D> {
    /// The ledger and the orders' database.
    pub db: D,
    /// The runner over `db`.
    pub effects: Effects<D>,
    /// The tenant every key is scoped to.
    pub tenant: Tenant,
    /// The payment provider.
    pub provider: Arc<FakeProvider>,
    /// The mailer.
    pub mailer: Arc<FakeMailer>,
    /// The claim options of every step (lease, in-progress wait).
    pub opts: ClaimOptions,
    /// Captures that ran under a lease taken over from an attempt that
    /// crashed or stalled (`Lease::taken_over`).
    pub capture_takeovers: Arc<AtomicU64>,
}

impl<D: Db> Pipeline<D> {
    /// A pipeline with a `lease` and a wait for in-flight steps of up to
    /// `wait` (then [`Error::InProgress`] and the broker redelivers).
    pub fn new(db: D, tenant: Tenant, provider: Arc<FakeProvider>, lease: Duration, wait: Duration) -> Self {
        Pipeline {
            effects: Effects::new(db.clone()),
            db,
            tenant,
            provider,
            mailer: Arc::new(FakeMailer::default()),
            // The consumer preset, with the simulation's lease and wait.
            opts: ClaimOptions::for_consumer()
                .lease(lease)
                .on_in_progress(OnInProgress::Wait { max: wait }),
            capture_takeovers: Arc::default(),
        }
    }

    /// Delivers `msg` once. With `crash`, the delivery stops dead at that
    /// boundary (its future is dropped) if it gets there.
    pub async fn deliver(&self, msg: &OrderMsg, crash: Option<Boundary>) -> Result<Delivered, DeliveryError> {
        let (tx, rx) = oneshot::channel();
        let hook = Arc::new(Hook {
            crash,
            fired: Mutex::new(Some(tx)),
            called_provider: AtomicBool::new(false),
        });
        tokio::select! {
            biased;
            Ok(b) = rx => Ok(Delivered::Crashed(b)),
            r = self.run(msg, hook.clone()) => r.map_err(|(stage, error)| DeliveryError {
                stage,
                called_provider: hook.called_provider.load(Ordering::SeqCst),
                error,
            }),
        }
    }

    async fn run(&self, msg: &OrderMsg, hook: Arc<Hook>) -> Result<Delivered, (&'static str, Error)> {
        let job = self
            .effects
            .job(&self.tenant, "payment", &msg.order_id)
            .options(self.opts.clone())
            .fingerprint_of(msg)
            .map_err(|e| ("capture", e))?;

        // 1. Capture, with the step's provider key as the idempotency key.
        let charge: Charge = job
            .step("capture", StepMode::ProviderKeyed, |ctx| {
                let hook = &hook;
                async move {
                    if ctx.lease().taken_over() {
                        self.capture_takeovers.fetch_add(1, Ordering::SeqCst);
                    }
                    hook.at(Boundary::AfterCaptureClaim).await;
                    let charge = self
                        .provider
                        .capture(&ctx.provider_key(), &msg.order_id, msg.amount)
                        .await;
                    hook.called_provider.store(true, Ordering::SeqCst);
                    hook.at(Boundary::AfterCaptureCall).await;
                    Ok(charge)
                }
            })
            .await
            .map_err(|e| ("capture", e))?;

        // 2. Mark the order paid, in one transaction with the step's claim
        //    and completion. The write is fenced as well: a later holder of
        //    this step always has a higher fence.
        let mut tx = self.db.begin().await.map_err(|e| ("mark-paid", e))?;
        let (id, charge_id, h) = (msg.order_id.clone(), charge.id.clone(), hook.clone());
        job.step_in("mark-paid", &mut *tx, move |conn, ctx| {
            Box::pin(async move {
                h.at(Boundary::AfterPaidClaim).await;
                let rows = D::mark_paid(conn, &id, &charge_id, ctx.fence()).await?;
                h.at(Boundary::AfterOrderUpdate).await;
                Ok(rows)
            }) as StepFuture<'_, u64>
        })
        .await
        .map_err(|e| ("mark-paid", e))?;
        self.db.commit(tx).await.map_err(|e| ("commit", e))?;
        hook.at(Boundary::AfterOrderCommit).await;

        // 3. The receipt: at most once.
        let receipt = job
            .step("receipt", StepMode::AtMostOnce, |_ctx| {
                let hook = &hook;
                async move {
                    hook.at(Boundary::AfterReceiptClaim).await;
                    self.mailer.send_receipt(&msg.order_id).await;
                    hook.at(Boundary::AfterSend).await;
                    Ok(())
                }
            })
            .await;
        let receipt_abandoned = match receipt {
            Ok(()) => false,
            // Listed for reconciliation. A broker consumer must hold such a
            // delivery, not ack it, until the step is reconciled (a step
            // found not sent is released, and only a delivery sends it);
            // oncely-consumer does. This simulation reports it and
            // redelivers by hand.
            Err(Error::Abandoned { .. }) => true,
            Err(e) => return Err(("receipt", e)),
        };
        hook.at(Boundary::BeforeAck).await;
        Ok(Delivered::Acked { receipt_abandoned })
    }

    /// The key of one of the job's steps for `order`.
    pub fn step_key(&self, kind: &str, order: &str) -> EffectKey {
        EffectKey::new(&self.tenant, kind, order).expect("valid key")
    }

    /// Everything a redelivery could change: the orders, the ledger records of
    /// every step, and the provider's and the mailer's counters.
    pub async fn snapshot(&self, orders: &[OrderMsg]) -> anyhow::Result<Snapshot> {
        let ids: Vec<String> = orders.iter().map(|o| o.order_id.clone()).collect();
        let mut ledger = Vec::new();
        for id in &ids {
            for kind in ["capture", "mark-paid", "receipt"] {
                let r = self.db.get(&self.step_key(kind, id)).await?;
                ledger.push(r.map(|mut r: Record| {
                    r.read_at = UNIX_EPOCH;
                    r
                }));
            }
        }
        Ok(Snapshot {
            orders: self.db.orders(&ids).await?,
            ledger,
            captures: self.provider.captures(),
            sends: self.mailer.sends(),
        })
    }
}

/// What [`Pipeline::snapshot`] reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// The order rows.
    pub orders: Vec<Order>,
    /// Every step's record (read time cleared).
    pub ledger: Vec<Option<Record>>,
    /// Captures per order at the provider.
    pub captures: BTreeMap<String, u32>,
    /// Receipts sent per order.
    pub sends: BTreeMap<String, u32>,
}

/// Settings of [`simulate`].
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// How many orders.
    pub orders: usize,
    /// How many times each order's message is delivered (duplicates).
    pub deliveries: usize,
    /// How many concurrent workers.
    pub workers: usize,
    /// Out of 100, how many delivery attempts crash at a random boundary.
    pub crash_percent: u64,
    /// Attempts of one delivery after which it no longer crashes, so every
    /// message is acked in the end.
    pub crash_attempts: u32,
    /// The seed of every random choice.
    pub seed: u64,
    /// Prefix of the order ids (tests sharing a database use distinct ones).
    pub prefix: String,
}

/// What happened during [`simulate`], per order.
#[derive(Debug, Default, Clone)]
pub struct SimReport {
    /// The messages.
    pub orders: Vec<OrderMsg>,
    /// Crashes per order and boundary.
    pub crashes: BTreeMap<String, BTreeMap<Boundary, u32>>,
    /// Per order: delivery attempts that called the provider and then failed
    /// without completing the capture step (crash after the call, a lost
    /// lease, a backend error): each one is a capture the provider must
    /// deduplicate.
    pub calls_not_completed: BTreeMap<String, u32>,
    /// Failed (non-crash) attempts by stage and error, for the record.
    pub errors: BTreeMap<String, u32>,
    /// Acked deliveries.
    pub acked: usize,
    /// Acks that found the receipt abandoned.
    pub acked_with_abandoned_receipt: usize,
    /// Errors that are not expected under crashes (they fail the test).
    pub unexpected: Vec<String>,
}

impl SimReport {
    /// Crashes of an order at a boundary.
    pub fn crashes_at(&self, order: &str, b: Boundary) -> u32 {
        self.crashes
            .get(order)
            .and_then(|m| m.get(&b))
            .copied()
            .unwrap_or(0)
    }
}

/// Creates the orders, then delivers each message `deliveries` times from a
/// shared queue served by `workers` concurrent workers. A delivery attempt
/// crashes at a random boundary with the configured probability; crashed and
/// failed attempts go back to the queue (the broker's redelivery) until each
/// is acked.
pub async fn simulate<D: Db>(p: Arc<Pipeline<D>>, cfg: &SimConfig) -> anyhow::Result<SimReport> {
    let orders: Vec<OrderMsg> = (0..cfg.orders)
        .map(|i| OrderMsg {
            order_id: format!("{}order-{i}", cfg.prefix),
            amount: 1000 + i as i64,
        })
        .collect();
    for o in &orders {
        p.db.insert_order(&o.order_id, o.amount).await?;
    }
    // The broker's queue: (order index, attempt), duplicates interleaved.
    let mut rng = fastrand::Rng::with_seed(cfg.seed);
    let mut queue: Vec<(usize, u32)> = (0..cfg.orders)
        .flat_map(|i| std::iter::repeat_n((i, 0), cfg.deliveries))
        .collect();
    for i in (1..queue.len()).rev() {
        queue.swap(i, rng.usize(..=i));
    }
    let queue = Arc::new(Mutex::new(VecDeque::from(queue)));
    let remaining = Arc::new(AtomicUsize::new(cfg.orders * cfg.deliveries));
    let report = Arc::new(Mutex::new(SimReport {
        orders: orders.clone(),
        ..SimReport::default()
    }));
    let orders = Arc::new(orders);
    let mut workers = Vec::new();
    for w in 0..cfg.workers {
        let (p, queue, remaining, report, orders, cfg) = (
            p.clone(),
            queue.clone(),
            remaining.clone(),
            report.clone(),
            orders.clone(),
            cfg.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut rng =
                fastrand::Rng::with_seed(cfg.seed ^ (0x9e37_79b9_7f4a_7c15u64.wrapping_mul(w as u64 + 1)));
            while remaining.load(Ordering::SeqCst) > 0 {
                let next = queue.lock().unwrap().pop_front();
                let Some((i, attempt)) = next else {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                };
                let msg = &orders[i];
                let crash = (attempt < cfg.crash_attempts && rng.u64(..100) < cfg.crash_percent)
                    .then(|| Boundary::ALL[rng.usize(..Boundary::ALL.len())]);
                let result = p.deliver(msg, crash).await;
                let mut r = report.lock().unwrap();
                match result {
                    Ok(Delivered::Acked { receipt_abandoned }) => {
                        r.acked += 1;
                        r.acked_with_abandoned_receipt += usize::from(receipt_abandoned);
                        remaining.fetch_sub(1, Ordering::SeqCst);
                        continue;
                    }
                    Ok(Delivered::Crashed(b)) => {
                        *r.crashes
                            .entry(msg.order_id.clone())
                            .or_default()
                            .entry(b)
                            .or_default() += 1;
                        if b == Boundary::AfterCaptureCall {
                            *r.calls_not_completed.entry(msg.order_id.clone()).or_default() += 1;
                        }
                    }
                    Err(e) => {
                        if e.stage == "capture" && e.called_provider {
                            *r.calls_not_completed.entry(msg.order_id.clone()).or_default() += 1;
                        }
                        let label = format!("{}: {}", e.stage, error_label(&e.error));
                        *r.errors.entry(label).or_default() += 1;
                        if !(e.error.is_retryable() || e.error.is_lease_lost()) {
                            r.unexpected.push(format!("{}: {e}", msg.order_id));
                        }
                    }
                }
                drop(r);
                queue.lock().unwrap().push_back((i, attempt + 1));
            }
        }));
    }
    for w in workers {
        w.await?;
    }
    let report = report.lock().unwrap().clone();
    Ok(report)
}

fn error_label(e: &Error) -> &'static str {
    match e {
        Error::InProgress { .. } => "in progress",
        Error::LeaseLost { .. } => "lease lost",
        Error::Backend { .. } => "backend",
        Error::Unavailable { .. } => "unavailable",
        _ => "other",
    }
}

/// Checks the invariants of a finished run against the database and the
/// fakes; returns every violation (empty: all hold).
///
/// - every order is paid, by exactly one transactional write, with the
///   charge the provider made;
/// - with key support, exactly one capture per order; without it, one plus
///   one per provider call whose step did not complete (the documented
///   provider-keyed window);
/// - exactly one receipt per order, except the orders whose receipt step
///   crashed inside the at-most-once window: zero sends (crash before the
///   send) or one (after it), the step abandoned and listed, never re-sent.
pub async fn check<D: Db>(
    p: &Pipeline<D>,
    report: &SimReport,
    honour_keys: bool,
) -> anyhow::Result<Vec<String>> {
    let mut bad = report.unexpected.clone();
    let snap = p.snapshot(&report.orders).await?;
    let abandoned: Vec<String> =
        p.db.abandoned(&p.tenant, 100_000)
            .await?
            .into_iter()
            .map(|r| r.key.subject().to_owned())
            .collect();
    for (msg, order) in report.orders.iter().zip(&snap.orders) {
        let id = &msg.order_id;
        let captures = snap.captures.get(id).copied().unwrap_or(0);
        let want = if honour_keys {
            1
        } else {
            1 + report.calls_not_completed.get(id).copied().unwrap_or(0)
        };
        if captures != want {
            bad.push(format!("{id}: {captures} captures, expected {want}"));
        }
        if order.status != "paid" || order.paid_writes != 1 {
            bad.push(format!("{id}: not paid exactly once: {order:?}"));
        }
        let capture = p.db.get(&p.step_key("capture", id)).await?;
        let charge: Option<Charge> = match capture.map(|r| r.stored::<Charge>()).transpose()? {
            Some(Some(StoredOutcome::Value(charge))) => Some(charge),
            _ => None,
        };
        if charge.as_ref().map(|c| &c.id) != order.charge_id.as_ref() {
            bad.push(format!(
                "{id}: order charge {:?} vs ledger {charge:?}",
                order.charge_id
            ));
        }
        let sends = snap.sends.get(id).copied().unwrap_or(0);
        let before = report.crashes_at(id, Boundary::AfterReceiptClaim);
        let after = report.crashes_at(id, Boundary::AfterSend);
        let listed = abandoned.iter().any(|s| s == id);
        if before + after > 0 {
            // One delivery got into the window; it crashed there and the
            // step was never re-run.
            if before + after != 1 || !listed || sends != after {
                bad.push(format!(
                    "{id}: receipt window crashes before/after send {before}/{after}, listed {listed}, sends {sends}"
                ));
            }
        } else if sends != 1 || listed {
            bad.push(format!(
                "{id}: {sends} receipts sent, listed as abandoned: {listed}"
            ));
        }
    }
    Ok(bad)
}

/// Builds a database from a URL: `sqlite:…` (or a path) or `postgres://…`.
pub async fn run_demo(url: &str, cfg: &SimConfig) -> anyhow::Result<Vec<String>> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let db = oncely_postgres::PgLedger::connect(url).await?;
        demo(db, cfg).await
    } else {
        let db = oncely_sqlite::SqliteLedger::connect(url).await?;
        demo(db, cfg).await
    }
}

async fn demo<D: Db>(db: D, cfg: &SimConfig) -> anyhow::Result<Vec<String>> {
    db.create_orders().await?;
    let tenant = Tenant::new(format!("demo-{}", cfg.seed % 1_000_000_007))?;
    let p = Arc::new(Pipeline::new(
        db,
        tenant,
        Arc::new(FakeProvider::new(true)),
        Duration::from_millis(300),
        Duration::from_secs(2),
    ));
    let report = simulate(p.clone(), cfg).await?;
    let crashes: u32 = report.crashes.values().flat_map(|m| m.values()).sum();
    println!(
        "{} orders x {} deliveries on {} workers: {} acked, {} crashes, {} acks found the receipt abandoned",
        cfg.orders, cfg.deliveries, cfg.workers, report.acked, crashes, report.acked_with_abandoned_receipt
    );
    let mut by_boundary: BTreeMap<Boundary, u32> = BTreeMap::new();
    for m in report.crashes.values() {
        for (b, n) in m {
            *by_boundary.entry(*b).or_default() += n;
        }
    }
    for (b, n) in &by_boundary {
        println!("  crashed {n:>4} times at {b:?}");
    }
    for (e, n) in &report.errors {
        println!("  {n:>4} redeliveries after {e}");
    }
    let snap = p.snapshot(&report.orders).await?;
    let total = |m: &BTreeMap<String, u32>| m.values().sum::<u32>();
    println!(
        "provider captures: {}, receipts sent: {}, abandoned receipts listed: {}",
        total(&snap.captures),
        total(&snap.sends),
        p.db.abandoned(&p.tenant, 100_000).await?.len()
    );
    let bad = check(&p, &report, true).await?;
    // One more full redelivery of every message changes nothing.
    for o in &report.orders {
        match p.deliver(o, None).await {
            Ok(Delivered::Acked { .. }) => {}
            other => anyhow::bail!("final redelivery of {}: {other:?}", o.order_id),
        }
    }
    let mut bad = bad;
    if p.snapshot(&report.orders).await? != snap {
        bad.push("a full redelivery after the run changed something".to_owned());
    }
    Ok(bad)
}

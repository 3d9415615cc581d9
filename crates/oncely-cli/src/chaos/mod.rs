//! `oncely chaos`: the payment pipeline run across several endpoints of one
//! replicated deployment while your scripts inject faults, and one table of
//! what happened.
//!
//! Every order's payment message is delivered twice, at once, to workers
//! spread over the endpoints (worker `w` starts on endpoint `w mod n`, and
//! a delivery that fails retryably moves on to the next endpoint, as a load
//! balancer would). Each delivery runs the reference job: a provider-keyed
//! `capture` step (a fake provider that deduplicates by idempotency key, as
//! real ones do, and counts every call and every distinct charge), then, on
//! the SQL backends, a transactional `mark-paid` step whose business row
//! commits with its claim and completion (`chaos/marks.rs`), then an at-most-once
//! `receipt` step (a fake mailer nobody deduplicates). A
//! delivery that fails retryably (in progress elsewhere, a node that went
//! away, an outcome unknown) is redelivered after a short back-off until it
//! acks or the deadline passes. Meanwhile each `--fault AT=COMMAND` runs
//! through `sh -c` at its offset from the start.
//!
//! Every step whose completion a worker saw acknowledged is remembered with
//! its fence; at the end each is read back (from the first endpoint that
//! answers): a record that is not completed at that fence is an
//! **acknowledged completion lost**. **Duplicates** are orders charged twice
//! (two distinct charges), marked paid twice (two committed rows) or sent
//! two receipts: the guarantee says 0
//! whatever the faults. An at-most-once receipt whose worker died mid-step is
//! **abandoned** (listed, never sent again here): that is the documented
//! window, not a duplicate.
//!
//! [`run`] returns a [`ChaosReport`]; it prints nothing (the binary does).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely::backend::{Ledger, RecordState};
use oncely::{ClaimOptions, Effects, Error, Failure, OnInProgress, Result, StepMode, Tenant};
use oncely_any::AnyLedger;
use serde::Serialize;

mod marks;

use marks::Marks;

/// How long the read-back of acknowledged completions keeps asking while
/// no endpoint answers.
const READ_BACK: Duration = Duration::from_secs(60);

/// A fault: a shell command run `at` after the start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// When, from the start of the run.
    pub at: Duration,
    /// What, through `sh -c`.
    pub command: String,
}

impl Fault {
    /// Reads `AT=COMMAND` (`2s=scripts/galera-cluster.sh kill 2`), `AT` a
    /// duration as `--lease` takes it.
    pub fn parse(
        s: &str,
        duration: impl Fn(&str) -> std::result::Result<Duration, String>,
    ) -> std::result::Result<Fault, String> {
        let (at, command) = s.split_once('=').ok_or_else(|| {
            format!("{s:?}: a fault is AT=COMMAND, e.g. 2s='scripts/galera-cluster.sh kill 2'")
        })?;
        let command = command.trim();
        if command.is_empty() {
            return Err(format!("{s:?}: the fault's command is empty"));
        }
        Ok(Fault {
            at: duration(at.trim())?,
            command: command.to_owned(),
        })
    }
}

/// What `oncely chaos` runs.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    /// One URL per endpoint (node) of the deployment; at least one.
    pub endpoints: Vec<String>,
    /// The topology's name in the report (`galera-3`, `pg-sync-standby`).
    pub topology: String,
    /// How many orders.
    pub orders: u32,
    /// How many concurrent workers.
    pub workers: usize,
    /// The steps' lease (short, so a crashed holder is taken over within
    /// the run).
    pub lease: Duration,
    /// The faults, in any order.
    pub faults: Vec<Fault>,
    /// When to stop redelivering what has not acked.
    pub deadline: Duration,
}

impl Default for ChaosConfig {
    fn default() -> Self {
        ChaosConfig {
            endpoints: Vec::new(),
            topology: "unnamed".to_owned(),
            orders: 300,
            workers: 8,
            lease: Duration::from_secs(2),
            faults: Vec::new(),
            deadline: Duration::from_secs(120),
        }
    }
}

impl ChaosConfig {
    /// Refuses what cannot run, before anything connects.
    pub fn validate(&self) -> Result<()> {
        if self.endpoints.is_empty() {
            return Err(Error::InvalidInput(
                "chaos needs at least one --endpoint URL".to_owned(),
            ));
        }
        if self.orders == 0 || self.workers == 0 {
            return Err(Error::InvalidInput(
                "--orders and --workers must be at least 1".to_owned(),
            ));
        }
        if let Some(f) = self.faults.iter().find(|f| f.at >= self.deadline) {
            return Err(Error::InvalidInput(format!(
                "the fault at {:?} comes after the deadline ({:?})",
                f.at, self.deadline
            )));
        }
        ClaimOptions::default().lease(self.lease).validate()
    }
}

/// One fault as it ran.
#[derive(Debug, Clone, Serialize)]
pub struct FaultRun {
    /// When it was asked for, in seconds from the start.
    pub at_seconds: f64,
    /// The command.
    pub command: String,
    /// Its exit status (`None`: it could not be started, or was killed).
    pub exit: Option<i32>,
}

/// What a chaos run did.
#[derive(Debug, Clone, Serialize)]
pub struct ChaosReport {
    /// The topology's name.
    pub topology: String,
    /// How many endpoints the workers used.
    pub endpoints: usize,
    /// The faults, as they ran.
    pub faults: Vec<FaultRun>,
    /// Orders (each delivered twice, at once).
    pub orders: u32,
    /// Deliveries, redeliveries included.
    pub deliveries: u64,
    /// Distinct charges the provider made.
    pub charges: u64,
    /// Calls to the provider (a repeat with the same key is deduplicated
    /// by it: effectively once).
    pub provider_calls: u64,
    /// Orders whose transactional `mark-paid` step committed its row (on
    /// the SQL backends; `None` where the backend has no transaction to
    /// share with a business write: Redis, NATS).
    pub marked: Option<u64>,
    /// Receipts sent.
    pub receipts: u64,
    /// Orders charged twice, marked paid twice or sent two receipts: 0,
    /// always.
    pub duplicates: u64,
    /// Step completions whose workers saw them acknowledged.
    pub acknowledged: u64,
    /// Of those, the ones whose record was not completed at that fence
    /// afterwards.
    pub lost: u64,
    /// Of those, the ones no endpoint would answer for by the end (counted
    /// as a failure: the run cannot vouch for them).
    pub unread: u64,
    /// Receipt steps left abandoned (a worker died mid-step): sent zero
    /// times or once, for reconciliation.
    pub abandoned: Vec<String>,
    /// Orders that had not acked by the deadline, or whose delivery failed
    /// with an error that is not retryable.
    pub unfinished: u64,
    /// Why each unfinished order stopped: the last error its delivery saw.
    pub gave_up: Vec<GaveUp>,
    /// Retryable failures seen, by class, and the redeliveries they caused.
    pub retried: BTreeMap<String, u64>,
    /// Wall time.
    pub seconds: f64,
}

impl ChaosReport {
    /// Whether the run broke a guarantee: a duplicate, a lost
    /// acknowledgement, or an order that never finished.
    pub fn failed(&self) -> bool {
        self.duplicates > 0 || self.lost > 0 || self.unread > 0 || self.unfinished > 0
    }
}

/// An order the run stopped delivering, and the error that stopped it.
#[derive(Debug, Clone, Serialize)]
pub struct GaveUp {
    /// The order.
    pub order: u32,
    /// The deadline passed while its delivery failed with this retryable
    /// error (`retryable: true`), or it failed with one that is not.
    pub error: String,
    /// Whether the error was retryable (the deadline stopped it).
    pub retryable: bool,
}

/// The provider: deduplicates by idempotency key, counts calls.
#[derive(Default)]
struct Provider {
    charges: Mutex<HashMap<String, String>>,
    per_order: Mutex<HashMap<u32, u64>>,
    calls: AtomicU64,
}

impl Provider {
    async fn capture(&self, key: &str, order: u32) -> String {
        tokio::time::sleep(Duration::from_millis(2)).await;
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut charges = self.charges.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(id) = charges.get(key) {
            return id.clone();
        }
        let id = format!("ch_{order}_{}", charges.len());
        charges.insert(key.to_owned(), id.clone());
        *self
            .per_order
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(order)
            .or_default() += 1;
        id
    }
}

/// What the workers share.
struct Shared {
    nodes: Vec<Effects<AnyLedger>>,
    /// Each node's transactional ledger and the run's table, when every
    /// node has one.
    marks: Option<(Vec<Marks>, String)>,
    tenant: Tenant,
    opts: ClaimOptions,
    provider: Provider,
    receipts: Mutex<HashMap<u32, u64>>,
    acked: Mutex<Vec<(oncely::EffectKey, u64)>>,
    retried: Mutex<BTreeMap<String, u64>>,
    deliveries: AtomicU64,
    abandoned: Mutex<Vec<String>>,
}

impl Shared {
    /// One delivery of `order` through endpoint `node`.
    async fn deliver(&self, order: u32, node: usize) -> Result<()> {
        self.deliveries.fetch_add(1, Ordering::Relaxed);
        let effects = &self.nodes[node];
        let subject = format!("order-{order}");
        let job = effects
            .job(&self.tenant, "payment", &subject)
            .options(self.opts.clone());
        let ran = Mutex::new(None);
        job.step("capture", StepMode::ProviderKeyed, |ctx| {
            let ran = &ran;
            async move {
                *ran.lock().unwrap_or_else(|p| p.into_inner()) = Some((ctx.key().clone(), ctx.fence()));
                Ok::<_, Failure>(self.provider.capture(&ctx.provider_key(), order).await)
            }
        })
        .await?;
        self.acknowledge(&ran);
        if let Some((marks, table)) = &self.marks {
            marks[node]
                .mark(table, &self.tenant, &self.opts, order, &ran)
                .await?;
            self.acknowledge(&ran);
        }
        let sent = job
            .step("receipt", StepMode::AtMostOnce, |ctx| {
                let ran = &ran;
                async move {
                    *ran.lock().unwrap_or_else(|p| p.into_inner()) = Some((ctx.key().clone(), ctx.fence()));
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    *self
                        .receipts
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(order)
                        .or_default() += 1;
                    Ok::<_, Failure>(())
                }
            })
            .await;
        match sent {
            Ok(()) => {
                self.acknowledge(&ran);
                Ok(())
            }
            // The documented window: listed for reconciliation, not retried.
            Err(Error::Abandoned { key }) => {
                self.abandoned.lock().unwrap_or_else(|p| p.into_inner()).push(key);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// The step that just returned `Ok` ran here if it noted its key: its
    /// completion was acknowledged.
    fn acknowledge(&self, ran: &Mutex<Option<(oncely::EffectKey, u64)>>) {
        if let Some(done) = ran.lock().unwrap_or_else(|p| p.into_inner()).take() {
            self.acked.lock().unwrap_or_else(|p| p.into_inner()).push(done);
        }
    }

    fn retried(&self, e: &Error) {
        let class = match e {
            Error::InProgress { .. } => "in_progress",
            Error::LeaseLost { .. } => "lease_lost",
            Error::OutcomeUnknown { .. } => "outcome_unknown",
            Error::Unavailable { .. } => "unavailable",
            // A step's own write failed (the transactional step's row on a
            // node that went away): rolled back with its claim.
            Error::Handler(_) => "handler",
            // A conflict or a lock wait the backend rolled back.
            Error::Backend { .. } => "backend",
            _ => "other",
        };
        *self
            .retried
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(class.to_owned())
            .or_default() += 1;
    }
}

/// Runs the pipeline with the faults and reports.
pub async fn run(config: &ChaosConfig) -> Result<ChaosReport> {
    config.validate()?;
    let mut nodes = Vec::new();
    for url in &config.endpoints {
        nodes.push(Effects::new(AnyLedger::connect(url).await?));
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let run_id = format!("{:x}", nanos & 0xffff_ffff_ffff);
    let tenant = Tenant::new(format!("chaos-{run_id}"))?;
    let marks: Option<Vec<Marks>> = nodes.iter().map(|n| Marks::of(n.ledger())).collect();
    let marks = match marks {
        Some(marks) => {
            let table = format!("oncely_chaos_marks_{run_id}");
            marks[0].create(&table).await?;
            Some((marks, table))
        }
        None => None,
    };
    let opts = ClaimOptions::default()
        .lease(config.lease)
        .on_in_progress(OnInProgress::Wait {
            max: Duration::from_millis(200),
        });
    let shared = Arc::new(Shared {
        nodes,
        marks,
        tenant,
        opts,
        provider: Provider::default(),
        receipts: Mutex::default(),
        acked: Mutex::default(),
        retried: Mutex::default(),
        deliveries: AtomicU64::new(0),
        abandoned: Mutex::default(),
    });
    // Each order twice, next to each other: both copies are in flight at once.
    let queue: Arc<Mutex<std::collections::VecDeque<u32>>> =
        Arc::new(Mutex::new((0..config.orders).flat_map(|o| [o, o]).collect()));
    let started = Instant::now();
    let deadline = started + config.deadline;
    let unfinished = Arc::new(AtomicU64::new(0));
    let gave_up: Arc<Mutex<Vec<GaveUp>>> = Arc::default();

    let faults = {
        let faults = config.faults.clone();
        tokio::spawn(async move {
            let mut faults = faults;
            faults.sort_by_key(|f| f.at);
            let mut runs = Vec::new();
            for f in faults {
                tokio::time::sleep_until((started + f.at).into()).await;
                let exit = tokio::process::Command::new("sh")
                    .arg("-c")
                    .arg(&f.command)
                    .stdin(std::process::Stdio::null())
                    .status()
                    .await
                    .ok()
                    .and_then(|s| s.code());
                tracing::info!(command = f.command, ?exit, "chaos fault ran");
                runs.push(FaultRun {
                    at_seconds: f.at.as_secs_f64(),
                    command: f.command,
                    exit,
                });
            }
            runs
        })
    };

    let mut workers = tokio::task::JoinSet::new();
    let endpoints = config.endpoints.len();
    for w in 0..config.workers {
        let (shared, queue, unfinished, gave_up) =
            (shared.clone(), queue.clone(), unfinished.clone(), gave_up.clone());
        workers.spawn(async move {
            loop {
                let Some(order) = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front() else {
                    return;
                };
                let mut attempt = 0usize;
                let mut backoff = Duration::from_millis(5);
                loop {
                    let node = (w + attempt) % endpoints;
                    match shared.deliver(order, node).await {
                        Ok(()) => break,
                        Err(e) if e.is_retryable() || e.is_lease_lost() => {
                            shared.retried(&e);
                            if Instant::now() >= deadline {
                                unfinished.fetch_add(1, Ordering::Relaxed);
                                gave_up.lock().unwrap_or_else(|p| p.into_inner()).push(GaveUp {
                                    order,
                                    error: e.to_string(),
                                    retryable: true,
                                });
                                break;
                            }
                            attempt += 1;
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(Duration::from_millis(500));
                        }
                        Err(e) => {
                            tracing::warn!(order, error = %e, "chaos delivery failed for good");
                            shared.retried(&e);
                            unfinished.fetch_add(1, Ordering::Relaxed);
                            gave_up.lock().unwrap_or_else(|p| p.into_inner()).push(GaveUp {
                                order,
                                error: e.to_string(),
                                retryable: false,
                            });
                            break;
                        }
                    }
                }
            }
        });
    }
    while let Some(joined) = workers.join_next().await {
        joined.map_err(|e| Error::Misuse(format!("a chaos worker panicked: {e}")))?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let faults = faults
        .await
        .map_err(|e| Error::Misuse(format!("the fault runner panicked: {e}")))?;

    // Read every acknowledged completion back from an endpoint that answers
    // (the faults may still be settling: keep asking for a while).
    let acked = std::mem::take(&mut *shared.acked.lock().unwrap_or_else(|p| p.into_inner()));
    let mut lost = 0;
    let mut unread = 0;
    let give_up = Instant::now() + READ_BACK;
    for (key, fence) in &acked {
        let record = loop {
            let mut answer = None;
            for effects in &shared.nodes {
                if let Ok(r) = effects.ledger().get(key).await {
                    answer = Some(r);
                    break;
                }
            }
            match answer {
                Some(r) => break Some(r),
                None if Instant::now() >= give_up => break None,
                None => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        match record {
            Some(Some(r)) if r.state == RecordState::Completed && r.fence == *fence => {}
            Some(r) => {
                tracing::warn!(effect_key = %key, fence, record = ?r, "acknowledged completion lost");
                lost += 1;
            }
            None => unread += 1,
        }
    }
    let per_order = shared
        .provider
        .per_order
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let receipts = shared.receipts.lock().unwrap_or_else(|p| p.into_inner()).clone();
    // The committed marks, from the first endpoint that answers.
    let mut marked = None;
    let mut marked_twice = 0;
    if let Some((marks, table)) = &shared.marks {
        let counts = loop {
            let mut answer = None;
            for m in marks {
                if let Ok(c) = m.counts(table).await {
                    answer = Some(c);
                    break;
                }
            }
            match answer {
                Some(c) => break Some(c),
                None if Instant::now() >= give_up => break None,
                None => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        match counts {
            Some(c) => {
                marked = Some(c.len() as u64);
                marked_twice = c.values().filter(|&&n| n > 1).count() as u64;
            }
            None => unread += 1,
        }
        for m in marks {
            if m.counts(table).await.is_ok() {
                m.drop_table(table).await;
                break;
            }
        }
    }
    let duplicates = per_order.values().filter(|&&n| n > 1).count() as u64
        + marked_twice
        + receipts.values().filter(|&&n| n > 1).count() as u64;
    let mut abandoned = shared.abandoned.lock().unwrap_or_else(|p| p.into_inner()).clone();
    abandoned.sort();
    abandoned.dedup();
    let report = ChaosReport {
        topology: config.topology.clone(),
        endpoints,
        faults,
        orders: config.orders,
        deliveries: shared.deliveries.load(Ordering::Relaxed),
        charges: per_order.values().sum(),
        provider_calls: shared.provider.calls.load(Ordering::Relaxed),
        marked,
        receipts: receipts.values().sum(),
        duplicates,
        acknowledged: acked.len() as u64,
        lost,
        unread,
        abandoned,
        unfinished: unfinished.load(Ordering::Relaxed),
        gave_up: {
            let mut g = std::mem::take(&mut *gave_up.lock().unwrap_or_else(|p| p.into_inner()));
            g.sort_by_key(|g| g.order);
            g
        },
        retried: shared.retried.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        seconds,
    };
    for effects in &shared.nodes {
        effects.ledger().close().await;
    }
    Ok(report)
}

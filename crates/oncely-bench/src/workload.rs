//! The workload: a row's deliveries, the workers that send them, and what
//! they measure, all timed here rather than in the ledger (a [`Timed`]
//! wrapper around it times each claim call as the caller sees it).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures_util::future::{join_all, select_all};
use futures_util::stream::{self, StreamExt, TryStreamExt};
use oncely::backend::Watch;
use oncely::backend::{Capabilities, Claim, Lease, Ledger, Outcome, Record, StoredOutcome};
use oncely::{ClaimOptions, EffectKey, Effects, Error, Failure, OnInProgress, Result, Tenant};
use oncely_any::AnyLedger;

use super::baseline::{Answer, Baseline, Leased};
use super::report::{Latency, RowReport};
use super::{Guard, Mode, Policy, Progress, RowSpec, ServerUse};

/// Bench records are kept this long, as the demo's: enough to inspect them,
/// short enough that `oncely prune` clears them the same day.
const RETENTION: Duration = Duration::from_secs(3600);

/// A delivery that fails retryably (a busy database) is retried this many
/// times before the row gives up, as a broker would keep redelivering.
const MAX_ATTEMPTS: u32 = 50;

/// What the [`Timed`] ledger saw, per row.
struct Stats {
    /// Each claim call's duration.
    claims: Mutex<Vec<Duration>>,
    /// Claim answers "in progress".
    in_progress: AtomicU64,
    /// Per job: a claim of it was answered "in progress" (its duplicate
    /// waited, or was rejected).
    saw_in_progress: Vec<AtomicBool>,
}

impl Stats {
    fn new(jobs: usize) -> Stats {
        Stats {
            claims: Mutex::new(Vec::with_capacity(2 * jobs)),
            in_progress: AtomicU64::new(0),
            saw_in_progress: (0..jobs).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    fn call(&self, took: Duration) {
        self.claims.lock().unwrap_or_else(|p| p.into_inner()).push(took);
    }

    /// A same-guarantees duplicate found job `job`'s lease live.
    fn busy(&self, job: usize) {
        self.in_progress.fetch_add(1, Ordering::Relaxed);
        if let Some(seen) = self.saw_in_progress.get(job) {
            seen.store(true, Ordering::Relaxed);
        }
    }

    fn answered(&self, key: &EffectKey, claim: &Claim) {
        if matches!(claim, Claim::InProgress { .. }) {
            self.in_progress.fetch_add(1, Ordering::Relaxed);
            // The subject of a bench key is its job's number.
            if let Some(seen) = key
                .subject()
                .parse::<usize>()
                .ok()
                .and_then(|j| self.saw_in_progress.get(j))
            {
                seen.store(true, Ordering::Relaxed);
            }
        }
    }
}

/// A ledger that times every `claim` and `claim_many` call and notes which
/// jobs were answered "in progress"; everything else goes straight through.
#[derive(Clone)]
struct Timed<L> {
    inner: L,
    stats: Arc<Stats>,
}

impl<L: Ledger> Ledger for Timed<L> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        let sent = Instant::now();
        let claim = self.inner.claim(key, opts).await;
        self.stats.call(sent.elapsed());
        if let Ok(c) = &claim {
            self.stats.answered(key, c);
        }
        claim
    }

    async fn claim_many(&self, keys: &[EffectKey], opts: &ClaimOptions) -> Result<Vec<Result<Claim>>> {
        let sent = Instant::now();
        let claims = self.inner.claim_many(keys, opts).await;
        self.stats.call(sent.elapsed());
        if let Ok(answers) = &claims {
            for (key, answer) in keys.iter().zip(answers) {
                if let Ok(c) = answer {
                    self.stats.answered(key, c);
                }
            }
        }
        claims
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        self.inner.complete(lease, outcome).await
    }

    async fn complete_many(&self, items: &[(Lease, Outcome)]) -> Vec<Result<()>> {
        self.inner.complete_many(items).await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.inner.release(lease).await
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
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

    async fn watch(&self, key: &EffectKey) -> Watch {
        self.inner.watch(key).await
    }

    fn unique_violation(&self, error: &(dyn std::error::Error + 'static)) -> Option<String> {
        self.inner.unique_violation(error)
    }
}

/// How one delivery of one job ended, as the workload saw it.
#[derive(Debug, Clone, Copy)]
struct Answered {
    /// This delivery ran the effect.
    ran: bool,
    /// It was rejected in flight (`Reject` policy).
    rejected: bool,
    /// When its answer came back to the workload (for the delivery that ran
    /// the effect: when its completion was written).
    at: Instant,
}

/// One row's run: its deliveries and everything they count.
pub(super) struct RowRun {
    spec: RowSpec,
    jobs: usize,
    workers: usize,
    /// The effect keys' tenant and kind (the row's slug).
    tenant: Tenant,
    kind: String,
    ledger: Timed<AnyLedger>,
    effects: Effects<Timed<AnyLedger>>,
    /// For redelivering rejected duplicates, untimed.
    plain: Effects<AnyLedger>,
    opts: ClaimOptions,
    baseline: Arc<Baseline>,
    stats: Arc<Stats>,
    /// Effects executed, per job.
    counts: Vec<AtomicU32>,
    wrong: AtomicU64,
    retries: AtomicU64,
}

/// What a worker tallied from the pairs of deliveries it sent.
#[derive(Default)]
struct Tally {
    wake_ups: Vec<Duration>,
    rejected: Vec<usize>,
}

impl Tally {
    /// Reads the two deliveries of each job: the one that ran the effect
    /// completed it at its `at`; a duplicate that found it in progress and
    /// was not rejected waited, and was woken `dup.at - first.at` later
    /// (zero if it returned first: its answer beat the holder's own).
    fn absorb(&mut self, jobs: Range<usize>, a: &[Answered], b: &[Answered], stats: &Stats) {
        for ((job, x), y) in jobs.zip(a).zip(b) {
            for d in [x, y] {
                if d.rejected {
                    self.rejected.push(job);
                }
            }
            let (first, dup) = match (x.ran, y.ran) {
                (true, false) => (x, y),
                (false, true) => (y, x),
                // Both ran (the row's count shows it) or neither did
                // (only an error could do that): no wait to measure.
                _ => continue,
            };
            if !dup.rejected && stats.saw_in_progress[job].load(Ordering::Relaxed) {
                self.wake_ups.push(dup.at.saturating_duration_since(first.at));
            }
        }
    }

    fn merge(&mut self, other: Tally) {
        self.wake_ups.extend(other.wake_ups);
        self.rejected.extend(other.rejected);
    }
}

/// The outcome of job `job`'s effect.
fn outcome(job: usize) -> String {
    format!("ch_{job}")
}

impl RowRun {
    pub(super) fn new(
        spec: RowSpec,
        jobs: usize,
        workers: usize,
        ledger: &AnyLedger,
        baseline: &Arc<Baseline>,
        tenant: &Tenant,
    ) -> RowRun {
        let stats = Arc::new(Stats::new(jobs));
        let timed = Timed {
            inner: ledger.clone(),
            stats: stats.clone(),
        };
        let policy = match spec.guard {
            Guard::Oncely(Policy::Reject) => OnInProgress::Reject,
            _ => ClaimOptions::default().on_in_progress,
        };
        RowRun {
            spec,
            jobs,
            workers: match spec.mode {
                Mode::Sequential => 1,
                Mode::Concurrent => workers,
            },
            tenant: tenant.clone(),
            kind: spec.slug(),
            effects: match spec.coalescing {
                Some(on) => Effects::new(timed.clone()).coalescing(on),
                None => Effects::new(timed.clone()),
            },
            ledger: timed,
            plain: Effects::new(ledger.clone()),
            opts: ClaimOptions::default()
                .retention(RETENTION)
                .on_in_progress(policy)
                .relaxed_claim(spec.relaxed),
            baseline: baseline.clone(),
            stats,
            counts: (0..jobs).map(|_| AtomicU32::new(0)).collect(),
            wrong: AtomicU64::new(0),
            retries: AtomicU64::new(0),
        }
    }

    /// Runs the row's deliveries (timed), redelivers what was rejected
    /// (untimed), and reports.
    pub(super) async fn run(self, progress: Arc<dyn Progress>) -> Result<RowReport> {
        let name = self.spec.name();
        let row = Arc::new(self);
        progress.start(&name, 2 * row.jobs as u64);
        let started = Instant::now();
        let next = Arc::new(AtomicUsize::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..row.workers {
            tasks.spawn(row.clone().worker(next.clone(), progress.clone()));
        }
        let mut tally = Tally::default();
        while let Some(joined) = tasks.join_next().await {
            // Returning early drops the JoinSet, which aborts the other workers.
            tally.merge(joined.map_err(|e| Error::Misuse(format!("a bench worker panicked: {e}")))??);
        }
        let seconds = started.elapsed().as_secs_f64();
        progress.finish();
        row.redeliver(&tally.rejected).await?;
        Ok(row.report(name, seconds, tally))
    }

    /// Takes the next job (or batch) until none is left and delivers it
    /// twice: one delivery after the other in sequential mode, both at once
    /// in concurrent mode.
    async fn worker(self: Arc<Self>, next: Arc<AtomicUsize>, progress: Arc<dyn Progress>) -> Result<Tally> {
        let mut tally = Tally::default();
        loop {
            let start = next.fetch_add(self.spec.batch, Ordering::Relaxed);
            if start >= self.jobs {
                return Ok(tally);
            }
            let jobs = start..(start + self.spec.batch).min(self.jobs);
            let (a, b) = match self.spec.mode {
                // The second delivery after the first returned is a broker's
                // redelivery (a lost ack), which the broker flags as such;
                // two at once are a re-publication racing the original,
                // which it does not.
                Mode::Sequential => {
                    let a = self.deliver(jobs.clone(), false).await?;
                    (a, self.deliver(jobs.clone(), true).await?)
                }
                Mode::Concurrent => {
                    let (a, b) = tokio::join!(
                        self.deliver(jobs.clone(), false),
                        self.deliver(jobs.clone(), false)
                    );
                    (a?, b?)
                }
            };
            tally.absorb(jobs.clone(), &a, &b, &self.stats);
            progress.delivered(2 * jobs.len() as u64);
        }
    }

    /// One delivery of `jobs` (one job, or a batch): one answer per job.
    /// A `redelivered` delivery tells oncely so (`ClaimOptions::redelivered`),
    /// as a consumer does from the broker's delivery count.
    async fn deliver(&self, jobs: Range<usize>, redelivered: bool) -> Result<Vec<Answered>> {
        match (self.spec.guard, self.spec.batch) {
            (Guard::HandWritten, 1) => Ok(vec![self.baseline_single(jobs.start).await?]),
            (Guard::HandWritten, _) => self.baseline_batch(jobs).await,
            (Guard::Leased, 1) => Ok(vec![self.leased_single(jobs.start).await?]),
            (Guard::Leased, _) => Err(Error::Misuse(
                "the same-guarantees baseline has single claims only".to_owned(),
            )),
            (Guard::Oncely(_), 1) => Ok(vec![self.oncely_single(jobs.start, redelivered).await?]),
            (Guard::Oncely(_), _) => self.oncely_batch(jobs).await,
        }
    }

    fn key(&self, job: usize) -> Result<EffectKey> {
        EffectKey::new(&self.tenant, &self.kind, job.to_string())
    }

    /// The effect: counted, and its outcome returned.
    fn effect(&self, job: usize) -> String {
        self.counts[job].fetch_add(1, Ordering::SeqCst);
        outcome(job)
    }

    fn check(&self, job: usize, answer: &str) {
        if answer != outcome(job) {
            self.wrong.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Waits before retrying a delivery that failed retryably; `false` when
    /// it has been tried often enough.
    async fn retry(&self, attempt: &mut u32, e: &Error) -> bool {
        if !e.is_retryable() || *attempt >= MAX_ATTEMPTS {
            return false;
        }
        self.retries.fetch_add(1, Ordering::Relaxed);
        let pause = Duration::from_millis(2 << (*attempt).min(5)).min(Duration::from_millis(100));
        *attempt += 1;
        tokio::time::sleep(pause).await;
        true
    }

    async fn oncely_single(&self, job: usize, redelivered: bool) -> Result<Answered> {
        if redelivered {
            let opts = self.opts.clone().redelivered(true);
            return self.oncely_run(&self.effects, job, &opts).await;
        }
        self.oncely_run(&self.effects, job, &self.opts).await
    }

    /// `Effects::run` on the job's key, the effect in the handler.
    async fn oncely_run<L: Ledger + 'static>(
        &self,
        effects: &Effects<L>,
        job: usize,
        opts: &ClaimOptions,
    ) -> Result<Answered> {
        let key = self.key(job)?;
        let ran = AtomicBool::new(false);
        let mut attempt = 1;
        loop {
            let result = effects
                .run(&key, opts, |_lease| {
                    ran.store(true, Ordering::Relaxed);
                    let value = self.effect(job);
                    async move { Ok::<_, Failure>(value) }
                })
                .await;
            let at = Instant::now();
            match result {
                Ok(value) => {
                    self.check(job, &value);
                    return Ok(Answered {
                        ran: ran.load(Ordering::Relaxed),
                        rejected: false,
                        at,
                    });
                }
                Err(e) if e.is_in_progress() && opts.on_in_progress == OnInProgress::Reject => {
                    return Ok(Answered {
                        ran: false,
                        rejected: true,
                        at,
                    });
                }
                Err(e) => {
                    if !self.retry(&mut attempt, &e).await {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// A batch consumer's delivery: `claim_many`, the effects of the keys
    /// it acquired, `complete_many`. Keys found in progress are rejected
    /// (`Reject`), or (`Wait`) waited for the way the runner waits for one
    /// key, for the whole batch at once: subscribe to each key
    /// ([`Ledger::watch`]), look once more at once if the watches are
    /// notified (the holder may have finished in between), else wait until
    /// any of them wakes (never past the earliest lease end), and claim the
    /// keys still pending again with one `claim_many`. Keys whose claim
    /// failed retryably are claimed again with them.
    async fn oncely_batch(&self, jobs: Range<usize>) -> Result<Vec<Answered>> {
        let keys: Vec<EffectKey> = jobs.clone().map(|j| self.key(j)).collect::<Result<_>>()?;
        let n = keys.len();
        let max = match self.opts.on_in_progress {
            OnInProgress::Wait { max } => max,
            OnInProgress::Reject => Duration::ZERO,
        };
        let started = Instant::now();
        let mut out: Vec<Option<Answered>> = vec![None; n];
        let mut watches: Vec<Option<Watch>> = (0..n).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..n).collect();
        let mut attempt = 1;
        loop {
            let claimed = if pending.len() == n {
                self.ledger.claim_many(&keys, &self.opts).await
            } else {
                let some: Vec<EffectKey> = pending.iter().map(|&i| keys[i].clone()).collect();
                self.ledger.claim_many(&some, &self.opts).await
            };
            let answers = match claimed {
                Ok(answers) => answers,
                Err(e) => {
                    if self.retry(&mut attempt, &e).await {
                        continue;
                    }
                    return Err(e);
                }
            };
            let answered = Instant::now();
            let done = |ran, rejected| {
                Some(Answered {
                    ran,
                    rejected,
                    at: answered,
                })
            };
            let (mut settle, mut settled, mut waiting) = (Vec::new(), Vec::new(), Vec::new());
            // Never wait past the earliest lease end among the keys in
            // progress: a key may be taken over then.
            let mut bound = max;
            let mut holder = 0;
            for (&i, answer) in pending.iter().zip(answers) {
                let job = jobs.start + i;
                match answer {
                    Ok(Claim::Acquired(lease)) => {
                        settle.push((lease, Outcome::value(&self.effect(job))?));
                        settled.push(i);
                    }
                    Ok(Claim::Completed(record)) => {
                        match record.stored::<String>()? {
                            Some(StoredOutcome::Value(v)) => self.check(job, &v),
                            _ => self.check(job, ""),
                        }
                        out[i] = done(false, false);
                    }
                    Ok(Claim::InProgress { .. }) if max.is_zero() => out[i] = done(false, true),
                    Ok(Claim::InProgress {
                        fence,
                        expires_at,
                        read_at,
                        ..
                    }) => {
                        holder = fence;
                        let left = expires_at.duration_since(read_at).unwrap_or_default();
                        bound = bound.min(left.saturating_add(Duration::from_millis(1)));
                        waiting.push(i);
                    }
                    Ok(other) => {
                        return Err(Error::Misuse(format!(
                            "{}: a bench claim was answered {}",
                            keys[i],
                            other.label()
                        )));
                    }
                    Err(e) if e.is_retryable() && attempt < MAX_ATTEMPTS => {
                        attempt += 1;
                        self.retries.fetch_add(1, Ordering::Relaxed);
                        waiting.push(i);
                    }
                    Err(e) => return Err(e),
                }
            }
            if !settle.is_empty() {
                let completed = self.ledger.complete_many(&settle).await;
                let at = Instant::now();
                for (result, &i) in completed.into_iter().zip(&settled) {
                    result?;
                    out[i] = Some(Answered {
                        ran: true,
                        rejected: false,
                        at,
                    });
                }
            }
            if waiting.is_empty() {
                break;
            }
            pending = waiting;
            // Subscribe to the keys met in progress for the first time; if
            // they are notified, look again before waiting.
            let new: Vec<usize> = pending
                .iter()
                .copied()
                .filter(|&i| watches[i].is_none())
                .collect();
            let taken = join_all(new.iter().map(|&i| self.ledger.watch(&keys[i]))).await;
            let mut notified = false;
            for (&i, watch) in new.iter().zip(taken) {
                notified |= watch.is_notified();
                watches[i] = Some(watch);
            }
            if notified {
                continue;
            }
            let waited = started.elapsed();
            if waited >= max {
                return Err(Error::InProgress {
                    key: keys[pending[0]].to_string(),
                    fence: holder,
                });
            }
            let until = Instant::now() + bound.min(max - waited);
            // Any key changing is reason enough to look at all of them: the
            // holder of a batch completes it at once.
            let changes: Vec<_> = watches
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| pending.contains(i))
                .filter_map(|(_, w)| w.as_mut())
                .map(|w| Box::pin(w.changed(until)))
                .collect();
            if !changes.is_empty() {
                select_all(changes).await;
            }
        }
        out.into_iter()
            .map(|a| a.ok_or_else(|| Error::Misuse("a batch left a key unanswered".to_owned())))
            .collect()
    }

    async fn baseline_single(&self, job: usize) -> Result<Answered> {
        let key = self.baseline.key(&self.kind, job);
        let outcome = outcome(job);
        let mut attempt = 1;
        let answer = loop {
            let sent = Instant::now();
            let answer = self.baseline.claim(&key, &outcome).await;
            self.stats.call(sent.elapsed());
            match answer {
                Ok(a) => break a,
                Err(e) => {
                    if !self.retry(&mut attempt, &e).await {
                        return Err(e);
                    }
                }
            }
        };
        Ok(self.baseline_answered(job, answer))
    }

    /// The same guarantees by hand: take the key's lease (or find its
    /// outcome), run the effect, complete fenced; a duplicate that finds
    /// the lease live polls, 1 ms at first, doubling up to 50 ms.
    async fn leased_single(&self, job: usize) -> Result<Answered> {
        let key = self.baseline.key(&self.kind, job);
        let mut attempt = 1;
        let mut pause = Duration::from_millis(1);
        loop {
            let sent = Instant::now();
            let answer = self.baseline.lease(&key).await;
            self.stats.call(sent.elapsed());
            let answer = match answer {
                Ok(a) => a,
                Err(e) => {
                    if !self.retry(&mut attempt, &e).await {
                        return Err(e);
                    }
                    continue;
                }
            };
            match answer {
                Leased::Won(fence) => {
                    let value = self.effect(job);
                    loop {
                        match self.baseline.finish(&key, fence, &value).await {
                            Ok(true) => break,
                            Ok(false) => {
                                return Err(Error::Misuse(format!(
                                    "bench baseline: {key}: the lease was taken over before its completion"
                                )));
                            }
                            Err(e) => {
                                if !self.retry(&mut attempt, &e).await {
                                    return Err(e);
                                }
                            }
                        }
                    }
                    return Ok(Answered {
                        ran: true,
                        rejected: false,
                        at: Instant::now(),
                    });
                }
                Leased::Done(stored) => {
                    self.check(job, &stored);
                    return Ok(Answered {
                        ran: false,
                        rejected: false,
                        at: Instant::now(),
                    });
                }
                Leased::Busy => {
                    self.stats.busy(job);
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
            }
        }
    }

    async fn baseline_batch(&self, jobs: Range<usize>) -> Result<Vec<Answered>> {
        let items: Vec<(String, String)> = jobs
            .clone()
            .map(|j| (self.baseline.key(&self.kind, j), outcome(j)))
            .collect();
        let mut attempt = 1;
        let answers = loop {
            let sent = Instant::now();
            let answers = self.baseline.claim_many(&items).await;
            self.stats.call(sent.elapsed());
            match answers {
                Ok(a) => break a,
                Err(e) => {
                    if !self.retry(&mut attempt, &e).await {
                        return Err(e);
                    }
                }
            }
        };
        Ok(jobs
            .zip(answers)
            .map(|(job, answer)| self.baseline_answered(job, answer))
            .collect())
    }

    fn baseline_answered(&self, job: usize, answer: Answer) -> Answered {
        let ran = match answer {
            Answer::Won => {
                self.effect(job);
                true
            }
            Answer::Duplicate(stored) => {
                self.check(job, &stored);
                false
            }
        };
        Answered {
            ran,
            rejected: false,
            at: Instant::now(),
        }
    }

    /// Delivers each rejected duplicate again, after the timed part, as a
    /// broker would: it must get the stored outcome without running the
    /// effect (if it ran it, the row's count shows it).
    async fn redeliver(&self, rejected: &[usize]) -> Result<()> {
        let opts = self
            .opts
            .clone()
            .on_in_progress(ClaimOptions::default().on_in_progress);
        stream::iter(rejected.iter().copied())
            .map(|job| self.oncely_run(&self.plain, job, &opts))
            .buffer_unordered(self.workers.max(1))
            .try_collect::<Vec<_>>()
            .await
            .map(drop)
    }

    fn report(&self, name: String, seconds: f64, tally: Tally) -> RowReport {
        let counts: Vec<u32> = self.counts.iter().map(|c| c.load(Ordering::SeqCst)).collect();
        let claims = std::mem::take(&mut *self.stats.claims.lock().unwrap_or_else(|p| p.into_inner()));
        let deliveries = 2 * self.jobs as u64;
        RowReport {
            name,
            mode: self.spec.mode,
            batch: self.spec.batch as u64,
            guard: self.spec.guard,
            policy: match self.spec.guard {
                Guard::Oncely(p) => Some(p),
                Guard::HandWritten | Guard::Leased => None,
            },
            coalescing: match self.spec.guard {
                Guard::Oncely(_) => Some(
                    self.spec
                        .coalescing
                        .unwrap_or(self.ledger.capabilities().coalescing),
                ),
                Guard::HandWritten | Guard::Leased => None,
            },
            relaxed_claim: self.spec.relaxed,
            guard_name: self.spec.guard_name(),
            jobs: self.jobs as u64,
            deliveries,
            seconds,
            deliveries_per_sec: deliveries as f64 / seconds.max(1e-9),
            claim_calls: claims.len() as u64,
            claim_latency: Latency::of(claims),
            in_progress_answers: self.stats.in_progress.load(Ordering::Relaxed),
            waiters: tally.wake_ups.len() as u64,
            wake_up_latency: Latency::of(tally.wake_ups),
            rejected: tally.rejected.len() as u64,
            retries: self.retries.load(Ordering::Relaxed),
            effects: counts.iter().map(|&c| u64::from(c)).sum(),
            jobs_run_twice: counts.iter().filter(|&&c| c > 1).count() as u64,
            jobs_not_run: counts.iter().filter(|&&c| c == 0).count() as u64,
            wrong_outcomes: self.wrong.load(Ordering::Relaxed),
            ratio: None,
            ratio_leased: None,
            server: ServerUse::default(),
            cpu_ratio: None,
        }
    }
}

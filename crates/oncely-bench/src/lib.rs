//! # oncely-bench
//!
//! The duplicate-storm bench behind `oncely bench`, measured next to the
//! hand-written minimum on the same server in the same run. The ledger is
//! opened through `oncely-any` ([`AnyLedger`]); the baselines talk to the
//! same database with its own driver (sqlx, redis, async-nats), enabled by
//! the backend's cargo feature (`sqlite`, `postgres`, `mysql`, `redis`,
//! `nats`; all on by default).
//!
//! `jobs` jobs are each delivered twice:
//!
//! - **sequential**: one worker, the second delivery of a job right after
//!   the first returned (the duplicate finds the effect completed);
//! - **concurrent**: `workers` workers, each taking the next job and
//!   dispatching both of its deliveries at the same instant (one of them
//!   finds the effect in progress).
//!
//! Each mode runs with single claims ([`Effects::run`](oncely::Effects::run),
//! under the `Wait` policy and, concurrently, under `Reject`) and with batches
//! of `batch` jobs ([`Ledger::claim_many`] /
//! [`Ledger::complete_many`]; keys a batch
//! finds in progress are then waited for through `Effects::run`, or rejected).
//! Next to each, the hand-written minimum on the same database: the
//! delivery inserts its outcome if the key is absent and runs the effect if
//! it inserted, and a duplicate reads the stored outcome (PostgreSQL
//! `INSERT … ON CONFLICT DO NOTHING RETURNING` + `SELECT`, MySQL `INSERT
//! IGNORE` + `SELECT`, SQLite `INSERT … ON CONFLICT DO NOTHING` + `SELECT`,
//! Redis `SET NX PX` + `GET`, NATS KV `create` + `get`, and a mutex-guarded
//! map for `memory:`). It does not survive a crash between the insert and the
//! effect, and a duplicate never waits: that is the floor oncely is compared
//! with.
//!
//! Single claims also run through hand-written code with oncely's
//! guarantees ([`Guard::Leased`]: an in-progress row with a lease, a fenced
//! completion, a duplicate that polls), so a report separates what the
//! guarantee costs from what oncely's implementation costs
//! ([`RowReport::ratio_leased`]). The concurrent single `Wait` row also runs
//! with coalescing the other way round from the backend's default, and on
//! PostgreSQL the single rows also run with relaxed claim durability
//! ([`RowSpec::relaxed`]).
//!
//! Every row counts the effects it executed: each job's must run exactly
//! once ([`BenchReport::problems`] names any row where one ran twice, or
//! never). A delivery rejected under the `Reject` policy is delivered again
//! after the row's timed part, as a broker would redeliver it, and must get
//! the stored outcome.
//!
//! Around each row the bench reads the server's own counters and reports
//! what it did per job ([`RowReport::server`], [`ServerUse`]): its CPU
//! (`/proc` for a server on this machine, `INFO cpu` on Redis), and where
//! the backend counts them live PostgreSQL's write transactions and WAL
//! bytes, MariaDB's statements and fsyncs, Redis's commands and scripts;
//! [`RowReport::cpu_ratio`] puts the CPU next to the floor's. They are the
//! server's totals: run the bench on a server nobody else uses meanwhile.
//!
//! Each run has its own tenant (`bench-<run id>`, records kept one hour, as
//! the demo's) and its own baseline table, bucket or keys, removed at the
//! end. [`run`] returns a [`BenchReport`]; it prints nothing.
//!
//! The code, by file: `workload.rs` (the deliveries, the workers and what
//! they measure), `baseline/` (the hand-written code, per backend, and
//! where it reads its server's counters), `server.rs` (those counters, per
//! job), `report.rs` (what a run reports, and its tables).
#![forbid(unsafe_code)]
#![deny(missing_docs)]
// A worker's future (a row's deliveries through `Effects::run` on any
// backend) nests past the default 128 when its layout is computed ("queries
// overflow the depth limit").
#![recursion_limit = "256"]

use std::sync::Arc;

use oncely::backend::Ledger;
use oncely::{Error, Result, Tenant};
use oncely_any::AnyLedger;
use oncely_any::scratch::{run_id, scratch_dir, scratch_ledger, sqlite_url};
use serde::Serialize;

mod baseline;
mod report;
mod server;
mod workload;

use baseline::Baseline;
pub use report::{BenchReport, Latency, RowReport};
pub use server::ServerUse;
use workload::RowRun;

/// What the bench runs.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// How many jobs; each is delivered twice.
    pub jobs: u32,
    /// Workers of the concurrent rows (each has one job's two deliveries in
    /// flight).
    pub workers: usize,
    /// Jobs per batch in the batch rows.
    pub batch: usize,
    /// Where the ledger and the baseline live; `None` means a fresh SQLite
    /// file in a temporary directory, removed afterwards.
    pub database_url: Option<String>,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            jobs: 5_000,
            workers: 8,
            batch: 100,
            database_url: None,
        }
    }
}

impl BenchConfig {
    /// Refuses configurations that cannot run, before anything is opened.
    pub fn validate(&self) -> Result<()> {
        if !(1..=1_000_000).contains(&self.jobs) {
            return Err(Error::Config("jobs must be between 1 and 1 000 000".to_owned()));
        }
        if !(1..=1024).contains(&self.workers) {
            return Err(Error::Config("workers must be between 1 and 1024".to_owned()));
        }
        // 1000 keys and outcomes stay within every backend's bind limits
        // (SQLite's 32 766, MySQL's 65 535 placeholders).
        if !(1..=1000).contains(&self.batch) {
            return Err(Error::Config("batch must be between 1 and 1000".to_owned()));
        }
        Ok(())
    }
}

/// How the two deliveries of a job arrive.
// Exhaustive by design (ARCHITECTURE.md, API boundaries): the report has a row for each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// One after the other, on one worker.
    Sequential,
    /// Both at the same instant, on each of `workers` workers.
    Concurrent,
}

impl Mode {
    /// `sequential` or `concurrent`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Sequential => "sequential",
            Mode::Concurrent => "concurrent",
        }
    }
}

/// Who decides that a delivery is a duplicate. In JSON: `hand-written` or
/// `oncely` (a row's policy is a field of its own).
// Exhaustive by design (ARCHITECTURE.md, API boundaries): the baseline and oncely, the ratio's two sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guard {
    /// The hand-written minimum on the same database (see the module docs).
    HandWritten,
    /// The same guarantees as oncely's, by hand, on the same database: an
    /// in-progress row with a lease, a fenced completion, a duplicate that
    /// polls while the lease is live (single claims only).
    Leased,
    /// oncely, with this in-progress policy.
    Oncely(Policy),
}

/// What an oncely duplicate does when it finds the effect in progress.
// Exhaustive by design (ARCHITECTURE.md, API boundaries): mirrors OnInProgress, which is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// `OnInProgress::Wait`: wait for the holder to finish.
    Wait,
    /// `OnInProgress::Reject`: fail at once; the broker redelivers.
    Reject,
}

impl Serialize for Guard {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(match self {
            Guard::HandWritten => "hand-written",
            Guard::Leased => "hand-written-leased",
            Guard::Oncely(_) => "oncely",
        })
    }
}

impl Guard {
    /// `hand-written`, `hand-written, leased`, `oncely Wait` or `oncely Reject`.
    pub fn name(self) -> &'static str {
        match self {
            Guard::HandWritten => "hand-written",
            Guard::Leased => "hand-written, leased",
            Guard::Oncely(Policy::Wait) => "oncely Wait",
            Guard::Oncely(Policy::Reject) => "oncely Reject",
        }
    }
}

/// One row of the bench: how deliveries arrive, how many keys a claim
/// carries, and who guards them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowSpec {
    /// Sequential or concurrent deliveries.
    pub mode: Mode,
    /// Keys per claim: 1 for single claims, else the batch size.
    pub batch: usize,
    /// Hand-written or oncely.
    pub guard: Guard,
    /// Whether oncely gathers the row's concurrent claims and completions
    /// into batched statements ([`Effects::coalescing`](oncely::Effects::coalescing)):
    /// `None` for the backend's default, and for the hand-written rows,
    /// which have nothing to gather.
    pub coalescing: Option<bool>,
    /// Whether oncely's claims are acknowledged before their flush
    /// ([`ClaimOptions::relaxed_claim`](oncely::ClaimOptions::relaxed_claim);
    /// PostgreSQL only). The completion is flushed either way.
    pub relaxed: bool,
}

impl RowSpec {
    /// The rows of a run, each oncely row after the hand-written row it is
    /// compared with. Sequential rows have no oncely `Reject` row: a
    /// sequential duplicate never finds the effect in progress, so both
    /// policies do the same. Single claims also run through the
    /// same-guarantees hand-written code, and concurrent single claims under
    /// `Wait` also with coalescing the other way round from the backend's
    /// default (`coalescing`), to show what it gains or costs.
    ///
    /// With `relaxed` (a backend that honours
    /// [`ClaimOptions::relaxed_claim`](oncely::ClaimOptions::relaxed_claim)),
    /// single claims also run with relaxed claim durability.
    pub fn all(batch: usize, coalescing: bool, relaxed: bool) -> Vec<RowSpec> {
        let mut rows = Vec::new();
        let row = |mode, batch, guard, coalescing| RowSpec {
            mode,
            batch,
            guard,
            coalescing,
            relaxed: false,
        };
        for mode in [Mode::Sequential, Mode::Concurrent] {
            for size in [1, batch] {
                rows.push(row(mode, size, Guard::HandWritten, None));
                if size == 1 {
                    rows.push(row(mode, size, Guard::Leased, None));
                }
                rows.push(row(mode, size, Guard::Oncely(Policy::Wait), None));
                if relaxed && size == 1 {
                    rows.push(RowSpec {
                        relaxed: true,
                        ..row(mode, size, Guard::Oncely(Policy::Wait), None)
                    });
                }
                if mode == Mode::Concurrent && size == 1 {
                    rows.push(row(mode, size, Guard::Oncely(Policy::Wait), Some(!coalescing)));
                }
                if mode == Mode::Concurrent {
                    rows.push(row(mode, size, Guard::Oncely(Policy::Reject), None));
                }
            }
        }
        rows
    }

    /// How tables name the row's guard: `hand-written`, `oncely` (both
    /// policies, sequentially), `oncely Wait`, `oncely Wait, coalescing off`.
    pub fn guard_name(&self) -> String {
        let guard = match (self.mode, self.guard) {
            // Both policies act alike on sequential duplicates.
            (Mode::Sequential, Guard::Oncely(_)) => "oncely",
            (_, g) => g.name(),
        };
        let guard = match self.coalescing {
            Some(true) => format!("{guard}, coalescing on"),
            Some(false) => format!("{guard}, coalescing off"),
            None => guard.to_owned(),
        };
        if self.relaxed {
            format!("{guard}, relaxed claim")
        } else {
            guard
        }
    }

    /// `single` or `batch N`.
    pub fn claims(&self) -> String {
        if self.batch == 1 {
            "single".to_owned()
        } else {
            format!("batch {}", self.batch)
        }
    }

    /// How messages name the row: `concurrent, batch 100, oncely Wait`.
    pub fn name(&self) -> String {
        format!("{}, {}, {}", self.mode.name(), self.claims(), self.guard_name())
    }

    /// A short, key-safe name, unique per row: the kind of its effect keys
    /// and the prefix of its baseline keys (`s1-hw`, `c100-reject`).
    fn slug(&self) -> String {
        let mode = match self.mode {
            Mode::Sequential => 's',
            Mode::Concurrent => 'c',
        };
        let guard = match self.guard {
            Guard::HandWritten => "hw",
            Guard::Leased => "lease",
            Guard::Oncely(Policy::Wait) => "wait",
            Guard::Oncely(Policy::Reject) => "reject",
        };
        let solo = match self.coalescing {
            Some(true) => "-gather",
            Some(false) => "-solo",
            None => "",
        };
        let relaxed = if self.relaxed { "-rx" } else { "" };
        format!("{mode}{}-{guard}{solo}{relaxed}", self.batch)
    }
}

/// Hears about the bench's progress (the binary draws a progress bar).
pub trait Progress: Send + Sync {
    /// A row starts with this many deliveries.
    fn start(&self, _row: &str, _deliveries: u64) {}
    /// `n` more deliveries were answered.
    fn delivered(&self, _n: u64) {}
    /// The row finished.
    fn finish(&self) {}
}

/// A [`Progress`] that ignores everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;

impl Progress for NoProgress {}

/// Runs every row ([`RowSpec::all`]) on the database and reports.
///
/// Opens the ledger (creating its schema, as `demo` does) and the baseline's
/// table, bucket or connection; removes the baseline's data at the end,
/// whether the rows succeeded or not. An effect that ran twice is not an
/// error here: it is in the report ([`BenchReport::problems`]), for the
/// caller to fail on.
pub async fn run(config: &BenchConfig, progress: Arc<dyn Progress>) -> Result<BenchReport> {
    config.validate()?;
    let run_id = run_id();
    // The temporary directory lives until the end of this function and is
    // removed on drop, after the pools are closed.
    let (url, scratch) = match &config.database_url {
        Some(url) => (url.clone(), None),
        None => {
            let dir = scratch_dir("oncely-bench-")?;
            let url = sqlite_url(&dir.path().join("oncely-bench.db"));
            (url, Some(dir))
        }
    };
    let ledger = match &scratch {
        Some(_) => scratch_ledger(&url).await?,
        None => AnyLedger::connect(&url).await?,
    };
    let result = match Baseline::open(&ledger, &url, &run_id).await {
        Ok(baseline) => {
            let baseline = Arc::new(baseline);
            // Only PostgreSQL acts on a relaxed claim.
            let relaxed = ledger.backend() == "postgres";
            let rows = RowSpec::all(config.batch, ledger.capabilities().coalescing, relaxed);
            let processes = server::local_processes(ledger.backend(), &url);
            let report = run_rows(config, &run_id, &rows, &ledger, &baseline, processes, progress).await;
            // Remove the baseline's data whatever happened; a failure to do
            // so must not hide the run's own error.
            let keys: Vec<String> = rows
                .iter()
                .filter(|r| !matches!(r.guard, Guard::Oncely(_)))
                .flat_map(|r| (0..config.jobs as usize).map(|job| baseline.key(&r.slug(), job)))
                .collect();
            let cleaned = baseline.remove(&keys).await;
            report.and_then(|r| cleaned.map(|()| r))
        }
        Err(e) => Err(e),
    };
    ledger.close().await;
    result
}

async fn run_rows(
    config: &BenchConfig,
    run_id: &str,
    rows: &[RowSpec],
    ledger: &AnyLedger,
    baseline: &Arc<Baseline>,
    processes: &[&str],
    progress: Arc<dyn Progress>,
) -> Result<BenchReport> {
    let tenant = Tenant::new(format!("bench-{run_id}"))?;
    warm_up(ledger, &tenant, config.workers).await?;
    let mut reports: Vec<RowReport> = Vec::with_capacity(rows.len());
    for &spec in rows {
        let run = RowRun::new(
            spec,
            config.jobs as usize,
            config.workers,
            ledger,
            baseline,
            &tenant,
        );
        // The server's counters around the row, its redeliveries included;
        // CPU from /proc where the backend does not report its own.
        let sample = || async {
            let (mut s, own) = baseline.sample().await?;
            s.cpu_us = s.cpu_us.or_else(|| server::proc_cpu_us(processes));
            Ok::<_, Error>((s, own))
        };
        let (before, own) = sample().await?;
        let mut row = run.run(progress.clone()).await?;
        let (after, _) = sample().await?;
        row.server = before.until(&after, row.jobs, own);
        let floor = reports
            .iter()
            .find(|r| r.mode == spec.mode && r.batch == spec.batch as u64 && r.guard == Guard::HandWritten);
        row.cpu_ratio = match (
            row.server.cpu_us_per_job,
            floor.and_then(|f| f.server.cpu_us_per_job),
        ) {
            (Some(cpu), Some(f)) if f > 0.0 => Some(cpu / f),
            (Some(_), _) if spec.guard == Guard::HandWritten => Some(1.0),
            _ => None,
        };
        let over = |guard: Guard| {
            reports
                .iter()
                .find(|r| r.mode == spec.mode && r.batch == spec.batch as u64 && r.guard == guard)
                .map(|b| row.deliveries_per_sec / b.deliveries_per_sec)
        };
        row.ratio = over(Guard::HandWritten).or((spec.guard == Guard::HandWritten).then_some(1.0));
        row.ratio_leased = match spec.guard {
            Guard::Oncely(_) => over(Guard::Leased),
            Guard::Leased => Some(1.0),
            Guard::HandWritten => None,
        };
        reports.push(row);
    }
    Ok(BenchReport {
        backend: ledger.backend(),
        jobs: u64::from(config.jobs),
        deliveries_per_job: 2,
        workers: config.workers as u64,
        batch: config.batch as u64,
        tenant: tenant.as_str().to_owned(),
        baseline: baseline.describe(),
        baseline_leased: baseline.describe_leased(),
        rows: reports,
    })
}

/// Opens the pool's connections before the first timed row, so that no
/// row pays for them: as many concurrent reads as the concurrent rows have
/// deliveries in flight. Reads of absent keys write nothing.
async fn warm_up(ledger: &AnyLedger, tenant: &Tenant, workers: usize) -> Result<()> {
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..2 * workers {
        let ledger = ledger.clone();
        let key = oncely::EffectKey::new(tenant, "warm-up", i.to_string())?;
        tasks.spawn(async move { ledger.get(&key).await.map(drop) });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.map_err(|e| Error::Misuse(format!("a warm-up task panicked: {e}")))??;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_pair_each_oncely_row_with_its_baseline() {
        assert_eq!(
            RowSpec::all(100, false, false)[8].name(),
            "concurrent, single, oncely Wait, coalescing on"
        );
        assert_eq!(RowSpec::all(100, true, true).len(), 15);
        let rows = RowSpec::all(100, true, false);
        assert_eq!(rows.len(), 13);
        let names: Vec<String> = rows.iter().map(RowSpec::name).collect();
        assert_eq!(names[0], "sequential, single, hand-written");
        assert_eq!(names[1], "sequential, single, hand-written, leased");
        assert_eq!(names[2], "sequential, single, oncely");
        assert_eq!(names[8], "concurrent, single, oncely Wait, coalescing off");
        assert_eq!(names[12], "concurrent, batch 100, oncely Reject");
        for (i, r) in rows.iter().enumerate() {
            if matches!(r.guard, Guard::Oncely(_)) {
                assert!(
                    rows[..i]
                        .iter()
                        .any(|b| b.guard == Guard::HandWritten && b.mode == r.mode && b.batch == r.batch),
                    "{}",
                    r.name()
                );
            }
        }
        let mut slugs: Vec<String> = rows.iter().map(RowSpec::slug).collect();
        slugs.sort();
        slugs.dedup();
        assert_eq!(slugs.len(), rows.len(), "one key space per row");
    }

    #[test]
    fn bad_configs_are_refused() {
        for bad in [
            BenchConfig {
                jobs: 0,
                ..BenchConfig::default()
            },
            BenchConfig {
                workers: 0,
                ..BenchConfig::default()
            },
            BenchConfig {
                batch: 0,
                ..BenchConfig::default()
            },
            BenchConfig {
                batch: 1001,
                ..BenchConfig::default()
            },
        ] {
            assert!(matches!(bad.validate(), Err(Error::Config(_))), "{bad:?}");
        }
        BenchConfig::default().validate().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn memory_bench_runs_each_effect_once() {
        let config = BenchConfig {
            jobs: 120,
            workers: 4,
            batch: 50,
            database_url: Some("memory:".to_owned()),
        };
        let report = run(&config, Arc::new(NoProgress)).await.unwrap();
        assert_eq!(report.backend, "memory");
        assert_eq!(report.rows.len(), 13);
        for row in &report.rows {
            assert_eq!(row.deliveries, 240, "{row:?}");
            assert_eq!(row.effects, 120, "{row:?}");
            assert_eq!(
                row.jobs_run_twice + row.jobs_not_run + row.wrong_outcomes,
                0,
                "{row:?}"
            );
            assert!(row.ratio.is_some(), "{row:?}");
            // No server: nothing to count.
            assert!(row.server.is_empty() && row.cpu_ratio.is_none(), "{row:?}");
        }
        assert!(report.server_table().is_none());
        assert!(report.problems().is_empty(), "{:?}", report.problems());
    }
}

//! What the bench reports: one [`RowReport`] per row, the [`BenchReport`]
//! over all of them, its [`problems`](BenchReport::problems), and its table.

use std::time::Duration;

use comfy_table::presets::NOTHING;
use comfy_table::{CellAlignment, Table};
use serde::Serialize;

use super::{Guard, Mode, Policy, ServerUse};

/// The median and the 99th percentile of a set of durations, in
/// microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Latency {
    /// The median.
    pub p50_us: u64,
    /// The 99th percentile.
    pub p99_us: u64,
    /// How many samples.
    pub samples: u64,
}

impl Latency {
    /// The percentiles of `samples`; `None` when there are none.
    pub fn of(mut samples: Vec<Duration>) -> Option<Latency> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        // Nearest rank: the smallest sample with at least p% at or below it.
        let rank = |p: usize| samples[(samples.len() * p).div_ceil(100).max(1) - 1];
        let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        Some(Latency {
            p50_us: us(rank(50)),
            p99_us: us(rank(99)),
            samples: samples.len() as u64,
        })
    }
}

/// The result of one row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RowReport {
    /// How messages name the row (`concurrent, batch 100, oncely Wait`).
    pub name: String,
    /// Sequential or concurrent deliveries.
    pub mode: Mode,
    /// Keys per claim: 1 for single claims.
    pub batch: u64,
    /// Hand-written or oncely.
    pub guard: Guard,
    /// oncely's in-progress policy (`None` for the hand-written rows).
    pub policy: Option<Policy>,
    /// Whether oncely coalesced the row's claims and completions (`None`
    /// for the hand-written rows).
    pub coalescing: Option<bool>,
    /// Whether oncely's claims were acknowledged before their flush
    /// (`relaxed_claim`; PostgreSQL only).
    pub relaxed_claim: bool,
    /// How the table names the guard (`oncely Wait, coalescing off`).
    pub guard_name: String,
    /// Jobs of the row.
    pub jobs: u64,
    /// Deliveries answered in the timed part (jobs × 2).
    pub deliveries: u64,
    /// Wall-clock time of the timed part.
    pub seconds: f64,
    /// Deliveries answered per second.
    pub deliveries_per_sec: f64,
    /// Claim round trips: `claim` or `claim_many` calls for oncely (a
    /// waiting duplicate claims again when it wakes), the insert (and the
    /// read on a duplicate) for the hand-written code.
    pub claim_calls: u64,
    /// The latency of those calls, as the workload timed them.
    pub claim_latency: Option<Latency>,
    /// Claims answered "in progress" (oncely only).
    pub in_progress_answers: u64,
    /// Duplicates that found the effect in progress, waited, and returned
    /// after the first delivery had.
    pub waiters: u64,
    /// For each waiter: from the first delivery's return (its effect
    /// completed) to the waiter's return, both timed by the workload.
    pub wake_up_latency: Option<Latency>,
    /// Duplicates rejected in flight (`Reject` policy), delivered again
    /// after the timed part.
    pub rejected: u64,
    /// Deliveries retried after a retryable error (a busy database), as a
    /// broker would redeliver them.
    pub retries: u64,
    /// Effects executed; must equal `jobs`.
    pub effects: u64,
    /// Jobs whose effect ran more than once.
    pub jobs_run_twice: u64,
    /// Jobs whose effect never ran.
    pub jobs_not_run: u64,
    /// Deliveries answered with an outcome other than their job's.
    pub wrong_outcomes: u64,
    /// Deliveries per second over those of the hand-written row with the
    /// same mode and batch size (1 for that row itself).
    pub ratio: Option<f64>,
    /// Deliveries per second over those of the same-guarantees hand-written
    /// row with the same mode and batch size (single claims only; 1 for
    /// that row itself).
    pub ratio_leased: Option<f64>,
    /// What the server did per job, from its own counters
    /// ([`ServerUse`]; empty where it has none, as SQLite and memory).
    pub server: ServerUse,
    /// Server CPU per job over the hand-written row's with the same mode
    /// and batch size (1 for that row itself).
    pub cpu_ratio: Option<f64>,
}

/// The bench's result: every row, on one database, in one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchReport {
    /// The ledger's backend (`sqlite`, `postgres`, `mysql`, `redis`, `nats`,
    /// `memory`).
    pub backend: &'static str,
    /// Jobs per row.
    pub jobs: u64,
    /// Deliveries of each job (2).
    pub deliveries_per_job: u64,
    /// Workers of the concurrent rows.
    pub workers: u64,
    /// Jobs per batch in the batch rows.
    pub batch: u64,
    /// The tenant of this run's effect keys (`bench-<run id>`).
    pub tenant: String,
    /// What the hand-written rows do on this backend.
    pub baseline: &'static str,
    /// What the same-guarantees hand-written rows do on this backend.
    pub baseline_leased: &'static str,
    /// The rows, in the order they ran.
    pub rows: Vec<RowReport>,
}

impl BenchReport {
    /// What went wrong, one message per row that names it: an effect that
    /// ran twice or never, a delivery answered with another job's outcome.
    /// Empty when every row did its job; the command exits 1 otherwise.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for r in &self.rows {
            if r.effects != r.jobs || r.jobs_run_twice > 0 || r.jobs_not_run > 0 {
                problems.push(format!(
                    "row '{}': {} effects executed for {} jobs ({} job(s) ran more than once, {} never ran)",
                    r.name, r.effects, r.jobs, r.jobs_run_twice, r.jobs_not_run
                ));
            }
            if r.wrong_outcomes > 0 {
                problems.push(format!(
                    "row '{}': {} deliveries were answered with an outcome that is not their job's",
                    r.name, r.wrong_outcomes
                ));
            }
        }
        problems
    }

    /// The rows as a borderless table, one line per row: mode, claims,
    /// guard, deliveries/s, claim latency p50 and p99, wake-up latency p50
    /// and p99, effects, and the ratio to the hand-written row. The binary
    /// prints it.
    pub fn table(&self) -> Table {
        let mut table = Table::new();
        table.load_preset(NOTHING).set_header([
            "mode",
            "claims",
            "guard",
            "deliveries/s",
            "claim p50",
            "claim p99",
            "wake-up p50",
            "wake-up p99",
            "effects",
            "ratio",
            "vs leased",
        ]);
        for r in &self.rows {
            let guard = &r.guard_name;
            let latency = |l: Option<Latency>, pick: fn(&Latency) -> u64| {
                l.as_ref().map_or("–".to_owned(), |l| micros(pick(l)))
            };
            table.add_row([
                r.mode.name().to_owned(),
                claims(r.batch),
                guard.to_owned(),
                format!("{:.0}", r.deliveries_per_sec),
                latency(r.claim_latency, |l| l.p50_us),
                latency(r.claim_latency, |l| l.p99_us),
                latency(r.wake_up_latency, |l| l.p50_us),
                latency(r.wake_up_latency, |l| l.p99_us),
                r.effects.to_string(),
                r.ratio.map_or("–".to_owned(), |x| format!("{x:.2}")),
                r.ratio_leased.map_or("–".to_owned(), |x| format!("{x:.2}")),
            ]);
        }
        align(&mut table);
        table
    }
}

impl BenchReport {
    /// What the server did per job, one line per row, with a column for
    /// each counter the backend has ([`ServerUse`]); `None` when it has
    /// none (SQLite, memory). The binary prints it under [`BenchReport::table`].
    pub fn server_table(&self) -> Option<Table> {
        let columns: [Column; 7] = [
            (
                "CPU/job",
                |r| r.server.cpu_us_per_job,
                |x| micros(x.round() as u64),
            ),
            ("CPU vs floor", |r| r.cpu_ratio, |x| format!("{x:.2}")),
            (
                "statements/job",
                |r| r.server.statements_per_job,
                |x| format!("{x:.2}"),
            ),
            ("scripts/job", |r| r.server.scripts_per_job, |x| format!("{x:.2}")),
            (
                "write txns/job",
                |r| r.server.write_transactions_per_job,
                |x| format!("{x:.2}"),
            ),
            ("fsyncs/job", |r| r.server.fsyncs_per_job, |x| format!("{x:.2}")),
            ("WAL/job", |r| r.server.wal_bytes_per_job, |x| format!("{x:.0} B")),
        ];
        let present: Vec<_> = columns
            .iter()
            .filter(|(_, pick, _)| self.rows.iter().any(|r| pick(r).is_some()))
            .collect();
        if present.is_empty() {
            return None;
        }
        let mut table = Table::new();
        let mut header = vec!["mode", "claims", "guard"];
        header.extend(present.iter().map(|(name, _, _)| *name));
        table.load_preset(NOTHING).set_header(header);
        for r in &self.rows {
            let mut line = vec![r.mode.name().to_owned(), claims(r.batch), r.guard_name.clone()];
            line.extend(
                present
                    .iter()
                    .map(|(_, pick, show)| pick(r).map_or("–".to_owned(), show)),
            );
            table.add_row(line);
        }
        align(&mut table);
        Some(table)
    }
}

/// A column of the server table: its header, what it reads of a row, and
/// how it prints that.
type Column = (&'static str, fn(&RowReport) -> Option<f64>, fn(f64) -> String);

/// `single` or `batch N`.
fn claims(batch: u64) -> String {
    if batch == 1 {
        "single".to_owned()
    } else {
        format!("batch {batch}")
    }
}

/// Three spaces between columns, none at the ends of a line; the numbers
/// (after mode, claims and guard) right-aligned.
fn align(table: &mut Table) {
    for (i, column) in table.column_iter_mut().enumerate() {
        column.set_padding((if i == 0 { 0 } else { 3 }, 0));
        if i > 2 {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
}

/// `850 µs`, `12.3 ms`, `1.20 s`.
fn micros(us: u64) -> String {
    match us {
        0..1_000 => format!("{us} µs"),
        1_000..100_000 => format!("{:.1} ms", us as f64 / 1e3),
        100_000..1_000_000 => format!("{:.0} ms", us as f64 / 1e3),
        _ => format!("{:.2} s", us as f64 / 1e6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, jobs: u64) -> RowReport {
        RowReport {
            name: name.to_owned(),
            mode: Mode::Concurrent,
            batch: 1,
            guard: Guard::Oncely(Policy::Wait),
            policy: Some(Policy::Wait),
            coalescing: Some(true),
            relaxed_claim: false,
            guard_name: "oncely Wait".to_owned(),
            jobs,
            deliveries: 2 * jobs,
            seconds: 1.0,
            deliveries_per_sec: 2.0 * jobs as f64,
            claim_calls: 2 * jobs,
            claim_latency: Latency::of(vec![Duration::from_micros(300); 4]),
            in_progress_answers: 0,
            waiters: 0,
            wake_up_latency: None,
            rejected: 0,
            retries: 0,
            effects: jobs,
            jobs_run_twice: 0,
            jobs_not_run: 0,
            wrong_outcomes: 0,
            ratio: Some(0.5),
            ratio_leased: Some(0.9),
            server: ServerUse::default(),
            cpu_ratio: None,
        }
    }

    fn report(rows: Vec<RowReport>) -> BenchReport {
        BenchReport {
            backend: "memory",
            jobs: 200,
            deliveries_per_job: 2,
            workers: 8,
            batch: 100,
            tenant: "bench-x".to_owned(),
            baseline: "a mutex-guarded map",
            baseline_leased: "a mutex-guarded map of leases",
            rows,
        }
    }

    #[test]
    fn a_duplicate_effect_is_a_problem_naming_its_row() {
        assert!(report(vec![row("fine", 200)]).problems().is_empty());
        let mut twice = row("concurrent, single, oncely Wait", 200);
        twice.effects = 201;
        twice.jobs_run_twice = 1;
        let problems = report(vec![row("fine", 200), twice]).problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0]
                .starts_with("row 'concurrent, single, oncely Wait': 201 effects executed for 200 jobs"),
            "{problems:?}"
        );
        // A job that ran twice while another never ran still adds up to
        // `jobs` effects: still a problem.
        let mut swapped = row("swapped", 200);
        swapped.jobs_run_twice = 1;
        swapped.jobs_not_run = 1;
        assert_eq!(report(vec![swapped]).problems().len(), 1);
        let mut wrong = row("wrong", 200);
        wrong.wrong_outcomes = 3;
        assert!(report(vec![wrong]).problems()[0].contains("row 'wrong'"));
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        assert_eq!(Latency::of(Vec::new()), None);
        let samples: Vec<Duration> = (1..=100).rev().map(Duration::from_micros).collect();
        let l = Latency::of(samples).unwrap();
        assert_eq!((l.p50_us, l.p99_us, l.samples), (50, 99, 100));
        let one = Latency::of(vec![Duration::from_micros(7)]).unwrap();
        assert_eq!((one.p50_us, one.p99_us), (7, 7));
    }

    #[test]
    fn the_table_has_a_line_per_row() {
        let text = report(vec![row("a", 200), row("b", 200)]).table().to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with("mode"), "{text}");
        assert!(
            lines[1].contains("oncely Wait") && lines[1].contains("300 µs"),
            "{text}"
        );
        assert_eq!(micros(1_500), "1.5 ms");
        assert_eq!(micros(2_500_000), "2.50 s");
    }
}

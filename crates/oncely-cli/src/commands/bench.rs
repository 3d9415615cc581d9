//! `oncely bench`'s command line and table; the bench itself is the
//! `oncely-bench` crate ([`oncely_bench`]).

use std::process::ExitCode;

use clap::Args as ClapArgs;
use oncely::Result;
use oncely_bench::{self as bench, BenchConfig, BenchReport};

use super::print_json;
use super::progress::Bar;

/// Measure duplicates: oncely next to hand-written code, on one database.
///
/// Each of --jobs jobs is delivered twice: sequentially (one worker, the
/// duplicate sent when the first delivery has returned) and concurrently
/// (--workers workers, both deliveries of a job dispatched at the same
/// instant). Each mode runs with single claims and with batches of
/// --batch jobs (claim_many / complete_many), with oncely (Effects::run
/// under the Wait policy, and for concurrent duplicates under Reject)
/// and with the hand-written minimum on the same database: PostgreSQL
/// INSERT ... ON CONFLICT DO NOTHING RETURNING, then SELECT on a
/// duplicate; MySQL INSERT IGNORE, then SELECT; SQLite INSERT ... ON
/// CONFLICT DO NOTHING, then SELECT; Redis SET NX PX, then GET; NATS KV
/// create, then get; a mutex-guarded map for memory:.
///
/// Each row prints deliveries/s, the claim latency (p50, p99), the
/// wake-up latency of duplicates that waited for the first delivery
/// (from its return to theirs), the effects executed (must equal --jobs)
/// and the ratio of deliveries/s to the hand-written row. By default the
/// database is a fresh SQLite file in a temporary directory, removed
/// afterwards. The baseline's table, bucket or keys are removed at the
/// end; the ledger's records stay under tenant bench-<run id>, kept one
/// hour. Exits 1, naming the row, if any effect ran twice or never.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// How many jobs; each is delivered twice.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    jobs: u32,
    /// How many workers send the concurrent deliveries (each has one job's
    /// two deliveries, or one batch's, in flight).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    workers: u32,
    /// Jobs per batch in the batch rows.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    batch: u32,
    /// Run against this database instead of a temporary SQLite file
    /// (sqlite:PATH?mode=rwc, postgres://USER@HOST/DB, mysql://USER@HOST/DB
    /// or mariadb://, redis://HOST:PORT, redis+cluster://HOST:PORT,HOST:PORT,...,
    /// redis+sentinel://HOST:PORT,.../MASTER[?wait_replicas=N],
    /// nats://HOST:PORT[,HOST:PORT...][?bucket=NAME&replicas=1|3], memory:).
    /// Like the demo, the bench ignores ONCELY_DATABASE_URL: it writes only
    /// where it is told to.
    #[arg(long)]
    database_url: Option<String>,
    /// Print exactly one JSON object on stdout instead of the table (and no
    /// progress bar).
    #[arg(long)]
    json: bool,
}

/// Runs the bench, prints the table (or JSON), and exits 1, naming the
/// row, if an effect ran twice or never.
pub async fn run(args: Args) -> Result<ExitCode> {
    let config = BenchConfig {
        jobs: args.jobs,
        workers: args.workers as usize,
        batch: args.batch as usize,
        database_url: args.database_url.clone(),
    };
    let progress = Bar::new(args.json);
    // On Ctrl-C the bench's future is dropped, which removes its temporary
    // SQLite directory; a baseline table, bucket or keys on a server stay
    // (the Redis keys expire within an hour).
    let report = tokio::select! {
        r = bench::run(&config, progress.clone()) => r?,
        _ = tokio::signal::ctrl_c() => {
            bench::Progress::finish(progress.as_ref());
            eprintln!("interrupted");
            return Ok(ExitCode::from(130));
        }
    };
    if args.json {
        let _ = print_json(&report);
    } else {
        print_bench_table(&report);
    }
    Ok(bench_verdict(&report))
}

/// Exit 1, naming each row, when an effect ran twice (or never) or a
/// delivery got another job's outcome; 0 otherwise.
fn bench_verdict(report: &BenchReport) -> ExitCode {
    let problems = report.problems();
    if problems.is_empty() {
        return ExitCode::SUCCESS;
    }
    for p in problems {
        eprintln!("error: {p}");
    }
    ExitCode::from(1)
}

fn print_bench_table(r: &BenchReport) {
    println!(
        "oncely bench: {} jobs x {} deliveries, {} workers, batches of {}, {} ledger (tenant {})",
        r.jobs, r.deliveries_per_job, r.workers, r.batch, r.backend, r.tenant
    );
    println!("hand-written: {}", r.baseline);
    println!("hand-written, leased: {}", r.baseline_leased);
    println!();
    println!("{}", r.table());
    println!();
    if let Some(server) = r.server_table() {
        println!("the server, per job (both deliveries; its own counters, read before and after each row):");
        println!("{server}");
        println!();
    }
    println!(
        "claim: one claim or claim_many call (hand-written: its insert, and its read on a duplicate); \
         wake-up: from the first delivery's return to the waiting duplicate's; \
         ratio: deliveries/s over the hand-written row's."
    );
    if r.problems().is_empty() {
        println!("Every effect ran exactly once.");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oncely_bench::{Guard, Latency, Mode, Policy, RowReport};

    fn row(effects: u64, twice: u64) -> RowReport {
        RowReport {
            name: "concurrent, single, oncely Wait".to_owned(),
            mode: Mode::Concurrent,
            batch: 1,
            guard: Guard::Oncely(Policy::Wait),
            policy: Some(Policy::Wait),
            coalescing: Some(true),
            relaxed_claim: false,
            guard_name: "oncely Wait".to_owned(),
            jobs: 200,
            deliveries: 400,
            seconds: 0.5,
            deliveries_per_sec: 800.0,
            claim_calls: 420,
            claim_latency: Latency::of(vec![std::time::Duration::from_micros(250); 420]),
            in_progress_answers: 20,
            waiters: 20,
            wake_up_latency: Latency::of(vec![std::time::Duration::from_micros(90); 20]),
            rejected: 0,
            retries: 0,
            effects,
            jobs_run_twice: twice,
            jobs_not_run: 0,
            wrong_outcomes: 0,
            ratio: Some(0.7),
            ratio_leased: Some(0.9),
            server: oncely_bench::ServerUse::default(),
            cpu_ratio: None,
        }
    }

    fn report(row: RowReport) -> BenchReport {
        BenchReport {
            backend: "memory",
            jobs: 200,
            deliveries_per_job: 2,
            workers: 8,
            batch: 100,
            tenant: "bench-test".to_owned(),
            baseline: "a mutex-guarded map",
            baseline_leased: "a mutex-guarded map of leases",
            rows: vec![row],
        }
    }

    #[test]
    fn a_report_with_a_duplicate_effect_fails_the_command() {
        assert_eq!(bench_verdict(&report(row(200, 0))), ExitCode::SUCCESS);
        assert_eq!(bench_verdict(&report(row(201, 1))), ExitCode::from(1));
    }
}

//! The `oncely` command: argument parsing and printing only. What each
//! command does lives in the `oncely_cli` library.
#![forbid(unsafe_code)]

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use oncely::Error;
use oncely_cli::bench::{self, BenchConfig, BenchReport};
use oncely_cli::demo::{self, DemoConfig, DemoReport, Guard, Progress};
use oncely_cli::ops::{self, RecordView};
use oncely_cli::serve::{self, ServeArgs};

/// Make job and message handlers safe to run twice.
///
/// oncely records each effect (a charge, an email) under a key derived from
/// the business fact, claimed atomically in a database, so a redelivered or
/// concurrent duplicate message changes nothing. This command runs the
/// double-charge demo, measures duplicates next to hand-written code, and
/// lets operators inspect and maintain a ledger.
///
/// Database URLs: sqlite:PATH or sqlite://PATH (add ?mode=rwc to create the
/// file), postgres://USER@HOST/DB, mysql://USER@HOST/DB or mariadb://USER@HOST/DB,
/// redis://HOST:PORT[/DB] (one server), redis+cluster://HOST:PORT,HOST:PORT,...
/// (a Redis Cluster's seed nodes), nats://HOST:PORT[,HOST:PORT...] with
/// optional ?bucket=NAME&replicas=1|3 (JetStream KV), memory: (an empty
/// in-process ledger).
///
/// Exit codes: 0 success; 1 runtime failure (database unreachable, backend
/// error, oncely charged twice in the demo, an effect ran twice in the
/// bench); 2 usage error (bad arguments,
/// invalid key or tenant, unknown URL scheme); 3 `get` found no record.
#[derive(Debug, Parser)]
#[command(name = "oncely", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show a naive guard charging twice, and oncely charging once.
    ///
    /// Each order's "charge" message is delivered several times; all
    /// deliveries are shuffled into one queue that several workers consume
    /// concurrently, so duplicates of one order overlap. The same deliveries
    /// run twice against a real database: first with the naive guard (read
    /// the order's status, charge if not paid, write 'paid'), then with
    /// oncely (claim capture:order-N, charge with the provider key, mark the
    /// order paid). A fake payment provider counts the charges.
    ///
    /// By default the database is a fresh SQLite file in a temporary
    /// directory, removed afterwards. With --database-url the ledger records
    /// stay (tenant demo-<run id>, kept one hour) and the orders tables are
    /// dropped. On Redis, NATS and memory: the orders table lives in a
    /// scratch SQLite file. Exits 1 if oncely charged any order twice.
    Demo(DemoArgs),
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
    Bench(BenchArgs),
    /// Print one effect's record as JSON.
    ///
    /// The key is the displayed form tenant/kind:subject, e.g.
    /// acme/capture:order-123. Exits 3 (and prints null) when the key has
    /// no record. Opens the ledger read-only: it creates, migrates and
    /// writes nothing (a missing database or table is an error), so a role
    /// that may only SELECT can run it.
    Get {
        /// The effect key, tenant/kind:subject.
        key: String,
        #[command(flatten)]
        db: DbArgs,
    },
    /// List a tenant's abandoned at-most-once steps as a JSON array.
    ///
    /// An at-most-once step (an email, a push) whose worker died between
    /// marking it attempted and completing it is never re-run
    /// automatically: it may or may not have happened, and someone has to
    /// check. This lists them, oldest first. Read-only, like `get`.
    Abandoned {
        /// The tenant whose steps to list.
        #[arg(long)]
        tenant: String,
        /// At most this many records.
        #[arg(long, default_value_t = 100)]
        limit: u64,
        #[command(flatten)]
        db: DbArgs,
    },
    /// Delete completed and released records past their retention.
    ///
    /// Never deletes a live lease or an unresolved abandoned step. Run it
    /// periodically; each call deletes at most --limit records and prints
    /// how many it deleted. It raises the ledger's horizon (per tenant and
    /// kind) to what it deleted, so a replay of a pruned effect is refused
    /// rather than run again. Uses the existing ledger; creates nothing.
    Prune {
        /// Delete at most this many records in this call.
        #[arg(long, default_value_t = 10_000)]
        limit: u64,
        #[command(flatten)]
        db: DbArgs,
    },
    /// Create or upgrade the ledger's schema, then print the backend's
    /// guarantees.
    ///
    /// SQL backends create or upgrade their tables and then check them (a
    /// table someone else created without a unique key on the effect key,
    /// or with a case-insensitive key, is refused); NATS creates its KV
    /// bucket (or checks an existing one's settings); Redis checks the
    /// server's eviction policy and needs no schema. With `demo`, the only
    /// command that creates anything.
    Migrate {
        #[command(flatten)]
        db: DbArgs,
    },
    /// Serve the operator web page: stats, stuck and abandoned records, one
    /// record's detail, and the redelivery-gap chart against the retention.
    ///
    /// Server-rendered HTML, no JavaScript. Read-only: the ledger is opened
    /// like `get` does, and nothing is written. Listens on loopback unless
    /// --allow-remote (the page has no authentication). Shows one tenant
    /// (--tenant; any other answers 403) or all (--all-tenants). The gap
    /// chart reads oncely_redelivery_gap_seconds from a consumer's
    /// Prometheus endpoint (--metrics-url): duplicates are not stored in
    /// the ledger. Runs until Ctrl-C.
    Serve(ServeArgs),
}

#[derive(Debug, Args)]
struct DbArgs {
    /// The ledger's database: sqlite:PATH, postgres://USER@HOST/DB,
    /// mysql://USER@HOST/DB (or mariadb://), redis://HOST:PORT,
    /// redis+cluster://HOST:PORT,HOST:PORT,...,
    /// nats://HOST:PORT[,HOST:PORT...][?bucket=NAME&replicas=1|3] or memory:.
    #[arg(long, env = "ONCELY_DATABASE_URL")]
    database_url: String,
}

#[derive(Debug, Args)]
struct DemoArgs {
    /// How many orders.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    orders: u32,
    /// How many times each order's charge message is delivered.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1000))]
    deliveries: u32,
    /// How many workers consume the deliveries concurrently.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    workers: u32,
    /// Run against this database instead of a temporary SQLite file
    /// (sqlite:PATH?mode=rwc, postgres://USER@HOST/DB, mysql://USER@HOST/DB
    /// or mariadb://, redis://HOST:PORT, redis+cluster://HOST:PORT,HOST:PORT,...,
    /// nats://HOST:PORT[,HOST:PORT...][?bucket=NAME&replicas=1|3], memory:).
    /// Unlike the other commands, the demo ignores ONCELY_DATABASE_URL: it
    /// writes only where it is told to.
    #[arg(long)]
    database_url: Option<String>,
    /// Print exactly one JSON object on stdout instead of the table (and no
    /// progress bar).
    #[arg(long)]
    json: bool,
    /// Seed of the delivery order, to replay a run's queue (timing still
    /// varies).
    #[arg(long)]
    seed: Option<u64>,
}

#[derive(Debug, Args)]
struct BenchArgs {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(run(cli.command))
}

async fn run(command: Command) -> ExitCode {
    match command {
        Command::Demo(args) => run_demo(args).await,
        Command::Bench(args) => run_bench(args).await,
        Command::Get { key, db } => match ops::get(&db.database_url, &key).await {
            Ok(Some(record)) => print_json(&RecordView::from(&record)),
            Ok(None) => {
                println!("null");
                eprintln!("no record for {key}");
                ExitCode::from(3)
            }
            Err(e) => fail(&e),
        },
        Command::Abandoned { tenant, limit, db } => {
            match ops::abandoned(&db.database_url, &tenant, limit).await {
                Ok(records) => print_json(&records.iter().map(RecordView::from).collect::<Vec<_>>()),
                Err(e) => fail(&e),
            }
        }
        Command::Prune { limit, db } => match ops::prune(&db.database_url, limit).await {
            Ok(n) => {
                println!("pruned {n} record{}", if n == 1 { "" } else { "s" });
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        Command::Migrate { db } => match ops::migrate(&db.database_url).await {
            Ok(report) => {
                println!("{} ledger schema is up to date", report.backend);
                println!(
                    "  caller's transaction: {}",
                    if report.caller_transaction { "yes" } else { "no" }
                );
                println!("  durability:           {}", report.durability);
                println!("  clock:                {}", report.clock);
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        Command::Serve(args) => run_serve(args).await,
    }
}

async fn run_serve(args: ServeArgs) -> ExitCode {
    let config = match args.config() {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    let scope = config.scope.to_string();
    let server = match serve::bind(config).await {
        Ok(s) => s,
        Err(e) => return fail(&e),
    };
    match server.local_addr() {
        Ok(addr) => println!(
            "oncely serve: http://{addr}/ ({} ledger, {scope}, read-only); Ctrl-C stops it",
            server.backend()
        ),
        Err(e) => return fail(&e),
    }
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    match server.run(shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

async fn run_demo(args: DemoArgs) -> ExitCode {
    let config = DemoConfig {
        orders: args.orders,
        deliveries_per_order: args.deliveries,
        workers: args.workers as usize,
        database_url: args.database_url.clone(),
        seed: args.seed,
        ..DemoConfig::default()
    };
    let show_bar = !args.json && std::io::stderr().is_terminal();
    let progress = Arc::new(Bar {
        enabled: show_bar,
        bar: Mutex::new(None),
    });
    // On Ctrl-C the demo's future is dropped, which removes its temporary
    // SQLite directories; PostgreSQL and MySQL orders tables of an
    // interrupted run stay.
    let report = tokio::select! {
        r = demo::run(&config, progress.clone()) => match r {
            Ok(r) => r,
            Err(e) => return fail(&e),
        },
        _ = tokio::signal::ctrl_c() => {
            progress.finish(Guard::Naive);
            eprintln!("interrupted");
            return ExitCode::from(130);
        }
    };
    if args.json {
        let _ = print_json(&report);
    } else {
        print_table(&report, args.database_url.is_some() && report.backend != "memory");
    }
    let problems = report.oncely_problems();
    if problems.is_empty() {
        return ExitCode::SUCCESS;
    }
    for p in problems {
        eprintln!("error: {p}");
    }
    ExitCode::from(1)
}

fn print_table(r: &DemoReport, kept: bool) {
    println!(
        "oncely demo: {} orders x {} deliveries = {} deliveries, {} workers, {} ledger (seed {})",
        r.orders, r.deliveries_per_order, r.deliveries, r.workers, r.backend, r.seed
    );
    println!();
    println!("{}", r.table());
    println!();
    if r.naive.duplicate_charges > 0 {
        println!(
            "The naive guard charged {} of {} orders more than once.",
            r.naive.orders_charged_twice, r.orders
        );
    } else {
        println!("The naive guard got lucky this time: no overlapping duplicates. Run it again.");
    }
    if r.oncely_problems().is_empty() {
        println!("oncely charged each order exactly once.");
    }
    if kept {
        println!(
            "Inspect a record: oncely get {}/capture:order-1 --database-url <same URL>",
            r.tenant
        );
    }
}

async fn run_bench(args: BenchArgs) -> ExitCode {
    let config = BenchConfig {
        jobs: args.jobs,
        workers: args.workers as usize,
        batch: args.batch as usize,
        database_url: args.database_url.clone(),
    };
    let progress = Arc::new(Bar {
        enabled: !args.json && std::io::stderr().is_terminal(),
        bar: Mutex::new(None),
    });
    // On Ctrl-C the bench's future is dropped, which removes its temporary
    // SQLite directory; a baseline table, bucket or keys on a server stay
    // (the Redis keys expire within an hour).
    let report = tokio::select! {
        r = bench::run(&config, progress.clone()) => match r {
            Ok(r) => r,
            Err(e) => return fail(&e),
        },
        _ = tokio::signal::ctrl_c() => {
            bench::Progress::finish(progress.as_ref());
            eprintln!("interrupted");
            return ExitCode::from(130);
        }
    };
    if args.json {
        let _ = print_json(&report);
    } else {
        print_bench_table(&report);
    }
    bench_verdict(&report)
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
    println!();
    println!("{}", r.table());
    println!();
    println!(
        "claim: one claim or claim_many call (hand-written: its insert, and its read on a duplicate); \
         wake-up: from the first delivery's return to the waiting duplicate's; \
         ratio: deliveries/s over the hand-written row's."
    );
    if r.problems().is_empty() {
        println!("Every effect ran exactly once.");
    }
}

fn print_json<T: serde::Serialize>(value: &T) -> ExitCode {
    match serde_json::to_string(value) {
        Ok(s) => {
            println!("{s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: cannot encode the output as JSON: {e}");
            ExitCode::from(1)
        }
    }
}

/// Prints the error and picks the exit code: 2 for what the caller can fix
/// in the command line, 1 for everything that went wrong at run time.
fn fail(e: &Error) -> ExitCode {
    eprintln!("error: {e}");
    match e {
        Error::InvalidKey { .. } | Error::Config(_) | Error::Misuse(_) => ExitCode::from(2),
        _ => ExitCode::from(1),
    }
}

/// The demo's progress bar on stderr, one per run; drawn only on a terminal.
struct Bar {
    enabled: bool,
    bar: Mutex<Option<ProgressBar>>,
}

impl Progress for Bar {
    fn start(&self, guard: Guard, deliveries: u64) {
        if !self.enabled {
            return;
        }
        let bar = ProgressBar::with_draw_target(Some(deliveries), ProgressDrawTarget::stderr());
        if let Ok(style) =
            ProgressStyle::with_template("{prefix:>7} [{bar:40}] {pos}/{len} deliveries {elapsed}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(guard.name());
        *self.bar.lock().unwrap_or_else(|p| p.into_inner()) = Some(bar);
    }

    fn delivered(&self) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            bar.inc(1);
        }
    }

    fn finish(&self, _guard: Guard) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).take() {
            bar.finish_and_clear();
        }
    }
}

/// The bench's progress bar: one per row, drawn only on a terminal.
impl bench::Progress for Bar {
    fn start(&self, row: &str, deliveries: u64) {
        if !self.enabled {
            return;
        }
        let bar = ProgressBar::with_draw_target(Some(deliveries), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template("{prefix:>38} [{bar:30}] {pos}/{len} {elapsed}") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(row.to_owned());
        *self.bar.lock().unwrap_or_else(|p| p.into_inner()) = Some(bar);
    }

    fn delivered(&self, n: u64) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            bar.inc(n);
        }
    }

    fn finish(&self) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).take() {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oncely_cli::bench::{Guard, Latency, Mode, Policy, RowReport};

    fn row(effects: u64, twice: u64) -> RowReport {
        RowReport {
            name: "concurrent, single, oncely Wait".to_owned(),
            mode: Mode::Concurrent,
            batch: 1,
            guard: Guard::Oncely(Policy::Wait),
            policy: Some(Policy::Wait),
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
            rows: vec![row],
        }
    }

    #[test]
    fn a_report_with_a_duplicate_effect_fails_the_command() {
        assert_eq!(bench_verdict(&report(row(200, 0))), ExitCode::SUCCESS);
        assert_eq!(bench_verdict(&report(row(201, 1))), ExitCode::from(1));
    }
}

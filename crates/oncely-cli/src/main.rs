//! The `oncely` command: argument parsing and printing only. What each
//! command does lives in the `oncely_cli` library.
#![forbid(unsafe_code)]

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use oncely::Error;
use oncely_cli::demo::{self, DemoConfig, DemoReport, Guard, Progress};
use oncely_cli::ops::{self, RecordView};

/// Make job and message handlers safe to run twice.
///
/// oncely records each effect (a charge, an email) under a key derived from
/// the business fact, claimed atomically in a database, so a redelivered or
/// concurrent duplicate message changes nothing. This command runs the
/// double-charge demo and lets operators inspect and maintain a ledger.
///
/// Database URLs: sqlite:PATH or sqlite://PATH (add ?mode=rwc to create the
/// file), postgres://USER@HOST/DB, mysql://USER@HOST/DB or mariadb://USER@HOST/DB,
/// redis://HOST:PORT[/DB] (one server), redis+cluster://HOST:PORT,HOST:PORT,...
/// (a Redis Cluster's seed nodes), nats://HOST:PORT[,HOST:PORT...] with
/// optional ?bucket=NAME&replicas=1|3 (JetStream KV), memory: (an empty
/// in-process ledger).
///
/// Exit codes: 0 success; 1 runtime failure (database unreachable, backend
/// error, oncely charged twice in the demo); 2 usage error (bad arguments,
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

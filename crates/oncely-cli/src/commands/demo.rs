//! `oncely demo`'s command line and table; the demo itself is
//! [`crate::demo`].

use std::process::ExitCode;

use clap::Args as ClapArgs;
use oncely::Result;

use super::print_json;
use super::progress::Bar;
use crate::demo::{self, DemoConfig, DemoReport, Guard, Progress};

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
#[derive(Debug, ClapArgs)]
pub struct Args {
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
    /// redis+sentinel://HOST:PORT,.../MASTER[?wait_replicas=N],
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

/// Runs the demo, prints the table (or JSON), and exits 1 if oncely
/// charged an order twice.
pub async fn run(args: Args) -> Result<ExitCode> {
    let config = DemoConfig {
        orders: args.orders,
        deliveries_per_order: args.deliveries,
        workers: args.workers as usize,
        database_url: args.database_url.clone(),
        seed: args.seed,
        ..DemoConfig::default()
    };
    let progress = Bar::new(args.json);
    // On Ctrl-C the demo's future is dropped, which removes its temporary
    // SQLite directories; PostgreSQL and MySQL orders tables of an
    // interrupted run stay.
    let report = tokio::select! {
        r = demo::run(&config, progress.clone()) => r?,
        _ = tokio::signal::ctrl_c() => {
            progress.finish(Guard::Naive);
            eprintln!("interrupted");
            return Ok(ExitCode::from(130));
        }
    };
    if args.json {
        let _ = print_json(&report);
    } else {
        print_table(&report, args.database_url.is_some() && report.backend != "memory");
    }
    let problems = report.oncely_problems();
    if problems.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    for p in problems {
        eprintln!("error: {p}");
    }
    Ok(ExitCode::from(1))
}

/// The runs side by side, and what they show.
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

//! `oncely chaos`'s command line and report; the run itself is
//! [`crate::chaos`].

use std::process::ExitCode;
use std::time::Duration;

use clap::Args as ClapArgs;
use oncely::Result;

use super::{duration_arg, padded, plain_table, print_json};
use crate::chaos;

/// Run the payment pipeline across the endpoints of one replicated
/// deployment while your scripts inject faults; print what happened.
///
/// Each order is delivered twice at once; worker W starts on endpoint
/// W mod N and a delivery that fails retryably moves to the next one.
/// The job: a provider-keyed capture (a fake provider that deduplicates
/// by idempotency key), then on SQL backends a transactional mark-paid
/// step (a business row committed with its claim and completion), then
/// an at-most-once receipt. Every completion a worker saw acknowledged
/// is read back at the end. Prints the topology, the faults, the
/// deliveries, the effects performed, the duplicates (orders charged
/// twice, marked paid twice or sent two receipts: must be 0),
/// the acknowledged completions lost, the abandoned receipts and what
/// was retried. Exits 1 if any duplicate, any lost acknowledgement, or
/// any order unfinished by the deadline.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// One endpoint (node) of the deployment, as a ledger URL; repeat for
    /// each (--endpoint mysql://root@127.0.0.1:3311/test --endpoint …).
    #[arg(long = "endpoint", required = true, value_name = "URL")]
    endpoints: Vec<String>,
    /// The topology's name in the report.
    #[arg(long, default_value = "unnamed")]
    topology: String,
    /// How many orders (each delivered twice).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    orders: u32,
    /// How many concurrent workers.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    workers: u32,
    /// The steps' lease.
    #[arg(long, default_value = "2s", value_parser = duration_arg)]
    lease: Duration,
    /// A fault: AT=COMMAND, run through `sh -c` AT after the start
    /// (--fault '2s=scripts/galera-cluster.sh kill 2'); repeat for more.
    #[arg(long = "fault", value_name = "AT=COMMAND", value_parser = fault_arg)]
    faults: Vec<chaos::Fault>,
    /// Stop redelivering what has not acked this long after the start.
    #[arg(long, default_value = "120s", value_parser = duration_arg)]
    deadline: Duration,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

fn fault_arg(s: &str) -> std::result::Result<chaos::Fault, String> {
    chaos::Fault::parse(s, duration_arg)
}

/// Runs the pipeline under the faults, prints what happened, and exits 1
/// on a duplicate, a lost acknowledgement or an unfinished order.
pub async fn run(args: Args) -> Result<ExitCode> {
    let config = chaos::ChaosConfig {
        endpoints: args.endpoints,
        topology: args.topology,
        orders: args.orders,
        workers: args.workers as usize,
        lease: args.lease,
        faults: args.faults,
        deadline: args.deadline,
    };
    let report = chaos::run(&config).await?;
    if args.json {
        let _ = print_json(&report);
    } else {
        let mut t = plain_table();
        t.set_header([
            "topology",
            "faults",
            "deliveries",
            "charges",
            "marked",
            "receipts",
            "duplicates",
            "acked",
            "acked lost",
            "unread",
            "abandoned",
            "unfinished",
        ]);
        t.add_row([
            report.topology.clone(),
            report.faults.len().to_string(),
            report.deliveries.to_string(),
            format!("{} ({} calls)", report.charges, report.provider_calls),
            report.marked.map_or("n/a".to_owned(), |n| n.to_string()),
            report.receipts.to_string(),
            report.duplicates.to_string(),
            report.acknowledged.to_string(),
            report.lost.to_string(),
            report.unread.to_string(),
            report.abandoned.len().to_string(),
            report.unfinished.to_string(),
        ]);
        println!("{}", padded(t));
        for f in &report.faults {
            println!(
                "fault at {:.1}s: {} (exit {})",
                f.at_seconds,
                f.command,
                f.exit.map_or("none".to_owned(), |c| c.to_string())
            );
        }
        if !report.retried.is_empty() {
            let retried: Vec<String> = report.retried.iter().map(|(k, n)| format!("{k} {n}")).collect();
            println!("retried: {}", retried.join(", "));
        }
        for key in &report.abandoned {
            println!("abandoned (reconcile it): {key}");
        }
    }
    for g in &report.gave_up {
        eprintln!(
            "order {} unfinished: {} ({})",
            g.order,
            g.error,
            if g.retryable {
                "retryable; the deadline passed"
            } else {
                "not retryable"
            }
        );
    }
    if report.failed() {
        eprintln!(
            "error: {} duplicate(s), {} acknowledged completion(s) lost, {} unread, {} order(s) unfinished",
            report.duplicates, report.lost, report.unread, report.unfinished
        );
        Ok(ExitCode::from(1))
    } else {
        Ok(ExitCode::SUCCESS)
    }
}

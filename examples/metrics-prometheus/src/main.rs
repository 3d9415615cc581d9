//! ```text
//! metrics-prometheus [--listen ADDR]   # default 127.0.0.1:9000
//! ```
//! Serves the metrics on `http://ADDR/metrics`, runs the scripted workload
//! on a SQLite ledger in a temporary directory, prints the numbers the
//! scrape must show, and keeps serving until Ctrl-C.

use std::net::SocketAddr;

use anyhow::Context as _;
use metrics_prometheus::{CONSUMER, KIND, Workload, install, run_workload};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mut listen: SocketAddr = "127.0.0.1:9000".parse()?;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" => {
                let addr = args.next().context("--listen needs an address")?;
                listen = addr.parse().with_context(|| format!("--listen {addr}"))?;
            }
            other => anyhow::bail!("unknown argument {other:?}; usage: metrics-prometheus [--listen ADDR]"),
        }
    }
    install(listen).with_context(|| format!("serving metrics on {listen}"))?;

    let dir = tempfile::tempdir()?;
    let workload = Workload::default();
    let report = run_workload(dir.path(), &workload).await?;
    let e = workload.expected();
    println!("ledger: {} (deleted on exit)", report.ledger.display());
    println!(
        "{} orders, {} duplicates ({} after >= {:?}), {} crashed workers and {} zombies on {:?} leases: \
         {} charges from {} provider calls, {} zombie completions refused by their fence",
        workload.orders,
        workload.prompt_duplicates + workload.late_duplicates,
        workload.late_duplicates,
        workload.late_gap,
        workload.crashed_workers,
        workload.zombies,
        workload.short_lease,
        report.charges,
        report.provider_calls,
        report.zombies_refused,
    );
    println!("the scrape shows (kind=\"{KIND}\", consumer=\"{CONSUMER}\"):");
    for (metric, n) in [
        ("oncely_claims_total{result=\"acquired\"}", e.claims_acquired),
        ("oncely_claims_total{result=\"completed\"}", e.claims_completed),
        ("oncely_claims_total{result=\"takeover\"}", e.claims_takeover),
        ("oncely_duplicates_suppressed_total", e.duplicates_suppressed),
        ("oncely_lease_takeovers_total", e.lease_takeovers),
        ("oncely_fence_rejections_total", e.fence_rejections),
        ("oncely_redelivery_gap_seconds_count", e.redelivery_gaps),
        (
            "oncely_consumer_deliveries_total{result=\"ran\"}",
            e.deliveries_ran,
        ),
        (
            "oncely_consumer_deliveries_total{result=\"replayed\"}",
            e.deliveries_replayed,
        ),
    ] {
        println!("  {metric:<55} {n}");
    }
    println!("serving http://{listen}/metrics until Ctrl-C");
    tokio::signal::ctrl_c().await?;
    Ok(())
}

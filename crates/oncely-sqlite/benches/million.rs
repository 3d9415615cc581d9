//! One million claims (claim of a fresh key + complete) through
//! `SqliteLedger`, printing claims/s and the process's memory as it goes:
//! peak RSS (`VmHWM` in `/proc/self/status`) after the first 100,000 claims
//! and at the end. The ledger keeps nothing per claim in memory (SQLite's
//! page cache is bounded per connection), so the peak must not grow with the
//! count: the run fails (exit status 1) if the final peak exceeds the peak at
//! 100,000 by more than a quarter.
//!
//! ```text
//! cargo bench -p oncely-sqlite --bench million
//! ONCELY_BENCH_CLAIMS=200000 ONCELY_BENCH_TASKS=1 cargo bench -p oncely-sqlite --bench million
//! ```
//!
//! `ONCELY_BENCH_CLAIMS` (default 1,000,000), `ONCELY_BENCH_TASKS` (tasks
//! claiming at once, default 4), `ONCELY_BENCH_DIR` (where the database file
//! goes, default a temporary directory; about 300 MB at a million records).
//! `synchronous=NORMAL`, as in `benches/claim.rs`: this measures the
//! library's CPU and memory, not the disk's fsync.
#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use oncely::backend::{Claim, Ledger, Outcome};
use oncely::{ClaimOptions, EffectKey, Tenant};
use oncely_sqlite::{SqliteLedger, SqliteLedgerOptions, SqliteSynchronous};

/// Where the first measurement is taken.
const FIRST: u64 = 100_000;
/// A progress line every this many claims.
const STEP: u64 = 100_000;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| v.replace('_', "").parse().expect("a whole number"))
        .unwrap_or(default)
}

/// `VmHWM` (peak resident set) and `VmRSS` (current), in KiB.
fn memory() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status (Linux)");
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} in /proc/self/status"))
    };
    (field("VmHWM:"), field("VmRSS:"))
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn main() {
    let total = env("ONCELY_BENCH_CLAIMS", 1_000_000);
    let tasks = env("ONCELY_BENCH_TASKS", 4).max(1);
    let dir = match std::env::var_os("ONCELY_BENCH_DIR") {
        Some(d) => tempfile::tempdir_in(d),
        None => tempfile::tempdir(),
    }
    .expect("a directory for the database");
    let path = dir.path().join("million.db");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let ok = rt.block_on(run(&path, total, tasks));
    drop(rt);
    drop(dir);
    if !ok {
        std::process::exit(1);
    }
}

async fn run(path: &std::path::Path, total: u64, tasks: u64) -> bool {
    let ledger = SqliteLedger::connect_with(
        &format!("sqlite:{}", path.display()),
        SqliteLedgerOptions::default()
            .synchronous(SqliteSynchronous::Normal)
            .max_connections(16),
    )
    .await
    .unwrap();
    let (start_peak, _) = memory();
    println!(
        "sqlite/million: {total} claims (claim + complete of a fresh key), {tasks} tasks, synchronous=NORMAL, {}",
        path.display()
    );
    println!(
        "{:>10} {:>12} {:>12} {:>12} {:>12}",
        "claims", "claims/s", "total/s", "VmRSS MiB", "VmHWM MiB"
    );

    let next = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let tenant = Tenant::new("bench").unwrap();
    let outcome = Outcome::from_json(&serde_json::json!({"charge": "ch_1", "amount": 1250})).unwrap();
    let started = Instant::now();
    // (claims done, elapsed, VmHWM) at each step.
    let marks = Arc::new(std::sync::Mutex::new(vec![(0u64, Duration::ZERO, start_peak)]));
    let workers: Vec<_> = (0..tasks)
        .map(|_| {
            let (ledger, next, done, tenant, outcome, marks) = (
                ledger.clone(),
                next.clone(),
                done.clone(),
                tenant.clone(),
                outcome.clone(),
                marks.clone(),
            );
            tokio::spawn(async move {
                let opts = ClaimOptions::default();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    let k = EffectKey::new(&tenant, "capture", format!("order-{i}")).unwrap();
                    match ledger.claim(&k, &opts).await.unwrap() {
                        Claim::Acquired(lease) => ledger.complete(&lease, &outcome).await.unwrap(),
                        other => panic!("{other:?}"),
                    }
                    let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                    if n % STEP == 0 || n == total {
                        let elapsed = started.elapsed();
                        let (peak, rss) = memory();
                        let mut marks = marks.lock().unwrap();
                        let (last_n, last_t, _) = *marks.last().unwrap();
                        println!(
                            "{n:>10} {:>12.0} {:>12.0} {:>12.1} {:>12.1}",
                            (n - last_n) as f64 / (elapsed - last_t).as_secs_f64(),
                            n as f64 / elapsed.as_secs_f64(),
                            mib(rss),
                            mib(peak),
                        );
                        marks.push((n, elapsed, peak));
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.expect("a claiming task panicked");
    }
    let elapsed = started.elapsed();
    let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let marks = marks.lock().unwrap();
    // VmHWM only grows: read now, it is the run's peak.
    let (final_peak, _) = memory();
    println!(
        "total: {total} claims in {:.1} s = {:.0} claims/s; database {:.0} MiB",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64(),
        size as f64 / 1_048_576.0
    );
    println!(
        "peak RSS (VmHWM): {:.1} MiB after opening, {:.1} MiB at the end",
        mib(start_peak),
        mib(final_peak)
    );
    let Some(&(n, _, first_peak)) = marks.iter().filter(|(n, _, _)| *n >= FIRST).min_by_key(|m| m.0) else {
        println!("fewer than {FIRST} claims: no bound checked");
        return true;
    };
    let growth = final_peak as f64 / first_peak as f64;
    println!(
        "peak RSS at {n} claims: {:.1} MiB; at {total}: {:.1} MiB ({:+.1}%)",
        mib(first_peak),
        mib(final_peak),
        (growth - 1.0) * 100.0
    );
    if growth > 1.25 {
        println!("FAIL: peak RSS grew by more than a quarter between {n} and {total} claims");
        return false;
    }
    true
}

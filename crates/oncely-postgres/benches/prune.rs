//! Claim latency while a [`Pruner`] deletes a backlog of expired records.
//!
//! 1. Seeds `ONCELY_PRUNE_ROWS` (default 1,000,000) completed records, past
//!    retention, straight into the ledger's table with one `INSERT … SELECT
//!    generate_series` per 100,000 rows, then `VACUUM ANALYZE`s it (old rows
//!    are all-visible in a real ledger too).
//! 2. `without prune`: 8 tasks claim and complete fresh keys for
//!    `ONCELY_PRUNE_SECS` seconds (default 20); every claim's latency and
//!    every claim + complete's latency is recorded.
//! 3. `during prune`: the same 8 tasks, while a [`Pruner`] (batch
//!    `ONCELY_PRUNE_BATCH`, default 500; `ONCELY_PRUNE_RATE` rows a second,
//!    default 5,000, the library's default; 0: no limit) deletes the
//!    backlog; the phase ends when the backlog is gone.
//!
//! 4. `after prune`: the workers alone again, for as long as in step 2.
//!
//! A 2-second warm-up before step 2 is not counted. Prints one table
//! (stderr) and one JSON line (stdout): p50/p99 of each phase, the ratios of
//! `during` to `without` (the target: p99 during the prune at most 2× the
//! p99 without it), and the prune's rows a second. The server and the
//! machine may be shared: the phases run one after the other, so load from
//! elsewhere that changes between them shows up in the ratio; `after prune`
//! shows how much.
//!
//! Needs PostgreSQL at `ONCELY_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`):
//! `cargo bench -p oncely-postgres --bench prune`; a quick run:
//! `ONCELY_PRUNE_ROWS=100000 ONCELY_PRUNE_SECS=5 cargo bench -p oncely-postgres --bench prune`.
#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use oncely::backend::{Claim, Ledger, Outcome};
use oncely::pruner::{Pruner, PrunerOptions};
use oncely::{ClaimOptions, EffectKey, Tenant};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::postgres::PgPoolOptions;

const TABLE: &str = "oncely_bench_prune";
const WORKERS: usize = 8;
const SEED_CHUNK: u64 = 100_000;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

/// Latencies of one phase, in microseconds.
#[derive(Default)]
struct Samples {
    claim: Vec<u32>,
    both: Vec<u32>,
}

impl Samples {
    fn merge(&mut self, other: Samples) {
        self.claim.extend(other.claim);
        self.both.extend(other.both);
    }

    fn sort(&mut self) {
        self.claim.sort_unstable();
        self.both.sort_unstable();
    }
}

fn pct(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    f64::from(sorted[i]) / 1000.0
}

/// Seeds `rows` completed records of tenant `old`, created two days ago,
/// whose retention ended a day ago (spread over a minute, so the expiry
/// index has an order to follow).
async fn seed(pool: &sqlx::PgPool, rows: u64) {
    let mut done = 0;
    let started = Instant::now();
    while done < rows {
        let n = SEED_CHUNK.min(rows - done);
        let sql = format!(
            "INSERT INTO {TABLE} (key, tenant, kind, subject, state, fence, fingerprint, outcome, \
               at_most_once, created_at, updated_at, lease_expires_at, retain_until, retention_us) \
             SELECT 'old/capture:s-' || i, 'old', 'capture', 's-' || i, 'completed', 1, NULL, \
               '{{\"charge\":\"ch_1\",\"amount\":1250}}'::bytea, false, \
               now() - interval '2 days' + i * interval '50 microseconds', \
               now() - interval '2 days' + i * interval '50 microseconds', NULL, \
               now() - interval '1 day' + i * interval '50 microseconds', 86400000000 \
             FROM generate_series({from}::bigint, {to}::bigint) AS i",
            from = done + 1,
            to = done + n,
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(pool)
            .await
            .unwrap();
        done += n;
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("VACUUM ANALYZE {TABLE}")))
        .execute(pool)
        .await
        .unwrap();
    eprintln!("seeded {rows} expired records in {:.1?}", started.elapsed());
}

/// Runs the workers until `stop` is set; returns their samples.
async fn workers(ledger: &PgLedger, phase: &str, stop: Arc<AtomicBool>) -> Samples {
    let tenant = Tenant::new(format!("new{}", std::process::id())).unwrap();
    let outcome = Outcome::from_json(&serde_json::json!({"charge": "ch_1", "amount": 1250})).unwrap();
    let opts = ClaimOptions::default();
    let tasks: Vec<_> = (0..WORKERS)
        .map(|w| {
            let (ledger, tenant, outcome, opts, stop) = (
                ledger.clone(),
                tenant.clone(),
                outcome.clone(),
                opts.clone(),
                stop.clone(),
            );
            let phase = phase.to_owned();
            tokio::spawn(async move {
                let mut s = Samples::default();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let key = EffectKey::new(&tenant, "capture", format!("{phase}-{w}-{i}")).unwrap();
                    i += 1;
                    let t0 = Instant::now();
                    let lease = match ledger.claim(&key, &opts).await.unwrap() {
                        Claim::Acquired(lease) => lease,
                        other => panic!("{other:?}"),
                    };
                    let t1 = Instant::now();
                    ledger.complete(&lease, &outcome).await.unwrap();
                    let t2 = Instant::now();
                    s.claim
                        .push(u32::try_from((t1 - t0).as_micros()).unwrap_or(u32::MAX));
                    s.both
                        .push(u32::try_from((t2 - t0).as_micros()).unwrap_or(u32::MAX));
                }
                s
            })
        })
        .collect();
    let mut all = Samples::default();
    for t in tasks {
        all.merge(t.await.unwrap());
    }
    all.sort();
    all
}

/// Runs the workers for `d`.
async fn timed(ledger: &PgLedger, phase: &str, d: Duration) -> Samples {
    let stop = Arc::new(AtomicBool::new(false));
    let task = tokio::spawn({
        let (ledger, stop, phase) = (ledger.clone(), stop.clone(), phase.to_owned());
        async move { workers(&ledger, &phase, stop).await }
    });
    tokio::time::sleep(d).await;
    stop.store(true, Ordering::Relaxed);
    task.await.unwrap()
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run());
}

async fn run() {
    let rows = env("ONCELY_PRUNE_ROWS", 1_000_000);
    let secs = env("ONCELY_PRUNE_SECS", 20);
    let batch = env("ONCELY_PRUNE_BATCH", 500);
    let rate = env("ONCELY_PRUNE_RATE", 5_000);
    let url = std::env::var("ONCELY_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .test_before_acquire(false)
        .connect(&url)
        .await
        .expect("PostgreSQL for the bench");
    let ledger = PgLedger::from_pool_with(pool.clone(), PgLedgerOptions::default().table(TABLE)).unwrap();
    ledger.migrate().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "TRUNCATE {TABLE}; DELETE FROM {TABLE}_horizon"
    )))
    .execute(&pool)
    .await
    .unwrap();
    seed(&pool, rows).await;

    // Warm-up (connections, caches), not counted; then without the prune.
    let _ = timed(&ledger, "w", Duration::from_secs(2)).await;
    let quiet = timed(&ledger, "a", Duration::from_secs(secs)).await;
    let quiet_secs = secs as f64;

    // During the prune: until the backlog is gone.
    let mut options = PrunerOptions::default()
        .batch(batch)
        .idle(Duration::from_millis(200));
    options = if rate == 0 {
        options.unlimited()
    } else {
        options.rows_per_second(rate)
    };
    let stop = Arc::new(AtomicBool::new(false));
    let phase = tokio::spawn({
        let (ledger, stop) = (ledger.clone(), stop.clone());
        async move { workers(&ledger, "b", stop).await }
    });
    let started = Instant::now();
    let pruner = Pruner::new(ledger.clone(), options).spawn();
    while pruner.stats().rows < rows {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!pruner.is_finished(), "the pruner ended early");
    }
    let prune_secs = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let busy = phase.await.unwrap();
    let stats = pruner.stop().await;
    let busy_secs = started.elapsed().as_secs_f64();
    let left: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {TABLE} WHERE tenant = 'old'"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(left, 0, "the prune left old records");
    let horizon = ledger
        .horizon(&Tenant::new("old").unwrap(), "capture")
        .await
        .unwrap();
    assert!(horizon.is_some(), "the prune raised no horizon");

    // Without the prune again, after it: load from elsewhere that changed
    // during the run shows up as a difference between the two.
    let after = timed(&ledger, "c", Duration::from_secs(secs)).await;

    let rate_label = if rate == 0 {
        "none".to_owned()
    } else {
        format!("{rate}")
    };
    let row = |name: &str, s: &Samples, secs: f64| {
        eprintln!(
            "{name:<15} {:>9} {:>9.0} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
            s.claim.len(),
            s.claim.len() as f64 / secs,
            pct(&s.claim, 0.5),
            pct(&s.claim, 0.99),
            pct(&s.both, 0.5),
            pct(&s.both, 0.99),
        );
    };
    eprintln!(
        "\nprune of {rows} expired records, batch {batch}, rate limit {rate_label} rows/s, {WORKERS} \
         workers claiming + completing fresh keys (ms)"
    );
    eprintln!(
        "{:<15} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "phase", "claims", "claims/s", "claim p50", "claim p99", "c+c p50", "c+c p99"
    );
    row("without prune", &quiet, quiet_secs);
    row("during prune", &busy, busy_secs);
    row("after prune", &after, quiet_secs);
    let ratio = |p: f64, f: fn(&Samples) -> &Vec<u32>| pct(f(&busy), p) / pct(f(&quiet), p);
    let claim_p50 = ratio(0.5, |s| &s.claim);
    let claim_p99 = ratio(0.99, |s| &s.claim);
    let both_p50 = ratio(0.5, |s| &s.both);
    let both_p99 = ratio(0.99, |s| &s.both);
    eprintln!(
        "{:<15} {:>9} {:>9} {:>8.2}x {:>8.2}x {:>8.2}x {:>8.2}x",
        "ratio (during/without)", "", "", claim_p50, claim_p99, both_p50, both_p99
    );
    let vs_after = |p: f64, f: fn(&Samples) -> &Vec<u32>| pct(f(&busy), p) / pct(f(&after), p);
    eprintln!(
        "{:<15} {:>9} {:>9} {:>8.2}x {:>8.2}x {:>8.2}x {:>8.2}x",
        "ratio vs after",
        "",
        "",
        vs_after(0.5, |s| &s.claim),
        vs_after(0.99, |s| &s.claim),
        vs_after(0.5, |s| &s.both),
        vs_after(0.99, |s| &s.both)
    );
    let rows_per_s = stats.rows as f64 / prune_secs;
    eprintln!(
        "prune: {} rows in {} batches, {:.1} s, {:.0} rows/s, {} errors; claim p99 ratio {:.2}x (target <= 2x)",
        stats.rows, stats.batches, prune_secs, rows_per_s, stats.errors, claim_p99
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "prune",
            "rows": rows,
            "batch": batch,
            "rate_limit": if rate == 0 { serde_json::Value::Null } else { rate.into() },
            "workers": WORKERS,
            "without_prune": {
                "claims": quiet.claim.len(), "secs": quiet_secs,
                "claim_p50_ms": pct(&quiet.claim, 0.5), "claim_p99_ms": pct(&quiet.claim, 0.99),
                "claim_complete_p50_ms": pct(&quiet.both, 0.5), "claim_complete_p99_ms": pct(&quiet.both, 0.99),
            },
            "after_prune": {
                "claims": after.claim.len(), "secs": quiet_secs,
                "claim_p50_ms": pct(&after.claim, 0.5), "claim_p99_ms": pct(&after.claim, 0.99),
                "claim_complete_p50_ms": pct(&after.both, 0.5), "claim_complete_p99_ms": pct(&after.both, 0.99),
            },
            "during_prune": {
                "claims": busy.claim.len(), "secs": busy_secs,
                "claim_p50_ms": pct(&busy.claim, 0.5), "claim_p99_ms": pct(&busy.claim, 0.99),
                "claim_complete_p50_ms": pct(&busy.both, 0.5), "claim_complete_p99_ms": pct(&busy.both, 0.99),
            },
            "ratio": {"claim_p50": claim_p50, "claim_p99": claim_p99,
                      "claim_complete_p50": both_p50, "claim_complete_p99": both_p99},
            "ratio_vs_after": {"claim_p50": vs_after(0.5, |s| &s.claim), "claim_p99": vs_after(0.99, |s| &s.claim),
                      "claim_complete_p50": vs_after(0.5, |s| &s.both),
                      "claim_complete_p99": vs_after(0.99, |s| &s.both)},
            "prune": {"rows": stats.rows, "batches": stats.batches, "errors": stats.errors,
                      "secs": prune_secs, "rows_per_s": rows_per_s},
        })
    );
}

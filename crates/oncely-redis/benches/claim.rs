//! Claim + complete of a fresh key: `RedisLedger` against hand-written
//! redis-rs commands doing the same two round trips on the same server.
//!
//! - `oncely`: `Ledger::claim` + `Ledger::complete` (two Lua scripts by
//!   `EVALSHA`: existence check, fingerprint check, server `TIME`, one hash
//!   per record with a clock fence, fenced completion; no TTL, records
//!   are deleted by prune).
//! - `baseline`: `SET key "in_progress:1" NX PX <lease>`, then
//!   `SET key <outcome> XX PX <retention>`: the usual hand-rolled Redis
//!   idempotency guard, with no fence, no fingerprint and no stored state
//!   beyond the value.
//!
//! Both sides use one `ConnectionManager` (one multiplexed connection) to the
//! server at `ONCELY_REDIS_URL` (default `redis://127.0.0.1:6379`), and keys
//! of the same shape and length. The ledger's records carry no TTL (only
//! prune deletes them), so the bench deletes every key of its prefixes when
//! it is done; the baseline's keys expire a minute after the run.
#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use oncely::backend::{Claim, Ledger, Outcome};
use oncely::{ClaimOptions, EffectKey, Tenant};
use oncely_redis::{RedisLedger, RedisLedgerOptions};
use redis::aio::ConnectionManager;

static SEQ: AtomicU64 = AtomicU64::new(0);

fn next_key(tenant: &Tenant) -> EffectKey {
    EffectKey::new(
        tenant,
        "capture",
        format!("k-{}", SEQ.fetch_add(1, Ordering::Relaxed)),
    )
    .unwrap()
}

struct Setup {
    ledger: RedisLedger,
    raw: ConnectionManager,
    tenant: Tenant,
    opts: ClaimOptions,
    outcome: Outcome,
}

async fn setup() -> Setup {
    let url = std::env::var("ONCELY_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    // What the ledger costs, whatever the server keeps: a test server that
    // persists nothing is accepted.
    let options = RedisLedgerOptions::default()
        .prefix("oncely-bench:")
        .ephemeral(true);
    let ledger = RedisLedger::connect_with(&url, options)
        .await
        .expect("Redis for the bench");
    let raw = ConnectionManager::new(redis::Client::open(url).unwrap())
        .await
        .unwrap();
    Setup {
        ledger,
        raw,
        tenant: Tenant::new(format!("bench{}", std::process::id())).unwrap(),
        opts: ClaimOptions::default().retention(Duration::from_secs(60)),
        outcome: Outcome::from_json(&serde_json::json!({"charge": "ch_1", "amount": 1250})).unwrap(),
    }
}

async fn oncely_once(s: &Setup) {
    let key = next_key(&s.tenant);
    match s.ledger.claim(&key, &s.opts).await.unwrap() {
        Claim::Acquired(lease) => s.ledger.complete(&lease, &s.outcome).await.unwrap(),
        other => panic!("{other:?}"),
    }
}

async fn baseline_once(s: &Setup, conn: &mut ConnectionManager) {
    // Same key shape as the ledger's: prefix, 16-hex tag, displayed key.
    let key = next_key(&s.tenant);
    let rkey = format!(
        "oncely-bench-baseline:{{{}}}:{key}",
        &blake3::hash(key.as_str().as_bytes()).to_hex()[..16]
    );
    let claimed: Option<String> = redis::cmd("SET")
        .arg(&rkey)
        .arg("in_progress:1")
        .arg("NX")
        .arg("PX")
        .arg(s.opts.lease.as_millis() as u64)
        .query_async(conn)
        .await
        .unwrap();
    assert!(claimed.is_some(), "fresh key acquired");
    let done: Option<String> = redis::cmd("SET")
        .arg(&rkey)
        .arg(s.outcome.as_bytes())
        .arg("XX")
        .arg("PX")
        .arg(s.opts.retention.as_millis() as u64)
        .query_async(conn)
        .await
        .unwrap();
    assert!(done.is_some(), "completed");
}

#[derive(Clone, Copy)]
enum Side {
    Oncely,
    Baseline,
}

async fn run(setup: Arc<Setup>, side: Side, tasks: u64, iters: u64) -> Duration {
    let start = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks {
        let n = iters / tasks + u64::from(t < iters % tasks);
        let setup = setup.clone();
        handles.push(tokio::spawn(async move {
            let mut conn = setup.raw.clone();
            for _ in 0..n {
                match side {
                    Side::Oncely => oncely_once(&setup).await,
                    Side::Baseline => baseline_once(&setup, &mut conn).await,
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let setup = Arc::new(rt.block_on(setup()));
    let cleanup = setup.clone();
    for (group_name, tasks) in [
        ("redis/claim_complete_1_task", 1u64),
        ("redis/claim_complete_8_tasks", 8),
    ] {
        let mut group = c.benchmark_group(group_name);
        group
            .sample_size(20)
            .measurement_time(Duration::from_secs(5))
            .warm_up_time(Duration::from_secs(1));
        for (name, side) in [("oncely", Side::Oncely), ("baseline", Side::Baseline)] {
            let setup = setup.clone();
            group.bench_function(name, |b| {
                b.to_async(&rt)
                    .iter_custom(|iters| run(setup.clone(), side, tasks, iters))
            });
        }
        group.finish();
    }
    rt.block_on(clean(&cleanup));
}

/// Deletes the ledger's records of this run (records carry no TTL: only
/// prune deletes them, and prune would wait out their retention).
async fn clean(s: &Setup) {
    let mut conn = s.raw.clone();
    let pattern = format!("oncely-bench:{{*}}:{}/*", s.tenant);
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .unwrap();
        if !keys.is_empty() {
            let _: u64 = redis::cmd("UNLINK")
                .arg(&keys)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);

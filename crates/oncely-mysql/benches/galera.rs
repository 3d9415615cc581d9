//! The duplicate storm across the nodes of a Galera cluster, next to the
//! hand-written floor on the same nodes in the same run (`oncely bench`
//! takes one URL, so one node: this is the topology it cannot reach).
//!
//! Each job is delivered twice, the two deliveries through two different
//! nodes (job `j`: nodes `j % 3` and `(j + 1) % 3`):
//!
//! - **sequential**: one worker, the second delivery after the first
//!   returned (it must find the effect completed, though the node it asks
//!   applied the completion asynchronously);
//! - **concurrent**: 8 workers, each dispatching one job's two deliveries
//!   at the same instant (one wins, on its node's certification).
//!
//! Guards: the floor (`INSERT IGNORE` with the outcome, then `SELECT` on a
//! duplicate; a certification failure, 1213, is run again: on Galera a
//! hand-written guard must do that too), and `Effects::run` with the `Wait`
//! and `Reject` policies. A delivery `Reject` turned away is delivered again
//! after the timed part. Every row checks that each job's effect ran
//! exactly once.
//!
//! Last, what a causal read costs (`SET STATEMENT wsrep_sync_wait = 1 FOR`,
//! which the ledger puts before its reads on Galera): the same primary-key
//! `SELECT`, plain and causal, on one node, one at a time.
//!
//! `cargo bench -p oncely-mysql --bench galera` (nodes: `ONCELY_GALERA_URLS`,
//! or the cluster `scripts/galera-cluster.sh up` starts; jobs:
//! `ONCELY_BENCH_JOBS`, default 2000).
#![allow(missing_docs)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use oncely::{ClaimOptions, EffectKey, Effects, Error, Failure, OnInProgress, Tenant};
use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};
use sqlx::{Executor, MySqlPool};

const WORKERS: usize = 8;

#[derive(Clone, Copy, PartialEq)]
enum Guard {
    Floor,
    Wait,
    Reject,
}

impl Guard {
    fn name(self) -> &'static str {
        match self {
            Guard::Floor => "hand-written",
            Guard::Wait => "oncely Wait",
            Guard::Reject => "oncely Reject",
        }
    }
}

struct Nodes {
    ledgers: Vec<MySqlLedger>,
    pools: Vec<MySqlPool>,
    table: String,
    ran: AtomicU64,
}

impl Nodes {
    /// The floor's delivery on node `n`: true when it ran the effect.
    async fn floor(&self, n: usize, key: &str) -> bool {
        let insert = format!("INSERT IGNORE INTO `{}` (k, outcome) VALUES (?, ?)", self.table);
        let select = format!("SELECT outcome FROM `{}` WHERE k = ?", self.table);
        loop {
            let done = sqlx::query(sqlx::AssertSqlSafe(insert.as_str()))
                .bind(key)
                .bind(b"\"done\"".to_vec())
                .execute(&self.pools[n])
                .await;
            match done {
                Ok(d) if d.rows_affected() == 1 => {
                    self.ran.fetch_add(1, Ordering::Relaxed);
                    return true;
                }
                Ok(_) => {
                    let rows = sqlx::query(sqlx::AssertSqlSafe(select.as_str()))
                        .bind(key)
                        .fetch_all(&self.pools[n])
                        .await
                        .unwrap();
                    assert_eq!(rows.len(), 1);
                    return false;
                }
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("40001") => continue,
                Err(e) => panic!("floor: {e}"),
            }
        }
    }

    /// One delivery through node `n`; `false`: rejected (in progress).
    async fn deliver(&self, guard: Guard, n: usize, key: &EffectKey, opts: &ClaimOptions) -> bool {
        if guard == Guard::Floor {
            self.floor(n, key.as_str()).await;
            return true;
        }
        let effects = Effects::new(self.ledgers[n].clone());
        let r = effects
            .run(key, opts, |_| async {
                self.ran.fetch_add(1, Ordering::Relaxed);
                Ok::<_, Failure>("done".to_owned())
            })
            .await;
        match r {
            Ok(_) => true,
            Err(Error::InProgress { .. }) => false,
            Err(e) => panic!("{} on node {n}: {e}", guard.name()),
        }
    }
}

async fn row(nodes: &Arc<Nodes>, tenant: &Tenant, concurrent: bool, guard: Guard, jobs: usize) {
    let opts = ClaimOptions::default().on_in_progress(match guard {
        Guard::Reject => OnInProgress::Reject,
        _ => OnInProgress::Wait {
            max: Duration::from_secs(30),
        },
    });
    let mode = if concurrent { "concurrent" } else { "sequential" };
    let keys: Arc<Vec<EffectKey>> = Arc::new(
        (0..jobs)
            .map(|j| EffectKey::new(tenant, "capture", format!("{mode}-{}-{j}", guard.name())).unwrap())
            .collect(),
    );
    nodes.ran.store(0, Ordering::Relaxed);
    let rejected = Arc::new(std::sync::Mutex::new(Vec::new()));
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let workers = if concurrent { WORKERS } else { 1 };
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (nodes, keys, opts, rejected, next) = (
            nodes.clone(),
            keys.clone(),
            opts.clone(),
            rejected.clone(),
            next.clone(),
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let j = next.fetch_add(1, Ordering::Relaxed) as usize;
                if j >= keys.len() {
                    return;
                }
                let (a, b) = (j % 3, (j + 1) % 3);
                let k = &keys[j];
                let (ra, rb) = if concurrent {
                    tokio::join!(
                        nodes.deliver(guard, a, k, &opts),
                        nodes.deliver(guard, b, k, &opts)
                    )
                } else {
                    let ra = nodes.deliver(guard, a, k, &opts).await;
                    (ra, nodes.deliver(guard, b, k, &opts).await)
                };
                for (ok, n) in [(ra, a), (rb, b)] {
                    if !ok {
                        rejected.lock().unwrap().push((j, n));
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let took = started.elapsed();
    // Redelivered, as a broker would: each gets the stored outcome.
    let again = std::mem::take(&mut *rejected.lock().unwrap());
    for (j, n) in &again {
        let wait = opts.clone().on_in_progress(OnInProgress::Wait {
            max: Duration::from_secs(30),
        });
        assert!(nodes.deliver(guard, *n, &keys[*j], &wait).await);
    }
    let ran = nodes.ran.load(Ordering::Relaxed);
    assert_eq!(
        ran,
        jobs as u64,
        "{mode} {}: effects ran {ran} times for {jobs} jobs",
        guard.name()
    );
    let rate = (2 * jobs) as f64 / took.as_secs_f64();
    println!(
        "{mode:<11} {:<14} {rate:>9.0} deliveries/s  ({} redelivered)  effects {ran}",
        guard.name(),
        again.len()
    );
}

async fn causal_cost(pool: &MySqlPool, table: &str, key: &str) {
    // Interleaved, one at a time, so both see the same load; medians.
    let plain = format!("SELECT outcome FROM `{table}` WHERE k = ?");
    let causal = format!("SET STATEMENT wsrep_sync_wait = 1 FOR {plain}");
    let n = 5000;
    let (mut p, mut c) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        for (q, times) in [(&plain, &mut p), (&causal, &mut c)] {
            let started = Instant::now();
            sqlx::query(sqlx::AssertSqlSafe(q.as_str()))
                .bind(key)
                .fetch_all(pool)
                .await
                .unwrap();
            times.push(started.elapsed());
        }
    }
    for (name, times) in [("plain read", &mut p), ("causal read", &mut c)] {
        times.sort();
        println!(
            "{name:<12} p50 {:>4} µs, p99 {:>5} µs ({n} reads, interleaved)",
            times[n / 2].as_micros(),
            times[n * 99 / 100].as_micros()
        );
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let jobs: usize = std::env::var("ONCELY_BENCH_JOBS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let urls = common::galera_urls().expect("a Galera cluster");
    let mut ledgers = Vec::new();
    let mut pools = Vec::new();
    for url in &urls {
        let l = MySqlLedger::connect_with(url, MySqlLedgerOptions::default().max_connections(20))
            .await
            .unwrap();
        pools.push(
            sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(20)
                .connect(url)
                .await
                .unwrap(),
        );
        ledgers.push(l);
    }
    let table = format!("galera_bench_floor_{}", std::process::id());
    pools[0]
        .execute(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE `{table}` (k VARCHAR(255) PRIMARY KEY, outcome BLOB) ENGINE = InnoDB"
        )))
        .await
        .unwrap();
    let nodes = Arc::new(Nodes {
        ledgers,
        pools,
        table: table.clone(),
        ran: AtomicU64::new(0),
    });
    let tenant = Tenant::new(format!("bench-galera-{}", std::process::id())).unwrap();
    println!(
        "{jobs} jobs x 2 deliveries through two different nodes of {}",
        urls.join(", ")
    );
    for concurrent in [false, true] {
        for guard in [Guard::Floor, Guard::Wait, Guard::Reject] {
            if guard == Guard::Reject && !concurrent {
                continue;
            }
            row(&nodes, &tenant, concurrent, guard, jobs).await;
        }
    }
    causal_cost(&nodes.pools[0], &table, "sequential-hand-written-0").await;
    nodes.pools[0]
        .execute(sqlx::AssertSqlSafe(format!("DROP TABLE `{table}`")))
        .await
        .unwrap();
}

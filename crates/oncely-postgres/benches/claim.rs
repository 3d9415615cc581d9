//! `PgLedger` against hand-written sqlx doing the same work on an identical
//! table of the same server, in the same run.
//!
//! - `claim_complete_{1_task,8_tasks}`: claim + complete of a fresh key.
//!   `baseline`: `INSERT … ON CONFLICT (key) DO NOTHING RETURNING fence`,
//!   then the fenced `UPDATE … WHERE key = $1 AND fence = $2 AND state =
//!   'in_progress'`; `baseline_plus_guard`: the same with the
//!   leaked-transaction guard (the `pg_cursors` lookup) in both statements.
//! - `storm_{sequential,concurrent}`: the duplicate storm. Every job is
//!   delivered twice; sequential delivers the second after the first
//!   finished, concurrent delivers both at the same instant (4 jobs in
//!   flight, so 8 deliveries at once). One iteration is one job (two
//!   deliveries). `oncely_wait`: `Effects::run` with the `Wait` policy (the
//!   duplicate waits for the outcome: woken by the ledger's notification);
//!   `oncely_reject`: the `Reject` policy (a duplicate that finds the effect
//!   in progress fails at once with `InProgress`); `baseline`: the claim
//!   insert above, the effect and the completion by whoever inserted, and
//!   one `SELECT` of the row by the duplicate (which does not wait). The
//!   effect must run once per job: a job run twice panics the bench.
//! - `batch_100`: claim + complete of 100 fresh keys. `oncely_batch`:
//!   `claim_many` + `complete_many` (one statement each); `baseline_batch`:
//!   the two hand-written statements over `unnest` arrays; `oncely_single`:
//!   the same 100 keys claimed and completed one at a time. One iteration is
//!   one batch of 100.
//!
//! Before the timed groups, a report (stderr) of what each storm variant
//! costs the server per job: WAL bytes, transaction ids, WAL syncs
//! (`pg_stat_wal.wal_sync`: the flushes commits wait on) and server CPU (the
//! sum of `/proc/<pid>/schedstat` over the server's postmaster and its
//! children, found through `pg_read_file('postmaster.pid')`). The counters
//! are the whole server's: anything else it runs meanwhile is counted too,
//! so for exact numbers point `ONCELY_POSTGRES_URL` at a cluster of its own
//! (docs/benchmarks.md shows how).
//!
//! Needs PostgreSQL at `ONCELY_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`):
//! `cargo bench -p oncely-postgres --bench claim`.
#![allow(missing_docs)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use oncely::backend::{Claim, Ledger, Outcome};
use oncely::{ClaimOptions, EffectKey, Effects, OnInProgress, Tenant};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const BASELINE_TABLE: &str = "oncely_bench_baseline";

static SEQ: AtomicU64 = AtomicU64::new(0);

fn next_subject() -> String {
    format!("k-{}", SEQ.fetch_add(1, Ordering::Relaxed))
}

struct Setup {
    ledger: PgLedger,
    effects: Effects<PgLedger>,
    pool: PgPool,
    tenant: Tenant,
    /// How many times a storm's effect ran, and how many jobs it was given.
    ran: AtomicU64,
    jobs: AtomicU64,
}

impl Setup {
    fn key(&self) -> EffectKey {
        EffectKey::new(&self.tenant, "capture", next_subject()).unwrap()
    }

    /// Panics if any job's effect ran more than once (or never).
    fn check_once(&self) {
        let (ran, jobs) = (self.ran.load(Ordering::SeqCst), self.jobs.load(Ordering::SeqCst));
        assert_eq!(ran, jobs, "effects executed {ran} for {jobs} jobs");
    }
}

const CLAIM: &str = "INSERT INTO oncely_bench_baseline (key, tenant, kind, subject, state, fence, \
     fingerprint, outcome, at_most_once, created_at, updated_at, lease_expires_at, retain_until, retention_us) \
     VALUES ($1, $2, $3, $4, 'in_progress', 1, NULL, NULL, false, now(), now(), \
     now() + $5::bigint * interval '1 microsecond', now() + $6::bigint * interval '1 microsecond', $6) \
     ON CONFLICT (key) DO NOTHING RETURNING fence";

const COMPLETE: &str = "UPDATE oncely_bench_baseline SET state = 'completed', outcome = $3, \
     lease_expires_at = NULL, updated_at = now(), \
     retain_until = now() + retention_us * interval '1 microsecond' \
     WHERE key = $1 AND fence = $2 AND state = 'in_progress'";

const READ: &str = "SELECT state, outcome FROM oncely_bench_baseline WHERE key = $1";

const CLAIM_BATCH: &str = "INSERT INTO oncely_bench_baseline (key, tenant, kind, subject, state, fence, \
     fingerprint, outcome, at_most_once, created_at, updated_at, lease_expires_at, retain_until, retention_us) \
     SELECT i.key, i.tenant, i.kind, i.subject, 'in_progress', 1, NULL, NULL, false, now(), now(), \
     now() + $5::bigint * interval '1 microsecond', now() + $6::bigint * interval '1 microsecond', $6 \
     FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS i(key, tenant, kind, subject) \
     ON CONFLICT (key) DO NOTHING RETURNING key, fence";

const COMPLETE_BATCH: &str = "UPDATE oncely_bench_baseline AS e SET state = 'completed', outcome = i.outcome, \
     lease_expires_at = NULL, updated_at = now(), \
     retain_until = now() + e.retention_us * interval '1 microsecond' \
     FROM unnest($1::text[], $2::bigint[], $3::bytea[]) AS i(key, fence, outcome) \
     WHERE e.key = i.key AND e.fence = i.fence AND e.state = 'in_progress'";

const GUARD: &str = "coalesce((SELECT c.creation_time = transaction_timestamp() \
     FROM pg_catalog.pg_cursors c WHERE c.name = ''), false)";

async fn setup() -> Setup {
    let url = std::env::var("ONCELY_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    // One pool for both sides: same size, same settings, same server.
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .test_before_acquire(false)
        .connect(&url)
        .await
        .expect("PostgreSQL for the bench");
    let ledger =
        PgLedger::from_pool_with(pool.clone(), PgLedgerOptions::default().table("oncely_bench")).unwrap();
    ledger.migrate().await.unwrap();
    // The baseline's table is created by the same migration, so the two
    // tables are identical (columns, constraints, indexes).
    let twin =
        PgLedger::from_pool_with(pool.clone(), PgLedgerOptions::default().table(BASELINE_TABLE)).unwrap();
    twin.migrate().await.unwrap();
    sqlx::raw_sql("TRUNCATE oncely_bench, oncely_bench_baseline")
        .execute(&pool)
        .await
        .unwrap();
    Setup {
        effects: Effects::new(ledger.clone()),
        ledger,
        pool,
        tenant: Tenant::new(format!("bench{}", std::process::id())).unwrap(),
        ran: AtomicU64::new(0),
        jobs: AtomicU64::new(0),
    }
}

fn outcome() -> Outcome {
    Outcome::from_json(&serde_json::json!({"charge": "ch_1", "amount": 1250})).unwrap()
}

async fn oncely_once(ledger: &PgLedger, key: &EffectKey, opts: &ClaimOptions, outcome: &Outcome) {
    match ledger.claim(key, opts).await.unwrap() {
        Claim::Acquired(lease) => ledger.complete(&lease, outcome).await.unwrap(),
        other => panic!("{other:?}"),
    }
}

async fn baseline_claim(pool: &PgPool, key: &EffectKey, opts: &ClaimOptions, sql: &str) -> Option<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(key.as_str())
        .bind(key.tenant().as_str())
        .bind(key.kind())
        .bind(key.subject())
        .bind(oncely::backend::duration_micros(opts.lease))
        .bind(oncely::backend::duration_micros(opts.retention))
        .fetch_optional(pool)
        .await
        .unwrap()
}

async fn baseline_complete(pool: &PgPool, key: &EffectKey, fence: i64, outcome: &Outcome, sql: &str) {
    let done = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(key.as_str())
        .bind(fence)
        .bind(outcome.as_bytes())
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(done.rows_affected(), 1);
}

async fn baseline_once(pool: &PgPool, key: &EffectKey, opts: &ClaimOptions, outcome: &Outcome, sql: &Sql) {
    let fence = baseline_claim(pool, key, opts, &sql.claim)
        .await
        .expect("fresh key acquired");
    baseline_complete(pool, key, fence, outcome, &sql.complete).await;
}

#[derive(Clone)]
struct Sql {
    claim: String,
    complete: String,
}

impl Sql {
    fn plain() -> Self {
        Sql {
            claim: CLAIM.into(),
            complete: COMPLETE.into(),
        }
    }

    fn guarded() -> Self {
        Sql {
            claim: CLAIM
                .replace(
                    "VALUES ($1, $2, $3, $4, 'in_progress', 1, NULL, NULL, false, now(), now(), \
     now() + $5::bigint * interval '1 microsecond', now() + $6::bigint * interval '1 microsecond', $6)",
                    "SELECT $1, $2, $3, $4, 'in_progress', 1, NULL, NULL, false, now(), now(), \
     now() + $5::bigint * interval '1 microsecond', now() + $6::bigint * interval '1 microsecond', $6 \
     WHERE GUARD",
                )
                .replace("GUARD", GUARD),
            complete: format!("{COMPLETE} AND {GUARD}"),
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Side {
    Oncely,
    Baseline,
    BaselineGuarded,
}

async fn run(setup: Arc<Setup>, side: Side, tasks: u64, iters: u64) -> Duration {
    let opts = ClaimOptions::default();
    let outcome = outcome();
    let start = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks {
        let n = iters / tasks + u64::from(t < iters % tasks);
        let (setup, opts, outcome) = (setup.clone(), opts.clone(), outcome.clone());
        handles.push(tokio::spawn(async move {
            let sql = match side {
                Side::BaselineGuarded => Sql::guarded(),
                _ => Sql::plain(),
            };
            for _ in 0..n {
                let key = setup.key();
                match side {
                    Side::Oncely => oncely_once(&setup.ledger, &key, &opts, &outcome).await,
                    Side::Baseline | Side::BaselineGuarded => {
                        baseline_once(&setup.pool, &key, &opts, &outcome, &sql).await
                    }
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    start.elapsed()
}

/// A storm variant: who delivers.
#[derive(Clone, Copy, Debug)]
enum Storm {
    OncelyWait,
    OncelyReject,
    Baseline,
}

/// One delivery of the job `key`.
async fn deliver(setup: &Setup, storm: Storm, key: &EffectKey, outcome: &Outcome) {
    let ran = || {
        setup.ran.fetch_add(1, Ordering::SeqCst);
    };
    match storm {
        Storm::OncelyWait | Storm::OncelyReject => {
            let policy = match storm {
                Storm::OncelyWait => OnInProgress::Wait {
                    max: Duration::from_secs(30),
                },
                _ => OnInProgress::Reject,
            };
            let opts = ClaimOptions::default().on_in_progress(policy);
            let answer = setup
                .effects
                .run(key, &opts, |_lease| async {
                    ran();
                    Ok(serde_json::json!({"charge": "ch_1", "amount": 1250}))
                })
                .await;
            match answer {
                Ok(_) => {}
                Err(e) if e.is_in_progress() && matches!(storm, Storm::OncelyReject) => {}
                Err(e) => panic!("{key}: {e:?}"),
            }
        }
        Storm::Baseline => {
            let opts = ClaimOptions::default();
            match baseline_claim(&setup.pool, key, &opts, CLAIM).await {
                Some(fence) => {
                    ran();
                    baseline_complete(&setup.pool, key, fence, outcome, COMPLETE).await;
                }
                None => {
                    let row: Option<(String, Option<Vec<u8>>)> = sqlx::query_as(READ)
                        .bind(key.as_str())
                        .fetch_optional(&setup.pool)
                        .await
                        .unwrap();
                    assert!(row.is_some());
                }
            }
        }
    }
}

/// `jobs` jobs, each delivered twice: one after the other (`concurrent`
/// false, one job at a time), or both at once with 4 jobs in flight.
async fn storm(setup: Arc<Setup>, storm: Storm, concurrent: bool, jobs: u64) -> Duration {
    let workers = if concurrent { 4 } else { 1 };
    setup.jobs.fetch_add(jobs, Ordering::SeqCst);
    let start = Instant::now();
    let mut handles = Vec::new();
    for w in 0..workers {
        let n = jobs / workers + u64::from(w < jobs % workers);
        let setup = setup.clone();
        handles.push(tokio::spawn(async move {
            let outcome = outcome();
            for _ in 0..n {
                let key = setup.key();
                if concurrent {
                    tokio::join!(
                        deliver(&setup, storm, &key, &outcome),
                        deliver(&setup, storm, &key, &outcome)
                    );
                } else {
                    deliver(&setup, storm, &key, &outcome).await;
                    deliver(&setup, storm, &key, &outcome).await;
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    let elapsed = start.elapsed();
    setup.check_once();
    elapsed
}

/// A batch variant.
#[derive(Clone, Copy, Debug)]
enum Batch {
    Oncely,
    Baseline,
    OncelySingle,
}

const BATCH: usize = 100;

async fn batch(setup: &Setup, how: Batch) {
    let keys: Vec<EffectKey> = (0..BATCH).map(|_| setup.key()).collect();
    let opts = ClaimOptions::default();
    let outcome = outcome();
    match how {
        Batch::Oncely => {
            let items: Vec<_> = setup
                .ledger
                .claim_many(&keys, &opts)
                .await
                .unwrap()
                .into_iter()
                .map(|c| match c.unwrap() {
                    Claim::Acquired(l) => (l, outcome.clone()),
                    other => panic!("{other:?}"),
                })
                .collect();
            for done in setup.ledger.complete_many(&items).await {
                done.unwrap();
            }
        }
        Batch::OncelySingle => {
            for key in &keys {
                oncely_once(&setup.ledger, key, &opts, &outcome).await;
            }
        }
        Batch::Baseline => {
            let col = |f: fn(&EffectKey) -> &str| keys.iter().map(f).collect::<Vec<_>>();
            let rows: Vec<(String, i64)> = sqlx::query_as(CLAIM_BATCH)
                .bind(col(EffectKey::as_str))
                .bind(col(|k| k.tenant().as_str()))
                .bind(col(EffectKey::kind))
                .bind(col(EffectKey::subject))
                .bind(oncely::backend::duration_micros(opts.lease))
                .bind(oncely::backend::duration_micros(opts.retention))
                .fetch_all(&setup.pool)
                .await
                .unwrap();
            assert_eq!(rows.len(), BATCH);
            let (ks, fences): (Vec<String>, Vec<i64>) = rows.into_iter().unzip();
            let outcomes: Vec<&[u8]> = ks.iter().map(|_| outcome.as_bytes()).collect();
            let done = sqlx::query(COMPLETE_BATCH)
                .bind(&ks)
                .bind(&fences)
                .bind(&outcomes)
                .execute(&setup.pool)
                .await
                .unwrap();
            assert_eq!(done.rows_affected(), BATCH as u64);
        }
    }
}

/// CPU time of this server's processes, by pid, in nanoseconds: the
/// postmaster `postmaster` and its children (another cluster on the same
/// machine is not counted). Without a postmaster pid, every `postgres`
/// process.
fn server_cpu(postmaster: Option<u32>) -> HashMap<u32, u64> {
    let mut cpu = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return cpu;
    };
    for entry in dir.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if comm.trim() != "postgres" {
            continue;
        }
        if let Some(pm) = postmaster {
            // /proc/<pid>/stat: "pid (comm) state ppid ..."; comm is "postgres".
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            let ppid = stat
                .rsplit(')')
                .next()
                .and_then(|rest| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if pid != pm && ppid != Some(pm) {
                continue;
            }
        }
        let stat = std::fs::read_to_string(entry.path().join("schedstat")).unwrap_or_default();
        if let Some(ns) = stat.split_whitespace().next().and_then(|n| n.parse().ok()) {
            cpu.insert(pid, ns);
        }
    }
    cpu
}

/// The server's postmaster pid (the first line of its `postmaster.pid`),
/// readable when the bench connects as a superuser on the same machine.
async fn postmaster_pid(pool: &PgPool) -> Option<u32> {
    let file: String = sqlx::query_scalar("SELECT pg_read_file('postmaster.pid')")
        .fetch_one(pool)
        .await
        .ok()?;
    file.lines().next()?.trim().parse().ok()
}

/// WAL bytes inserted, the next transaction id and the WAL syncs (the
/// flushes a commit waits on; `pg_stat_wal`, cluster-wide) so far.
async fn wal_and_xid(pool: &PgPool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint, \
         pg_snapshot_xmax(pg_current_snapshot())::text::bigint, \
         (SELECT wal_sync FROM pg_stat_wal)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Longer than PostgreSQL's idle statistics interval (10 s in 15), so that
/// `pg_stat_wal` holds every backend's syncs when it is read.
const STATS_FLUSH: Duration = Duration::from_secs(11);

/// Per job: WAL bytes, transaction ids, WAL syncs and server CPU of each
/// storm variant.
async fn report(setup: Arc<Setup>) {
    const JOBS: u64 = 1000;
    let postmaster = postmaster_pid(&setup.pool).await;
    eprintln!(
        "\nserver cost per job of {JOBS} jobs x 2 deliveries (the whole server, {}: noisy if shared)",
        match postmaster {
            Some(pid) => format!("CPU of postmaster {pid} and its children"),
            None => "CPU of every postgres process on this machine".to_owned(),
        }
    );
    eprintln!(
        "{:<28} {:>10} {:>10} {:>11} {:>12} {:>14}",
        "variant", "WAL B/job", "xids/job", "syncs/job", "CPU us/job", "deliveries/s"
    );
    for concurrent in [false, true] {
        for s in [Storm::Baseline, Storm::OncelyWait, Storm::OncelyReject] {
            if !concurrent && matches!(s, Storm::OncelyReject) {
                continue; // sequential duplicates never find one in progress
            }
            let (wal0, xid0, sync0) = wal_and_xid(&setup.pool).await;
            let cpu0 = server_cpu(postmaster);
            let elapsed = storm(setup.clone(), s, concurrent, JOBS).await;
            let cpu1 = server_cpu(postmaster);
            // PostgreSQL 15 backends report their WAL statistics at most once
            // a second while busy and within ten seconds once idle: wait for
            // the stragglers, or a short variant's syncs count in the next.
            tokio::time::sleep(STATS_FLUSH).await;
            let (wal1, xid1, sync1) = wal_and_xid(&setup.pool).await;
            let cpu: u64 = cpu1
                .iter()
                .filter_map(|(pid, ns)| cpu0.get(pid).map(|before| ns.saturating_sub(*before)))
                .sum();
            let mode = if concurrent { "concurrent" } else { "sequential" };
            eprintln!(
                "{:<28} {:>10.0} {:>10.2} {:>11.2} {:>12.0} {:>14.0}",
                format!("{mode} {s:?}"),
                (wal1 - wal0) as f64 / JOBS as f64,
                (xid1 - xid0) as f64 / JOBS as f64,
                (sync1 - sync0) as f64 / JOBS as f64,
                cpu as f64 / 1000.0 / JOBS as f64,
                (2 * JOBS) as f64 / elapsed.as_secs_f64(),
            );
        }
    }
    let status = setup.ledger.listener_status();
    eprintln!(
        "listener: listening {}, {} notifications\n",
        status.listening, status.notifications
    );
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let setup = Arc::new(rt.block_on(setup()));
    if std::env::var_os("ONCELY_BENCH_NO_REPORT").is_none() {
        rt.block_on(report(setup.clone()));
    }
    for (group_name, tasks) in [
        ("postgres/claim_complete_1_task", 1u64),
        ("postgres/claim_complete_8_tasks", 8),
    ] {
        let mut group = c.benchmark_group(group_name);
        group
            .sample_size(20)
            .measurement_time(Duration::from_secs(5))
            .warm_up_time(Duration::from_secs(1));
        for (name, side) in [
            ("oncely", Side::Oncely),
            ("baseline", Side::Baseline),
            ("baseline_plus_guard", Side::BaselineGuarded),
        ] {
            let setup = setup.clone();
            group.bench_function(name, |b| {
                b.to_async(&rt)
                    .iter_custom(|iters| run(setup.clone(), side, tasks, iters))
            });
        }
        group.finish();
    }
    for (group_name, concurrent) in [
        ("postgres/storm_sequential", false),
        ("postgres/storm_concurrent", true),
    ] {
        let mut group = c.benchmark_group(group_name);
        group
            .sample_size(20)
            .measurement_time(Duration::from_secs(5))
            .warm_up_time(Duration::from_secs(1));
        for (name, s) in [
            ("oncely_wait", Storm::OncelyWait),
            ("oncely_reject", Storm::OncelyReject),
            ("baseline", Storm::Baseline),
        ] {
            if !concurrent && matches!(s, Storm::OncelyReject) {
                continue;
            }
            let setup = setup.clone();
            group.bench_function(name, |b| {
                b.to_async(&rt)
                    .iter_custom(|iters| storm(setup.clone(), s, concurrent, iters))
            });
        }
        group.finish();
    }
    let mut group = c.benchmark_group("postgres/batch_100");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .warm_up_time(Duration::from_secs(1));
    for (name, how) in [
        ("oncely_batch", Batch::Oncely),
        ("baseline_batch", Batch::Baseline),
        ("oncely_single", Batch::OncelySingle),
    ] {
        let setup = setup.clone();
        group.bench_function(name, |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let setup = setup.clone();
                async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        batch(&setup, how).await;
                    }
                    start.elapsed()
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

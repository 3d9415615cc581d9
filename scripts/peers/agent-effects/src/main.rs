//! The duplicate storm against agent-effects: N jobs, each delivered twice.
//!
//! sequential: one worker, the second delivery right after the first returned.
//! concurrent: 8 workers; each takes the next job, dispatches both deliveries at
//! once, waits for both, then takes the next job. A delivery that gets
//! `EffectOutcome::InProgress` (the other delivery holds the lease) is
//! redelivered after 5 ms, as a broker would, until it gets the committed
//! result; those redeliveries are counted as retries.
//!
//! Usage: agent-effects-storm <postgres|sqlite> [jobs]
//! Postgres URL from PEER_PG_URL (default postgres://postgres@127.0.0.1:5432/test).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use agent_effects::store::EffectStore;
use agent_effects::{EffectOutcome, Runtime};

const WORKERS: usize = 8;
const RETRY_SLEEP: Duration = Duration::from_millis(5);

struct Storm {
    effects: Vec<AtomicU32>,
    retries: AtomicU64,
}

async fn deliver<S: EffectStore + Clone>(rt: &Runtime<S>, storm: &Arc<Storm>, name: &str, job: usize) {
    loop {
        let s = Arc::clone(storm);
        let outcome = rt
            .effect(name, job)
            .run(move |_ctx| {
                let s = Arc::clone(&s);
                async move {
                    // The effect: a counter increment keyed by job.
                    s.effects[job].fetch_add(1, Ordering::SeqCst);
                    Ok::<u64, agent_effects::EffectFailure>(job as u64)
                }
            })
            .await
            .expect("agent-effects infrastructure error");
        match outcome {
            EffectOutcome::Committed(v) => {
                assert_eq!(v, job as u64);
                return;
            }
            EffectOutcome::InProgress { .. } => {
                storm.retries.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(RETRY_SLEEP).await;
            }
            other => panic!("job {job}: unexpected outcome {other:?}"),
        }
    }
}

fn check(storm: &Storm, mode: &str) -> u64 {
    let mut total = 0u64;
    for (job, c) in storm.effects.iter().enumerate() {
        let n = c.load(Ordering::SeqCst);
        if n != 1 {
            eprintln!("{mode}: job {job} ran its effect {n} times");
            std::process::exit(1);
        }
        total += u64::from(n);
    }
    total
}

async fn storm<S: EffectStore + Clone + 'static>(rt: Runtime<S>, jobs: usize, backend: &str) {
    // Sequential.
    let seq = Arc::new(Storm { effects: (0..jobs).map(|_| AtomicU32::new(0)).collect(), retries: AtomicU64::new(0) });
    let start = Instant::now();
    for job in 0..jobs {
        deliver(&rt, &seq, "storm.seq", job).await;
        deliver(&rt, &seq, "storm.seq", job).await;
    }
    let seq_secs = start.elapsed().as_secs_f64();
    let seq_effects = check(&seq, "sequential");

    // Concurrent.
    let conc = Arc::new(Storm { effects: (0..jobs).map(|_| AtomicU32::new(0)).collect(), retries: AtomicU64::new(0) });
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..WORKERS {
        let (rt, conc, next) = (rt.clone(), Arc::clone(&conc), Arc::clone(&next));
        workers.push(tokio::spawn(async move {
            loop {
                let job = next.fetch_add(1, Ordering::Relaxed);
                if job >= jobs {
                    break;
                }
                let (a, b) = (rt.clone(), rt.clone());
                let (ca, cb) = (Arc::clone(&conc), Arc::clone(&conc));
                let d1 = tokio::spawn(async move { deliver(&a, &ca, "storm.conc", job).await });
                let d2 = tokio::spawn(async move { deliver(&b, &cb, "storm.conc", job).await });
                d1.await.unwrap();
                d2.await.unwrap();
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    let conc_secs = start.elapsed().as_secs_f64();
    let conc_effects = check(&conc, "concurrent");

    let deliveries = (2 * jobs) as f64;
    println!(
        "{}",
        serde_json::json!({
            "peer": "agent-effects",
            "peer_version": "0.2.0",
            "backend": backend,
            "jobs": jobs,
            "sequential_deliveries_per_sec": (deliveries / seq_secs).round() as u64,
            "concurrent_deliveries_per_sec": (deliveries / conc_secs).round() as u64,
            "effects": { "sequential": seq_effects, "concurrent": conc_effects },
            "retries": { "sequential": seq.retries.load(Ordering::Relaxed), "concurrent": conc.retries.load(Ordering::Relaxed) },
        })
    );
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let backend = args.next().unwrap_or_else(|| "sqlite".into());
    let jobs: usize = args.next().map_or(5000, |s| s.parse().expect("jobs"));
    let run = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis();
    match backend.as_str() {
        "postgres" => {
            let url = std::env::var("PEER_PG_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
            // A fresh schema per run, dropped afterwards.
            let schema = format!("ae_storm_{run}");
            let store = agent_effects_postgres::PostgresOptions::new()
                .schema(schema.clone())
                .max_connections(16)
                .connect(&url)
                .await
                .expect("connect postgres");
            let pool = store.pool().clone();
            storm(Runtime::new(store), jobs, "postgres").await;
            // The name is ours (digits only), so building the statement is safe.
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
                .execute(&pool)
                .await
                .expect("drop schema");
        }
        "sqlite" => {
            let dir = std::env::temp_dir().join(format!("ae-storm-{run}"));
            std::fs::create_dir_all(&dir).unwrap();
            let store = agent_effects_sqlite::SqliteStore::open(dir.join("effects.db"))
                .await
                .expect("open sqlite");
            storm(Runtime::new(store.clone()), jobs, "sqlite").await;
            store.pool().close().await;
            std::fs::remove_dir_all(&dir).unwrap();
        }
        other => panic!("unknown backend {other}; use postgres or sqlite"),
    }
}

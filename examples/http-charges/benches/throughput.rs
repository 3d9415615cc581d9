//! Requests/s of `POST /charges` with and without the `Idempotency-Key`
//! layer, on SQLite and on PostgreSQL, in one run: the report is the ratio.
//!
//! The load comes from a Rust HTTP/1.1 client in this process, over
//! loopback, with a fixed number of requests in flight. Each round measures,
//! on the same machine one after the other:
//! - `without`: the endpoint with no layer;
//! - `with`: every request with a new key (the full path: claim, run the
//!   handler, store the response), the number the ratio is about;
//! - `replays`: every request a retry of a completed key (one read);
//! - `ledger alone`: `Effects::run` of fresh keys with a trivial handler and
//!   no HTTP at all, as many in flight: the ceiling the ledger's two durable
//!   writes per key put on `with`.
//!
//! The median of the rounds is reported. `cargo bench -p http-charges
//! --bench throughput` (PostgreSQL and Redis from `ONCELY_POSTGRES_URL` and
//! `ONCELY_REDIS_URL`, by default the loopback servers; skipped when
//! unreachable, unless `ONCELY_REQUIRE_SERVICES=1`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use http_charges::{Charges, api, idempotent_api};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use oncely::backend::{Fingerprint, Ledger};
use oncely::conformance::{service_url, skip_or_fail};
use oncely::{ClaimOptions, EffectKey, Effects, Tenant};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use oncely_sqlite::SqliteLedger;

const IN_FLIGHT: usize = 16;
const REQUESTS: usize = 2000;
const WARMUP: usize = 200;
const ROUNDS: usize = 3;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite:{}", dir.path().join("bench.db").display());
        let sqlite = Arc::new(SqliteLedger::connect(&url).await.unwrap());
        compare("sqlite", sqlite).await;

        if let Some(url) = service_url(
            "ONCELY_POSTGRES_URL",
            Some("postgres://postgres@127.0.0.1:5432/test"),
        ) {
            let options = PgLedgerOptions::default().table("oncely_tower_bench");
            match PgLedger::connect_with(&url, options).await {
                Ok(pg) => {
                    // Keys of earlier runs go, so the table stays one run big.
                    sqlx::query("TRUNCATE oncely_tower_bench")
                        .execute(pg.pool())
                        .await
                        .unwrap();
                    compare("postgres", Arc::new(pg)).await;
                }
                Err(e) => skip_or_fail::<()>(&format!("PostgreSQL at {url}: {e}")).unwrap_or(()),
            }
        }
        if let Some(url) = service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379")) {
            // The service's cost, whatever the server keeps: a test server
            // that persists nothing is accepted.
            let options = oncely_redis::RedisLedgerOptions::default().ephemeral(true);
            match oncely_redis::RedisLedger::connect_with(&url, options).await {
                Ok(redis) => compare("redis", Arc::new(redis)).await,
                Err(e) => skip_or_fail::<()>(&format!("Redis at {url}: {e}")).unwrap_or(()),
            }
        }
    });
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

async fn compare<L: Ledger + Clone + 'static>(backend: &str, ledger: L) {
    let plain = serve(api(Charges::default())).await;
    let guarded = serve(idempotent_api(ledger.clone(), Charges::default())).await;
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(IN_FLIGHT)
        .build_http();
    load(&client, plain, WARMUP, Keys::Fresh).await;
    load(&client, guarded, WARMUP, Keys::Fresh).await;
    // The keys the replay rounds repeat, completed here.
    let replayed = Keys::Repeat(RUN.fetch_add(1, Ordering::Relaxed));
    load(&client, guarded, IN_FLIGHT, replayed).await;
    let effects = Effects::new(ledger);
    let (mut without, mut with, mut replays, mut alone) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        without.push(load(&client, plain, REQUESTS, Keys::Fresh).await);
        with.push(load(&client, guarded, REQUESTS, Keys::Fresh).await);
        replays.push(load(&client, guarded, REQUESTS, replayed).await);
        alone.push(ledger_alone(&effects, REQUESTS).await);
    }
    let (without, with, replays, alone) = (median(without), median(with), median(replays), median(alone));
    println!(
        "{backend:>8}: without the layer {without:>7.0} req/s | with it {with:>6.0} req/s (ratio {:.3}) | \
         replays {replays:>6.0} req/s (ratio {:.3}) | ledger alone {alone:>6.0} claims+completions/s \
         (with/alone {:.2})",
        with / without,
        replays / without,
        with / alone,
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

static RUN: AtomicUsize = AtomicUsize::new(0);

#[derive(Clone, Copy)]
enum Keys {
    /// A new key per request.
    Fresh,
    /// Worker `w` always sends key `w` of this set.
    Repeat(usize),
}

/// Sends `n` charges with `IN_FLIGHT` in flight; requests/s.
async fn load(client: &HttpClient, addr: SocketAddr, n: usize, keys: Keys) -> f64 {
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let stamp = stamp();
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..IN_FLIGHT)
        .map(|w| {
            let (client, next) = (client.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let key = match keys {
                        Keys::Fresh => format!("\"{stamp:x}-{run}-{i}\""),
                        Keys::Repeat(set) => format!("\"{stamp:x}-r{set}-{w}\""),
                    };
                    let request = http::Request::post(format!("http://{addr}/charges"))
                        .header("authorization", "Bearer bench")
                        .header("content-type", "application/json")
                        .header("idempotency-key", key)
                        .body(Full::new(Bytes::from_static(
                            br#"{"amount":1250,"currency":"EUR"}"#,
                        )))
                        .unwrap();
                    let response = client.request(request).await.unwrap();
                    assert_eq!(response.status(), 201);
                    response.into_body().collect().await.unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// One stamp per process, so that the replay keys are the same in every round.
fn stamp() -> u128 {
    static STAMP: std::sync::OnceLock<u128> = std::sync::OnceLock::new();
    *STAMP.get_or_init(|| SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos())
}

/// `Effects::run` of `n` fresh keys, `IN_FLIGHT` at a time, storing a
/// charge-sized value; runs/s.
async fn ledger_alone<L: Ledger + Clone + 'static>(effects: &Effects<L>, n: usize) -> f64 {
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let tenant = Tenant::global();
    let opts = ClaimOptions::default()
        .lease(std::time::Duration::from_secs(60))
        .retention(std::time::Duration::from_secs(24 * 3600))
        .on_in_progress(oncely::OnInProgress::Reject)
        .fingerprint(Fingerprint::of_bytes(b"bench"));
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..IN_FLIGHT)
        .map(|_| {
            let (effects, next, tenant, opts) = (effects.clone(), next.clone(), tenant.clone(), opts.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let key =
                        EffectKey::for_client(&tenant, "bench", "alone", &format!("{:x}-{run}-{i}", stamp()))
                            .unwrap();
                    let value: String = effects
                        .run(&key, &opts, |_| async {
                            Ok(r#"{"id":"ch_1","amount":1250,"currency":"EUR"}"#.to_owned())
                        })
                        .await
                        .unwrap();
                    assert!(!value.is_empty());
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    n as f64 / start.elapsed().as_secs_f64()
}

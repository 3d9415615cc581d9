//! Requests/s of `POST /charges` with and without the `Idempotency-Key`
//! layer, on SQLite and on PostgreSQL, in one run: the report is the ratio.
//!
//! The load comes from a Rust HTTP/1.1 client in this process, over
//! loopback, with a fixed number of requests in flight; every request with
//! the layer carries a new key (the full path: claim, run, store). Rounds
//! alternate without/with so that both see the same machine; the median of
//! each is reported.
//!
//! `cargo bench -p http-charges --bench throughput` (PostgreSQL from
//! `ONCELY_POSTGRES_URL`, by default the loopback server; skipped when it is
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
use oncely::Ledger;
use oncely::conformance::{service_url, skip_or_fail};
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
    let guarded = serve(idempotent_api(ledger, Charges::default())).await;
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(IN_FLIGHT)
        .build_http();
    load(&client, plain, WARMUP).await;
    load(&client, guarded, WARMUP).await;
    let (mut without, mut with) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        without.push(load(&client, plain, REQUESTS).await);
        with.push(load(&client, guarded, REQUESTS).await);
    }
    let (without, with) = (median(without), median(with));
    println!(
        "{backend:>8}: without the layer {without:>8.0} req/s, with it {with:>8.0} req/s, \
         ratio with/without {:.3} ({REQUESTS} requests x {ROUNDS} rounds, {IN_FLIGHT} in flight)",
        with / without
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

static RUN: AtomicUsize = AtomicUsize::new(0);

/// Sends `n` charges with `IN_FLIGHT` in flight; requests/s.
async fn load(client: &HttpClient, addr: SocketAddr, n: usize) -> f64 {
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let stamp = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..IN_FLIGHT)
        .map(|_| {
            let (client, next) = (client.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let request = http::Request::post(format!("http://{addr}/charges"))
                        .header("authorization", "Bearer bench")
                        .header("content-type", "application/json")
                        .header("idempotency-key", format!("\"{stamp:x}-{run}-{i}\""))
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

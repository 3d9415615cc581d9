//! The example over real HTTP on loopback: a retried charge is replayed,
//! not made twice; on SQLite and on PostgreSQL.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use http_charges::{Charges, idempotent_api};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use oncely::backend::Ledger;
use oncely::conformance::{service_url, skip_or_fail};

async fn serve<L: Ledger + Clone + 'static>(ledger: L) -> (SocketAddr, Charges) {
    let charges = Charges::default();
    let app = idempotent_api(ledger, charges.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, charges)
}

async fn retried_charge_is_replayed(addr: SocketAddr, charges: &Charges, user: &str) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let key = format!("\"{user}-{}\"", std::process::id());
    let mut answers = Vec::new();
    for _ in 0..2 {
        let request = http::Request::post(format!("http://{addr}/charges"))
            .header("authorization", format!("Bearer {user}"))
            .header("content-type", "application/json")
            .header("idempotency-key", &key)
            .body(Full::new(Bytes::from_static(
                br#"{"amount":1250,"currency":"EUR"}"#,
            )))
            .unwrap();
        let response = client.request(request).await.unwrap();
        let (parts, body) = response.into_parts();
        answers.push((parts, body.collect().await.unwrap().to_bytes()));
    }
    let (first, again) = (&answers[0], &answers[1]);
    assert_eq!(first.0.status, 201);
    assert_eq!(again.0.status, 201);
    assert_eq!(
        first.1, again.1,
        "the retry gets the first charge back, byte for byte"
    );
    assert!(first.0.headers.get("idempotent-replayed").is_none());
    assert_eq!(again.0.headers["idempotent-replayed"], "true");
    assert_eq!(charges.made(), 1, "charged once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_retry_is_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("charges.db").display());
    let ledger = Arc::new(oncely_sqlite::SqliteLedger::connect(&url).await.unwrap());
    let (addr, charges) = serve(ledger).await;
    retried_charge_is_replayed(addr, &charges, "alice").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_retry_is_replayed() {
    let Some(url) = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    ) else {
        return;
    };
    let ledger = match oncely_postgres::PgLedger::connect(&url).await {
        Ok(l) => Arc::new(l),
        Err(e) => return skip_or_fail(&format!("PostgreSQL at {url}: {e}")).unwrap_or(()),
    };
    let (addr, charges) = serve(ledger).await;
    // A user of its own per run: the tenant is global in the example.
    let user = format!(
        "u{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    retried_charge_is_replayed(addr, &charges, &user).await;
}

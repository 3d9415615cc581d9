//! `http-charges [LEDGER_URL] [--listen ADDR]`: serves the charges API
//! behind the `Idempotency-Key` layer. The ledger is SQLite
//! (`sqlite:http-charges.db`) unless a URL says otherwise
//! (`postgres://postgres@127.0.0.1:5432/test`).

use std::sync::Arc;

use anyhow::{Context, bail};
use http_charges::{Charges, idempotent_api};
use oncely::open::{Access, FromUrl, OpenOptions};
use oncely_postgres::PgLedger;
use oncely_sqlite::SqliteLedger;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut url = "sqlite:http-charges.db".to_owned();
    let mut listen = "127.0.0.1:3000".to_owned();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" => listen = args.next().context("--listen needs an address")?,
            "-h" | "--help" => {
                println!("usage: http-charges [LEDGER_URL] [--listen ADDR]");
                return Ok(());
            }
            other => url = other.to_owned(),
        }
    }
    let charges = Charges::default();
    let open = OpenOptions::new(Access::Migrate);
    let app = match url.split_once(':').map(|(scheme, _)| scheme) {
        Some("sqlite") => idempotent_api(Arc::new(SqliteLedger::from_url(&url, open).await?), charges),
        Some("postgres" | "postgresql") => {
            idempotent_api(Arc::new(PgLedger::from_url(&url, open).await?), charges)
        }
        _ => bail!("expected a sqlite: or postgres:// URL"),
    };
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .with_context(|| format!("listening on {listen}"))?;
    eprintln!(
        "http-charges on http://{listen} (ledger: {})",
        url.split('@').next_back().unwrap_or("")
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

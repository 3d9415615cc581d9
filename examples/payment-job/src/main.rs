//! Runs the payment job under crashes and duplicate deliveries, then checks
//! that every order was captured once, paid once and sent one receipt (or is
//! listed as an abandoned receipt), and that one more redelivery changes
//! nothing.
//!
//! ```text
//! payment-job [DATABASE_URL]    # default: a SQLite file in a temp directory
//! ```
//! `DATABASE_URL` may be `sqlite:path` or `postgres://…`. `ONCELY_SEED`
//! replays a run.

use std::time::{SystemTime, UNIX_EPOCH};

use payment_job::{SimConfig, run_demo};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let seed = std::env::var("ONCELY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos() as u64
        });
    let dir = std::env::temp_dir().join(format!("payment-job-{}-{seed}", std::process::id()));
    let url = match std::env::args().nth(1) {
        Some(url) => url,
        None => {
            std::fs::create_dir_all(&dir)?;
            format!("sqlite:{}", dir.join("payments.db").display())
        }
    };
    println!("payment-job on {url} (ONCELY_SEED={seed})");
    let cfg = SimConfig {
        orders: 40,
        deliveries: 4,
        workers: 4,
        crash_percent: 25,
        crash_attempts: 3,
        seed,
        prefix: format!("run{seed}-"),
    };
    let bad = run_demo(&url, &cfg).await;
    let _ = std::fs::remove_dir_all(&dir);
    let bad = bad?;
    if bad.is_empty() {
        println!("all invariants hold");
        Ok(())
    } else {
        for b in &bad {
            eprintln!("VIOLATION: {b}");
        }
        anyhow::bail!("{} invariant violations (ONCELY_SEED={seed})", bad.len())
    }
}

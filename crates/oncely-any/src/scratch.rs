//! What the demo and the bench set up for a run of their own: a temporary
//! directory and a SQLite ledger in it, a run id that names their tables
//! and tenants, and the error of a table of their own on the ledger's pool.

use std::time::SystemTime;

use oncely::{Error, Result};

use crate::AnyLedger;

/// A fresh temporary directory whose name starts with `prefix`, removed
/// when dropped.
pub fn scratch_dir(prefix: &str) -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .map_err(|e| Error::Config(format!("cannot create a temporary directory: {e}")))
}

/// Opens the ledger of a scratch SQLite file (in a [`scratch_dir`]). The
/// file goes with the run, so a temporary directory on a memory file
/// system (a tmpfs `/tmp`), which a ledger refuses by default, is accepted:
/// `ephemeral(true)` accepts a file there and nowhere else, so the second
/// attempt succeeds exactly when that was the refusal.
pub async fn scratch_ledger(url: &str) -> Result<AnyLedger> {
    let refused = match AnyLedger::connect(url).await {
        Err(e @ Error::Config(_)) => e,
        other => return other,
    };
    #[cfg(feature = "sqlite")]
    {
        let ephemeral = oncely_sqlite::SqliteLedgerOptions::default().ephemeral(true);
        if let Ok(l) = oncely_sqlite::SqliteLedger::connect_with(url, ephemeral).await {
            return Ok(AnyLedger::Sqlite(l));
        }
    }
    Err(refused)
}

/// The URL of a SQLite file, created if missing.
pub fn sqlite_url(path: &std::path::Path) -> String {
    format!("sqlite://{}?mode=rwc", path.display())
}

/// 12 hex digits from the clock and the process id: unique enough that two
/// demos (or benches) on one database never share a table or a tenant.
pub fn run_id() -> String {
    let mut rng = fastrand::Rng::with_seed(clock_seed() ^ (u64::from(std::process::id()) << 32));
    format!("{:012x}", rng.u64(..) & 0xffff_ffff_ffff)
}

/// The wall clock in nanoseconds since the Unix epoch (truncated to 64
/// bits): a seed that differs from run to run.
pub fn clock_seed() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64
}

/// Maps a driver error on a table of the demo's or the bench's own, saying
/// `what` it was about; busy and locked databases, deadlocks, pool timeouts
/// and I/O errors are worth a retry.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub fn sql_error(backend: &'static str, what: &str, e: sqlx::Error) -> Error {
    let retryable = match &e {
        sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) => true,
        sqlx::Error::Database(d) => {
            let code = d.code().unwrap_or_default();
            // SQLite BUSY (5) / LOCKED (6) and their extended codes;
            // PostgreSQL serialization failure and deadlock; MySQL's
            // deadlock (SQLSTATE 40001 too).
            matches!(code.as_ref(), "5" | "6" | "40001" | "40P01")
                || code
                    .parse::<u32>()
                    .is_ok_and(|c| backend == "sqlite" && matches!(c & 0xff, 5 | 6))
        }
        _ => false,
    };
    Error::Backend {
        backend,
        message: format!("{what}: {e}"),
        retryable,
    }
}

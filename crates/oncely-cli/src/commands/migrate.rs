//! `oncely migrate`: the ledger's schema created or upgraded, and the
//! backend's guarantees printed.

use std::process::ExitCode;

use clap::Args as ClapArgs;
use oncely::Result;
use oncely::backend::Ledger;
use oncely_any::Access;
use serde::Serialize;

use super::DbArgs;
use crate::read::{Read, with_ledger};

/// Create or upgrade the ledger's schema, then print the backend's
/// guarantees.
///
/// SQL backends create or upgrade their tables and then check them (a
/// table someone else created without a unique key on the effect key,
/// or with a case-insensitive key, is refused); NATS creates its KV
/// bucket (or checks an existing one's settings); Redis checks the
/// server's eviction policy and needs no schema. With `demo`, the only
/// command that creates anything.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    db: DbArgs,
}

/// Migrates and prints what the backend guarantees.
pub async fn run(args: Args) -> Result<ExitCode> {
    let Read {
        ledger,
        value: report,
    } = migrate(&args.db.database_url).await?;
    println!("{} ledger schema is up to date", report.backend);
    println!("  ledger:               {ledger}");
    println!(
        "  caller's transaction: {}",
        if report.caller_transaction { "yes" } else { "no" }
    );
    println!("  durability:           {}", report.durability);
    println!("  clock:                {}", report.clock);
    Ok(ExitCode::SUCCESS)
}

/// What `migrate` found: the backend, now with its schema in place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MigrateReport {
    /// The backend's name.
    pub backend: &'static str,
    /// Whether claims can join the caller's transaction on this backend.
    pub caller_transaction: bool,
    /// What a completed record survives.
    pub durability: &'static str,
    /// Whose clock decides expiry.
    pub clock: &'static str,
}

/// Creates or upgrades the ledger's schema (or NATS bucket), checks it, and
/// reports the backend's capabilities. The only command (with `demo`) that
/// creates anything.
pub async fn migrate(database_url: &str) -> Result<Read<MigrateReport>> {
    with_ledger(database_url, Access::Migrate, |l| async move {
        let caps = l.capabilities();
        Ok(MigrateReport {
            backend: l.backend(),
            caller_transaction: caps.caller_transaction,
            durability: caps.durability,
            clock: caps.clock,
        })
    })
    .await
}

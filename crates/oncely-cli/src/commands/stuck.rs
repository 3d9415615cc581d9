//! `oncely stuck`: the stuck leases, oldest first.

use std::process::ExitCode;

use clap::Args as ClapArgs;
use oncely::Result;
use oncely::admin::Filter;

use super::{DbArgs, Render, ScopeArgs, or_dash, padded, plain_table};
use crate::read::{Listing, list_records};
use crate::view::Inspection;

/// List stuck leases: in progress, lease ended, not at-most-once.
///
/// A worker died or stalled and nobody has claimed the key since; the
/// next delivery takes it over (with fence + 1). Resolve one by hand
/// with `resolve`. Oldest first. Read-only; SQL backends only.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    scope: ScopeArgs,
    /// Only this kind.
    #[arg(long)]
    kind: Option<String>,
    /// Only records first claimed at or after this RFC 3339 time
    /// (2026-11-30T08:00:00Z) or date (2026-11-30).
    #[arg(long)]
    since: Option<String>,
    /// At most this many records (up to 1000).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    limit: u32,
    /// Print a JSON array instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DbArgs,
}

/// Prints the stuck leases, and says so when the limit may have cut them.
pub async fn run(args: Args) -> Result<ExitCode> {
    let listing = Listing {
        tenant: args.scope.tenant()?,
        kind: args.kind,
        since: args.since,
        limit: args.limit,
    };
    let list = list_records(&args.db.database_url, Filter::Stuck, &listing)
        .await?
        .map(|records| records.iter().map(Inspection::from).collect::<Vec<_>>());
    if args.json && list.value.is_empty() {
        eprintln!("no stuck records in {}", list.ledger);
    }
    let code = list.render(args.json);
    if !args.json && list.value.len() == args.limit as usize {
        eprintln!(
            "showing the oldest {}; there may be more (narrow with --kind or --since, or raise \
             --limit up to 1000)",
            args.limit
        );
    }
    Ok(code)
}

/// The records as a table, or "no stuck records".
impl Render for Vec<Inspection> {
    fn print(&self, ledger: &str) {
        if self.is_empty() {
            println!("no stuck records in {ledger}");
            return;
        }
        println!("ledger: {ledger}");
        let mut t = plain_table();
        t.set_header(["key", "state", "fence", "granted", "created", "lease ended"]);
        for i in self {
            t.add_row([
                i.record.key.clone(),
                i.class.to_owned(),
                i.record.fence.to_string(),
                i.claims.grants.to_owned(),
                i.record.created_at.clone(),
                or_dash(i.record.lease_expires_at.as_deref()),
            ]);
        }
        println!("{}", padded(t));
    }
}

//! `oncely abandoned`: the abandoned at-most-once steps, as a table (or
//! JSON), like the other listings.

use std::process::ExitCode;

use clap::Args as ClapArgs;
use oncely::admin::Filter;
use oncely::backend::{Ledger, Record};
use oncely::{Result, Tenant};
use oncely_any::Access;

use serde::Serialize;

use super::{DbArgs, Render, ScopeArgs, or_dash, padded, plain_table, print_json};
use crate::read::{Listing, Read, list_records, with_ledger};
use crate::view::{Inspection, RecordView};

/// List abandoned at-most-once steps: a table, or a JSON array with --json.
///
/// An at-most-once step (an email, a push) whose worker died between
/// marking it attempted and completing it is never re-run
/// automatically: it may or may not have happened, and someone has to
/// check (then `resolve` it). This lists them, oldest first. One tenant
/// works on every backend; --all-tenants, --kind and --since need a SQL
/// backend. Read-only, like `get`.
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
    /// At most this many records.
    #[arg(long, default_value_t = 100)]
    limit: u64,
    /// Print a JSON array instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DbArgs,
}

/// Prints the abandoned steps as a table, or as a JSON array (empty: says
/// so on stderr).
pub async fn run(args: Args) -> Result<ExitCode> {
    let tenant = args.scope.tenant()?;
    let records = abandoned_in(
        &args.db.database_url,
        tenant.as_ref(),
        args.kind.as_deref(),
        args.since.as_deref(),
        args.limit,
    )
    .await?;
    if !args.json {
        let limited = records.value.len() as u64 == args.limit;
        let code = records
            .map(|r| Abandoned(r.iter().map(Inspection::from).collect()))
            .render(false);
        if limited {
            eprintln!(
                "showing the oldest {}; there may be more (narrow with --kind or --since, or \
                 raise --limit)",
                args.limit
            );
        }
        return Ok(code);
    }
    if records.value.is_empty() {
        eprintln!("no abandoned records in {}", records.ledger);
    }
    Ok(print_json(
        &records.map(|r| r.iter().map(RecordView::from).collect::<Vec<_>>()),
    ))
}

/// The abandoned steps as `abandoned` prints them for people.
#[derive(Debug, Serialize)]
#[serde(transparent)]
struct Abandoned(Vec<Inspection>);

/// The steps as a table, or "no abandoned records".
impl Render for Abandoned {
    fn print(&self, ledger: &str) {
        if self.0.is_empty() {
            println!("no abandoned records in {ledger}");
            return;
        }
        println!("ledger: {ledger}");
        let mut t = plain_table();
        t.set_header(["key", "state", "fence", "created", "lease ended", "provider key"]);
        for i in &self.0 {
            t.add_row([
                i.record.key.clone(),
                i.class.to_owned(),
                i.record.fence.to_string(),
                i.record.created_at.clone(),
                or_dash(i.record.lease_expires_at.as_deref()),
                i.record.provider_key.clone(),
            ]);
        }
        println!("{}", padded(t));
        println!(
            "each may have happened once or not at all: check, then `oncely resolve KEY \
             --completed JSON` or `--released`"
        );
    }
}

/// Lists up to `limit` abandoned at-most-once steps of `tenant`, oldest first.
pub async fn abandoned(database_url: &str, tenant: &str, limit: u64) -> Result<Read<Vec<Record>>> {
    let tenant = Tenant::parse(tenant)?;
    with_ledger(database_url, Access::ReadOnly, |l| async move {
        l.abandoned(&tenant, limit).await
    })
    .await
}

/// Lists abandoned at-most-once steps of one tenant or of every tenant
/// (`None`), optionally of one kind and since a time, oldest first. One
/// tenant alone is [`Ledger::abandoned`], which every backend answers; the rest
/// needs [`oncely::admin::Admin`] (the SQL backends).
pub async fn abandoned_in(
    database_url: &str,
    tenant: Option<&Tenant>,
    kind: Option<&str>,
    since: Option<&str>,
    limit: u64,
) -> Result<Read<Vec<Record>>> {
    match (tenant, kind, since) {
        (Some(t), None, None) => abandoned(database_url, t.as_str(), limit).await,
        _ => {
            let listing = Listing {
                tenant: tenant.cloned(),
                kind: kind.map(str::to_owned),
                since: since.map(str::to_owned),
                limit: u32::try_from(limit).unwrap_or(u32::MAX),
            };
            list_records(database_url, Filter::Abandoned, &listing).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oncely::Error;

    #[tokio::test]
    async fn a_bad_tenant_is_refused_before_connecting() {
        let url = "postgres://nobody@127.0.0.1:1/none";
        let err = abandoned(url, "bad/tenant", 10).await.unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{err:?}");
    }
}

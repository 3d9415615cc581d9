//! `oncely prune`: completed and released records past their retention
//! deleted, or counted with `--dry-run`.

use std::process::ExitCode;

use clap::Args as ClapArgs;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use oncely::{Error, Result};
use oncely_any::{Access, Scheme};

use super::{DbArgs, plural, print_json};
use crate::read::{Read, with_ledger};

/// Delete completed and released records past their retention.
///
/// Never deletes a live lease or an unresolved abandoned step. Run it
/// periodically; each call deletes at most --limit records and prints
/// how many it deleted. It raises the ledger's horizon (per tenant and
/// kind) to what it deleted, so a replay of a pruned effect is refused
/// rather than run again. Uses the existing ledger; creates nothing.
/// With --dry-run, counts what would go now and deletes nothing
/// (read-only; SQL backends only).
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Delete at most this many records in this call.
    #[arg(long, default_value_t = 10_000)]
    limit: u64,
    /// Records per batch: each batch is one short transaction, so claims
    /// keep their latency while a large backlog goes.
    #[arg(long, default_value_t = 500)]
    batch: u64,
    /// Delete at most this many records per second (default: no limit).
    #[arg(long, value_name = "ROWS_PER_SEC")]
    rate: Option<u64>,
    /// Count the records past retention; delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print one JSON object ({"pruned": N} or {"would_prune": N}).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DbArgs,
}

/// Prunes (or counts, with `--dry-run`) and prints how many.
pub async fn run(args: Args) -> Result<ExitCode> {
    if args.dry_run {
        let read = prune_dry_run(&args.db.database_url).await?;
        if args.json {
            return Ok(print_json(
                &read.map(|n| serde_json::json!({ "would_prune": n, "dry_run": true })),
            ));
        }
        let n = read.value;
        println!(
            "would prune {n} record{} in {} (dry run: nothing deleted)",
            plural(n),
            read.ledger
        );
        return Ok(ExitCode::SUCCESS);
    }
    let plan = PrunePlan {
        limit: args.limit,
        batch: args.batch,
        rows_per_second: args.rate,
    };
    // A count on stderr while a backlog goes (hidden when stderr is not a
    // terminal, and with --json).
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::with_draw_target(Some(args.limit), ProgressDrawTarget::stderr())
    };
    bar.set_style(
        ProgressStyle::with_template("pruning {pos}/{len} records ({per_sec}, {elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let pruned = prune(&args.db.database_url, plan, |rows| bar.inc(rows)).await;
    bar.finish_and_clear();
    let read = pruned?;
    if args.json {
        return Ok(print_json(&read.map(|n| serde_json::json!({ "pruned": n }))));
    }
    let n = read.value;
    println!("pruned {n} record{} from {}", plural(n), read.ledger);
    Ok(ExitCode::SUCCESS)
}

/// How many records `prune` would delete now, deleting nothing (a dry run,
/// read-only). Needs [`oncely::admin::Admin`] (the SQL backends).
pub async fn prune_dry_run(database_url: &str) -> Result<Read<u64>> {
    let scheme = Scheme::of_url(database_url)?;
    if !scheme.has_admin() {
        return Err(Error::Config(format!(
            "prune --dry-run is not available on the {} backend: it keeps no index to count \
             records past retention (only SQLite, PostgreSQL and MySQL ledgers offer it)",
            scheme.name()
        )));
    }
    with_ledger(database_url, Access::ReadOnly, |l| async move {
        oncely::admin::Admin::prunable(&l).await
    })
    .await
}

/// How `prune` deletes: at most `limit` records, in batches of `batch`, at
/// most `rows_per_second` (none: as fast as the database goes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrunePlan {
    /// Records to delete at most in this call.
    pub limit: u64,
    /// Records per batch (one transaction each).
    pub batch: u64,
    /// The rate limit, if any.
    pub rows_per_second: Option<u64>,
}

/// Deletes up to `plan.limit` completed or released records past their
/// retention (never a live lease, never an abandoned step) through
/// [`oncely::pruner::Pruner::drain`], in bounded batches at the plan's rate, calling
/// `on_batch` with each batch's count; returns how many went. A failed batch
/// ends the call with its error; the batches before it stay deleted.
pub async fn prune(
    database_url: &str,
    plan: PrunePlan,
    on_batch: impl FnMut(u64) + Send,
) -> Result<Read<u64>> {
    if plan.batch == 0 || plan.rows_per_second == Some(0) {
        return Err(Error::InvalidInput(
            "prune: --batch and --rate must be at least 1".to_owned(),
        ));
    }
    with_ledger(database_url, Access::Existing, |l| async move {
        let options = oncely::pruner::PrunerOptions::default().batch(plan.batch);
        let options = match plan.rows_per_second {
            Some(rate) => options.rows_per_second(rate),
            None => options.unlimited(),
        };
        let stats = oncely::pruner::Pruner::new(l, options)
            .drain(plan.limit, on_batch)
            .await?;
        Ok(stats.rows)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_unknown_scheme_is_refused_before_connecting() {
        let plan = PrunePlan {
            limit: 10,
            batch: 10,
            rows_per_second: None,
        };
        let err = prune("nope://x", plan, |_| {}).await.unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err:?}");
    }
}

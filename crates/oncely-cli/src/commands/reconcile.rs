//! `oncely reconcile`'s command line and report; the run itself, and the
//! check command's protocol, are [`crate::reconcile`].

use std::process::ExitCode;
use std::time::Duration;

use clap::Args as ClapArgs;
use oncely::Result;

use super::{DbArgs, Render, ScopeArgs, duration_arg, padded, plain_table, plural};
use crate::audit::after_release;
use crate::reconcile::{ReconcileConfig, ReconcileReport, reconcile};

/// Settle stuck leases and abandoned at-most-once steps by asking a
/// command of yours about each (like a git hook).
///
/// Lists the tenant's doubtful records (--all-tenants: every
/// tenant's): stuck leases first, then abandoned steps, oldest first.
/// For each, runs CHECK through `sh -c` and applies its answer with
/// fenced writes: a stuck lease is taken over by a claim (fence + 1),
/// then completed or released; an abandoned step is completed or
/// released at its fence. A record that moved on meanwhile is left
/// alone (counted as moved).
///
/// The protocol. The record reaches CHECK only as data, never on its
/// command line: on stdin, one JSON object and a newline, with key,
/// tenant, kind, subject, doubt ("stuck" or "abandoned"), fence, state,
/// at_most_once, created_at, lease_expires_at (RFC 3339 UTC) and
/// provider_key (the idempotency key the step sent the provider); in
/// the environment, ONCELY_KEY, ONCELY_DOUBT and ONCELY_PROVIDER_KEY.
/// CHECK prints exactly one line on stdout:
///
///   done <JSON>   the effect happened: complete the record with this
///                 value, stored as a runner stores a handler's value
///                 ({"ok": JSON}), so duplicates replay it (done null
///                 for a step that returns nothing);
///
///   not-done      it certainly did not happen: release the record, the
///                 next delivery of its message runs the step (an oncely
///                 consumer holds an abandoned step's delivery until
///                 then, and dead-letters it with the reason abandoned
///                 after its last allowed delivery: replay it from
///                 there); the released keys are listed at the end;
///
///   unknown       the provider cannot tell: write nothing, the record
///                 stays listed.
///
/// Any other output, a non-zero exit, or no answer within
/// --check-timeout (CHECK is then killed) is an error for that record:
/// nothing is written for it and the run goes on. Log to stderr; its
/// end is quoted in the error. With --dry-run, CHECK is still asked
/// (it should only read from the provider) but nothing is written.
///
/// Prints each examined record (key, doubt, fence, verdict, result)
/// and the totals, or one JSON object with --json. Exits 1 if any
/// record failed or the listing failed; 2 on bad input, and on Redis
/// and NATS (they cannot list records: settle known keys with
/// `resolve`). SQL backends only.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    scope: ScopeArgs,
    /// The command to ask about each record, run through `sh -c` (see the
    /// protocol above), e.g. './check-provider.sh'.
    #[arg(long, value_name = "CMD")]
    check: String,
    /// How long CHECK may take for one record before it is killed, with
    /// everything it started (its process group): 500ms, 30s, 5m.
    #[arg(long, default_value = "30s", value_parser = duration_arg)]
    check_timeout: Duration,
    /// Ask, but write nothing: the report says what would be done.
    #[arg(long)]
    dry_run: bool,
    /// Leave alone records whose lease ended less than this long ago, on
    /// the database's clock (a stalled worker may still call the provider):
    /// 30s, 5m, 2h, 1d.
    #[arg(long, default_value = "0s", value_parser = duration_arg)]
    grace: Duration,
    /// Records listed per page.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    batch: u32,
    /// Stop after examining this many records.
    #[arg(long)]
    max: Option<u64>,
    /// At most this many records per second (the provider's rate limit).
    #[arg(long, value_name = "PER_SEC")]
    rate: Option<f64>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DbArgs,
}

/// Reconciles, prints the report, and exits 1 if a record could not be
/// settled or the run stopped early.
pub async fn run(args: Args) -> Result<ExitCode> {
    let tenant = args.scope.tenant()?;
    let config = ReconcileConfig {
        check_timeout: args.check_timeout,
        dry_run: args.dry_run,
        grace: args.grace,
        batch: args.batch as usize,
        max: args.max,
        rate: args.rate,
        ..ReconcileConfig::new(tenant, args.check)
    };
    // The check runs in a process group of its own, out of the terminal's
    // reach: on Ctrl-C the run's future is dropped, which kills that group.
    let report = tokio::select! {
        r = reconcile(&args.db.database_url, &config) => r?,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("interrupted");
            return Ok(ExitCode::from(130));
        }
    };
    let code = report.render(args.json);
    if code != ExitCode::SUCCESS {
        return Ok(code);
    }
    let report = &report.value;
    if let Some(why) = &report.run.aborted {
        eprintln!("error: the run stopped early: {why}");
    }
    if report.run.errors > 0 {
        eprintln!(
            "error: {} record{} could not be settled (left as they were)",
            report.run.errors,
            plural(report.run.errors)
        );
    }
    Ok(if report.failed() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// Each examined record, the totals, and what to do about released ones.
impl Render for ReconcileReport {
    fn print(&self, ledger: &str) {
        let r = self;
        if r.entries.is_empty() {
            println!("no doubtful records in {}", ledger);
        } else {
            println!("ledger: {}", ledger);
            let mut t = plain_table();
            t.set_header(["key", "doubt", "fence", "verdict", "result", "detail"]);
            for e in &r.entries {
                let detail = match (&e.error, &e.outcome) {
                    (Some(err), _) => err.clone(),
                    (None, Some(v)) => v.to_string(),
                    (None, None) => "-".to_owned(),
                };
                t.add_row([
                    e.key.clone(),
                    e.doubt.unwrap_or("-").to_owned(),
                    e.fence.to_string(),
                    e.verdict.unwrap_or("-").to_owned(),
                    e.result.to_owned(),
                    detail,
                ]);
            }
            println!("{}", padded(t));
        }
        println!(
            "examined {}: completed {}, released {}, unknown {}, moved {}, skipped {}, errors {}{}",
            r.run.examined,
            r.run.completed,
            r.run.released,
            r.run.unknown,
            r.run.moved,
            r.run.skipped,
            r.run.errors,
            if r.run.dry_run {
                " (dry run: nothing written)"
            } else {
                ""
            }
        );
        // Released records need a delivery to be performed: say so once per
        // kind of doubt, with the keys.
        for doubt in ["stuck", "abandoned"] {
            let released: Vec<&str> = r
                .entries
                .iter()
                .filter(|e| e.doubt == Some(doubt) && e.next.is_some())
                .map(|e| e.key.as_str())
                .collect();
            if let Some(next) = after_release(doubt).filter(|_| !released.is_empty()) {
                println!("released {doubt} ({}): {next}", released.join(", "));
            }
        }
    }
}

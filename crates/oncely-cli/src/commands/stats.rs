//! `oncely stats`: records per tenant and kind.

use std::process::ExitCode;

use clap::Args as ClapArgs;
use oncely::admin::{Admin, KindStats};
use oncely::{Result, Tenant};
use oncely_any::Access;
use serde::Serialize;

use super::{DbArgs, Render, ScopeArgs, or_dash, padded, plain_table};
use crate::read::{Read, with_admin};
use crate::time::rfc3339;

/// Why duplicates are not among the counts, and where to find them: printed
/// under every count of records (`stats`, the web page).
pub const DUPLICATES_NOT_STORED: &str = "duplicates suppressed are not stored (a duplicate of a completed \
     effect is a read, not a write); count them with the oncely_duplicates_suppressed_total metric";

/// Count records per tenant and kind: live, stuck, abandoned,
/// completed, released, and the oldest open ones.
///
/// Judged on the backend's clock. Duplicates suppressed are not
/// stored (a duplicate of a completed effect is a read, not a write):
/// count them with the oncely_duplicates_suppressed_total metric.
/// Read-only; SQL backends only.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    scope: ScopeArgs,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DbArgs,
}

/// Prints the counts.
pub async fn run(args: Args) -> Result<ExitCode> {
    let tenant = args.scope.tenant()?;
    Ok(stats(&args.db.database_url, tenant.as_ref())
        .await?
        .render(args.json))
}

/// The stats of `stats`, as printed: counts per tenant and kind, and the
/// note that duplicates are not among them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StatsReport {
    /// One entry per tenant and kind.
    pub kinds: Vec<KindStatsView>,
    /// [`DUPLICATES_NOT_STORED`].
    pub note: &'static str,
}

/// One tenant and kind's counts, timestamps in RFC 3339.
///
/// A mirror of [`KindStats`] rather than `Serialize` on it: the JSON has
/// RFC 3339 times, which the core does not format, and the `total`, which
/// it computes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KindStatsView {
    /// The tenant.
    pub tenant: String,
    /// The kind.
    pub kind: String,
    /// In progress, lease live.
    pub live: u64,
    /// In progress, lease ended, not at-most-once.
    pub stuck: u64,
    /// At-most-once, lease ended.
    pub abandoned: u64,
    /// Completed.
    pub completed: u64,
    /// Released (forgotten ones included).
    pub released: u64,
    /// Every record counted.
    pub total: u64,
    /// Oldest `created_at` of the live ones.
    pub oldest_live: Option<String>,
    /// Oldest `created_at` of the stuck ones.
    pub oldest_stuck: Option<String>,
    /// Oldest `created_at` of the abandoned ones.
    pub oldest_abandoned: Option<String>,
    /// The backend's clock when counted.
    pub read_at: String,
}

impl From<&KindStats> for KindStatsView {
    fn from(s: &KindStats) -> Self {
        KindStatsView {
            tenant: s.tenant.to_string(),
            kind: s.kind.clone(),
            live: s.live,
            stuck: s.stuck,
            abandoned: s.abandoned,
            completed: s.completed,
            released: s.released,
            total: s.total(),
            oldest_live: s.oldest_live.map(rfc3339),
            oldest_stuck: s.oldest_stuck.map(rfc3339),
            oldest_abandoned: s.oldest_abandoned.map(rfc3339),
            read_at: rfc3339(s.read_at),
        }
    }
}

/// Counts records per tenant and kind (`None`: every tenant). Read-only.
pub async fn stats(database_url: &str, tenant: Option<&Tenant>) -> Result<Read<StatsReport>> {
    let read = with_admin(database_url, Access::ReadOnly, |l| async move {
        l.stats(tenant).await
    })
    .await?;
    Ok(read.map(|kinds| StatsReport {
        kinds: kinds.iter().map(KindStatsView::from).collect(),
        note: DUPLICATES_NOT_STORED,
    }))
}

/// Counts per tenant and kind as a table, and the note.
impl Render for StatsReport {
    fn print(&self, ledger: &str) {
        let r = self;
        if r.kinds.is_empty() {
            println!("no records in {}", ledger);
        } else {
            println!("ledger: {}", ledger);
            let mut t = plain_table();
            t.set_header([
                "tenant",
                "kind",
                "live",
                "stuck",
                "abandoned",
                "completed",
                "released",
                "oldest live",
                "oldest stuck",
                "oldest abandoned",
            ]);
            for k in &r.kinds {
                t.add_row([
                    k.tenant.clone(),
                    k.kind.clone(),
                    k.live.to_string(),
                    k.stuck.to_string(),
                    k.abandoned.to_string(),
                    k.completed.to_string(),
                    k.released.to_string(),
                    or_dash(k.oldest_live.as_deref()),
                    or_dash(k.oldest_stuck.as_deref()),
                    or_dash(k.oldest_abandoned.as_deref()),
                ]);
            }
            println!("{}", padded(t));
        }
        println!("note: {}", r.note);
    }
}

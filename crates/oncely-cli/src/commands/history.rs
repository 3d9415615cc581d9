//! `oncely history`: did this run twice? Every record of a subject, the
//! operator actions recorded on them, and a verdict.

use std::process::ExitCode;

use clap::Args as ClapArgs;
use oncely::admin::RecordQuery;
use oncely::{EffectKey, Result, Tenant};
use oncely_any::Access;
use serde::Serialize;

use super::{ClientKeyArgs, DbArgs, Render, SubjectKeyArgs, padded, plain_table, plural};
use crate::audit::{self, AUDIT_KIND};
use crate::read::{Read, all_pages, with_admin};
use crate::time::parse_rfc3339;
use crate::view::Inspection;

/// Did this run twice? Every record of a subject, and a verdict.
///
/// Lists the tenant's records (of one kind, one subject, created since
/// a time: all optional), oldest first, each with what `inspect`
/// derives, the resolve and forget actions recorded on them, and a
/// one-line verdict from what is stored: "no" when each record was
/// granted once; "possibly" when a record was granted again (a
/// takeover after its lease ended: the work may have started twice).
/// Duplicates answered from a stored outcome are reads and leave no
/// record; count them with the oncely_duplicates_suppressed_total
/// metric. Read-only; SQL backends only.
///
/// An HTTP request (oncely-tower) is stored under a hash of its principal
/// and Idempotency-Key: --principal P --client-key K finds it. A subject
/// your producers hash (EffectKey::hashed) is found from the raw one with
/// --subject-key-file.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The tenant.
    #[arg(long)]
    tenant: String,
    /// Only this kind (capture).
    #[arg(long)]
    kind: Option<String>,
    /// Only this subject (order-123), in every kind unless --kind.
    #[arg(long, conflicts_with = "principal")]
    subject: Option<String>,
    #[command(flatten)]
    client: ClientKeyArgs,
    #[command(flatten)]
    subject_key: SubjectKeyArgs,
    /// Only records first claimed at or after this RFC 3339 time
    /// (2026-11-30T08:00:00Z) or date (2026-11-30).
    #[arg(long)]
    since: Option<String>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DbArgs,
}

/// Prints the history.
pub async fn run(args: Args) -> Result<ExitCode> {
    Ok(history(&args).await?.render(args.json))
}

/// An audit record as `history` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditView {
    /// The audit record's key.
    pub audit_key: String,
    /// What the audit outcome says (`action`, `key`, `fence`, …).
    pub entry: serde_json::Value,
}

/// What `history` found for a subject: every record, the operator actions
/// recorded on them, and a one-line verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct History {
    /// The records, oldest first.
    pub records: Vec<Inspection>,
    /// The `resolve` and `forget` actions recorded on these records.
    pub audits: Vec<AuditView>,
    /// Whether the ledger's records show any effect granted more than once.
    pub claimed_more_than_once: bool,
    /// The records not finished: in progress (`live`) or with a lease that
    /// ended without a completion (`stuck`). Their effects may not have
    /// happened yet, or may be happening.
    pub unfinished: Vec<String>,
    /// "Did this run twice?", answered in one line from what is stored.
    pub verdict: String,
}

/// The records of a subject (or a tenant's kind), every page of them, with
/// the audit records of the ones listed and a verdict. Read-only.
async fn history(q: &Args) -> Result<Read<History>> {
    let tenant = Tenant::parse(&q.tenant)?;
    let subject = match q.client.subject()? {
        Some(s) => Some(s),
        None => q
            .subject
            .as_deref()
            .map(|s| q.subject_key.stored(&tenant, s))
            .transpose()?,
    };
    if let Some(k) = &q.kind {
        // Validates the kind (and the subject) as a key would.
        EffectKey::new(&tenant, k, subject.as_deref().unwrap_or("x"))?;
    }
    let mut query = RecordQuery::tenant(&tenant);
    if let Some(k) = &q.kind {
        query = query.kind(k.clone());
    }
    if let Some(s) = subject {
        query = query.subject(s);
    }
    if let Some(since) = &q.since {
        query = query.since(parse_rfc3339(since)?);
    }
    let read = with_admin(&q.db.database_url, Access::ReadOnly, |ledger| async move {
        let records = all_pages(&ledger, query).await?;
        let keys: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
        let audits = all_pages(&ledger, RecordQuery::tenant(&tenant).kind(AUDIT_KIND))
            .await?
            .into_iter()
            .filter_map(|r| {
                let entry = audit::entry(&r)?;
                let touched = entry.get("key").and_then(|k| k.as_str())?;
                keys.contains(&touched).then(|| AuditView {
                    audit_key: r.key.to_string(),
                    entry,
                })
            })
            .collect::<Vec<_>>();
        Ok((records.iter().map(Inspection::from).collect::<Vec<_>>(), audits))
    })
    .await?;
    Ok(read.map(|(records, audits)| {
        let (claimed_more_than_once, verdict) = verdict(&records, &audits);
        let unfinished = records
            .iter()
            .filter(|r| matches!(r.class, "live" | "stuck"))
            .map(|r| r.record.key.clone())
            .collect();
        History {
            records,
            audits,
            claimed_more_than_once,
            unfinished,
            verdict,
        }
    }))
}

/// The one-line answer to "did this run twice?" from what is stored.
fn verdict(records: &[Inspection], audits: &[AuditView]) -> (bool, String) {
    if records.is_empty() {
        return (
            false,
            "no record: never claimed through oncely, or pruned after its retention".to_owned(),
        );
    }
    let again: Vec<&str> = records
        .iter()
        .filter(|r| r.claims.claimed_again == Some(true))
        .map(|r| r.record.key.as_str())
        .collect();
    let unknown = records
        .iter()
        .filter(|r| r.claims.claimed_again.is_none())
        .count();
    let abandoned = records.iter().filter(|r| r.class == "abandoned").count();
    let live = records.iter().filter(|r| r.class == "live").count();
    let stuck = records.iter().filter(|r| r.class == "stuck").count();
    let n = records.len();
    let mut line = if again.is_empty() {
        if n == 1 && live + stuck == 1 {
            format!(
                "no, and it is unfinished: the effect was granted once (fence = first claim's \
                 clock) and never completed ({})",
                if stuck == 1 {
                    "stuck: its lease ended with nobody holding it; the next delivery takes it \
                     over, or resolve it"
                } else {
                    "live: a worker holds it now"
                }
            )
        } else if n == 1 {
            "no: the effect was granted once (fence = first claim's clock)".to_owned()
        } else {
            format!("no: each of the {n} effects was granted once (fence = first claim's clock)")
        }
    } else {
        format!(
            "possibly: {} of {n} effect{} granted more than once (a takeover after a lease ended, \
             a claim after a release or a forget), so the work may have started twice: {}",
            again.len(),
            plural(n as u64),
            again.join(", ")
        )
    };
    if unknown > 0 {
        line.push_str(&format!(
            "; {unknown} with a fence not derived from the clock (cannot tell)"
        ));
    }
    if !audits.is_empty() {
        line.push_str(&format!(
            "; {} operator action{} recorded",
            audits.len(),
            plural(audits.len() as u64)
        ));
    }
    if live + stuck > 0 && n > 1 {
        line.push_str(&format!(
            "; {} unfinished ({live} live: held now, {stuck} stuck: lease ended, never completed)",
            live + stuck
        ));
    }
    if abandoned > 0 {
        line.push_str(&format!(
            "; {abandoned} abandoned at-most-once step{} (outcome unknown: reconcile)",
            plural(abandoned as u64)
        ));
    }
    line.push_str("; duplicates answered from a stored outcome are reads, not stored (see the oncely_duplicates_suppressed_total metric)");
    (!again.is_empty(), line)
}

/// The records as a table, the actions recorded on them, the verdict.
impl Render for History {
    fn print(&self, ledger: &str) {
        let h = self;
        println!("ledger: {ledger}");
        if !h.records.is_empty() {
            let mut t = plain_table();
            t.set_header([
                "key", "state", "fence", "granted", "created", "updated", "outcome",
            ]);
            for i in &h.records {
                t.add_row([
                    i.record.key.clone(),
                    i.class.to_owned(),
                    i.record.fence.to_string(),
                    i.claims.grants.to_owned(),
                    i.record.created_at.clone(),
                    i.record.updated_at.clone(),
                    i.outcome_summary.clone().unwrap_or_else(|| "-".to_owned()),
                ]);
            }
            println!("{}", padded(t));
        }
        for a in &h.audits {
            println!(
                "recorded: {} of {} at fence {} ({})",
                a.entry["action"].as_str().unwrap_or("?"),
                a.entry["key"].as_str().unwrap_or("?"),
                a.entry["fence"],
                a.entry["at"].as_str().unwrap_or("?")
            );
        }
        if !h.unfinished.is_empty() {
            println!("unfinished: {}", h.unfinished.join(", "));
        }
        println!("verdict: {}", h.verdict);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::tests::record;
    use oncely::backend::{Record, RecordState};

    #[test]
    fn the_verdict_says_what_the_records_show() {
        let view = |r: &Record| Inspection::from(r);
        let (twice, line) = verdict(&[], &[]);
        assert!(!twice && line.starts_with("no record"), "{line}");
        let (twice, line) = verdict(&[view(&record(0, RecordState::Completed))], &[]);
        assert!(
            !twice && line.starts_with("no: the effect was granted once"),
            "{line}"
        );
        let (twice, line) = verdict(
            &[
                view(&record(0, RecordState::Completed)),
                view(&record(3, RecordState::Completed)),
            ],
            &[],
        );
        assert!(twice && line.starts_with("possibly: 1 of 2 effects"), "{line}");
        assert!(line.contains("oncely_duplicates_suppressed_total"), "{line}");
        // A stuck effect is said to be unfinished, not only granted once.
        let (twice, line) = verdict(&[view(&record(0, RecordState::InProgress))], &[]);
        assert!(
            !twice && line.starts_with("no, and it is unfinished") && line.contains("stuck"),
            "{line}"
        );
        let (_, line) = verdict(
            &[
                view(&record(0, RecordState::Completed)),
                view(&record(0, RecordState::InProgress)),
            ],
            &[],
        );
        assert!(line.contains("1 unfinished (0 live: held now, 1 stuck"), "{line}");
    }
}

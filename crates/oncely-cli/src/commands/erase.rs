//! `oncely erase`: a subject's stored outcomes and fingerprints erased on
//! a data-protection request, without reopening its effects; recorded.

use std::process::ExitCode;

use clap::Args as ClapArgs;
use oncely::admin::{Admin, RecordQuery};
use oncely::{EffectKey, Result, Tenant};
use oncely_any::{Access, AnyLedger};
use serde::Serialize;

use super::{DbArgs, Render, SubjectKeyArgs, print_json};
use crate::audit::{self, AUDIT_KIND};
use crate::read::{Read, all_pages, with_admin};
use crate::time::rfc3339;

/// Erase what the ledger holds of one subject, on a data-protection
/// request, without letting its effects run again.
///
/// Every record of the tenant whose subject is exactly --subject (in
/// every kind), completed or released, loses its stored outcome and its
/// request fingerprint. The key, state, fence and timestamps stay, so a
/// redelivery of an erased completed effect is refused (Error::Erased)
/// and never runs again; the records are pruned at the end of their
/// retention like any other. Records still in progress (a live lease, a
/// stuck one, an abandoned step) are left unchanged and listed as
/// pending (exit 1): erase again once they are settled. The resolve and
/// forget audit records that name the subject's keys are erased too, and
/// so are the payload, headers and ordering key of the subject's outbox
/// messages that were sent (or failed for good); messages still to be
/// sent are listed as pending (exit 1). Recorded as an audit record
/// (kind oncely-audit) that names the subject only by a hash. --dry-run
/// runs the same statements and rolls them back: it lists what would
/// change, outbox messages included, and writes nothing. With
/// --subject-key-file, --subject is the raw identifier and is hashed as
/// your producers hash it (EffectKey::hashed). SQL backends only.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The tenant.
    #[arg(long)]
    tenant: String,
    /// The subject, exactly as stored (order-123), or the raw identifier
    /// with --subject-key-file.
    #[arg(long)]
    subject: String,
    #[command(flatten)]
    subject_key: SubjectKeyArgs,
    /// List what would be erased and what is pending; write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DbArgs,
}

/// What `erase` did (or, with `--dry-run`, would do).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErasureReport {
    /// The tenant.
    pub tenant: String,
    /// The subject as stored (its keyed hash with `--subject-key-file`).
    pub subject: String,
    /// Whether nothing was written.
    pub dry_run: bool,
    /// The records emptied (or that would be): completed and released.
    pub erased: Vec<String>,
    /// The records in progress, left unchanged: erase again once settled.
    pub pending: Vec<String>,
    /// The `resolve`/`forget` audit records naming the subject's keys,
    /// emptied too.
    pub audit_records_erased: Vec<String>,
    /// The subject's outbox messages that were sent (or failed for good):
    /// payload, headers and ordering key emptied.
    pub messages_erased: Vec<String>,
    /// The subject's outbox messages still to be sent, left unchanged:
    /// erase again once they are sent.
    pub messages_pending: Vec<String>,
    /// The audit record of this erasure (none on a dry run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audit_key: Option<String>,
    /// The backend's clock at the erasure (none on a dry run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
}

/// Prints the report; exit 1 when records or outbox messages are pending.
pub async fn run(args: Args) -> Result<ExitCode> {
    let read = erase(&args).await?;
    let pending = !read.value.pending.is_empty() || !read.value.messages_pending.is_empty();
    let code = if args.json {
        print_json(&read)
    } else {
        read.value.print(&read.ledger);
        ExitCode::SUCCESS
    };
    Ok(if pending { ExitCode::from(1) } else { code })
}

/// Erases (or lists, on a dry run) the subject's records and the audit
/// records that name them; records the erasure. An invalid tenant or
/// subject fails with [`oncely::Error::InvalidKey`] before anything
/// connects.
pub async fn erase(args: &Args) -> Result<Read<ErasureReport>> {
    let tenant = Tenant::parse(&args.tenant)?;
    let subject = args.subject_key.stored(&tenant, &args.subject)?;
    oncely::backend::check_subject(&subject)?;
    let dry_run = args.dry_run;
    with_admin(&args.db.database_url, Access::Existing, |ledger| async move {
        let audits = naming_audits(&ledger, &tenant, &subject).await?;
        let mut report = ErasureReport {
            tenant: tenant.to_string(),
            subject: subject.clone(),
            dry_run,
            erased: Vec::new(),
            pending: Vec::new(),
            audit_records_erased: Vec::new(),
            messages_erased: Vec::new(),
            messages_pending: Vec::new(),
            audit_key: None,
            at: None,
        };
        let strings = |keys: &[EffectKey]| keys.iter().map(EffectKey::to_string).collect();
        report.audit_records_erased = strings(&audits);
        let erasure = if dry_run {
            ledger.erase_dry_run(&tenant, &subject).await?
        } else {
            ledger.erase(&tenant, &subject).await?
        };
        report.erased = strings(&erasure.erased);
        report.pending = strings(&erasure.pending);
        report.messages_erased = strings(&erasure.messages);
        report.messages_pending = strings(&erasure.messages_pending);
        if dry_run {
            return Ok(report);
        }
        for audit in &audits {
            ledger.erase(&tenant, audit.subject()).await?;
        }
        let audit_key = audit::write_erasure(&ledger, &tenant, &subject, &erasure).await?;
        report.audit_key = Some(audit_key.to_string());
        report.at = Some(rfc3339(erasure.at));
        Ok(report)
    })
    .await
}

/// The tenant's `resolve` and `forget` audit records whose entry names a
/// key of `subject` (their outcome holds that key, subject and all).
async fn naming_audits(ledger: &AnyLedger, tenant: &Tenant, subject: &str) -> Result<Vec<EffectKey>> {
    let audits = all_pages(ledger, RecordQuery::tenant(tenant).kind(AUDIT_KIND)).await?;
    Ok(audits
        .into_iter()
        .filter(|r| {
            audit::entry(r)
                .and_then(|e| e.get("key")?.as_str().map(str::to_owned))
                .and_then(|k| EffectKey::parse(&k).ok())
                .is_some_and(|k| k.subject() == subject)
        })
        .map(|r| r.key)
        .collect())
}

impl Render for ErasureReport {
    fn print(&self, ledger: &str) {
        let r = self;
        let verb = if r.dry_run { "would erase" } else { "erased" };
        println!("ledger: {ledger}");
        println!(
            "{verb} {} record(s) of subject {} in tenant {}",
            r.erased.len(),
            r.subject,
            r.tenant
        );
        for k in &r.erased {
            println!("  {k}");
        }
        if !r.audit_records_erased.is_empty() {
            println!(
                "{verb} {} audit record(s) naming them",
                r.audit_records_erased.len()
            );
            for k in &r.audit_records_erased {
                println!("  {k}");
            }
        }
        if !r.messages_erased.is_empty() {
            println!(
                "{verb} {} sent outbox message(s) of the subject (payload, headers, ordering key)",
                r.messages_erased.len()
            );
            for k in &r.messages_erased {
                println!("  {k}");
            }
        }
        if !r.pending.is_empty() {
            println!(
                "pending: {} record(s) in progress, left unchanged; erase again once they are settled",
                r.pending.len()
            );
            for k in &r.pending {
                println!("  {k}");
            }
        }
        if !r.messages_pending.is_empty() {
            println!(
                "pending: {} outbox message(s) not sent yet, left unchanged; erase again once they are sent",
                r.messages_pending.len()
            );
            for k in &r.messages_pending {
                println!("  {k}");
            }
        }
        if let (Some(key), Some(at)) = (&r.audit_key, &r.at) {
            println!("recorded as {key} at {at}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use oncely::Error;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    #[tokio::test]
    async fn bad_input_is_refused_before_connecting() {
        // The URL is unreachable: a round trip would fail differently.
        let url = "postgres://nobody@127.0.0.1:1/none";
        for (tenant, subject) in [("bad tenant", "s"), ("t", " s"), ("t", "")] {
            let cli = Cli::parse_from([
                "x",
                "--tenant",
                tenant,
                "--subject",
                subject,
                "--database-url",
                url,
            ]);
            let err = erase(&cli.args).await.unwrap_err();
            assert!(
                matches!(err, Error::InvalidKey { .. }),
                "{tenant:?} {subject:?}: {err:?}"
            );
        }
    }
}

//! `oncely resolve`: a stuck lease or an abandoned step resolved by hand,
//! recorded as an audit record.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args as ClapArgs;
use oncely::backend::{Claim, Ledger, Outcome, Record};
use oncely::{ClaimOptions, EffectKey, Error, Result};
use oncely_any::{Access, AnyLedger};

use super::{DbArgs, no_record, print_json};
use crate::audit::{self, ActionReport, after_release};
use crate::read::{Read, with_ledger};
use crate::time::rfc3339;
use crate::view::class_of;

/// Resolve a stuck lease or an abandoned at-most-once step by hand:
/// complete it with an outcome, or release it so the next delivery of
/// its message runs it (an oncely consumer holds an abandoned step's
/// delivery until then; what to replay if none is left is printed).
///
/// A stuck lease is taken over atomically by a claim (granted only if
/// its lease is still ended; fence + 1), then completed or released
/// with that lease. An abandoned step is completed or released at its
/// fence (Record::reconciliation_lease), a fenced write. A live lease,
/// a completed or released record, or a fence other than --fence is
/// refused and nothing changes. --completed takes the handler's value
/// as JSON and stores it as the runners do ({"ok": VALUE}), so
/// duplicates replay it. Recorded: writes an audit record (kind
/// oncely-audit, same tenant) and emits a tracing event.
#[derive(Debug, ClapArgs)]
#[command(group(clap::ArgGroup::new("resolution").required(true).args(["completed", "released"])))]
pub struct Args {
    /// The effect key, tenant/kind:subject.
    key: String,
    /// Complete it with this value (JSON), e.g. '{"charge":"ch_1"}'.
    #[arg(long, value_name = "OUTCOME_JSON")]
    completed: Option<String>,
    /// Release it: the next delivery runs the effect.
    #[arg(long)]
    released: bool,
    /// Refuse unless the record is still at this fence (as listed).
    #[arg(long)]
    fence: Option<u64>,
    /// Print one JSON object instead of a line.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DbArgs,
}

/// Prints what was done, or "no record" (exit 3).
pub async fn run(args: Args) -> Result<ExitCode> {
    let resolution = match &args.completed {
        Some(text) => Resolution::Completed(serde_json::from_str(text).map_err(|e| {
            Error::InvalidInput(format!(
                "--completed takes the outcome as JSON (quote strings: '\"sent\"'): {e}"
            ))
        })?),
        None => Resolution::Released,
    };
    let read = resolve(&args.db.database_url, &args.key, &resolution, args.fence).await?;
    Ok(print_action(read, &args.key, args.json))
}

/// What `resolve` writes.
// Exhaustive by design (ARCHITECTURE.md, API boundaries): the two fenced writes that settle a lease.
#[derive(Debug, Clone, PartialEq)]
pub enum Resolution {
    /// Complete the effect with this value, stored as the runners store a
    /// handler's value (`{"ok": value}`), so duplicates replay it.
    Completed(serde_json::Value),
    /// Release the key: the next delivery runs the effect again.
    Released,
}

/// Resolves a stuck lease or an abandoned at-most-once step.
///
/// A stuck lease (in progress, ended, not at-most-once) is taken over
/// atomically by a claim (which grants `fence + 1` only if it is still
/// ended: a holder that came back or another resolver wins instead), then
/// completed or released with that lease. An abandoned step is completed or
/// released with [`Record::reconciliation_lease`], a write fenced at the
/// fence read. A live lease, a completed or released record, or a fence
/// other than `expected_fence` is refused, changing nothing. Recorded (see
/// the module docs). `None`: the key has no record in the ledger
/// [`Read::ledger`] names; nothing was written.
pub async fn resolve(
    database_url: &str,
    key: &str,
    resolution: &Resolution,
    expected_fence: Option<u64>,
) -> Result<Read<Option<ActionReport>>> {
    let key = EffectKey::parse(key)?;
    let outcome = match resolution {
        Resolution::Completed(v) => Some(Outcome::value(v)?),
        Resolution::Released => None,
    };
    with_ledger(database_url, Access::Existing, |l| async move {
        resolve_on(&l, &key, outcome.as_ref(), expected_fence).await
    })
    .await
}

async fn resolve_on(
    ledger: &AnyLedger,
    key: &EffectKey,
    outcome: Option<&Outcome>,
    expected_fence: Option<u64>,
) -> Result<Option<ActionReport>> {
    let Some(record) = ledger.get(key).await? else {
        return Ok(None);
    };
    if let Some(f) = expected_fence
        && f != record.fence
    {
        return Err(Error::LeaseLost {
            key: key.to_string(),
            fence: f,
        });
    }
    let was = class_of(&record);
    let lease = match was {
        "live" => {
            return Err(Error::InProgress {
                key: key.to_string(),
                fence: record.fence,
            });
        }
        "stuck" => {
            // The takeover is the claim's own atomic decision: it grants only
            // if the lease is still ended and the step not at-most-once.
            let opts = ClaimOptions::default()
                .lease(Duration::from_secs(60))
                .retention(retention_of(&record));
            match ledger.claim(key, &opts).await? {
                Claim::Acquired(lease) => lease,
                Claim::InProgress { fence, .. } => {
                    return Err(Error::InProgress {
                        key: key.to_string(),
                        fence,
                    });
                }
                other => {
                    return Err(Error::Misuse(format!(
                        "{key} changed while resolving it: a claim now answers {}; nothing was written",
                        other.label()
                    )));
                }
            }
        }
        "abandoned" => record.reconciliation_lease(),
        other => {
            return Err(Error::Misuse(format!(
                "{key} is {other}: resolve is for stuck leases and abandoned steps \
                 (to let a completed effect run again, use forget)"
            )));
        }
    };
    match outcome {
        Some(o) => ledger.complete(&lease, o).await?,
        None => ledger.release(&lease).await?,
    }
    let action = if outcome.is_some() {
        "resolve-completed"
    } else {
        "resolve-released"
    };
    let now = ledger.get(key).await?;
    let at = now.as_ref().map_or(lease.acquired_at(), |r| r.updated_at);
    let audit_key = audit::write(ledger, key, action, record.fence, lease.fence(), at).await?;
    Ok(Some(ActionReport {
        action,
        key: key.to_string(),
        was,
        fence: record.fence,
        new_fence: lease.fence(),
        now: if outcome.is_some() {
            "completed"
        } else {
            "released"
        },
        audit_key: audit_key.to_string(),
        at: rfc3339(at),
        next: outcome.is_none().then(|| after_release(was)).flatten(),
    }))
}

/// The retention a record was claimed with, as far as it is stored
/// (`retain_until - updated_at`, set together), bounded to what a claim
/// accepts.
fn retention_of(r: &Record) -> Duration {
    r.retain_until
        .duration_since(r.updated_at)
        .unwrap_or_default()
        .clamp(Duration::from_secs(60), Duration::from_secs(10 * 365 * 86_400))
}

/// What `resolve` or `forget` did, or "no record" (nothing written).
pub(crate) fn print_action(read: Read<Option<ActionReport>>, key: &str, json: bool) -> ExitCode {
    let Some(r) = read.value else {
        if json {
            println!("null");
        }
        return no_record(key, &read.ledger);
    };
    if json {
        return print_json(&Read {
            ledger: read.ledger,
            value: r,
        });
    }
    println!(
        "{}: {} in {} was {} at fence {}, now {} (fence {}); recorded as {}",
        r.action, r.key, read.ledger, r.was, r.fence, r.now, r.new_fence, r.audit_key
    );
    if let Some(next) = r.next {
        println!("next: {next}");
    }
    ExitCode::SUCCESS
}

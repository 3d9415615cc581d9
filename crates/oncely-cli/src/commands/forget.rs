//! `oncely forget`: a completed effect let run again on purpose, recorded
//! as an audit record.

use std::process::ExitCode;

use clap::Args as ClapArgs;
use oncely::admin::Admin;
use oncely::backend::Ledger;
use oncely::{EffectKey, Result};
use oncely_any::Access;

use super::DbArgs;
use super::resolve::print_action;
use crate::audit::{self, ActionReport};
use crate::read::{Read, with_admin};
use crate::time::rfc3339;
use crate::view::class_of;

/// Let a completed effect run again, on purpose.
///
/// One fenced write turns the completed record (at its current fence,
/// or --fence) into a released one without its outcome; the row stays,
/// so the next delivery takes it over at a higher fence and fences stay
/// above every earlier one. Refused, changing nothing, when the key has
/// no record (exit 3), is not completed, or its fence moved. Recorded:
/// writes an audit record (kind oncely-audit, same tenant) and emits a
/// tracing event. SQL backends only.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The effect key, tenant/kind:subject.
    key: String,
    /// Refuse unless the record is still at this fence.
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
    let read = forget(&args.db.database_url, &args.key, args.fence).await?;
    Ok(print_action(read, &args.key, args.json))
}

/// Lets a completed effect run again on purpose ([`Admin::forget`]), at the
/// fence read (or `expected_fence`, refused if the record moved). Recorded.
/// `None`: the key has no record in the ledger [`Read::ledger`] names;
/// nothing was written.
pub async fn forget(
    database_url: &str,
    key: &str,
    expected_fence: Option<u64>,
) -> Result<Read<Option<ActionReport>>> {
    let key = EffectKey::parse(key)?;
    with_admin(database_url, Access::Existing, |ledger| async move {
        let Some(record) = ledger.get(&key).await? else {
            return Ok(None);
        };
        let fence = expected_fence.unwrap_or(record.fence);
        ledger.forget(&key, fence).await?;
        let at = ledger.get(&key).await?.map_or(record.read_at, |r| r.updated_at);
        let audit_key = audit::write(&ledger, &key, "forget", fence, fence, at).await?;
        Ok(Some(ActionReport {
            action: "forget",
            key: key.to_string(),
            was: class_of(&record),
            fence,
            new_fence: fence,
            now: "released",
            audit_key: audit_key.to_string(),
            at: rfc3339(at),
            next: None,
        }))
    })
    .await
}

//! `oncely inspect`: one record for an operator.

use std::process::ExitCode;

use clap::Args as ClapArgs;
use oncely::backend::Ledger;
use oncely::{EffectKey, Error, Result, Tenant};
use oncely_any::Access;

use super::{ClientKeyArgs, DbArgs, Render, no_record, or_dash, padded, plain_table};
use crate::read::{Read, with_ledger};
use crate::view::Inspection;

/// Show one effect's record for an operator: its state, fence, lease,
/// timestamps, outcome size, whether a fingerprint is stored, and how
/// often it was granted.
///
/// The key is tenant/kind:subject. Stored: state, fence, at-most-once,
/// fingerprint, outcome, created/updated/lease-end/retain-until times.
/// Derived (nothing counts claims): the class (live, stuck: lease
/// ended and not at-most-once, abandoned: at-most-once and lease ended,
/// completed, released) on the backend's clock at the read; "granted":
/// 1 when the fence equals the first claim's clock in microseconds
/// (every first claim writes it so), "2 or more" when it is above it
/// (a takeover of an ended lease, a claim after a release or a forget;
/// the exact count is not stored), with the latest grant's time read
/// from the fence. Exits 3 when the key has no record. Read-only, every
/// backend.
///
/// An HTTP request's record (oncely-tower) is found from who sent it and
/// its Idempotency-Key: inspect --tenant T --principal P --client-key K
/// (--kind when the layer's kind is not "http").
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The effect key, tenant/kind:subject (or --tenant with --principal
    /// and --client-key).
    #[arg(required_unless_present = "principal", conflicts_with = "principal")]
    key: Option<String>,
    /// The tenant of an HTTP request's principal (with --principal).
    #[arg(long, requires = "principal")]
    tenant: Option<String>,
    /// The HTTP layer's kind (with --principal).
    #[arg(long, default_value = "http", requires = "principal")]
    kind: String,
    #[command(flatten)]
    client: ClientKeyArgs,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DbArgs,
}

/// Prints the record, or "no record" (exit 3; `null` with `--json`).
pub async fn run(args: Args) -> Result<ExitCode> {
    let key = match (&args.key, args.client.subject()?) {
        (Some(key), _) => key.clone(),
        (None, Some(subject)) => {
            let tenant = match &args.tenant {
                Some(t) => Tenant::parse(t)?,
                None => Tenant::global(),
            };
            EffectKey::new(&tenant, &args.kind, subject)?.to_string()
        }
        (None, None) => {
            return Err(Error::Misuse(
                "give a key, or --principal and --client-key".into(),
            ));
        }
    };
    let read = inspect(&args.db.database_url, &key).await?;
    Ok(match read.value {
        Some(inspection) => Read {
            ledger: read.ledger,
            value: inspection,
        }
        .render(args.json),
        None => {
            if args.json {
                println!("null");
            }
            no_record(&key, &read.ledger)
        }
    })
}

/// Reads one record for `inspect` (read-only, every backend). `None`: no
/// record (in the ledger [`Read::ledger`] names).
pub async fn inspect(database_url: &str, key: &str) -> Result<Read<Option<Inspection>>> {
    let key = EffectKey::parse(key)?;
    let read = with_ledger(
        database_url,
        Access::ReadOnly,
        |l| async move { l.get(&key).await },
    )
    .await?;
    Ok(read.map(|r| r.as_ref().map(Inspection::from)))
}

/// The record as a two-column table.
impl Render for Inspection {
    fn print(&self, ledger: &str) {
        let r = &self.record;
        let mut t = plain_table();
        let lease = match self.lease_left_seconds {
            Some(s) if s > 0.0 => format!("{} (ends in {s:.1} s)", or_dash(r.lease_expires_at.as_deref())),
            Some(s) => format!(
                "{} (ended {:.1} s ago)",
                or_dash(r.lease_expires_at.as_deref()),
                -s
            ),
            None => "-".to_owned(),
        };
        let granted = match &self.claims.latest_grant_at {
            Some(at) => format!(
                "{} (derived from the fence; latest grant {at})",
                self.claims.grants
            ),
            None => format!("{} (derived from the fence)", self.claims.grants),
        };
        for (k, v) in [
            ("ledger", ledger.to_owned()),
            ("key", r.key.clone()),
            ("state", format!("{} (stored {})", self.class, r.state)),
            ("fence", r.fence.to_string()),
            ("granted", granted),
            ("at-most-once", r.at_most_once.to_string()),
            ("created", r.created_at.clone()),
            ("updated", r.updated_at.clone()),
            ("lease", lease),
            ("retain until", r.retain_until.clone()),
            (
                "outcome",
                self.outcome_summary.clone().unwrap_or_else(|| "-".to_owned()),
            ),
            (
                "fingerprint",
                if self.fingerprint_present {
                    "stored"
                } else {
                    "none"
                }
                .to_owned(),
            ),
            ("provider key", r.provider_key.clone()),
            ("read at", self.read_at.clone()),
        ] {
            t.add_row([k.to_owned(), v]);
        }
        println!("{}", padded(t));
    }
}

//! `oncely reencrypt`: stored outcomes re-sealed under the active key of an
//! outcome keyring (key rotation, [`oncely::codec`]), or plain ones sealed.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args as ClapArgs;
use oncely::codec::{Keyring, ResealOptions, reseal};
use oncely::{Error, Result};
use oncely_any::Access;
use serde::Serialize;

use super::{DbArgs, Render, ScopeArgs};
use crate::audit;
use crate::read::{Read, with_admin};

/// The environment variable holding the keyring itself (entries
/// `id=<64 hex>`), when no keys file is given.
pub const KEYS_ENV: &str = "ONCELY_OUTCOME_KEYS";

/// Re-seal stored outcomes under the active outcome key (key rotation).
///
/// Reads the keyring from --keys-file (or ONCELY_OUTCOME_KEYS_FILE), else
/// from the ONCELY_OUTCOME_KEYS variable: entries id=<64 hex digits>,
/// separated by newlines, commas or spaces, '#' comments; the entry marked
/// with a leading '*' is the active key (else the first), the others are
/// decrypt-only. Keys are never read from the command line.
///
/// Every completed record whose outcome is sealed under another key id is
/// opened and sealed again under the active one, by one conditional write
/// per record: a record that changed meanwhile is left alone and counted.
/// The command's own audit records (kind oncely-audit) are left plain.
/// With --plain, plain outcomes (written before encryption) are sealed
/// too. Records that cannot be opened (a key the keyring lacks) are listed
/// and left as they are (exit 1). Running it again is harmless. With
/// --dry-run, counts and writes nothing. SQL backends only. Recorded as
/// an audit record (kind oncely-audit, in the tenant, or the global
/// tenant with --all-tenants) with the counts, and a tracing event
/// (target oncely::audit).
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// A file holding the keyring.
    #[arg(long, env = "ONCELY_OUTCOME_KEYS_FILE", value_name = "PATH")]
    keys_file: Option<PathBuf>,
    #[command(flatten)]
    scope: ScopeArgs,
    /// Seal plain (unencrypted) outcomes too.
    #[arg(long)]
    plain: bool,
    /// Deflate each outcome it re-seals before sealing, where that makes it
    /// smaller (off by default: the stored size then says something about
    /// the content; see docs/privacy.md).
    #[arg(long)]
    compress: bool,
    /// Count what would be re-sealed; write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DbArgs,
}

/// The keyring from `file`, else from [`KEYS_ENV`]; [`Error::Config`]
/// when neither is given or it does not parse (never echoing a key).
pub fn load_keys(file: Option<&Path>) -> Result<Keyring> {
    let text = match file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("outcome keys file {}: {e}", path.display())))?,
        None => std::env::var(KEYS_ENV).map_err(|_| {
            Error::Config(format!(
                "no outcome keys: give --keys-file (or ONCELY_OUTCOME_KEYS_FILE) or set {KEYS_ENV}"
            ))
        })?,
    };
    Keyring::parse(&text)
}

/// What `reencrypt` did (or, in a dry run, would do).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReencryptReport {
    /// The active key id outcomes are sealed under.
    pub active_key: String,
    /// Whether nothing was written.
    pub dry_run: bool,
    /// Completed records with an outcome looked at.
    pub scanned: u64,
    /// Re-sealed under the active key (dry run: would be).
    pub resealed: u64,
    /// Already under the active key.
    pub current: u64,
    /// Plain outcomes left plain (no --plain).
    pub plain: u64,
    /// Changed by someone else meanwhile; left as they are.
    pub moved_on: u64,
    /// Records that could not be opened: key and reason.
    pub failed: Vec<Failed>,
    /// The audit record of this run (none on a dry run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audit_key: Option<String>,
}

/// A record `reencrypt` could not open.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Failed {
    /// The effect key.
    pub key: String,
    /// Why (a key id the keyring lacks, a value that does not open).
    pub error: String,
}

/// Re-seals the stored outcomes of the ledger at `database_url`
/// ([`reseal`]) and records the run (not a dry run) as an audit record.
pub async fn reencrypt(
    database_url: &str,
    keys: &Keyring,
    options: &ResealOptions,
) -> Result<Read<ReencryptReport>> {
    let access = if options.dry_run {
        Access::ReadOnly
    } else {
        Access::Existing
    };
    with_admin(database_url, access, |ledger| async move {
        let r = reseal(&ledger, keys, options).await?;
        let audit_key = if options.dry_run {
            None
        } else {
            let key = audit::write_reencrypt(&ledger, options.tenant.as_ref(), keys.active(), &r).await?;
            Some(key.to_string())
        };
        Ok(ReencryptReport {
            active_key: keys.active().to_owned(),
            dry_run: options.dry_run,
            scanned: r.scanned,
            resealed: r.resealed,
            current: r.current,
            plain: r.plain,
            moved_on: r.moved_on,
            failed: r
                .failed
                .iter()
                .map(|(key, error)| Failed {
                    key: key.to_string(),
                    error: error.to_string(),
                })
                .collect(),
            audit_key,
        })
    })
    .await
}

/// Prints the counts; exit 1 when a record could not be opened.
pub async fn run(args: Args) -> Result<ExitCode> {
    let keys = load_keys(args.keys_file.as_deref())?.compress(args.compress);
    // Its own audit records stay plain: `history` and `erase` read them
    // without a key.
    let mut options = ResealOptions::default()
        .plain(args.plain)
        .dry_run(args.dry_run)
        .skip_kind(audit::AUDIT_KIND);
    if let Some(tenant) = args.scope.tenant()? {
        options = options.tenant(tenant);
    }
    let read = reencrypt(&args.db.database_url, &keys, &options).await?;
    let failed = !read.value.failed.is_empty();
    let code = read.render(args.json);
    Ok(if failed { ExitCode::from(1) } else { code })
}

impl Render for ReencryptReport {
    fn print(&self, ledger: &str) {
        let verb = if self.dry_run {
            "would re-seal"
        } else {
            "re-sealed"
        };
        println!("ledger: {ledger}");
        println!(
            "{verb} {} of {} stored outcomes under key {}; {} already under it, {} plain left plain, \
             {} changed meanwhile (left alone), {} could not be opened",
            self.resealed,
            self.scanned,
            self.active_key,
            self.current,
            self.plain,
            self.moved_on,
            self.failed.len()
        );
        for f in &self.failed {
            println!("  {}: {}", f.key, f.error);
        }
        if let Some(key) = &self.audit_key {
            println!("recorded as {key}");
        }
    }
}

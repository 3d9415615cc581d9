//! One module per `oncely` command, as mini-redis's `cmd/` has one per
//! command: each owns its arguments (a clap [`Args`] struct, whose doc
//! comment is the command's help), its `run`, and how its answer is
//! printed. The binary only parses the command line, calls the command's
//! `run`, and maps an [`Error`] to the exit code.
//!
//! Every `run` returns the exit code of an answer (0, or 3 for "no record",
//! 1 for a run that found problems, 130 for Ctrl-C) or the [`Error`] that
//! stopped it, printed by the binary.

// The `Args` doc comments are the commands' `--help`, written for a
// terminal: `[?table=T]` and `<run id>` are command-line syntax, not links
// or HTML.
#![allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]

pub mod abandoned;
pub mod bench;
pub mod chaos;
pub mod demo;
pub mod erase;
pub mod forget;
pub mod get;
pub mod history;
pub mod inspect;
pub mod migrate;
pub(crate) mod progress;
pub mod prune;
pub mod reconcile;
pub mod reencrypt;
pub mod relay;
pub mod resolve;
pub mod serve;
pub mod stats;
pub mod stuck;

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use comfy_table::Table;
use comfy_table::presets::NOTHING;
use oncely::{Error, Result, Tenant};
use serde::Serialize;

use crate::read::Read;

/// The ledger a command reads or writes.
#[derive(Debug, Args)]
pub struct DbArgs {
    /// The ledger's database: sqlite:PATH[?table=T],
    /// postgres://USER@HOST/DB[?schema=S&table=T], mysql://USER@HOST/DB[?table=T]
    /// (or mariadb://), redis://HOST:PORT[?prefix=P],
    /// redis+cluster://HOST:PORT,HOST:PORT,..., redis+sentinel://HOST:PORT,.../MASTER,
    /// nats://HOST:PORT[,HOST:PORT...][?bucket=NAME&replicas=1|3] or memory:.
    #[arg(long, env = "ONCELY_DATABASE_URL")]
    pub database_url: String,
}

/// Which tenants a read covers: one, or every tenant when asked for
/// explicitly.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct ScopeArgs {
    /// The tenant whose records to read.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Read every tenant's records (an operator view across tenants).
    #[arg(long)]
    pub all_tenants: bool,
}

impl ScopeArgs {
    /// One tenant (`Some`), or all (`None`, asked for explicitly with
    /// `--all-tenants`). Neither, or both, is a usage error
    /// ([`Error::Misuse`]); an invalid tenant is [`Error::InvalidKey`].
    pub fn tenant(&self) -> Result<Option<Tenant>> {
        match (self.tenant.as_deref(), self.all_tenants) {
            (Some(t), false) => Ok(Some(Tenant::parse(t)?)),
            (None, true) => Ok(None),
            (Some(_), true) => Err(Error::Misuse(
                "give either --tenant or --all-tenants, not both".into(),
            )),
            (None, false) => Err(Error::Misuse(
                "this command reads one tenant (--tenant T) or, explicitly, every tenant (--all-tenants)"
                    .into(),
            )),
        }
    }
}

/// An HTTP request's key as an operator knows it: who sent it and the
/// `Idempotency-Key` it carried. `oncely-tower` stores the request under
/// the subject [`EffectKey::client_subject`](oncely::EffectKey::client_subject)
/// computes from both, which is what these arguments look up.
#[derive(Debug, Args)]
pub struct ClientKeyArgs {
    /// The principal (the authenticated caller's id) an HTTP request's
    /// Idempotency-Key is bound to; with --client-key, finds the record
    /// oncely-tower stored for it.
    #[arg(long, requires = "client_key")]
    pub principal: Option<String>,
    /// The Idempotency-Key header's value (without its quotes), with
    /// --principal.
    #[arg(long, requires = "principal")]
    pub client_key: Option<String>,
}

impl ClientKeyArgs {
    /// The stored subject, when both were given.
    pub fn subject(&self) -> Result<Option<String>> {
        match (self.principal.as_deref(), self.client_key.as_deref()) {
            (Some(p), Some(k)) => Ok(Some(oncely::EffectKey::client_subject(p, k)?)),
            _ => Ok(None),
        }
    }
}

/// The key producers hash subjects with ([`EffectKey::hashed`](oncely::EffectKey::hashed)),
/// so an operator can name a record by its raw subject (an email) and
/// the command looks it up by the keyed hash the ledger stores.
#[derive(Debug, Args)]
pub struct SubjectKeyArgs {
    /// A file holding the subject key (64 hex digits) your producers hash
    /// subjects with (EffectKey::hashed): the subject given is then the raw
    /// identifier (alice@example.com), and the stored one (h-…) is looked
    /// up. The key never appears in any output.
    #[arg(long, env = "ONCELY_SUBJECT_KEY_FILE")]
    pub subject_key_file: Option<std::path::PathBuf>,
}

impl SubjectKeyArgs {
    /// The key from the file, if one was named ([`Error::Config`] when it
    /// cannot be read or is not 64 hex digits).
    pub fn key(&self) -> Result<Option<oncely::SubjectKey>> {
        let Some(path) = &self.subject_key_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("subject key file {}: {e}", path.display())))?;
        oncely::SubjectKey::from_hex(&text)
            .map(Some)
            .map_err(|e| Error::Config(format!("subject key file {}: {e}", path.display())))
    }

    /// The subject as the ledger stores it: `subject` hashed with the key
    /// when one was given, else `subject` as it is.
    pub fn stored(&self, tenant: &Tenant, subject: &str) -> Result<String> {
        match self.key()? {
            Some(k) => oncely::EffectKey::hashed_subject(tenant, subject, &k),
            None => Ok(subject.to_owned()),
        }
    }
}

/// An answer that prints itself for people; `--json` prints it through
/// [`Read`]'s `Serialize` instead (the value with a `ledger` field).
pub trait Render: Serialize {
    /// Prints the answer on stdout, naming the ledger it came from.
    fn print(&self, ledger: &str);
}

impl<T: Render> Read<T> {
    /// Prints the answer: one JSON object with `json`, else for people.
    pub fn render(&self, json: bool) -> ExitCode {
        if json {
            return print_json(self);
        }
        self.value.print(&self.ledger);
        ExitCode::SUCCESS
    }
}

/// A duration argument: `500ms`, `30s`, `5m`, `1h30m`, `2h`, `1d`
/// ([`crate::time::parse_duration`]).
pub(crate) fn duration_arg(s: &str) -> std::result::Result<Duration, String> {
    crate::time::parse_duration(s).map_err(|e| match e {
        Error::InvalidInput(m) => m,
        other => other.to_string(),
    })
}

/// Prints `value` as one line of JSON (exit 0), or says it cannot (exit 1).
pub(crate) fn print_json<T: Serialize>(value: &T) -> ExitCode {
    match serde_json::to_string(value) {
        Ok(s) => {
            println!("{s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: cannot encode the output as JSON: {e}");
            ExitCode::from(1)
        }
    }
}

/// "No record" for `key` in `ledger`: the answer of `get`, `inspect`,
/// `resolve` and `forget` (exit 3).
pub(crate) fn no_record(key: &str, ledger: &str) -> ExitCode {
    eprintln!("no record for {key} in {ledger}");
    ExitCode::from(3)
}

/// A table without borders; [`padded`] spaces its columns.
pub(crate) fn plain_table() -> Table {
    let mut t = Table::new();
    t.load_preset(NOTHING);
    t
}

/// Two spaces between columns, none before the first.
pub(crate) fn padded(mut t: Table) -> Table {
    for (i, column) in t.column_iter_mut().enumerate() {
        column.set_padding((if i == 0 { 0 } else { 2 }, 0));
    }
    t
}

/// The value, or `-` when there is none.
pub(crate) fn or_dash(v: Option<&str>) -> String {
    v.unwrap_or("-").to_owned()
}

/// `""` for one, `"s"` for any other count.
pub(crate) fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(tenant: Option<&str>, all_tenants: bool) -> Result<Option<Tenant>> {
        ScopeArgs {
            tenant: tenant.map(str::to_owned),
            all_tenants,
        }
        .tenant()
    }

    #[test]
    fn scope_needs_a_tenant_or_all_tenants() {
        assert!(matches!(scope(None, false), Err(Error::Misuse(_))));
        assert!(matches!(scope(Some("a"), true), Err(Error::Misuse(_))));
        assert_eq!(scope(None, true).unwrap(), None);
        assert_eq!(
            scope(Some("acme"), false).unwrap(),
            Some(Tenant::new("acme").unwrap())
        );
        assert!(matches!(scope(Some("a/b"), false), Err(Error::InvalidKey { .. })));
    }
}

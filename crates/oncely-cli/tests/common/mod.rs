//! What the command-line tests share: running the built `oncely` binary,
//! reading its output, and reaching a server (or saying why not).
// Each test binary uses its own subset.
#![allow(dead_code)]

use std::process::{Command, Output};

use oncely::backend::{Claim, Lease};
use oncely_cli::AnyLedger;

/// Runs the built binary with `args`, ignoring any `ONCELY_DATABASE_URL` of
/// the environment the tests run in.
pub fn oncely(args: &[&str]) -> Output {
    oncely_with(args, None)
}

/// Runs the built binary with `args` and `ONCELY_DATABASE_URL` set to
/// `env_url` (or unset).
pub fn oncely_with(args: &[&str], env_url: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oncely"));
    cmd.args(args).env_remove("ONCELY_DATABASE_URL");
    if let Some(url) = env_url {
        cmd.env("ONCELY_DATABASE_URL", url);
    }
    cmd.output().expect("the oncely binary runs")
}

/// What the command printed on stdout.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// What the command printed on stderr.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A current-thread runtime for seeding and reading back through the library.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The URL in `var` (else `default`) if a ledger connects there; otherwise
/// the test is skipped, or fails under `ONCELY_REQUIRE_SERVICES=1`.
pub fn reachable(var: &str, default: &str, what: &str) -> Option<String> {
    let url = oncely::conformance::service_url(var, Some(default))?;
    connects(url, what)
}

/// The machine's Redis (ONCELY_REDIS_URL) with `?ephemeral=true`: the test
/// server persists nothing (`--save "" --appendonly no`), and the commands
/// that write refuse such a server unless the URL accepts it.
pub fn redis_url() -> Option<String> {
    let url = oncely::conformance::service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379"))?;
    let sep = if url.contains('?') { '&' } else { '?' };
    connects(format!("{url}{sep}ephemeral=true"), "Redis")
}

fn connects(url: String, what: &str) -> Option<String> {
    let rt = runtime();
    match rt.block_on(AnyLedger::connect(&url)) {
        Ok(l) => {
            rt.block_on(l.close());
            Some(url)
        }
        Err(e) => oncely::conformance::skip_or_fail(&format!("{what} at {url}: {e}")),
    }
}

/// The lease of a claim that must have acquired.
pub fn acquired(c: Claim) -> Lease {
    match c {
        Claim::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

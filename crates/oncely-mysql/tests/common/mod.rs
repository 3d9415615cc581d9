//! Shared by the Galera test binaries: where the three-node cluster is.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use oncely::conformance::skip_or_fail;
use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};

/// The repository's `scripts/galera-cluster.sh`.
pub fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/galera-cluster.sh")
}

/// The node URLs: `ONCELY_GALERA_URLS` (comma-separated), or those of the
/// three-node cluster this process starts with `scripts/galera-cluster.sh up`
/// (once per test binary; the script is idempotent and locked, so parallel
/// binaries share one cluster).
pub fn galera_urls() -> Option<Vec<String>> {
    let split = |urls: &str| -> Vec<String> {
        urls.split(',')
            .map(|u| u.trim().to_owned())
            .filter(|u| !u.is_empty())
            .collect()
    };
    if let Ok(urls) = std::env::var("ONCELY_GALERA_URLS") {
        return Some(split(&urls));
    }
    static URLS: OnceLock<Result<String, String>> = OnceLock::new();
    match URLS.get_or_init(|| run(&["up"]).map(|out| out.trim().lines().last().unwrap_or("").to_owned())) {
        Ok(urls) => Some(split(urls)),
        Err(e) => skip_or_fail(&format!("three-node Galera cluster: {e}")),
    }
}

/// Runs the cluster script; its stdout on success.
pub fn run(args: &[&str]) -> Result<String, String> {
    let out = Command::new("bash")
        .arg(script())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running {}: {e}", script().display()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{} {args:?} failed: {}",
            script().display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A ledger on `url` with `opts`.
pub async fn ledger_on(url: &str, opts: MySqlLedgerOptions) -> Option<MySqlLedger> {
    match MySqlLedger::connect_with(url, opts).await {
        Ok(l) => Some(l),
        Err(e) => skip_or_fail(&format!("Galera node at {url}: {e}")),
    }
}

/// One ledger per node, each with a pool of its own (`opts`).
pub async fn nodes_with(opts: MySqlLedgerOptions) -> Option<Vec<MySqlLedger>> {
    let mut nodes = Vec::new();
    for url in galera_urls()? {
        nodes.push(ledger_on(&url, opts.clone()).await?);
    }
    Some(nodes)
}

/// One URL listing every node (`mysql://root@h1,h2,h3/test`), starting
/// from node `first` (0-based) and going round.
pub fn host_list_url(first: usize) -> Option<String> {
    let urls = galera_urls()?;
    let hosts: Vec<String> = urls
        .iter()
        .map(|u| {
            let rest = u.split_once('@').map_or(u.as_str(), |(_, r)| r);
            rest.split('/').next().unwrap_or(rest).to_owned()
        })
        .collect();
    let n = hosts.len();
    let order: Vec<&str> = (0..n).map(|i| hosts[(first + i) % n].as_str()).collect();
    Some(format!("mysql://root@{}/test", order.join(",")))
}

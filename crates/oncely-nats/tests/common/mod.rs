//! Shared by the cluster test binaries: where the three-node cluster is.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use oncely::conformance::skip_or_fail;

/// The repository's `scripts/nats-cluster.sh`.
pub fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/nats-cluster.sh")
}

/// `ONCELY_NATS_CLUSTER_URLS`, or the URLs of a cluster this process starts
/// with `scripts/nats-cluster.sh up` (once per test binary; the script is
/// idempotent and locked, so parallel binaries share one cluster).
pub fn cluster_urls() -> Option<String> {
    if let Ok(urls) = std::env::var("ONCELY_NATS_CLUSTER_URLS") {
        return Some(urls);
    }
    static URLS: OnceLock<Result<String, String>> = OnceLock::new();
    match URLS.get_or_init(|| run(&["up"]).map(|out| out.trim().lines().last().unwrap_or("").to_owned())) {
        Ok(urls) => Some(urls.clone()),
        Err(e) => skip_or_fail(&format!("three-node NATS cluster: {e}")),
    }
}

/// Runs the cluster script; its stdout on success.
pub fn run(args: &[&str]) -> Result<String, String> {
    let out = Command::new("bash")
        .arg(script())
        .args(args)
        .output()
        .map_err(|e| format!("running {}: {e}", script().display()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{} {args:?} failed: {}",
            script().display(),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

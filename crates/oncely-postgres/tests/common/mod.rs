//! Shared by the test binaries that need a primary with a streaming standby
//! (`scripts/pg-standby.sh`, run once per call; idempotent and locked).

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

use oncely::conformance::skip_or_fail;

/// The repository's `scripts/pg-standby.sh`.
pub fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/pg-standby.sh")
}

/// Runs the script for the pair whose primary listens on `port` (the
/// standby on the next one); its last line of output on success.
/// `ONCELY_PG_STANDBY_PORT` moves `port` by the difference to 5440 (to run
/// two copies of the tests side by side).
pub fn run(port: u16, args: &[&str]) -> Result<String, String> {
    let shift = std::env::var("ONCELY_PG_STANDBY_PORT")
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
        .map_or(0, |p| p - 5440);
    let port = (i32::from(port) + shift).to_string();
    let out = Command::new("bash")
        .arg(script())
        .args(args)
        .env("ONCELY_PG_STANDBY_PORT", &port)
        .output()
        .map_err(|e| format!("running {}: {e}", script().display()))?;
    if out.status.success() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        Ok(stdout.trim().lines().last().unwrap_or("").to_owned())
    } else {
        Err(format!(
            "{} {args:?} (port {port}) failed: {}",
            script().display(),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// The two-host URL of a healthy pair on `port` (started if need be), or
/// `None` (skipped) when it cannot be started and services are not required.
pub fn pair(port: u16, mode: &str) -> Option<String> {
    match run(port, &["up", mode]) {
        Ok(url) => Some(url),
        Err(e) => skip_or_fail(&format!("PostgreSQL primary and standby: {e}")),
    }
}

/// Like [`pair`], but always a fresh pair (after a failover).
pub fn fresh_pair(port: u16, mode: &str) -> Option<String> {
    match run(port, &["reset", mode]) {
        Ok(url) => Some(url),
        Err(e) => skip_or_fail(&format!("PostgreSQL primary and standby: {e}")),
    }
}

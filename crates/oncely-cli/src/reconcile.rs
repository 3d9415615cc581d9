//! `oncely reconcile`: settles stuck leases and abandoned at-most-once
//! steps by asking an external command about each, like a git hook.
//!
//! The CLI cannot know your provider, so the [`Reconciler`] it runs,
//! [`CheckCommand`], runs a command of yours once per doubtful record,
//! through `sh -c`, and reads its answer. The record reaches the command
//! only as data, never as part of a command line (no shell injection from
//! a key's subject):
//!
//! - on **stdin**, one JSON object and a newline: `key`, `tenant`, `kind`,
//!   `subject`, `doubt` (`stuck` or `abandoned`), `fence`, `state`,
//!   `at_most_once`, `created_at`, `lease_expires_at` (RFC 3339 UTC) and
//!   `provider_key` (the idempotency key the step sent the provider);
//! - in the environment: `ONCELY_KEY`, `ONCELY_DOUBT`,
//!   `ONCELY_PROVIDER_KEY` (and everything the `oncely` process has).
//!
//! The command prints one line on stdout ([`parse_answer`]):
//!
//! | line | verdict | what is written |
//! | --- | --- | --- |
//! | `done <JSON>` | [`Verdict::Done`] with [`Outcome::value`] of the JSON | the record completes with `{"ok": JSON}`, as a runner stores a handler's value, so duplicates replay it (`done null` for a step that returns nothing) |
//! | `not-done` | [`Verdict::NotDone`] | the record is released: the next delivery of its message runs the step (an oncely consumer holds an abandoned step's delivery until then); the report says what to replay if none is left |
//! | `unknown` | [`Verdict::Unknown`] | nothing: the record stays listed |
//!
//! Anything else (another line, several lines, JSON that does not parse), a
//! non-zero exit, or no answer within the timeout (the command is then
//! killed) is an error for that record: nothing is written for it, it is
//! counted in [`Report::errors`], and the run goes on. Write logs
//! to stderr: the end of it is quoted in the error.
//!
//! The command runs in a process group of its own. Its answer is what it
//! printed by the time it exited; then whatever it left running in the
//! group (a background child still holding its stdout, say) is killed, so
//! a prompt answer counts and nothing outlives the record. On a timeout,
//! or when the run is interrupted, the whole group is killed.
//!
//! The records are listed and the answers applied by
//! [`oncely::reconcile::Reconcile`] (stuck leases first, then abandoned
//! steps, oldest first; fenced writes; a stuck lease taken over by a claim
//! before it is written). It needs [`oncely::admin::Admin`]: on Redis and
//! NATS the command is a usage error.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use oncely::admin::{Filter, RecordQuery};
use oncely::backend::{Outcome, Record};
use oncely::open::Access;
use oncely::reconcile::{Chain, Doubt, Query, Reconcile, Reconciler, Report, Resolution, Verdict};
use oncely::{BoxError, EffectKey, Error, Result, Tenant};
use rustix::process::{Pid, Signal, kill_process_group};
use serde::Serialize;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::audit::after_release;
use crate::read::{Read, open_admin};
use crate::time::rfc3339;

/// How much of the command's stderr an error quotes (its end).
const STDERR_TAIL: usize = 300;

/// What `oncely reconcile` runs.
#[derive(Debug, Clone)]
pub struct ReconcileConfig {
    /// One tenant, or every tenant (`None`).
    pub tenant: Option<Tenant>,
    /// The command, run through `sh -c` once per doubtful record.
    pub check: String,
    /// How long the command may take for one record before it is killed,
    /// with everything it started (its process group).
    pub check_timeout: Duration,
    /// Ask, but write nothing.
    pub dry_run: bool,
    /// Leave records alone whose lease ended less than this long ago.
    pub grace: Duration,
    /// Records listed per page.
    pub batch: usize,
    /// Stop after this many records.
    pub max: Option<u64>,
    /// At most this many records per second.
    pub rate: Option<f64>,
}

impl ReconcileConfig {
    /// A run over `tenant` asking `check`, with the defaults: a 30 s
    /// timeout, no grace, pages of 100, no limits, not a dry run.
    pub fn new(tenant: Option<Tenant>, check: impl Into<String>) -> Self {
        ReconcileConfig {
            tenant,
            check: check.into(),
            check_timeout: Duration::from_secs(30),
            dry_run: false,
            grace: Duration::ZERO,
            batch: 100,
            max: None,
            rate: None,
        }
    }

    /// Refuses, before anything connects, what cannot run.
    fn validate(&self) -> Result<()> {
        if self.check.trim().is_empty() {
            return Err(Error::InvalidInput(
                "--check needs a command to ask about each record".into(),
            ));
        }
        if self.check_timeout.is_zero() {
            return Err(Error::InvalidInput("--check-timeout must be above zero".into()));
        }
        if self.batch == 0 {
            return Err(Error::InvalidInput("--batch must be at least 1".into()));
        }
        if let Some(r) = self.rate
            && !(r.is_finite() && r > 0.0)
        {
            return Err(Error::InvalidInput(format!(
                "--rate must be a positive number of records per second, got {r}"
            )));
        }
        Ok(())
    }
}

/// What a run did, as `oncely reconcile` prints it: the run's counts
/// ([`Report`]'s JSON) and each examined record with the command's answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReconcileReport {
    /// What the run did: `dry_run`, `examined`, `completed`, `released`,
    /// `unknown`, `moved`, `skipped`, `errors` and `aborted` (its entries
    /// are [`ReconcileReport::entries`]).
    #[serde(flatten)]
    pub run: Report,
    /// Every examined record, in order.
    pub entries: Vec<EntryView>,
}

impl ReconcileReport {
    /// Whether any record failed or the run stopped early (the command
    /// exits 1).
    pub fn failed(&self) -> bool {
        self.run.errors > 0 || self.run.aborted.is_some()
    }
}

/// One examined record.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EntryView {
    /// `tenant/kind:subject`.
    pub key: String,
    /// `stuck`, `abandoned`, or `None` when it was not in doubt.
    pub doubt: Option<&'static str>,
    /// Its fence when listed.
    pub fence: u64,
    /// The command's answer: `done`, `not-done`, `unknown`, `error` (it
    /// failed), or `None` (it was not asked).
    pub verdict: Option<&'static str>,
    /// `completed`, `released`, `unknown`, `moved`, `skipped` or `error`.
    pub result: &'static str,
    /// The JSON the command answered `done` with.
    pub outcome: Option<serde_json::Value>,
    /// What failed.
    pub error: Option<String>,
    /// What must happen next for a released record's step to be performed
    /// ([`after_release`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<&'static str>,
}

/// Reconciles the doubtful records of a tenant (or of every tenant):
/// stuck leases, then abandoned steps, asking `config.check` about each.
/// Bad input fails before anything connects; a ledger without
/// [`oncely::admin::Admin`] fails with [`Error::Config`]. Record failures
/// are in the report, not an `Err`.
pub async fn reconcile(database_url: &str, config: &ReconcileConfig) -> Result<Read<ReconcileReport>> {
    config.validate()?;
    let access = if config.dry_run {
        Access::ReadOnly
    } else {
        Access::Existing
    };
    let ledger = open_admin(database_url, access).await?;
    let check = CheckCommand::new(&config.check, config.check_timeout);
    let mut run = Reconcile::new(&ledger, &check)
        .batch_size(config.batch)
        .dry_run(config.dry_run)
        .grace(config.grace);
    if let Some(max) = config.max {
        run = run.max_records(max);
    }
    if let Some(rate) = config.rate {
        run = run.rate_limit(rate);
    }
    let report = match &config.tenant {
        Some(t) => run.doubtful(t).await,
        None => {
            let all = || RecordQuery::all_tenants();
            run.run(Chain::new(
                Query::new(all().filter(Filter::Stuck)),
                Query::new(all().filter(Filter::Abandoned)),
            ))
            .await
        }
    };
    ledger.close().await;
    let mut report = report?;
    let examined = std::mem::take(&mut report.entries);
    let answers = check.answers.into_inner().unwrap_or_else(|p| p.into_inner());
    let entries = examined
        .iter()
        .map(|e| {
            let answer = answers.get(&(e.key.clone(), e.fence));
            EntryView {
                key: e.key.to_string(),
                doubt: e.doubt.map(Doubt::as_str),
                fence: e.fence,
                verdict: answer.map(|a| a.verdict),
                result: e.resolution.as_str(),
                outcome: answer.and_then(|a| a.outcome.clone()),
                error: match &e.resolution {
                    Resolution::Error(m) => Some(m.clone()),
                    _ => None,
                },
                next: match (&e.resolution, e.doubt) {
                    (Resolution::Released, Some(doubt)) if !report.dry_run => after_release(doubt.as_str()),
                    _ => None,
                },
            }
        })
        .collect();
    Ok(Read {
        ledger: ledger.to_string(),
        value: ReconcileReport { run: report, entries },
    })
}

/// What the command said about one record, kept for the report.
#[derive(Debug, Clone)]
struct Answer {
    verdict: &'static str,
    outcome: Option<serde_json::Value>,
}

/// A [`Reconciler`] that runs a shell command per record (see the
/// [module docs](self) for the protocol).
#[derive(Debug)]
pub struct CheckCommand {
    command: String,
    timeout: Duration,
    answers: Mutex<HashMap<(EffectKey, u64), Answer>>,
}

impl CheckCommand {
    /// Runs `command` through `sh -c` in a process group of its own, killed
    /// with the group after `timeout`.
    pub fn new(command: &str, timeout: Duration) -> Self {
        CheckCommand {
            command: command.to_owned(),
            timeout,
            answers: Mutex::new(HashMap::new()),
        }
    }

    fn note(&self, record: &Record, answer: Answer) {
        self.answers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((record.key.clone(), record.fence), answer);
    }

    /// Runs the command for one record and reads its line.
    async fn ask(&self, record: &Record, doubt: Doubt) -> std::result::Result<Answered, String> {
        let input = serde_json::to_vec(&CheckInput::of(record, doubt))
            .map_err(|e| format!("cannot encode the record as JSON: {e}"))?;
        let mut child = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(&self.command)
            .env("ONCELY_KEY", record.key.as_str())
            .env("ONCELY_DOUBT", doubt.as_str())
            .env("ONCELY_PROVIDER_KEY", record.key.provider_key())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // A group of its own, so that what the command starts (a
            // provider call, a `sleep &`) is killed with it.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot run sh -c: {e}"))?;
        // Killed when dropped, on every way out of here (answered, failed,
        // timed out, the run interrupted): nothing the command started
        // outlives its record.
        let group = ProcessGroup::of(child.id());
        let out = match tokio::time::timeout(self.timeout, converse(&mut child, &group, input)).await {
            Err(_) => {
                return Err(format!(
                    "the check command gave no answer within {} (killed)",
                    human(self.timeout)
                ));
            }
            Ok(Err(e)) => return Err(format!("the check command failed to run: {e}")),
            Ok(Ok(out)) => out,
        };
        let stderr = tail(&String::from_utf8_lossy(&out.stderr));
        let said = |what: String| {
            if stderr.is_empty() {
                what
            } else {
                format!("{what}; stderr: {stderr}")
            }
        };
        if !out.status.success() {
            return Err(said(format!("the check command exited with {}", out.status)));
        }
        let stdout = std::str::from_utf8(&out.stdout)
            .map_err(|_| said("the check command's output is not UTF-8".to_owned()))?;
        parse_answer(stdout).map_err(said)
    }
}

/// Feeds the record to the command, waits for it to exit, then kills what
/// it left running in its group and reads its output to the end.
///
/// A command that printed its answer and exited is answered, even if a
/// child it started in the background still holds its stdout: that child is
/// killed, which closes the pipes. Only a process that left the group (with
/// `setsid`, say) can keep them open, until the timeout.
async fn converse(
    child: &mut tokio::process::Child,
    group: &ProcessGroup,
    input: Vec<u8>,
) -> std::io::Result<std::process::Output> {
    let (stdin, stdout, stderr) = (child.stdin.take(), child.stdout.take(), child.stderr.take());
    // Fed while the output is read, so a large record never blocks on a
    // command that prints before it reads; a command that does not read its
    // stdin is fine (the write error is ignored).
    let feed = async move {
        if let Some(mut stdin) = stdin {
            let _ = stdin.write_all(&input).await;
            let _ = stdin.write_all(b"\n").await;
        }
    };
    let exit = async {
        let status = child.wait().await;
        group.kill();
        status
    };
    let ((), status, stdout, stderr) = tokio::join!(feed, exit, read_all(stdout), read_all(stderr));
    Ok(std::process::Output {
        status: status?,
        stdout: stdout?,
        stderr: stderr?,
    })
}

async fn read_all(pipe: Option<impl tokio::io::AsyncRead + Unpin>) -> std::io::Result<Vec<u8>> {
    let mut all = Vec::new();
    if let Some(mut pipe) = pipe {
        pipe.read_to_end(&mut all).await?;
    }
    Ok(all)
}

/// The check command's process group (the command is its leader), killed
/// with SIGKILL when dropped.
#[derive(Debug)]
struct ProcessGroup(Option<Pid>);

impl ProcessGroup {
    fn of(leader: Option<u32>) -> Self {
        // Never 1: `kill(-1)` would signal every process we may signal.
        ProcessGroup(
            leader
                .and_then(|p| i32::try_from(p).ok())
                .filter(|&p| p > 1)
                .and_then(Pid::from_raw),
        )
    }

    /// Kills every process left in the group. After the leader is reaped
    /// its id stays the group's while any member lives, and pids are handed
    /// out in a cycle, so the id cannot name another group in the moment
    /// between the reap and this. A group already gone is not an error.
    fn kill(&self) {
        if let Some(pgid) = self.0 {
            let _ = kill_process_group(pgid, Signal::KILL);
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Reconciler for CheckCommand {
    async fn check(&self, record: &Record, doubt: Doubt) -> std::result::Result<Verdict, BoxError> {
        match self.ask(record, doubt).await {
            Ok(Answered { verdict, outcome }) => {
                self.note(
                    record,
                    Answer {
                        verdict: match verdict {
                            Verdict::Done(_) => "done",
                            Verdict::NotDone => "not-done",
                            Verdict::Unknown => "unknown",
                        },
                        outcome,
                    },
                );
                Ok(verdict)
            }
            Err(e) => {
                self.note(
                    record,
                    Answer {
                        verdict: "error",
                        outcome: None,
                    },
                );
                Err(e.into())
            }
        }
    }
}

/// A parsed answer: the verdict, and the JSON of a `done`.
#[derive(Debug, Clone, PartialEq)]
pub struct Answered {
    /// What to do with the record.
    pub verdict: Verdict,
    /// The JSON the command answered `done` with.
    pub outcome: Option<serde_json::Value>,
}

/// Reads the check command's stdout: exactly one non-empty line, `done
/// <JSON>`, `not-done` or `unknown` (surrounding whitespace ignored).
/// `done`'s JSON is stored as [`Outcome::value`] stores a handler's value.
pub fn parse_answer(stdout: &str) -> std::result::Result<Answered, String> {
    let mut lines = stdout.lines().map(str::trim).filter(|l| !l.is_empty());
    let line = match (lines.next(), lines.next()) {
        (Some(line), None) => line,
        (None, _) => {
            return Err(
                "the check command printed nothing (expected one line: done <JSON>, not-done or unknown)"
                    .to_owned(),
            );
        }
        (Some(_), Some(_)) => {
            return Err(format!(
                "the check command printed several lines (expected one: done <JSON>, not-done or \
                 unknown; log to stderr): {}",
                quote(stdout.trim())
            ));
        }
    };
    let (word, rest) = match line.split_once(char::is_whitespace) {
        Some((w, r)) => (w, r.trim()),
        None => (line, ""),
    };
    match (word, rest) {
        ("not-done", "") => Ok(Answered {
            verdict: Verdict::NotDone,
            outcome: None,
        }),
        ("unknown", "") => Ok(Answered {
            verdict: Verdict::Unknown,
            outcome: None,
        }),
        ("done", "") => Err(
            "the check command answered done without the outcome (done <JSON>; done null for a step \
             that returns nothing)"
                .to_owned(),
        ),
        ("done", json) => {
            let value: serde_json::Value = serde_json::from_str(json).map_err(|e| {
                format!(
                    "the check command's done outcome is not JSON ({e}): {}",
                    quote(json)
                )
            })?;
            let outcome = Outcome::value(&value).map_err(|e| format!("the done outcome: {e}"))?;
            Ok(Answered {
                verdict: Verdict::Done(outcome),
                outcome: Some(value),
            })
        }
        _ => Err(format!(
            "the check command answered {} (expected done <JSON>, not-done or unknown)",
            quote(line)
        )),
    }
}

/// What the check command reads on stdin.
#[derive(Debug, Serialize)]
struct CheckInput<'a> {
    key: &'a str,
    tenant: &'a str,
    kind: &'a str,
    subject: &'a str,
    doubt: &'static str,
    fence: u64,
    state: &'static str,
    at_most_once: bool,
    created_at: String,
    lease_expires_at: Option<String>,
    provider_key: String,
}

impl<'a> CheckInput<'a> {
    fn of(r: &'a Record, doubt: Doubt) -> Self {
        CheckInput {
            key: r.key.as_str(),
            tenant: r.key.tenant().as_str(),
            kind: r.key.kind(),
            subject: r.key.subject(),
            doubt: doubt.as_str(),
            fence: r.fence,
            state: r.state.as_str(),
            at_most_once: r.at_most_once,
            created_at: rfc3339(r.created_at),
            lease_expires_at: r.lease_expires_at.map(rfc3339),
            provider_key: r.key.provider_key(),
        }
    }
}

fn human(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

/// The end of a command's stderr, on one line.
fn tail(s: &str) -> String {
    let one = s.split_whitespace().collect::<Vec<_>>().join(" ");
    let n = one.chars().count();
    if n <= STDERR_TAIL {
        one
    } else {
        let cut: String = one.chars().skip(n - STDERR_TAIL).collect();
        format!("…{cut}")
    }
}

/// A command's output, quoted and bounded.
fn quote(s: &str) -> String {
    let short: String = s.chars().take(120).collect();
    if short.len() < s.len() {
        format!("{short:?}…")
    } else {
        format!("{short:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse_strictly() {
        let a = parse_answer("done {\"charge\":\"ch_1\"}\n").unwrap();
        assert_eq!(a.outcome, Some(serde_json::json!({"charge": "ch_1"})));
        let Verdict::Done(o) = a.verdict else { panic!() };
        assert_eq!(o.as_bytes(), br#"{"ok":{"charge":"ch_1"}}"#);
        let a = parse_answer("  done   null  ").unwrap();
        let Verdict::Done(o) = a.verdict else { panic!() };
        assert_eq!(o.as_bytes(), br#"{"ok":null}"#);
        assert_eq!(parse_answer("not-done\n").unwrap().verdict, Verdict::NotDone);
        assert_eq!(parse_answer("\nunknown\n\n").unwrap().verdict, Verdict::Unknown);
        for bad in [
            "",
            "\n \n",
            "done",
            "done {",
            "done 1 2",
            "not-done please",
            "NOT-DONE",
            "not_done",
            "yes",
            "unknown\nnot-done",
            "checking...\ndone 1",
        ] {
            assert!(parse_answer(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_config_that_cannot_run_is_refused() {
        let t = Tenant::new("acme").ok();
        assert!(ReconcileConfig::new(t.clone(), "true").validate().is_ok());
        assert!(ReconcileConfig::new(t.clone(), "  ").validate().is_err());
        for rate in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let c = ReconcileConfig {
                rate: Some(rate),
                ..ReconcileConfig::new(t.clone(), "true")
            };
            assert!(matches!(c.validate(), Err(Error::InvalidInput(_))), "{rate}");
        }
        let c = ReconcileConfig {
            check_timeout: Duration::ZERO,
            ..ReconcileConfig::new(t, "true")
        };
        assert!(c.validate().is_err());
    }

    #[test]
    fn stderr_is_quoted_by_its_end() {
        assert_eq!(tail("a\n b \n"), "a b");
        let long = "x".repeat(1000) + "END";
        let t = tail(&long);
        assert!(t.ends_with("END") && t.chars().count() == STDERR_TAIL + 1, "{t}");
    }
}

//! `oncely reconcile`, run as the built binary against SQLite and
//! PostgreSQL: doubtful records seeded through the library in a tenant of
//! the test's own, a check script written into a temporary directory that
//! answers per key, and the ledger read back afterwards.

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use oncely::backend::{Claim, Ledger, Outcome, Record, RecordState};
use oncely::{ClaimOptions, EffectKey, Tenant};
use oncely_cli::AnyLedger;
use serde_json::Value;

mod common;
use common::{acquired, oncely, reachable, runtime, stderr, stdout};

/// The records a test starts from, in a fresh tenant.
struct Seeded {
    tenant: Tenant,
    /// capture:o-1, a stuck lease; the script answers `done {"charge":"ch_1"}`.
    done: EffectKey,
    /// receipt:o-2, an abandoned step; the script answers `not-done`.
    not_done: EffectKey,
    /// receipt:o-3, an abandoned step; the script answers `unknown`.
    unknown: EffectKey,
    /// capture:o-4, a stuck lease; the script exits 3.
    fails: EffectKey,
    /// receipt:o-5, an abandoned step; the script hangs past the timeout.
    hangs: EffectKey,
    /// receipt:o-6 with shell syntax in its subject; the script prints
    /// something that is no answer.
    garbage: EffectKey,
    /// capture:o-7, a live lease (ten minutes): never asked about.
    live: EffectKey,
    /// capture:o-8, completed: never asked about.
    completed: EffectKey,
}

impl Seeded {
    fn doubtful(&self) -> [&EffectKey; 6] {
        [
            &self.done,
            &self.not_done,
            &self.unknown,
            &self.fails,
            &self.hangs,
            &self.garbage,
        ]
    }

    fn all(&self) -> Vec<&EffectKey> {
        let mut all = self.doubtful().to_vec();
        all.extend([&self.live, &self.completed]);
        all
    }
}

fn seed(url: &str) -> Seeded {
    let tenant = oncely::conformance::fresh_tenant();
    let k = |kind: &str, subject: &str| EffectKey::new(&tenant, kind, subject).unwrap();
    let s = Seeded {
        done: k("capture", "o-1"),
        not_done: k("receipt", "o-2"),
        unknown: k("receipt", "o-3"),
        fails: k("capture", "o-4"),
        hangs: k("receipt", "o-5"),
        garbage: k("receipt", "o-6;$(touch${IFS}pwned)`touch${IFS}pwned`"),
        live: k("capture", "o-7"),
        completed: k("capture", "o-8"),
        tenant: tenant.clone(),
    };
    runtime().block_on(async {
        let l = AnyLedger::connect(url).await.unwrap();
        let short = ClaimOptions::default().lease(Duration::from_millis(200));
        let amo = short.clone().at_most_once(true);
        for key in [&s.done, &s.fails] {
            acquired(l.claim(key, &short).await.unwrap());
        }
        for key in [&s.not_done, &s.unknown, &s.hangs, &s.garbage] {
            acquired(l.claim(key, &amo).await.unwrap());
        }
        acquired(
            l.claim(&s.live, &ClaimOptions::default().lease(Duration::from_secs(600)))
                .await
                .unwrap(),
        );
        let lease = acquired(l.claim(&s.completed, &ClaimOptions::default()).await.unwrap());
        l.complete(&lease, &Outcome::value(&"ch_8").unwrap())
            .await
            .unwrap();
        // Wait on the database's clock, not on ours: every short lease ended.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut ended = true;
            for key in s.doubtful() {
                let r = l.get(key).await.unwrap().unwrap();
                ended &= r.lease_expires_at.is_some_and(|at| at <= r.read_at);
            }
            if ended {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the leases never ended on the database's clock"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        l.close().await;
    });
    s
}

fn record(url: &str, key: &EffectKey) -> Record {
    runtime().block_on(async {
        let l = AnyLedger::open(url, oncely::open::Access::ReadOnly)
            .await
            .unwrap();
        let r = l.get(key).await.unwrap();
        l.close().await;
        r.unwrap_or_else(|| panic!("no record for {key}"))
    })
}

/// What a write can change in a record: state, fence, outcome, lease end.
type Written = (RecordState, u64, Option<Vec<u8>>, Option<std::time::SystemTime>);

/// What can change in each seeded record.
fn snapshot(url: &str, s: &Seeded) -> Vec<Written> {
    s.all()
        .into_iter()
        .map(|k| {
            let r = record(url, k);
            (
                r.state,
                r.fence,
                r.outcome.map(|o| o.as_bytes().to_vec()),
                r.lease_expires_at,
            )
        })
        .collect()
}

/// The check script: answers by key, and logs what it read on stdin (one
/// JSON line per call) and its environment.
fn write_script(dir: &Path, s: &Seeded) -> String {
    let path = dir.join("check.sh");
    let log = dir.join("calls.log");
    let script = format!(
        r#"#!/bin/sh
input=$(cat)
printf '%s\n' "$input" >> '{log}'
printf '%s %s\n' "$ONCELY_DOUBT" "$ONCELY_KEY" >> '{log}.env'
case "$ONCELY_KEY" in
  '{done}') echo 'done {{"charge":"ch_1"}}' ;;
  '{not_done}') echo not-done ;;
  '{unknown}') echo unknown ;;
  '{fails}') echo 'provider says 503' >&2; exit 3 ;;
  '{hangs}') exec sleep 30 ;;
  '{garbage}') echo 'maybe?' ;;
  *) echo "asked about $ONCELY_KEY" >&2; exit 9 ;;
esac
"#,
        log = log.display(),
        done = s.done,
        not_done = s.not_done,
        unknown = s.unknown,
        fails = s.fails,
        hangs = s.hangs,
        garbage = s.garbage,
    );
    std::fs::write(&path, script).unwrap();
    format!("sh '{}'", path.display())
}

/// The JSON lines the script read, one per call.
fn calls(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("calls.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn run(args: &[&str], url: &str) -> Output {
    let mut all = vec!["reconcile"];
    all.extend_from_slice(args);
    all.extend(["--database-url", url]);
    oncely(&all)
}

fn report(out: &Output) -> Value {
    serde_json::from_str(&stdout(out)).unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(out), stderr(out)))
}

fn entry<'a>(report: &'a Value, key: &EffectKey) -> &'a Value {
    report["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["key"] == key.as_str())
        .unwrap_or_else(|| panic!("{key} not in {report}"))
}

fn counts(report: &Value) -> [u64; 7] {
    [
        "examined",
        "completed",
        "released",
        "unknown",
        "moved",
        "skipped",
        "errors",
    ]
    .map(|k| report[k].as_u64().unwrap_or_else(|| panic!("{k} in {report}")))
}

/// The whole command on one database.
fn reconcile_on(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let s = seed(url);
    let t = s.tenant.as_str();
    let check = write_script(dir.path(), &s);
    let before = snapshot(url, &s);
    let fences: Vec<u64> = s.doubtful().iter().map(|k| record(url, k).fence).collect();

    // Bad input: exit 2, the script never runs, nothing changes.
    for (args, needle) in [
        (vec!["--tenant", t], "--check <CMD>"),
        (vec!["--check", &check], "--tenant <TENANT>|--all-tenants"),
        (vec!["--tenant", t, "--check", &check, "--rate", "0"], "--rate"),
        (
            vec!["--tenant", t, "--check", &check, "--grace", "soon"],
            "not a duration",
        ),
        (
            vec!["--tenant", t, "--check", &check, "--check-timeout", "0s"],
            "--check-timeout",
        ),
        (vec!["--tenant", t, "--check", " "], "--check needs a command"),
        (vec!["--tenant", "a/b", "--check", &check], "invalid effect key"),
    ] {
        let out = run(&args, url);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains(needle),
            "{args:?}: wanted {needle:?} in {}",
            stderr(&out)
        );
        assert!(stdout(&out).is_empty(), "{args:?}: {}", stdout(&out));
    }
    for (bad, needle) in [
        ("mongodb://localhost/x", "unknown database URL scheme 'mongodb'"),
        ("redis://127.0.0.1:1", "not available on the redis backend"),
        ("nats://127.0.0.1:1", "not available on the nats backend"),
    ] {
        let out = run(&["--tenant", t, "--check", &check], bad);
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", stderr(&out));
        assert!(stderr(&out).contains(needle), "{bad}: {}", stderr(&out));
    }
    assert!(calls(dir.path()).is_empty(), "bad input ran the check");
    assert_eq!(snapshot(url, &s), before, "bad input changed the ledger");

    // A grace longer than the leases have been over: nothing asked, exit 0.
    let out = run(
        &["--tenant", t, "--check", &check, "--grace", "1h", "--json"],
        url,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let r = report(&out);
    assert_eq!(counts(&r), [6, 0, 0, 0, 0, 6, 0], "{r}");
    assert!(
        calls(dir.path()).is_empty(),
        "a record within the grace was asked about"
    );
    assert_eq!(snapshot(url, &s), before);

    // A dry run asks about every doubtful record, writes nothing, and
    // exits 1 because three records failed.
    let out = run(
        &[
            "--tenant",
            t,
            "--check",
            &check,
            "--check-timeout",
            "1s",
            "--dry-run",
        ],
        url,
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let text = stdout(&out);
    let mut lines = text.lines();
    assert!(lines.next().unwrap().starts_with("ledger: "), "{text}");
    assert!(lines.next().unwrap().starts_with("key"), "{text}");
    assert!(
        text.contains("examined 6: completed 1, released 1, unknown 1, moved 0, skipped 0, errors 3 (dry run: nothing written)"),
        "{text}"
    );
    let row = text.lines().find(|l| l.starts_with(s.done.as_str())).unwrap();
    for word in ["stuck", "done", "completed", r#"{"charge":"ch_1"}"#] {
        assert!(row.contains(word), "{word:?} in {row}");
    }
    assert!(
        stderr(&out).contains("3 records could not be settled"),
        "{}",
        stderr(&out)
    );
    assert_eq!(calls(dir.path()).len(), 6);
    assert_eq!(snapshot(url, &s), before, "a dry run wrote");

    // The real run.
    let out = run(
        &[
            "--tenant",
            t,
            "--check",
            &check,
            "--check-timeout",
            "1s",
            "--json",
        ],
        url,
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let r = report(&out);
    assert_eq!(counts(&r), [6, 1, 1, 1, 0, 0, 3], "{r}");
    assert_eq!(r["dry_run"], false);
    assert_eq!(r["aborted"], Value::Null);
    // Stuck leases first, then abandoned steps, each oldest first.
    let order: Vec<&str> = r["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["key"].as_str().unwrap())
        .collect();
    let expected: Vec<&str> = [&s.done, &s.fails, &s.not_done, &s.unknown, &s.hangs, &s.garbage]
        .iter()
        .map(|k| k.as_str())
        .collect();
    assert_eq!(order, expected, "{r}");
    let e = entry(&r, &s.done);
    assert_eq!(
        (&e["doubt"], &e["verdict"], &e["result"]),
        (&"stuck".into(), &"done".into(), &"completed".into()),
        "{e}"
    );
    assert_eq!(e["outcome"], serde_json::json!({"charge": "ch_1"}), "{e}");
    let e = entry(&r, &s.not_done);
    assert_eq!(
        (&e["doubt"], &e["verdict"], &e["result"]),
        (&"abandoned".into(), &"not-done".into(), &"released".into()),
        "{e}"
    );
    let e = entry(&r, &s.unknown);
    assert_eq!(
        (&e["verdict"], &e["result"]),
        (&"unknown".into(), &"unknown".into()),
        "{e}"
    );
    for (key, needle) in [
        (&s.fails, "exited with exit status: 3; stderr: provider says 503"),
        (&s.hangs, "no answer within 1 s"),
        (&s.garbage, r#"answered "maybe?""#),
    ] {
        let e = entry(&r, key);
        assert_eq!(
            (&e["verdict"], &e["result"]),
            (&"error".into(), &"error".into()),
            "{e}"
        );
        assert!(e["error"].as_str().unwrap().contains(needle), "{needle:?} in {e}");
    }

    // What the script read: one JSON object per record, with the record.
    let seen = calls(dir.path());
    assert_eq!(seen.len(), 12, "six in the dry run, six now");
    for c in &seen[6..] {
        let key = EffectKey::parse(c["key"].as_str().unwrap()).unwrap();
        let i = s.doubtful().iter().position(|k| **k == key).unwrap();
        assert_eq!(c["tenant"], t, "{c}");
        assert_eq!(c["kind"], key.kind(), "{c}");
        assert_eq!(c["subject"], key.subject(), "{c}");
        assert_eq!(c["fence"], fences[i], "{c}");
        assert_eq!(c["provider_key"], key.provider_key(), "{c}");
        assert!(c["created_at"].as_str().unwrap().ends_with('Z'), "{c}");
        assert!(c["lease_expires_at"].as_str().unwrap().ends_with('Z'), "{c}");
        let (doubt, amo, state) = if key.kind() == "capture" {
            ("stuck", false, "in_progress")
        } else {
            ("abandoned", true, "abandoned")
        };
        assert_eq!(
            (&c["doubt"], &c["at_most_once"], &c["state"]),
            (&doubt.into(), &amo.into(), &state.into()),
            "{c}"
        );
    }
    let env = std::fs::read_to_string(dir.path().join("calls.log.env")).unwrap();
    assert!(env.lines().any(|l| l == format!("stuck {}", s.done)), "{env}");
    assert!(
        env.lines().any(|l| l == format!("abandoned {}", s.garbage)),
        "{env}"
    );
    // The subject's shell syntax stayed data.
    assert!(!dir.path().join("pwned").exists() && !Path::new("pwned").exists());

    // The ledger afterwards.
    let done = record(url, &s.done);
    assert_eq!(done.state, RecordState::Completed);
    assert!(
        done.fence > fences[0],
        "a stuck lease is taken over before it is written"
    );
    assert_eq!(
        done.outcome.as_ref().unwrap().as_bytes(),
        br#"{"ok":{"charge":"ch_1"}}"#,
        "stored as a runner stores a value"
    );
    let released = record(url, &s.not_done);
    assert_eq!(
        (released.state, released.fence),
        (RecordState::Released, fences[1])
    );
    let after = snapshot(url, &s);
    for (i, key) in s.all().iter().enumerate() {
        if *key != &s.done && *key != &s.not_done {
            assert_eq!(after[i], before[i], "{key} was touched");
        }
    }
    // A duplicate of the completed capture replays the provider's answer;
    // the released receipt runs again.
    runtime().block_on(async {
        let l = AnyLedger::connect(url).await.unwrap();
        match l.claim(&s.done, &ClaimOptions::default()).await.unwrap() {
            Claim::Completed(r) => assert_eq!(r.outcome.unwrap().as_bytes(), br#"{"ok":{"charge":"ch_1"}}"#),
            other => panic!("{other:?}"),
        }
        let lease = acquired(
            l.claim(&s.not_done, &ClaimOptions::default().at_most_once(true))
                .await
                .unwrap(),
        );
        assert!(lease.fence() > fences[1]);
        l.release(&lease).await.unwrap();
        l.close().await;
    });

    // The unknown and failed records are still listed; --max bounds a run
    // and a check that answers unknown for everything exits 0.
    let out = run(
        &[
            "--tenant",
            t,
            "--check",
            "cat >/dev/null; echo unknown",
            "--max",
            "3",
            "--json",
        ],
        url,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let r = report(&out);
    assert_eq!(counts(&r), [3, 0, 0, 3, 0, 0, 0], "{r}");
    let out = run(
        &[
            "--tenant",
            t,
            "--check",
            "echo unknown",
            "--json",
            "--rate",
            "1000",
        ],
        url,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let r = report(&out);
    let left: Vec<&str> = r["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["key"].as_str().unwrap())
        .collect();
    let expected: Vec<&str> = [&s.fails, &s.unknown, &s.hangs, &s.garbage]
        .iter()
        .map(|k| k.as_str())
        .collect();
    assert_eq!(left, expected, "{r}");
    assert_eq!(snapshot(url, &s)[2..], after[2..]);
}

fn sqlite_url(dir: &Path) -> String {
    format!("sqlite://{}?mode=rwc", dir.join("ledger.db").display())
}

#[test]
fn reconcile_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    reconcile_on(&url);
}

#[test]
fn reconcile_on_postgres() {
    let Some(url) = reachable(
        "ONCELY_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
        "PostgreSQL",
    ) else {
        return;
    };
    reconcile_on(&url);
}

/// On a file of its own, --all-tenants covers every tenant's doubtful
/// records, and --tenant only its own.
#[test]
fn all_tenants_covers_every_tenant_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let (a, b) = (seed(&url), seed(&url));
    let before = (snapshot(&url, &a), snapshot(&url, &b));
    let out = run(&["--all-tenants", "--check", "echo unknown", "--json"], &url);
    assert!(out.status.success(), "{}", stderr(&out));
    let r = report(&out);
    assert_eq!(counts(&r), [12, 0, 0, 12, 0, 0, 0], "{r}");
    for key in a.doubtful().into_iter().chain(b.doubtful()) {
        assert_eq!(entry(&r, key)["verdict"], "unknown");
    }
    let out = run(
        &[
            "--tenant",
            b.tenant.as_str(),
            "--check",
            "echo not-done",
            "--json",
        ],
        &url,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let r = report(&out);
    assert_eq!(counts(&r), [6, 0, 6, 0, 0, 0, 0], "{r}");
    assert_eq!(
        snapshot(&url, &a),
        before.0,
        "another tenant's records were touched"
    );
    assert_ne!(snapshot(&url, &b), before.1);
    for key in b.doubtful() {
        assert_eq!(record(&url, key).state, RecordState::Released, "{key}");
    }
}

/// A check script that starts `sleep 30` in the background, writes its pid
/// to `pids`, then does `body`.
fn background_script(dir: &Path, body: &str) -> (String, std::path::PathBuf) {
    let path = dir.join("check.sh");
    let pids = dir.join("pids");
    let script = format!(
        "#!/bin/sh\ncat >/dev/null\nsleep 30 &\necho $! >> '{pids}'\n{body}\n",
        pids = pids.display()
    );
    std::fs::write(&path, script).unwrap();
    (format!("sh '{}'", path.display()), pids)
}

/// The pids a background script wrote.
fn pids(file: &Path) -> Vec<u32> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .map(|l| l.trim().parse().unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect()
}

/// Whether `pid` runs (a zombie does not: it is dead, waiting for its
/// parent, here whatever adopted it, to reap it).
fn alive(pid: u32) -> bool {
    let out = std::process::Command::new("ps")
        .args(["-o", "stat=", "-p", &pid.to_string()])
        .output()
        .unwrap();
    let stat = String::from_utf8_lossy(&out.stdout);
    !stat.trim().is_empty() && !stat.trim().starts_with('Z')
}

/// Every pid is dead, soon: SIGKILL is delivered, not waited for, so the
/// processes may take a moment to go (well before `sleep 30` would end).
fn all_dead(pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) {
        assert!(
            Instant::now() < deadline,
            "still running after reconcile returned: {:?}",
            pids.iter().filter(|&&p| alive(p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A check that answers at once and exits, leaving a background child
/// that holds its stdout, is answered (not timed out), and the child is
/// killed.
#[test]
fn a_prompt_answer_counts_and_what_the_check_left_running_is_killed_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let s = seed(&url);
    let (check, pid_file) = background_script(
        dir.path(),
        "case \"$ONCELY_KEY\" in\n  */capture:*) echo 'done 1' ;;\n  *) echo not-done ;;\nesac",
    );
    // Stuck leases first: o-1 and o-4 (captures, done), then o-2 (not-done).
    let out = run(
        &[
            "--tenant",
            s.tenant.as_str(),
            "--check",
            &check,
            "--check-timeout",
            "5s",
            "--max",
            "3",
            "--json",
        ],
        &url,
    );
    let r = report(&out);
    assert_eq!(counts(&r), [3, 2, 1, 0, 0, 0, 0], "{r}");
    assert!(out.status.success(), "{}", stderr(&out));
    for (key, state) in [
        (&s.done, RecordState::Completed),
        (&s.fails, RecordState::Completed),
        (&s.not_done, RecordState::Released),
    ] {
        assert_eq!(entry(&r, key)["error"], Value::Null, "{r}");
        assert_eq!(record(&url, key).state, state, "{key}");
    }
    assert_eq!(record(&url, &s.done).outcome.unwrap().as_bytes(), br#"{"ok":1}"#);
    let left = pids(&pid_file);
    assert_eq!(left.len(), 3, "one background child per record");
    all_dead(&left);
}

/// A check still waiting on its child at the timeout is killed with that
/// child: nothing it started goes on after reconcile returned.
#[test]
fn a_check_past_its_timeout_is_killed_with_its_children_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let s = seed(&url);
    let before = snapshot(&url, &s);
    let (check, pid_file) = background_script(dir.path(), "wait\necho not-done");
    let out = run(
        &[
            "--tenant",
            s.tenant.as_str(),
            "--check",
            &check,
            "--check-timeout",
            "1s",
            "--max",
            "1",
            "--json",
        ],
        &url,
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let r = report(&out);
    assert_eq!(counts(&r), [1, 0, 0, 0, 0, 0, 1], "{r}");
    let e = entry(&r, &s.done);
    assert!(
        e["error"].as_str().unwrap().contains("no answer within 1 s"),
        "{e}"
    );
    assert_eq!(snapshot(&url, &s), before);
    let left = pids(&pid_file);
    assert_eq!(left.len(), 1);
    all_dead(&left);
}

/// Ctrl-C (SIGINT) stops a run and kills the check being asked with its
/// children (in a group of their own, the terminal's Ctrl-C no longer
/// reaches them).
#[test]
fn an_interrupted_run_kills_the_check_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let s = seed(&url);
    let (check, pid_file) = background_script(dir.path(), "wait\necho not-done");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_oncely"))
        .args([
            "reconcile",
            "--tenant",
            s.tenant.as_str(),
            "--check",
            &check,
            "--check-timeout",
            "5m",
            "--database-url",
            &url,
        ])
        .env_remove("ONCELY_DATABASE_URL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while pids(&pid_file).is_empty() {
        assert!(Instant::now() < deadline, "the check never ran");
        std::thread::sleep(Duration::from_millis(50));
    }
    let sent = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    assert!(stderr(&out).contains("interrupted"), "{}", stderr(&out));
    all_dead(&pids(&pid_file));
}

/// Listed in --help, with the protocol in the command's long help.
#[test]
fn help_documents_the_protocol() {
    let out = oncely(&["--help"]);
    assert!(stdout(&out).contains("reconcile"), "{}", stdout(&out));
    let out = oncely(&["reconcile", "--help"]);
    assert!(out.status.success());
    for needle in [
        "done <JSON>",
        "not-done",
        "unknown",
        "ONCELY_KEY",
        "ONCELY_DOUBT",
        "stdin",
        "--check-timeout",
        "--dry-run",
        "postgres://",
    ] {
        assert!(stdout(&out).contains(needle), "{needle:?} in {}", stdout(&out));
    }
}

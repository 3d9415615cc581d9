//! The operator commands (`inspect`, `history`, `stats`, `stuck`,
//! `abandoned`, `resolve`, `forget`, `prune --dry-run`), run as the built
//! `oncely` binary against SQLite, PostgreSQL and MySQL/MariaDB, on records
//! seeded through the library in a tenant of the test's own.

use std::path::Path;
use std::time::Duration;

use oncely::backend::{Fingerprint, Ledger, Outcome};
use oncely::{ClaimOptions, EffectKey, Tenant};
use oncely_cli::AnyLedger;
use serde_json::Value;

mod common;
use common::{acquired, oncely, oncely_with, reachable, runtime, stderr, stdout};

/// Runs a command that must succeed and print JSON.
fn json(args: &[&str], url: &str) -> Value {
    let mut all = args.to_vec();
    all.extend(["--database-url", url]);
    let out = oncely(&all);
    assert!(
        out.status.success(),
        "{args:?}: {}\n{}",
        stderr(&out),
        stdout(&out)
    );
    serde_json::from_str(&stdout(&out)).unwrap_or_else(|e| panic!("{args:?}: {e}: {}", stdout(&out)))
}

/// Runs a command that must fail with `code`, printing `needle` on stderr
/// and nothing on stdout.
fn refused(args: &[&str], url: &str, code: i32, needle: &str) {
    let mut all = args.to_vec();
    all.extend(["--database-url", url]);
    let out = oncely(&all);
    assert_eq!(out.status.code(), Some(code), "{args:?}: {}", stderr(&out));
    assert!(
        stderr(&out).contains(needle),
        "{args:?}: wanted {needle:?} in {}",
        stderr(&out)
    );
    assert!(
        stdout(&out).trim().is_empty() || stdout(&out).trim() == "null",
        "{args:?}: {}",
        stdout(&out)
    );
}

/// The records every test starts from, in a fresh tenant.
struct Seeded {
    tenant: Tenant,
    /// capture:o-1, completed once, with a fingerprint.
    done: EffectKey,
    /// capture:o-2, a lease that ended (not at-most-once).
    stuck: EffectKey,
    /// receipt:o-1, an at-most-once step whose lease ended.
    abandoned: EffectKey,
    /// capture:o-3, a live lease (ten minutes).
    live: EffectKey,
    /// capture:o-4, taken over once, then completed.
    retried: EffectKey,
}

fn seed(url: &str) -> Seeded {
    let tenant = oncely::conformance::fresh_tenant();
    let k = |kind: &str, subject: &str| EffectKey::new(&tenant, kind, subject).unwrap();
    let s = Seeded {
        done: k("capture", "o-1"),
        stuck: k("capture", "o-2"),
        abandoned: k("receipt", "o-1"),
        live: k("capture", "o-3"),
        retried: k("capture", "o-4"),
        tenant: tenant.clone(),
    };
    runtime().block_on(async {
        let l = AnyLedger::connect(url).await.unwrap();
        let short = ClaimOptions::default().lease(Duration::from_millis(300));
        let fp = Fingerprint::of_json(&serde_json::json!({"amount": 10})).unwrap();
        let lease = acquired(
            l.claim(&s.done, &ClaimOptions::default().fingerprint(fp))
                .await
                .unwrap(),
        );
        l.complete(&lease, &Outcome::value(&"ch_1").unwrap())
            .await
            .unwrap();
        acquired(l.claim(&s.stuck, &short).await.unwrap());
        acquired(
            l.claim(&s.abandoned, &short.clone().at_most_once(true))
                .await
                .unwrap(),
        );
        acquired(l.claim(&s.retried, &short).await.unwrap());
        tokio::time::sleep(Duration::from_millis(900)).await;
        let again = acquired(l.claim(&s.retried, &ClaimOptions::default()).await.unwrap());
        assert!(again.taken_over());
        l.complete(&again, &Outcome::value(&"ch_4").unwrap())
            .await
            .unwrap();
        acquired(
            l.claim(&s.live, &ClaimOptions::default().lease(Duration::from_secs(600)))
                .await
                .unwrap(),
        );
        l.close().await;
    });
    s
}

/// What the library says the URL's ledger is (what every command names).
fn described(url: &str) -> String {
    runtime().block_on(async {
        let l = AnyLedger::open(url, oncely::open::Access::ReadOnly)
            .await
            .unwrap();
        l.close().await;
        l.to_string()
    })
}

/// What a record is now, through the library.
fn record(url: &str, key: &EffectKey) -> Option<oncely::backend::Record> {
    runtime().block_on(async {
        let l = AnyLedger::open(url, oncely::open::Access::ReadOnly)
            .await
            .unwrap();
        let r = l.get(key).await.unwrap();
        l.close().await;
        r
    })
}

/// Every operator command on one database.
fn operate_on(url: &str) {
    let s = seed(url);
    let t = s.tenant.as_str();

    // inspect: stored and derived.
    let done = json(&["inspect", s.done.as_str(), "--json"], url);
    assert_eq!(done["class"], "completed", "{done}");
    assert_eq!(done["claims"]["grants"], "1", "{done}");
    assert_eq!(done["claims"]["claimed_again"], false, "{done}");
    assert_eq!(done["fingerprint_present"], true, "{done}");
    assert_eq!(done["outcome_bytes"], br#"{"ok":"ch_1"}"#.len(), "{done}");
    assert_eq!(done["outcome"]["ok"], "ch_1", "{done}");
    let retried = json(&["inspect", s.retried.as_str(), "--json"], url);
    assert_eq!(retried["claims"]["grants"], "2 or more", "{retried}");
    assert_eq!(retried["claims"]["claimed_again"], true, "{retried}");
    assert!(retried["claims"]["latest_grant_at"].is_string(), "{retried}");
    let stuck = json(&["inspect", s.stuck.as_str(), "--json"], url);
    assert_eq!(stuck["class"], "stuck", "{stuck}");
    assert_eq!(stuck["state"], "in_progress", "{stuck}");
    assert!(stuck["lease_left_seconds"].as_f64().unwrap() < 0.0, "{stuck}");
    assert_eq!(stuck["fingerprint_present"], false, "{stuck}");
    let live = json(&["inspect", s.live.as_str(), "--json"], url);
    assert_eq!(live["class"], "live", "{live}");
    assert!(live["lease_left_seconds"].as_f64().unwrap() > 0.0, "{live}");
    let out = oncely(&["inspect", s.stuck.as_str(), "--database-url", url]);
    assert!(out.status.success(), "{}", stderr(&out));
    for line in [
        "state         stuck (stored in_progress)",
        "granted       1 (derived from the fence)",
    ] {
        assert!(stdout(&out).contains(line), "{line:?} in {}", stdout(&out));
    }
    let absent = format!("{t}/capture:o-none");
    let out = oncely(&["inspect", &absent, "--json", "--database-url", url]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "null");

    // stats: one tenant, counted per kind on the database's clock.
    let stats = json(&["stats", "--tenant", t, "--json"], url);
    let kinds = stats["kinds"].as_array().unwrap();
    assert_eq!(kinds.len(), 2, "{stats}");
    let (capture, receipt) = (&kinds[0], &kinds[1]);
    assert_eq!(capture["kind"], "capture");
    assert_eq!(
        [
            &capture["live"],
            &capture["stuck"],
            &capture["abandoned"],
            &capture["completed"],
            &capture["released"]
        ],
        [1, 1, 0, 2, 0],
        "{capture}"
    );
    assert_eq!(capture["oldest_stuck"], stuck["created_at"], "{capture}");
    assert_eq!(receipt["kind"], "receipt");
    assert_eq!([&receipt["abandoned"], &receipt["total"]], [1, 1], "{receipt}");
    assert!(
        stats["note"]
            .as_str()
            .unwrap()
            .contains("oncely_duplicates_suppressed_total"),
        "{stats}"
    );
    let out = oncely(&["stats", "--tenant", t, "--database-url", url]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some(format!("ledger: {}", described(url)).as_str()),
        "{text}"
    );
    assert!(lines.next().unwrap().starts_with("tenant"), "{text}");
    assert_eq!(stats["ledger"], described(url), "{stats}");
    assert!(
        text.contains("note: duplicates suppressed are not stored"),
        "{text}"
    );
    let all = json(&["stats", "--all-tenants", "--json"], url);
    let all = all["kinds"].as_array().unwrap();
    assert!(
        all.iter()
            .any(|k| k["tenant"] == t && k["kind"] == "capture" && k["stuck"] == 1),
        "{} kinds, not {t}'s",
        all.len()
    );

    // stuck and abandoned listings.
    let listed = json(&["stuck", "--tenant", t, "--json"], url);
    let keys: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, [s.stuck.as_str()]);
    // Across tenants (other tests' records too): from this test's start.
    let since = stuck["created_at"].as_str().unwrap();
    let across = json(
        &[
            "stuck",
            "--all-tenants",
            "--kind",
            "capture",
            "--since",
            since,
            "--limit",
            "1000",
            "--json",
        ],
        url,
    );
    let across = across.as_array().unwrap();
    assert!(
        across.iter().any(|r| r["key"] == s.stuck.as_str()),
        "{} listed, not {}",
        across.len(),
        s.stuck
    );
    assert!(
        across
            .iter()
            .all(|r| r["class"] == "stuck" && r["kind"] == "capture")
    );
    let listed = json(&["abandoned", "--tenant", t, "--json"], url);
    let keys: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, [s.abandoned.as_str()]);
    let across = json(
        &[
            "abandoned",
            "--all-tenants",
            "--kind",
            "receipt",
            "--since",
            since,
            "--limit",
            "1000",
            "--json",
        ],
        url,
    );
    let across = across.as_array().unwrap();
    assert!(
        across.iter().any(|r| r["key"] == s.abandoned.as_str()),
        "{} listed, not {}",
        across.len(),
        s.abandoned
    );
    assert!(
        across
            .iter()
            .all(|r| r["state"] == "abandoned" && r["kind"] == "receipt")
    );
    let none = json(&["abandoned", "--tenant", t, "--kind", "capture", "--json"], url);
    assert_eq!(none, serde_json::json!([]));

    // history: every record of a subject, and the verdict.
    let h = json(&["history", "--tenant", t, "--subject", "o-1", "--json"], url);
    let keys: Vec<&str> = h["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys.len(), 2, "{h}");
    assert!(
        keys.contains(&s.done.as_str()) && keys.contains(&s.abandoned.as_str()),
        "{h}"
    );
    assert_eq!(h["claimed_more_than_once"], false, "{h}");
    let verdict = h["verdict"].as_str().unwrap();
    assert!(
        verdict.starts_with("no: each of the 2 effects was granted once"),
        "{verdict}"
    );
    assert!(verdict.contains("1 abandoned at-most-once step"), "{verdict}");
    assert_eq!(h["unfinished"], serde_json::json!([]), "{h}");
    // A stuck effect is unfinished, not only "granted once".
    let h = json(&["history", "--tenant", t, "--subject", "o-2", "--json"], url);
    assert_eq!(h["unfinished"], serde_json::json!([s.stuck.as_str()]), "{h}");
    let verdict = h["verdict"].as_str().unwrap();
    assert!(verdict.starts_with("no, and it is unfinished"), "{verdict}");
    assert!(verdict.contains("stuck"), "{verdict}");
    let out = oncely(&[
        "history",
        "--tenant",
        t,
        "--subject",
        "o-2",
        "--database-url",
        url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!("unfinished: {}", s.stuck.as_str())),
        "{}",
        stdout(&out)
    );
    let h = json(
        &[
            "history",
            "--tenant",
            t,
            "--kind",
            "capture",
            "--subject",
            "o-4",
            "--json",
        ],
        url,
    );
    assert_eq!(h["claimed_more_than_once"], true, "{h}");
    assert!(
        h["verdict"]
            .as_str()
            .unwrap()
            .starts_with("possibly: 1 of 1 effect"),
        "{h}"
    );
    let out = oncely(&[
        "history",
        "--tenant",
        t,
        "--subject",
        "o-4",
        "--database-url",
        url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("verdict: possibly"), "{}", stdout(&out));
    let later = json(
        &[
            "history",
            "--tenant",
            t,
            "--since",
            "2999-01-01T00:00:00Z",
            "--json",
        ],
        url,
    );
    assert_eq!(later["records"], serde_json::json!([]), "{later}");
    assert!(
        later["verdict"].as_str().unwrap().starts_with("no record"),
        "{later}"
    );
    let everything = json(
        &["history", "--tenant", t, "--since", "2000-01-01", "--json"],
        url,
    );
    assert_eq!(everything["records"].as_array().unwrap().len(), 5, "{everything}");
    refused(
        &["history", "--tenant", t, "--since", "yesterday"],
        url,
        2,
        "RFC 3339",
    );

    // resolve: refused on a live lease, a completed record, a stale fence,
    // bad JSON and an absent key; nothing changes.
    let live_before = record(url, &s.live).unwrap();
    refused(
        &["resolve", s.live.as_str(), "--released"],
        url,
        1,
        "in progress elsewhere",
    );
    assert_eq!(record(url, &s.live).unwrap().fence, live_before.fence);
    assert_eq!(
        record(url, &s.live).unwrap().state,
        oncely::backend::RecordState::InProgress
    );
    refused(&["resolve", s.done.as_str(), "--released"], url, 2, "use forget");
    let stuck_fence = stuck["fence"].as_u64().unwrap();
    let stale = (stuck_fence - 1).to_string();
    refused(
        &[
            "resolve",
            s.stuck.as_str(),
            "--completed",
            r#"{"charge":"ch_2"}"#,
            "--fence",
            &stale,
        ],
        url,
        1,
        "is no longer held",
    );
    refused(
        &["resolve", s.stuck.as_str(), "--completed", "{not json"],
        url,
        2,
        "as JSON",
    );
    refused(&["resolve", &absent, "--released"], url, 3, "no record");
    let r = record(url, &s.stuck).unwrap();
    assert_eq!(
        (r.fence, r.state),
        (stuck_fence, oncely::backend::RecordState::InProgress)
    );

    // resolve a stuck lease: taken over at a higher fence, then completed.
    let fence = stuck_fence.to_string();
    let done2 = json(
        &[
            "resolve",
            s.stuck.as_str(),
            "--completed",
            r#"{"charge":"ch_2"}"#,
            "--fence",
            &fence,
            "--json",
        ],
        url,
    );
    assert_eq!(done2["was"], "stuck", "{done2}");
    assert_eq!(done2["now"], "completed", "{done2}");
    assert!(done2["new_fence"].as_u64().unwrap() > stuck_fence, "{done2}");
    let r = record(url, &s.stuck).unwrap();
    assert_eq!(r.state, oncely::backend::RecordState::Completed);
    assert_eq!(r.outcome.unwrap().as_bytes(), br#"{"ok":{"charge":"ch_2"}}"#);
    // The audit record says what was done.
    let audit_key = done2["audit_key"].as_str().unwrap();
    assert!(
        audit_key.starts_with(&format!("{t}/oncely-audit:resolve-completed:{stuck_fence}:")),
        "{audit_key}"
    );
    let audit = json(&["get", audit_key], url);
    assert_eq!(audit["state"], "completed", "{audit}");
    assert_eq!(audit["outcome"]["ok"]["action"], "resolve-completed", "{audit}");
    assert_eq!(audit["outcome"]["ok"]["key"], s.stuck.as_str(), "{audit}");
    assert_eq!(audit["outcome"]["ok"]["fence"], stuck_fence, "{audit}");

    // resolve an abandoned step: released at its fence; the next claim runs it.
    let out = oncely(&[
        "resolve",
        s.abandoned.as_str(),
        "--released",
        "--database-url",
        url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("resolve-released: "), "{}", stdout(&out));
    assert!(
        stdout(&out).contains(" was abandoned at fence "),
        "{}",
        stdout(&out)
    );
    let abandoned_fence = record(url, &s.abandoned).unwrap().fence;
    runtime().block_on(async {
        let l = AnyLedger::connect(url).await.unwrap();
        let lease = acquired(
            l.claim(&s.abandoned, &ClaimOptions::default().at_most_once(true))
                .await
                .unwrap(),
        );
        assert!(lease.fence() > abandoned_fence);
        l.complete(&lease, &Outcome::value(&"sent").unwrap())
            .await
            .unwrap();
        l.close().await;
    });

    // forget: refused on a live lease, a stale fence and an absent key.
    refused(&["forget", s.live.as_str()], url, 1, "in progress elsewhere");
    let done_fence = done["fence"].as_u64().unwrap();
    let wrong = (done_fence + 1).to_string();
    refused(
        &["forget", s.done.as_str(), "--fence", &wrong],
        url,
        1,
        "is no longer held",
    );
    refused(&["forget", &absent], url, 3, "no record");
    let r = record(url, &s.done).unwrap();
    assert_eq!(
        (r.state, r.fence),
        (oncely::backend::RecordState::Completed, done_fence)
    );
    assert!(r.outcome.is_some());

    // forget: released without its outcome; the next claim takes it over.
    let f = json(&["forget", s.done.as_str(), "--json"], url);
    assert_eq!(
        (&f["action"], &f["was"], &f["fence"]),
        (&"forget".into(), &"completed".into(), &done_fence.into()),
        "{f}"
    );
    let r = record(url, &s.done).unwrap();
    assert_eq!(
        (r.state, r.fence),
        (oncely::backend::RecordState::Released, done_fence)
    );
    assert!(r.outcome.is_none());
    refused(&["forget", s.done.as_str()], url, 1, "is released, not completed");
    runtime().block_on(async {
        let l = AnyLedger::connect(url).await.unwrap();
        let lease = acquired(l.claim(&s.done, &ClaimOptions::default()).await.unwrap());
        assert!(lease.fence() > done_fence && lease.taken_over());
        l.complete(&lease, &Outcome::value(&"ch_1b").unwrap())
            .await
            .unwrap();
        l.close().await;
    });
    let h = json(
        &[
            "history",
            "--tenant",
            t,
            "--kind",
            "capture",
            "--subject",
            "o-1",
            "--json",
        ],
        url,
    );
    assert_eq!(h["claimed_more_than_once"], true, "{h}");
    let audits = h["audits"].as_array().unwrap();
    assert_eq!(audits.len(), 1, "{h}");
    assert_eq!(audits[0]["entry"]["action"], "forget", "{h}");
    assert_eq!(audits[0]["entry"]["fence"], done_fence, "{h}");

    // The URL from the environment.
    let out = oncely_with(&["stats", "--tenant", t, "--json"], Some(url));
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_str(&stdout(&out)).unwrap();
    // Audit records are records too: capture, oncely-audit, receipt.
    let kinds: Vec<&str> = v["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["capture", "oncely-audit", "receipt"], "{v}");
}

/// `prune --dry-run` counts a record past its retention and deletes
/// nothing (on a database whose other users may prune meanwhile: the
/// count is checked only while the record is still there).
fn dry_run_on(url: &str) {
    let t = oncely::conformance::fresh_tenant();
    let key = EffectKey::new(&t, "capture", "old").unwrap();
    runtime().block_on(async {
        let l = AnyLedger::connect(url).await.unwrap();
        let short = ClaimOptions::default()
            .lease(Duration::from_millis(50))
            .retention(Duration::from_millis(50));
        let lease = acquired(l.claim(&key, &short).await.unwrap());
        l.complete(&lease, &Outcome::value(&1).unwrap()).await.unwrap();
        l.close().await;
    });
    std::thread::sleep(Duration::from_millis(300));
    let out = oncely(&["prune", "--dry-run", "--database-url", url]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let n: u64 = text
        .strip_prefix("would prune ")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{text}"));
    assert!(text.trim_end().ends_with("(dry run: nothing deleted)"), "{text}");
    if record(url, &key).is_some() {
        assert!(n >= 1, "{text}");
    }
}

fn sqlite_url(dir: &Path) -> String {
    format!("sqlite://{}?mode=rwc", dir.join("ledger.db").display())
}

#[test]
fn operator_commands_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    operate_on(&url);
}

#[test]
fn operator_commands_on_postgres() {
    let Some(url) = reachable(
        "ONCELY_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
        "PostgreSQL",
    ) else {
        return;
    };
    operate_on(&url);
    dry_run_on(&url);
}

#[cfg(feature = "mysql")]
#[test]
fn operator_commands_on_mysql() {
    let Some(url) = reachable(
        "ONCELY_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
        "MySQL/MariaDB",
    ) else {
        return;
    };
    operate_on(&url);
    dry_run_on(&url);
}

/// On a file of its own, the dry run's count is exact, and a real prune
/// then deletes what it counted.
#[test]
fn prune_dry_run_counts_exactly_and_deletes_nothing_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let t = oncely::conformance::fresh_tenant();
    let key = EffectKey::new(&t, "capture", "old").unwrap();
    let kept = EffectKey::new(&t, "capture", "new").unwrap();
    runtime().block_on(async {
        let l = AnyLedger::connect(&url).await.unwrap();
        let short = ClaimOptions::default()
            .lease(Duration::from_millis(50))
            .retention(Duration::from_millis(50));
        let lease = acquired(l.claim(&key, &short).await.unwrap());
        l.complete(&lease, &Outcome::value(&1).unwrap()).await.unwrap();
        let lease = acquired(l.claim(&kept, &ClaimOptions::default()).await.unwrap());
        l.complete(&lease, &Outcome::value(&2).unwrap()).await.unwrap();
        l.close().await;
    });
    std::thread::sleep(Duration::from_millis(300));
    let ledger = described(&url);
    for _ in 0..2 {
        let out = oncely(&["prune", "--dry-run", "--database-url", &url]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(
            stdout(&out).trim(),
            format!("would prune 1 record in {ledger} (dry run: nothing deleted)")
        );
        assert!(record(&url, &key).is_some());
    }
    let v = json(&["prune", "--dry-run", "--json"], &url);
    assert_eq!(
        v,
        serde_json::json!({"would_prune": 1, "dry_run": true, "ledger": ledger})
    );
    let v = json(&["prune", "--json"], &url);
    assert_eq!(v, serde_json::json!({"pruned": 1, "ledger": ledger}));
    let out = oncely(&["prune", "--dry-run", "--database-url", &url]);
    assert_eq!(
        stdout(&out).trim(),
        format!("would prune 0 records in {ledger} (dry run: nothing deleted)")
    );
    assert!(record(&url, &kept).is_some());
}

/// `prune` deletes through the library's Pruner: at most `--limit` records,
/// in batches of `--batch`, at `--rate`; nothing due is left alone, and a
/// zero batch or rate is refused before connecting.
#[test]
fn prune_is_bounded_batched_and_paced_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let t = oncely::conformance::fresh_tenant();
    let old: Vec<EffectKey> = (0..7)
        .map(|i| EffectKey::new(&t, "capture", format!("old-{i}")).unwrap())
        .collect();
    let kept = EffectKey::new(&t, "capture", "new").unwrap();
    runtime().block_on(async {
        let l = AnyLedger::connect(&url).await.unwrap();
        let short = ClaimOptions::default()
            .lease(Duration::from_millis(50))
            .retention(Duration::from_millis(50));
        for k in &old {
            let lease = acquired(l.claim(k, &short).await.unwrap());
            l.complete(&lease, &Outcome::value(&1).unwrap()).await.unwrap();
        }
        let lease = acquired(l.claim(&kept, &ClaimOptions::default()).await.unwrap());
        l.complete(&lease, &Outcome::value(&2).unwrap()).await.unwrap();
        l.close().await;
    });
    std::thread::sleep(Duration::from_millis(300));
    for bad in [["--batch", "0"], ["--rate", "0"]] {
        let out = oncely(&["prune", bad[0], bad[1], "--database-url", &url]);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {}", stderr(&out));
    }
    let gone = |url: &str| old.iter().filter(|k| record(url, k).is_none()).count();
    assert_eq!(gone(&url), 0, "refused commands deleted nothing");
    let v = json(
        &[
            "prune", "--limit", "5", "--batch", "2", "--rate", "1000", "--json",
        ],
        &url,
    );
    assert_eq!(v["pruned"], 5, "{v}");
    assert_eq!(gone(&url), 5);
    let v = json(&["prune", "--batch", "2", "--json"], &url);
    assert_eq!(v["pruned"], 2, "{v}");
    assert_eq!(gone(&url), 7);
    assert!(record(&url, &kept).is_some(), "not due: kept");
}

/// Commands that read across tenants say so: without --tenant or
/// --all-tenants (or with both) they are usage errors, before connecting.
#[test]
fn cross_tenant_reads_must_be_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("never.db");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    for cmd in ["stats", "stuck", "abandoned"] {
        let out = oncely(&[cmd, "--database-url", &url]);
        assert_eq!(out.status.code(), Some(2), "{cmd}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("--tenant <TENANT>|--all-tenants"),
            "{cmd}: {}",
            stderr(&out)
        );
        let out = oncely(&[cmd, "--tenant", "acme", "--all-tenants", "--database-url", &url]);
        assert_eq!(out.status.code(), Some(2), "{cmd}: {}", stderr(&out));
    }
    let out = oncely(&["history", "--subject", "o-1", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(!path.exists(), "a usage error created the database");
}

/// The read commands create nothing: a mistyped SQLite path is an error,
/// and no file appears; so do resolve and forget.
#[test]
fn operator_commands_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("typo.db");
    let url = format!("sqlite://{}", path.display());
    for args in [
        vec!["inspect", "acme/capture:o-1"],
        vec!["history", "--tenant", "acme"],
        vec!["stats", "--tenant", "acme"],
        vec!["stats", "--all-tenants"],
        vec!["stuck", "--tenant", "acme"],
        vec!["abandoned", "--all-tenants"],
        vec!["prune", "--dry-run"],
        vec!["resolve", "acme/capture:o-1", "--released"],
        vec!["forget", "acme/capture:o-1"],
    ] {
        let mut args = args.clone();
        args.extend(["--database-url", &url]);
        let out = oncely(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains(&path.display().to_string()),
            "{args:?}: {}",
            stderr(&out)
        );
        assert!(!path.exists(), "{args:?} created {}", path.display());
    }
}

/// Bad input is refused before anything connects: a malformed key or
/// tenant, an unknown URL scheme, a resolve without (or with both)
/// resolutions; Redis and NATS say the command is not available there.
#[test]
fn bad_input_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    for args in [
        vec!["inspect", "no-slash"],
        vec!["resolve", "acme/no-colon", "--released"],
        vec!["forget", "bad tenant/capture:x"],
        vec!["history", "--tenant", "a/b"],
        vec!["stats", "--tenant", "a b"],
        vec!["stuck", "--tenant", "acme", "--kind", "a:b"],
    ] {
        let mut all = args.clone();
        all.extend(["--database-url", &url]);
        let out = oncely(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("invalid effect key"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
    for args in [
        vec!["resolve", "acme/capture:o-1"],
        vec!["resolve", "acme/capture:o-1", "--released", "--completed", "1"],
        vec!["stuck", "--tenant", "acme", "--limit", "0"],
        vec!["forget", "acme/capture:o-1", "--fence", "-1"],
    ] {
        let mut all = args.clone();
        all.extend(["--database-url", &url]);
        let out = oncely(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    }
    assert!(!path.exists(), "bad input created the database");
    for args in [
        vec!["stats", "--all-tenants"],
        vec!["inspect", "acme/capture:o-1"],
        vec!["forget", "acme/capture:o-1"],
        vec!["prune", "--dry-run"],
    ] {
        let mut all = args.clone();
        all.extend(["--database-url", "mongodb://localhost/x"]);
        let out = oncely(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("unknown database URL scheme 'mongodb'"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
    // Port 1: nothing listens, so these fail before connecting or not at all.
    for url in ["redis://127.0.0.1:1", "nats://127.0.0.1:1"] {
        for args in [
            vec!["stats", "--all-tenants"],
            vec!["stuck", "--tenant", "acme"],
            vec!["history", "--tenant", "acme"],
            vec!["abandoned", "--all-tenants"],
            vec!["forget", "acme/capture:o-1"],
            vec!["prune", "--dry-run"],
        ] {
            let mut all = args.clone();
            all.extend(["--database-url", url]);
            let out = oncely(&all);
            assert_eq!(out.status.code(), Some(2), "{url} {args:?}: {}", stderr(&out));
            assert!(
                stderr(&out).contains("not available on the"),
                "{url} {args:?}: {}",
                stderr(&out)
            );
        }
    }
}

/// Every new command is listed in --help and documents every URL scheme.
#[test]
fn help_lists_the_operator_commands() {
    let out = oncely(&["--help"]);
    assert!(out.status.success());
    for cmd in [
        "inspect",
        "history",
        "stats",
        "stuck",
        "abandoned",
        "resolve",
        "forget",
        "prune",
    ] {
        assert!(stdout(&out).contains(cmd), "--help lists {cmd}: {}", stdout(&out));
        let out = oncely(&[cmd, "--help"]);
        assert!(out.status.success(), "{cmd}");
        for scheme in [
            "sqlite:",
            "postgres://",
            "mysql://",
            "redis://",
            "nats://",
            "memory:",
        ] {
            assert!(stdout(&out).contains(scheme), "{cmd} --help shows {scheme}");
        }
    }
    let out = oncely(&["inspect", "--help"]);
    assert!(stdout(&out).contains("Derived"), "{}", stdout(&out));
}

/// On Redis (no `Admin`): `inspect`, one tenant's `abandoned` and `resolve`
/// work on a real server; the listings, stats and forget say they are not
/// available there, and change nothing.
#[cfg(feature = "redis")]
#[test]
fn redis_offers_inspect_and_resolve_and_refuses_the_rest() {
    let Some(url) = common::redis_url() else {
        return;
    };
    let t = oncely::conformance::fresh_tenant();
    let step = EffectKey::new(&t, "receipt", "o-1").unwrap();
    let done = EffectKey::new(&t, "capture", "o-1").unwrap();
    runtime().block_on(async {
        let l = AnyLedger::connect(&url).await.unwrap();
        let short = ClaimOptions::default()
            .lease(Duration::from_millis(300))
            .at_most_once(true);
        acquired(l.claim(&step, &short).await.unwrap());
        let lease = acquired(l.claim(&done, &ClaimOptions::default()).await.unwrap());
        l.complete(&lease, &Outcome::value(&"ch_1").unwrap())
            .await
            .unwrap();
        l.close().await;
    });
    std::thread::sleep(Duration::from_millis(900));
    let i = json(&["inspect", step.as_str(), "--json"], &url);
    assert_eq!(i["class"], "abandoned", "{i}");
    let listed = json(&["abandoned", "--tenant", t.as_str(), "--json"], &url);
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    for args in [
        vec!["stats", "--tenant", t.as_str()],
        vec!["stuck", "--tenant", t.as_str()],
        vec!["history", "--tenant", t.as_str()],
        vec!["abandoned", "--all-tenants"],
        vec!["forget", done.as_str()],
        vec!["erase", "--tenant", t.as_str(), "--subject", "o-1"],
        vec!["prune", "--dry-run"],
    ] {
        refused(&args, &url, 2, "not available on the redis backend");
    }
    let r = record(&url, &done).unwrap();
    assert_eq!(
        r.state,
        oncely::backend::RecordState::Completed,
        "forget refused, nothing changed"
    );
    let resolved = json(&["resolve", step.as_str(), "--released", "--json"], &url);
    assert_eq!(resolved["was"], "abandoned", "{resolved}");
    assert_eq!(
        record(&url, &step).unwrap().state,
        oncely::backend::RecordState::Released
    );
    let audit = json(&["get", resolved["audit_key"].as_str().unwrap()], &url);
    assert_eq!(audit["outcome"]["ok"]["action"], "resolve-released", "{audit}");
}

/// `url` with `query` appended (after its own query, if any).
fn with_query(url: &str, query: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

/// One completed record in a fresh tenant, written by the application's own
/// ledger (opened through the library with a table of its own).
async fn completed_in<L: Ledger>(l: &L) -> EffectKey {
    let key = EffectKey::new(&oncely::conformance::fresh_tenant(), "capture", "o-1").unwrap();
    let lease = acquired(l.claim(&key, &ClaimOptions::default()).await.unwrap());
    l.complete(&lease, &Outcome::value(&"ch_1").unwrap())
        .await
        .unwrap();
    key
}

/// The operator commands read the ledger the URL names: given the table the
/// application set (`named`), `inspect`, `get`, `stats`, `history`,
/// `stuck`, `prune --dry-run`, `resolve`, `reconcile`, `serve` and `forget`
/// find its record; given the
/// default URL, they answer "no record" (or "no records") naming the table
/// they read (`default_table`), in text and in `--json` (a `ledger`
/// field); and a mistyped parameter is a usage error naming it.
fn commands_read_the_named_table(
    default: &str,
    named: &str,
    key: &EffectKey,
    named_table: &str,
    default_table: &str,
) {
    let t = key.tenant().as_str();
    let ledger = described(named);
    assert!(ledger.ends_with(named_table), "{ledger}");
    let elsewhere = described(default);
    assert!(elsewhere.ends_with(default_table), "{elsewhere}");

    // inspect and get find it in the named table, and say where.
    let found = json(&["inspect", key.as_str(), "--json"], named);
    assert_eq!(
        (&found["class"], &found["ledger"]),
        (&"completed".into(), &ledger.clone().into()),
        "{found}"
    );
    let out = oncely(&["inspect", key.as_str(), "--database-url", named]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with(&format!("ledger        {ledger}")),
        "{}",
        stdout(&out)
    );
    let got = json(&["get", key.as_str()], named);
    assert_eq!(
        (&got["state"], &got["ledger"]),
        (&"completed".into(), &ledger.clone().into()),
        "{got}"
    );
    // The default table has no such record, and says which table it read.
    let no_record = format!("no record for {key} in {elsewhere}");
    for args in [
        vec!["inspect", key.as_str()],
        vec!["inspect", key.as_str(), "--json"],
        vec!["get", key.as_str()],
    ] {
        refused(&args, default, 3, &no_record);
    }

    // stats and history count and list it there, and nothing here.
    let stats = json(&["stats", "--tenant", t, "--json"], named);
    assert_eq!(stats["kinds"][0]["completed"], 1, "{stats}");
    assert_eq!(stats["ledger"], ledger, "{stats}");
    let out = oncely(&["stats", "--tenant", t, "--database-url", default]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with(&format!("no records in {elsewhere}\n")),
        "{}",
        stdout(&out)
    );
    let stats = json(&["stats", "--tenant", t, "--json"], default);
    assert_eq!(
        (&stats["kinds"], &stats["ledger"]),
        (&serde_json::json!([]), &elsewhere.clone().into()),
        "{stats}"
    );
    let h = json(&["history", "--tenant", t, "--json"], named);
    assert_eq!(h["records"][0]["key"], key.as_str(), "{h}");
    assert_eq!(h["ledger"], ledger, "{h}");
    let out = oncely(&["history", "--tenant", t, "--database-url", default]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.starts_with(&format!("ledger: {elsewhere}\n")), "{text}");
    assert!(text.contains("verdict: no record"), "{text}");
    let out = oncely(&["stuck", "--tenant", t, "--database-url", named]);
    assert_eq!(
        stdout(&out).trim(),
        format!("no stuck records in {ledger}"),
        "{}",
        stderr(&out)
    );
    let out = oncely(&["prune", "--dry-run", "--database-url", named]);
    assert!(
        stdout(&out).starts_with(&format!("would prune 0 records in {ledger} ")),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );

    // resolve: "no record" in the default table; in the named one it finds
    // the record, completed, and refuses to change it.
    refused(&["resolve", key.as_str(), "--released"], default, 3, &no_record);
    let out = oncely(&["resolve", key.as_str(), "--released", "--database-url", named]);
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(!stderr(&out).contains("no record"), "{}", stderr(&out));
    assert_eq!(
        record(named, key).unwrap().state,
        oncely::backend::RecordState::Completed
    );

    // reconcile reads (and names) the ledger the URL names.
    for (url, which) in [(named, &ledger), (default, &elsewhere)] {
        let r = json(
            &["reconcile", "--tenant", t, "--check", "echo done", "--json"],
            url,
        );
        assert_eq!(r["ledger"], which.as_str(), "{r}");
    }

    // serve's overview counts the record in the named table, and names the
    // default one when it finds nothing there.
    let page = served_overview(named, t);
    assert!(page.contains("capture") && !page.contains("No records"), "{page}");
    let page = served_overview(default, t);
    assert!(
        page.contains("No records in") && page.contains(default_table),
        "{page}"
    );

    // forget: "no record" in the default table, done in the named one.
    refused(&["forget", key.as_str()], default, 3, &no_record);
    let forgot = json(&["forget", key.as_str(), "--json"], named);
    assert_eq!(
        (&forgot["now"], &forgot["ledger"]),
        (&"released".into(), &ledger.clone().into()),
        "{forgot}"
    );
    assert_eq!(
        record(named, key).unwrap().state,
        oncely::backend::RecordState::Released
    );

    // A mistyped parameter is refused, naming it, before anything is read.
    let typo = with_query(named, "tabel=effects");
    refused(&["inspect", key.as_str()], &typo, 2, "URL parameter 'tabel'");
}

/// `oncely serve --tenant TENANT` on `url`: the overview page's HTML (the
/// server stopped after one request).
fn served_overview(url: &str, tenant: &str) -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_oncely"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--tenant",
            tenant,
            "--database-url",
            url,
        ])
        .env_remove("ONCELY_DATABASE_URL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("http://"))
        .unwrap_or_else(|| panic!("serve printed {line:?}"))
        .trim_end_matches('/')
        .to_owned();
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    write!(conn, "GET / HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200"),
        "{answer}"
    );
    answer
}

/// An application's ledger in `billing_effects` of its SQLite file.
#[test]
fn commands_read_the_table_the_url_names_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let key = runtime().block_on(async {
        let l = oncely_sqlite::SqliteLedger::connect_with(
            &url,
            oncely_sqlite::SqliteLedgerOptions::default().table("billing_effects"),
        )
        .await
        .unwrap();
        let key = completed_in(&l).await;
        // The default table exists too (as `oncely migrate` would leave it).
        oncely_sqlite::SqliteLedger::connect(&url).await.unwrap();
        key
    });
    let named = with_query(&url, "table=billing_effects");
    commands_read_the_named_table(
        &url,
        &named,
        &key,
        ", table billing_effects",
        ", table oncely_effects",
    );
}

/// An application's ledger in `<its own schema>.effects`, opened with
/// `PgLedgerOptions::schema(..).table(..)`.
#[test]
fn commands_read_the_table_the_url_names_on_postgres() {
    let Some(url) = reachable(
        "ONCELY_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
        "PostgreSQL",
    ) else {
        return;
    };
    let schema = format!("oncely_cli_{}", std::process::id());
    let drop = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
    let key = runtime().block_on(async {
        let l = oncely_postgres::PgLedger::connect_with(
            &url,
            oncely_postgres::PgLedgerOptions::default()
                .schema(schema.clone())
                .table("effects"),
        )
        .await
        .unwrap();
        let key = completed_in(&l).await;
        l.pool().close().await;
        key
    });
    let named = with_query(&url, &format!("schema={schema}&table=effects"));
    commands_read_the_named_table(
        &url,
        &named,
        &key,
        &format!(", table {schema}.effects"),
        ", table public.oncely_effects",
    );
    runtime().block_on(async {
        let l = oncely_postgres::PgLedger::connect(&url).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(l.pool())
            .await
            .unwrap();
        l.pool().close().await;
    });
}

/// An application's ledger in a table of its own of the URL's database,
/// opened with `MySqlLedgerOptions::table(..)`.
#[cfg(feature = "mysql")]
#[test]
fn commands_read_the_table_the_url_names_on_mysql() {
    let Some(url) = reachable(
        "ONCELY_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
        "MySQL/MariaDB",
    ) else {
        return;
    };
    let table = format!("oncely_cli_{}", std::process::id());
    let key = runtime().block_on(async {
        let l = oncely_mysql::MySqlLedger::connect_with(
            &url,
            oncely_mysql::MySqlLedgerOptions::default().table(&table),
        )
        .await
        .unwrap();
        let key = completed_in(&l).await;
        l.pool().close().await;
        key
    });
    let named = with_query(&url, &format!("table={table}"));
    commands_read_the_named_table(
        &url,
        &named,
        &key,
        &format!(", table {table}"),
        ", table oncely_effects",
    );
    runtime().block_on(async {
        let l = oncely_mysql::MySqlLedger::connect(&url).await.unwrap();
        for t in [format!("{table}_horizon"), table.clone()] {
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS `{t}`")))
                .execute(l.pool())
                .await
                .unwrap();
        }
        l.pool().close().await;
    });
}

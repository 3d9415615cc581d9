//! Runs the built `oncely` binary against real databases.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use oncely::{Claim, ClaimOptions, EffectKey, Ledger, Outcome, Tenant};
use oncely_cli::AnyLedger;
use serde_json::Value;

fn oncely(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oncely"))
        .args(args)
        // The command reads its URL from here when --database-url is absent;
        // a developer's setting must not leak into the tests.
        .env_remove("ONCELY_DATABASE_URL")
        .output()
        .expect("the oncely binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn sqlite_url(dir: &Path) -> String {
    format!("sqlite://{}?mode=rwc", dir.join("ledger.db").display())
}

/// Runs `demo --json` and checks what the demo promises: the naive guard
/// charges twice, oncely never does.
fn demo_json(extra: &[&str]) -> Value {
    let mut args = vec!["demo", "--json", "--orders", "120"];
    args.extend_from_slice(extra);
    let out = oncely(&args);
    assert!(
        out.status.success(),
        "demo failed: {}\n{}",
        stderr(&out),
        stdout(&out)
    );
    let text = stdout(&out);
    assert_eq!(text.lines().count(), 1, "exactly one JSON line on stdout: {text}");
    let v: Value = serde_json::from_str(&text).expect("stdout is JSON");
    assert_eq!(v["orders"], 120);
    assert_eq!(v["deliveries"], 480);
    assert_eq!(v["oncely"]["duplicate_charges"], 0, "{v}");
    assert_eq!(v["oncely"]["charges"], 120, "{v}");
    assert_eq!(v["oncely"]["orders_paid"], 120, "{v}");
    assert_eq!(v["oncely"]["duplicates_suppressed"], 480 - 120, "{v}");
    assert!(
        v["naive"]["duplicate_charges"].as_u64().unwrap() > 0,
        "naive guard should double-charge: {v}"
    );
    assert_eq!(v["naive"]["orders_paid"], 120, "{v}");
    v
}

#[test]
fn demo_on_the_default_sqlite_file() {
    let v = demo_json(&[]);
    assert_eq!(v["backend"], "sqlite");
}

#[test]
fn demo_on_postgres() {
    let Some(url) = oncely::conformance::service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    ) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    match rt.block_on(AnyLedger::connect(&url)) {
        Ok(l) => rt.block_on(l.close()),
        Err(e) => {
            oncely::conformance::skip_or_fail::<()>(&format!("PostgreSQL at {url}: {e}"));
            return;
        }
    }
    let v = demo_json(&["--database-url", &url]);
    assert_eq!(v["backend"], "postgres");
    // The run's ledger records stay (for inspection) under its own tenant.
    let key = format!("{}/capture:order-7", v["tenant"].as_str().unwrap());
    let out = oncely(&["get", &key, "--database-url", &url]);
    assert!(out.status.success(), "{}", stderr(&out));
    let record: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(record["state"], "completed");
}

#[test]
fn the_table_shows_both_guards() {
    let out = oncely(&[
        "demo",
        "--orders",
        "40",
        "--database-url",
        "memory:",
        "--seed",
        "3",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for row in [
        "deliveries",
        "charges performed",
        "duplicate charges",
        "duplicates suppressed",
        "time",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(row)),
            "row {row:?} missing:\n{text}"
        );
    }
    let header = text.lines().find(|l| l.contains("naive")).unwrap();
    assert!(header.contains("oncely"), "{header}");
    let dup = text.lines().find(|l| l.starts_with("duplicate charges")).unwrap();
    assert_eq!(dup.split_whitespace().last(), Some("0"), "oncely column: {dup}");
    // Not a terminal: no progress bar escape codes on stderr.
    assert!(!stderr(&out).contains('\u{1b}'), "{:?}", stderr(&out));
}

#[test]
fn unknown_scheme_is_a_usage_error() {
    for args in [
        vec![
            "get",
            "acme/capture:order-1",
            "--database-url",
            "mongodb://localhost/x",
        ],
        vec!["demo", "--json", "--database-url", "mongodb://localhost/x"],
        vec!["prune", "--database-url", "mongodb://localhost/x"],
    ] {
        let out = oncely(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out)
                .contains("unknown database URL scheme 'mongodb' (expected sqlite:, postgres://, memory:)"),
            "{args:?}: {}",
            stderr(&out)
        );
        assert!(stdout(&out).is_empty(), "{args:?}: {}", stdout(&out));
    }
}

#[test]
fn invalid_key_and_tenant_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    for key in [
        "no-slash",
        "acme/no-colon",
        "acme/:order-1",
        "bad tenant/capture:x",
    ] {
        let out = oncely(&["get", key, "--database-url", &url]);
        assert_eq!(out.status.code(), Some(2), "{key}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("invalid effect key"),
            "{key}: {}",
            stderr(&out)
        );
    }
    let out = oncely(&["abandoned", "--tenant", "a/b", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("tenant"), "{}", stderr(&out));
    // Refused before connecting: the file was never created.
    assert!(!dir.path().join("ledger.db").exists());
}

#[test]
fn bad_arguments_exit_2() {
    for args in [
        vec!["demo", "--orders", "0"],
        vec!["demo", "--workers", "many"],
        vec!["get", "acme/capture:order-1"],
        vec!["frobnicate"],
    ] {
        let out = oncely(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    }
    let out = oncely(&["--help"]);
    assert!(out.status.success());
    for cmd in ["demo", "get", "abandoned", "prune", "migrate"] {
        assert!(stdout(&out).contains(cmd), "--help lists {cmd}: {}", stdout(&out));
    }
}

#[test]
fn unreachable_database_is_a_runtime_error() {
    // Port 1 on loopback: nothing listens there.
    let out = oncely(&[
        "get",
        "acme/capture:order-1",
        "--database-url",
        "postgres://postgres@127.0.0.1:1/test",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("postgres unavailable"), "{}", stderr(&out));
    let dir = tempfile::tempdir().unwrap();
    // A SQLite file in a directory that does not exist cannot be created.
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("missing/ledger.db").display()
    );
    let out = oncely(&["prune", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).starts_with("error: sqlite"), "{}", stderr(&out));
}

#[test]
fn get_prune_abandoned_round_trip_after_a_demo() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());

    let out = oncely(&["migrate", "--database-url", &url]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("sqlite ledger schema is up to date"),
        "{}",
        stdout(&out)
    );

    let out = oncely(&["demo", "--json", "--orders", "20", "--database-url", &url]);
    assert!(out.status.success(), "{}", stderr(&out));
    let demo: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let tenant = demo["tenant"].as_str().unwrap().to_owned();

    // The demo's record of one order: completed once, the charge stored.
    let key = format!("{tenant}/capture:order-3");
    let out = oncely(&["get", &key, "--database-url", &url]);
    assert!(out.status.success(), "{}", stderr(&out));
    let record: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(record["key"], key.as_str());
    assert_eq!(record["state"], "completed");
    assert_eq!(record["fence"], 1);
    assert!(
        record["outcome"]["ok"].as_str().unwrap().starts_with("ch_"),
        "{record}"
    );
    let parsed = EffectKey::parse(&key).unwrap();
    assert_eq!(record["provider_key"], parsed.provider_key().as_str());

    // No record: `null` and exit 3.
    let out = oncely(&[
        "get",
        &format!("{tenant}/capture:order-999"),
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "null");

    // Seed an abandoned at-most-once step and a completed record already
    // past its retention, through the same ledger the CLI opens.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let t = Tenant::new(&tenant).unwrap();
    let receipt = EffectKey::new(&t, "receipt", "order-3").unwrap();
    let old = EffectKey::new(&t, "capture", "order-old").unwrap();
    rt.block_on(async {
        let ledger = AnyLedger::connect(&url).await.unwrap();
        let short = ClaimOptions::default()
            .lease(Duration::from_millis(50))
            .retention(Duration::from_millis(50));
        let Claim::Acquired(_crashed) = ledger
            .claim(&receipt, &short.clone().at_most_once(true))
            .await
            .unwrap()
        else {
            panic!("fresh key")
        };
        let Claim::Acquired(lease) = ledger.claim(&old, &short).await.unwrap() else {
            panic!("fresh key")
        };
        ledger
            .complete(&lease, &Outcome::from_json(&"ch_old").unwrap())
            .await
            .unwrap();
        ledger.close().await;
    });
    // Let the lease and the retention run out on the database's clock.
    std::thread::sleep(Duration::from_millis(300));

    let out = oncely(&["abandoned", "--tenant", &tenant, "--database-url", &url]);
    assert!(out.status.success(), "{}", stderr(&out));
    let listed: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["key"], receipt.as_str());
    assert_eq!(listed[0]["state"], "abandoned");
    assert_eq!(listed[0]["at_most_once"], true);

    // Another tenant sees nothing.
    let out = oncely(&["abandoned", "--tenant", "someone-else", "--database-url", &url]);
    assert_eq!(stdout(&out).trim(), "[]", "{}", stderr(&out));

    // Prune deletes only the expired completed record: not the demo's
    // records (an hour of retention) and not the abandoned step.
    let out = oncely(&["prune", "--database-url", &url]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "pruned 1 record");
    let out = oncely(&["get", old.as_str(), "--database-url", &url]);
    assert_eq!(out.status.code(), Some(3), "pruned: {}", stdout(&out));
    for kept in [key.as_str(), receipt.as_str()] {
        let out = oncely(&["get", kept, "--database-url", &url]);
        assert!(
            out.status.success(),
            "{kept} must survive prune: {}",
            stderr(&out)
        );
    }
    let out = oncely(&["prune", "--database-url", &url]);
    assert_eq!(stdout(&out).trim(), "pruned 0 records");
}

#[test]
fn demo_exits_nonzero_only_for_oncely_duplicates() {
    // A run with one delivery per order has no duplicates to suppress and
    // must still succeed: the exit code tracks oncely's duplicates, not the
    // naive guard's.
    let out = oncely(&[
        "demo",
        "--json",
        "--orders",
        "10",
        "--deliveries",
        "1",
        "--database-url",
        "memory:",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(v["naive"]["duplicate_charges"], 0);
    assert_eq!(v["oncely"]["charges"], 10);
}

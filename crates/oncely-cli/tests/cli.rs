//! Runs the built `oncely` binary against real databases.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome};
use oncely::{ClaimOptions, EffectKey, Tenant};
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

/// With the temporary directory on a memory file system (TMPDIR under
/// /dev/shm, as on systems whose /tmp is a tmpfs), where a ledger refuses a
/// file by default, the demo and the bench still run on their scratch
/// SQLite file: it goes with the run.
#[cfg(target_os = "linux")]
#[test]
fn demo_and_bench_run_with_the_temp_dir_on_a_memory_file_system() {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    if !mounts
        .lines()
        .any(|l| l.split(' ').nth(1) == Some("/dev/shm") && l.split(' ').nth(2) == Some("tmpfs"))
    {
        eprintln!("skipped: /dev/shm is not a tmpfs here");
        return;
    }
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    for args in [
        &["demo", "--json", "--orders", "20"][..],
        &["bench", "--json", "--jobs", "20", "--batch", "10"][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_oncely"))
            .args(args)
            .env("TMPDIR", dir.path())
            .env_remove("ONCELY_DATABASE_URL")
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        let v: Value = serde_json::from_str(&stdout(&out)).expect("stdout is JSON");
        assert_eq!(v["backend"], "sqlite", "{v}");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The URL of a server from `var` (or `default`) if a ledger opens on it;
/// otherwise `None` after `skip_or_fail` (which panics under
/// ONCELY_REQUIRE_SERVICES=1).
fn reachable(var: &str, default: &str, what: &str) -> Option<String> {
    let url = oncely::conformance::service_url(var, Some(default))?;
    server_at(url, what)
}

fn server_at(url: String, what: &str) -> Option<String> {
    let rt = runtime();
    match rt.block_on(AnyLedger::connect(&url)) {
        Ok(l) => {
            rt.block_on(l.close());
            Some(url)
        }
        Err(e) => oncely::conformance::skip_or_fail(&format!("{what} at {url}: {e}")),
    }
}

/// The demo on a server, then the operator commands on what it left: the
/// records stay (for inspection) under the run's own tenant.
fn demo_on(url: &str, backend: &str) -> Value {
    let v = demo_json(&["--database-url", url]);
    assert_eq!(v["backend"], backend, "{v}");
    let tenant = v["tenant"].as_str().unwrap();
    let key = format!("{tenant}/capture:order-7");
    let out = oncely(&["get", &key, "--database-url", url]);
    assert!(out.status.success(), "{}", stderr(&out));
    let record: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(record["key"], key.as_str());
    assert_eq!(record["state"], "completed");
    assert!(record["fence"].as_u64().unwrap() >= 1, "{record}");
    assert!(
        record["outcome"]["ok"].as_str().unwrap().starts_with("ch_"),
        "{record}"
    );
    let out = oncely(&[
        "get",
        &format!("{tenant}/capture:order-121"),
        "--database-url",
        url,
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    // The demo completes every step: nothing abandoned.
    let out = oncely(&["abandoned", "--tenant", tenant, "--json", "--database-url", url]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "[]");
    let out = oncely(&["abandoned", "--tenant", tenant, "--database-url", url]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("no abandoned records in "),
        "{}",
        stdout(&out)
    );
    let out = oncely(&["migrate", "--database-url", url]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with(&format!("{backend} ledger schema is up to date")),
        "{}",
        stdout(&out)
    );
    v
}

#[test]
fn demo_on_postgres() {
    let Some(url) = reachable(
        "ONCELY_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
        "PostgreSQL",
    ) else {
        return;
    };
    demo_on(&url, "postgres");
}

#[cfg(feature = "mysql")]
#[test]
fn demo_on_mysql() {
    let Some(url) = reachable(
        "ONCELY_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
        "MySQL/MariaDB",
    ) else {
        return;
    };
    let v = demo_on(&url, "mysql");
    // The orders tables lived in the same database and were dropped.
    let run_id = v["tenant"]
        .as_str()
        .unwrap()
        .trim_start_matches("demo-")
        .to_owned();
    let rt = runtime();
    let left: i64 = rt.block_on(async {
        let ledger = AnyLedger::connect(&url).await.unwrap();
        let Some(oncely_cli::AnyPool::MySql(pool)) = ledger.pool() else {
            panic!("a MySQL ledger has a MySQL pool")
        };
        let n = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name LIKE ?",
        )
        .bind(format!("oncely_demo_{run_id}%"))
        .fetch_one(&pool)
        .await
        .unwrap();
        ledger.close().await;
        n
    });
    assert_eq!(left, 0, "orders tables of run {run_id} left behind");

    // mariadb:// opens the same backend on the same database.
    if let Some(rest) = url.strip_prefix("mysql://") {
        let maria = format!("mariadb://{rest}");
        let out = oncely(&[
            "get",
            &format!("{}/capture:order-1", v["tenant"].as_str().unwrap()),
            "--database-url",
            &maria,
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        let record: Value = serde_json::from_str(&stdout(&out)).unwrap();
        assert_eq!(record["state"], "completed");
    }
}

/// The machine's Redis (ONCELY_REDIS_URL) with `?ephemeral=true`: the test
/// server persists nothing (`--save "" --appendonly no`), and the commands
/// that write refuse such a server unless the URL accepts it.
#[cfg(feature = "redis")]
fn redis_url() -> Option<String> {
    let url = oncely::conformance::service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379"))?;
    let sep = if url.contains('?') { '&' } else { '?' };
    server_at(format!("{url}{sep}ephemeral=true"), "Redis")
}

#[cfg(feature = "redis")]
#[test]
fn demo_on_redis() {
    let Some(url) = redis_url() else {
        return;
    };
    demo_on(&url, "redis");
}

/// A Redis server that persists nothing: the commands that write (and
/// `migrate`, which reports what the server keeps) are refused with a
/// message that names `?ephemeral=true`; the commands that only read open
/// it; with the parameter, `migrate` reports durability none.
#[cfg(feature = "redis")]
#[test]
fn redis_that_persists_nothing_is_refused_for_writes_unless_the_url_accepts_it() {
    let Some(accepted) = redis_url() else {
        return;
    };
    let plain = accepted
        .replace("?ephemeral=true", "")
        .replace("&ephemeral=true", "");
    let key = format!("{}/capture:order-1", oncely::conformance::fresh_tenant());
    for args in [
        vec!["migrate"],
        vec!["demo", "--orders", "5"],
        vec!["prune"],
        vec!["resolve", &key, "--released"],
    ] {
        let mut all = args.clone();
        all.extend(["--database-url", &plain]);
        let out = oncely(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("persists nothing") && stderr(&out).contains("?ephemeral=true"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
    // A read opens it: the key is simply not there.
    let out = oncely(&["get", &key, "--database-url", &plain]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stderr(&out).contains("no record"), "{}", stderr(&out));
    let out = oncely(&["migrate", "--database-url", &accepted]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("durability:           none: the Redis server persists nothing"),
        "{}",
        stdout(&out)
    );
}

/// The seed nodes of a Redis Cluster as a `redis+cluster://` URL:
/// ONCELY_REDIS_CLUSTER_URLS (comma-separated `redis://` URLs, as the
/// oncely-redis tests take it), or the local three-master cluster that
/// scripts/redis-cluster.sh starts (idempotent; it is left running, as the
/// oncely-redis tests leave it).
#[cfg(feature = "redis")]
fn redis_cluster_url() -> Option<String> {
    let nodes: Vec<String> = match std::env::var("ONCELY_REDIS_CLUSTER_URLS") {
        Ok(urls) => urls
            .split(',')
            .map(|u| u.trim().to_owned())
            .filter(|u| !u.is_empty())
            .collect(),
        Err(_) => {
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/redis-cluster.sh");
            match Command::new("bash").arg(script).arg("up").output() {
                Ok(out) if out.status.success() => {}
                Ok(out) => {
                    return oncely::conformance::skip_or_fail(&format!(
                        "{script} up failed: {}",
                        stderr(&out).trim()
                    ));
                }
                Err(e) => return oncely::conformance::skip_or_fail(&format!("{script}: {e}")),
            }
            (7000..=7002).map(|p| format!("redis://127.0.0.1:{p}")).collect()
        }
    };
    let list: Vec<&str> = nodes
        .iter()
        .map(|n| n.strip_prefix("redis://").unwrap_or(n))
        .collect();
    // The test cluster persists nothing either.
    server_at(
        format!("redis+cluster://{}?ephemeral=true", list.join(",")),
        "Redis Cluster",
    )
}

#[cfg(feature = "redis")]
#[test]
fn demo_on_redis_cluster() {
    let Some(url) = redis_cluster_url() else {
        return;
    };
    demo_on(&url, "redis");
}

#[cfg(feature = "nats")]
#[test]
fn demo_on_nats() {
    let Some(url) = reachable("ONCELY_NATS_URL", "nats://127.0.0.1:4222", "NATS") else {
        return;
    };
    demo_on(&url, "nats");
}

#[cfg(feature = "nats")]
#[test]
fn nats_bucket_comes_from_the_url() {
    let Some(url) = reachable("ONCELY_NATS_URL", "nats://127.0.0.1:4222", "NATS") else {
        return;
    };
    let sep = if url.contains('?') { '&' } else { '?' };
    let own = format!("{url}{sep}bucket=oncely_cli_test&replicas=1");
    let out = oncely(&["demo", "--json", "--orders", "10", "--database-url", &own]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let key = format!("{}/capture:order-3", v["tenant"].as_str().unwrap());
    let out = oncely(&["get", &key, "--database-url", &own]);
    assert!(out.status.success(), "in its bucket: {}", stderr(&out));
    // The default bucket never saw this run.
    let out = oncely(&["get", &key, "--database-url", &url]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "not in the default bucket: {}",
        stdout(&out)
    );
    // The run's records are an hour from their retention: prune keeps them.
    // (This bucket is the test's own, so prune touches nobody else's.)
    let out = oncely(&["prune", "--database-url", &own]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = oncely(&["get", &key, "--database-url", &own]);
    assert!(out.status.success(), "kept by prune: {}", stderr(&out));
    // An option the URL cannot carry is a usage error, before connecting.
    let out = oncely(&["get", &key, "--database-url", &format!("{url}{sep}replicas=2")]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("replicas must be 1 or 3"),
        "{}",
        stderr(&out)
    );
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
            stderr(&out).contains(
                "unknown database URL scheme 'mongodb' (expected sqlite:, postgres://, mysql://, \
                 mariadb://, redis://, redis+cluster://, redis+sentinel://, nats://, memory:)"
            ),
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
    // Every command that takes a URL documents every scheme.
    for cmd in ["demo", "get", "abandoned", "prune", "migrate"] {
        let out = oncely(&[cmd, "--help"]);
        assert!(out.status.success());
        for scheme in [
            "sqlite:",
            "postgres://",
            "mysql://",
            "mariadb://",
            "redis://",
            "redis+cluster://",
            "nats://",
            "memory:",
        ] {
            assert!(
                stdout(&out).contains(scheme),
                "{cmd} --help shows {scheme}: {}",
                stdout(&out)
            );
        }
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
    let servers: &[(&str, &str)] = &[
        #[cfg(feature = "mysql")]
        ("mysql://root@127.0.0.1:1/test", "mysql"),
        #[cfg(feature = "mysql")]
        ("mariadb://root@127.0.0.1:1/test", "mysql"),
        #[cfg(feature = "redis")]
        ("redis://127.0.0.1:1", "redis"),
        #[cfg(feature = "redis")]
        ("redis+cluster://127.0.0.1:1,127.0.0.1:2", "redis"),
        #[cfg(feature = "nats")]
        ("nats://127.0.0.1:1", "nats"),
        #[cfg(feature = "nats")]
        ("nats://127.0.0.1:1,127.0.0.1:2", "nats"),
    ];
    for &(url, backend) in servers {
        for args in [
            vec!["get", "acme/capture:order-1", "--database-url", url],
            vec!["demo", "--json", "--orders", "5", "--database-url", url],
        ] {
            let out = oncely(&args);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
            assert!(
                stderr(&out).starts_with(&format!("error: {backend} unavailable: ")),
                "{args:?}: {}",
                stderr(&out)
            );
            assert!(stdout(&out).is_empty(), "{args:?}: {}", stdout(&out));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    // A SQLite file in a directory that does not exist cannot be created.
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("missing/ledger.db").display()
    );
    let out = oncely(&["migrate", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).starts_with("error: sqlite"), "{}", stderr(&out));
}

/// Commands other than `migrate` and `demo` never create a ledger: a
/// mistyped SQLite path is an error naming the path (exit 2), not a new empty
/// database answering `null`, and no file appears.
#[test]
fn read_and_prune_commands_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("typo.db");
    let url = format!("sqlite://{}", path.display());
    for args in [
        vec!["get", "acme/capture:order-1"],
        vec!["abandoned", "--tenant", "acme"],
        vec!["prune"],
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
        assert!(stdout(&out).is_empty(), "{args:?}: {}", stdout(&out));
        assert!(!path.exists(), "{args:?} created {}", path.display());
    }
    // After `migrate` creates it, the read commands work on it, read-only.
    let out = oncely(&["migrate", "--database-url", &format!("{url}?mode=rwc")]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = oncely(&["get", "acme/capture:order-1", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "null");
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
    assert!(record["fence"].as_u64().unwrap() >= 1, "{record}");
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

    // A table by default, like the other listings.
    let out = oncely(&["abandoned", "--tenant", &tenant, "--database-url", &url]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("ledger: sqlite"), "{table}");
    for column in ["key", "state", "fence", "created", "lease ended", "provider key"] {
        assert!(lines[1].contains(column), "{table}");
    }
    assert!(
        lines[2].starts_with(receipt.as_str()) && lines[2].contains("abandoned"),
        "{table}"
    );
    assert!(lines[3].contains("oncely resolve"), "{table}");
    let out = oncely(&["abandoned", "--tenant", &tenant, "--json", "--database-url", &url]);
    assert!(out.status.success(), "{}", stderr(&out));
    let listed: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["key"], receipt.as_str());
    assert_eq!(listed[0]["state"], "abandoned");
    assert_eq!(listed[0]["at_most_once"], true);

    // Another tenant sees nothing.
    let out = oncely(&[
        "abandoned",
        "--tenant",
        "someone-else",
        "--json",
        "--database-url",
        &url,
    ]);
    assert_eq!(stdout(&out).trim(), "[]", "{}", stderr(&out));

    // Prune deletes only the expired completed record: not the demo's
    // records (an hour of retention) and not the abandoned step.
    let out = oncely(&["prune", "--database-url", &url]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("pruned 1 record from sqlite "),
        "{}",
        stdout(&out)
    );
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
    assert!(
        stdout(&out).starts_with("pruned 0 records from sqlite "),
        "{}",
        stdout(&out)
    );
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

/// Runs `bench --json` on `url` (or the default SQLite file) with a small
/// workload and checks what the bench promises: one JSON object, every
/// row's effects equal to its jobs, each oncely row paired with a
/// hand-written row and a ratio, waiters woken in the concurrent Wait row.
fn bench_on(url: Option<&str>, backend: &str) {
    let mut args = vec![
        "bench",
        "--json",
        "--jobs",
        "60",
        "--workers",
        "4",
        "--batch",
        "20",
    ];
    if let Some(url) = url {
        args.extend_from_slice(&["--database-url", url]);
    }
    let out = oncely(&args);
    assert!(
        out.status.success(),
        "bench failed: {}\n{}",
        stderr(&out),
        stdout(&out)
    );
    let text = stdout(&out);
    assert_eq!(text.lines().count(), 1, "exactly one JSON line on stdout: {text}");
    let v: Value = serde_json::from_str(&text).expect("stdout is JSON");
    assert_eq!(v["backend"], backend, "{v}");
    let rows = v["rows"].as_array().expect("rows");
    // Sequential and concurrent, single and batch; hand-written, oncely
    // Wait, and concurrently oncely Reject; concurrent single Wait also
    // without coalescing; single claims also by hand with the same
    // guarantees (leased).
    // PostgreSQL also runs its single claims with relaxed claim durability.
    let want = if backend == "postgres" { 15 } else { 13 };
    assert_eq!(rows.len(), want, "{v}");
    for row in rows {
        let name = row["name"].as_str().unwrap();
        assert_eq!(row["jobs"], 60, "{name}: {row}");
        assert_eq!(row["effects"], 60, "{name}: every effect exactly once: {row}");
        assert_eq!(row["jobs_run_twice"], 0, "{name}: {row}");
        assert_eq!(row["wrong_outcomes"], 0, "{name}: {row}");
        assert_eq!(row["deliveries"], 120, "{name}: {row}");
        assert!(row["deliveries_per_sec"].as_f64().unwrap() > 0.0, "{name}: {row}");
        assert!(row["ratio"].as_f64().unwrap() > 0.0, "{name}: {row}");
        assert!(
            row["claim_latency"]["samples"].as_u64().unwrap() > 0,
            "{name}: {row}"
        );
        // The server's own counters, per job, where it has them (other
        // tests share the server: only their presence is asserted here;
        // oncely-bench's tests/server.rs checks their values).
        let counted = |field: &str| row["server"][field].as_f64().is_some();
        match backend {
            "postgres" => assert!(
                counted("write_transactions_per_job") && counted("cpu_us_per_job"),
                "{row}"
            ),
            "mysql" => assert!(
                counted("statements_per_job") && counted("fsyncs_per_job"),
                "{row}"
            ),
            "redis" => assert!(counted("scripts_per_job") && counted("cpu_us_per_job"), "{row}"),
            _ => assert!(!counted("statements_per_job"), "{row}"),
        }
    }
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    for want in [
        "sequential, single, hand-written",
        "concurrent, single, oncely Wait",
        "concurrent, single, oncely Reject",
        if matches!(backend, "memory" | "nats") {
            "concurrent, single, oncely Wait, coalescing on"
        } else {
            "concurrent, single, oncely Wait, coalescing off"
        },
        "concurrent, single, hand-written, leased",
        "concurrent, batch 20, oncely Wait",
    ] {
        assert!(names.contains(&want), "no row {want:?} in {names:?}");
    }
}

#[test]
fn bench_on_the_default_sqlite_file() {
    bench_on(None, "sqlite");
}

#[test]
fn bench_on_memory() {
    bench_on(Some("memory:"), "memory");
}

#[test]
fn bench_on_postgres() {
    let Some(url) = reachable(
        "ONCELY_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
        "PostgreSQL",
    ) else {
        return;
    };
    bench_on(Some(&url), "postgres");
}

#[cfg(feature = "mysql")]
#[test]
fn bench_on_mysql() {
    let Some(url) = reachable(
        "ONCELY_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
        "MySQL/MariaDB",
    ) else {
        return;
    };
    bench_on(Some(&url), "mysql");
}

#[cfg(feature = "redis")]
#[test]
fn bench_on_redis() {
    let Some(url) = redis_url() else {
        return;
    };
    bench_on(Some(&url), "redis");
}

#[cfg(feature = "nats")]
#[test]
fn bench_on_nats() {
    let Some(url) = reachable("ONCELY_NATS_URL", "nats://127.0.0.1:4222", "NATS") else {
        return;
    };
    bench_on(Some(&url), "nats");
}

//! Encrypted outcomes at the command line, as the built `oncely` binary on
//! SQLite, PostgreSQL and MySQL: `get` and `inspect` show a sealed outcome as
//! encrypted (key id and size), never its bytes; `reencrypt` moves outcomes
//! to the active key (a dry run first, `--compress` deflating what shrinks),
//! lists what it cannot open, and refuses to run without keys.

use std::process::{Command, Output};

use oncely::backend::{Ledger, Outcome};
use oncely::codec::{Keyring, Sealed, SecretKey};
use oncely::{ClaimOptions, EffectKey};
use oncely_cli::AnyLedger;
use oncely_cli::commands::reencrypt::KEYS_ENV;
use serde_json::Value;

mod common;
use common::{acquired, reachable, runtime, stderr, stdout};

const SECRET: &str = "ch_secret_9931";

/// The outcome stored for the `i`th key: the secret alone, and for the
/// third a long, repetitive list that compresses.
fn outcome(i: usize) -> Outcome {
    if i < 2 {
        Outcome::value(&SECRET).unwrap()
    } else {
        Outcome::value(&vec![SECRET; 300]).unwrap()
    }
}

fn hex(byte: u8) -> String {
    format!("{byte:02x}").repeat(32)
}

/// Runs the binary with the keyring `keys` in the environment (or none).
fn run(args: &[&str], url: &str, keys: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oncely"));
    cmd.args(args)
        .args(["--database-url", url])
        .env_remove("ONCELY_DATABASE_URL")
        .env_remove(KEYS_ENV)
        .env_remove("ONCELY_OUTCOME_KEYS_FILE");
    if let Some(k) = keys {
        cmd.env(KEYS_ENV, k);
    }
    cmd.output().expect("the oncely binary runs")
}

fn json(out: &Output) -> Value {
    serde_json::from_str(&stdout(out)).unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(out), stderr(out)))
}

fn key_id(url: &str, key: &EffectKey) -> String {
    let out = run(&["inspect", key.as_str(), "--json"], url, None);
    assert!(out.status.success(), "{}", stderr(&out));
    json(&out)["outcome"]["encrypted"]["key_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn operate_on(url: &str) {
    let tenant = oncely::conformance::fresh_tenant();
    let keys: Vec<EffectKey> = (0..3)
        .map(|i| EffectKey::new(&tenant, "capture", format!("o-{i}")).unwrap())
        .collect();
    let rt = runtime();
    rt.block_on(async {
        let ledger = AnyLedger::connect(url).await.unwrap();
        let sealed = Sealed::new(
            ledger.clone(),
            Keyring::new("k1", SecretKey::from_hex(&hex(1)).unwrap()).unwrap(),
        );
        for (i, k) in keys.iter().enumerate() {
            let lease = acquired(sealed.claim(k, &ClaimOptions::default()).await.unwrap());
            sealed.complete(&lease, &outcome(i)).await.unwrap();
        }
        ledger.close().await;
    });

    // Shown as encrypted, never as bytes, in JSON and in text.
    for args in [
        vec!["get", keys[0].as_str()],
        vec!["inspect", keys[0].as_str(), "--json"],
    ] {
        let out = run(&args, url, None);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        let v = json(&out);
        assert_eq!(v["outcome"]["encrypted"]["key_id"], "k1", "{v}");
        assert!(!stdout(&out).contains(SECRET), "{}", stdout(&out));
    }
    // Opened on request, with the keyring.
    let k1 = format!("k1={}", hex(1));
    let opened = run(&["get", keys[0].as_str(), "--decrypt"], url, Some(&k1));
    assert!(opened.status.success(), "{}", stderr(&opened));
    let v = json(&opened);
    assert_eq!(
        (v["outcome"]["ok"].as_str(), v["decrypted_with"].as_str()),
        (Some(SECRET), Some("k1")),
        "{v}"
    );
    let lacking = run(
        &["get", keys[0].as_str(), "--decrypt"],
        url,
        Some(&format!("k9={}", hex(9))),
    );
    assert_eq!(lacking.status.code(), Some(1), "{}", stderr(&lacking));
    assert!(stderr(&lacking).contains("\"k1\""), "{}", stderr(&lacking));
    assert!(!stdout(&lacking).contains(SECRET));

    let text = run(&["inspect", keys[0].as_str()], url, None);
    assert!(stdout(&text).contains("encrypted (key k1, "), "{}", stdout(&text));
    let history = run(
        &["history", "--tenant", tenant.as_str(), "--subject", "o-1"],
        url,
        None,
    );
    assert!(
        stdout(&history).contains("encrypted (key k1, "),
        "{}",
        stdout(&history)
    );

    // No keys: a usage error, nothing read.
    let none = run(&["reencrypt", "--tenant", tenant.as_str()], url, None);
    assert_eq!(none.status.code(), Some(2), "{}", stderr(&none));
    assert!(stderr(&none).contains(KEYS_ENV), "{}", stderr(&none));

    // A keyring without k1: nothing opens, each record is listed, exit 1.
    let lacking = format!("k3={}", hex(3));
    let out = run(
        &["reencrypt", "--tenant", tenant.as_str(), "--json"],
        url,
        Some(&lacking),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["failed"].as_array().unwrap().len(), 3, "{v}");
    assert!(
        v["failed"][0]["error"].as_str().unwrap().contains("\"k1\""),
        "{v}"
    );
    assert!(!stdout(&out).contains(&hex(3)), "a key is never printed");

    // Rotation: k2 active, k1 decrypt-only. A dry run writes nothing.
    let rotated = format!("# rotated\n*k2={}\nk1={}\n", hex(2), hex(1));
    let dry = run(
        &["reencrypt", "--tenant", tenant.as_str(), "--dry-run", "--json"],
        url,
        Some(&rotated),
    );
    assert!(dry.status.success(), "{}", stderr(&dry));
    assert_eq!(
        (json(&dry)["resealed"].as_u64(), json(&dry)["dry_run"].as_bool()),
        (Some(3), Some(true))
    );
    assert_eq!(key_id(url, &keys[0]), "k1");

    let done = run(
        &["reencrypt", "--tenant", tenant.as_str(), "--compress", "--json"],
        url,
        Some(&rotated),
    );
    assert!(done.status.success(), "{}", stderr(&done));
    let v = json(&done);
    assert_eq!(
        (v["resealed"].as_u64(), v["active_key"].as_str()),
        (Some(3), Some("k2")),
        "{v}"
    );
    for k in &keys {
        assert_eq!(key_id(url, k), "k2");
    }
    // The run is recorded, with its counts; the dry run was not.
    assert!(json(&dry).get("audit_key").is_none());
    let audit_key = v["audit_key"].as_str().unwrap();
    assert!(
        audit_key.starts_with(&format!("{tenant}/oncely-audit:reencrypt:")),
        "{audit_key}"
    );
    let audit = run(&["get", audit_key], url, None);
    let entry = &json(&audit)["outcome"]["ok"];
    assert_eq!(
        (
            entry["action"].as_str(),
            entry["resealed"].as_u64(),
            entry["active_key"].as_str()
        ),
        (Some("reencrypt"), Some(3), Some("k2")),
        "{}",
        stdout(&audit)
    );
    // --compress deflated the long outcome and left the short ones as they were.
    let compressed = |k: &EffectKey| {
        let out = run(&["inspect", k.as_str(), "--json"], url, None);
        json(&out)["outcome"]["encrypted"]["compressed"].as_bool()
    };
    assert_eq!(
        keys.iter().map(compressed).collect::<Vec<_>>(),
        [Some(false), Some(false), Some(true)]
    );
    let again = run(&["reencrypt", "--tenant", tenant.as_str()], url, Some(&rotated));
    assert!(stdout(&again).contains("re-sealed 0 of 3"), "{}", stdout(&again));

    // The old key is no longer needed to read them.
    rt.block_on(async {
        let ledger = AnyLedger::connect(url).await.unwrap();
        let only_k2 = Sealed::new(
            ledger.clone(),
            Keyring::new("k2", SecretKey::from_hex(&hex(2)).unwrap()).unwrap(),
        );
        for (i, k) in keys.iter().enumerate() {
            let r = only_k2.get(k).await.unwrap().unwrap();
            assert_eq!(r.outcome, Some(outcome(i)));
        }
        ledger.close().await;
    });
}

#[test]
fn encrypted_outcomes_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("ledger.db").display());
    operate_on(&url);
}

#[test]
fn encrypted_outcomes_on_postgres() {
    let Some(url) = reachable(
        "ONCELY_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
        "PostgreSQL",
    ) else {
        return;
    };
    operate_on(&url);
}

#[cfg(feature = "mysql")]
#[test]
fn encrypted_outcomes_on_mysql() {
    let Some(url) = reachable(
        "ONCELY_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
        "MySQL/MariaDB",
    ) else {
        return;
    };
    operate_on(&url);
}

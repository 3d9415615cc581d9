//! Erasure on a data-protection request, end to end through the binary, on
//! SQLite, PostgreSQL and MySQL: a person's effects, keyed by a hashed
//! subject, are looked up from the raw subject with the subject key, erased
//! by `oncely erase`, and afterwards a dump of the table made with the
//! database's own tool (`sqlite3 .dump`, `pg_dump`, `mysqldump`) holds none
//! of their outcome's or fingerprint's bytes, nor the raw subject, nor the
//! payload and headers of the outbox message sent for them, while a
//! redelivery of an erased effect does not run.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

use common::{oncely, reachable, runtime, stderr, stdout};
use oncely::backend::{Fingerprint, Ledger, Outcome};
use oncely::outbox::{Message, TransactionalOutbox};
use oncely::{ClaimOptions, EffectKey, Effects, Error, Failure, SubjectKey, Tenant};
use oncely_cli::AnyLedger;
use oncely_testkit::dump;
use serde_json::Value;

const PERSON: &str = "alice@example.com";
const SECRET: &str = "secret-outcome-of-alice-4242";
const KEPT: &str = "outcome-of-another-order-7777";
const MAIL: &str = "mail-body-for-alice-5151";
const MAIL_HEADER: &str = "mail-header-for-alice-5252";
const MAIL_KEPT: &str = "mail-body-of-order-7-6161";

/// Enqueues one outbox message per `(key, payload)` on the ledger's own
/// outbox, then has them claimed and marked sent, as a relay would.
async fn send<L: TransactionalOutbox>(ledger: &L, messages: &[(&EffectKey, &str)]) {
    let mut tx = ledger.begin().await.unwrap();
    for (key, payload) in messages {
        let m = Message::new("mail", payload.as_bytes().to_vec())
            .unwrap()
            .header("x-note", MAIL_HEADER)
            .unwrap();
        ledger.enqueue_in(&mut tx, key, &m).await.unwrap();
    }
    ledger.commit(tx).await.unwrap();
    let claimed = ledger
        .claim_messages(10, std::time::Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(claimed.len(), messages.len());
    let tickets: Vec<_> = claimed.iter().map(|m| m.ticket()).collect();
    assert!(ledger.mark_sent(&tickets).await.unwrap().iter().all(|&sent| sent));
}

fn json_of(out: &std::process::Output) -> Value {
    serde_json::from_str(&stdout(out)).unwrap_or_else(|e| panic!("{e}: {}{}", stdout(out), stderr(out)))
}

/// The whole story on the ledger at `url`, whose table `dump` prints.
fn erase_story(url: &str, dir: &Path, dump: impl Fn() -> Vec<u8>) {
    let tenant = Tenant::new(format!("erase-{}", std::process::id())).unwrap();
    let secret_key = SubjectKey::from_bytes(*blake3_key());
    let key_file = dir.join("subject.key");
    std::fs::write(&key_file, hex(blake3_key())).unwrap();
    let key_file = key_file.to_str().unwrap().to_owned();
    let capture = EffectKey::hashed(&tenant, "capture", PERSON, &secret_key).unwrap();
    let receipt = EffectKey::hashed(&tenant, "receipt", PERSON, &secret_key).unwrap();
    let refund = EffectKey::hashed(&tenant, "refund", PERSON, &secret_key).unwrap();
    let other = EffectKey::new(&tenant, "capture", "order-7").unwrap();
    let mail = EffectKey::hashed(&tenant, "mail", PERSON, &secret_key).unwrap();
    let other_mail = EffectKey::new(&tenant, "mail", "order-7").unwrap();
    let fp = Fingerprint::of_bytes(b"card 4242 4242 4242 4242, alice@example.com");
    let opts = ClaimOptions::default().fingerprint(fp);

    runtime().block_on(async {
        let l = AnyLedger::connect(url).await.unwrap();
        for k in [&capture, &receipt, &refund] {
            let lease = common::acquired(l.claim(k, &opts).await.unwrap());
            l.complete(&lease, &Outcome::value(&SECRET).unwrap())
                .await
                .unwrap();
        }
        let other_fp = ClaimOptions::default().fingerprint(Fingerprint::of_bytes(b"order 7"));
        let lease = common::acquired(l.claim(&other, &other_fp).await.unwrap());
        l.complete(&lease, &Outcome::value(&KEPT).unwrap()).await.unwrap();
        let messages = [(&mail, MAIL), (&other_mail, MAIL_KEPT)];
        match &l {
            AnyLedger::Sqlite(l) => send(l, &messages).await,
            AnyLedger::Postgres(l) => send(l, &messages).await,
            #[cfg(feature = "mysql")]
            AnyLedger::MySql(l) => send(l, &messages).await,
            #[allow(unreachable_patterns)]
            _ => unreachable!("a SQL ledger"),
        }
        l.close().await;
    });
    let before = dump();
    assert!(
        dump::contains(&before, SECRET.as_bytes()),
        "control: the dump shows outcomes"
    );
    assert!(
        dump::contains(&before, fp.as_bytes()),
        "control: the dump shows fingerprints"
    );
    assert!(
        !dump::contains(&before, PERSON.as_bytes()),
        "a hashed subject is never stored raw"
    );
    for control in [MAIL, MAIL_HEADER] {
        assert!(
            dump::contains(&before, control.as_bytes()),
            "control: the dump shows the outbox"
        );
    }

    // The raw subject round-trips through the CLI's lookup with the key.
    let raw_key = format!("{tenant}/capture:{PERSON}");
    let got = oncely(&[
        "get",
        &raw_key,
        "--subject-key-file",
        &key_file,
        "--database-url",
        url,
    ]);
    assert!(got.status.success(), "{}", stderr(&got));
    assert_eq!(json_of(&got)["key"], capture.to_string());
    let without = oncely(&["get", &raw_key, "--database-url", url]);
    assert_eq!(
        without.status.code(),
        Some(3),
        "the raw subject is not stored: {}",
        stdout(&without)
    );
    let history = oncely(&[
        "history",
        "--tenant",
        tenant.as_str(),
        "--subject",
        PERSON,
        "--subject-key-file",
        &key_file,
        "--json",
        "--database-url",
        url,
    ]);
    assert!(history.status.success(), "{}", stderr(&history));
    assert_eq!(json_of(&history)["records"].as_array().unwrap().len(), 3);

    // A forget recorded on one of them: its audit record names the key.
    let forgot = oncely(&["forget", refund.as_str(), "--database-url", url]);
    assert!(forgot.status.success(), "{}", stderr(&forgot));

    let run = |dry: bool| {
        let mut a = vec![
            "erase",
            "--tenant",
            tenant.as_str(),
            "--subject",
            PERSON,
            "--subject-key-file",
            &key_file,
            "--json",
            "--database-url",
            url,
        ];
        if dry {
            a.push("--dry-run");
        }
        oncely(&a)
    };
    let dry = run(true);
    assert!(dry.status.success(), "{}", stderr(&dry));
    let report = json_of(&dry);
    assert_eq!(report["erased"].as_array().unwrap().len(), 3, "{report}");
    assert_eq!(
        report["audit_records_erased"].as_array().unwrap().len(),
        1,
        "{report}"
    );
    assert_eq!(
        report["messages_erased"],
        serde_json::json!([mail.to_string()]),
        "a dry run lists the outbox too: {report}"
    );
    let untouched = dump();
    for kept in [SECRET, MAIL] {
        assert!(
            dump::contains(&untouched, kept.as_bytes()),
            "a dry run writes nothing"
        );
    }

    let done = run(false);
    assert!(done.status.success(), "{}{}", stdout(&done), stderr(&done));
    let report = json_of(&done);
    let mut erased: Vec<String> = report["erased"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    erased.sort();
    let mut want = vec![capture.to_string(), receipt.to_string(), refund.to_string()];
    want.sort();
    assert_eq!(erased, want);
    assert!(report["pending"].as_array().unwrap().is_empty());
    assert_eq!(report["messages_erased"], serde_json::json!([mail.to_string()]));
    assert!(report["messages_pending"].as_array().unwrap().is_empty());
    assert!(
        report["audit_key"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{tenant}/oncely-audit:erase:"))
    );

    let after = dump();
    assert!(
        !dump::contains(&after, SECRET.as_bytes()),
        "no byte of an erased outcome is left"
    );
    assert!(
        !dump::contains(&after, fp.as_bytes()),
        "no erased fingerprint is left"
    );
    assert!(
        !dump::contains(&after, PERSON.as_bytes()),
        "the raw subject appears nowhere"
    );
    assert!(
        dump::contains(&after, KEPT.as_bytes()),
        "another subject's outcome is kept"
    );
    assert!(
        !dump::contains(&after, MAIL.as_bytes()),
        "no byte of the subject's sent message is left"
    );
    assert!(
        dump::contains(&after, MAIL_KEPT.as_bytes()),
        "another subject's message is kept"
    );
    assert!(
        dump::contains(&after, MAIL_HEADER.as_bytes()),
        "another subject's message keeps its headers"
    );

    // A redelivery of an erased effect does not run.
    runtime().block_on(async {
        let l = AnyLedger::connect(url).await.unwrap();
        let e = l.claim(&capture, &opts).await.unwrap_err();
        assert!(matches!(e, Error::Erased { .. }), "{e:?}");
        let runs = AtomicU32::new(0);
        let effects = Effects::new(l.clone());
        let e = effects
            .run(&receipt, &opts, async |_| {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Failure>(1)
            })
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Erased { .. }), "{e:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler never ran");
        l.close().await;
    });
    // get shows the erased record as such.
    let got = oncely(&[
        "get",
        &raw_key,
        "--subject-key-file",
        &key_file,
        "--database-url",
        url,
    ]);
    let view = json_of(&got);
    assert!(view["outcome"].is_null(), "{view}");
    let inspected = oncely(&["inspect", capture.as_str(), "--json", "--database-url", url]);
    assert_eq!(json_of(&inspected)["class"], "erased", "{}", stdout(&inspected));
}

/// A fixed 32-byte subject key for the tests.
fn blake3_key() -> &'static [u8; 32] {
    &[0x5a; 32]
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn erase_on_sqlite_leaves_nothing_in_a_dump() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ledger.db");
    let url = format!("sqlite://{}?mode=rwc", file.display());
    erase_story(&url, dir.path(), || dump::sqlite(&file).expect("sqlite3 .dump"));
}

#[test]
fn erase_on_postgres_leaves_nothing_in_a_dump() {
    let Some(base) = reachable(
        "ONCELY_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
        "PostgreSQL",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let schema = format!("oncely_erase_{}", std::process::id());
    let url = format!("{base}?schema={schema}&table=effects");
    erase_story(&url, dir.path(), || {
        let mut d = dump::postgres(&base, &format!("{schema}.effects")).expect("pg_dump");
        d.extend(dump::postgres(&base, &format!("{schema}.effects_outbox")).expect("pg_dump"));
        d
    });
    runtime().block_on(async {
        let l = oncely_postgres::PgLedger::connect(&base).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(l.pool())
        .await
        .unwrap();
        l.pool().close().await;
    });
}

#[cfg(feature = "mysql")]
#[test]
fn erase_on_mysql_leaves_nothing_in_a_dump() {
    let Some(base) = reachable(
        "ONCELY_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
        "MySQL/MariaDB",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let table = format!("oncely_erase_{}", std::process::id());
    let url = format!("{base}?table={table}");
    let (host, port, db) = mysql_parts(&base);
    erase_story(&url, dir.path(), || {
        let mut d = dump::mysql(&host, port, &db, &table).expect("mysqldump");
        d.extend(dump::mysql(&host, port, &db, &format!("{table}_outbox")).expect("mysqldump"));
        d
    });
    runtime().block_on(async {
        let l = oncely_mysql::MySqlLedger::connect(&base).await.unwrap();
        for t in [
            table.clone(),
            format!("{table}_horizon"),
            format!("{table}_outbox"),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS `{t}`")))
                .execute(l.pool())
                .await
                .unwrap();
        }
        l.pool().close().await;
    });
}

/// Host, port and database of a `mysql://user@host:port/db` URL.
#[cfg(feature = "mysql")]
fn mysql_parts(url: &str) -> (String, u16, String) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.split_once('@').map_or(rest, |(_, r)| r);
    let (hostport, db) = rest.split_once('/').unwrap_or((rest, "test"));
    let db = db.split('?').next().unwrap_or("test");
    let (host, port) = hostport.split_once(':').unwrap_or((hostport, "3306"));
    (host.to_owned(), port.parse().unwrap_or(3306), db.to_owned())
}

//! `oncely relay`: committed outbox messages published to a broker (Redis
//! Streams here, read back with XRANGE) and marked sent; a second run finds
//! nothing; a bad broker URL and a backend without an outbox are usage
//! errors (exit 2) before anything is published.

use std::process::{Command, Output};

use oncely::EffectKey;
use oncely::backend::TransactionalLedger;
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::outbox::{Message, TransactionalOutbox};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use serde_json::Value;

fn oncely(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oncely"))
        .args(args)
        .env_remove("ONCELY_DATABASE_URL")
        .env_remove("ONCELY_RELAY_TO")
        .output()
        .expect("the oncely binary runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_publishes_committed_messages_once() {
    let Some(pg) = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    ) else {
        return;
    };
    let redis = service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379")).unwrap();
    const TABLE: &str = "oncely_cli_relay";
    let ledger = match PgLedger::connect_with(&pg, PgLedgerOptions::default().table(TABLE)).await {
        Ok(l) => l,
        Err(e) => {
            skip_or_fail::<()>(&format!("PostgreSQL at {pg}: {e}"));
            return;
        }
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DELETE FROM {TABLE}_outbox")))
        .execute(ledger.pool())
        .await
        .unwrap();
    let t = fresh_tenant();
    let stream = format!("oncely-cli-relay-{t}");
    let mut ids = Vec::new();
    for i in 0..5 {
        let key = EffectKey::new(&t, "order.paid", format!("order-{i}")).unwrap();
        ids.push(key.provider_key());
        let mut tx = ledger.begin().await.unwrap();
        ledger
            .enqueue_in(
                &mut tx,
                &key,
                &Message::new(&stream, format!("paid {i}")).unwrap(),
            )
            .await
            .unwrap();
        ledger.commit(tx).await.unwrap();
    }
    let url = format!("{pg}?table={TABLE}");
    let out = oncely(&[
        "relay",
        "--database-url",
        &url,
        "--to",
        &redis,
        "--drain",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    assert_eq!(
        (v["sent"].as_u64(), v["pending"].as_u64()),
        (Some(5), Some(0)),
        "{v}"
    );
    assert!(v["ledger"].as_str().unwrap().contains(TABLE), "{v}");

    let client = redis::Client::open(redis.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let entries: Vec<(String, std::collections::HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(&stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    let got: Vec<String> = entries.iter().map(|(_, f)| f["message_id"].clone()).collect();
    assert_eq!(got, ids, "each message once, with its effect key's id, in order");
    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut conn)
        .await
        .unwrap();

    // Nothing left: a second run publishes nothing.
    let out = oncely(&["relay", "--database-url", &url, "--to", &redis, "--drain"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("published 0 messages from postgres"), "{text}");

    let out = oncely(&[
        "relay",
        "--database-url",
        &url,
        "--to",
        "kafkaesque://x",
        "--drain",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no broker for"),
        "{out:?}"
    );
    let out = oncely(&["relay", "--database-url", "memory:", "--to", &redis, "--drain"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no transactional outbox"),
        "{out:?}"
    );
}

//! `RedisLedger::from_url` (`oncely::open::FromUrl`): the URL names the
//! key prefix (`?prefix=`), and a query parameter neither the ledger nor the
//! redis client reads is refused by name before anything connects.

use oncely::backend::{Claim, Ledger, Outcome, RecordState};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::open::{Access, FromUrl, OpenOptions};
use oncely::{ClaimOptions, EffectKey, Error};
use oncely_redis::{RedisLedger, RedisLedgerOptions};

/// `url` with `query` appended (after its own query, if any).
fn with_query(url: &str, query: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

/// A ledger the application opened with `RedisLedgerOptions::prefix(..)`
/// is the one `?prefix=` opens, for every access, and the default URL opens
/// another (the `oncely:` keys, without the record). `connect_with` reads
/// it too, over its options'. The ledger says what it reads.
#[tokio::test]
async fn the_url_names_the_prefix() {
    let Some(url) = service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379")) else {
        return;
    };
    let prefix = format!("oncely-url-{}:", std::process::id());
    // The test server persists nothing: accepted for the test.
    let app = match RedisLedger::connect_with(
        &url,
        RedisLedgerOptions::default().prefix(&prefix).ephemeral(true),
    )
    .await
    {
        Ok(l) => l,
        Err(e) => return skip_or_fail(&format!("redis at {url}: {e}")).unwrap_or(()),
    };
    let done = EffectKey::new(&fresh_tenant(), "capture", "in-prefix").unwrap();
    let Claim::Acquired(lease) = app.claim(&done, &ClaimOptions::default()).await.unwrap() else {
        panic!("a fresh key")
    };
    app.complete(&lease, &Outcome::from_json(&"ch_1").unwrap())
        .await
        .unwrap();

    // `:` needs no escape in a query; `%3A` is the same prefix.
    for named in [
        with_query(&url, &format!("prefix={prefix}&ephemeral=true")),
        with_query(
            &url,
            &format!("ephemeral=true&prefix={}", prefix.replace(':', "%3A")),
        ),
    ] {
        for access in [Access::ReadOnly, Access::Existing, Access::Migrate] {
            let l = RedisLedger::from_url(&named, OpenOptions::new(access))
                .await
                .unwrap();
            let r = l.get(&done).await.unwrap();
            assert_eq!(
                r.map(|r| r.state),
                Some(RecordState::Completed),
                "{named} {access:?}"
            );
            let shown = l.to_string();
            assert!(shown.starts_with("redis "), "{shown}");
            assert!(shown.ends_with(&format!(", prefix {prefix}")), "{shown}");
        }
    }
    let l = RedisLedger::connect_with(
        &with_query(&url, &format!("prefix={prefix}")),
        RedisLedgerOptions::default().prefix("from-code:").read_only(true),
    )
    .await
    .unwrap();
    assert!(l.get(&done).await.unwrap().is_some());

    let default = RedisLedger::from_url(&url, OpenOptions::new(Access::ReadOnly))
        .await
        .unwrap();
    assert!(default.get(&done).await.unwrap().is_none());
    assert!(default.to_string().ends_with(", prefix oncely:"), "{default}");

    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: i64 = redis::cmd("DEL")
        .arg(app.redis_key(&done))
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// A mistyped or unknown parameter (the redis client alone ignores it) and
/// a duplicate one are configuration errors naming it, before anything
/// connects (port 1 is closed: a connection attempt would be
/// `Unavailable`), on one server and on a cluster, without the password.
#[tokio::test]
async fn unknown_url_parameters_are_refused_before_connecting() {
    for (url, says) in [
        (
            "redis://:hunter2@127.0.0.1:1?prefx=app:",
            "unknown Redis URL parameter 'prefx' (expected prefix, ephemeral, wait_replicas, wait_timeout_ms, or one its driver reads: protocol)",
        ),
        (
            "redis://127.0.0.1:1/0?table=x",
            "unknown Redis URL parameter 'table'",
        ),
        (
            "redis+cluster://:hunter2@127.0.0.1:1,127.0.0.1:2?bucket=x",
            "unknown Redis URL parameter 'bucket'",
        ),
        (
            "redis://127.0.0.1:1?prefix=a:&prefix=b:",
            "Redis URL parameter prefix is given twice",
        ),
        ("redis://127.0.0.1:1?prefix=a%7Bb", "redis key prefix \"a{b\""),
        (
            "redis+sentinel://:hunter2@127.0.0.1:1,127.0.0.1:2/mymaster?tabel=x",
            "unknown Redis URL parameter 'tabel'",
        ),
        (
            "redis://:hunter2@127.0.0.1:1?wait_replicas=one",
            "wait_replicas must be a whole number",
        ),
        (
            "redis://127.0.0.1:1?wait_timeout_ms=50",
            "wait_timeout_ms goes with wait_replicas",
        ),
        // A WAIT without a timeout blocks forever; one as long as the
        // response timeout ends every stalled write as a response timeout.
        (
            "redis://127.0.0.1:1?wait_replicas=1&wait_timeout_ms=0",
            "must be at least 1 ms and shorter than the response timeout",
        ),
        (
            "redis+sentinel://127.0.0.1:1/m?wait_replicas=1&wait_timeout_ms=5000",
            "must be at least 1 ms and shorter than the response timeout",
        ),
    ] {
        for access in [Access::Migrate, Access::Existing, Access::ReadOnly] {
            match RedisLedger::from_url(url, OpenOptions::new(access)).await {
                Err(Error::Config(m)) => {
                    assert!(m.contains(says), "{url} {access:?}: {m}");
                    assert!(!m.contains("hunter2"), "{url} {access:?}: {m}");
                }
                Err(e) => panic!("{url} {access:?}: {e:?}"),
                Ok(_) => panic!("{url} {access:?} opened"),
            }
        }
    }
}

/// `from_client_with` opens the ledger of a caller's `redis::Client` with
/// the options' prefix: the same records as `connect_with`, the same
/// checks, and it says which server it reads.
#[tokio::test]
async fn a_callers_client_opens_the_same_ledger() {
    let Some(url) = service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379")) else {
        return;
    };
    let prefix = format!("oncely-client-{}:", std::process::id());
    // The test server persists nothing: accepted for the test.
    let options = RedisLedgerOptions::default().prefix(&prefix).ephemeral(true);
    let app = match RedisLedger::connect_with(&url, options.clone()).await {
        Ok(l) => l,
        Err(e) => return skip_or_fail(&format!("redis at {url}: {e}")).unwrap_or(()),
    };
    let done = EffectKey::new(&fresh_tenant(), "capture", "from-client").unwrap();
    let Claim::Acquired(lease) = app.claim(&done, &ClaimOptions::default()).await.unwrap() else {
        panic!("a fresh key")
    };
    app.complete(&lease, &Outcome::from_json(&"ch_1").unwrap())
        .await
        .unwrap();

    let parsed = oncely_redis::RedisUrl::parse(&url).unwrap();
    let client = redis::Client::open(parsed.nodes()[0].as_str()).unwrap();
    let l = RedisLedger::from_client_with(client, options).await.unwrap();
    let r = l.get(&done).await.unwrap();
    assert_eq!(r.map(|r| r.state), Some(RecordState::Completed));
    let shown = l.to_string();
    assert!(shown.contains(&parsed.servers()), "{shown}");
    assert!(shown.ends_with(&format!(", prefix {prefix}")), "{shown}");
}

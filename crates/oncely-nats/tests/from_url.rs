//! `NatsKvLedger::from_url` (`oncely::open::FromUrl`): the URL names the
//! bucket (`?bucket=`), and any other query parameter is refused by name
//! before anything connects, through the rule every backend shares.

use oncely::backend::{Claim, Ledger, Outcome, RecordState};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::open::{Access, FromUrl, OpenOptions};
use oncely::{ClaimOptions, EffectKey, Error};
use oncely_nats::{NatsKvLedger, NatsKvLedgerOptions};

/// A ledger the application opened with `NatsKvLedgerOptions::bucket(..)` is the
/// one `?bucket=` opens, for every access; the default URL opens another
/// bucket, without the record. The ledger says what it reads.
#[tokio::test]
async fn the_url_names_the_bucket() {
    let Some(url) = service_url("ONCELY_NATS_URL", Some("nats://127.0.0.1:4222")) else {
        return;
    };
    let bucket = format!("oncely_url_{}", std::process::id());
    let app = match NatsKvLedger::connect_with(&url, NatsKvLedgerOptions::default().bucket(&bucket)).await {
        Ok(l) => l,
        Err(e) => return skip_or_fail(&format!("NATS at {url}: {e}")).unwrap_or(()),
    };
    let done = EffectKey::new(&fresh_tenant(), "capture", "in-bucket").unwrap();
    let Claim::Acquired(lease) = app.claim(&done, &ClaimOptions::default()).await.unwrap() else {
        panic!("a fresh key")
    };
    app.complete(&lease, &Outcome::from_json(&"ch_1").unwrap())
        .await
        .unwrap();

    let named = format!("{url}?bucket={bucket}");
    for access in [Access::ReadOnly, Access::Existing, Access::Migrate] {
        let l = NatsKvLedger::from_url(&named, OpenOptions::new(access))
            .await
            .unwrap();
        let r = l.get(&done).await.unwrap();
        assert_eq!(r.map(|r| r.state), Some(RecordState::Completed), "{access:?}");
        let shown = l.to_string();
        assert!(shown.starts_with("nats "), "{shown}");
        assert!(shown.ends_with(&format!(", bucket {bucket}")), "{shown}");
    }
    let default = NatsKvLedger::from_url(&url, OpenOptions::new(Access::Migrate))
        .await
        .unwrap();
    assert!(default.get(&done).await.unwrap().is_none());
    assert!(
        default.to_string().ends_with(", bucket oncely_effects"),
        "{default}"
    );

    let client = async_nats::connect(url.as_str()).await.unwrap();
    async_nats::jetstream::new(client)
        .delete_key_value(&bucket)
        .await
        .unwrap();
}

/// A mistyped or unknown parameter and a duplicate one are configuration
/// errors naming it, before anything connects (port 1 is closed: a
/// connection attempt would be `Unavailable`), without the password.
#[tokio::test]
async fn unknown_url_parameters_are_refused_before_connecting() {
    for (url, says) in [
        (
            "nats://u:hunter2@127.0.0.1:1?buckt=x",
            "unknown NATS URL parameter 'buckt' (expected bucket, replicas)",
        ),
        (
            "nats://127.0.0.1:1,127.0.0.1:2?table=x",
            "unknown NATS URL parameter 'table'",
        ),
        (
            "nats://127.0.0.1:1?bucket=a&bucket=b",
            "NATS URL parameter bucket is given twice",
        ),
        ("nats://127.0.0.1:1?replicas=2", "replicas must be 1 or 3"),
    ] {
        for access in [Access::Migrate, Access::Existing, Access::ReadOnly] {
            match NatsKvLedger::from_url(url, OpenOptions::new(access)).await {
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

/// `from_client_with` opens the options' bucket on a caller's connection:
/// the same records as `connect_with`, and it says it is the caller's
/// connection.
#[tokio::test]
async fn a_callers_client_opens_the_same_ledger() {
    let Some(url) = service_url("ONCELY_NATS_URL", Some("nats://127.0.0.1:4222")) else {
        return;
    };
    let bucket = format!("oncely_client_{}", std::process::id());
    let options = NatsKvLedgerOptions::default().bucket(&bucket);
    let app = match NatsKvLedger::connect_with(&url, options.clone()).await {
        Ok(l) => l,
        Err(e) => return skip_or_fail(&format!("NATS at {url}: {e}")).unwrap_or(()),
    };
    let done = EffectKey::new(&fresh_tenant(), "capture", "from-client").unwrap();
    let Claim::Acquired(lease) = app.claim(&done, &ClaimOptions::default()).await.unwrap() else {
        panic!("a fresh key")
    };
    app.complete(&lease, &Outcome::from_json(&"ch_1").unwrap())
        .await
        .unwrap();

    let addrs = oncely_nats::NatsUrl::parse(&url).unwrap().addrs().unwrap();
    let client = async_nats::connect(addrs).await.unwrap();
    let l = NatsKvLedger::from_client_with(client, options.read_only(true))
        .await
        .unwrap();
    let r = l.get(&done).await.unwrap();
    assert_eq!(r.map(|r| r.state), Some(RecordState::Completed));
    assert_eq!(
        l.to_string(),
        format!("nats (the caller's connection), bucket {bucket}")
    );
    async_nats::jetstream::new(async_nats::connect(url.as_str()).await.unwrap())
        .delete_key_value(&bucket)
        .await
        .unwrap();
}

//! Backend-specific behaviour on the single NATS server: bucket settings
//! are checked, never silently changed, and an unreachable server fails
//! closed.

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::{Claim, ClaimOptions, EffectKey, Error, Ledger, Outcome, RecordState};
use oncely_nats::{NatsKvLedger, NatsKvOptions};

async fn js() -> Option<(String, jetstream::Context)> {
    let url = service_url("ONCELY_NATS_URL", Some("nats://127.0.0.1:4222"))?;
    match async_nats::connect(url.as_str()).await {
        Ok(c) => Some((url, jetstream::new(c))),
        Err(e) => skip_or_fail(&format!("NATS at {url}: {e}")),
    }
}

fn kv_stream(bucket: &str) -> stream::Config {
    stream::Config {
        name: format!("KV_{bucket}"),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: 1,
        max_messages: -1,
        max_bytes: -1,
        max_age: Duration::from_secs(30 * 86_400),
        max_message_size: -1,
        storage: stream::StorageType::File,
        num_replicas: 1,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: stream::DiscardPolicy::New,
        ..Default::default()
    }
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            % 1_000_000_000
    )
}

/// A change to a compatible bucket's settings.
type Tweak = Box<dyn Fn(&mut stream::Config)>;

/// Each incompatible setting is refused with `Error::Config`, and the
/// bucket's configuration is exactly what it was.
#[tokio::test]
async fn incompatible_buckets_are_refused_and_left_unchanged() {
    let Some((url, js)) = js().await else { return };
    let cases: Vec<(&str, Tweak, NatsKvOptions, &str)> = vec![
        (
            "history",
            Box::new(|c| c.max_messages_per_subject = 5),
            NatsKvOptions::default(),
            "history",
        ),
        (
            "max_age",
            Box::new(|c| c.max_age = Duration::from_secs(3 * 86_400)),
            NatsKvOptions::default(),
            "max_age",
        ),
        (
            "replicas",
            Box::new(|_| {}),
            NatsKvOptions::default().replicas(3),
            "replicas",
        ),
        (
            "memory",
            Box::new(|c| c.storage = stream::StorageType::Memory),
            NatsKvOptions::default(),
            "memory",
        ),
        (
            "max_msgs",
            Box::new(|c| c.max_messages = 1000),
            NatsKvOptions::default(),
            "max_msgs",
        ),
        (
            "max_bytes",
            Box::new(|c| c.max_bytes = 1 << 20),
            NatsKvOptions::default(),
            "max_bytes",
        ),
        (
            "value_size",
            Box::new(|c| c.max_message_size = 1024),
            NatsKvOptions::default(),
            "max_value_size",
        ),
    ];
    for (name, tweak, opts, needle) in cases {
        let bucket = unique(&format!("oncely_bad_{name}"));
        let mut cfg = kv_stream(&bucket);
        tweak(&mut cfg);
        let mut created = js.create_stream(cfg).await.unwrap();
        let before = created.info().await.unwrap().config.clone();
        let e = NatsKvLedger::connect(&url, opts.bucket(&bucket))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Config(m) if m.contains(needle)),
            "{name}: {e:?}"
        );
        let mut after = js.get_stream(format!("KV_{bucket}")).await.unwrap();
        let after = after.info().await.unwrap();
        assert_eq!(after.config, before, "{name}: the bucket was changed");
        assert_eq!(after.state.messages, 0, "{name}: something was written");
        js.delete_stream(format!("KV_{bucket}")).await.unwrap();
    }
}

/// A compatible bucket made by someone else (longer max_age) is used as it
/// is; claims asking for more retention than max_age are refused up front.
#[tokio::test]
async fn compatible_bucket_is_used_and_retention_is_capped() {
    let Some((url, js)) = js().await else { return };
    let bucket = unique("oncely_ok");
    let mut cfg = kv_stream(&bucket);
    cfg.max_age = Duration::from_secs(60 * 86_400);
    js.create_stream(cfg).await.unwrap();
    let ledger = NatsKvLedger::connect(&url, NatsKvOptions::default().bucket(&bucket))
        .await
        .unwrap();
    let k = EffectKey::new(&fresh_tenant(), "capture", "o-1").unwrap();
    let too_long = ClaimOptions::default().retention(Duration::from_secs(31 * 86_400));
    let e = ledger.claim(&k, &too_long).await.unwrap_err();
    assert!(e.is_invalid_input(), "{e:?}");
    assert!(ledger.get(&k).await.unwrap().is_none());
    let l = match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    assert_eq!(
        ledger.get(&k).await.unwrap().unwrap().state,
        RecordState::Completed
    );
    js.delete_stream(format!("KV_{bucket}")).await.unwrap();
}

/// Bad options fail before any connection.
#[tokio::test]
async fn bad_options_are_config_errors() {
    for opts in [
        NatsKvOptions::default().replicas(2),
        NatsKvOptions::default().bucket("a.b"),
        NatsKvOptions::default().bucket(""),
        NatsKvOptions::default().max_age(Duration::from_secs(3600)),
    ] {
        let e = NatsKvLedger::connect("nats://127.0.0.1:1", opts.clone())
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{opts:?}: {e:?}");
    }
    let e = NatsKvLedger::connect("not a url at all ::", NatsKvOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    // A bad address in a list is named by position, never quoted: it may
    // carry a password.
    let e = NatsKvLedger::connect(
        "nats://127.0.0.1:1,nats://u:hunter2@[bad:4222",
        NatsKvOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(!e.to_string().contains("hunter2"), "{e}");
    assert!(e.to_string().contains("#2"), "{e}");
}

/// Nobody listening: `Unavailable`, retryable, and nothing ran.
#[tokio::test]
async fn unreachable_server_is_unavailable() {
    let opts = NatsKvOptions::default().connect_timeout(Duration::from_millis(500));
    let e = NatsKvLedger::connect("nats://127.0.0.1:1", opts)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable { backend: "nats", .. }), "{e:?}");
    assert!(e.is_retryable());
}

/// A NATS server on port 4390 started without JetStream; killed on drop.
struct NoJetStream(std::process::Child);

impl Drop for NoJetStream {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A server without JetStream is a deployment mistake, not a transient state:
/// `connect` says so at once with `Error::Config` instead of waiting out
/// `open_timeout` (ten minutes here, so waiting would fail the test too).
#[tokio::test]
async fn server_without_jetstream_is_a_config_error_at_once() {
    let bin = std::env::var("NATS_SERVER").unwrap_or_else(|_| "/usr/sbin/nats-server".to_owned());
    let child = match std::process::Command::new(&bin)
        .args(["-a", "127.0.0.1", "-p", "4390"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            skip_or_fail::<()>(&format!("starting {bin}: {e}"));
            return;
        }
    };
    let _server = NoJetStream(child);
    let url = "nats://127.0.0.1:4390";
    let opts = || NatsKvOptions::default().open_timeout(Duration::from_secs(600));
    // The server takes a moment to listen; only a refused connection is retried.
    let mut attempts = 0;
    let e = loop {
        match NatsKvLedger::connect(url, opts()).await {
            Err(Error::Unavailable { .. }) if attempts < 50 => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(_) => panic!("connected to a server without JetStream"),
            Err(e) => break e,
        }
    };
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(e.to_string().contains("JetStream"), "{e}");
}

/// A value written at an oncely key by something else is reported as
/// corrupt and never overwritten.
#[tokio::test]
async fn foreign_values_are_not_overwritten() {
    let Some((url, js)) = js().await else { return };
    let bucket = unique("oncely_foreign");
    let ledger = NatsKvLedger::connect(&url, NatsKvOptions::default().bucket(&bucket))
        .await
        .unwrap();
    let t = fresh_tenant();
    let k = EffectKey::new(&t, "capture", "o-1").unwrap();
    // Find the KV key by claiming once, then overwrite it behind the ledger's back.
    let l = match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    let store = ledger.store().clone();
    let mut keys = futures_util::StreamExt::boxed(store.keys().await.unwrap());
    let mut kv_key = None;
    while let Some(key) = futures_util::StreamExt::next(&mut keys).await {
        let key = key.unwrap();
        if key.contains('.') {
            kv_key = Some(key);
        }
    }
    let kv_key = kv_key.expect("the claim wrote a key");
    store.put(&kv_key, "not oncely".into()).await.unwrap();
    let e = ledger.claim(&k, &ClaimOptions::default()).await.unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e:?}");
    let e = ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e:?}");
    assert_eq!(store.get(&kv_key).await.unwrap().unwrap(), "not oncely");
    js.delete_stream(format!("KV_{bucket}")).await.unwrap();
}

async fn shared_ledger() -> Option<NatsKvLedger> {
    let (url, _) = js().await?;
    Some(
        NatsKvLedger::connect(&url, NatsKvOptions::default().bucket("oncely_conformance"))
            .await
            .unwrap(),
    )
}

/// Many claimants race to take over one expired lease: the revision-checked
/// update lets exactly one through, at fence 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_takeover_has_one_winner() {
    let Some(ledger) = shared_ledger().await else {
        return;
    };
    let k = EffectKey::new(&fresh_tenant(), "capture", "takeover-race").unwrap();
    let short = ClaimOptions::default().lease(oncely::conformance::SHORT_LEASE);
    assert!(matches!(
        ledger.claim(&k, &short).await.unwrap(),
        Claim::Acquired(_)
    ));
    tokio::time::sleep(oncely::conformance::SHORT_LEASE_WAIT).await;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(32));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (ledger, k, barrier) = (ledger.clone(), k.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            ledger.claim(&k, &ClaimOptions::default()).await.unwrap()
        }));
    }
    let mut winners = 0;
    for t in tasks {
        match t.await.unwrap() {
            Claim::Acquired(l) => {
                assert_eq!(l.fence, 2);
                assert!(l.taken_over);
                winners += 1;
            }
            Claim::InProgress { fence, .. } => assert_eq!(fence, 2),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(winners, 1);
}

/// A lease completed through another ledger instance (no remembered
/// revision) works, and the instance that made the claim then cannot
/// complete it again with its remembered, now stale, revision.
#[tokio::test]
async fn remembered_revisions_never_bypass_the_fence() {
    let Some(a) = shared_ledger().await else { return };
    let Some(b) = shared_ledger().await else { return };
    let k = EffectKey::new(&fresh_tenant(), "capture", "two-instances").unwrap();
    let l = match a.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    let renewed = b.renew(&l, Duration::from_secs(60)).await.unwrap();
    b.complete(&renewed, &Outcome::from_json(&"b").unwrap())
        .await
        .unwrap();
    let e = a
        .complete(&l, &Outcome::from_json(&"a").unwrap())
        .await
        .unwrap_err();
    assert!(e.is_lease_lost(), "{e:?}");
    let r = a.get(&k).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Completed);
    assert_eq!(r.outcome.unwrap().to_value::<String>().unwrap(), "b");
}

/// `from_store` checks the caller's bucket like `connect` does.
#[tokio::test]
async fn from_store_checks_the_bucket() {
    let Some((_, js)) = js().await else { return };
    let good = unique("oncely_from_store");
    js.create_stream(kv_stream(&good)).await.unwrap();
    let store = js.get_key_value(&good).await.unwrap();
    let ledger = NatsKvLedger::from_store(store, NatsKvOptions::default())
        .await
        .unwrap();
    assert_eq!(ledger.options().bucket, good);
    let k = EffectKey::new(&fresh_tenant(), "capture", "o-1").unwrap();
    assert!(matches!(
        ledger.claim(&k, &ClaimOptions::default()).await.unwrap(),
        Claim::Acquired(_)
    ));
    let bad = unique("oncely_from_store_bad");
    let mut cfg = kv_stream(&bad);
    cfg.max_messages_per_subject = 3;
    js.create_stream(cfg).await.unwrap();
    let store = js.get_key_value(&bad).await.unwrap();
    let e = NatsKvLedger::from_store(store, NatsKvOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    for b in [good, bad] {
        js.delete_stream(format!("KV_{b}")).await.unwrap();
    }
}

//! Backend-specific behaviour on the single NATS server: bucket settings
//! are checked, never silently changed, and an unreachable server fails
//! closed.

use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, stream};
use oncely::backend::{Claim, Ledger, Outcome, RecordState};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::{ClaimOptions, EffectKey, Error};
use oncely_nats::{NatsKvLedger, NatsKvLedgerOptions};

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
    let cases: Vec<(&str, Tweak, NatsKvLedgerOptions, &str)> = vec![
        (
            "history",
            Box::new(|c| c.max_messages_per_subject = 5),
            NatsKvLedgerOptions::default(),
            "history",
        ),
        (
            "max_age",
            Box::new(|c| c.max_age = Duration::from_secs(3 * 86_400)),
            NatsKvLedgerOptions::default(),
            "max_age",
        ),
        (
            "replicas",
            Box::new(|_| {}),
            NatsKvLedgerOptions::default().replicas(3),
            "replicas",
        ),
        (
            "memory",
            Box::new(|c| c.storage = stream::StorageType::Memory),
            NatsKvLedgerOptions::default(),
            "memory",
        ),
        (
            "max_msgs",
            Box::new(|c| c.max_messages = 1000),
            NatsKvLedgerOptions::default(),
            "max_msgs",
        ),
        (
            "max_bytes",
            Box::new(|c| c.max_bytes = 1 << 20),
            NatsKvLedgerOptions::default(),
            "max_bytes",
        ),
        (
            "value_size",
            Box::new(|c| c.max_message_size = 1024),
            NatsKvLedgerOptions::default(),
            "max_value_size",
        ),
    ];
    for (name, tweak, opts, needle) in cases {
        let bucket = unique(&format!("oncely_bad_{name}"));
        let mut cfg = kv_stream(&bucket);
        tweak(&mut cfg);
        let mut created = js.create_stream(cfg).await.unwrap();
        let before = created.info().await.unwrap().config.clone();
        let e = NatsKvLedger::connect_with(&url, opts.bucket(&bucket))
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
    let ledger = NatsKvLedger::connect_with(&url, NatsKvLedgerOptions::default().bucket(&bucket))
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
        NatsKvLedgerOptions::default().replicas(2),
        NatsKvLedgerOptions::default().bucket("a.b"),
        NatsKvLedgerOptions::default().bucket(""),
        NatsKvLedgerOptions::default().max_age(Duration::from_secs(3600)),
    ] {
        let e = NatsKvLedger::connect_with("nats://127.0.0.1:1", opts.clone())
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{opts:?}: {e:?}");
    }
    let e = NatsKvLedger::connect_with("not a url at all ::", NatsKvLedgerOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    // A bad address in a list is named by position, never quoted: it may
    // carry a password.
    let e = NatsKvLedger::connect_with(
        "nats://127.0.0.1:1,nats://u:hunter2@[bad:4222",
        NatsKvLedgerOptions::default(),
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
    let opts = NatsKvLedgerOptions::default().connect_timeout(Duration::from_millis(500));
    let e = NatsKvLedger::connect_with("nats://127.0.0.1:1", opts)
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
    let opts = || NatsKvLedgerOptions::default().open_timeout(Duration::from_secs(600));
    // The server takes a moment to listen; only a refused connection is retried.
    let mut attempts = 0;
    let e = loop {
        match NatsKvLedger::connect_with(url, opts()).await {
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
    let ledger = NatsKvLedger::connect_with(&url, NatsKvLedgerOptions::default().bucket(&bucket))
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
        NatsKvLedger::connect_with(&url, NatsKvLedgerOptions::default().bucket("oncely_conformance"))
            .await
            .unwrap(),
    )
}

/// Many claimants race to take over one expired lease: the revision-checked
/// update lets exactly one through, with a fence above the expired one, and
/// every loser sees the winner's fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_takeover_has_one_winner() {
    let Some(ledger) = shared_ledger().await else {
        return;
    };
    let k = EffectKey::new(&fresh_tenant(), "capture", "takeover-race").unwrap();
    let short = ClaimOptions::default().lease(oncely::conformance::SHORT_LEASE);
    let Claim::Acquired(first) = ledger.claim(&k, &short).await.unwrap() else {
        panic!("a fresh key is acquired");
    };
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
    let mut winners = Vec::new();
    let mut seen = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Claim::Acquired(l) => {
                assert!(l.fence() > first.fence(), "{} after {}", l.fence(), first.fence());
                assert!(l.taken_over());
                winners.push(l.fence());
            }
            Claim::InProgress { fence, .. } => seen.push(fence),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "{winners:?}");
    assert!(seen.iter().all(|f| *f == winners[0]), "{seen:?} vs {winners:?}");
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
    let ledger = NatsKvLedger::from_store(js.client(), store, NatsKvLedgerOptions::default())
        .await
        .unwrap();
    assert_eq!(ledger.options().get_bucket(), good);
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
    let e = NatsKvLedger::from_store(js.client(), store, NatsKvLedgerOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    for b in [good, bad] {
        js.delete_stream(format!("KV_{b}")).await.unwrap();
    }
}

/// A bucket of one test's own (so listing its keys is cheap); the caller
/// deletes it with [`drop_bucket`].
async fn own_ledger(prefix: &str) -> Option<(NatsKvLedger, jetstream::Context, String)> {
    let (url, js) = js().await?;
    let bucket = unique(prefix);
    let ledger = NatsKvLedger::connect_with(&url, NatsKvLedgerOptions::default().bucket(&bucket))
        .await
        .unwrap();
    Some((ledger, js, bucket))
}

async fn drop_bucket(js: &jetstream::Context, bucket: &str) {
    js.delete_stream(format!("KV_{bucket}")).await.unwrap();
}

/// The server's stamp on the latest revision of `tenant`'s one record (the
/// instant from which every ledger measures its lease).
async fn stamp(ledger: &NatsKvLedger, tenant: &oncely::Tenant) -> SystemTime {
    use futures_util::StreamExt;
    // Fresh tenants are letters, digits and '-': their KV token is the tenant.
    let prefix = format!("{}.", tenant.as_str());
    let store = ledger.store();
    let mut keys = store.keys().await.unwrap().boxed();
    while let Some(k) = keys.next().await {
        let k = k.unwrap();
        if k.starts_with(&prefix) && k.matches('.').count() == 1 {
            let e = store.entry(&k).await.unwrap().expect("the record exists");
            return SystemTime::from(e.created);
        }
    }
    panic!("no record of {tenant}");
}

fn acquired(c: Claim) -> oncely::backend::Lease {
    match c {
        Claim::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Leases are judged on the server's clock at the revision-checked write:
/// everyone else measures a lease from its revision's stamp. What a grant or
/// a renewal reports must end no later than that (`acquired_at` at or before
/// the stamp, `expires_at - acquired_at` the requested length), so the
/// runner's deadline and safety margin, computed from the report, err on
/// the safe side.
#[tokio::test]
async fn reported_leases_end_no_later_than_the_server_enforces() {
    let Some((ledger, js, bucket)) = own_ledger("oncely_lease_clock").await else {
        return;
    };
    let len = oncely::conformance::SHORT_LEASE;
    let o = ClaimOptions::default().lease(len);
    let check = |l: &oncely::backend::Lease, stamp: SystemTime, len: Duration, what: &str| {
        assert!(
            l.acquired_at() <= stamp,
            "{what}: acquired_at {:?} is after the write's stamp {stamp:?}",
            l.acquired_at()
        );
        assert!(
            l.expires_at() <= stamp + len,
            "{what}: {l:?} outlasts {stamp:?} + {len:?}"
        );
    };
    // A new key.
    let t = fresh_tenant();
    let k = EffectKey::new(&t, "capture", "o-1").unwrap();
    let l = acquired(ledger.claim(&k, &o).await.unwrap());
    assert_eq!(l.expires_at().duration_since(l.acquired_at()).unwrap(), len);
    check(&l, stamp(&ledger, &t).await, len, "create");
    // A renewal.
    let longer = Duration::from_secs(5);
    let r = ledger.renew(&l, longer).await.unwrap();
    check(&r, stamp(&ledger, &t).await, longer, "renew");
    assert!(r.expires_at() >= l.expires_at());
    // A takeover.
    let t = fresh_tenant();
    let k = EffectKey::new(&t, "capture", "o-2").unwrap();
    let first = acquired(ledger.claim(&k, &o).await.unwrap());
    tokio::time::sleep(oncely::conformance::SHORT_LEASE_WAIT).await;
    let l = acquired(ledger.claim(&k, &o).await.unwrap());
    assert!(l.taken_over() && l.fence() > first.fence(), "{l:?}");
    assert_eq!(l.expires_at().duration_since(l.acquired_at()).unwrap(), len);
    check(&l, stamp(&ledger, &t).await, len, "takeover");
    drop_bucket(&js, &bucket).await;
}

/// The bucket drops every key nobody wrote for `max_age`, so the horizon is
/// never before `now - max_age`, even where nothing was pruned; a message
/// older than that is refused before anything is written.
#[tokio::test]
async fn max_age_bounds_the_horizon() {
    let Some(ledger) = shared_ledger().await else {
        return;
    };
    // The bucket's own max_age (what the server enforces), not the option.
    let max_age = ledger.store().stream.cached_info().config.max_age;
    let t = fresh_tenant();
    let h = ledger
        .horizon(&t, "capture")
        .await
        .unwrap()
        .expect("max_age is a horizon");
    // Worker and server run on one machine here; allow a minute either way.
    let now = SystemTime::now();
    let slack = Duration::from_secs(60);
    assert!(
        h > now - max_age - slack && h < now - max_age + slack,
        "{h:?} vs now {now:?} - {max_age:?}"
    );
    let k = EffectKey::new(&t, "capture", "ancient").unwrap();
    let day = Duration::from_secs(86_400);
    let e = ledger
        .claim(&k, &ClaimOptions::default().sent_at(now - max_age - day))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
    assert!(ledger.get(&k).await.unwrap().is_none());
    acquired(
        ledger
            .claim(&k, &ClaimOptions::default().sent_at(now - max_age + day))
            .await
            .unwrap(),
    );
}

/// A claim with `sent_at` checks the horizon after its create; one that
/// never finished that check (crashed, dropped, its reply lost) leaves its
/// record marked. Whoever takes that record over after its lease expired
/// checks again: beyond the horizon, the record is removed and the key
/// claimed as absent (a replay with `sent_at` is refused, a claim without it
/// starts afresh). A record whose holder wrote since (a renewal) passed its
/// check, and is taken over as usual.
#[tokio::test]
async fn unchecked_records_are_checked_again_on_takeover() {
    unchecked_records_checked_again(false).await;
}

/// The same through `claim_many`: a batch keeps every rule of the single
/// claim (the create-then-check and the recheck before a takeover), per key.
#[tokio::test]
async fn unchecked_records_are_checked_again_in_a_batch() {
    unchecked_records_checked_again(true).await;
}

/// Claims `key` on its own, or as the middle key of a batch with two keys
/// of another tenant (a new one and a completed one) that must be answered
/// as usual around it.
async fn claim_maybe_in_batch(
    ledger: &NatsKvLedger,
    key: &EffectKey,
    opts: &ClaimOptions,
    batch: bool,
) -> oncely::Result<Claim> {
    if !batch {
        return ledger.claim(key, opts).await;
    }
    let t = fresh_tenant();
    let done = EffectKey::new(&t, "capture", "done").unwrap();
    let l = acquired(ledger.claim(&done, &ClaimOptions::default()).await.unwrap());
    ledger
        .complete(&l, &Outcome::from_json(&"done").unwrap())
        .await
        .unwrap();
    let new = EffectKey::new(&t, "capture", "new").unwrap();
    let mut answers = ledger
        .claim_many(&[new, key.clone(), done], opts)
        .await
        .unwrap()
        .into_iter();
    assert!(matches!(answers.next(), Some(Ok(Claim::Acquired(_)))));
    let answer = answers.next().unwrap();
    assert!(matches!(answers.next(), Some(Ok(Claim::Completed(_)))));
    answer
}

async fn unchecked_records_checked_again(batch: bool) {
    let Some(ledger) = shared_ledger().await else {
        return;
    };
    let t = fresh_tenant();
    let hour_ago = SystemTime::now() - Duration::from_secs(3600);
    let short = ClaimOptions::default().lease(oncely::conformance::SHORT_LEASE);
    let key = |s: &str| EffectKey::new(&t, "capture", s).unwrap();
    // Three claims of messages an hour old pass the check (nothing pruned);
    // their holders stop without completing.
    let replayed = acquired(
        ledger
            .claim(&key("replayed"), &short.clone().sent_at(hour_ago))
            .await
            .unwrap(),
    );
    let fresh = acquired(
        ledger
            .claim(&key("fresh"), &short.clone().sent_at(hour_ago))
            .await
            .unwrap(),
    );
    let renewed = acquired(
        ledger
            .claim(&key("renewed"), &short.clone().sent_at(hour_ago))
            .await
            .unwrap(),
    );
    let renewed = ledger
        .renew(&renewed, oncely::conformance::SHORT_LEASE)
        .await
        .unwrap();
    // A newer effect of the same kind is pruned: the horizon passes them.
    let brief = ClaimOptions::default()
        .lease(Duration::from_millis(100))
        .retention(Duration::from_millis(300));
    let newer = key("newer");
    let l = acquired(ledger.claim(&newer, &brief).await.unwrap());
    ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    tokio::time::sleep(oncely::conformance::SHORT_LEASE_WAIT).await;
    oncely::conformance::prune_until_gone(&ledger, &newer).await;
    assert!(ledger.horizon(&t, "capture").await.unwrap().unwrap() >= hour_ago);
    // The replay of an unchecked record is refused, and the record is gone.
    let e = claim_maybe_in_batch(&ledger, &key("replayed"), &short.clone().sent_at(hour_ago), batch)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
    assert!(ledger.get(&key("replayed")).await.unwrap().is_none());
    assert!(ledger.release(&replayed).await.unwrap_err().is_lease_lost());
    // A claim without `sent_at` finds the key absent: a new record.
    let l = acquired(
        claim_maybe_in_batch(&ledger, &key("fresh"), &short, batch)
            .await
            .unwrap(),
    );
    assert!(!l.taken_over() && l.fence() > fresh.fence(), "{l:?}");
    // The renewed record is taken over as any expired lease.
    let l = acquired(
        claim_maybe_in_batch(&ledger, &key("renewed"), &short.clone().sent_at(hour_ago), batch)
            .await
            .unwrap(),
    );
    assert!(l.taken_over() && l.fence() > renewed.fence(), "{l:?}");
    // A new key of the pruned kind, in a message older than the horizon:
    // refused after its create (the watermark is read after the create), and
    // nothing is left behind.
    let e = claim_maybe_in_batch(&ledger, &key("late"), &short.clone().sent_at(hour_ago), batch)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
    assert!(ledger.get(&key("late")).await.unwrap().is_none());
}

/// The order that keeps a pruned effect from running again (prune: raise
/// the watermark, then delete; claim: create, then read it), under
/// concurrency: claimants keep replaying every message (produced before its
/// first claim) while a pruner deletes the records as soon as their tiny
/// retention ends. Each effect runs exactly once; later replays get its
/// outcome or `BeyondHorizon`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replays_racing_prune_never_run_an_effect_twice() {
    let Some((ledger, js, bucket)) = own_ledger("oncely_prune_race").await else {
        return;
    };
    const KEYS: usize = 64;
    let t = fresh_tenant();
    let sent_at = SystemTime::now() - Duration::from_secs(1);
    // One kind per key: each has its own watermark, so every key's first
    // prune is a race of its own (with one kind, the first prune of any key
    // would put every other key's replays beyond the horizon).
    let keys: Vec<EffectKey> = (0..KEYS)
        .map(|i| EffectKey::new(&t, format!("k{i}"), "o").unwrap())
        .collect();
    let runs = std::sync::Arc::new(std::sync::Mutex::new(vec![0usize; KEYS]));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let o = ClaimOptions::default()
        .lease(Duration::from_millis(200))
        .retention(Duration::from_millis(200))
        .sent_at(sent_at);
    let mut tasks = Vec::new();
    for w in 0..3 {
        let (ledger, keys, runs, stop, o) = (
            ledger.clone(),
            keys.clone(),
            runs.clone(),
            stop.clone(),
            o.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                i = (i + 1) % KEYS;
                match ledger.claim(&keys[i], &o).await {
                    Ok(Claim::Acquired(l)) => {
                        runs.lock().unwrap()[i] += 1;
                        ledger
                            .complete(&l, &Outcome::from_json(&w).unwrap())
                            .await
                            .unwrap();
                    }
                    Ok(Claim::Completed(_) | Claim::InProgress { .. }) | Err(Error::BeyondHorizon { .. }) => {
                    }
                    other => panic!("{other:?}"),
                }
            }
        }));
    }
    let pruner = {
        let (ledger, stop) = (ledger.clone(), stop.clone());
        tokio::spawn(async move {
            let mut pruned = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                // Passes far apart delete many records each: long batches
                // give a wrong order many chances to show.
                tokio::time::sleep(Duration::from_millis(300)).await;
                pruned += ledger.prune(u64::MAX).await.unwrap();
            }
            pruned
        })
    };
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for task in tasks {
        task.await.unwrap();
    }
    let pruned = pruner.await.unwrap();
    let runs = runs.lock().unwrap().clone();
    eprintln!("pruned {pruned}; runs per key {runs:?}");
    assert!(pruned >= KEYS as u64 / 2, "the race needs prunes: {pruned}");
    for (i, n) in runs.iter().enumerate() {
        assert!(*n <= 1, "{} ran {n} times", keys[i]);
    }
    drop_bucket(&js, &bucket).await;
}

/// An `open_timeout` too long to add to the worker's clock means "no
/// deadline", not a panic ("overflow when adding duration to instant").
#[tokio::test]
async fn unbounded_open_timeout_does_not_panic() {
    let Some((url, _)) = js().await else { return };
    let opts = NatsKvLedgerOptions::default()
        .bucket("oncely_conformance")
        .open_timeout(Duration::MAX);
    NatsKvLedger::connect_with(&url, opts).await.unwrap();
}

/// `migrate(false)` (what the read-only operator commands ask for) never
/// creates a bucket: a missing one is a configuration error naming it, and an
/// existing one opens as usual.
#[tokio::test]
async fn without_migrate_a_missing_bucket_is_not_created() {
    let Some((url, js)) = js().await else { return };
    let bucket = unique("oncely_nomigrate");
    let e = NatsKvLedger::connect_with(
        &url,
        NatsKvLedgerOptions::default().bucket(&bucket).migrate(false),
    )
    .await
    .unwrap_err();
    assert!(matches!(&e, Error::Config(m) if m.contains(&bucket)), "{e:?}");
    assert!(
        js.get_stream(format!("KV_{bucket}")).await.is_err(),
        "a bucket was created"
    );
    NatsKvLedger::connect_with(&url, NatsKvLedgerOptions::default().bucket(&bucket))
        .await
        .unwrap();
    NatsKvLedger::connect_with(
        &url,
        NatsKvLedgerOptions::default().bucket(&bucket).migrate(false),
    )
    .await
    .unwrap();
    js.delete_stream(format!("KV_{bucket}")).await.unwrap();
}

/// The durability a single server's R=1 bucket reports says what an
/// acknowledgement means there: handed to the OS, synced on a timer, so an
/// OS crash or a power loss can lose acknowledged writes (not "once
/// stored").
#[tokio::test]
async fn durability_says_an_r1_ack_is_not_yet_on_disk() {
    let Some((url, js)) = js().await else { return };
    let bucket = unique("oncely_durability_r1");
    let ledger = NatsKvLedger::connect_with(&url, NatsKvLedgerOptions::default().bucket(&bucket))
        .await
        .unwrap();
    let caps = ledger.capabilities();
    assert!(!caps.replicated);
    let d = caps.durability;
    assert!(d.starts_with("JetStream file storage, R=1"), "{d}");
    assert!(d.contains("OS crash or a power loss can lose"), "{d}");
    // The server names its version on connect: 2.9 has no sync setting,
    // later versions have sync_interval.
    let version = async_nats::connect(url.as_str())
        .await
        .unwrap()
        .server_info()
        .version;
    if version.starts_with("2.9.") {
        assert!(
            d.contains("2.9 fsyncs streams every 2 min (not configurable)"),
            "{d}"
        );
    } else {
        assert!(d.contains("sync_interval: always"), "{version}: {d}");
    }
    drop_bucket(&js, &bucket).await;
}

/// The URL's query names the bucket (and replicas), over the options'.
#[tokio::test]
async fn the_url_names_the_bucket() {
    let Some((url, js)) = js().await else { return };
    let bucket = unique("oncely_url_bucket");
    let ledger = NatsKvLedger::connect(&format!("{url}?bucket={bucket}&replicas=1"))
        .await
        .unwrap();
    assert_eq!(ledger.options().get_bucket(), bucket);
    assert!(js.get_stream(format!("KV_{bucket}")).await.is_ok());
    let ledger = NatsKvLedger::connect_with(
        &format!("{url}?bucket={bucket}"),
        NatsKvLedgerOptions::default()
            .bucket("oncely_not_this_one")
            .migrate(false),
    )
    .await
    .unwrap();
    assert_eq!(ledger.options().get_bucket(), bucket);
    drop_bucket(&js, &bucket).await;
}

/// Values the URL parser accepts but the options refuse still fail with a
/// typed error before any connection (port 1: a connection attempt would be
/// `Unavailable` instead), through `connect` and `from_url` alike.
#[tokio::test]
async fn options_from_the_url_are_validated_before_connecting() {
    use oncely::open::{Access, FromUrl, OpenOptions};
    for url in [
        "nats://127.0.0.1:1?replicas=2",
        "nats://127.0.0.1:1?bucket=no.dots",
        "nats://127.0.0.1:1?max_age=9",
        "redis://127.0.0.1:1",
    ] {
        let e = NatsKvLedger::connect(url).await.unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{url}: {e:?}");
        let e = NatsKvLedger::from_url(url, OpenOptions::new(Access::Migrate))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{url}: {e:?}");
    }
    assert_eq!(NatsKvLedger::SCHEMES, &["nats"]);
}

/// `from_url` honours the access it is given: `Migrate` creates the bucket,
/// `Existing` and `ReadOnly` never do (a missing bucket is `Config`, and
/// nothing is created), and `connect_timeout` bounds the connection and the
/// wait for the bucket.
#[tokio::test]
async fn from_url_honours_access_and_timeout() {
    use oncely::open::{Access, FromUrl, OpenOptions};
    let Some((url, js)) = js().await else { return };
    let bucket = unique("oncely_from_url");
    let at = format!("{url}?bucket={bucket}");
    for access in [Access::Existing, Access::ReadOnly] {
        let e = NatsKvLedger::from_url(&at, OpenOptions::new(access))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Config(m) if m.contains(&bucket)),
            "{access:?}: {e:?}"
        );
        assert!(
            js.get_stream(format!("KV_{bucket}")).await.is_err(),
            "{access:?} created a bucket"
        );
    }
    let created = NatsKvLedger::from_url(&at, OpenOptions::new(Access::Migrate))
        .await
        .unwrap();
    assert!(created.options().get_migrate() && !created.options().get_read_only());
    assert!(js.get_stream(format!("KV_{bucket}")).await.is_ok());
    let quick = Duration::from_secs(3);
    let existing = NatsKvLedger::from_url(&at, OpenOptions::new(Access::Existing).connect_timeout(quick))
        .await
        .unwrap();
    let o = existing.options();
    assert!(!o.get_migrate() && !o.get_read_only(), "{o:?}");
    assert_eq!((o.get_connect_timeout(), o.get_open_timeout()), (quick, quick));
    let k = EffectKey::new(&fresh_tenant(), "capture", "o-1").unwrap();
    acquired(existing.claim(&k, &ClaimOptions::default()).await.unwrap());
    let reader = NatsKvLedger::from_url(&at, OpenOptions::new(Access::ReadOnly))
        .await
        .unwrap();
    assert!(reader.options().get_read_only());
    assert_eq!(
        reader.get(&k).await.unwrap().unwrap().state,
        RecordState::InProgress
    );
    drop_bucket(&js, &bucket).await;
}

/// A read-only ledger reads (`get`, `abandoned`, `horizon`) and refuses every
/// write of its own with `Config`, before any round trip: still `Config` once
/// the bucket is gone, where a round trip would fail otherwise. What it
/// refused is left as it was.
#[tokio::test]
async fn read_only_refuses_writes_before_any_round_trip() {
    let Some((ledger, js, bucket)) = own_ledger("oncely_read_only").await else {
        return;
    };
    let url = service_url("ONCELY_NATS_URL", Some("nats://127.0.0.1:4222")).unwrap();
    let t = fresh_tenant();
    let k = EffectKey::new(&t, "capture", "held").unwrap();
    let lease = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
    let reader = NatsKvLedger::connect_with(
        &url,
        NatsKvLedgerOptions::default().bucket(&bucket).read_only(true),
    )
    .await
    .unwrap();
    let seen = reader.get(&k).await.unwrap().unwrap();
    assert_eq!((seen.state, seen.fence), (RecordState::InProgress, lease.fence()));
    assert!(reader.abandoned(&t, 10).await.unwrap().is_empty());
    reader.horizon(&t, "capture").await.unwrap();
    let other = EffectKey::new(&t, "capture", "new").unwrap();
    let outcome = Outcome::from_json(&1).unwrap();
    let refusals = |stage: &'static str| {
        let (reader, k, other, lease, outcome) = (&reader, &k, &other, &lease, &outcome);
        async move {
            let results = [
                ("claim", reader.claim(other, &ClaimOptions::default()).await.err()),
                ("takeover", reader.claim(k, &ClaimOptions::default()).await.err()),
                ("complete", reader.complete(lease, outcome).await.err()),
                ("release", reader.release(lease).await.err()),
                ("renew", reader.renew(lease, Duration::from_secs(60)).await.err()),
                ("prune", reader.prune(100).await.err()),
                (
                    "claim_many",
                    reader
                        .claim_many(std::slice::from_ref(other), &ClaimOptions::default())
                        .await
                        .err(),
                ),
                (
                    "complete_many",
                    reader
                        .complete_many(&[(lease.clone(), outcome.clone())])
                        .await
                        .pop()
                        .and_then(|r| r.err()),
                ),
            ];
            for (what, e) in results {
                assert!(
                    matches!(&e, Some(Error::Config(m)) if m.contains("read-only")),
                    "{stage}: {what}: {e:?}"
                );
            }
        }
    };
    refusals("with the bucket").await;
    assert!(ledger.get(&other).await.unwrap().is_none());
    let after = ledger.get(&k).await.unwrap().unwrap();
    assert_eq!(
        (after.state, after.fence),
        (RecordState::InProgress, lease.fence())
    );
    drop_bucket(&js, &bucket).await;
    // Without the bucket every round trip fails; the refusals do not change.
    assert!(reader.get(&k).await.is_err());
    refusals("without the bucket").await;
}

/// A duplicate waiting on one ledger is woken by a completion written through
/// another ledger on its own connection, as another process's would be: it
/// gets the holder's outcome (its handler never runs), or acquires after a
/// release, and its ledger received the notification the holder published.
/// The holder ends its lease with `complete`, `release`, or a
/// `complete_many` of that lease and another one (one message, two keys).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_is_woken_by_another_connections_completion() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use oncely::{Effects, OnInProgress};

    let Some((holder_ledger, js, bucket)) = own_ledger("oncely_wake").await else {
        return;
    };
    let url = service_url("ONCELY_NATS_URL", Some("nats://127.0.0.1:4222")).unwrap();
    let waiter_ledger = NatsKvLedger::connect_with(&url, NatsKvLedgerOptions::default().bucket(&bucket))
        .await
        .unwrap();
    assert!(holder_ledger.is_listening() && waiter_ledger.is_listening());
    for how in ["complete", "release", "complete_many"] {
        let release = how == "release";
        let t = fresh_tenant();
        let k = EffectKey::new(&t, "capture", "waited-on").unwrap();
        let long = ClaimOptions::default().lease(Duration::from_secs(60));
        let holder = acquired(holder_ledger.claim(&k, &long).await.unwrap());
        let other = EffectKey::new(&t, "capture", "other").unwrap();
        let other = acquired(holder_ledger.claim(&other, &long).await.unwrap());
        assert!(waiter_ledger.watch(&k).await.is_notified());
        let before = waiter_ledger.notifications_received();
        let ran = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (ledger, k, ran) = (waiter_ledger.clone(), k.clone(), ran.clone());
            tokio::spawn(async move {
                let wait = OnInProgress::Wait {
                    max: Duration::from_secs(30),
                };
                Effects::new(ledger)
                    .run(
                        &k,
                        &ClaimOptions::default().on_in_progress(wait),
                        |_| async move {
                            ran.store(true, Ordering::SeqCst);
                            Ok("waiter ran".to_owned())
                        },
                    )
                    .await
            })
        };
        // Let the waiter find the effect in progress and start waiting.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!waiter.is_finished(), "the waiter did not wait");
        let outcome = Outcome::value(&"holder ran").unwrap();
        match how {
            "release" => holder_ledger.release(&holder).await.unwrap(),
            "complete" => holder_ledger.complete(&holder, &outcome).await.unwrap(),
            _ => {
                let items = [(other.clone(), outcome.clone()), (holder.clone(), outcome)];
                for answer in holder_ledger.complete_many(&items).await {
                    answer.unwrap();
                }
            }
        }
        let want = if release { "waiter ran" } else { "holder ran" };
        assert_eq!(waiter.await.unwrap().unwrap(), want, "{how}");
        assert_eq!(
            ran.load(Ordering::SeqCst),
            release,
            "{how}: the waiter's handler ran only after a release"
        );
        // The waiter's ledger does not receive its own completions (after the
        // release it completed the effect itself): what it received is the
        // holder's.
        let want = if how == "complete_many" { 2 } else { 1 };
        assert!(
            waiter_ledger.notifications_received() >= before + want,
            "{how}: {} keys announced to the waiting ledger, want {want}",
            waiter_ledger.notifications_received() - before
        );
        if how != "complete_many" {
            holder_ledger.release(&other).await.unwrap();
        }
    }
    drop_bucket(&js, &bucket).await;
}

/// A NATS server of this test's own, so that it can be stopped and started
/// again (the shared server and the cluster must stay up): killed on drop.
struct OwnServer {
    child: Option<std::process::Child>,
    port: u16,
    dir: std::path::PathBuf,
}

impl OwnServer {
    /// Starts a server on a free port with its store in a fresh directory;
    /// `None` (or a failure, with ONCELY_REQUIRE_SERVICES=1) without the
    /// `nats-server` binary.
    fn start() -> Option<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(unique("oncely-nats-own-server"));
        let mut server = OwnServer {
            child: None,
            port,
            dir,
        };
        match server.spawn() {
            Ok(()) => Some(server),
            Err(e) => skip_or_fail(&format!("starting nats-server: {e}")),
        }
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let bin = std::env::var("NATS_SERVER").unwrap_or_else(|_| "/usr/sbin/nats-server".to_owned());
        let child = std::process::Command::new(bin)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(&self.dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits, generously, until `cond` holds; false if it never did.
async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..600 {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cond()
}

/// While the connection is down nothing can wake a notified watch, so the
/// ledger hands out polling ones; once the connection is back (async-nats
/// renews the subscription) watches are notified again, and completions
/// from other connections reach the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn watches_poll_while_the_connection_is_down() {
    if service_url("ONCELY_NATS_URL", Some("nats://127.0.0.1:4222")).is_none() {
        return;
    }
    let Some(mut server) = OwnServer::start() else {
        return;
    };
    let opts = NatsKvLedgerOptions::default().bucket("oncely_reconnect");
    let open = || async {
        for _ in 0..100 {
            match NatsKvLedger::connect_with(&server.url(), opts.clone()).await {
                Ok(l) => return l,
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        panic!("the test's own NATS server did not come up");
    };
    let watcher = open().await;
    let writer = open().await;
    let k = EffectKey::new(&fresh_tenant(), "capture", "reconnect").unwrap();
    assert!(watcher.is_listening());
    assert!(watcher.watch(&k).await.is_notified());

    server.stop();
    assert!(
        eventually(|| !watcher.is_listening()).await,
        "the ledger never noticed its connection was down"
    );
    assert!(
        !watcher.watch(&k).await.is_notified(),
        "a watch nothing can wake is handed out while the connection is down"
    );

    server.spawn().unwrap();
    assert!(
        eventually(|| watcher.is_listening()).await,
        "the ledger never listened again"
    );
    assert!(watcher.watch(&k).await.is_notified());
    let before = watcher.notifications_received();
    // JetStream may need a moment after the restart: retry the claim.
    let mut lease = None;
    for _ in 0..100 {
        match writer.claim(&k, &ClaimOptions::default()).await {
            Ok(c) => {
                lease = Some(acquired(c));
                break;
            }
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => panic!("{e:?}"),
        }
    }
    let lease = lease.expect("JetStream answered after the restart");
    writer
        .complete(&lease, &Outcome::value(&1).unwrap())
        .await
        .unwrap();
    assert!(
        eventually(|| watcher.notifications_received() > before).await,
        "the renewed subscription relays completions"
    );
}

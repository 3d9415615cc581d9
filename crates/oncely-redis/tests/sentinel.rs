//! Redis with replicas: a ledger that opens through Sentinel
//! (`redis+sentinel://`, the fixture of scripts/redis-sentinel.sh: a
//! primary on 6390, its replica on 6391, three Sentinels), the server's role
//! checked at connect, and `RedisLedgerOptions::wait_replicas` on a primary
//! and a replica of the test's own (stopped with SIGSTOP to stall the
//! replication). Failovers are in tests/failover.rs: nothing here changes
//! the fixture's topology, so these tests run in parallel.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{PRIMARY, REPLICA, TempRedis, raw, replica_linked, sentinel_url, sentinel_with};
use oncely::backend::{Claim, Ledger, Outcome, RecordState};
use oncely::conformance::fresh_tenant;
use oncely::open::{Access, FromUrl, OpenOptions};
use oncely::{ClaimOptions, EffectKey, Effects, Error};
use oncely_redis::{RedisLedger, RedisLedgerOptions};

/// How long the tests' ledgers wait for a replica.
const WAIT: Duration = Duration::from_millis(200);

fn waiting() -> RedisLedgerOptions {
    RedisLedgerOptions::default().wait_replicas(1, Duration::from_secs(1))
}

/// The fixture through its Sentinels, waiting for its replica.
async fn sentinel() -> Option<RedisLedger> {
    sentinel_with(waiting()).await
}

oncely::conformance::conformance_tests!(sentinel);

/// Three ledgers, each told of one Sentinel only: each finds the primary
/// on its own, and they race for the same keys there.
async fn through_each_sentinel() -> Option<Vec<RedisLedger>> {
    sentinel_with(waiting()).await?;
    let mut nodes = Vec::new();
    for port in common::SENTINELS {
        let url = format!("redis+sentinel://127.0.0.1:{port}/{}", common::MASTER);
        nodes.push(RedisLedger::connect_with(&url, waiting()).await.unwrap());
    }
    Some(nodes)
}

oncely::conformance::nodes_conformance_tests!(through_each_sentinel);

fn acquired(c: Claim) -> oncely::backend::Lease {
    match c {
        Claim::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn config_error(e: Error, wanted: &[&str]) {
    match &e {
        Error::Config(m) if wanted.iter().all(|w| m.contains(w)) => {}
        _ => panic!("expected Error::Config mentioning {wanted:?}, got {e:?}"),
    }
}

/// A Sentinel URL opens the primary the Sentinels name: it says so, its
/// writes reach the replica, and its persistence is the primary's (the
/// fixture runs appendonly yes, so no `?ephemeral=true`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_url_opens_the_primary() {
    let Some(ledger) = sentinel_with(RedisLedgerOptions::default()).await else {
        return;
    };
    assert_eq!(ledger.primary(), Some((format!("127.0.0.1:{PRIMARY}"), 0)));
    assert!(!ledger.is_cluster());
    let shown = ledger.to_string();
    assert_eq!(
        shown,
        "redis sentinel 127.0.0.1:26390,127.0.0.1:26391,127.0.0.1:26392 master mymaster/0, prefix oncely:"
    );
    let caps = ledger.capabilities();
    assert!(
        caps.durability.starts_with("AOF, appendfsync everysec"),
        "{}",
        caps.durability
    );
    assert!(
        !caps.replicated,
        "no WAIT: a claim returns before any replica has it"
    );
    assert!(sentinel().await.unwrap().capabilities().replicated);
    assert!(ledger.is_subscribed());

    let k = EffectKey::new(&fresh_tenant(), "capture", "through-sentinel").unwrap();
    let lease = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
    ledger
        .complete(&lease, &Outcome::from_json(&"ch_1").unwrap())
        .await
        .unwrap();
    let replica = RedisLedger::connect_with(
        &format!("redis://127.0.0.1:{REPLICA}"),
        RedisLedgerOptions::default().read_only(true),
    )
    .await
    .unwrap();
    let mut state = None;
    for _ in 0..100 {
        state = replica.get(&k).await.unwrap().map(|r| r.state);
        if state == Some(RecordState::Completed) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(state, Some(RecordState::Completed), "replicated");

    // `from_url` opens the scheme as `connect` does, every access.
    let read_only = RedisLedger::from_url(&sentinel_url(), OpenOptions::new(Access::ReadOnly))
        .await
        .unwrap();
    assert!(read_only.is_read_only());
    assert_eq!(
        read_only.get(&k).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed)
    );
    assert_eq!(read_only.to_string(), shown);

    // The URL's wait parameters go through the shared rule.
    let waits = RedisLedger::connect(&format!("{}?wait_replicas=1&wait_timeout_ms=500", sentinel_url()))
        .await
        .unwrap();
    assert!(waits.capabilities().replicated);
}

/// A Sentinel that names no such master, and no Sentinel at all, are
/// `Unavailable` (retryable: during a failover no primary is named for a
/// moment).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_primary_named_is_unavailable() {
    if sentinel_with(RedisLedgerOptions::default()).await.is_none() {
        return;
    }
    let e = RedisLedger::connect("redis+sentinel://127.0.0.1:26390/nosuchmaster")
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
    assert!(e.to_string().contains("nosuchmaster"), "{e}");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = RedisLedger::connect(&format!("redis+sentinel://127.0.0.1:{port}/mymaster"))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
}

/// A ledger pointed at a replica used to connect and then fail every write
/// with READONLY: it is refused at connect, with a pointer to the primary
/// and to Sentinel, unless it only reads (then it reads what the replica
/// has).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_is_refused_unless_read_only() {
    let Some(primary) = TempRedis::start(&[]).await else {
        return;
    };
    let port = primary.port.to_string();
    let replica = TempRedis::start(&["--replicaof", "127.0.0.1", &port])
        .await
        .unwrap();
    replica_linked(&replica.url()).await;
    let e = RedisLedger::connect(&replica.ledger_url()).await.unwrap_err();
    config_error(e, &["replica, not a primary", "READONLY", "redis+sentinel://"]);

    let writer = RedisLedger::connect(&primary.ledger_url()).await.unwrap();
    let k = EffectKey::new(&fresh_tenant(), "capture", "on-the-primary").unwrap();
    let lease = acquired(writer.claim(&k, &ClaimOptions::default()).await.unwrap());
    writer
        .complete(&lease, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    let reader = RedisLedger::connect_with(
        &replica.ledger_url(),
        RedisLedgerOptions::default().read_only(true),
    )
    .await
    .unwrap();
    let mut found = None;
    for _ in 0..100 {
        found = reader.get(&k).await.unwrap();
        if found.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(found.map(|r| r.state), Some(RecordState::Completed));
}

/// A primary and its replica, both of the test's own, and a ledger that
/// waits for the replica.
async fn pair() -> Option<(TempRedis, TempRedis, RedisLedger)> {
    let primary = TempRedis::start(&[]).await?;
    let port = primary.port.to_string();
    let replica = TempRedis::start(&["--replicaof", "127.0.0.1", &port]).await?;
    replica_linked(&replica.url()).await;
    let ledger = RedisLedger::connect_with(
        &primary.ledger_url(),
        RedisLedgerOptions::default().wait_replicas(1, WAIT),
    )
    .await
    .unwrap();
    Some((primary, replica, ledger))
}

fn unavailable(e: &Error, says: &str) {
    assert!(
        matches!(e, Error::Unavailable { .. }) && e.to_string().contains(says),
        "expected Unavailable saying {says:?}, got {e:?}"
    );
}

fn not_replicated(e: &Error, what: &str) {
    assert!(
        matches!(e, Error::Backend { retryable: true, .. })
            && e.to_string().contains(&format!(
                "{what} applied on the primary but acknowledged by 0 of 1"
            )),
        "expected a retryable Backend error about the {what}, got {e:?}"
    );
}

/// With `wait_replicas(1, …)`, what the replica acknowledged is granted and
/// answered; while it acknowledges nothing (stopped), a claim is not
/// granted (and given back, so it is claimed at once when the replica is
/// back), a completed record is not answered from (even by a ledger that
/// wrote nothing before: the claim writes to the record so that its `WAIT`
/// covers it), and a completion,
/// release or renewal fails (retryable): the primary applied it, and a
/// failover may lose it. `Effects::run` runs no handler without a grant,
/// and reports a completion that fell short as `OutcomeUnknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_replicas_acknowledges_only_what_a_replica_has() {
    let Some((primary, replica, ledger)) = pair().await else {
        return;
    };
    assert!(ledger.capabilities().replicated);
    let plain = RedisLedger::connect(&primary.ledger_url()).await.unwrap();
    let t = fresh_tenant();
    let key = |s: &str| EffectKey::new(&t, "capture", s).unwrap();
    let opts = ClaimOptions::default();
    let o = Outcome::from_json(&"ch_1").unwrap();

    // The replica keeps up: every write is acknowledged.
    let done = key("done");
    let lease = acquired(ledger.claim(&done, &opts).await.unwrap());
    let lease = ledger.renew(&lease, Duration::from_secs(30)).await.unwrap();
    ledger.complete(&lease, &o).await.unwrap();
    assert!(matches!(
        ledger.claim(&done, &opts).await.unwrap(),
        Claim::Completed(_)
    ));
    let held = acquired(ledger.claim(&key("held"), &opts).await.unwrap());
    let held2 = acquired(ledger.claim(&key("held2"), &opts).await.unwrap());
    let batch: Vec<EffectKey> = (0..3).map(|i| key(&format!("batch-{i}"))).collect();
    let leases: Vec<_> = ledger
        .claim_many(&batch, &opts)
        .await
        .unwrap()
        .into_iter()
        .map(|c| acquired(c.unwrap()))
        .collect();

    // Another process's ledger, which has written nothing yet: a WAIT on
    // its connection alone would count nothing to wait for.
    let reader = RedisLedger::connect_with(
        &primary.ledger_url(),
        RedisLedgerOptions::default().wait_replicas(1, WAIT),
    )
    .await
    .unwrap();

    replica.signal("STOP");
    let fresh = key("fresh");
    let e = ledger.claim(&fresh, &opts).await.unwrap_err();
    unavailable(
        &e,
        "claim not granted: acknowledged by 0 of 1 replicas within 200ms",
    );
    assert!(e.is_retryable());
    assert!(e.to_string().contains("it was released"), "{e}");
    let r = plain.get(&fresh).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Released, "given back on the primary");
    let e = ledger.claim(&done, &opts).await.unwrap_err();
    unavailable(&e, "not answered from");
    let e = ledger.complete(&held, &o).await.unwrap_err();
    not_replicated(&e, "completion");
    assert_eq!(
        plain.get(&key("held")).await.unwrap().unwrap().state,
        RecordState::Completed,
        "the primary applied it"
    );
    // A completion no replica has is not answered from, by any ledger.
    unavailable(
        &reader.claim(&key("held"), &opts).await.unwrap_err(),
        "not answered from",
    );
    not_replicated(&ledger.release(&held2).await.unwrap_err(), "release");
    not_replicated(
        &ledger
            .renew(&leases[0], Duration::from_secs(30))
            .await
            .unwrap_err(),
        "renewal",
    );
    let answers = ledger.complete_many(&[(leases[1].clone(), o.clone())]).await;
    not_replicated(answers[0].as_ref().unwrap_err(), "completion");
    let answers = ledger.claim_many(&[key("batch-new")], &opts).await.unwrap();
    unavailable(answers[0].as_ref().unwrap_err(), "claim not granted");

    // The runner: no grant, no handler; a completion short of the replica
    // is an unknown outcome, not a success.
    let effects = Effects::new(ledger.clone());
    let ran = Arc::new(AtomicUsize::new(0));
    let count = ran.clone();
    let e = effects
        .run::<u32, _, _>(&key("run"), &opts, move |_| async move {
            count.fetch_add(1, Ordering::SeqCst);
            Ok(1)
        })
        .await
        .unwrap_err();
    unavailable(&e, "claim not granted");
    assert_eq!(ran.load(Ordering::SeqCst), 0, "no handler without a grant");
    replica.signal("CONT");
    let stalled = key("stalled-completion");
    let stall = Arc::new(replica);
    let stopper = stall.clone();
    let e = effects
        .run::<u32, _, _>(&stalled, &opts, move |_| async move {
            // The handler ran with a grant the replica had; its completion
            // finds the replica stopped.
            stopper.signal("STOP");
            Ok(1)
        })
        .await
        .unwrap_err();
    assert!(e.is_outcome_unknown(), "{e:?}");
    stall.signal("CONT");

    // The replica back: the given-back key is claimed at once, above its
    // fence; the completed record is answered again.
    let mut granted = None;
    for _ in 0..50 {
        match ledger.claim(&fresh, &opts).await {
            Ok(c) => {
                granted = Some(acquired(c));
                break;
            }
            Err(e) => {
                assert!(e.is_retryable(), "{e:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let granted = granted.expect("claimed once the replica is back");
    assert!(
        granted.taken_over() && granted.fence() > r.fence,
        "{granted:?} after {r:?}"
    );
    assert!(matches!(
        ledger.claim(&done, &opts).await.unwrap(),
        Claim::Completed(_)
    ));
    drop(primary);
}

/// With no replica at all, `wait_replicas(1, …)` grants nothing: on one
/// server and on the test cluster (its masters have no replicas), where the
/// `WAIT` goes to the master of the record's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_replicas_without_a_replica_grants_nothing() {
    let Some(server) = TempRedis::start(&[]).await else {
        return;
    };
    let opts = RedisLedgerOptions::default().wait_replicas(1, Duration::from_millis(20));
    let single = RedisLedger::connect_with(&server.ledger_url(), opts.clone())
        .await
        .unwrap();
    let Some(cluster) = common::cluster_with(opts).await else {
        return;
    };
    let t = fresh_tenant();
    for ledger in [single, cluster] {
        for i in 0..8 {
            let k = EffectKey::new(&t, "capture", format!("alone-{i}")).unwrap();
            let e = ledger.claim(&k, &ClaimOptions::default()).await.unwrap_err();
            unavailable(&e, "acknowledged by 0 of 1 replicas within 20ms");
        }
    }
    // Without waiting, the same keys are free (given back).
    let plain = RedisLedger::connect(&server.ledger_url()).await.unwrap();
    let k = EffectKey::new(&t, "capture", "alone-0").unwrap();
    assert!(acquired(plain.claim(&k, &ClaimOptions::default()).await.unwrap()).taken_over());
    let _ = raw(&server.url()).await;
}

//! Redis-specific behaviour: foreign values, a server that goes away, records
//! without TTLs, prune and the horizon watermark, clock fences, the
//! eviction-policy check, timeouts, how records spread over a cluster, and
//! opening from a URL (`FromUrl`, read-only ledgers).

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use common::{TempRedis, cluster, cluster_url, cluster_urls, ephemeral, raw, single, single_with};
use oncely::backend::{Claim, Ledger, Outcome, RecordState};
use oncely::backend::{Grant, to_micros};
use oncely::conformance::{SHORT_LEASE, SHORT_LEASE_WAIT, fresh_tenant, prune_until_gone};
use oncely::open::{Access, FromUrl, OpenOptions};
use oncely::{ClaimOptions, EffectKey, Effects, Error};
use oncely_redis::{RedisLedger, RedisLedgerOptions};
use redis::AsyncCommands;

fn acquired(c: Claim) -> oncely::backend::Lease {
    match c {
        Claim::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn single_url() -> String {
    std::env::var("ONCELY_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn is_corrupt(e: &Error) -> bool {
    matches!(e, Error::Corrupt { backend: "redis", .. })
}

/// A value oncely did not write at a record's key is reported, never
/// overwritten, by every operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_values_are_corrupt_and_untouched() {
    let Some(ledger) = single().await else { return };
    let mut conn = raw(&single_url()).await;
    let t = fresh_tenant();
    let opts = ClaimOptions::default();

    // A string where a record would be.
    let k = EffectKey::new(&t, "capture", "foreign-string").unwrap();
    let rkey = ledger.redis_key(&k);
    let _: () = conn.set(&rkey, "not yours").await.unwrap();
    let e = ledger.claim(&k, &opts).await.unwrap_err();
    assert!(is_corrupt(&e), "{e:?}");
    assert!(e.to_string().contains("string"), "{e}");
    assert!(is_corrupt(&ledger.get(&k).await.unwrap_err()));
    // A lease someone forged for it cannot write either.
    let l = acquired(
        ledger
            .claim(&EffectKey::new(&t, "capture", "donor").unwrap(), &opts)
            .await
            .unwrap(),
    );
    let forged = Grant {
        key: k.clone(),
        ..Grant::from(&l)
    }
    .into_lease();
    let o = Outcome::from_json(&1).unwrap();
    assert!(is_corrupt(&ledger.complete(&forged, &o).await.unwrap_err()));
    assert!(is_corrupt(&ledger.release(&forged).await.unwrap_err()));
    assert!(is_corrupt(
        &ledger.renew(&forged, Duration::from_secs(5)).await.unwrap_err()
    ));
    let still: String = conn.get(&rkey).await.unwrap();
    assert_eq!(still, "not yours");
    let ttl: i64 = conn.pttl(&rkey).await.unwrap();
    assert_eq!(ttl, -1, "no TTL was set on a foreign value");

    // A list.
    let k = EffectKey::new(&t, "capture", "foreign-list").unwrap();
    let rkey = ledger.redis_key(&k);
    let _: () = conn.rpush(&rkey, "a").await.unwrap();
    assert!(is_corrupt(&ledger.claim(&k, &opts).await.unwrap_err()));
    let len: i64 = conn.llen(&rkey).await.unwrap();
    assert_eq!(len, 1);

    // A hash without oncely's fields.
    let k = EffectKey::new(&t, "capture", "foreign-hash").unwrap();
    let rkey = ledger.redis_key(&k);
    let _: () = conn.hset(&rkey, "name", "someone else's").await.unwrap();
    let e = ledger.claim(&k, &opts).await.unwrap_err();
    assert!(is_corrupt(&e), "{e:?}");
    assert!(is_corrupt(&ledger.get(&k).await.unwrap_err()));
    let fields: BTreeMap<String, String> = conn.hgetall(&rkey).await.unwrap();
    assert_eq!(
        fields,
        BTreeMap::from([("name".to_owned(), "someone else's".to_owned())])
    );

    // An oncely record copied to another key's place.
    let a = EffectKey::new(&t, "capture", "a").unwrap();
    let b = EffectKey::new(&t, "capture", "b").unwrap();
    let la = acquired(ledger.claim(&a, &opts).await.unwrap());
    ledger.complete(&la, &o).await.unwrap();
    let copied: Vec<(String, Vec<u8>)> = conn.hgetall(ledger.redis_key(&a)).await.unwrap();
    let _: () = conn.hset_multiple(ledger.redis_key(&b), &copied).await.unwrap();
    assert!(is_corrupt(&ledger.claim(&b, &opts).await.unwrap_err()));
    assert!(is_corrupt(&ledger.get(&b).await.unwrap_err()));
    // The real record is unaffected.
    assert_eq!(
        ledger.get(&a).await.unwrap().unwrap().state,
        RecordState::Completed
    );
}

async fn flush_scripts(conn: &mut redis::aio::MultiplexedConnection) {
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query_async(conn).await.unwrap();
}

/// A server that lost its scripts (a restart, `SCRIPT FLUSH`) is sent them
/// again by every operation, which then takes effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushed_scripts_are_loaded_again() {
    let Some(ledger) = single().await else { return };
    let mut conn = raw(&single_url()).await;
    let t = fresh_tenant();
    let k = EffectKey::new(&t, "capture", "flushed").unwrap();
    let opts = ClaimOptions::default();
    flush_scripts(&mut conn).await;
    let l = acquired(ledger.claim(&k, &opts).await.unwrap());
    flush_scripts(&mut conn).await;
    let l = ledger.renew(&l, Duration::from_secs(60)).await.unwrap();
    flush_scripts(&mut conn).await;
    ledger
        .complete(&l, &Outcome::from_json(&7).unwrap())
        .await
        .unwrap();
    flush_scripts(&mut conn).await;
    let r = ledger.get(&k).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Completed);
    assert_eq!(r.fence, l.fence());
    flush_scripts(&mut conn).await;
    assert!(matches!(
        ledger.claim(&k, &opts).await.unwrap(),
        Claim::Completed(_)
    ));
}

/// The scripts build the stored times from the server's `TIME` without
/// formatting numbers (format 2 leaves out the fields a first claim implies):
/// what a record reads back is exactly what the operations returned, whatever
/// the microsecond digits (a short `TIME` microsecond part must be padded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_times_match_returned_times() {
    let Some(ledger) = single().await else { return };
    let mut conn = raw(&single_url()).await;
    let t = fresh_tenant();
    let retention = Duration::from_secs(3600);
    let opts = ClaimOptions::default().retention(retention);
    let mut short_micros = 0;
    for i in 0..40 {
        let k = EffectKey::new(&t, "capture", format!("times-{i}")).unwrap();
        let l = acquired(ledger.claim(&k, &opts).await.unwrap());
        let acquired_us = to_micros(l.acquired_at()).unwrap();
        // A new key's fence is the server's clock at the grant, in µs.
        assert_eq!(l.fence(), u64::try_from(acquired_us).unwrap(), "{k}");
        let micros = acquired_us.rem_euclid(1_000_000);
        if micros < 100_000 {
            short_micros += 1;
        } else if short_micros < 3 {
            // Aim the next claim just past the server's next second, where
            // TIME's microsecond part has fewer than six digits.
            let wait = 1_000_000 - micros + 10_000;
            tokio::time::sleep(Duration::from_micros(u64::try_from(wait).unwrap())).await;
        }
        let r = ledger.get(&k).await.unwrap().unwrap();
        assert_eq!(r.state, RecordState::InProgress);
        assert_eq!(r.created_at, l.acquired_at(), "{k}");
        assert_eq!(r.created_at, l.first_claimed_at(), "{k}");
        assert_eq!(r.updated_at, l.acquired_at(), "{k}");
        assert_eq!(r.lease_expires_at, Some(l.expires_at()), "{k}");
        assert_eq!(r.retain_until, r.created_at + retention, "{k}");
        let stored: String = conn.hget(ledger.redis_key(&k), "v").await.unwrap();
        assert_eq!(stored, "2", "record format");
        if i % 2 == 0 {
            ledger
                .complete(&l, &Outcome::from_json(&i).unwrap())
                .await
                .unwrap();
            let r = ledger.get(&k).await.unwrap().unwrap();
            assert_eq!(r.state, RecordState::Completed);
            assert_eq!(r.lease_expires_at, None, "a completed record has no lease");
            assert!(r.updated_at >= l.acquired_at());
            assert_eq!(r.retain_until, r.updated_at + retention, "{k}");
        } else {
            let renewed = ledger.renew(&l, Duration::from_secs(90)).await.unwrap();
            let r = ledger.get(&k).await.unwrap().unwrap();
            assert_eq!(r.lease_expires_at, Some(renewed.expires_at()), "{k}");
            ledger.release(&l).await.unwrap();
        }
    }
    assert!(short_micros > 0, "no claim landed early in a second");
}

/// A prefix of the test's own, so that its `prune` walks only its records
/// (and a watermark broken on purpose breaks no other test's prune).
fn own_prefix(t: &oncely::Tenant) -> RedisLedgerOptions {
    RedisLedgerOptions::default().prefix(format!("oncely-{t}:"))
}

/// No record carries a TTL (completed, released, taken over, abandoned), so
/// Redis never deletes one by itself: a record past its retention stays
/// until prune deletes it. A record written with a TTL by an earlier
/// version loses it at the first prune.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_carry_no_ttl() {
    let t = fresh_tenant();
    let Some(ledger) = single_with(own_prefix(&t)).await else {
        return;
    };
    let mut conn = raw(&single_url()).await;
    let brief = ClaimOptions::default().lease(SHORT_LEASE).retention(SHORT_LEASE);
    let rkey = |s: &str| ledger.redis_key(&EffectKey::new(&t, "capture", s).unwrap());

    let done = EffectKey::new(&t, "capture", "done").unwrap();
    let l = acquired(ledger.claim(&done, &brief).await.unwrap());
    let ttl: i64 = conn.pttl(rkey("done")).await.unwrap();
    assert_eq!(ttl, -1, "a lease in progress has no TTL");
    ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    let ttl: i64 = conn.pttl(rkey("done")).await.unwrap();
    assert_eq!(ttl, -1, "a completed record has no TTL");

    let released = EffectKey::new(&t, "capture", "released").unwrap();
    let l = acquired(ledger.claim(&released, &brief).await.unwrap());
    ledger.release(&l).await.unwrap();
    let ttl: i64 = conn.pttl(rkey("released")).await.unwrap();
    assert_eq!(ttl, -1, "a released record has no TTL");
    // A released record written by an earlier version carried a TTL; taking
    // it over removes it (a lease must never vanish).
    let _: () = conn.pexpire(rkey("released"), 600_000).await.unwrap();
    let l2 = acquired(ledger.claim(&released, &brief).await.unwrap());
    assert!(l2.taken_over() && l2.fence() > l.fence());
    let ttl: i64 = conn.pttl(rkey("released")).await.unwrap();
    assert_eq!(ttl, -1, "a lease taken over from a released record has no TTL");

    let abandoned = EffectKey::new(&t, "receipt", "abandoned").unwrap();
    let amo = brief.clone().at_most_once(true);
    acquired(ledger.claim(&abandoned, &amo).await.unwrap());

    // An earlier version's completed record with a TTL, not yet due.
    let legacy = EffectKey::new(&t, "capture", "legacy").unwrap();
    let l = acquired(
        ledger
            .claim(
                &legacy,
                &ClaimOptions::default().retention(Duration::from_secs(3600)),
            )
            .await
            .unwrap(),
    );
    ledger
        .complete(&l, &Outcome::from_json(&2).unwrap())
        .await
        .unwrap();
    let _: () = conn.pexpire(rkey("legacy"), 600_000).await.unwrap();

    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    assert!(matches!(
        ledger.claim(&abandoned, &amo).await.unwrap(),
        Claim::Abandoned(_)
    ));
    let ttl: i64 = conn.pttl(ledger.redis_key(&abandoned)).await.unwrap();
    assert_eq!(ttl, -1, "an abandoned step never expires");
    let r = ledger.get(&done).await.unwrap().expect("only prune deletes");
    assert_eq!(r.state, RecordState::Completed);
    assert!(r.retain_until <= r.read_at, "past its retention");

    assert_eq!(ledger.prune(u64::MAX).await.unwrap(), 1, "only `done` is due");
    assert!(ledger.get(&done).await.unwrap().is_none());
    let ttl: i64 = conn.pttl(rkey("legacy")).await.unwrap();
    assert_eq!(ttl, -1, "prune made the earlier version's record permanent");
    assert_eq!(
        ledger.get(&legacy).await.unwrap().unwrap().state,
        RecordState::Completed
    );
}

/// Prune raises the horizon before it deletes: with a watermark it cannot
/// raise it deletes nothing. Once it can, the watermark is the newest
/// creation time it deleted, never lowered by a later prune of an older
/// record, and a replay of a message at or before it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_raises_the_horizon_before_it_deletes() {
    let t = fresh_tenant();
    let Some(ledger) = single_with(own_prefix(&t)).await else {
        return;
    };
    let mut conn = raw(&single_url()).await;
    let older = EffectKey::new(&t, "capture", "older").unwrap();
    let newer = EffectKey::new(&t, "capture", "newer").unwrap();
    let lo = acquired(
        ledger
            .claim(
                &older,
                &ClaimOptions::default()
                    .lease(Duration::from_millis(100))
                    .retention(Duration::from_millis(1500)),
            )
            .await
            .unwrap(),
    );
    ledger
        .complete(&lo, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    let ln = acquired(
        ledger
            .claim(
                &newer,
                &ClaimOptions::default()
                    .lease(Duration::from_millis(100))
                    .retention(Duration::from_millis(200)),
            )
            .await
            .unwrap(),
    );
    ledger
        .complete(&ln, &Outcome::from_json(&2).unwrap())
        .await
        .unwrap();
    let created_older = lo.first_claimed_at();
    let created_newer = ln.first_claimed_at();
    assert!(created_newer > created_older);
    tokio::time::sleep(SHORT_LEASE_WAIT).await;

    let hkey = ledger.horizon_key(&t, "capture");
    let _: () = conn.rpush(&hkey, "not a watermark").await.unwrap();
    let e = ledger.prune(u64::MAX).await.unwrap_err();
    assert!(is_corrupt(&e) && e.to_string().contains("horizon"), "{e:?}");
    assert!(
        ledger.get(&newer).await.unwrap().is_some(),
        "nothing is deleted before the horizon is raised"
    );
    assert!(is_corrupt(&ledger.horizon(&t, "capture").await.unwrap_err()));
    // A claim that must ask the horizon fails closed and writes nothing.
    let other = EffectKey::new(&t, "capture", "other").unwrap();
    let e = ledger
        .claim(&other, &ClaimOptions::default().sent_at(SystemTime::now()))
        .await
        .unwrap_err();
    assert!(is_corrupt(&e) && e.to_string().contains(&hkey), "{e:?}");
    assert!(ledger.get(&other).await.unwrap().is_none());
    acquired(ledger.claim(&other, &ClaimOptions::default()).await.unwrap());

    let _: () = conn.del(&hkey).await.unwrap();
    assert_eq!(ledger.prune(u64::MAX).await.unwrap(), 1);
    assert!(ledger.get(&newer).await.unwrap().is_none());
    assert_eq!(ledger.horizon(&t, "capture").await.unwrap(), Some(created_newer));
    let stored: String = conn.get(&hkey).await.unwrap();
    assert_eq!(stored, to_micros(created_newer).unwrap().to_string());
    let ttl: i64 = conn.pttl(&hkey).await.unwrap();
    assert_eq!(ttl, -1, "a watermark is kept for good");
    assert_eq!(ledger.horizon(&t, "receipt").await.unwrap(), None);
    assert!(matches!(
        ledger.horizon(&t, "bad:kind").await.unwrap_err(),
        Error::InvalidKey { .. }
    ));

    tokio::time::sleep(Duration::from_millis(1500)).await;
    prune_until_gone(&ledger, &older).await;
    assert_eq!(
        ledger.horizon(&t, "capture").await.unwrap(),
        Some(created_newer),
        "an older record's prune never lowers the watermark"
    );

    // Replays: at or before the watermark refused, after it new work.
    for (k, sent) in [(&older, created_older), (&newer, created_newer)] {
        let e = ledger
            .claim(k, &ClaimOptions::default().sent_at(sent))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
        assert!(ledger.get(k).await.unwrap().is_none());
    }
    let l = acquired(
        ledger
            .claim(
                &newer,
                &ClaimOptions::default().sent_at(created_newer + Duration::from_micros(1)),
            )
            .await
            .unwrap(),
    );
    assert!(
        l.fence() > ln.fence(),
        "a fence after prune is above the pruned one"
    );
}

/// Fences follow the server's clock: a takeover gets the previous fence + 1
/// when that is above the clock, and a stored fence that Lua could not hold
/// exactly (2^53 or more) is refused, never rounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_follow_the_server_clock() {
    let Some(ledger) = single().await else { return };
    let mut conn = raw(&single_url()).await;
    let k = EffectKey::new(&fresh_tenant(), "capture", "fence").unwrap();
    let rkey = ledger.redis_key(&k);
    let l = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
    ledger.release(&l).await.unwrap();
    let l2 = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
    assert!(l2.fence() > l.fence());
    assert_eq!(
        l2.fence(),
        u64::try_from(to_micros(l2.acquired_at()).unwrap()).unwrap()
    );
    ledger.release(&l2).await.unwrap();
    // A fence an hour ahead of the clock (a record from a master whose clock
    // ran fast): the next grant is one above it.
    let ahead = l2.fence() + 3_600_000_000;
    let _: () = conn.hset(&rkey, "f", ahead).await.unwrap();
    let l3 = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
    assert_eq!((l3.fence(), l3.taken_over()), (ahead + 1, true));
    ledger.release(&l3).await.unwrap();

    let _: () = conn.hset(&rkey, "f", 1u64 << 53).await.unwrap();
    assert!(is_corrupt(
        &ledger.claim(&k, &ClaimOptions::default()).await.unwrap_err()
    ));
    assert!(is_corrupt(&ledger.get(&k).await.unwrap_err()));
    let forged = Grant {
        fence: (1 << 53) + 1,
        ..Grant::from(&l3)
    }
    .into_lease();
    assert!(is_corrupt(&ledger.release(&forged).await.unwrap_err()));
    let f: u64 = conn.hget(&rkey, "f").await.unwrap();
    assert_eq!(f, 1 << 53, "nothing was changed");
}

/// Nobody listening: Unavailable, and the runner's handler never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_refused_is_unavailable() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = RedisLedger::connect(&format!("redis://127.0.0.1:{port}"))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable { backend: "redis", .. }), "{e:?}");
    assert!(e.is_retryable());
    let e = RedisLedger::connect(&format!("redis+cluster://127.0.0.1:{port}"))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable { backend: "redis", .. }), "{e:?}");
    let e = RedisLedger::connect("not a url").await.unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    let e = RedisLedger::connect_with(
        "redis://127.0.0.1:6379",
        RedisLedgerOptions::default().prefix("bad{prefix}"),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
}

/// The server dies under a connected ledger: every operation fails closed
/// (Unavailable) and `Effects::run` does not run its handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_going_down_fails_closed() {
    let Some(mut server) = TempRedis::start(&[]).await else {
        return;
    };
    let ledger = RedisLedger::connect(&server.ledger_url()).await.unwrap();
    let effects = Effects::new(ledger.clone());
    let t = fresh_tenant();
    let ran = AtomicUsize::new(0);
    let k = EffectKey::new(&t, "capture", "before").unwrap();
    let v: u32 = effects
        .run(&k, &ClaimOptions::default(), |_| {
            ran.fetch_add(1, Ordering::SeqCst);
            async { Ok(7) }
        })
        .await
        .unwrap();
    assert_eq!((v, ran.load(Ordering::SeqCst)), (7, 1));

    server.kill();
    for i in 0..3 {
        let k = EffectKey::new(&t, "capture", format!("after-{i}")).unwrap();
        let e = effects
            .run::<u32, _, _>(&k, &ClaimOptions::default(), |_| {
                ran.fetch_add(1, Ordering::SeqCst);
                async { Ok(0) }
            })
            .await
            .unwrap_err();
        assert!(
            matches!(e, Error::Unavailable { backend: "redis", .. }),
            "attempt {i}: {e:?}"
        );
        let e = ledger.get(&k).await.unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1, "no handler ran without the ledger");
}

/// A server that does not answer in time: a retryable backend error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_server_is_a_retryable_timeout() {
    let Some(server) = TempRedis::start(&[]).await else {
        return;
    };
    let opts = RedisLedgerOptions::default().request_timeout(Duration::from_millis(200));
    let ledger = RedisLedger::connect_with(&server.ledger_url(), opts)
        .await
        .unwrap();
    let k = EffectKey::new(&fresh_tenant(), "capture", "paused").unwrap();
    let mut admin = raw(&server.url()).await;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(1500)
        .arg("ALL")
        .query_async(&mut admin)
        .await
        .unwrap();
    let e = ledger.claim(&k, &ClaimOptions::default()).await.unwrap_err();
    assert!(matches!(e, Error::Backend { retryable: true, .. }), "{e:?}");
    // Once the pause ends the ledger works again on the same connection.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let mut answer = None;
    for _ in 0..20 {
        match ledger.claim(&k, &ClaimOptions::default()).await {
            Ok(c) => {
                answer = Some(c);
                break;
            }
            Err(e) => {
                assert!(e.is_retryable(), "{e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    // The timed-out claim may or may not have been applied (as after any
    // dropped request); either way the key has exactly one holder.
    let fence = match answer.expect("ledger recovers after the pause") {
        Claim::Acquired(l) => l.fence(),
        Claim::InProgress { fence, .. } => fence,
        other => panic!("{other:?}"),
    };
    assert_eq!(ledger.get(&k).await.unwrap().unwrap().fence, fence);
}

fn config_error(e: Error, wanted: &[&str]) {
    match &e {
        Error::Config(m) if wanted.iter().all(|w| m.contains(w)) => {}
        _ => panic!("expected Error::Config mentioning {wanted:?}, got {e:?}"),
    }
}

/// What a ledger reports its records survive.
fn durability(ledger: &RedisLedger) -> &'static str {
    ledger.capabilities().durability
}

/// A server that persists nothing (`--save "" --appendonly no`, how the
/// test servers run) is refused unless the ledger is told to accept it:
/// `RedisLedgerOptions::ephemeral(true)` or `?ephemeral=true` in the URL,
/// which wins over the option either way. A read-only ledger is not
/// refused. Durability reports what the server keeps, read again on each
/// connect: snapshots, AOF and its fsync policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_persists_nothing_is_refused_unless_accepted() {
    let Some(server) = TempRedis::start(&[]).await else {
        return;
    };
    let url = server.url();
    let refused = ["persists nothing", "ephemeral=true", "ephemeral(true)"];
    config_error(RedisLedger::connect(&url).await.unwrap_err(), &refused);
    for access in [Access::Migrate, Access::Existing] {
        let e = RedisLedger::from_url(&url, OpenOptions::new(access))
            .await
            .unwrap_err();
        config_error(e, &refused);
    }
    let e = RedisLedger::connect_with(
        &format!("{url}?ephemeral=false"),
        RedisLedgerOptions::default().ephemeral(true),
    )
    .await
    .unwrap_err();
    config_error(e, &refused);

    let accepted = [
        RedisLedger::connect(&format!("{url}?ephemeral=true"))
            .await
            .unwrap(),
        RedisLedger::connect_with(&url, RedisLedgerOptions::default().ephemeral(true))
            .await
            .unwrap(),
        RedisLedger::from_url(
            &format!("{url}/0?ephemeral=true"),
            OpenOptions::new(Access::Migrate),
        )
        .await
        .unwrap(),
        RedisLedger::from_url(&url, OpenOptions::new(Access::ReadOnly))
            .await
            .unwrap(),
    ];
    for ledger in &accepted {
        assert!(durability(ledger).starts_with("none"), "{}", durability(ledger));
    }
    // The accepted ledger writes as any other.
    let k = EffectKey::new(&fresh_tenant(), "capture", "unpersisted").unwrap();
    acquired(accepted[0].claim(&k, &ClaimOptions::default()).await.unwrap());
    assert_eq!(
        accepted[0].options(),
        &RedisLedgerOptions::default().ephemeral(true)
    );

    // Persisting servers are accepted without it, and reported as they are.
    let mut admin = raw(&url).await;
    for (param, value, reported) in [
        ("save", "3600 1", "RDB snapshots only"),
        ("appendonly", "yes", "AOF, appendfsync everysec"),
        ("appendfsync", "always", "AOF, appendfsync always"),
        ("appendfsync", "no", "AOF, appendfsync no"),
    ] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(param)
            .arg(value)
            .query_async(&mut admin)
            .await
            .unwrap();
        let ledger = RedisLedger::connect(&url).await.unwrap();
        assert!(
            durability(&ledger).starts_with(reported),
            "{}",
            durability(&ledger)
        );
        assert_eq!(ledger.options(), &RedisLedgerOptions::default());
    }
    let Some(aof) = TempRedis::start(&["--appendonly", "yes", "--appendfsync", "always"]).await else {
        return;
    };
    let ledger = RedisLedger::connect(&aof.url()).await.unwrap();
    assert!(
        durability(&ledger).starts_with("AOF, appendfsync always"),
        "{}",
        durability(&ledger)
    );
}

/// Where `CONFIG` is not allowed (managed services rename or disable it),
/// `INFO persistence` says whether AOF is on; where neither answers, the
/// durability is reported as unknown and the ledger opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistence_without_config_falls_back_to_info_then_unknown() {
    for (extra, reported) in [
        (
            &["--rename-command", "CONFIG", ""][..],
            "no AOF (from INFO persistence",
        ),
        (
            &["--appendonly", "yes", "--rename-command", "CONFIG", ""][..],
            "AOF (from INFO persistence",
        ),
        (
            &["--rename-command", "CONFIG", "", "--rename-command", "INFO", ""][..],
            "unknown",
        ),
    ] {
        let Some(server) = TempRedis::start(extra).await else {
            return;
        };
        let ledger = RedisLedger::connect(&server.url()).await.unwrap();
        assert!(
            durability(&ledger).starts_with(reported),
            "{extra:?}: {}",
            durability(&ledger)
        );
    }
}

/// The test cluster persists nothing either: refused, naming a master,
/// unless accepted; then reported by its weakest master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_that_persists_nothing_is_refused_unless_accepted() {
    let Some(url) = cluster_url() else { return };
    let e = RedisLedger::connect(&url).await.unwrap_err();
    config_error(e, &["the Redis master ", "persists nothing"]);
    let ledger = RedisLedger::connect(&ephemeral(&url)).await.unwrap();
    assert!(ledger.is_cluster());
    assert!(durability(&ledger).starts_with("none"), "{}", durability(&ledger));
}

/// A server that may evict keys is refused unless the caller opts out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_policy_is_checked() {
    for policy in ["allkeys-lru", "volatile-ttl"] {
        let Some(server) = TempRedis::start(&["--maxmemory-policy", policy]).await else {
            return;
        };
        let e = RedisLedger::connect(&server.ledger_url()).await.unwrap_err();
        assert!(matches!(&e, Error::Config(m) if m.contains(policy)), "{e:?}");
        let ok = RedisLedger::connect_with(
            &server.ledger_url(),
            RedisLedgerOptions::default().require_noeviction(false),
        )
        .await;
        assert!(ok.is_ok(), "{ok:?}");
    }
}

/// Two ledgers with different prefixes on one server keep separate records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefixes_separate_ledgers() {
    let Some(a) = single().await else { return };
    let Some(b) = single_with(RedisLedgerOptions::default().prefix("other-app:")).await else {
        return;
    };
    let k = EffectKey::new(&fresh_tenant(), "capture", "shared-name").unwrap();
    assert!(b.redis_key(&k).starts_with("other-app:{"));
    // Each acquires: neither sees the other's record.
    acquired(a.claim(&k, &ClaimOptions::default()).await.unwrap());
    acquired(b.claim(&k, &ClaimOptions::default()).await.unwrap());
}

/// Counts a tenant's records on each cluster master.
async fn records_per_master(tenant: &oncely::Tenant) -> Vec<usize> {
    let mut counts = Vec::new();
    for url in cluster_urls().unwrap() {
        let mut conn = raw(&url).await;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut conn).await.unwrap();
        if !matches!(&role[0], redis::Value::BulkString(b) if b == b"master") {
            continue;
        }
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("oncely:{{*}}:{tenant}/*"))
            .query_async(&mut conn)
            .await
            .unwrap();
        counts.push(keys.len());
    }
    counts
}

/// Records spread over every master, subjects with braces included: the hash
/// tag comes from the whole key, so `{same}-1` and `{same}-2` do not share a
/// slot as they would under Redis's rule for the raw key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keys_spread_over_masters() {
    let Some(ledger) = cluster().await else { return };
    assert!(ledger.is_cluster());
    let t = fresh_tenant();
    let mut slots = HashSet::new();
    let mut conn = raw(&cluster_urls().unwrap()[0]).await;
    for i in 0..60 {
        let k = EffectKey::new(&t, "capture", format!("{{same}}-{i}")).unwrap();
        let l = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
        ledger
            .complete(&l, &Outcome::from_json(&i).unwrap())
            .await
            .unwrap();
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(ledger.redis_key(&k))
            .query_async(&mut conn)
            .await
            .unwrap();
        slots.insert(slot);
    }
    assert!(slots.len() > 50, "60 keys fell into only {} slots", slots.len());
    let raw_slot: i64 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(format!("oncely:{t}/capture:{{same}}-1"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let raw_slot2: i64 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(format!("oncely:{t}/capture:{{same}}-2"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        raw_slot, raw_slot2,
        "control: Redis's own rule would pin them together"
    );
    let counts = records_per_master(&t).await;
    assert_eq!(counts.iter().sum::<usize>(), 60, "{counts:?}");
    if std::env::var_os("ONCELY_REDIS_CLUSTER_URLS").is_none() {
        // Our own three masters: 60 evenly hashed keys reach all of them
        // (the chance that one gets none is 3 * (2/3)^60, about 1e-10).
        assert_eq!(counts.len(), 3, "three masters: {counts:?}");
        assert!(
            counts.iter().all(|&n| n > 0),
            "every master holds records: {counts:?}"
        );
    } else {
        assert!(counts.iter().filter(|&&n| n > 0).count() >= 2, "{counts:?}");
    }
}

/// `abandoned` finds the abandoned steps of a tenant on every master, oldest
/// first, and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_abandoned_lists_every_master() {
    let Some(ledger) = cluster().await else { return };
    let t = fresh_tenant();
    let amo = ClaimOptions::default().lease(SHORT_LEASE).at_most_once(true);
    let mut expected = Vec::new();
    for i in 0..12 {
        let k = EffectKey::new(&t, "receipt", format!("mail-{i}")).unwrap();
        acquired(ledger.claim(&k, &amo).await.unwrap());
        expected.push(k);
    }
    // Neither a completed step, a live lease nor another tenant's step is listed.
    let done = EffectKey::new(&t, "receipt", "sent").unwrap();
    let l = acquired(ledger.claim(&done, &amo).await.unwrap());
    ledger
        .complete(&l, &Outcome::from_json(&"ok").unwrap())
        .await
        .unwrap();
    let live = EffectKey::new(&t, "receipt", "sending").unwrap();
    acquired(
        ledger
            .claim(&live, &ClaimOptions::default().at_most_once(true))
            .await
            .unwrap(),
    );
    let other = fresh_tenant();
    let theirs = EffectKey::new(&other, "receipt", "mail-0").unwrap();
    acquired(ledger.claim(&theirs, &amo).await.unwrap());
    tokio::time::sleep(SHORT_LEASE_WAIT).await;

    let counts = records_per_master(&t).await;
    assert!(
        counts.iter().filter(|&&n| n > 0).count() >= 2,
        "the steps are on several masters: {counts:?}"
    );
    let listed = ledger.abandoned(&t, 100).await.unwrap();
    let keys: Vec<EffectKey> = listed.iter().map(|r| r.key.clone()).collect();
    assert_eq!(keys, expected, "all twelve, oldest first");
    assert!(listed.iter().all(|r| r.state == RecordState::Abandoned));
    assert_eq!(ledger.abandoned(&t, 5).await.unwrap().len(), 5);
    assert_eq!(ledger.abandoned(&other, 100).await.unwrap().len(), 1);
}

/// Many clients on separate connections race on one key per master.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_race_on_separate_connections() {
    let Some(_) = cluster().await else { return };
    let t = fresh_tenant();
    let keys: Vec<EffectKey> = (0..6)
        .map(|i| EffectKey::new(&t, "capture", format!("race-{i}")).unwrap())
        .collect();
    let mut ledgers = Vec::new();
    for _ in 0..8 {
        ledgers.push(cluster().await.unwrap());
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(ledgers.len() * keys.len()));
    let mut tasks = Vec::new();
    for ledger in &ledgers {
        for k in &keys {
            let (ledger, k, barrier) = (ledger.clone(), k.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                (
                    k.clone(),
                    ledger.claim(&k, &ClaimOptions::default()).await.unwrap(),
                )
            }));
        }
    }
    let mut winners = BTreeMap::new();
    for task in tasks {
        let (k, c) = task.await.unwrap();
        if matches!(c, Claim::Acquired(_)) {
            *winners.entry(k.to_string()).or_insert(0) += 1;
        }
    }
    assert_eq!(winners.len(), keys.len());
    assert!(winners.values().all(|&n| n == 1), "{winners:?}");
}

/// On a cluster the watermark lives in another slot than the record, so a
/// claim with `sent_at` reads it after its insert. A watermark it cannot
/// read fails the claim closed and takes the insert back: nothing is left
/// for a later delivery to take over without the check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_claim_checks_the_horizon_after_its_insert() {
    let t = fresh_tenant();
    let Some(ledger) = common::cluster_with(own_prefix(&t)).await else {
        return;
    };
    let urls = cluster_urls().unwrap();
    let mut conn = redis::cluster::ClusterClient::new(urls)
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    let k = EffectKey::new(&t, "capture", "checked-after").unwrap();
    let hkey = ledger.horizon_key(&t, "capture");
    let slot = |key: String| redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).clone();
    let (a, b): (i64, i64) = (
        slot(ledger.redis_key(&k)).query_async(&mut conn).await.unwrap(),
        slot(hkey.clone()).query_async(&mut conn).await.unwrap(),
    );
    assert_ne!(a, b, "the record and the watermark are in different slots");

    let _: () = conn.rpush(&hkey, "not a watermark").await.unwrap();
    let sent = ClaimOptions::default().sent_at(SystemTime::now());
    let e = ledger.claim(&k, &sent).await.unwrap_err();
    assert!(is_corrupt(&e) && e.to_string().contains(&hkey), "{e:?}");
    assert!(
        ledger.get(&k).await.unwrap().is_none(),
        "the insert was taken back"
    );
    // Without sent_at the horizon is not asked.
    let l = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
    ledger.release(&l).await.unwrap();
    // A takeover found the record: the horizon is not its question either.
    let l2 = acquired(ledger.claim(&k, &sent).await.unwrap());
    assert!(l2.taken_over());

    let _: () = conn.del(&hkey).await.unwrap();
    let fresh = EffectKey::new(&t, "capture", "fresh").unwrap();
    let l = acquired(ledger.claim(&fresh, &sent).await.unwrap());
    assert!(!l.taken_over());
    assert_eq!(ledger.get(&fresh).await.unwrap().unwrap().fence, l.fence());
}

/// A cluster claim beyond the horizon whose caller drops it at any moment
/// (a timeout, `select!`) leaves no record behind: the read of the
/// watermark and the take-back run to the end on their own. A record left
/// behind would be taken over after its lease, with no horizon check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_dropped_claim_beyond_the_horizon_leaves_nothing() {
    let t = fresh_tenant();
    let Some(ledger) = common::cluster_with(own_prefix(&t)).await else {
        return;
    };
    let mut conn = redis::cluster::ClusterClient::new(cluster_urls().unwrap())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    // As if prune had deleted records of this tenant and kind created now.
    let now = to_micros(SystemTime::now()).unwrap();
    let _: () = conn.set(ledger.horizon_key(&t, "capture"), now).await.unwrap();
    let replay = ClaimOptions::default().sent_at(SystemTime::now() - Duration::from_secs(3600));
    let mut rng = oncely::conformance::Rng::from_env("cluster_dropped_claim");
    let mut keys = Vec::new();
    let mut dropped = 0;
    for i in 0..150 {
        let k = EffectKey::new(&t, "capture", format!("dropped-{i}")).unwrap();
        // Drop points spread over the claim's two round trips.
        // A zero timeout drops the claim right after its first poll.
        let after = match i % 4 {
            0 => Duration::ZERO,
            _ => Duration::from_micros(rng.below(3_000)),
        };
        match tokio::time::timeout(after, ledger.claim(&k, &replay)).await {
            Err(_) => dropped += 1,
            Ok(Err(Error::BeyondHorizon { .. })) => {}
            Ok(other) => panic!("{other:?}"),
        }
        keys.push(k);
    }
    assert!(dropped > 0, "no claim was dropped");
    tokio::time::sleep(Duration::from_millis(500)).await;
    for k in &keys {
        assert!(
            ledger.get(k).await.unwrap().is_none(),
            "{k}: a dropped claim left its insert behind"
        );
    }
}

/// The claim script as the ledger sends it, for tests that must leave a
/// record exactly as a cluster claim whose horizon check never ran (its reply
/// lost, its take-back unable to reach the server): the insert, without the
/// check that follows it. The arguments restate `RedisLedger::claim_once`'s.
static CLAIM_SCRIPT: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(concat!(
        include_str!("../src/lua/prelude.lua"),
        include_str!("../src/lua/claim.lua")
    ))
});

/// What a cluster claim with `sent_at` inserts, before its horizon check:
/// returns the record's fence and creation time (µs).
async fn insert_unchecked(
    ledger: &RedisLedger,
    conn: &mut redis::cluster_async::ClusterConnection,
    key: &EffectKey,
    sent_at: SystemTime,
    at_most_once: bool,
) -> (u64, i64) {
    // claim.lua's ARGV: the batch's size and options (the waiter's mark and
    // the touch flag last), then per record its key, horizon index and floor.
    let mut replies: Vec<Vec<redis::Value>> = CLAIM_SCRIPT
        .key(ledger.redis_key(key))
        .arg(1)
        .arg(i64::try_from(SHORT_LEASE.as_micros()).unwrap())
        .arg(3_600_000_000i64)
        .arg("")
        .arg(if at_most_once { "1" } else { "0" })
        .arg(to_micros(sent_at).unwrap())
        .arg("")
        .arg("")
        .arg(key.as_str())
        .arg("")
        .arg("")
        .invoke_async(conn)
        .await
        .unwrap();
    let reply = replies.pop().unwrap();
    let int = |v: &redis::Value| match v {
        redis::Value::Int(i) => *i,
        other => panic!("{other:?}"),
    };
    assert!(
        matches!(&reply[0], redis::Value::BulkString(b) if b == b"acquired"),
        "{reply:?}"
    );
    (u64::try_from(int(&reply[1])).unwrap(), int(&reply[3]))
}

async fn cluster_conn() -> redis::cluster_async::ClusterConnection {
    redis::cluster::ClusterClient::new(cluster_urls().unwrap())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap()
}

/// A cluster claim with `sent_at` whose horizon check never ran leaves its
/// record marked with that `sent_at` (`hz`). Once its lease has ended, and
/// the watermark has passed its `sent_at`, whoever would take it over checks
/// again and finds that it should never have existed: the record is removed
/// and the key claimed as absent. A replay of the message is refused, a
/// claim without `sent_at` starts afresh with a fence above the removed
/// record's, and a newer message acquires. An at-most-once record in that
/// state stays abandoned, for reconciliation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_unchecked_record_beyond_the_horizon_is_removed_on_takeover() {
    let t = fresh_tenant();
    let Some(ledger) = common::cluster_with(own_prefix(&t)).await else {
        return;
    };
    let mut conn = cluster_conn().await;
    let key = |s: &str| EffectKey::new(&t, "capture", s).unwrap();
    let hour_ago = SystemTime::now() - Duration::from_secs(3600);
    let replayed = insert_unchecked(&ledger, &mut conn, &key("replayed"), hour_ago, false).await;
    let fresh = insert_unchecked(&ledger, &mut conn, &key("fresh"), hour_ago, false).await;
    let ahead = insert_unchecked(&ledger, &mut conn, &key("ahead"), hour_ago, false).await;
    // A fence an hour ahead of the clock (written by a master whose clock
    // ran fast): the key's next record must still get a higher one.
    let ahead_fence = ahead.0 + 3_600_000_000;
    let _: () = conn
        .hset(ledger.redis_key(&key("ahead")), "f", ahead_fence)
        .await
        .unwrap();
    let amo = EffectKey::new(&t, "capture", "mail").unwrap();
    insert_unchecked(&ledger, &mut conn, &amo, hour_ago, true).await;
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    // As if prune had deleted a record of this tenant and kind created now.
    let now = SystemTime::now();
    let _: () = conn
        .set(ledger.horizon_key(&t, "capture"), to_micros(now).unwrap())
        .await
        .unwrap();

    let e = ledger
        .claim(&key("replayed"), &ClaimOptions::default().sent_at(hour_ago))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
    assert!(
        ledger.get(&key("replayed")).await.unwrap().is_none(),
        "the unchecked record is gone, and the replay left nothing"
    );
    let old = oncely::backend::Grant {
        key: key("replayed"),
        fence: replayed.0,
        expires_at: now,
        first_claimed_at: now,
        acquired_at: now,
        taken_over: false,
        at_most_once: false,
    }
    .into_lease();
    assert!(ledger.release(&old).await.unwrap_err().is_lease_lost());
    // A message produced after the watermark is new work.
    let l = acquired(
        ledger
            .claim(
                &key("replayed"),
                &ClaimOptions::default().sent_at(now + Duration::from_millis(1)),
            )
            .await
            .unwrap(),
    );
    assert!(!l.taken_over() && l.fence() > replayed.0, "{l:?}");

    let l = acquired(
        ledger
            .claim(&key("fresh"), &ClaimOptions::default())
            .await
            .unwrap(),
    );
    assert!(!l.taken_over(), "a new record, not a takeover: {l:?}");
    assert!(l.fence() > fresh.0, "{l:?}");
    assert!(to_micros(l.first_claimed_at()).unwrap() > fresh.1, "{l:?}");
    let r = ledger.get(&key("fresh")).await.unwrap().unwrap();
    assert_eq!((r.fence, r.created_at), (l.fence(), l.first_claimed_at()));

    let l = acquired(
        ledger
            .claim(&key("ahead"), &ClaimOptions::default())
            .await
            .unwrap(),
    );
    assert!(!l.taken_over(), "{l:?}");
    assert!(l.fence() > ahead_fence, "above the removed record's fence: {l:?}");

    // Never taken over, so never removed: it waits for reconciliation.
    assert!(matches!(
        ledger.claim(&amo, &ClaimOptions::default()).await.unwrap(),
        Claim::Abandoned(_)
    ));
    assert_eq!(
        ledger.get(&amo).await.unwrap().unwrap().state,
        RecordState::Abandoned
    );
}

/// An unchecked record whose `sent_at` is after the watermark (or where
/// nothing was pruned) passes the repeated check: it is taken over as any
/// expired lease, and its mark cleared, so a later takeover does not check
/// again. A watermark that cannot be read fails the claim closed and leaves
/// the record as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_unchecked_record_within_the_horizon_is_taken_over() {
    let t = fresh_tenant();
    let Some(ledger) = common::cluster_with(own_prefix(&t)).await else {
        return;
    };
    let mut conn = cluster_conn().await;
    let hour_ago = SystemTime::now() - Duration::from_secs(3600);
    let sent_us = to_micros(hour_ago).unwrap();
    let capture = EffectKey::new(&t, "capture", "within").unwrap();
    let refund = EffectKey::new(&t, "refund", "never-pruned").unwrap();
    let mut old = Vec::new();
    for k in [&capture, &refund] {
        old.push(insert_unchecked(&ledger, &mut conn, k, hour_ago, false).await);
        let hz: Option<String> = conn.hget(ledger.redis_key(k), "hz").await.unwrap();
        assert_eq!(
            hz,
            Some(sent_us.to_string()),
            "{k}: the record carries its sent_at"
        );
    }
    tokio::time::sleep(SHORT_LEASE_WAIT).await;

    let hkey = ledger.horizon_key(&t, "capture");
    let _: () = conn.rpush(&hkey, "not a watermark").await.unwrap();
    let e = ledger
        .claim(&capture, &ClaimOptions::default())
        .await
        .unwrap_err();
    assert!(is_corrupt(&e) && e.to_string().contains(&hkey), "{e:?}");
    let hz: Option<String> = conn.hget(ledger.redis_key(&capture), "hz").await.unwrap();
    assert_eq!(hz, Some(sent_us.to_string()), "left as it was");
    assert_eq!(ledger.get(&capture).await.unwrap().unwrap().fence, old[0].0);
    let _: () = conn.del(&hkey).await.unwrap();
    let _: () = conn.set(&hkey, sent_us - 1_000_000).await.unwrap();

    for (k, (fence, created)) in [&capture, &refund].into_iter().zip(old) {
        let l = acquired(
            ledger
                .claim(k, &ClaimOptions::default().lease(SHORT_LEASE))
                .await
                .unwrap(),
        );
        assert!(l.taken_over() && l.fence() > fence, "{k}: {l:?}");
        assert_eq!(to_micros(l.first_claimed_at()).unwrap(), created, "{k}");
        let hz: Option<String> = conn.hget(ledger.redis_key(k), "hz").await.unwrap();
        assert_eq!(hz, None, "{k}: checked, the mark is cleared");
        // Checked once: a later watermark above the old sent_at changes
        // nothing for the record, which is taken over as usual.
        tokio::time::sleep(SHORT_LEASE_WAIT).await;
        let _: () = conn
            .set(
                ledger.horizon_key(&t, k.kind()),
                to_micros(SystemTime::now()).unwrap(),
            )
            .await
            .unwrap();
        let l2 = acquired(ledger.claim(k, &ClaimOptions::default()).await.unwrap());
        assert!(l2.taken_over() && l2.fence() > l.fence(), "{k}: {l2:?}");
        assert_eq!(l2.first_claimed_at(), l.first_claimed_at(), "{k}");
    }
}

/// A cluster claim with `sent_at` that passed its check keeps the mark
/// until its holder's first write: renew, complete and release each clear
/// it (in the same script), so the record is theirs for good. A holder that
/// never writes keeps it, and a takeover after the watermark passed its
/// `sent_at` removes the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_lease_holder_writes_clear_the_unchecked_mark() {
    let t = fresh_tenant();
    let Some(ledger) = common::cluster_with(own_prefix(&t)).await else {
        return;
    };
    let mut conn = cluster_conn().await;
    let hour_ago = SystemTime::now() - Duration::from_secs(3600);
    let opts = ClaimOptions::default().lease(SHORT_LEASE).sent_at(hour_ago);
    let key = |s: &str| EffectKey::new(&t, "capture", s).unwrap();
    let mut leases = BTreeMap::new();
    for s in ["renewed", "completed", "released", "untouched"] {
        let l = acquired(ledger.claim(&key(s), &opts).await.unwrap());
        let hz: Option<String> = conn.hget(ledger.redis_key(&key(s)), "hz").await.unwrap();
        assert_eq!(hz, Some(to_micros(hour_ago).unwrap().to_string()), "{s}");
        leases.insert(s, l);
    }
    let renewed = ledger.renew(&leases["renewed"], SHORT_LEASE).await.unwrap();
    ledger
        .complete(&leases["completed"], &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    ledger.release(&leases["released"]).await.unwrap();
    for s in ["renewed", "completed", "released"] {
        let hz: Option<String> = conn.hget(ledger.redis_key(&key(s)), "hz").await.unwrap();
        assert_eq!(hz, None, "{s}: a lease holder's write clears the mark");
    }
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    let _: () = conn
        .set(
            ledger.horizon_key(&t, "capture"),
            to_micros(SystemTime::now()).unwrap(),
        )
        .await
        .unwrap();
    let l = acquired(ledger.claim(&key("renewed"), &opts).await.unwrap());
    assert!(l.taken_over() && l.fence() > renewed.fence(), "{l:?}");
    assert!(matches!(
        ledger.claim(&key("completed"), &opts).await.unwrap(),
        Claim::Completed(_)
    ));
    let l = acquired(ledger.claim(&key("released"), &opts).await.unwrap());
    assert!(l.taken_over() && l.fence() > leases["released"].fence(), "{l:?}");
    // Control: the holder that never wrote loses its record.
    let l = acquired(
        ledger
            .claim(&key("untouched"), &ClaimOptions::default())
            .await
            .unwrap(),
    );
    assert!(
        !l.taken_over() && l.fence() > leases["untouched"].fence(),
        "{l:?}"
    );
}

/// `from_url` opens both URL forms with every access: one server, and the
/// real cluster through a `redis+cluster://` URL listing its nodes. The
/// connect timeout becomes `RedisLedgerOptions::connect_timeout`; nothing else changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_url_opens_a_server_or_a_cluster() {
    assert_eq!(RedisLedger::SCHEMES, ["redis", "redis+cluster", "redis+sentinel"]);
    if single().await.is_none() {
        return;
    }
    let t = fresh_tenant();
    let o = Outcome::from_json(&1).unwrap();
    for access in [Access::Migrate, Access::Existing] {
        let ledger = RedisLedger::from_url(&ephemeral(&single_url()), OpenOptions::new(access))
            .await
            .unwrap();
        assert!(!ledger.is_cluster() && !ledger.is_read_only(), "{access:?}");
        assert_eq!(
            ledger.options(),
            &RedisLedgerOptions::default().ephemeral(true),
            "{access:?}"
        );
        let k = EffectKey::new(&t, "capture", format!("single-{access:?}")).unwrap();
        let l = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
        ledger.complete(&l, &o).await.unwrap();
    }
    let timeout = Duration::from_millis(1500);
    let ledger = RedisLedger::from_url(
        &single_url(),
        OpenOptions::new(Access::ReadOnly).connect_timeout(timeout),
    )
    .await
    .unwrap();
    assert!(ledger.is_read_only());
    assert_eq!(
        ledger.options(),
        &RedisLedgerOptions::default()
            .connect_timeout(timeout)
            .read_only(true)
    );

    let Some(url) = cluster_url() else { return };
    assert!(url.starts_with("redis+cluster://") && url.contains(','), "{url}");
    for access in [Access::Migrate, Access::Existing] {
        let ledger = RedisLedger::from_url(&ephemeral(&url), OpenOptions::new(access))
            .await
            .unwrap();
        assert!(ledger.is_cluster() && !ledger.is_read_only(), "{access:?}");
        // Keys of many slots: the ledger reaches every master through the
        // nodes the URL lists.
        for i in 0..12 {
            let k = EffectKey::new(&t, "capture", format!("cluster-{access:?}-{i}")).unwrap();
            let l = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
            ledger.complete(&l, &o).await.unwrap();
            assert_eq!(
                ledger.get(&k).await.unwrap().unwrap().state,
                RecordState::Completed
            );
        }
    }
    let reader = RedisLedger::from_url(&url, OpenOptions::new(Access::ReadOnly))
        .await
        .unwrap();
    assert!(reader.is_cluster() && reader.is_read_only());
    let k = EffectKey::new(&t, "capture", "cluster-Migrate-0").unwrap();
    assert_eq!(
        reader.get(&k).await.unwrap().unwrap().state,
        RecordState::Completed
    );
    let e = reader
        .claim(
            &EffectKey::new(&t, "capture", "cluster-read-only").unwrap(),
            &ClaimOptions::default(),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
}

/// URLs that are not this backend's, or malformed, fail with
/// `Error::Config` before anything connects, without quoting a password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_url_refuses_other_and_malformed_urls() {
    for url in [
        "nats://:hunter2@127.0.0.1:4222",
        "unix:///tmp/hunter2.sock",
        "rediss://:hunter2@127.0.0.1:6379",
        "redis://:hunter2@127.0.0.1:6379,127.0.0.1:6380",
        "redis+cluster://:hunter2@",
        "redis+cluster://127.0.0.1:7000,postgres://:hunter2@127.0.0.1:5432",
        "redis:hunter2",
    ] {
        for access in [Access::Migrate, Access::ReadOnly] {
            match RedisLedger::from_url(url, OpenOptions::new(access)).await {
                Err(Error::Config(m)) => assert!(!m.contains("hunter2"), "{url}: {m}"),
                other => panic!("{url}: expected Error::Config, got {other:?}"),
            }
        }
    }
}

/// A read-only ledger reads like any other and refuses every write with
/// `Error::Config` before any round trip: with its server gone, its writes
/// still say Config (a round trip would have said Unavailable), and a
/// refused claim left no record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_ledger_refuses_writes_before_any_round_trip() {
    let Some(mut server) = TempRedis::start(&[]).await else {
        return;
    };
    let writer = RedisLedger::connect(&server.ledger_url()).await.unwrap();
    let reader = RedisLedger::from_url(&server.url(), OpenOptions::new(Access::ReadOnly))
        .await
        .unwrap();
    assert!(reader.is_read_only() && !writer.is_read_only());
    let t = fresh_tenant();
    let o = Outcome::from_json(&1).unwrap();
    let done = EffectKey::new(&t, "capture", "done").unwrap();
    let l = acquired(writer.claim(&done, &ClaimOptions::default()).await.unwrap());
    writer.complete(&l, &o).await.unwrap();
    let held = EffectKey::new(&t, "capture", "held").unwrap();
    let lease = acquired(writer.claim(&held, &ClaimOptions::default()).await.unwrap());

    // Reads work.
    assert_eq!(
        reader.get(&done).await.unwrap().unwrap().state,
        RecordState::Completed
    );
    assert!(reader.abandoned(&t, 10).await.unwrap().is_empty());
    assert_eq!(reader.horizon(&t, "capture").await.unwrap(), None);

    let refused = |what: &str, r: oncely::Result<()>| match r {
        Err(Error::Config(m)) => assert!(m.contains("read-only"), "{what}: {m}"),
        other => panic!("{what}: expected Error::Config, got {other:?}"),
    };
    let check_writes = |label: &'static str| {
        let (reader, t, lease, o) = (reader.clone(), t.clone(), lease.clone(), o.clone());
        async move {
            let fresh = EffectKey::new(&t, "capture", format!("fresh-{label}")).unwrap();
            refused(
                label,
                reader.claim(&fresh, &ClaimOptions::default()).await.map(drop),
            );
            refused(label, reader.complete(&lease, &o).await);
            refused(label, reader.release(&lease).await);
            refused(
                label,
                reader.renew(&lease, Duration::from_secs(5)).await.map(drop),
            );
            refused(label, reader.prune(10).await.map(drop));
            fresh
        }
    };
    let fresh = check_writes("up").await;
    assert!(
        writer.get(&fresh).await.unwrap().is_none(),
        "a refused claim wrote nothing"
    );
    let rec = writer.get(&held).await.unwrap().unwrap();
    assert_eq!((rec.state, rec.fence), (RecordState::InProgress, lease.fence()));

    server.kill();
    let e = reader.get(&done).await.unwrap_err();
    assert!(
        matches!(e, Error::Unavailable { .. }),
        "reads go to the server: {e:?}"
    );
    check_writes("down").await;
}

// ---- Waiting without polling (change notifications) ----

/// The `w` field of `key`'s record: the waiter mark a claim that would wait
/// left on it.
async fn waiter_mark(url: &str, ledger: &RedisLedger, key: &EffectKey) -> Option<String> {
    let mut conn = raw(url).await;
    conn.hget(ledger.redis_key(key), "w").await.unwrap()
}

/// Waits (generously, without asserting on time) until `what` holds.
async fn eventually<F: std::future::Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    for _ in 0..600 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not after 30 s");
}

/// `Effects::run` on `ledger` with the `Wait` policy, as a task: the
/// duplicate of a delivery in progress elsewhere.
fn waiting_run(ledger: RedisLedger, k: &EffectKey) -> tokio::task::JoinHandle<oncely::Result<String>> {
    let k = k.clone();
    tokio::spawn(async move {
        let wait = oncely::OnInProgress::Wait {
            max: Duration::from_secs(30),
        };
        Effects::new(ledger)
            .run(&k, &ClaimOptions::default().on_in_progress(wait), |_| async {
                Ok("waiter ran".to_owned())
            })
            .await
    })
}

/// Two ledgers on separate connections, as two processes have: `b`'s
/// duplicate waits for `a`'s lease, marks the record, and is woken through
/// `b`'s subscription when `a` completes (it gets `a`'s outcome) or releases
/// (it runs). `url`: a node to look at the record through.
async fn woken_across_ledgers(a: RedisLedger, b: RedisLedger, url: &str) {
    assert!(a.is_subscribed() && b.is_subscribed());
    let t = fresh_tenant();
    for release in [false, true] {
        let k = EffectKey::new(&t, "capture", format!("woken-{release}")).unwrap();
        assert!(b.watch(&k).await.is_notified(), "b's watches are notified ones");
        let holder = acquired(
            a.claim(&k, &ClaimOptions::default().lease(Duration::from_secs(60)))
                .await
                .unwrap(),
        );
        let relayed = b.notifications_relayed();
        let waiter = waiting_run(b.clone(), &k);
        eventually("b's waiter marks the record", || async {
            waiter_mark(url, &a, &k).await.is_some()
        })
        .await;
        assert!(!waiter.is_finished(), "the waiter waits");
        if release {
            a.release(&holder).await.unwrap();
        } else {
            a.complete(&holder, &Outcome::value(&"holder ran").unwrap())
                .await
                .unwrap();
        }
        let want = if release { "waiter ran" } else { "holder ran" };
        assert_eq!(waiter.await.unwrap().unwrap(), want);
        eventually("b's subscription relays a's write", || async {
            b.notifications_relayed() > relayed
        })
        .await;
    }
}

/// Across ledgers on one server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_another_ledgers_write() {
    let t = fresh_tenant();
    let Some(a) = single_with(own_prefix(&t)).await else {
        return;
    };
    let b = single_with(own_prefix(&t)).await.unwrap();
    woken_across_ledgers(a, b, &single_url()).await;
}

/// Across ledgers on a cluster: the scripts `PUBLISH` on the record's
/// master, and Redis forwards the message to every node, so one
/// subscription on any node hears every master's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_a_waiter_is_woken_by_another_ledgers_write() {
    let t = fresh_tenant();
    let Some(a) = common::cluster_with(own_prefix(&t)).await else {
        return;
    };
    let b = common::cluster_with(own_prefix(&t)).await.unwrap();
    woken_across_cluster(a, b).await;
}

/// [`woken_across_ledgers`] for a cluster, looking at records through the
/// cluster client.
async fn woken_across_cluster(a: RedisLedger, b: RedisLedger) {
    assert!(a.is_subscribed() && b.is_subscribed());
    let t = fresh_tenant();
    let conn = cluster_conn().await;
    // Keys on each master, so that every master's messages are heard.
    for i in 0..6 {
        let k = EffectKey::new(&t, "capture", format!("woken-{i}")).unwrap();
        assert!(b.watch(&k).await.is_notified(), "b's watches are notified ones");
        let holder = acquired(
            a.claim(&k, &ClaimOptions::default().lease(Duration::from_secs(60)))
                .await
                .unwrap(),
        );
        let relayed = b.notifications_relayed();
        let waiter = waiting_run(b.clone(), &k);
        let rkey = a.redis_key(&k);
        eventually("b's waiter marks the record", || {
            let (mut conn, rkey) = (conn.clone(), rkey.clone());
            async move {
                let w: Option<String> = conn.hget(rkey, "w").await.unwrap();
                w.is_some()
            }
        })
        .await;
        a.complete(&holder, &Outcome::value(&"holder ran").unwrap())
            .await
            .unwrap();
        assert_eq!(waiter.await.unwrap().unwrap(), "holder ran");
        eventually("b's subscription relays a's write", || async {
            b.notifications_relayed() > relayed
        })
        .await;
    }
}

/// Killing the subscription's connection (`CLIENT KILL TYPE pubsub`, on a
/// server of the test's own: it kills every subscriber there) costs waiters
/// latency, never their answer, and the subscription comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_subscription_costs_latency_not_answers() {
    let Some(server) = TempRedis::start(&[]).await else {
        return;
    };
    let url = server.url();
    let a = RedisLedger::connect(&ephemeral(&url)).await.unwrap();
    let b = RedisLedger::connect(&ephemeral(&url)).await.unwrap();
    assert!(b.is_subscribed());
    let mut admin = raw(&url).await;
    let t = fresh_tenant();
    for round in 0..3 {
        eventually("b's subscription is up", || async { b.is_subscribed() }).await;
        let killed: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("pubsub")
            .query_async(&mut admin)
            .await
            .unwrap();
        assert!(killed >= 1, "round {round}: a subscription to kill");
        // Whatever b's subscription is doing now (not noticed yet, down,
        // back), its waiter gets the holder's answer.
        let k = EffectKey::new(&t, "capture", format!("killed-{round}")).unwrap();
        let holder = acquired(a.claim(&k, &ClaimOptions::default()).await.unwrap());
        let waiter = waiting_run(b.clone(), &k);
        eventually("b's waiter marks the record", || async {
            waiter_mark(&url, &a, &k).await.is_some()
        })
        .await;
        a.complete(&holder, &Outcome::value(&"holder ran").unwrap())
            .await
            .unwrap();
        assert_eq!(waiter.await.unwrap().unwrap(), "holder ran");
    }
    // The kill took a's subscription too.
    eventually("both subscriptions are back", || async {
        a.is_subscribed() && b.is_subscribed()
    })
    .await;
    woken_across_ledgers(a, b, &url).await;
}

/// A user the server's ACL does not let use any channel: the subscription
/// never comes up, so waiters poll (and still get their answer), and the
/// scripts' `PUBLISH` fails without failing the write it follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_channel_permissions_waiters_poll_and_writes_succeed() {
    let Some(server) = TempRedis::start(&[]).await else {
        return;
    };
    let mut admin = raw(&server.url()).await;
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "nochan", "on", ">pw", "~*", "+@all", "resetchannels"])
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("redis://nochan:pw@127.0.0.1:{}?ephemeral=true", server.port);
    let a = RedisLedger::connect(&url).await.unwrap();
    let b = RedisLedger::connect(&url).await.unwrap();
    assert!(!b.is_subscribed(), "SUBSCRIBE is refused");
    let k = EffectKey::new(&fresh_tenant(), "capture", "no-channels").unwrap();
    assert!(!b.watch(&k).await.is_notified(), "so b's watches poll");
    let holder = acquired(a.claim(&k, &ClaimOptions::default()).await.unwrap());
    let waiter = waiting_run(b.clone(), &k);
    eventually("b's waiter marks the record", || async {
        waiter_mark(&server.url(), &a, &k).await.is_some()
    })
    .await;
    // The script's PUBLISH is refused (NOPERM); the completion stands.
    a.complete(&holder, &Outcome::value(&"holder ran").unwrap())
        .await
        .unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), "holder ran");
    let r = a.get(&k).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Completed);
}

/// How many times the server ran `command` (scripts' calls included).
async fn calls(conn: &mut redis::aio::MultiplexedConnection, command: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// A completion publishes only when a claim that would wait found the
/// record in progress, and only for waiters of another ledger (a ledger
/// wakes its own in process): a completion nobody waits for costs no
/// message. On a server of the test's own, so the count is the test's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_completions_that_someone_waits_for_publish() {
    let Some(server) = TempRedis::start(&[]).await else {
        return;
    };
    let url = server.url();
    let a = RedisLedger::connect(&ephemeral(&url)).await.unwrap();
    let b = RedisLedger::connect(&ephemeral(&url)).await.unwrap();
    let mut admin = raw(&url).await;
    let t = fresh_tenant();
    let done = |s: &str| Outcome::value(&s).unwrap();

    // Nobody waits.
    let k = EffectKey::new(&t, "capture", "alone").unwrap();
    let l = acquired(a.claim(&k, &ClaimOptions::default()).await.unwrap());
    a.complete(&l, &done("a")).await.unwrap();
    // A duplicate that does not wait leaves no mark.
    let k = EffectKey::new(&t, "capture", "rejected").unwrap();
    let l = acquired(a.claim(&k, &ClaimOptions::default()).await.unwrap());
    let reject = ClaimOptions::default().on_in_progress(oncely::OnInProgress::Reject);
    assert!(matches!(
        b.claim(&k, &reject).await.unwrap(),
        Claim::InProgress { .. }
    ));
    assert_eq!(waiter_mark(&url, &a, &k).await, None);
    a.complete(&l, &done("a")).await.unwrap();
    // Only a's own waiter: a wakes it in process.
    let k = EffectKey::new(&t, "capture", "own-waiter").unwrap();
    let l = acquired(a.claim(&k, &ClaimOptions::default()).await.unwrap());
    let waiter = waiting_run(a.clone(), &k);
    eventually("a's waiter marks the record", || async {
        waiter_mark(&url, &a, &k).await.is_some()
    })
    .await;
    a.complete(&l, &done("holder ran")).await.unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), "holder ran");
    assert_eq!(calls(&mut admin, "publish").await, 0, "no message so far");

    // b's waiter: one message.
    let k = EffectKey::new(&t, "capture", "b-waits").unwrap();
    let l = acquired(a.claim(&k, &ClaimOptions::default()).await.unwrap());
    let waiter = waiting_run(b.clone(), &k);
    eventually("b's waiter marks the record", || async {
        waiter_mark(&url, &a, &k).await.is_some()
    })
    .await;
    a.complete(&l, &done("holder ran")).await.unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), "holder ran");
    assert_eq!(calls(&mut admin, "publish").await, 1);
}

/// A claim flagged as a redelivery (`ClaimOptions::redelivered`) that finds
/// the effect completed is answered by a plain read (`TIME` and `HMGET`),
/// with no script: a fraction of the claim script's server time. What the
/// script would answer otherwise (a live lease, which it marks for its
/// waiter; an absent key; a key of another type) still goes to the script,
/// and a fingerprint mismatch is refused as by the script. A duplicate in
/// another process woken by the holder's completion claims again flagged,
/// so it too reads plainly. On a server of the test's own, so the counts
/// are the test's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_duplicate_of_a_completed_effect_runs_no_script() {
    let Some(server) = TempRedis::start(&[]).await else {
        return;
    };
    let url = server.url();
    let a = RedisLedger::connect(&ephemeral(&url)).await.unwrap();
    let b = RedisLedger::connect(&ephemeral(&url)).await.unwrap();
    let mut admin = raw(&url).await;
    let t = fresh_tenant();
    let redelivered = ClaimOptions::default().redelivered(true);
    let fp = |s: &str| oncely::backend::Fingerprint::of_bytes(s.as_bytes());

    let done = EffectKey::new(&t, "capture", "done").unwrap();
    let l = acquired(
        a.claim(&done, &ClaimOptions::default().fingerprint(fp("100")))
            .await
            .unwrap(),
    );
    a.complete(&l, &Outcome::value(&"ch_1").unwrap()).await.unwrap();
    let (scripts, reads) = (
        calls(&mut admin, "evalsha").await,
        calls(&mut admin, "hmget").await,
    );
    for _ in 0..3 {
        match b
            .claim(&done, &redelivered.clone().fingerprint(fp("100")))
            .await
            .unwrap()
        {
            Claim::Completed(r) => assert_eq!(
                r.outcome.unwrap().as_bytes(),
                Outcome::value(&"ch_1").unwrap().as_bytes()
            ),
            other => panic!("{other:?}"),
        }
    }
    let e = b
        .claim(&done, &redelivered.clone().fingerprint(fp("200")))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::FingerprintMismatch { .. }), "{e:?}");
    assert_eq!(
        calls(&mut admin, "evalsha").await,
        scripts,
        "a redelivered duplicate of a completed effect ran a script"
    );
    assert_eq!(calls(&mut admin, "hmget").await, reads + 4);

    // Not flagged: the claim script, as always.
    assert!(matches!(
        b.claim(&done, &ClaimOptions::default()).await.unwrap(),
        Claim::Completed(_)
    ));
    assert_eq!(calls(&mut admin, "evalsha").await, scripts + 1);
    // Flagged, but nothing to answer from a read: the script decides.
    let fresh = EffectKey::new(&t, "capture", "fresh").unwrap();
    let l = acquired(b.claim(&fresh, &redelivered).await.unwrap());
    let reject = redelivered.clone().on_in_progress(oncely::OnInProgress::Reject);
    assert!(matches!(
        a.claim(&fresh, &reject).await.unwrap(),
        Claim::InProgress { .. }
    ));
    assert_eq!(calls(&mut admin, "evalsha").await, scripts + 3);
    b.release(&l).await.unwrap();
    let foreign = EffectKey::new(&t, "capture", "foreign").unwrap();
    let _: () = admin.set(a.redis_key(&foreign), "not a record").await.unwrap();
    assert!(is_corrupt(&a.claim(&foreign, &redelivered).await.unwrap_err()));

    // A duplicate in another process, woken by the completion.
    let k = EffectKey::new(&t, "capture", "woken").unwrap();
    let l = acquired(a.claim(&k, &ClaimOptions::default()).await.unwrap());
    let waiter = waiting_run(b.clone(), &k);
    eventually("b's waiter marks the record", || async {
        waiter_mark(&url, &a, &k).await.is_some()
    })
    .await;
    // Its watch follows the marking claim's answer at once; leave it time.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let scripts = calls(&mut admin, "evalsha").await;
    a.complete(&l, &Outcome::value(&"holder ran").unwrap())
        .await
        .unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), "holder ran");
    assert_eq!(
        calls(&mut admin, "evalsha").await,
        scripts + 1,
        "the completion's script only: the woken duplicate read the record"
    );
}

// ---- Batches ----

/// A batch is one script call on one server, whatever its size, and so is
/// a batch of completions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_one_script_call_on_one_server() {
    let Some(server) = TempRedis::start(&[]).await else {
        return;
    };
    let ledger = RedisLedger::connect(&server.ledger_url()).await.unwrap();
    let mut admin = raw(&server.url()).await;
    let t = fresh_tenant();
    let keys: Vec<EffectKey> = (0..100)
        .map(|i| EffectKey::new(&t, "capture", format!("batch-{i}")).unwrap())
        .collect();
    // Loads the scripts, so that what is counted next is the calls only.
    let warm = acquired(
        ledger
            .claim(
                &EffectKey::new(&t, "capture", "warm").unwrap(),
                &ClaimOptions::default(),
            )
            .await
            .unwrap(),
    );
    ledger.release(&warm).await.unwrap();
    let before = calls(&mut admin, "evalsha").await;
    let answers = ledger.claim_many(&keys, &ClaimOptions::default()).await.unwrap();
    assert_eq!(calls(&mut admin, "evalsha").await, before + 1);
    let items: Vec<(oncely::backend::Lease, Outcome)> = answers
        .into_iter()
        .map(|a| (acquired(a.unwrap()), Outcome::value(&1).unwrap()))
        .collect();
    let done = ledger.complete_many(&items).await;
    assert!(done.iter().all(Result::is_ok), "{done:?}");
    assert_eq!(calls(&mut admin, "evalsha").await, before + 2);
    for k in &keys {
        assert_eq!(
            ledger.get(k).await.unwrap().unwrap().state,
            RecordState::Completed
        );
    }
}

/// The horizon holds for a batch as for a single claim: an absent key with
/// a `sent_at` at or before the watermark is refused and nothing of it is
/// left (on a cluster, where the check follows the insert, the insert is
/// taken back), a record that exists answers as it is, and a later message
/// acquires.
async fn batch_checks_the_horizon(ledger: RedisLedger, t: &oncely::Tenant) {
    let k = |s: &str| EffectKey::new(t, "capture", s).unwrap();
    let done = acquired(ledger.claim(&k("done"), &ClaimOptions::default()).await.unwrap());
    ledger
        .complete(&done, &Outcome::value(&"done").unwrap())
        .await
        .unwrap();
    let w = SystemTime::now();
    let set_watermark = |ledger: RedisLedger| async move {
        let hkey = ledger.horizon_key(t, "capture");
        let us = to_micros(w).unwrap();
        if ledger.is_cluster() {
            let mut conn = cluster_conn().await;
            let _: () = conn.set(hkey, us).await.unwrap();
        } else {
            let mut conn = raw(&single_url()).await;
            let _: () = conn.set(hkey, us).await.unwrap();
        }
    };
    set_watermark(ledger.clone()).await;
    let old = ClaimOptions::default().sent_at(w - Duration::from_secs(1));
    let answers = ledger
        .claim_many(&[k("absent-1"), k("done"), k("absent-2")], &old)
        .await
        .unwrap();
    assert!(
        matches!(answers[0], Err(Error::BeyondHorizon { .. })),
        "{answers:?}"
    );
    assert!(matches!(answers[1], Ok(Claim::Completed(_))), "{answers:?}");
    assert!(
        matches!(answers[2], Err(Error::BeyondHorizon { .. })),
        "{answers:?}"
    );
    for s in ["absent-1", "absent-2"] {
        assert!(ledger.get(&k(s)).await.unwrap().is_none(), "{s} left behind");
    }
    let new = ClaimOptions::default().sent_at(w + Duration::from_secs(1));
    let answers = ledger
        .claim_many(&[k("absent-1"), k("absent-2")], &new)
        .await
        .unwrap();
    assert!(
        answers.iter().all(|a| matches!(a, Ok(Claim::Acquired(_)))),
        "{answers:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_checks_the_horizon_on_one_server() {
    let t = fresh_tenant();
    let Some(ledger) = single_with(own_prefix(&t)).await else {
        return;
    };
    batch_checks_the_horizon(ledger, &t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_batch_checks_the_horizon_after_its_inserts() {
    let t = fresh_tenant();
    let Some(ledger) = common::cluster_with(own_prefix(&t)).await else {
        return;
    };
    batch_checks_the_horizon(ledger, &t).await;
}

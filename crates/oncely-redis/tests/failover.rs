//! Failovers of the Sentinel fixture (scripts/redis-sentinel.sh: a primary
//! on 6390, its replica on 6391, three Sentinels with quorum 2 that declare
//! a primary down after 1 s) while workers run `Effects::run` over many
//! keys through a `redis+sentinel://` ledger.
//!
//! On loopback a replica keeps up, so the loss that asynchronous
//! replication allows is made visible on purpose: the replica replicates
//! through a relay of the test's own, which stops passing the replication
//! stream on ("the link paused") before the primary fails. What the
//! primary acknowledged from then on never reaches the replica that
//! Sentinel promotes.
//!
//! Each run counts, and prints:
//! - acknowledged completions: a delivery whose handler ran and whose
//!   completion the ledger acknowledged (`Effects::run` answered `Ran`);
//! - lost ones: acknowledged, yet not completed at that fence on the new
//!   primary, and what their next delivery did (it runs the handler again,
//!   at a higher fence);
//! - double holders: two handler runs of one key at the same time (a
//!   delivery parked in its handler across the failover, and a duplicate
//!   delivered after it), and whether the parked one's completion was then
//!   refused by its fence;
//! - deliveries that did not return within their bound (stuck): none may.
//!
//! The primary is killed (SIGKILL) or frozen (SIGSTOP); each way with and
//! without `wait_replicas(1, …)`. Without it acknowledged completions are
//! lost (the tests require some: otherwise the runs with it would prove
//! nothing); with it none is, and the parked holders never got a grant.
//! After the failover the old primary comes back, as a replica of the new
//! one (a ledger that waits for a replica needs one). The runs take the
//! fixture one at a time and leave it failed over; the next one starts it
//! afresh.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{
    PRIMARY, REPLICA, SENTINELS, fixture_pid, raw, sentinel_rejoin, sentinel_up, sentinel_url, signal,
};
use oncely::backend::{Ledger, Outcome, RecordState};
use oncely::conformance::fresh_tenant;
use oncely::{ClaimOptions, EffectKey, Effects, Error, How, OnInProgress};
use oncely_redis::{RedisLedger, RedisLedgerOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// How long any one delivery may take before it counts as stuck: far
/// above what it needs (a response timeout, a discovery, a wait for a
/// holder), so only a delivery that hangs reaches it.
const BOUND: Duration = Duration::from_secs(45);

/// The fixture is one: runs take it in turn.
static FIXTURE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// SIGKILL: the primary is gone.
    Kill,
    /// SIGSTOP: the primary accepts connections and answers nothing.
    Freeze,
}

/// A relay between the replica and the primary: the replica's ACKs always
/// pass, the replication stream stops passing once paused (held, never
/// delivered), and cutting it closes every connection and the listener.
struct Link {
    port: u16,
    paused: Arc<AtomicBool>,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Link {
    async fn start(upstream: u16) -> Link {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let paused = Arc::new(AtomicBool::new(false));
        let tasks: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = tokio::spawn({
            let (paused, tasks) = (paused.clone(), tasks.clone());
            async move {
                while let Ok((down, _)) = listener.accept().await {
                    let Ok(up) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                        continue;
                    };
                    let (mut down_r, mut down_w) = down.into_split();
                    let (mut up_r, mut up_w) = up.into_split();
                    let acks = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut down_r, &mut up_w).await;
                    });
                    let paused = paused.clone();
                    let stream = tokio::spawn(async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match up_r.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            if paused.load(Ordering::SeqCst) {
                                // Held: what the primary sends from now on
                                // never reaches the replica.
                                std::future::pending::<()>().await;
                            }
                            if down_w.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    });
                    tasks.lock().unwrap().extend([acks, stream]);
                }
            }
        });
        tasks.lock().unwrap().push(accept);
        Link { port, paused, tasks }
    }

    fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
    }

    fn cut(&self) {
        for t in self.tasks.lock().unwrap().drain(..) {
            t.abort();
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.cut();
    }
}

/// Points the replica at `port` (the link) and waits until it replicates
/// through it.
async fn replicate_through(port: u16) {
    let url = format!("redis://127.0.0.1:{REPLICA}");
    let mut conn = raw(&url).await;
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(port)
        .query_async(&mut conn)
        .await
        .unwrap();
    for _ in 0..200 {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut conn)
            .await
            .unwrap();
        let has = |l: &str| info.lines().any(|x| x.trim() == l);
        if has(&format!("master_port:{port}")) && has("master_link_status:up") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the replica never replicated through the link");
}

/// Waits until every Sentinel names the replica as the primary.
async fn promoted() {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let mut named = 0;
        for port in SENTINELS {
            let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}")) else {
                continue;
            };
            let Ok(Ok(mut c)) =
                tokio::time::timeout(Duration::from_secs(1), client.get_multiplexed_async_connection()).await
            else {
                continue;
            };
            let addr: redis::RedisResult<Vec<String>> = redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(common::MASTER)
                .query_async(&mut c)
                .await;
            if addr.is_ok_and(|a| a.get(1).map(String::as_str) == Some(&REPLICA.to_string())) {
                named += 1;
            }
        }
        if named == SENTINELS.len() {
            return;
        }
        assert!(Instant::now() < deadline, "Sentinel never promoted the replica");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One handler run: its key, its fence, when it began and ended.
struct Span {
    key: String,
    fence: u64,
    began: Instant,
    ended: Option<Instant>,
}

/// What the handlers did, across every delivery of a run.
#[derive(Default)]
struct Tally {
    spans: Mutex<Vec<Span>>,
}

impl Tally {
    fn begin(&self, key: &EffectKey, fence: u64) -> usize {
        let mut spans = self.spans.lock().unwrap();
        spans.push(Span {
            key: key.to_string(),
            fence,
            began: Instant::now(),
            ended: None,
        });
        spans.len() - 1
    }

    fn end(&self, i: usize) {
        self.spans.lock().unwrap()[i].ended = Some(Instant::now());
    }

    fn started(&self, key: &EffectKey) -> bool {
        let key = key.to_string();
        self.spans.lock().unwrap().iter().any(|s| s.key == key)
    }

    /// Keys two of whose handler runs overlapped in time, with their fences.
    fn double_holders(&self) -> Vec<(String, u64, u64)> {
        let spans = self.spans.lock().unwrap();
        let mut by_key: HashMap<&str, Vec<&Span>> = HashMap::new();
        for s in spans.iter() {
            by_key.entry(&s.key).or_default().push(s);
        }
        let mut doubles = Vec::new();
        for (key, runs) in by_key {
            for (i, a) in runs.iter().enumerate() {
                for b in &runs[i + 1..] {
                    let a_end = a.ended.unwrap_or_else(Instant::now);
                    let b_end = b.ended.unwrap_or_else(Instant::now);
                    if a.began < b_end && b.began < a_end {
                        doubles.push((key.to_owned(), a.fence, b.fence));
                    }
                }
            }
        }
        doubles
    }
}

/// What one delivery answered.
#[derive(Debug)]
struct Delivery {
    /// The fence the outcome was recorded at, and whether this delivery
    /// ran the handler or had the stored outcome replayed.
    answer: Result<(u64, How), Error>,
    /// The fence this delivery's handler ran at, if it ran.
    ran: Option<u64>,
}

impl Delivery {
    /// A completion acknowledged to the holder that ran it: its fence.
    fn acknowledged(&self) -> Option<u64> {
        match &self.answer {
            Ok((fence, How::Ran)) => Some(*fence),
            _ => None,
        }
    }
}

/// One delivery of `key`; its handler (after `gate` opens, if given)
/// returns its fence. Panics if it does not return within [`BOUND`].
async fn deliver(
    effects: &Effects<RedisLedger>,
    tally: &Arc<Tally>,
    key: &EffectKey,
    opts: &ClaimOptions,
    gate: Option<tokio::sync::watch::Receiver<bool>>,
) -> Delivery {
    let ran = Arc::new(Mutex::new(None));
    let (t, r, k) = (tally.clone(), ran.clone(), key.clone());
    let run = effects.run_reported(key, opts, move |lease| async move {
        let fence = lease.fence();
        *r.lock().unwrap() = Some(fence);
        let span = t.begin(&k, fence);
        if let Some(mut gate) = gate {
            let _ = gate.wait_for(|open| *open).await;
        }
        t.end(span);
        Ok(fence)
    });
    let answer = match tokio::time::timeout(BOUND, run).await {
        Ok(answer) => answer.map(|r| (r.value, r.how)),
        Err(_) => panic!("{key}: a delivery did not return within {BOUND:?} (stuck)"),
    };
    let ran = *ran.lock().unwrap();
    Delivery { answer, ran }
}

/// Delivers each key once, `workers` at a time.
async fn deliver_all(
    effects: &Effects<RedisLedger>,
    tally: &Arc<Tally>,
    keys: &[EffectKey],
    opts: &ClaimOptions,
    workers: usize,
) -> Vec<(EffectKey, Delivery)> {
    let queue = Arc::new(Mutex::new(keys.to_vec()));
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (effects, tally, queue, opts) = (effects.clone(), tally.clone(), queue.clone(), opts.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                let Some(k) = queue.lock().unwrap().pop() else {
                    return done;
                };
                let d = deliver(&effects, &tally, &k, &opts, None).await;
                done.push((k, d));
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// Delivers each key until it is answered (a broker redelivering after a
/// retryable error, at most `tries` times).
async fn deliver_until_answered(
    effects: &Effects<RedisLedger>,
    tally: &Arc<Tally>,
    key: &EffectKey,
    opts: &ClaimOptions,
    tries: usize,
) -> Vec<Delivery> {
    let mut all = Vec::new();
    for _ in 0..tries {
        let d = deliver(effects, tally, key, opts, None).await;
        let answered = d.answer.is_ok();
        let retry = d.answer.as_ref().err().is_some_and(|e| e.is_retryable());
        all.push(d);
        if answered || !retry {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    all
}

/// What a run counted.
#[derive(Debug, Default)]
struct Report {
    acknowledged: usize,
    lost: Vec<(String, u64)>,
    /// Lost completions whose next delivery ran the handler again: (old
    /// fence, new fence).
    ran_again: Vec<(u64, u64)>,
    double_holders: Vec<(String, u64, u64)>,
    /// What the deliveries parked across the failover answered.
    parked: Vec<String>,
    /// Deliveries during the paused link that got no grant (with
    /// `wait_replicas`), that ran their handler, that were acknowledged.
    paused_refused: usize,
    paused_ran: usize,
    paused_acknowledged: usize,
    waiter: String,
}

/// Adds the acknowledged completions among `deliveries` to `acknowledged`.
fn record<'a>(
    deliveries: impl Iterator<Item = (&'a EffectKey, &'a Delivery)>,
    acknowledged: &mut Vec<(EffectKey, u64)>,
) {
    for (k, d) in deliveries {
        if let Some(f) = d.acknowledged() {
            acknowledged.push((k.clone(), f));
        }
    }
}

fn ledger_options(wait: bool) -> RedisLedgerOptions {
    let opts = RedisLedgerOptions::default()
        .connect_timeout(Duration::from_secs(1))
        .request_timeout(Duration::from_secs(2));
    if wait {
        opts.wait_replicas(1, Duration::from_millis(100))
    } else {
        opts
    }
}

/// One failover run; see the module docs.
async fn failover(fault: Fault, wait: bool) -> Option<Report> {
    let _turn = FIXTURE.lock().await;
    if !sentinel_up() {
        return None;
    }
    let link = Link::start(PRIMARY).await;
    replicate_through(link.port).await;
    let ledger = RedisLedger::connect_with(&sentinel_url(), ledger_options(wait))
        .await
        .unwrap();
    // Another process's ledger: duplicates, the waiter's holder.
    let other = RedisLedger::connect_with(&sentinel_url(), ledger_options(wait))
        .await
        .unwrap();
    assert_eq!(ledger.primary(), Some((format!("127.0.0.1:{PRIMARY}"), 0)));
    let (effects, duplicates) = (Effects::new(ledger.clone()), Effects::new(other.clone()));
    let tally = Arc::new(Tally::default());
    let t = fresh_tenant();
    let keys = |phase: &str, n: usize| -> Vec<EffectKey> {
        (0..n)
            .map(|i| EffectKey::new(&t, "capture", format!("{phase}-{i}")).unwrap())
            .collect()
    };
    let opts = ClaimOptions::default()
        .lease(Duration::from_secs(3))
        .on_in_progress(OnInProgress::Wait {
            max: Duration::from_secs(2),
        });
    let mut report = Report::default();
    let mut acknowledged: Vec<(EffectKey, u64)> = Vec::new();

    // Replicated: the link passes everything.
    let before = deliver_all(&effects, &tally, &keys("replicated", 16), &opts, 4).await;
    assert!(before.iter().all(|(_, d)| d.answer.is_ok()), "{before:?}");
    record(before.iter().map(|(k, d)| (k, d)), &mut acknowledged);

    // A waiter: a key another process holds for long, and a duplicate
    // waiting for it when the primary fails.
    let held = EffectKey::new(&t, "capture", "held-elsewhere").unwrap();
    let holder = other
        .claim(&held, &ClaimOptions::default().lease(Duration::from_secs(60)))
        .await
        .unwrap();
    assert!(
        matches!(holder, oncely::backend::Claim::Acquired(_)),
        "{holder:?}"
    );

    // The link paused: acknowledged writes from now on reach no replica.
    link.pause();
    let (open, gate) = tokio::sync::watch::channel(false);
    let long = keys("parked", 3);
    let parked: Vec<JoinHandle<Delivery>> = long
        .iter()
        .map(|k| {
            let (effects, tally, k, opts, gate) = (
                effects.clone(),
                tally.clone(),
                k.clone(),
                opts.clone(),
                gate.clone(),
            );
            tokio::spawn(async move { deliver(&effects, &tally, &k, &opts, Some(gate)).await })
        })
        .collect();
    let during = deliver_all(&effects, &tally, &keys("paused", 12), &opts, 4).await;
    record(during.iter().map(|(k, d)| (k, d)), &mut acknowledged);
    report.paused_acknowledged = during.iter().filter(|(_, d)| d.acknowledged().is_some()).count();
    report.paused_ran = during.iter().filter(|(_, d)| d.ran.is_some()).count();
    if wait {
        // Not granted, or (the connection queued behind the WAITs) timed
        // out: either way retryable, and no handler ran.
        for (k, d) in &during {
            assert!(
                d.answer.as_ref().is_err_and(|e| e.is_retryable()),
                "{k}: {:?}",
                d.answer
            );
        }
    }
    report.paused_refused = during
        .iter()
        .filter(|(_, d)| matches!(&d.answer, Err(Error::Unavailable { message, .. }) if message.contains("not granted")))
        .count();
    // Every parked delivery is in its handler, or was refused a grant.
    for (k, p) in long.iter().zip(&parked) {
        let deadline = Instant::now() + BOUND;
        while !tally.started(k) && !p.is_finished() {
            assert!(Instant::now() < deadline, "{k}: neither ran nor answered");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // Waits longer than the failover takes, so it is waiting through it.
    let waiter = {
        let (effects, tally, held) = (effects.clone(), tally.clone(), held.clone());
        let opts = opts.clone().on_in_progress(OnInProgress::Wait {
            max: Duration::from_secs(8),
        });
        tokio::spawn(async move { deliver(&effects, &tally, &held, &opts, None).await })
    };

    // The fault, and the replica cut off from the old primary for good.
    let pid = fixture_pid(PRIMARY);
    signal(pid, if fault == Fault::Kill { "KILL" } else { "STOP" });
    link.cut();
    promoted().await;

    // The waiter returned (within its bound, or deliver panicked).
    report.waiter = format!("{:?}", waiter.await.unwrap().answer.map(|(_, how)| how));
    // The old primary comes back as a replica of the new one: without a
    // replica, a ledger that waits for one grants nothing (the crate docs
    // say to run two replicas for that reason).
    sentinel_rejoin(PRIMARY).await;

    // Duplicates of the parked keys, from another process, after the
    // failover; then the parked handlers finish.
    let mut dups = Vec::new();
    for k in &long {
        dups.push((
            k.clone(),
            deliver_until_answered(&duplicates, &tally, k, &opts, 30).await,
        ));
    }
    open.send(true).unwrap();
    for (k, p) in long.iter().zip(parked) {
        let d = p.await.unwrap();
        report.parked.push(match (&d.answer, d.ran) {
            (Ok((f, how)), _) => format!("{k}: {how:?} at fence {f}"),
            (Err(e), None) => format!("{k}: did not run ({e})"),
            (Err(e), Some(f)) if e.is_lease_lost() => {
                format!("{k}: ran at fence {f}, completion refused (LeaseLost)")
            }
            (Err(e), Some(f)) if e.is_outcome_unknown() => format!("{k}: ran at fence {f}, outcome unknown"),
            (Err(e), Some(f)) => format!("{k}: ran at fence {f}, then {e}"),
        });
        if let Some(f) = d.acknowledged() {
            acknowledged.push((k.clone(), f));
        }
    }
    for (k, ds) in &dups {
        record(ds.iter().map(|d| (k, d)), &mut acknowledged);
    }

    // The ledger follows the new primary: fresh keys are answered.
    let after = keys("after", 12);
    for k in &after {
        let ds = deliver_until_answered(&effects, &tally, k, &opts, 60).await;
        let last = ds.last().unwrap();
        assert!(
            matches!(last.answer, Ok((_, How::Ran))),
            "{k}: not answered after the failover: {ds:?}"
        );
        record(ds.iter().map(|d| (k, d)), &mut acknowledged);
    }
    let (primary, moves) = ledger.primary().unwrap();
    assert_eq!(primary, format!("127.0.0.1:{REPLICA}"));
    assert!(moves >= 1);

    // Lost: acknowledged, and not completed at that fence on the new
    // primary. Read before anything is delivered again.
    for (k, fence) in &acknowledged {
        let r = ledger.get(k).await.unwrap();
        if r.as_ref().map(|r| (r.state, r.fence)) != Some((RecordState::Completed, *fence)) {
            report.lost.push((k.to_string(), *fence));
        }
    }
    report.acknowledged = acknowledged.len();
    // What the next delivery of each acknowledged key does: a kept one is
    // replayed; a lost one runs again, at a higher fence.
    for (k, fence) in &acknowledged {
        let ds = deliver_until_answered(&effects, &tally, k, &opts, 30).await;
        let last = ds.last().unwrap();
        let lost = report.lost.iter().any(|(l, _)| *l == k.to_string());
        match (&last.answer, lost) {
            (Ok((f, How::Replayed)), false) => assert_eq!(f, fence, "{k}"),
            (Ok((f, How::Ran)), true) => {
                assert!(f > fence, "{k}: ran again at fence {f}, not above {fence}");
                report.ran_again.push((*fence, *f));
            }
            other => panic!("{k} (lost: {lost}): the next delivery answered {other:?}"),
        }
    }
    report.double_holders = tally.double_holders();

    // The subscriber follows too: a waiter here is woken by the other
    // process's completion through the new primary. With `wait_replicas`
    // each write also waits (100 ms) for the replica that just rejoined; on
    // a loaded machine that can fall short, a retryable error on which
    // nothing ran. Such a round says nothing about the subscription and is
    // tried again; a waiter that ran the handler is never accepted.
    let mut woken = false;
    let mut short = Vec::new();
    for round in 0..20 {
        if !ledger.is_subscribed() {
            tokio::time::sleep(Duration::from_millis(250)).await;
            continue;
        }
        let k = EffectKey::new(&t, "capture", format!("wake-{round}")).unwrap();
        let lease = match other.claim(&k, &ClaimOptions::default()).await {
            Ok(oncely::backend::Claim::Acquired(l)) => l,
            Err(e) if wait && e.is_retryable() => {
                short.push(e.to_string());
                continue;
            }
            other => panic!("{other:?}"),
        };
        let relayed = ledger.notifications_relayed();
        let w = {
            let (effects, tally, k, opts) = (effects.clone(), tally.clone(), k.clone(), opts.clone());
            tokio::spawn(async move { deliver(&effects, &tally, &k, &opts, None).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let completed = other
            .complete(&lease, &Outcome::value(&lease.fence()).unwrap())
            .await;
        let d = w.await.unwrap();
        assert_eq!(d.ran, None, "{k}: the waiter ran the handler: {d:?}");
        match (completed, &d.answer) {
            (Ok(()), Ok((_, How::Replayed))) => {}
            (Err(e), _) if wait && e.is_retryable() => {
                short.push(e.to_string());
                continue;
            }
            (Ok(()), Err(e)) if wait && e.is_retryable() => {
                short.push(e.to_string());
                continue;
            }
            (completed, _) => panic!("{k}: completed {completed:?}, the waiter answered {d:?}"),
        }
        if ledger.notifications_relayed() > relayed {
            woken = true;
            break;
        }
    }
    for s in &short {
        println!("  a wake round fell short of the replica: {s}");
    }
    assert!(woken, "the subscription never followed the new primary");

    let refused = report.parked.iter().filter(|p| p.contains("refused")).count();
    println!(
        "redis sentinel, primary {}, wait_replicas {}: {} acknowledged completions, {} lost ({} ran again at a \
         higher fence on their next delivery); while the link was paused {} acknowledged, {} not granted; {} \
         double holders ({} parked completions refused by their fence); waiter: {}",
        if fault == Fault::Kill { "killed" } else { "frozen" },
        if wait { "(1, 100ms)" } else { "off" },
        report.acknowledged,
        report.lost.len(),
        report.ran_again.len(),
        report.paused_acknowledged,
        report.paused_refused,
        report.double_holders.len(),
        refused,
        report.waiter,
    );
    for p in &report.parked {
        println!("  parked across the failover: {p}");
    }
    Some(report)
}

/// Without `wait_replicas`: the primary acknowledged what the replica never
/// got, so the failover loses acknowledged completions, and their next
/// delivery runs the handler again (at a higher fence). A delivery parked
/// in its handler across the failover has a duplicate run at the same time;
/// its own completion is then refused.
async fn without_wait(fault: Fault) {
    let Some(r) = failover(fault, false).await else {
        return;
    };
    assert!(r.paused_acknowledged > 0);
    assert!(!r.lost.is_empty(), "the paused link makes the loss visible");
    assert_eq!(r.ran_again.len(), r.lost.len());
    assert!(
        !r.double_holders.is_empty(),
        "the parked deliveries' claims were lost too"
    );
    assert!(
        r.parked.iter().all(|p| !p.contains("Ran at fence")),
        "a parked holder's completion counted: {:?}",
        r.parked
    );
}

/// With `wait_replicas(1, …)`: nothing the replica did not acknowledge was
/// acknowledged, so the failover loses no acknowledged completion; the
/// deliveries during the paused link, the parked ones included, got no
/// grant and ran nothing.
async fn with_wait(fault: Fault) {
    let Some(r) = failover(fault, true).await else {
        return;
    };
    assert_eq!(r.lost, Vec::new(), "acknowledged completions lost");
    assert_eq!(r.paused_acknowledged, 0);
    assert_eq!(r.paused_ran, 0, "no handler ran without a grant");
    assert!(
        r.paused_refused > 0,
        "claims during the paused link were not granted"
    );
    assert_eq!(r.double_holders, Vec::new());
    assert!(
        r.parked.iter().all(|p| p.contains("did not run")),
        "{:?}",
        r.parked
    );
    assert!(r.acknowledged >= 16 + 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_primary_without_wait_loses_acknowledged_completions() {
    without_wait(Fault::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_primary_with_wait_replicas_loses_none() {
    with_wait(Fault::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn frozen_primary_without_wait_loses_acknowledged_completions() {
    without_wait(Fault::Freeze).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn frozen_primary_with_wait_replicas_loses_none() {
    with_wait(Fault::Freeze).await;
}

//! The ledger against the same work hand-written on the same server, in one
//! run:
//!
//! - `nats/claim_complete_*`: claim of a fresh key + complete, against
//!   `kv.create` of the key then a revision-checked `kv.update` of the same
//!   value size (1 and 8 tasks).
//! - `nats/storm_*`: the duplicate storm. Each job is delivered twice at the
//!   same instant, both deliveries through [`Effects::run`] with the `Wait`
//!   policy (the duplicate waits for the first and returns its outcome), or
//!   `Reject` (the duplicate fails with `InProgress` if the first still
//!   runs), against the hand-written minimum: `kv.create`, and on the
//!   duplicate's `AlreadyExists` a `kv.get` (no waiting). 1 and 8 workers.
//!   Throughput is in deliveries. Every run checks that each job's effect ran
//!   exactly once.
//! - `nats/batch_100`: 100 fresh keys claimed with one `claim_many` and
//!   completed with one `complete_many`, against 100 `kv.create`s then 100
//!   `kv.update`s, each hundred sent concurrently by hand. Throughput is in
//!   keys; compare with `claim_complete_1_task`.
//!
//! At the end the bench prints, per case, the messages the connection sent
//! per delivery or key (JetStream requests, publishes and notifications; the
//! ledger and the baseline share one connection, so the counts compare):
//! unlike the times, this does not depend on how busy the machine is.
//!
//! `cargo bench -p oncely-nats --bench claim` (server: ONCELY_NATS_URL or
//! nats://127.0.0.1:4222).
#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::kv;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use oncely::backend::{Claim, Ledger, Outcome};
use oncely::{ClaimOptions, EffectKey, Effects, Error, OnInProgress, Tenant};
use oncely_nats::{NatsKvLedger, NatsKvLedgerOptions};

const BUCKET: &str = "oncely_bench";
const BATCH: usize = 100;
static SEQ: AtomicU64 = AtomicU64::new(0);

fn url() -> String {
    std::env::var("ONCELY_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

fn next() -> u64 {
    SEQ.fetch_add(1, Ordering::Relaxed)
}

fn fresh_key(tenant: &Tenant) -> EffectKey {
    EffectKey::new(tenant, "capture", format!("order-{}", next())).unwrap()
}

/// What each case shares.
#[derive(Clone)]
struct Ctx {
    ledger: NatsKvLedger,
    effects: Arc<Effects<NatsKvLedger>>,
    store: kv::Store,
    tenant: Tenant,
    outcome: Outcome,
    claim_val: bytes::Bytes,
    done_val: bytes::Bytes,
    /// Effects executed (handlers run, or hand-written creates won).
    ran: Arc<AtomicU64>,
    /// The connection's counters.
    stats: Arc<async_nats::Statistics>,
    /// Per case: messages sent, and deliveries or keys done.
    sent: Arc<Mutex<BTreeMap<String, (u64, u64)>>>,
}

async fn oncely_once(cx: &Ctx) {
    let k = fresh_key(&cx.tenant);
    match cx.ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => cx.ledger.complete(&l, &cx.outcome).await.unwrap(),
        other => panic!("{other:?}"),
    }
}

/// The same round trips by hand: insert-if-absent, then a conditional
/// update, with values the size of the ledger's records.
async fn baseline_once(cx: &Ctx) {
    let key = format!("baseline.{}", next());
    let rev = cx.store.create(&key, cx.claim_val.clone()).await.unwrap();
    cx.store.update(&key, cx.done_val.clone(), rev).await.unwrap();
}

/// One job, both deliveries at once, through the runner.
async fn oncely_storm(cx: &Ctx, policy: OnInProgress) {
    let k = fresh_key(&cx.tenant);
    let opts = ClaimOptions::default().on_in_progress(policy);
    let deliver = || async {
        cx.effects
            .run(&k, &opts, |_| async {
                cx.ran.fetch_add(1, Ordering::Relaxed);
                Ok(1250u32)
            })
            .await
    };
    let (a, b) = tokio::join!(deliver(), deliver());
    for answer in [a, b] {
        match answer {
            Ok(v) => assert_eq!(v, 1250),
            // Reject: the duplicate arrived while the first ran.
            Err(Error::InProgress { .. }) if matches!(policy, OnInProgress::Reject) => {}
            Err(e) => panic!("{e:?}"),
        }
    }
}

/// One delivery by hand: create the key; on a duplicate read it (no wait).
async fn baseline_delivery(cx: &Ctx, key: &str) {
    match cx.store.create(key, cx.claim_val.clone()).await {
        Ok(rev) => {
            cx.ran.fetch_add(1, Ordering::Relaxed);
            cx.store.update(key, cx.done_val.clone(), rev).await.unwrap();
        }
        Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
            cx.store.get(key).await.unwrap();
        }
        Err(e) => panic!("{e:?}"),
    }
}

async fn baseline_storm(cx: &Ctx) {
    let key = format!("baseline.{}", next());
    tokio::join!(baseline_delivery(cx, &key), baseline_delivery(cx, &key));
}

async fn oncely_batch(cx: &Ctx) {
    let keys: Vec<EffectKey> = (0..BATCH).map(|_| fresh_key(&cx.tenant)).collect();
    let claims = cx
        .ledger
        .claim_many(&keys, &ClaimOptions::default())
        .await
        .unwrap();
    let items: Vec<_> = claims
        .into_iter()
        .map(|c| match c.unwrap() {
            Claim::Acquired(l) => (l, cx.outcome.clone()),
            other => panic!("{other:?}"),
        })
        .collect();
    for r in cx.ledger.complete_many(&items).await {
        r.unwrap();
    }
}

async fn baseline_batch(cx: &Ctx) {
    let keys: Vec<String> = (0..BATCH).map(|_| format!("baseline.{}", next())).collect();
    let revs =
        futures_util::future::join_all(keys.iter().map(|k| cx.store.create(k, cx.claim_val.clone()))).await;
    futures_util::future::join_all(
        keys.iter()
            .zip(revs)
            .map(|(k, rev)| cx.store.update(k, cx.done_val.clone(), rev.unwrap())),
    )
    .await
    .into_iter()
    .for_each(|r| {
        r.unwrap();
    });
}

/// How one case is run and counted.
#[derive(Clone, Copy)]
struct Case {
    /// Its name in the table of messages sent.
    name: &'static str,
    /// Tasks the calls are spread over.
    tasks: u64,
    /// Effects that must run per call (0: not counted).
    effects: u64,
    /// Deliveries or keys per call.
    units: u64,
}

/// Times `iters` calls of `op` spread over the case's tasks, checks that
/// the case's effects ran per call (none twice, none lost), and counts the
/// messages the connection sent.
async fn timed<F, Fut>(cx: &Ctx, case: Case, iters: u64, op: F) -> Duration
where
    F: Fn(Ctx) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let (tasks, effects_per_call) = (case.tasks, case.effects);
    let before = cx.ran.load(Ordering::SeqCst);
    let sent_before = cx.stats.out_messages.load(Ordering::SeqCst);
    let op = Arc::new(op);
    let shared = cx.clone();
    let elapsed = oncely::conformance::spread(iters, tasks, move || {
        let (op, cx) = (op.clone(), shared.clone());
        async move { op(cx).await }
    })
    .await;
    let sent = cx.stats.out_messages.load(Ordering::SeqCst) - sent_before;
    let ran = cx.ran.load(Ordering::SeqCst) - before;
    assert_eq!(ran, iters * effects_per_call, "effects executed");
    let mut table = cx.sent.lock().unwrap();
    let row = table.entry(case.name.to_owned()).or_default();
    row.0 += sent;
    row.1 += iters * case.units;
    elapsed
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cx = rt.block_on(async {
        // Start from an empty bucket so runs are comparable.
        let client = async_nats::connect(url())
            .await
            .expect("NATS server for the bench");
        let js = async_nats::jetstream::new(client.clone());
        let _ = js.delete_stream(format!("KV_{BUCKET}")).await;
        // Create the bucket as the ledger would, then open it on this
        // bench's own connection, whose counters the table reads.
        drop(
            NatsKvLedger::connect_with(&url(), NatsKvLedgerOptions::default().bucket(BUCKET))
                .await
                .unwrap(),
        );
        let js = async_nats::jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(5))
            .build(client.clone());
        let store = js.get_key_value(BUCKET).await.unwrap();
        let ledger = NatsKvLedger::from_store(client.clone(), store, NatsKvLedgerOptions::default())
            .await
            .unwrap();
        Ctx {
            stats: client.statistics(),
            sent: Arc::default(),
            effects: Arc::new(Effects::new(ledger.clone())),
            store: ledger.store().clone(),
            ledger,
            tenant: Tenant::new(format!("bench-{}", std::process::id())).unwrap(),
            outcome: Outcome::from_json(&serde_json::json!({"charge": "ch_123456", "amount": 1250})).unwrap(),
            // Record-sized values: what the ledger writes for a claim and a
            // completion.
            claim_val: bytes::Bytes::from(vec![b'x'; 230]),
            done_val: bytes::Bytes::from(vec![b'y'; 290]),
            ran: Arc::new(AtomicU64::new(0)),
        }
    });
    let wait = OnInProgress::Wait {
        max: Duration::from_secs(30),
    };

    for tasks in [1u64, 8] {
        let group = format!("claim_complete_{tasks}_task{}", if tasks == 1 { "" } else { "s" });
        let mut g = c.benchmark_group(format!("nats/{group}"));
        g.sample_size(20)
            .measurement_time(Duration::from_secs(5))
            .warm_up_time(Duration::from_secs(1))
            .throughput(Throughput::Elements(1));
        let case = |name| Case {
            name,
            tasks,
            effects: 0,
            units: 1,
        };
        let name = |label: &str| leak(format!("{group}/{label}"));
        run(
            &mut g,
            &rt,
            &cx,
            "oncely",
            case(name("oncely")),
            |cx| async move { oncely_once(&cx).await },
        );
        run(
            &mut g,
            &rt,
            &cx,
            "baseline",
            case(name("baseline")),
            |cx| async move { baseline_once(&cx).await },
        );
        g.finish();
    }

    for workers in [1u64, 8] {
        let group = format!("storm_{workers}_worker{}", if workers == 1 { "" } else { "s" });
        let mut g = c.benchmark_group(format!("nats/{group}"));
        g.sample_size(10)
            .measurement_time(Duration::from_secs(5))
            .warm_up_time(Duration::from_secs(1))
            .throughput(Throughput::Elements(2));
        // One job per call: two deliveries, one effect.
        let case = |name| Case {
            name,
            tasks: workers,
            effects: 1,
            units: 2,
        };
        let name = |label: &str| leak(format!("{group}/{label}"));
        for (label, policy) in [("oncely_wait", wait), ("oncely_reject", OnInProgress::Reject)] {
            run(&mut g, &rt, &cx, label, case(name(label)), move |cx| async move {
                oncely_storm(&cx, policy).await
            });
        }
        run(
            &mut g,
            &rt,
            &cx,
            "baseline",
            case(name("baseline")),
            |cx| async move { baseline_storm(&cx).await },
        );
        g.finish();
    }

    let mut g = c.benchmark_group("nats/batch_100");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .warm_up_time(Duration::from_secs(1))
        .throughput(Throughput::Elements(BATCH as u64));
    let case = |name| Case {
        name,
        tasks: 1,
        effects: 0,
        units: BATCH as u64,
    };
    run(
        &mut g,
        &rt,
        &cx,
        "oncely",
        case("batch_100/oncely"),
        |cx| async move { oncely_batch(&cx).await },
    );
    run(
        &mut g,
        &rt,
        &cx,
        "baseline",
        case("batch_100/baseline"),
        |cx| async move { baseline_batch(&cx).await },
    );
    g.finish();

    println!("\nmessages sent per delivery (storm) or key (others):");
    for (name, (sent, units)) in cx.sent.lock().unwrap().iter() {
        println!("  {name:<40} {:>6.2}", *sent as f64 / (*units).max(1) as f64);
    }
}

/// A case name that lives as long as the bench.
fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

/// One bench function of a group: `op` timed by [`timed`].
fn run<F, Fut>(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    rt: &tokio::runtime::Runtime,
    cx: &Ctx,
    label: &str,
    case: Case,
    op: F,
) where
    F: Fn(Ctx) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    g.bench_function(label, |b| {
        b.to_async(rt).iter_custom(|iters| {
            let (cx, op) = (cx.clone(), op.clone());
            async move { timed(&cx, case, iters, op).await }
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);

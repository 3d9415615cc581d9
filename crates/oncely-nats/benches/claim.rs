//! Claim of a fresh key + complete through the ledger, against the same two
//! round trips hand-written on the same server: `kv.create` of the key, then
//! a revision-checked `kv.update` of the same value size.
//!
//! `cargo bench -p oncely-nats --bench claim` (server: ONCELY_NATS_URL or
//! nats://127.0.0.1:4222).
#![allow(missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use oncely::{Claim, ClaimOptions, EffectKey, Ledger, Outcome, Tenant};
use oncely_nats::{NatsKvLedger, NatsKvOptions};

const BUCKET: &str = "oncely_bench";
static SEQ: AtomicU64 = AtomicU64::new(0);

fn url() -> String {
    std::env::var("ONCELY_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

fn next() -> u64 {
    SEQ.fetch_add(1, Ordering::Relaxed)
}

async fn oncely_once(ledger: &NatsKvLedger, tenant: &Tenant, outcome: &Outcome) {
    let k = EffectKey::new(tenant, "capture", format!("order-{}", next())).unwrap();
    match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => ledger.complete(&l, outcome).await.unwrap(),
        other => panic!("{other:?}"),
    }
}

/// The same round trips by hand: insert-if-absent, then a conditional
/// update, with values the size of the ledger's records.
async fn baseline_once(store: &async_nats::jetstream::kv::Store, claim: &bytes::Bytes, done: &bytes::Bytes) {
    let key = format!("baseline.{}", next());
    let rev = store.create(&key, claim.clone()).await.unwrap();
    store.update(&key, done.clone(), rev).await.unwrap();
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (ledger, store) = rt.block_on(async {
        // Start from an empty bucket so runs are comparable.
        let client = async_nats::connect(url())
            .await
            .expect("NATS server for the bench");
        let js = async_nats::jetstream::new(client);
        let _ = js.delete_stream(format!("KV_{BUCKET}")).await;
        let ledger = NatsKvLedger::connect_with(&url(), NatsKvOptions::default().bucket(BUCKET))
            .await
            .unwrap();
        let store = ledger.store().clone();
        (ledger, store)
    });
    let tenant = Tenant::new(format!("bench-{}", std::process::id())).unwrap();
    let outcome = Outcome::from_json(&serde_json::json!({"charge": "ch_123456", "amount": 1250})).unwrap();
    // Record-sized values: what the ledger writes for a claim and a completion.
    let claim_val = bytes::Bytes::from(vec![b'x'; 230]);
    let done_val = bytes::Bytes::from(vec![b'y'; 290]);

    for tasks in [1usize, 8] {
        let name = if tasks == 1 {
            "nats/claim_complete_1_task"
        } else {
            "nats/claim_complete_8_tasks"
        };
        let mut g = c.benchmark_group(name);
        g.sample_size(20)
            .measurement_time(Duration::from_secs(5))
            .warm_up_time(Duration::from_secs(1));
        {
            let (ledger, tenant, outcome) = (ledger.clone(), tenant.clone(), outcome.clone());
            g.bench_function("oncely", |b| {
                b.to_async(&rt).iter_custom(|iters| {
                    let (ledger, tenant, outcome) = (ledger.clone(), tenant.clone(), outcome.clone());
                    async move {
                        oncely::conformance::spread(iters, tasks as u64, move || {
                            let (ledger, tenant, outcome) = (ledger.clone(), tenant.clone(), outcome.clone());
                            async move { oncely_once(&ledger, &tenant, &outcome).await }
                        })
                        .await
                    }
                })
            });
        }
        {
            let (store, claim_val, done_val) = (store.clone(), claim_val.clone(), done_val.clone());
            g.bench_function("baseline", |b| {
                b.to_async(&rt).iter_custom(|iters| {
                    let (store, claim_val, done_val) = (store.clone(), claim_val.clone(), done_val.clone());
                    async move {
                        oncely::conformance::spread(iters, tasks as u64, move || {
                            let (store, claim_val, done_val) =
                                (store.clone(), claim_val.clone(), done_val.clone());
                            async move { baseline_once(&store, &claim_val, &done_val).await }
                        })
                        .await
                    }
                })
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);

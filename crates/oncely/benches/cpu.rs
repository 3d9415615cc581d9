//! The CPU the core spends per claim outside the round trip: key validation
//! and rendering, the provider key, fingerprinting a payload, encoding and
//! decoding an outcome, and a whole `Effects::run` (claim, run, complete) and
//! a duplicate's replay on the in-process ledger, where the "round trip" is a
//! mutex. Target: under 5 µs per claim. The outcome codec (`oncely::codec`):
//! sealing and opening a charge and a 16 KiB page, with and without
//! compression, next to encoding the same outcome in plain (the baseline);
//! the stored sizes are printed once.
//!
//! `cargo bench -p oncely --bench cpu`

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use oncely::backend::{Fingerprint, Outcome, StoredOutcome};
use oncely::codec::{Keyring, OutcomeCodec, SecretKey};
use oncely::{ClaimOptions, EffectKey, Effects, MemoryLedger, Tenant};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Charge {
    id: String,
    amount: u64,
    currency: String,
}

fn charge() -> Charge {
    Charge {
        id: "ch_3PqzK2Lk9x8v7w6u5t4s".to_owned(),
        amount: 1250,
        currency: "EUR".to_owned(),
    }
}

fn keys(c: &mut Criterion) {
    let tenant = Tenant::new("acme-eu").unwrap();
    c.bench_function("key: validate", |b| {
        b.iter(|| {
            EffectKey::new(
                black_box(&tenant),
                black_box("capture"),
                black_box("order-123456"),
            )
            .unwrap()
        })
    });
    let key = EffectKey::new(&tenant, "capture", "order-123456").unwrap();
    c.bench_function("key: render", |b| b.iter(|| black_box(&key).to_string()));
    c.bench_function("key: parse", |b| {
        b.iter(|| EffectKey::parse(black_box("acme-eu/capture:order-123456")).unwrap())
    });
    c.bench_function("key: provider key", |b| b.iter(|| black_box(&key).provider_key()));
}

fn payloads(c: &mut Criterion) {
    let payload = serde_json::json!({
        "order": "order-123456", "amount": 1250, "currency": "EUR",
        "customer": {"id": "cus_42", "email": "a@example.com"}, "items": [1, 2, 3],
    });
    c.bench_function("fingerprint: json payload", |b| {
        b.iter(|| Fingerprint::of_json(black_box(&payload)).unwrap())
    });
    c.bench_function("outcome: encode", |b| {
        b.iter(|| Outcome::value(black_box(&charge())).unwrap())
    });
    let outcome = Outcome::value(&charge()).unwrap();
    c.bench_function("outcome: decode", |b| {
        b.iter(|| match black_box(&outcome).decode::<Charge>().unwrap() {
            StoredOutcome::Value(c) => c.amount,
            _ => 0,
        })
    });
}

/// A stored HTTP response's worth of JSON: 16 KiB of order lines.
fn page() -> Vec<serde_json::Value> {
    (0..300)
        .map(|i| serde_json::json!({"line": i, "sku": format!("SKU-{:05}", i * 7), "qty": i % 4 + 1, "price": "19.90"}))
        .collect()
}

fn codec(c: &mut Criterion) {
    let key = EffectKey::new(&Tenant::new("acme-eu").unwrap(), "capture", "order-123456").unwrap();
    let ring = Keyring::new("k1", SecretKey::from_bytes([7; 32])).unwrap();
    let compressing = ring.clone().compress(true);
    for (name, value) in [
        ("charge", serde_json::to_value(charge()).unwrap()),
        ("16 KiB page", serde_json::to_value(page()).unwrap()),
    ] {
        let plain = Outcome::value(&value).unwrap();
        let sealed = ring.seal(&key, &plain).unwrap();
        let deflated = compressing.seal(&key, &plain).unwrap();
        eprintln!(
            "codec, {name}: plain {} bytes, sealed {} bytes, compressed and sealed {} bytes",
            plain.len(),
            sealed.len(),
            deflated.len()
        );
        c.bench_function(&format!("codec: {name}: encode plain (baseline)"), |b| {
            b.iter(|| Outcome::value(black_box(&value)).unwrap())
        });
        c.bench_function(&format!("codec: {name}: encode and seal"), |b| {
            b.iter(|| {
                ring.seal(&key, &Outcome::value(black_box(&value)).unwrap())
                    .unwrap()
            })
        });
        c.bench_function(&format!("codec: {name}: encode, compress and seal"), |b| {
            b.iter(|| {
                compressing
                    .seal(&key, &Outcome::value(black_box(&value)).unwrap())
                    .unwrap()
            })
        });
        c.bench_function(&format!("codec: {name}: open"), |b| {
            b.iter(|| ring.open(&key, black_box(&sealed)).unwrap())
        });
        c.bench_function(&format!("codec: {name}: open and inflate"), |b| {
            b.iter(|| ring.open(&key, black_box(&deflated)).unwrap())
        });
    }
}

fn runner(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let effects = Effects::new(Arc::new(MemoryLedger::new()));
    let tenant = Tenant::new("acme-eu").unwrap();
    let opts = ClaimOptions::default();
    let mut n = 0u64;
    c.bench_function("run: claim, handler, complete (memory ledger)", |b| {
        b.iter(|| {
            n += 1;
            let key = EffectKey::new(&tenant, "capture", format!("order-{n}")).unwrap();
            rt.block_on(effects.run(&key, &opts, |_| async { Ok(charge()) }))
                .unwrap()
        })
    });
    let key = EffectKey::new(&tenant, "capture", "order-replayed").unwrap();
    rt.block_on(effects.run(&key, &opts, |_| async { Ok(charge()) }))
        .unwrap();
    c.bench_function("run: a duplicate's replay (memory ledger)", |b| {
        b.iter(|| {
            rt.block_on(effects.run(&key, &opts, |_| async { Ok(charge()) }))
                .unwrap()
        })
    });
}

criterion_group!(benches, keys, payloads, codec, runner);
criterion_main!(benches);

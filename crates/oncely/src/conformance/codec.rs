//! The outcome codec cases: a backend's ledger wrapped in
//! [`Sealed`] with a [`Keyring`]. Each backend's `tests/codec.rs` calls them
//! with its ledger (an [`Admin`] one) and, for
//! [`codec_dump_holds_no_plain_outcome`], a function that dumps the ledger's
//! table with the database's own tool and the search of it
//! (`oncely_testkit::dump`).

use std::sync::Arc;

use super::{acquired, fresh_tenant, key, opts};
use crate::admin::{Admin, Filter, RecordQuery};
use crate::backend::{Ledger, TransactionalLedger};
use crate::codec::{Envelope, Keyring, ResealOptions, Sealed, SecretKey, reseal};
use crate::record::{Claim, Fingerprint, Outcome, RecordState};
use crate::{ClaimOptions, EffectKey, Effects, Error, Tenant};

fn ring(id: &str, byte: u8) -> Keyring {
    Keyring::new(id, SecretKey::from_bytes([byte; 32])).expect("valid key id")
}

fn rotated() -> Keyring {
    ring("k2", 2)
        .with_decrypt_only("k1", SecretKey::from_bytes([1; 32]))
        .expect("distinct ids")
}

/// Claims and completes `k` on `ledger` with `value` as its outcome.
async fn complete<L: Ledger>(ledger: &L, k: &EffectKey, value: &str) {
    let lease = acquired(ledger.claim(k, &opts()).await.unwrap());
    ledger
        .complete(&lease, &Outcome::from_json(&value).unwrap())
        .await
        .unwrap();
}

/// The stored bytes of `k`'s outcome, read past any codec.
async fn stored<L: Ledger>(inner: &L, k: &EffectKey) -> Vec<u8> {
    let record = inner.get(k).await.unwrap().expect("record exists");
    record.outcome.expect("completed with an outcome").into_bytes()
}

fn marker(tenant: &Tenant, what: &str) -> String {
    format!("{what}-{}", tenant.as_str())
}

/// With the codec, the table as its dump tool prints it holds no byte
/// sequence of an outcome (raw or in hex); an outcome written without the
/// codec, in the same table, is found by the same search, and so is the
/// sealed row's stored envelope (the controls: the search sees rows, and
/// this one was dumped). Duplicates still get the plain value back. The
/// same holds for an outcome deflated before sealing
/// ([`Keyring::compress`]), stored shorter than it is, and opened by a
/// keyring that does not compress.
pub async fn codec_dump_holds_no_plain_outcome<L: Admin + 'static>(
    ledger: L,
    dump: impl Fn() -> Vec<u8>,
    contains: fn(&[u8], &[u8]) -> bool,
) {
    let ledger = Arc::new(ledger);
    let t = fresh_tenant();
    let secret = marker(&t, "ch_sealed_4242");
    let control = marker(&t, "ch_plain_1717");
    let (ks, kc) = (key(&t, "capture", "sealed"), key(&t, "capture", "plain"));

    complete(&ledger, &kc, &control).await;
    let effects = Effects::new(Sealed::new(ledger.clone(), ring("k1", 1)));
    let first: String = effects
        .run(&ks, &ClaimOptions::default(), |_| {
            let secret = secret.clone();
            async move { Ok(secret) }
        })
        .await
        .unwrap();
    let again: String = effects
        .run(&ks, &ClaimOptions::default(), |_| async {
            Ok("ran twice".to_owned())
        })
        .await
        .unwrap();
    assert_eq!(
        (first.as_str(), again.as_str()),
        (secret.as_str(), secret.as_str())
    );

    let bytes = stored(&ledger, &ks).await;
    assert_eq!(
        Envelope::parse(&bytes).map(|e| e.key_id().to_owned()).as_deref(),
        Some("k1")
    );
    let dumped = dump();
    assert!(
        contains(&dumped, control.as_bytes()),
        "control: the plain outcome {control} is not in the dump, so the search proves nothing"
    );
    assert!(
        contains(&dumped, &bytes),
        "the sealed row itself is not in the dump, so its absence proves nothing"
    );
    assert!(
        !contains(&dumped, secret.as_bytes()),
        "the sealed outcome {secret} appears in the dump"
    );
    // The whole stored plain outcome, not only the marker inside it.
    let plain = Outcome::value(&secret).unwrap();
    assert!(!contains(&dumped, plain.as_bytes()));

    // Compressed, then sealed: shorter than the plain outcome, and no more
    // readable in a dump.
    let kz = key(&t, "render", "compressed");
    let page = vec![marker(&t, "ch_deflated_5151"); 200];
    let compressing = Effects::new(Sealed::new(ledger.clone(), ring("k1", 1).compress(true)));
    let first: Vec<String> = compressing
        .run(&kz, &ClaimOptions::default(), |_| {
            let page = page.clone();
            async move { Ok(page) }
        })
        .await
        .unwrap();
    let again: Vec<String> = effects
        .run(&kz, &ClaimOptions::default(), |_| async { Ok(Vec::new()) })
        .await
        .unwrap();
    assert_eq!((&first, &again), (&page, &page));
    let bytes = stored(&ledger, &kz).await;
    let envelope = Envelope::parse(&bytes).expect("sealed");
    let plain = Outcome::value(&page).unwrap();
    assert!(
        envelope.is_compressed() && bytes.len() < plain.len() / 4,
        "{} stored bytes for {} plain",
        bytes.len(),
        plain.len()
    );
    let dumped = dump();
    assert!(contains(&dumped, &bytes), "the compressed row is not in the dump");
    assert!(!contains(&dumped, page[0].as_bytes()));
}

/// Rotation: with a new active key and the old one decrypt-only, records
/// sealed under the old key still open (claims and gets), new ones are
/// sealed under the new key; [`reseal`] moves the old ones to the new key
/// (a dry run first, which writes nothing), after which a keyring without
/// the old key opens everything; running it again rewrites nothing. Plain
/// outcomes are sealed only when asked.
pub async fn codec_rotation_keeps_old_records_readable<L: Admin>(ledger: L) {
    let t = fresh_tenant();
    let old = Sealed::new(&ledger, ring("k1", 1));
    let keys: Vec<EffectKey> = (0..3).map(|i| key(&t, "capture", &format!("old-{i}"))).collect();
    for (i, k) in keys.iter().enumerate() {
        complete(&old, k, &format!("old value {i}")).await;
    }
    let plain_key = key(&t, "capture", "plain");
    complete(&ledger, &plain_key, "written before the codec").await;

    let new = Sealed::new(&ledger, rotated());
    for (i, k) in keys.iter().enumerate() {
        let want = Outcome::from_json(&format!("old value {i}")).unwrap();
        match new.claim(k, &opts()).await.unwrap() {
            Claim::Completed(r) => assert_eq!(r.outcome.as_ref(), Some(&want)),
            other => panic!("expected Completed, got {other:?}"),
        }
        assert_eq!(new.get(k).await.unwrap().unwrap().outcome, Some(want));
    }
    let fresh = key(&t, "capture", "new");
    complete(&new, &fresh, "new value").await;
    assert_eq!(
        Envelope::parse(&stored(&ledger, &fresh).await).unwrap().key_id(),
        "k2"
    );

    let only_tenant = ResealOptions::default().tenant(t.clone());
    let dry = reseal(&ledger, new.codec(), &only_tenant.clone().dry_run(true))
        .await
        .unwrap();
    assert_eq!(
        (dry.scanned, dry.resealed, dry.current, dry.plain),
        (5, 3, 1, 1),
        "{dry:?}"
    );
    for k in &keys {
        assert_eq!(Envelope::parse(&stored(&ledger, k).await).unwrap().key_id(), "k1");
    }

    let done = reseal(&ledger, new.codec(), &only_tenant).await.unwrap();
    assert_eq!(
        (done.resealed, done.current, done.moved_on),
        (3, 1, 0),
        "{done:?}"
    );
    assert!(done.failed.is_empty(), "{:?}", done.failed);
    let without_old = Sealed::new(&ledger, ring("k2", 2));
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(Envelope::parse(&stored(&ledger, k).await).unwrap().key_id(), "k2");
        let record = without_old.get(k).await.unwrap().unwrap();
        assert_eq!(
            record.outcome,
            Some(Outcome::from_json(&format!("old value {i}")).unwrap())
        );
        assert_eq!(record.state, RecordState::Completed);
    }
    let again = reseal(&ledger, new.codec(), &only_tenant).await.unwrap();
    assert_eq!(
        (again.resealed, again.current, again.plain),
        (0, 4, 1),
        "{again:?}"
    );

    let with_plain = reseal(&ledger, new.codec(), &only_tenant.plain(true))
        .await
        .unwrap();
    assert_eq!(with_plain.resealed, 1, "{with_plain:?}");
    assert!(Envelope::is_sealed(&stored(&ledger, &plain_key).await));
    let strict = Sealed::new(&ledger, ring("k2", 2).require_sealed(true));
    assert_eq!(
        strict.get(&plain_key).await.unwrap().unwrap().outcome,
        Some(Outcome::from_json(&"written before the codec").unwrap())
    );
}

/// A record that moved on between [`reseal`]'s read and its write is left
/// alone and counted: the conditional write refuses a stale fence.
pub async fn codec_reseal_leaves_a_record_that_moved_on<L: Admin>(ledger: L) {
    let t = fresh_tenant();
    let k = key(&t, "capture", "moved");
    complete(&Sealed::new(&ledger, ring("k1", 1)), &k, "before").await;
    let record = ledger.get(&k).await.unwrap().unwrap();
    let stale = Outcome::from_bytes(stored(&ledger, &k).await).unwrap();
    ledger.forget(&k, record.fence).await.unwrap();
    complete(&Sealed::new(&ledger, ring("k1", 1)), &k, "after").await;
    let replacement = Outcome::from_json(&"never").unwrap();
    assert!(
        !ledger
            .replace_outcome(&k, record.fence, &stale, &replacement)
            .await
            .unwrap()
    );
    let current = ledger.get(&k).await.unwrap().unwrap();
    assert!(
        !ledger
            .replace_outcome(&k, current.fence, &stale, &replacement)
            .await
            .unwrap(),
        "another outcome than the one read: refused"
    );
    let opened = Sealed::new(&ledger, rotated()).get(&k).await.unwrap().unwrap();
    assert_eq!(opened.outcome, Some(Outcome::from_json(&"after").unwrap()));
}

/// A wrong key under a known id is [`Error::Codec`]; a key id the keyring
/// lacks is [`Error::CodecKeyMissing`] naming it; both on claims and gets,
/// and neither writes anything (the record still opens with the right key).
/// A claim with another fingerprint fails with
/// [`Error::FingerprintMismatch`] before anything is opened, even when the
/// keyring lacks the record's key.
pub async fn codec_wrong_or_missing_key_is_a_typed_error<L: Admin>(ledger: L) {
    let t = fresh_tenant();
    let k = key(&t, "capture", "keyed");
    let fp = Fingerprint::of_bytes(b"request one");
    let right = Sealed::new(&ledger, ring("k1", 1));
    let lease = acquired(right.claim(&k, &opts().fingerprint(fp)).await.unwrap());
    let value = Outcome::from_json(&"secret value").unwrap();
    right.complete(&lease, &value).await.unwrap();

    let wrong = Sealed::new(&ledger, ring("k1", 9));
    assert!(matches!(wrong.claim(&k, &opts()).await, Err(Error::Codec { .. })));
    assert!(matches!(wrong.get(&k).await, Err(Error::Codec { .. })));

    let lacking = Sealed::new(&ledger, ring("k2", 2));
    match lacking.claim(&k, &opts().fingerprint(fp)).await {
        Err(Error::CodecKeyMissing { key, key_id }) => {
            assert_eq!((key, key_id.as_str()), (k.to_string(), "k1"));
        }
        other => panic!("expected CodecKeyMissing, got {other:?}"),
    }
    assert!(matches!(
        lacking.get(&k).await,
        Err(Error::CodecKeyMissing { .. })
    ));
    let other_payload = opts().fingerprint(Fingerprint::of_bytes(b"request two"));
    assert!(
        matches!(
            lacking.claim(&k, &other_payload).await,
            Err(Error::FingerprintMismatch { .. })
        ),
        "the fingerprint is checked before anything is opened"
    );
    match right.claim(&k, &opts().fingerprint(fp)).await.unwrap() {
        Claim::Completed(r) => assert_eq!(r.outcome, Some(value)),
        other => panic!("expected Completed, got {other:?}"),
    }
}

/// An erased record (completed, no outcome) passes through the codec
/// untouched: a claim fails with [`Error::Erased`], a get shows it erased,
/// [`reseal`] skips it.
pub async fn codec_leaves_erased_records_alone<L: Admin>(ledger: L) {
    let t = fresh_tenant();
    let k = key(&t, "capture", "erased-subject");
    let sealed = Sealed::new(&ledger, ring("k1", 1));
    complete(&sealed, &k, "personal data").await;
    ledger.erase(&t, "erased-subject").await.unwrap();
    assert!(matches!(
        sealed.claim(&k, &opts()).await,
        Err(Error::Erased { .. })
    ));
    assert!(sealed.get(&k).await.unwrap().unwrap().is_erased());
    let report = reseal(&ledger, &rotated(), &ResealOptions::default().tenant(t.clone()))
        .await
        .unwrap();
    assert_eq!((report.scanned, report.resealed), (0, 0), "{report:?}");
    let listed = ledger
        .records(&RecordQuery::tenant(&t).filter(Filter::State(RecordState::Completed)))
        .await
        .unwrap();
    assert!(listed.iter().all(|r| r.outcome.is_none()));
}

/// In the caller's transaction ([`TransactionalLedger`]): `complete_in`
/// through [`Sealed`] stores the outcome sealed, and a duplicate's
/// `claim_in` gets it back opened.
pub async fn codec_seals_in_the_callers_transaction<L: TransactionalLedger>(ledger: L) {
    let t = fresh_tenant();
    let k = key(&t, "capture", "in-tx");
    let sealed = Sealed::new(ledger, ring("k1", 1));
    let value = Outcome::from_json(&marker(&t, "tx secret")).unwrap();
    let mut tx = sealed.begin().await.unwrap();
    let lease = acquired(sealed.claim_in(&mut tx, &k, &opts()).await.unwrap());
    sealed.complete_in(&mut tx, &lease, &value).await.unwrap();
    sealed.commit(tx).await.unwrap();
    assert_eq!(
        Envelope::parse(&stored(sealed.inner(), &k).await)
            .unwrap()
            .key_id(),
        "k1"
    );
    let mut tx = sealed.begin().await.unwrap();
    match sealed.claim_in(&mut tx, &k, &opts()).await.unwrap() {
        Claim::Completed(r) => assert_eq!(r.outcome, Some(value)),
        other => panic!("expected Completed, got {other:?}"),
    }
    sealed.rollback(tx).await.unwrap();
}

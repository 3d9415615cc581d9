//! The outcome codec cases on the memory ledger, and what only the memory
//! ledger can show directly (batches and the caller's transaction are the
//! SQL backends' `tests/codec.rs`).

use oncely::backend::{Claim, Ledger, Outcome};
use oncely::codec::{Envelope, Keyring, Sealed, SecretKey};
use oncely::conformance::{
    codec_leaves_erased_records_alone, codec_reseal_leaves_a_record_that_moved_on,
    codec_rotation_keeps_old_records_readable, codec_wrong_or_missing_key_is_a_typed_error, fresh_tenant,
};
use oncely::{ClaimOptions, EffectKey, Error, MemoryLedger};

#[tokio::test]
async fn rotation_keeps_old_records_readable() {
    codec_rotation_keeps_old_records_readable(MemoryLedger::new()).await;
}

#[tokio::test]
async fn reseal_leaves_a_record_that_moved_on() {
    codec_reseal_leaves_a_record_that_moved_on(MemoryLedger::new()).await;
}

#[tokio::test]
async fn wrong_or_missing_key_is_a_typed_error() {
    codec_wrong_or_missing_key_is_a_typed_error(MemoryLedger::new()).await;
}

#[tokio::test]
async fn erased_records_pass_untouched() {
    codec_leaves_erased_records_alone(MemoryLedger::new()).await;
}

fn ring() -> Keyring {
    Keyring::new("k1", SecretKey::from_bytes([7; 32])).unwrap()
}

#[tokio::test]
async fn batches_are_sealed_and_opened_per_slot() {
    let inner = MemoryLedger::new();
    let sealed = Sealed::new(&inner, ring());
    let t = fresh_tenant();
    let keys: Vec<EffectKey> = (0..3)
        .map(|i| EffectKey::new(&t, "capture", format!("b-{i}")).unwrap())
        .collect();
    let opts = ClaimOptions::default();
    let mut items = Vec::new();
    for (i, answer) in sealed
        .claim_many(&keys, &opts)
        .await
        .unwrap()
        .into_iter()
        .enumerate()
    {
        let Ok(Claim::Acquired(lease)) = answer else {
            panic!("{answer:?}")
        };
        let outcome = if i == 1 {
            // Over what is left of the limit once sealed: this slot alone fails.
            Outcome::from_bytes(vec![b'x'; oncely::backend::MAX_OUTCOME_BYTES]).unwrap()
        } else {
            Outcome::from_json(&format!("value {i}")).unwrap()
        };
        items.push((lease, outcome));
    }
    let answers = sealed.complete_many(&items).await;
    assert!(answers[0].is_ok() && answers[2].is_ok(), "{answers:?}");
    assert!(
        matches!(answers[1], Err(Error::OutcomeTooLarge { .. })),
        "{answers:?}"
    );
    for i in [0, 2] {
        let stored = inner.get(&keys[i]).await.unwrap().unwrap().outcome.unwrap();
        assert_eq!(Envelope::parse(stored.as_bytes()).unwrap().key_id(), "k1");
    }
    let again = sealed.claim_many(&keys, &opts).await.unwrap();
    for i in [0, 2] {
        let Ok(Claim::Completed(r)) = &again[i] else {
            panic!("{:?}", again[i])
        };
        assert_eq!(
            r.outcome,
            Some(Outcome::from_json(&format!("value {i}")).unwrap())
        );
    }
    assert!(matches!(again[1], Ok(Claim::InProgress { .. })), "{:?}", again[1]);
}

#[test]
fn the_limit_a_caller_sees_is_what_is_left_once_sealed() {
    let inner = MemoryLedger::new();
    let codec = ring();
    let left = inner.capabilities().max_outcome_bytes - oncely::codec::OutcomeCodec::overhead(&codec);
    assert_eq!(Sealed::new(inner, codec).capabilities().max_outcome_bytes, left);
}

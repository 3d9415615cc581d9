//! The outcome codec cases on the memory ledger, and what is shown once for
//! every backend: batches sealed per slot, the limit a caller sees, and
//! `reseal` meeting a record that moved on (the caller's transaction and
//! the dumps are the SQL backends' `tests/codec.rs`).

use oncely::admin::{Admin, RecordQuery};
use oncely::backend::{Claim, Ledger, Outcome};
use oncely::codec::{Envelope, Keyring, OutcomeCodec, ResealOptions, Sealed, SecretKey, reseal};
use oncely::conformance::fresh_tenant;
use oncely::{ClaimOptions, EffectKey, Error, MemoryLedger};

async fn memory() -> Option<MemoryLedger> {
    Some(MemoryLedger::new())
}

oncely::conformance::codec_conformance_tests!(memory);

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
    let left = inner.capabilities().max_outcome_bytes - codec.overhead();
    assert_eq!(Sealed::new(inner, codec).capabilities().max_outcome_bytes, left);
}

/// A memory ledger whose record listing, once, lets another operator move
/// the first completed record on (forget, then complete again) after the
/// page was read: what `reseal` must count and leave alone.
struct MovesOnceListed {
    inner: MemoryLedger,
    moved: std::sync::atomic::AtomicBool,
}

impl Ledger for MovesOnceListed {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn capabilities(&self) -> oncely::backend::Capabilities {
        self.inner.capabilities()
    }
    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> oncely::Result<Claim> {
        self.inner.claim(key, opts).await
    }
    async fn complete(&self, lease: &oncely::backend::Lease, outcome: &Outcome) -> oncely::Result<()> {
        self.inner.complete(lease, outcome).await
    }
    async fn release(&self, lease: &oncely::backend::Lease) -> oncely::Result<()> {
        self.inner.release(lease).await
    }
    async fn renew(
        &self,
        lease: &oncely::backend::Lease,
        extend_by: std::time::Duration,
    ) -> oncely::Result<oncely::backend::Lease> {
        self.inner.renew(lease, extend_by).await
    }
    async fn get(&self, key: &EffectKey) -> oncely::Result<Option<oncely::backend::Record>> {
        self.inner.get(key).await
    }
    async fn prune(&self, limit: u64) -> oncely::Result<u64> {
        self.inner.prune(limit).await
    }
    async fn abandoned(
        &self,
        tenant: &oncely::Tenant,
        limit: u64,
    ) -> oncely::Result<Vec<oncely::backend::Record>> {
        self.inner.abandoned(tenant, limit).await
    }
    async fn horizon(
        &self,
        tenant: &oncely::Tenant,
        kind: &str,
    ) -> oncely::Result<Option<std::time::SystemTime>> {
        self.inner.horizon(tenant, kind).await
    }
}

impl Admin for MovesOnceListed {
    async fn records(&self, query: &RecordQuery) -> oncely::Result<Vec<oncely::backend::Record>> {
        let page = self.inner.records(query).await?;
        if let Some(first) = page.first()
            && !self.moved.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            self.inner.forget(&first.key, first.fence).await?;
            let Claim::Acquired(lease) = self.inner.claim(&first.key, &ClaimOptions::default()).await? else {
                panic!("a forgotten record is taken over")
            };
            let again = ring().seal(&first.key, &Outcome::from_json(&"redone").unwrap())?;
            self.inner.complete(&lease, &again).await?;
        }
        Ok(page)
    }
    async fn stats(&self, tenant: Option<&oncely::Tenant>) -> oncely::Result<Vec<oncely::admin::KindStats>> {
        self.inner.stats(tenant).await
    }
    async fn forget(&self, key: &EffectKey, fence: u64) -> oncely::Result<()> {
        self.inner.forget(key, fence).await
    }
    async fn prunable(&self) -> oncely::Result<u64> {
        self.inner.prunable().await
    }
    async fn erase(&self, tenant: &oncely::Tenant, subject: &str) -> oncely::Result<oncely::admin::Erasure> {
        self.inner.erase(tenant, subject).await
    }
    async fn erase_dry_run(
        &self,
        tenant: &oncely::Tenant,
        subject: &str,
    ) -> oncely::Result<oncely::admin::Erasure> {
        self.inner.erase_dry_run(tenant, subject).await
    }
    async fn replace_outcome(
        &self,
        key: &EffectKey,
        fence: u64,
        expected: &Outcome,
        outcome: &Outcome,
    ) -> oncely::Result<bool> {
        self.inner.replace_outcome(key, fence, expected, outcome).await
    }
}

#[tokio::test]
async fn reseal_counts_a_record_that_moved_on_between_its_read_and_its_write() {
    let ledger = MovesOnceListed {
        inner: MemoryLedger::new(),
        moved: std::sync::atomic::AtomicBool::new(false),
    };
    let t = fresh_tenant();
    let keys: Vec<EffectKey> = (0..2)
        .map(|i| EffectKey::new(&t, "capture", format!("m-{i}")).unwrap())
        .collect();
    let sealed = Sealed::new(&ledger.inner, ring());
    for k in &keys {
        let Claim::Acquired(lease) = sealed.claim(k, &ClaimOptions::default()).await.unwrap() else {
            panic!("fresh")
        };
        sealed
            .complete(&lease, &Outcome::from_json(&"first").unwrap())
            .await
            .unwrap();
    }
    let rotated = Keyring::new("k2", SecretKey::from_bytes([8; 32]))
        .unwrap()
        .with_decrypt_only("k1", SecretKey::from_bytes([7; 32]))
        .unwrap();
    let report = reseal(&ledger, &rotated, &ResealOptions::default().tenant(t))
        .await
        .unwrap();
    assert_eq!((report.resealed, report.moved_on), (1, 1), "{report:?}");
    assert!(report.failed.is_empty());
    // The moved record keeps what its new run stored, under the old key;
    // a second pass moves it.
    let moved = ledger.inner.get(&keys[0]).await.unwrap().unwrap();
    assert_eq!(
        Envelope::parse(moved.outcome.as_ref().unwrap().as_bytes())
            .unwrap()
            .key_id(),
        "k1"
    );
    assert_eq!(
        Sealed::new(&ledger.inner, rotated.clone())
            .get(&keys[0])
            .await
            .unwrap()
            .unwrap()
            .outcome,
        Some(Outcome::from_json(&"redone").unwrap())
    );
    let again = reseal(&ledger, &rotated, &ResealOptions::default())
        .await
        .unwrap();
    assert_eq!((again.resealed, again.moved_on), (1, 0), "{again:?}");
}

/// The whole `Ledger` contract holds through the wrapper: the shared
/// conformance suite on a sealed memory ledger (every outcome it writes is
/// sealed, every one it reads back opened).
mod through_the_wrapper {
    use std::sync::Arc;

    use oncely::MemoryLedger;
    use oncely::codec::{Keyring, Sealed, SecretKey};

    async fn ledger() -> Option<Arc<Sealed<MemoryLedger, Keyring>>> {
        let keys = Keyring::new("k1", SecretKey::from_bytes([3; 32])).unwrap();
        Some(Arc::new(Sealed::new(MemoryLedger::new(), keys)))
    }

    oncely::conformance::conformance_tests!(ledger);
}

//! The background [`Pruner`](crate::pruner::Pruner) on a real backend: it deletes
//! everything due, nothing else, in calls no larger than its batch, and
//! stops when asked.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use super::{SHORT_LEASE_WAIT, acquired, fresh_tenant, key, opts};
use crate::ledger::{Capabilities, Ledger};
use crate::pruner::{Pruner, PrunerOptions};
use crate::record::{Claim, Lease, Outcome, Record, RecordState};
use crate::{ClaimOptions, EffectKey, Result, Tenant};

/// A ledger that passes everything through and records each `prune` call:
/// the limit asked for and how many records it deleted.
#[derive(Debug, Clone)]
pub struct CountingPrunes<L> {
    inner: L,
    calls: Arc<Mutex<Vec<(u64, u64)>>>,
}

impl<L: Ledger> CountingPrunes<L> {
    /// Wraps `inner`.
    pub fn new(inner: L) -> Self {
        CountingPrunes {
            inner,
            calls: Arc::default(),
        }
    }

    /// Every successful `prune` call so far: (limit, deleted).
    pub fn calls(&self) -> Vec<(u64, u64)> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl<L: Ledger> Ledger for CountingPrunes<L> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        self.inner.claim(key, opts).await
    }
    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        self.inner.complete(lease, outcome).await
    }
    async fn release(&self, lease: &Lease) -> Result<()> {
        self.inner.release(lease).await
    }
    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        self.inner.renew(lease, extend_by).await
    }
    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        self.inner.get(key).await
    }
    async fn prune(&self, limit: u64) -> Result<u64> {
        let n = self.inner.prune(limit).await?;
        self.calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((limit, n));
        Ok(n)
    }
    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        self.inner.abandoned(tenant, limit).await
    }
    async fn horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
        self.inner.horizon(tenant, kind).await
    }
}

/// A [`Pruner`] deletes every completed and released record past retention,
/// keeps young records, live leases and abandoned steps, never asks the
/// ledger for more than its batch at once, counts what it did, raises the
/// horizon, and makes no call after [`stop`](crate::pruner::PrunerHandle::stop)
/// returns.
///
/// `exact`: the ledger (its table) is this test's alone, so the rows the
/// pruner deleted are exactly the 43 records due; on a table other tests
/// prune too, only what is gone and what is kept prove anything.
pub async fn pruner_prunes_due_records_in_bounded_batches<L: Ledger + Clone + 'static>(
    ledger: L,
    exact: bool,
) {
    const BATCH: u64 = 7;
    let t = fresh_tenant();
    let brief = opts()
        .lease(Duration::from_millis(100))
        .retention(Duration::from_millis(300));
    let long = opts()
        .lease(Duration::from_secs(60))
        .retention(Duration::from_secs(3_600));
    let mut due = Vec::new();
    for i in 0..40 {
        let k = key(&t, "capture", &format!("done-{i}"));
        let l = acquired(ledger.claim(&k, &brief).await.unwrap());
        ledger
            .complete(&l, &Outcome::from_json(&i).unwrap())
            .await
            .unwrap();
        due.push(k);
    }
    for i in 0..3 {
        let k = key(&t, "capture", &format!("released-{i}"));
        let l = acquired(ledger.claim(&k, &brief).await.unwrap());
        ledger.release(&l).await.unwrap();
        due.push(k);
    }
    let mut kept = Vec::new();
    for i in 0..5 {
        let k = key(&t, "capture", &format!("young-{i}"));
        let l = acquired(ledger.claim(&k, &long).await.unwrap());
        ledger
            .complete(&l, &Outcome::from_json(&i).unwrap())
            .await
            .unwrap();
        kept.push((k, RecordState::Completed));
    }
    let live = key(&t, "capture", "live");
    acquired(ledger.claim(&live, &long).await.unwrap());
    kept.push((live, RecordState::InProgress));
    let abandoned = key(&t, "receipt", "abandoned");
    acquired(
        ledger
            .claim(&abandoned, &brief.clone().at_most_once(true))
            .await
            .unwrap(),
    );
    kept.push((abandoned, RecordState::Abandoned));
    tokio::time::sleep(SHORT_LEASE_WAIT).await;

    let counting = CountingPrunes::new(ledger.clone());
    let handle = Pruner::new(
        counting.clone(),
        PrunerOptions::default()
            .batch(BATCH)
            .rows_per_second(2_000)
            .idle(Duration::from_millis(20)),
    )
    .spawn();
    // A deadline against a hang, not a timing assertion.
    let mut waited = 0;
    loop {
        let mut left = 0;
        for k in &due {
            left += usize::from(ledger.get(k).await.unwrap().is_some());
        }
        if left == 0 {
            break;
        }
        assert!(
            waited < 3_000,
            "the pruner left {left} due records: {:?}",
            handle.stats()
        );
        waited += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = handle.stop().await;
    let calls = counting.calls();
    assert!(
        calls
            .iter()
            .all(|&(limit, deleted)| limit == BATCH && deleted <= BATCH),
        "a prune call exceeded the batch of {BATCH}: {calls:?}"
    );
    assert_eq!(stats.batches, calls.len() as u64, "{stats:?}");
    assert_eq!(stats.rows, calls.iter().map(|c| c.1).sum::<u64>(), "{stats:?}");
    if exact {
        assert_eq!(stats.rows, due.len() as u64, "{stats:?} {calls:?}");
        assert!(
            calls.len() as u64 >= (due.len() as u64).div_ceil(BATCH),
            "{calls:?}"
        );
    }
    for (k, state) in &kept {
        let r = ledger.get(k).await.unwrap();
        assert_eq!(r.map(|r| r.state), Some(*state), "{k} was not kept as it was");
    }
    assert!(
        ledger.horizon(&t, "capture").await.unwrap().is_some(),
        "the prune raised no horizon"
    );
    // Stopped: no call after stop returned.
    let after = counting.calls().len();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        counting.calls().len(),
        after,
        "the pruner ran after it was stopped"
    );
}

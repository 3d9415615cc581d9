//! Prune: delete completed and released records past their retention, each
//! with a revision-checked delete (a record changed meanwhile is left
//! alone), after raising the horizon watermark of its tenant and kind
//! (`horizon.rs` has why that order).

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use oncely::backend::RecordState;
use oncely::{EffectKey, Result, Tenant};

use crate::NatsKvLedger;
use crate::codec::Stored;
use crate::kv::{Current, MAX_ATTEMPTS, refusal_backoff};
use crate::marker::MARKER_KEEP;

/// A record this call of prune means to delete.
struct Victim {
    kv_key: String,
    revision: u64,
    /// Its `created_at`, µs: what the watermark must reach first.
    first_us: i64,
    key: EffectKey,
    /// The record at `revision`.
    value: Stored,
}

/// The watermark each tenant and kind has been raised to in this call.
type Raised = HashMap<(Tenant, String), i64>;

/// Whether a record may go: completed or released, its retention over at
/// server time `now`.
fn prunable(cur: &Current, now: SystemTime) -> bool {
    cur.value.as_ref().is_some_and(|v| {
        matches!(v.state(), Ok(RecordState::Completed | RecordState::Released))
            && cur
                .at
                .checked_add(Duration::from_micros(v.retention_us))
                .is_some_and(|end| end <= now)
    })
}

/// Up to `limit` records of a scan that may go.
fn victims(entries: Vec<(String, Current)>, now: SystemTime, limit: u64) -> Vec<Victim> {
    let mut doomed = Vec::new();
    for (kk, cur) in entries {
        if u64::try_from(doomed.len()).unwrap_or(u64::MAX) >= limit {
            break;
        }
        if !prunable(&cur, now) {
            continue;
        }
        let Some(v) = cur.value.as_ref() else {
            continue;
        };
        match v.effect_key(None) {
            Ok(key) => doomed.push(Victim {
                first_us: v.first_us,
                kv_key: kk,
                revision: cur.revision,
                key,
                value: v.clone(),
            }),
            // Its tenant and kind are unknown, so its horizon could not be
            // raised: left for an operator.
            Err(e) => {
                tracing::warn!(kv_key = %kk, error = %e, "not pruning a record with an unreadable key")
            }
        }
    }
    doomed
}

impl NatsKvLedger {
    /// [`oncely::backend::Ledger::prune`]: scans the whole bucket, deletes up to
    /// `limit` records.
    pub(crate) async fn prune_records(&self, limit: u64) -> Result<u64> {
        let (entries, markers) = self.scan(format!("{}>", self.inner.store.prefix)).await?;
        let now = self.now().await?;
        self.purge_old_markers(&markers, now).await;
        let doomed = victims(entries, now, limit);
        // Before any delete, raise each tenant and kind's watermark to the
        // newest record about to go (see horizon.rs for why first). A record
        // that then is not deleted (taken over meanwhile) leaves the horizon
        // a little later than needed: refusing a late message is safe,
        // running a pruned effect again is not.
        let mut raised = Raised::new();
        for v in &doomed {
            let w = raised
                .entry((v.key.tenant().clone(), v.key.kind().to_owned()))
                .or_insert(v.first_us);
            *w = (*w).max(v.first_us);
        }
        for ((tenant, kind), w) in &raised {
            self.raise_watermark(tenant, kind, *w).await?;
        }
        let mut pruned = 0;
        for victim in doomed {
            if self.delete_victim(victim, now, &mut raised).await? {
                pruned += 1;
            }
        }
        Ok(pruned)
    }

    /// Purges the markers older than [`MARKER_KEEP`] (`marker.rs`). A failure
    /// (a bucket that denies purges) leaves them to `max_age` and does not
    /// fail the prune.
    async fn purge_old_markers(&self, markers: &[(u64, SystemTime)], now: SystemTime) {
        let Some(cutoff) = now.checked_sub(MARKER_KEEP) else {
            return;
        };
        // Stream sequences follow the leader's stamps: everything below the
        // newest old marker is older still.
        let Some(newest_old) = markers
            .iter()
            .filter(|(_, at)| *at <= cutoff)
            .map(|(r, _)| *r)
            .max()
        else {
            return;
        };
        match self.purge_markers(newest_old + 1).await {
            Ok(n) => tracing::debug!(purged = n, "purged old markers"),
            Err(e) => tracing::warn!(error = %e, "could not purge old markers; the bucket's max_age will"),
        }
    }

    /// Deletes one victim if it is still prunable; whether it did. A record
    /// that changed since the scan is read again and judged again.
    async fn delete_victim(&self, victim: Victim, now: SystemTime, raised: &mut Raised) -> Result<bool> {
        let Victim {
            kv_key: kk,
            mut revision,
            mut first_us,
            key,
            mut value,
        } = victim;
        let mut backoff = refusal_backoff();
        for _ in 0..MAX_ATTEMPTS {
            let group = (key.tenant().clone(), key.kind().to_owned());
            if raised.get(&group).is_none_or(|w| *w < first_us) {
                // Claimed again since the scan and prunable again already
                // (a retention of milliseconds): its own creation counts.
                self.raise_watermark(key.tenant(), key.kind(), first_us).await?;
                raised.insert(group, first_us);
            }
            // Revision-checked: a record taken over since the scan stays.
            if self.delete(&kk, revision, &value, "prune").await? {
                return Ok(true);
            }
            // Either the record changed, or the stream leader refused a
            // matching revision (NATS 2.9 clusters do so under concurrent
            // writes to other keys): read again and decide again, as a
            // claim does, pausing first if it was the refusal.
            match self.read(&kk).await? {
                Some(c) if prunable(&c, now) => {
                    if c.revision == revision {
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                    revision = c.revision;
                    if let Some(v) = c.value {
                        first_us = v.first_us;
                        value = v;
                    }
                }
                _ => return Ok(false),
            }
        }
        // Left for the next prune, as every record it does not get to.
        Ok(false)
    }
}

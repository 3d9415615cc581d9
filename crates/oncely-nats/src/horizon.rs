//! The horizon: how far back this ledger can vouch that a key it finds
//! absent was never claimed.
//!
//! A record can leave the bucket two ways, and the horizon of a tenant and
//! kind is the later of the two bounds:
//!
//! - **prune** deletes completed and released records past their retention.
//!   Before it deletes a record it raises the *watermark* of the record's
//!   tenant and kind (a value at [`watermark_key`], written with a
//!   revision-checked update so concurrent prunes only ever raise it) to at
//!   least the record's `created_at`;
//! - **`max_age`**: the server drops every key not written for the bucket's
//!   `max_age`. Such a record was last written, hence created, at or before
//!   `now - max_age`, so that instant is a horizon too. It also covers a
//!   watermark key that nobody raised for `max_age` and that vanished: every
//!   value it held was at or before its last write.
//!
//! # Why the order makes a pruned effect unable to run again
//!
//! Prune: *raise the watermark, then delete* (each acknowledged before the
//! next is sent). Claim with `sent_at`: *create the record, then read the
//! watermark*; if `sent_at` is at or before the horizon, delete exactly the
//! revision it created and fail with `BeyondHorizon`.
//!
//! Take a record R that prune deleted, and a redelivery of R's message whose
//! claim creates a new record. The message was produced before R's first
//! claim, so `sent_at <= R.created_at`. The create is a revision-checked
//! write that succeeds only on an absent key, so it came after R's delete in
//! the stream's order; the delete came after the raise; the claim reads the
//! watermark after its create was acknowledged, from the stream leader,
//! which has applied every acknowledged write. So the read sees a watermark
//! `>= R.created_at >= sent_at`, and the claim refuses. The other order on
//! either side breaks this: a prune that deleted first could let a claim
//! create, read the old watermark and run before the raise lands; a claim
//! that read first could read the old watermark, then create after the
//! prune.
//!
//! Until the claim's check has finished, its fresh record carries its
//! `sent_at` ([`Stored::hz`](crate::codec::Stored::hz)); the first write by
//! a lease holder clears it. If the claimant never finishes the check (it
//! crashed, its future was dropped, the create's reply was lost, the undo
//! failed), the record stays in progress with that mark until its lease runs
//! out; whoever then would take it over first repeats the check with the
//! watermark of that moment, and if the mark is beyond it, deletes the
//! record and claims the key as absent (with its own `sent_at`, so a replay
//! is refused). The watermark can only have grown since, so this never lets
//! a pruned effect through. An at-most-once record in that state is left
//! alone: it reads as abandoned, for reconciliation, and never runs again
//! anyway. The price: a claimant that passed the check and then died before
//! its first renewal or completion, while a prune raised the watermark above
//! its `sent_at`, loses its record on takeover (its replays are refused
//! rather than resumed).

use std::time::SystemTime;

use oncely::backend::{from_micros, is_beyond_horizon};
use oncely::{EffectKey, Error, Result, Tenant};

use crate::NatsKvLedger;
use crate::codec::{Stored, Watermark, watermark_key};
use crate::error::{corrupt, gave_up};
use crate::kv::{MAX_ATTEMPTS, Write, refusal_backoff};

impl NatsKvLedger {
    /// The instant before which the bucket itself may have dropped records
    /// (`now - max_age`), if its `max_age` is bounded.
    pub(crate) fn aged_out_before(&self, now: SystemTime) -> Option<SystemTime> {
        self.inner.bucket_max_age.and_then(|age| now.checked_sub(age))
    }

    /// The watermark of `tenant` and `kind`, with the revision of its key
    /// (0 when it was never written), read from the stream leader.
    async fn read_watermark(&self, tenant: &Tenant, kind: &str) -> Result<(u64, Option<Watermark>)> {
        let wk = watermark_key(tenant, kind);
        let Some(raw) = self.read_raw(&wk).await? else {
            return Ok((0, None));
        };
        let Some(payload) = raw.payload else {
            // Deleted by hand: the watermark is gone, `max_age` still bounds.
            return Ok((raw.revision, None));
        };
        let w = Watermark::decode(&payload, tenant, kind)
            .map_err(|e| corrupt(format!("value at {wk} is not an oncely horizon watermark: {e}")))?;
        Ok((raw.revision, Some(w)))
    }

    /// The horizon of `tenant` and `kind` at server time `now`: the later of
    /// the watermark and `now - max_age`.
    pub(crate) async fn horizon_at(
        &self,
        tenant: &Tenant,
        kind: &str,
        now: SystemTime,
    ) -> Result<Option<SystemTime>> {
        let (_, w) = self.read_watermark(tenant, kind).await?;
        Ok(w.map(|w| from_micros(w.w_us)).max(self.aged_out_before(now)))
    }

    /// Raises the watermark of `tenant` and `kind` to at least `to_us`.
    /// Prune calls it before deleting a record created at `to_us`.
    pub(crate) async fn raise_watermark(&self, tenant: &Tenant, kind: &str, to_us: i64) -> Result<()> {
        let wk = watermark_key(tenant, kind);
        for _ in 0..MAX_ATTEMPTS {
            let (revision, current) = self.read_watermark(tenant, kind).await?;
            if current.as_ref().is_some_and(|w| w.w_us >= to_us) {
                return Ok(());
            }
            let base = current.map_or(Ok(bytes::Bytes::new()), |w| w.encode())?;
            let value = Watermark {
                v: 1,
                tenant: tenant.as_str().to_owned(),
                kind: kind.to_owned(),
                w_us: to_us,
            };
            // Revision-checked: a concurrent prune that raised it further
            // makes this write fail, and the re-read sees the higher value.
            match self.write_raw(&wk, value.encode()?, revision, &base).await? {
                Write::Done(_) => return Ok(()),
                Write::Conflict => continue,
            }
        }
        Err(gave_up("raise horizon", wk, "lost races"))
    }

    /// The horizon check of a claim that has just created `key`'s record at
    /// `revision`, for a message produced at `sent_at` (module docs: create,
    /// then read). Beyond the horizon, or unable to tell, it deletes exactly
    /// that revision before failing, so a refused claim leaves nothing.
    pub(crate) async fn check_created(
        &self,
        key: &EffectKey,
        kv_key: &str,
        revision: u64,
        created: &Stored,
        sent_at: SystemTime,
        now: SystemTime,
    ) -> Result<()> {
        let horizon = match self.horizon_at(key.tenant(), key.kind(), now).await {
            Ok(h) => h,
            Err(e) => {
                if let Err(undo) = self.undo_create(kv_key, revision, created).await {
                    // The record keeps its `hz` mark: a takeover checks again.
                    tracing::warn!(effect_key = %key, error = %undo, "could not undo an unchecked claim");
                }
                return Err(e);
            }
        };
        if is_beyond_horizon(Some(sent_at), horizon) {
            self.undo_create(kv_key, revision, created).await?;
            return Err(Error::BeyondHorizon { key: key.to_string() });
        }
        Ok(())
    }

    /// Whether a record whose creating claim may not have finished its
    /// horizon check (`hz`: that claim's `sent_at`) must be treated as never
    /// created. `created_at_server` is the record's revision stamp (the
    /// record was not written since its create, or `hz` would be gone).
    pub(crate) async fn unchecked_is_beyond(
        &self,
        key: &EffectKey,
        hz: i64,
        created_at_server: SystemTime,
    ) -> Result<bool> {
        let horizon = self
            .horizon_at(key.tenant(), key.kind(), created_at_server)
            .await?;
        Ok(is_beyond_horizon(Some(from_micros(hz)), horizon))
    }

    /// Deletes `kv_key` if, and only if, its latest revision is `revision`
    /// (the one this ledger just wrote, holding `created`). A record changed
    /// since is no longer this claim's to remove.
    pub(crate) async fn undo_create(&self, kv_key: &str, revision: u64, created: &Stored) -> Result<()> {
        let mut backoff = refusal_backoff();
        for _ in 0..MAX_ATTEMPTS {
            if self.delete(kv_key, revision, created, "undo claim").await? {
                return Ok(());
            }
            // NATS 2.9 clusters can refuse a matching revision under
            // concurrent writes to other keys: look before giving up.
            match self.read_raw(kv_key).await? {
                Some(raw) if raw.revision == revision => {
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                _ => return Ok(()),
            }
        }
        Err(gave_up("undo claim", kv_key, "refused deletes"))
    }
}

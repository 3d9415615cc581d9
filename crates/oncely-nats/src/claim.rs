//! The claim: create the record of an absent key, or take over an expired
//! or released one, each with one revision-checked write; what a record the
//! claim may not take over answers is [`answer_existing`]'s decision.

use std::time::SystemTime;

use oncely::backend::{Claim, RecordState};
use oncely::backend::{Grant, answer_existing, from_micros, is_beyond_horizon, next_fence, to_micros};
use oncely::{ClaimOptions, EffectKey, Error, Result};

use crate::NatsKvLedger;
use crate::clock::{later, server_us};
use crate::codec::{Stored, kv_key, length_us};
use crate::error::gave_up;
use crate::kv::{Current, MAX_ATTEMPTS, Write, refusal_backoff};

impl NatsKvLedger {
    /// Claims `key` (options validated by the caller). A lost race (someone
    /// wrote the key between the read and the write) reads again and
    /// decides again.
    pub(crate) async fn claim_key(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        let kk = kv_key(key);
        // Most claims are of new keys: try the create first. A claim with
        // `sent_at` does too: its horizon check follows the create (see
        // horizon.rs for why that order). A key this ledger just found in
        // progress is read first instead: the claim again is most likely a
        // waiting duplicate's, and a create would only be refused (one
        // round trip saved per look; either order decides the same way).
        let hinted = self.was_in_progress(&kk);
        let mut known: Option<Option<Current>> = if hinted { None } else { Some(None) };
        // The fence of a record this claim removed (below): the new record's
        // fence goes above it whatever the clock estimates say.
        let mut floor: Option<u64> = None;
        // The revision a write was just refused on. Found unchanged by the
        // read after, the winner's write is still on its way (nats-server
        // 2.12 and later refuse a write to a key with another one in
        // flight; on older clusters a marker's copy may be, `marker.rs`):
        // pause before asking again, rather than losing every attempt
        // within a few milliseconds.
        let mut lost_on: Option<u64> = None;
        let mut backoff = refusal_backoff();
        for _ in 0..MAX_ATTEMPTS {
            let cur = match known.take() {
                Some(c) => c,
                None => self.read(&kk).await?,
            };
            if lost_on.is_some() && lost_on == Some(cur.as_ref().map_or(0, |c| c.revision)) {
                tokio::time::sleep(backoff.next_delay()).await;
            }
            // Read before the write is sent, so it is at most the server's
            // time when the write takes effect (the revision's stamp, from
            // which everyone else measures this lease): the lease we report,
            // `now + lease`, ends no later than the one the server enforces,
            // so the runner's deadline and safety margin err on the safe side.
            let now = self.now().await?;
            let (revision, prev) = match cur {
                None => (0, None),
                Some(Current {
                    revision,
                    value: None,
                    ..
                }) => (revision, None),
                Some(Current {
                    revision,
                    at,
                    value: Some(v),
                }) => (revision, Some((at, v))),
            };
            let Some((at, prev)) = prev else {
                match self.create(key, &kk, opts, revision, floor, now).await? {
                    Some(claim) => {
                        if hinted {
                            self.saw_in_progress(&kk, false);
                        }
                        return Ok(claim);
                    }
                    None => {
                        lost_on = Some(revision);
                        continue;
                    }
                }
            };
            prev.effect_key(Some(key))?;
            let now = now.max(at);
            if let Some(answer) = answer_existing(key, opts, prev.record(key.clone(), at, now)?)? {
                self.saw_in_progress(&kk, matches!(answer, Claim::InProgress { .. }));
                return Ok(answer);
            }
            // An expired lease whose creating claim may not have finished its
            // horizon check: if that check fails now, the record should never
            // have existed. Remove it (this revision only) and claim the
            // absent key, with this claim's own `sent_at`.
            if let Some(hz) = prev.hz
                && self.unchecked_is_beyond(key, hz, at).await?
            {
                tracing::warn!(effect_key = %key, "removing a record whose claim was beyond the horizon");
                self.undo_create(&kk, revision, &prev).await?;
                floor = floor.max(Some(prev.fence));
                continue;
            }
            if let Some(claim) = self.take_over(key, &kk, opts, revision, prev, now).await? {
                if hinted {
                    self.saw_in_progress(&kk, false);
                }
                return Ok(claim);
            }
            lost_on = Some(revision);
        }
        Err(gave_up("claim", key, "lost races"))
    }

    /// Creates the record of a key found absent at `revision` (0: never
    /// written), with a fence above `floor`; `None` if the key was written
    /// meanwhile. With `sent_at`, the horizon check follows the create.
    async fn create(
        &self,
        key: &EffectKey,
        kk: &str,
        opts: &ClaimOptions,
        revision: u64,
        floor: Option<u64>,
        now: SystemTime,
    ) -> Result<Option<Claim>> {
        // What the bucket dropped by age needs no round trip to know.
        if is_beyond_horizon(opts.sent_at, self.aged_out_before(now)) {
            return Err(Error::BeyondHorizon { key: key.to_string() });
        }
        let now_us = server_us(now)?;
        let value = Stored {
            v: 1,
            key: key.to_string(),
            state: RecordState::InProgress.as_str().to_owned(),
            // The clock carries the order across prunes: the key's pruned
            // record got its last fence at least its retention ago, on the
            // same clock.
            fence: next_fence(floor, now_us),
            fp: opts.fingerprint.map(|f| f.to_hex()),
            outcome: None,
            amo: opts.at_most_once,
            first_us: now_us,
            lease_us: length_us(opts.lease),
            retention_us: length_us(opts.retention),
            // `validate` has checked it lies in 1970..9999.
            hz: opts.sent_at.map(to_micros).transpose()?,
        };
        let lease = Grant {
            key: key.clone(),
            fence: value.fence,
            expires_at: later(now, opts.lease)?,
            first_claimed_at: now,
            acquired_at: now,
            taken_over: false,
            at_most_once: opts.at_most_once,
        }
        .into_lease();
        // Created on nothing, or on a delete marker (`revision` > 0).
        match self.write(kk, &value, revision, None).await? {
            Write::Done(rev) => {
                if let Some(sent_at) = opts.sent_at {
                    self.check_created(key, kk, rev, &value, sent_at, now).await?;
                }
                self.remember(kk, rev, value);
                Ok(Some(Claim::Acquired(lease)))
            }
            Write::Conflict => Ok(None),
        }
    }

    /// Takes over `prev` (released, or an expired lease), found at
    /// `revision`; `None` if the key was written meanwhile.
    async fn take_over(
        &self,
        key: &EffectKey,
        kk: &str,
        opts: &ClaimOptions,
        revision: u64,
        prev: Stored,
        now: SystemTime,
    ) -> Result<Option<Claim>> {
        let base = prev.clone();
        let value = Stored {
            state: RecordState::InProgress.as_str().to_owned(),
            fence: next_fence(Some(prev.fence), server_us(now)?),
            fp: prev.fp.clone().or_else(|| opts.fingerprint.map(|f| f.to_hex())),
            outcome: None,
            amo: opts.at_most_once,
            lease_us: length_us(opts.lease),
            retention_us: length_us(opts.retention),
            hz: None,
            ..prev
        };
        let lease = Grant {
            key: key.clone(),
            fence: value.fence,
            expires_at: later(now, opts.lease)?,
            first_claimed_at: from_micros(value.first_us),
            acquired_at: now,
            taken_over: true,
            at_most_once: opts.at_most_once,
        }
        .into_lease();
        match self.write(kk, &value, revision, Some(&base)).await? {
            Write::Done(rev) => {
                self.remember(kk, rev, value);
                Ok(Some(Claim::Acquired(lease)))
            }
            Write::Conflict => Ok(None),
        }
    }
}

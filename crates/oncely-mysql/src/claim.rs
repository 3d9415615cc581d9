//! The claim: a plain read, then one statement when a write is due, and
//! what its row means.
//!
//! **Read first.** On the pool a claim first reads the key without a lock
//! (`MySqlLedger::peek`): a duplicate (completed, live lease, abandoned,
//! another fingerprint) is answered from it and nothing is written. Only an
//! absent, released or expired key goes on to the statement below, which
//! decides again on its own. `claim_in` skips the read (its snapshot may
//! be old). See the crate docs, "A duplicate is a read".
//!
//! **Clock after the wait.** A claim's `INSERT` computes a fresh row's values
//! before it waits on the key's row lock (another transaction's uncommitted
//! row of the same key). If that transaction rolls back, the row is inserted
//! with a lease and a fence measured from before the wait; the next claimant
//! could take over at once while this one runs. The statement therefore also
//! returns the clock read after the write (`now_us`), and a fresh grant
//! whose statement waited ([`WAITED`], or less than half its lease left:
//! `backend::needs_refresh`) is refreshed before it is returned: a fenced
//! update gives it a new expiry and a new fence from the clock after the
//! wait. If the key was taken over meanwhile (the stale grant was already
//! committed on the pool), the claim runs again and answers as that claim
//! does. A takeover needs no refresh: `ON DUPLICATE KEY UPDATE` is evaluated
//! after the row lock is granted.
//!
//! **Horizon.** A claim with `sent_at` must fail with `BeyondHorizon` when
//! its key is absent and `sent_at` is at or before the watermark of its
//! tenant and kind ([`oncely::backend::is_beyond_horizon`]). It is decided in
//! two places, both locking (current) reads, so no snapshot taken before a
//! wait can fool them, whatever the session's isolation level:
//!
//! 1. before the insert, in the statement's `WHERE` (`claim_pre`): when the
//!    watermark already covers the message, nothing is inserted (the usual
//!    refusal costs no write). The key may exist though, and then it answers
//!    for itself: a locking read of the key decides, and an existing key is
//!    claimed without the pre-check.
//! 2. after the write, in the same statement (`RETURNING`, or the locking
//!    read-back on MySQL 8): if the row is a fresh insert and the watermark
//!    read *after* it covers the message, the claim deletes its own row
//!    (fenced by its token) and refuses. This catches a prune that deleted
//!    the key while the insert waited on it: the prune raises the watermark
//!    in the transaction that deletes, so it is committed before the insert
//!    can proceed.
//!
//! Check-then-insert alone is not enough at READ COMMITTED (no gap locks: a
//! prune can create the watermark row and delete the key between the check
//! and the insert), and insert-then-check alone would write (and on the
//! pool, commit for a moment) a row for every refused replay; together each
//! covers the other. What remains: on the pool, if the process dies between
//! a refused insert of case 2 and its undo, the row stays as an in-progress
//! lease that the next claim takes over once it expires.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use oncely::backend::{Claim, Lease, RecordState};
use oncely::backend::{
    answer_existing, duration_micros, from_micros, is_beyond_horizon, needs_refresh, to_micros,
};
use oncely::{ClaimOptions, EffectKey, Error};
use sqlx::MySqlConnection;

use crate::MySqlLedger;
use crate::error::{self, corrupt, unexpected_violation};
use crate::guard::{Retry, retry_on_lock};
use crate::row::first;
use crate::sql::{Stored, stored};

/// A fresh grant whose statement took longer than this from its start to
/// its write waited on a lock, and is refreshed (new expiry, new fence), even
/// if more than half its lease is left. Without a lock wait the gap is well
/// under a millisecond, but a refresh changes the fence that concurrent
/// duplicates have already seen, so a loaded server must not trigger it: a
/// second is far above any scheduling delay. A fence written before a
/// shorter wait can only fall below an earlier fence of the key if that key
/// was claimed, completed *and pruned* during the wait, which needs a
/// retention under a second; and even then the fences differ (a stale holder
/// cannot match the new lease).
pub(crate) const WAITED: Duration = Duration::from_secs(1);

static TOKEN_SEQ: AtomicU64 = AtomicU64::new(0);
static TOKEN_SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// A claim token unique to this attempt: a per-process random seed (from the
/// OS-seeded `RandomState`) and a per-process counter.
pub(crate) fn claim_token() -> [u8; 16] {
    let seed = *TOKEN_SEED.get_or_init(|| {
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        h.write_u128(now.as_nanos());
        h.finish()
    });
    let mut t = [0u8; 16];
    t[..8].copy_from_slice(&seed.to_le_bytes());
    t[8..].copy_from_slice(&TOKEN_SEQ.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    t
}

/// One claim attempt: what it claims, and the token it writes.
pub(crate) struct Attempt<'a> {
    pub key: &'a EffectKey,
    pub opts: &'a ClaimOptions,
    pub token: [u8; 16],
    /// `claim_in` on the caller's transaction (no leaked-transaction guard).
    pub in_caller_tx: bool,
}

impl<'a> Attempt<'a> {
    /// A new attempt on the pool, with its own token.
    pub(crate) fn on_pool(key: &'a EffectKey, opts: &'a ClaimOptions) -> Self {
        Attempt {
            key,
            opts,
            token: claim_token(),
            in_caller_tx: false,
        }
    }
}

/// Which claim statement to run.
#[derive(Clone, Copy)]
enum Form {
    /// No `sent_at`.
    Plain,
    /// `sent_at`: insert only after the horizon (µs), return the watermark.
    Pre(i64),
    /// `sent_at` on a key found to exist: no pre-check, return the watermark.
    Post,
}

impl MySqlLedger {
    /// One claim attempt on `conn`. `in_caller_tx`: `claim_in` on the
    /// caller's transaction (no leaked-transaction guard).
    pub(crate) async fn claim_on(
        &self,
        conn: &mut MySqlConnection,
        key: &EffectKey,
        opts: &ClaimOptions,
        in_caller_tx: bool,
    ) -> Result<Claim, Retry> {
        let a = Attempt {
            key,
            opts,
            token: claim_token(),
            in_caller_tx,
        };
        let sent_us = opts.sent_at.map(to_micros).transpose()?;
        // On the pool, read first: a duplicate of a completed effect, of a
        // live lease, of an abandoned step or with another fingerprint is
        // answered by this read alone, without a lock or a write. Only a key
        // that is absent, released or expired goes on to the claim
        // statement, which decides again on its own (a key that appeared or
        // changed since is answered as the statement finds it). Inside the
        // caller's transaction the read could come from an old snapshot, so
        // `claim_in` always runs the statement, whose reads are current.
        let mut exists = false;
        if !in_caller_tx && let Some(row) = self.peek(conn, key).await? {
            if let Some(claim) = answer_existing(key, opts, row.record(Some(key))?)? {
                return Ok(claim);
            }
            exists = true;
        }
        let started = Instant::now();
        let row = match sent_us {
            None => self.claim_statement(conn, &a, Form::Plain).await?,
            // The key was there a moment ago: it answers for itself, so the
            // horizon is only checked after the write (in case a prune
            // removed it meanwhile and this claim inserted it afresh).
            Some(_) if exists => self.claim_statement(conn, &a, Form::Post).await?,
            Some(sent_us) => match self.claim_statement(conn, &a, Form::Pre(sent_us)).await? {
                Some(row) => Some(row),
                // Nothing inserted: beyond the horizon, unless the key exists
                // and answers for itself.
                None if self.read_back(conn, key, in_caller_tx).await?.is_none() => {
                    return Err(Error::BeyondHorizon { key: key.to_string() }.into());
                }
                None => self.claim_statement(conn, &a, Form::Post).await?,
            },
        };
        // Absent right after a claim without the pre-check: either the insert
        // hit another unique index, or a prune removed the row in between.
        // Run it again; if it persists it is the former.
        let Some(row) = row else {
            return Err(Retry::Moved(format!("{key}: claim wrote no row for the key")));
        };
        // How long the statement could have waited at most: what the server
        // measured (statement start to the clock read after the write), but
        // never more than this attempt took here (on MySQL 8 the server's
        // measure also spans the read-back's round trip).
        let took = duration_micros(started.elapsed());
        let waited_us = row.now_us.saturating_sub(row.updated_us).min(took);
        self.interpret(conn, &a, row, waited_us).await
    }

    /// Runs one claim statement (and, without `RETURNING`, its read-back).
    /// `None`: no row for the key (refused by the pre-check, or see
    /// [`MySqlLedger::claim_on`]).
    async fn claim_statement(
        &self,
        conn: &mut MySqlConnection,
        a: &Attempt<'_>,
        form: Form,
    ) -> Result<Option<Stored>, Retry> {
        let Attempt {
            key,
            opts,
            ref token,
            in_caller_tx,
        } = *a;
        let returning = self.inner.returning.load(Ordering::Relaxed);
        let s = self.sql();
        let horizon = !matches!(form, Form::Plain);
        let q = match form {
            Form::Plain => s.bind_claim(returning, key, opts, token),
            Form::Pre(sent_us) => s.bind_claim_pre(returning, key, opts, token, in_caller_tx, sent_us),
            Form::Post => s.bind_claim_h(returning, key, opts, token),
        };
        if returning {
            // Read to the end: on Galera the certification failure of this
            // autocommit statement comes after its row.
            return match q.fetch_all(&mut *conn).await.map(first) {
                Ok(Some(row)) => {
                    let row = stored(&row, true, horizon)?;
                    if !in_caller_tx && row.in_tx && self.heal_if_leaked(conn).await? {
                        return Err(Retry::Leaked);
                    }
                    Ok(Some(row))
                }
                Ok(None) if !in_caller_tx && self.heal_if_leaked(conn).await? => Err(Retry::Leaked),
                Ok(None) if horizon => Ok(None),
                Ok(None) => Err(corrupt("claim returned no row").into()),
                Err(e) if error::number(&e) == Some(1064) && self.inner.returning_pref.is_none() => {
                    // This server parses no ODKU … RETURNING: use the
                    // two-statement path from now on.
                    self.inner.returning.store(false, Ordering::Relaxed);
                    Err(Retry::Moved("RETURNING unsupported".into()))
                }
                Err(e) => Err(retry_on_lock(e)),
            };
        }
        let done = q.execute(&mut *conn).await.map_err(retry_on_lock)?;
        if matches!(form, Form::Pre(_)) && done.rows_affected() == 0 {
            // The WHERE was false: refused by the horizon, or the guard
            // tripped (with CLIENT_FOUND_ROWS an ODKU that changed nothing
            // still reports 1).
            if !in_caller_tx && self.heal_if_leaked(conn).await? {
                return Err(Retry::Leaked);
            }
            return Ok(None);
        }
        let s = self.sql();
        let read = if horizon {
            s.bind_read_back_h(key)
        } else {
            s.bind_read_back(key)
        };
        let read = read
            .fetch_all(&mut *conn)
            .await
            .map(first)
            .map_err(retry_on_lock)?;
        let row = read.map(|r| stored(&r, true, horizon)).transpose()?;
        let leaked = row.as_ref().is_none_or(|r| r.in_tx);
        if !in_caller_tx && leaked && self.heal_if_leaked(conn).await? {
            return Err(Retry::Leaked);
        }
        Ok(row)
    }

    /// The key's row as committed, read without a lock (see
    /// [`Statements::peek`](crate::sql::Statements)). A pooled connection
    /// found inside a transaction someone else left open is healed and the
    /// claim runs again: that transaction's snapshot may be old.
    pub(crate) async fn peek(
        &self,
        conn: &mut MySqlConnection,
        key: &EffectKey,
    ) -> Result<Option<Stored>, Retry> {
        let row = self
            .sql()
            .bind_peek(key)
            .fetch_all(&mut *conn)
            .await
            .map(first)
            .map_err(retry_on_lock)?
            .map(|r| stored(&r, true, false))
            .transpose()?;
        if row.as_ref().is_some_and(|r| r.in_tx) && self.heal_if_leaked(conn).await? {
            return Err(Retry::Leaked);
        }
        Ok(row)
    }

    /// The key's row, read with a lock (a current read, in any snapshot).
    async fn read_back(
        &self,
        conn: &mut MySqlConnection,
        key: &EffectKey,
        in_caller_tx: bool,
    ) -> Result<Option<Stored>, Retry> {
        let row = self
            .sql()
            .bind_read_back(key)
            .fetch_all(&mut *conn)
            .await
            .map(first)
            .map_err(retry_on_lock)?
            .map(|r| stored(&r, true, false))
            .transpose()?;
        if !in_caller_tx && row.as_ref().is_none_or(|r| r.in_tx) && self.heal_if_leaked(conn).await? {
            return Err(Retry::Leaked);
        }
        Ok(row)
    }

    /// What the claim's row means for this attempt.
    pub(crate) async fn interpret(
        &self,
        conn: &mut MySqlConnection,
        a: &Attempt<'_>,
        row: Stored,
        waited_us: i64,
    ) -> Result<Claim, Retry> {
        let Attempt {
            key,
            opts,
            ref token,
            in_caller_tx,
        } = *a;
        if row.key != key.as_str() {
            // RETURNING gave another effect's row: the insert conflicted on a
            // unique index other than the effect key, and the guard kept ODKU
            // from touching it.
            return Err(unexpected_violation(&format!(
                "claiming {key} conflicted with the row of {}",
                row.key
            ))
            .into());
        }
        if !row.ours(token) {
            return match answer_existing(key, opts, row.record(Some(key))?)? {
                Some(claim) => Ok(claim),
                // Takeover-eligible, yet not taken over by this statement:
                // the lease ended between the statement's takeover check and
                // its read of the clock, or (two statements) the row moved
                // after the claim. Claim again.
                None => Err(Retry::Moved(format!(
                    "{key}: the row changed between the claim and its read"
                ))),
            };
        }
        if row.state != RecordState::InProgress {
            return Err(Retry::Moved(format!("{key}: our grant moved on before its read")));
        }
        let fresh = row.fresh();
        if fresh && is_beyond_horizon(opts.sent_at, row.horizon_us.map(from_micros)) {
            self.undo(conn, key, token, row.fence, in_caller_tx).await?;
            return Err(Error::BeyondHorizon { key: key.to_string() }.into());
        }
        let expires = row
            .lease_expires_us
            .ok_or_else(|| corrupt(format!("{key}: in-progress row without a lease")))?;
        let lease = oncely::backend::Grant {
            key: key.clone(),
            fence: row.fence,
            expires_at: from_micros(expires),
            first_claimed_at: from_micros(row.created_us),
            // The clock after the write, not the (possibly pre-wait) time the
            // row says it was written.
            acquired_at: from_micros(row.now_us),
            taken_over: !fresh,
            at_most_once: row.at_most_once,
        }
        .into_lease();
        if fresh && (waited_us > duration_micros(WAITED) || needs_refresh(&lease, opts.lease)) {
            return self.refresh(conn, a, lease).await;
        }
        Ok(Claim::Acquired(lease))
    }

    /// Rewrites a fresh grant's expiry and fence from the clock now (after
    /// the wait), fenced by the claim's token and fence.
    async fn refresh(
        &self,
        conn: &mut MySqlConnection,
        a: &Attempt<'_>,
        stale: Lease,
    ) -> Result<Claim, Retry> {
        let Attempt {
            opts,
            ref token,
            in_caller_tx,
            ..
        } = *a;
        tracing::debug!(effect_key = %stale.key(), fence = stale.fence(),
            "claim waited on a lock after computing its grant; refreshing it");
        let done = self
            .sql()
            .bind_refresh(
                duration_micros(opts.lease),
                stale.key(),
                token,
                stale.fence(),
                in_caller_tx,
            )
            .execute(&mut *conn)
            .await
            .map_err(retry_on_lock)?;
        if done.rows_affected() == 0 {
            if !in_caller_tx && self.heal_if_leaked(conn).await? {
                return Err(Retry::Leaked);
            }
            // Someone took the stale grant over before we could refresh it.
            return Err(Retry::Moved(format!(
                "{}: a stale grant was taken over before its refresh",
                stale.key()
            )));
        }
        let row = self.read_back(conn, stale.key(), in_caller_tx).await?;
        let Some(row) = row.filter(|r| r.ours(token) && r.state == RecordState::InProgress) else {
            return Err(Retry::Moved(format!(
                "{}: a refreshed grant was taken over before its read",
                stale.key()
            )));
        };
        let expires = row
            .lease_expires_us
            .ok_or_else(|| corrupt(format!("{}: in-progress row without a lease", stale.key())))?;
        Ok(Claim::Acquired(
            oncely::backend::Grant {
                fence: row.fence,
                expires_at: from_micros(expires),
                acquired_at: from_micros(row.updated_us),
                ..oncely::backend::Grant::from(&stale)
            }
            .into_lease(),
        ))
    }

    /// Deletes the claim's own fresh row (a claim that found, after its
    /// insert, that the key is beyond the horizon).
    async fn undo(
        &self,
        conn: &mut MySqlConnection,
        key: &EffectKey,
        token: &[u8; 16],
        fence: u64,
        in_caller_tx: bool,
    ) -> Result<(), Retry> {
        let done = self
            .sql()
            .bind_undo(key, token, fence, in_caller_tx)
            .execute(&mut *conn)
            .await
            .map_err(retry_on_lock)?;
        if done.rows_affected() == 0 && !in_caller_tx && self.heal_if_leaked(conn).await? {
            return Err(Retry::Leaked);
        }
        // 0 rows otherwise: the row was taken over meanwhile (its lease
        // expired); it is no longer ours to delete.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_unique() {
        let a = claim_token();
        let b = claim_token();
        assert_ne!(a, b);
        assert_eq!(a[..8], b[..8]);
    }
}

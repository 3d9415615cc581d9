//! Batches: `claim_many` and `complete_many` as statements over arrays
//! (`sql::Queries::claim_many`, `complete_many`), up to [`CLAIM_BATCH`]
//! distinct keys each, and the resolution of a batch whose answer was lost.
//! A key or lease listed twice is sent once; the later listings are
//! answered by the kit's rule (`oncely::backend::repeated_claim`,
//! `repeated_completion`).

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use oncely::backend::{Claim, Lease, MAX_OUTCOME_BYTES, Outcome};
use oncely::backend::{
    answer_existing, check_outcome, copy_error, earlier_listings, repeated_claim, repeated_completion,
    to_micros,
};
use oncely::{ClaimOptions, EffectKey, Error, Result};
use sqlx::PgConnection;

use crate::PgLedger;
use crate::error;
use crate::guard::{self, Run};
use crate::ledger::resolving;
use crate::sql::{self, ClaimRow};
use crate::token::Attempt;

/// Most distinct keys one `claim_many` statement carries: it holds one
/// advisory lock per key until it ends, in the same shared lock table as
/// prune (`ledger.rs`); a larger batch runs as several statements on one
/// connection, each as atomic as a single claim.
const CLAIM_BATCH: usize = 500;

impl PgLedger {
    /// [`PgLedger::resolve_claim`] for the keys of a batch whose answer was
    /// lost (`answers[n]` is [`Error::Unavailable`]): they are claimed again
    /// together, with the batch's token, until each has an answer or the
    /// window ends; a key still unanswered then keeps its first error.
    pub(crate) async fn resolve_batch(
        &self,
        keys: &[EffectKey],
        opts: &ClaimOptions,
        attempt: &Attempt,
        answers: &mut [Result<Claim>],
    ) {
        let mut attempts = resolving(self.inner.operation_timeout);
        loop {
            let lost: Vec<usize> = (0..keys.len())
                .filter(|&n| matches!(answers[n], Err(Error::Unavailable { .. })))
                .collect();
            if lost.is_empty() {
                return;
            }
            let subset: Vec<EffectKey> = lost.iter().map(|&n| keys[n].clone()).collect();
            let again = self
                .bounded_for(
                    attempts.left(),
                    self.claim_batches(&subset, opts, &attempt.again()),
                )
                .await;
            let mut unavailable = false;
            match again {
                Ok(again) => {
                    for (&n, answer) in lost.iter().zip(again) {
                        match answer {
                            Err(Error::Unavailable { .. }) => unavailable = true,
                            answer => answers[n] = answer,
                        }
                    }
                }
                Err(Error::Unavailable { .. }) => unavailable = true,
                Err(e) => {
                    for &n in &lost {
                        answers[n] = Err(copy_error(&e));
                    }
                }
            }
            if unavailable && !attempts.again().await {
                return;
            }
        }
    }

    /// Claims the distinct keys `keys[n]` for `n` in `chunk` with one
    /// statement, run again (through the same retry loop and its limit as
    /// one claim) only for the keys that did not settle, and writes each
    /// key's answer into `answers[n]`.
    async fn claim_chunk(
        &self,
        conn: &mut PgConnection,
        keys: &[EffectKey],
        chunk: &[usize],
        opts: &ClaimOptions,
        attempt: &Attempt,
        answers: &mut [Option<Result<Claim>>],
    ) {
        let sent_at = match opts.sent_at.map(to_micros).transpose() {
            Ok(sent_at) => sent_at,
            Err(e) => return fill(answers, chunk, &e),
        };
        let what = || format!("a batch of {} claims", chunk.len());
        let state = (chunk.to_vec(), answers);
        let ((pending, answers), settled) = guard::retry_on(
            conn,
            true,
            what,
            state,
            |conn, (mut pending, answers)| async move {
                let run = async {
                    let batch: Vec<&EffectKey> = pending.iter().map(|&n| &keys[n]).collect();
                    let query =
                        self.inner
                            .q
                            .bind_claim_many(&batch, opts, attempt.token().as_bytes(), sent_at);
                    attempt.sending();
                    let rows = query.fetch_all(&mut *conn).await?;
                    // The guard is one for the statement: every row says so.
                    if rows.iter().any(sql::claim_leaked) {
                        return Ok(Run::Leaked);
                    }
                    if rows.len() != pending.len() {
                        return Err(error::corrupt(format!(
                            "a batch of {} claims answered {} rows",
                            pending.len(),
                            rows.len()
                        ))
                        .into());
                    }
                    let index: HashMap<&str, usize> =
                        pending.iter().map(|&n| (keys[n].as_str(), n)).collect();
                    let mut again = Vec::new();
                    for row in &rows {
                        let stored = sql::claimed_key(row)?;
                        let Some(&n) = index.get(stored.as_str()) else {
                            return Err(error::corrupt(format!(
                                "a batch claim answered a key it was not given: {stored:?}"
                            ))
                            .into());
                        };
                        let key = &keys[n];
                        let answer = match ClaimRow::decode(key, row)? {
                            ClaimRow::Leaked => return Ok(Run::Leaked),
                            ClaimRow::Beyond => Err(Error::BeyondHorizon { key: key.to_string() }),
                            ClaimRow::Missing => {
                                again.push(n);
                                continue;
                            }
                            ClaimRow::Acquired(lease) => Ok(Claim::Acquired(lease)),
                            // As for one claim: this call's own row is its lease,
                            // and `None` is a record that could be taken over by
                            // now; that key is claimed again.
                            ClaimRow::Existing(record, own) => {
                                match own.then(|| sql::own_lease(&record, opts.lease)) {
                                    Some(Some(lease)) => Ok(Claim::Acquired(lease)),
                                    _ => match answer_existing(key, opts, record) {
                                        Ok(Some(claim)) => Ok(claim),
                                        Ok(None) => {
                                            again.push(n);
                                            continue;
                                        }
                                        Err(e) => Err(e),
                                    },
                                }
                            }
                        };
                        answers[n] = Some(answer);
                    }
                    pending = again;
                    Ok(if pending.is_empty() {
                        Run::Done(())
                    } else {
                        Run::Again
                    })
                }
                .await;
                (conn, (pending, answers), run)
            },
        )
        .await;
        if let Err(e) = settled {
            fill(answers, &pending, &e);
        }
    }

    /// Completes the leases `items[n]` for `n` in `send` (distinct (key,
    /// fence) pairs, outcomes checked) with one statement; `Ok` with the
    /// completed pairs.
    async fn complete_batch(
        &self,
        conn: &mut PgConnection,
        items: &[(Lease, Outcome)],
        send: &[usize],
    ) -> Result<Vec<(String, i64, bool)>> {
        let keys: Vec<&str> = send.iter().map(|&n| items[n].0.key().as_str()).collect();
        let fences: Vec<i64> = send
            .iter()
            .map(|&n| i64::try_from(items[n].0.fence()).unwrap_or(i64::MAX))
            .collect();
        let outcomes: Vec<&[u8]> = send.iter().map(|&n| items[n].1.as_bytes()).collect();
        let (keys, fences, outcomes) = (&keys, &fences, &outcomes);
        guard::retry(
            conn,
            true,
            || format!("a batch of {} completions", send.len()),
            |conn| async move {
                let run = async {
                    let rows = self
                        .inner
                        .q
                        .bind_complete_many(keys, fences, outcomes)
                        .fetch_all(&mut *conn)
                        .await?;
                    if !rows.iter().all(|r| sql::guard_ok(r).unwrap_or(false)) {
                        return Ok(Run::Leaked);
                    }
                    let mut done = Vec::with_capacity(rows.len());
                    for r in &rows {
                        if let Some((key, fence)) = sql::completed(r)? {
                            done.push((key, fence, sql::watched(r)?));
                        }
                    }
                    Ok(Run::Done(done))
                }
                .await;
                (conn, run)
            },
        )
        .await
    }

    pub(crate) async fn claim_batches(
        &self,
        keys: &[EffectKey],
        opts: &ClaimOptions,
        attempt: &Attempt,
    ) -> Result<Vec<Result<Claim>>> {
        // A `sent_at` the ledger cannot store fails the whole batch, before
        // any round trip.
        opts.sent_at.map(to_micros).transpose()?;
        // A key listed again is not sent: it gets what the same claim made
        // right after its first listing would (`repeated_claim`).
        let mut distinct = Vec::with_capacity(keys.len());
        let mut repeats = Vec::new();
        for (n, earlier) in earlier_listings(keys.iter().map(EffectKey::as_str))
            .into_iter()
            .enumerate()
        {
            match earlier {
                Some(f) => repeats.push((n, f)),
                None => distinct.push(n),
            }
        }
        // In key order, so overlapping batches reach their common rows in
        // the same order too (their locks are ordered by the statement).
        distinct.sort_unstable_by(|&a, &b| keys[a].as_str().cmp(keys[b].as_str()));
        let mut answers: Vec<Option<Result<Claim>>> = (0..keys.len()).map(|_| None).collect();
        if !distinct.is_empty() {
            match self.acquire().await {
                Ok(mut conn) => {
                    for chunk in distinct.chunks(CLAIM_BATCH) {
                        self.claim_chunk(&mut conn, keys, chunk, opts, attempt, &mut answers)
                            .await;
                    }
                }
                Err(e) => fill(&mut answers, &distinct, &e),
            }
        }
        for (n, f) in repeats {
            let answer = match &answers[f] {
                Some(first) => repeated_claim(first),
                None => Err(error::corrupt("a batch claim left a key unanswered")),
            };
            answers[n] = Some(answer);
        }
        Ok(answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(error::corrupt("a batch claim left a key unanswered"))))
            .collect())
    }

    pub(crate) async fn complete_batches(&self, items: &[(Lease, Outcome)]) -> Vec<Result<()>> {
        let lost = |lease: &Lease| Error::LeaseLost {
            key: lease.key().to_string(),
            fence: lease.fence(),
        };
        let mut answers: Vec<Option<Result<()>>> = (0..items.len()).map(|_| None).collect();
        let mut first: HashMap<(&str, u64), usize> = HashMap::with_capacity(items.len());
        let mut send = Vec::with_capacity(items.len());
        let mut repeats = Vec::new();
        for (n, (lease, outcome)) in items.iter().enumerate() {
            if let Err(e) = check_outcome(outcome, MAX_OUTCOME_BYTES).and_then(|()| self.writable()) {
                answers[n] = Some(Err(e));
            } else if i64::try_from(lease.fence()).is_err() {
                answers[n] = Some(Err(lost(lease)));
            } else {
                match first.entry((lease.key().as_str(), lease.fence())) {
                    Entry::Occupied(f) => repeats.push((n, *f.get())),
                    Entry::Vacant(v) => {
                        v.insert(n);
                        send.push(n);
                    }
                }
            }
        }
        send.sort_unstable_by(|&a, &b| items[a].0.key().as_str().cmp(items[b].0.key().as_str()));
        if !send.is_empty() {
            let done = match self.acquire().await {
                Ok(mut conn) => self.complete_batch(&mut conn, items, &send).await,
                Err(e) => Err(e),
            };
            match done {
                Ok(done) => {
                    let done: HashMap<(&str, i64), bool> =
                        done.iter().map(|(k, f, w)| ((k.as_str(), *f), *w)).collect();
                    for &n in &send {
                        let lease = &items[n].0;
                        let fence = i64::try_from(lease.fence()).unwrap_or(i64::MAX);
                        answers[n] = Some(if let Some(&watched) = done.get(&(lease.key().as_str(), fence)) {
                            self.inner.changes.finished(lease.key().as_str(), watched);
                            Ok(())
                        } else {
                            Err(lost(lease))
                        });
                    }
                }
                Err(e) => fill(&mut answers, &send, &e),
            }
        }
        for (n, f) in repeats {
            answers[n] = Some(match &answers[f] {
                Some(first) => repeated_completion(first, &items[n].0),
                None => Err(lost(&items[n].0)),
            });
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(error::corrupt("a batch completion left a lease unanswered"))))
            .collect()
    }
}

/// Writes a copy of `e` as the answer of every `n` in `pending`.
fn fill<T>(answers: &mut [Option<Result<T>>], pending: &[usize], e: &Error) {
    for &n in pending {
        answers[n] = Some(Err(copy_error(e)));
    }
}

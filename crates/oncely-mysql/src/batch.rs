//! Batches: `claim_many` and `complete_many` in the fewest round trips
//! MySQL and MariaDB allow, each key answered exactly as its own claim (or
//! completion) would be.
//!
//! **`claim_many`**, per chunk of up to [`CHUNK`] distinct keys:
//!
//! 1. one plain read of every key
//!    ([`Statements::peek_many`](crate::sql::Statements::peek_many)): no
//!    lock, no write. A completed record, a live lease, an abandoned step or another
//!    fingerprint is answered from it, by the kit's rules
//!    (`backend::answer_existing`), as a single claim's read would be.
//! 2. with `sent_at` only, one plain read of the watermarks of the absent
//!    keys' tenants and kinds: an absent key at or before its watermark is
//!    refused (`BeyondHorizon`) without a write.
//! 3. one claim statement for every key left (absent, released, expired),
//!    one `VALUES` row each, sorted by key, each with its own claim token
//!    ([`Statements::claim_many`](crate::sql::Statements::claim_many)): the
//!    very statement a single claim runs, so it decides every row again on its own (insert, take over, or find
//!    it taken meanwhile), with the clock after any lock wait. MariaDB
//!    returns every row (`RETURNING`), in `VALUES` order; MySQL 8 reads them
//!    back with a locking read (one more round trip).
//! 4. each row is then interpreted as a single claim's row is (token, fresh
//!    or taken over, horizon after the write, the refresh of a grant that
//!    waited on a lock): `MySqlLedger::interpret`.
//!
//! So a batch costs one round trip when every key is a duplicate, two when
//! some need a write (three on MySQL 8, one more with `sent_at`), whatever
//! its size. There is no single statement that does it all: InnoDB locks
//! (and assigns a transaction to) every row an `INSERT` finds, so a
//! statement that both inserts the new keys and reports the existing ones
//! would lock the duplicates, which is what step 1 avoids.
//!
//! A key listed twice is claimed once: the later listings get what the same
//! claim made right after the first would (`oncely::backend::repeated_claim`:
//! a grant to the first listing is `InProgress` to the others, a refusal is
//! the same refusal). A rare case falls back to the single claim, for that
//! key only: a row that moved between the statement and its interpretation.
//!
//! **`complete_many`**: one `UPDATE` per chunk, each row fenced by its own
//! lease (`fence = CASE effect_key …`). When it matches every lease, that is
//! the answer (one round trip); when it matches fewer, one plain read tells
//! which rows this statement completed: each carries the call's token. On
//! a Galera node a lease that missed is completed on its own afterwards,
//! which tells a lease lost from a grant this node had not yet applied.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime};

use oncely::backend::{Claim, Lease, Outcome};
use oncely::backend::{
    answer_existing, check_outcome, copy_error, duration_micros, earlier_listings, fail_each, from_micros,
    is_beyond_horizon, repeated_claim, repeated_completion,
};
use oncely::{ClaimOptions, EffectKey, Error, Result};
use sqlx::MySqlConnection;

use crate::MySqlLedger;
use crate::claim::{Attempt, claim_token};
use crate::error::{self, corrupt, lease_lost, map};
use crate::guard::{Retry, retry_on_lock};
use crate::sql::{Settled, Stored, Watermark, stored};

/// The most keys (or leases) one statement carries: ten parameters a key,
/// far below the 65,535 a prepared statement takes, and a statement short
/// enough that a lock wait on one row delays few others.
pub(crate) const CHUNK: usize = 500;

/// One key's answer from a batch attempt; `None`: claim this key on its
/// own (its row moved under the batch).
type Slot = Option<Result<Claim>>;

impl MySqlLedger {
    /// `Ledger::claim_many` on the pool (options already validated).
    pub(crate) async fn claim_batch(&self, keys: &[EffectKey], opts: &ClaimOptions) -> Vec<Result<Claim>> {
        // The first listing of each key is claimed; later ones are answered
        // from it (`repeated_claim`). `first[i]`: slot `i`'s key in `distinct`.
        let earlier = earlier_listings(keys.iter().map(EffectKey::as_str));
        let mut distinct: Vec<EffectKey> = Vec::with_capacity(keys.len());
        let mut first: Vec<usize> = Vec::with_capacity(keys.len());
        for (k, e) in keys.iter().zip(&earlier) {
            match e {
                Some(e) => first.push(first[*e]),
                None => {
                    first.push(distinct.len());
                    distinct.push(k.clone());
                }
            }
        }
        let mut answers: Vec<Option<Result<Claim>>> = Vec::with_capacity(distinct.len());
        for chunk in distinct.chunks(CHUNK) {
            let (chunk_keys, chunk_opts) = (chunk.to_vec(), opts.clone());
            let slots = self
                .on_pool(move |this, conn| {
                    let (keys, opts) = (chunk_keys.clone(), chunk_opts.clone());
                    Box::pin(async move { this.claim_chunk(conn, &keys, &opts).await })
                })
                .await;
            match slots {
                Ok(slots) => {
                    for (slot, key) in slots.into_iter().zip(chunk) {
                        answers.push(Some(match slot {
                            Some(answer) => answer,
                            None => self.claim_alone(key, opts).await,
                        }));
                    }
                }
                Err(e) => answers.extend(fail_each(e, chunk.len()).into_iter().map(Some)),
            }
        }
        // Later listings first, while the first listings' answers are there
        // to read; then move the first listings' answers out.
        let mut out: Vec<Option<Result<Claim>>> = earlier
            .iter()
            .zip(&first)
            .map(|(e, &d)| e.and(answers[d].as_ref()).map(repeated_claim))
            .collect();
        for (i, e) in earlier.iter().enumerate() {
            if e.is_none() {
                out[i] = answers[first[i]].take();
            }
        }
        let out: Vec<Result<Claim>> = out
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(corrupt("claim_many: a key was left unanswered"))))
            .collect();
        for answer in &out {
            if let Ok(Claim::Acquired(lease)) = answer {
                self.held_here(lease);
            }
        }
        out
    }

    /// A single claim on the pool, for a key the batch could not answer.
    async fn claim_alone(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        let (key, opts) = (key.clone(), opts.clone());
        self.on_pool(move |this, conn| {
            let (key, opts) = (key.clone(), opts.clone());
            Box::pin(async move { this.claim_on(conn, &key, &opts, false).await })
        })
        .await
    }

    /// One attempt at a chunk of distinct keys, on one pooled connection. A
    /// `Retry` other than `Fail` means nothing of this attempt was
    /// committed (a lock error rolled the statement back; a leaked
    /// transaction was rolled back), so the whole chunk runs again.
    async fn claim_chunk(
        &self,
        conn: &mut MySqlConnection,
        keys: &[EffectKey],
        opts: &ClaimOptions,
    ) -> Result<Vec<Slot>, Retry> {
        let mut slots: Vec<Option<Slot>> = keys.iter().map(|_| None).collect();

        // 1. Read every key: duplicates are answered here.
        let rows = self
            .sql()
            .bind_peek_many(keys)
            .fetch_all(&mut *conn)
            .await
            .map_err(retry_on_lock)?;
        let mut found: HashMap<String, Stored> = HashMap::with_capacity(rows.len());
        for r in &rows {
            let row = stored(r, true, false)?;
            found.insert(row.key.clone(), row);
        }
        if found.values().any(|r| r.in_tx) && self.heal_if_leaked(conn).await? {
            return Err(Retry::Leaked);
        }
        let mut writes: Vec<usize> = Vec::new();
        let mut absent: Vec<usize> = Vec::new();
        let mut is_absent = vec![false; keys.len()];
        for (i, k) in keys.iter().enumerate() {
            match found.remove(k.as_str()) {
                Some(row) => match row.record(Some(k)).and_then(|r| answer_existing(k, opts, r)) {
                    Ok(Some(claim)) => slots[i] = Some(Some(Ok(claim))),
                    Err(e) => slots[i] = Some(Some(Err(e))),
                    Ok(None) => writes.push(i),
                },
                None => {
                    writes.push(i);
                    absent.push(i);
                    is_absent[i] = true;
                }
            }
        }

        // 2. With `sent_at`: an absent key the horizon covers is refused
        // before anything is written.
        if opts.sent_at.is_some() && !absent.is_empty() {
            let marks = self.watermarks(conn, keys, &absent).await?;
            writes.retain(|&i| {
                let k = &keys[i];
                let covered = is_absent[i]
                    && is_beyond_horizon(
                        opts.sent_at,
                        marks.get(&(k.tenant().as_str(), k.kind())).copied().flatten(),
                    );
                if covered {
                    slots[i] = Some(Some(Err(Error::BeyondHorizon { key: k.to_string() })));
                }
                !covered
            });
        }

        // 3. One statement for every key left, in key order.
        if !writes.is_empty() {
            writes.sort_by(|&a, &b| keys[a].as_str().cmp(keys[b].as_str()));
            let attempts: Vec<Attempt<'_>> =
                writes.iter().map(|&i| Attempt::on_pool(&keys[i], opts)).collect();
            let started = Instant::now();
            let rows = self.write_rows(conn, opts, &attempts).await?;
            let took = duration_micros(started.elapsed());

            // 4. Each row as a single claim's row.
            for ((&i, a), row) in writes.iter().zip(&attempts).zip(rows) {
                let Some(row) = row else {
                    slots[i] = Some(None);
                    continue;
                };
                let waited_us = row.now_us.saturating_sub(row.updated_us).min(took);
                slots[i] = Some(match self.interpret(conn, a, row, waited_us).await {
                    Ok(claim) => Some(Ok(claim)),
                    Err(Retry::Fail(e)) => Some(Err(e)),
                    // Our writes are committed: never rerun the chunk from here.
                    Err(Retry::Lock(_) | Retry::Moved(_) | Retry::Leaked | Retry::Behind(_)) => None,
                });
            }
        }
        Ok(slots.into_iter().map(Option::flatten).collect())
    }

    /// The watermarks (plain read) of the tenants and kinds of `keys[absent]`.
    async fn watermarks<'k>(
        &self,
        conn: &mut MySqlConnection,
        keys: &'k [EffectKey],
        absent: &[usize],
    ) -> Result<HashMap<(&'k str, &'k str), Option<SystemTime>>, Retry> {
        let pairs: Vec<(&str, &str)> = absent
            .iter()
            .map(|&i| (keys[i].tenant().as_str(), keys[i].kind()))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        let rows = self
            .sql()
            .bind_watermarks(&pairs)
            .fetch_all(&mut *conn)
            .await
            .map_err(retry_on_lock)?;
        let mut marks: HashMap<(&str, &str), Option<SystemTime>> = pairs.iter().map(|p| (*p, None)).collect();
        for r in &rows {
            let Watermark {
                tenant,
                kind,
                watermark_us,
            } = Watermark::read(r)?;
            if let Some(pair) = pairs.iter().find(|(t, k)| *t == tenant && *k == kind) {
                marks.insert(*pair, watermark_us.map(from_micros));
            }
        }
        Ok(marks)
    }

    /// Runs the claim statement for `attempts`, all with `opts` (and,
    /// without `RETURNING`, its read-back); one row per attempt, in order
    /// (`None`: no row for that key).
    async fn write_rows(
        &self,
        conn: &mut MySqlConnection,
        opts: &ClaimOptions,
        attempts: &[Attempt<'_>],
    ) -> Result<Vec<Option<Stored>>, Retry> {
        let returning = self.inner.returning.load(Ordering::Relaxed);
        let horizon = attempts.first().is_some_and(|a| a.opts.sent_at.is_some());
        let rows: Vec<(&EffectKey, &[u8; 16])> = attempts.iter().map(|a| (a.key, &a.token)).collect();
        let q = self.sql().bind_claim_many(returning, horizon, opts, &rows);
        if returning {
            let rows = match q.fetch_all(&mut *conn).await {
                Ok(rows) => rows,
                Err(e) if error::number(&e) == Some(1064) && self.inner.returning_pref.is_none() => {
                    // This server parses no ODKU … RETURNING (see the single
                    // claim): nothing was written; run it the other way.
                    self.inner.returning.store(false, Ordering::Relaxed);
                    return Err(Retry::Moved("RETURNING unsupported".into()));
                }
                Err(e) => return Err(retry_on_lock(e)),
            };
            let rows: Vec<Stored> = rows
                .iter()
                .map(|r| stored(r, true, horizon))
                .collect::<Result<_>>()?;
            if rows.iter().any(|r| r.in_tx) && self.heal_if_leaked(conn).await? {
                return Err(Retry::Leaked);
            }
            // One row per `VALUES` row, in order; a row of another key means
            // the insert hit another unique index (`interpret` reports it).
            let mut rows = rows.into_iter();
            return Ok(attempts.iter().map(|_| rows.next()).collect());
        }
        q.execute(&mut *conn).await.map_err(retry_on_lock)?;
        let keys: Vec<&EffectKey> = attempts.iter().map(|a| a.key).collect();
        let rows = self
            .sql()
            .bind_read_back_many(horizon, &keys)
            .fetch_all(&mut *conn)
            .await
            .map_err(retry_on_lock)?;
        let mut by_key: HashMap<String, Stored> = HashMap::with_capacity(rows.len());
        for r in &rows {
            let row = stored(r, true, horizon)?;
            by_key.insert(row.key.clone(), row);
        }
        if (by_key.is_empty() || by_key.values().any(|r| r.in_tx)) && self.heal_if_leaked(conn).await? {
            return Err(Retry::Leaked);
        }
        Ok(attempts.iter().map(|a| by_key.remove(a.key.as_str())).collect())
    }

    /// `Ledger::complete_many` on the pool: one answer per lease, in order.
    pub(crate) async fn complete_batch(&self, items: &[(Lease, Outcome)]) -> Vec<Result<()>> {
        let mut answers: Vec<Option<Result<()>>> = items.iter().map(|_| None).collect();
        if let Err(e) = self.writable("complete_many") {
            return fail_each(e, items.len());
        }
        let max = self.max_outcome_bytes();
        // Which items go into the statements: the first lease of each key
        // with an outcome that fits. The same lease listed again is answered
        // from its first listing (`repeated_completion`); another lease of a
        // key already listed completes on its own afterwards, as it would if
        // completed after the first (the statement can fence a key by one
        // fence only).
        let mut seen: HashMap<&str, (u64, usize)> = HashMap::with_capacity(items.len());
        let mut batch: Vec<usize> = Vec::with_capacity(items.len());
        let mut later: Vec<usize> = Vec::new();
        let mut repeats: Vec<(usize, usize)> = Vec::new();
        for (i, (lease, outcome)) in items.iter().enumerate() {
            if let Err(e) = check_outcome(outcome, max) {
                answers[i] = Some(Err(e));
                continue;
            }
            match seen.get(lease.key().as_str()) {
                Some(&(fence, f)) if fence == lease.fence() => repeats.push((i, f)),
                Some(_) => later.push(i),
                None => {
                    seen.insert(lease.key().as_str(), (lease.fence(), i));
                    batch.push(i);
                }
            }
        }
        for chunk in self.complete_chunks(items, &batch) {
            let work: Vec<(Lease, Outcome)> = chunk.iter().map(|&i| items[i].clone()).collect();
            let done = self
                .on_pool(move |this, conn| {
                    let work = work.clone();
                    Box::pin(async move { this.complete_chunk(conn, &work).await })
                })
                .await;
            match done {
                Ok(done) => {
                    for (&i, ok) in chunk.iter().zip(done) {
                        if !ok && self.inner.causal.load(Ordering::Relaxed) {
                            // On Galera the grant may not be applied here
                            // yet: the lease's own completion decides.
                            later.push(i);
                            continue;
                        }
                        // Either way the lease ended (or was already gone).
                        self.ended_here(&items[i].0);
                        answers[i] = Some(if ok { Ok(()) } else { Err(lease_lost(&items[i].0)) });
                    }
                }
                Err(e) => {
                    for &i in &chunk {
                        answers[i] = Some(Err(copy_error(&e)));
                    }
                }
            }
        }
        for i in later {
            let (lease, outcome) = &items[i];
            answers[i] = Some(oncely::backend::Ledger::complete(self, lease, outcome).await);
        }
        for (i, f) in repeats {
            let again = answers[f]
                .as_ref()
                .map(|first| repeated_completion(first, &items[i].0));
            answers[i] = again;
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(corrupt("complete_many: a lease was left unanswered"))))
            .collect()
    }

    /// `batch` (indexes into `items`) in chunks of at most [`CHUNK`] leases
    /// whose outcomes together fit one packet with room to spare.
    fn complete_chunks(&self, items: &[(Lease, Outcome)], batch: &[usize]) -> Vec<Vec<usize>> {
        let budget = self.inner.packet_budget.load(Ordering::Relaxed).max(1);
        let mut chunks: Vec<Vec<usize>> = Vec::new();
        let mut current: Vec<usize> = Vec::new();
        let mut bytes = 0usize;
        for &i in batch {
            let size = items[i].1.len() + items[i].0.key().as_str().len() * 3 + 64;
            if !current.is_empty() && (current.len() == CHUNK || bytes + size > budget) {
                chunks.push(std::mem::take(&mut current));
                bytes = 0;
            }
            current.push(i);
            bytes += size;
        }
        if !current.is_empty() {
            chunks.push(current);
        }
        chunks
    }

    /// One `UPDATE` for leases of distinct keys; `true` per lease it
    /// completed.
    async fn complete_chunk(
        &self,
        conn: &mut MySqlConnection,
        work: &[(Lease, Outcome)],
    ) -> Result<Vec<bool>, Retry> {
        let token = claim_token();
        let done = self
            .sql()
            .bind_complete_many(&token, work)
            .execute(&mut *conn)
            .await
            .map_err(retry_on_lock)?;
        // sqlx sets CLIENT_FOUND_ROWS: this is the number of rows matched.
        if done.rows_affected() == work.len() as u64 {
            return Ok(vec![true; work.len()]);
        }
        if self.heal_if_leaked(conn).await? {
            return Err(Retry::Leaked);
        }
        // Some leases missed: the rows this statement completed carry its
        // token (a plain read after our commit sees them).
        let rows = self
            .sql()
            .bind_settled(work.iter().map(|(lease, _)| lease))
            .fetch_all(&mut *conn)
            .await
            .map_err(map)?;
        let mut ours: HashSet<(String, u64)> = HashSet::with_capacity(rows.len());
        for r in &rows {
            let row = Settled::read(r)?;
            if row.state == "completed" && row.token.as_slice() == token.as_slice() {
                ours.insert((row.key, row.fence));
            }
        }
        Ok(work
            .iter()
            .map(|(l, _)| ours.contains(&(l.key().as_str().to_owned(), l.fence())))
            .collect())
    }
}

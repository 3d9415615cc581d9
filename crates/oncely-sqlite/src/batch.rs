//! Batches: [`claim_many`] and [`complete_many`] inside one `BEGIN
//! IMMEDIATE` transaction that the caller opens and commits, each one
//! statement over a JSON array of the batch (`sql::Queries::claim_many`,
//! `complete_many`), so a batch of 100 costs one write lock and one commit
//! instead of 100 (one fsync under `synchronous=FULL`).
//!
//! Every slot gets the answer a claim (or completion) of its own would have
//! given at that moment: the statements apply the single claim's rules per
//! key, and what a found record answers is decided by the same kit function
//! ([`answer_existing`]).

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};

use oncely::backend::{Claim, Lease, Outcome};
use oncely::backend::{answer_existing, from_micros, is_beyond_horizon, repeated_completion};
use oncely::{ClaimOptions, EffectKey, Error, Result};
use sqlx::Row;
use sqlx::sqlite::{SqliteConnection, SqliteRow};

use crate::error::{BACKEND, map};
use crate::sql::{self, Found, Queries};

/// The keys as the batch statements read them (`sql::BATCH_KEYS`): a JSON
/// array of `[key, tenant, kind, subject]`.
fn keys_json<'a>(keys: impl Iterator<Item = &'a EffectKey>) -> Result<String> {
    let parts: Vec<[&str; 4]> = keys
        .map(|k| [k.as_str(), k.tenant().as_str(), k.kind(), k.subject()])
        .collect();
    Ok(serde_json::to_string(&parts)?)
}

/// Claims `keys` on `conn`, inside the caller's `BEGIN IMMEDIATE`
/// transaction: one answer per key, in order. `Err` means the transaction
/// failed and must not be committed.
///
/// Each pass runs the batch claim over the slots still unanswered, then
/// reads the records of the slots that did not acquire. Inside the
/// transaction no one else writes, so a second pass only happens when the
/// clock moved between the two statements (a lease that expired in
/// between is taken over, as a claim of its own would).
pub(crate) async fn claim_many(
    conn: &mut SqliteConnection,
    q: &Queries,
    keys: &[EffectKey],
    opts: &ClaimOptions,
    sent_at: Option<i64>,
) -> Result<Vec<Result<Claim>>> {
    let mut answers: Vec<Option<Result<Claim>>> = keys.iter().map(|_| None).collect();
    let mut pending: Vec<usize> = (0..keys.len()).collect();
    for _ in 0..8 {
        if pending.is_empty() {
            break;
        }
        let claim = q.bind_claim_many(keys_json(pending.iter().map(|&i| &keys[i]))?, opts, sent_at);
        let rows = claim.fetch_all(&mut *conn).await.map_err(map)?;
        // Grants by key; a key can only be granted once per statement (its
        // first slot's lease is live for the rest of it), but if it were
        // granted twice the lower fence goes to the earlier slot.
        let mut granted: HashMap<String, VecDeque<(i64, SqliteRow)>> = HashMap::new();
        for row in rows {
            let key: String = row.try_get("key").map_err(map)?;
            let fence: i64 = row.try_get("fence").map_err(map)?;
            granted.entry(key).or_default().push_back((fence, row));
        }
        for grants in granted.values_mut() {
            grants.make_contiguous().sort_by_key(|(fence, _)| *fence);
        }
        let mut rest = Vec::new();
        for &i in &pending {
            match granted.get_mut(keys[i].as_str()).and_then(VecDeque::pop_front) {
                Some((_, row)) => answers[i] = Some(sql::lease(&keys[i], opts, &row).map(Claim::Acquired)),
                None => rest.push(i),
            }
        }
        pending.clear();
        if rest.is_empty() {
            break;
        }
        let rows = q
            .bind_claim_many_read(keys_json(rest.iter().map(|&i| &keys[i]))?)
            .fetch_all(&mut *conn)
            .await
            .map_err(map)?;
        for row in rows {
            let slot: i64 = row.try_get("slot").map_err(map)?;
            let Some(&i) = usize::try_from(slot).ok().and_then(|s| rest.get(s)) else {
                return Err(crate::error::corrupt(format!("batch read returned slot {slot}")));
            };
            let key = &keys[i];
            answers[i] = match sql::found(&row) {
                Err(e) => Some(Err(e)),
                // The claim statement compared microseconds; so does this.
                Ok(Found::Absent { watermark }) => {
                    if is_beyond_horizon(sent_at.map(from_micros), watermark.map(from_micros)) {
                        Some(Err(Error::BeyondHorizon { key: key.to_string() }))
                    } else {
                        pending.push(i);
                        None
                    }
                }
                Ok(Found::Record(record)) => match answer_existing(key, opts, record) {
                    Ok(None) => {
                        pending.push(i);
                        None
                    }
                    other => other.transpose(),
                },
            };
        }
        // The read's rows come in no promised order; slots claim in theirs.
        pending.sort_unstable();
    }
    Ok(keys
        .iter()
        .zip(answers)
        .map(|(key, answer)| {
            answer.unwrap_or_else(|| {
                Err(Error::Backend {
                    backend: BACKEND,
                    message: format!("{key}: the record kept changing during the claim"),
                    retryable: true,
                })
            })
        })
        .collect())
}

/// Completes `items` on `conn`, inside the caller's `BEGIN IMMEDIATE`
/// transaction: one answer per item, in order, each fenced by its own lease.
/// Items whose answer is already known (`answers[i]` is `Some`: an outcome
/// refused before any round trip) are skipped. `Err` means the transaction
/// failed and must not be committed.
pub(crate) async fn complete_many(
    conn: &mut SqliteConnection,
    q: &Queries,
    items: &[(Lease, Outcome)],
    mut answers: Vec<Option<Result<()>>>,
) -> Result<Vec<Result<()>>> {
    // A lease listed twice is sent once (one statement must not offer
    // SQLite two updates of one row); the later listings are answered from
    // the first by the kit's rule (`repeated_completion`).
    let mut first: HashMap<(&str, u64), usize> = HashMap::new();
    let mut repeats = Vec::new();
    let mut sent = Vec::new();
    let mut outcomes = Vec::new();
    let mut parts: Vec<(&str, i64, usize, usize)> = Vec::new();
    for (i, (lease, outcome)) in items.iter().enumerate() {
        if answers[i].is_some() {
            continue;
        }
        match first.entry((lease.key().as_str(), lease.fence())) {
            Entry::Occupied(f) => {
                repeats.push((i, *f.get()));
                continue;
            }
            Entry::Vacant(v) => {
                v.insert(i);
            }
        }
        let bytes = outcome.as_bytes();
        parts.push((
            lease.key().as_str(),
            sql::fence_param(lease.fence()),
            outcomes.len() + 1,
            bytes.len(),
        ));
        outcomes.extend_from_slice(bytes);
        sent.push(i);
    }
    if !sent.is_empty() {
        let rows = q
            .bind_complete_many(serde_json::to_string(&parts)?, outcomes)
            .fetch_all(&mut *conn)
            .await
            .map_err(map)?;
        let mut done = std::collections::HashSet::new();
        for row in rows {
            let key: String = row.try_get("key").map_err(map)?;
            let fence: i64 = row.try_get("fence").map_err(map)?;
            done.insert((key, fence));
        }
        for i in sent {
            let lease = &items[i].0;
            let completed = done.contains(&(lease.key().to_string(), sql::fence_param(lease.fence())));
            answers[i] = Some(if completed { Ok(()) } else { Err(lease_lost(lease)) });
        }
    }
    for (i, f) in repeats {
        let first = answers[f].as_ref().expect("a first listing is answered");
        answers[i] = Some(repeated_completion(first, &items[i].0));
    }
    Ok(answers
        .into_iter()
        .map(|a| a.expect("every item is answered"))
        .collect())
}

fn lease_lost(lease: &Lease) -> Error {
    Error::LeaseLost {
        key: lease.key().to_string(),
        fence: lease.fence(),
    }
}

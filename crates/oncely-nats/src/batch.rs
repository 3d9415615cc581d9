//! Batches: `claim_many` and `complete_many`, pipelined on the one
//! connection.
//!
//! JetStream has no multi-key conditional write, so a batch is the single
//! operations run concurrently: their requests go out back to back on the
//! connection and their acknowledgements come back as the stream applies
//! them, so a batch of 100 new keys costs about one round trip plus the
//! server's time for 100 writes, not 100 round trips. Each key runs the
//! single claim's code (`claim.rs`) unchanged, so every rule it keeps holds
//! per key: create first, the horizon check after the create (and the undo
//! of exactly that revision), fences from the clock's lower bound read
//! before the write, the `hz` recheck before a takeover, and a lost race
//! read again and decided again.
//!
//! A key listed more than once is claimed once per occurrence, one after the
//! other in list order: the first occurrence acquires (or answers what the
//! record says) and the later ones then find the record it left, as single
//! claims made in that order would. Run concurrently instead, either
//! occurrence could win the create.

use std::collections::HashMap;
use std::future::Future;

use futures_util::StreamExt;
use oncely::backend::check_outcome;
use oncely::backend::{Claim, Lease, Outcome};
use oncely::{ClaimOptions, EffectKey, Result};

use crate::NatsKvLedger;

/// How many distinct keys of one batch are in flight at once: enough to
/// fill the connection with a consumer's fetch of a few hundred messages,
/// few enough that a huge batch does not queue thousands of requests (each
/// with its own timeout) behind each other.
const IN_FLIGHT: usize = 128;

impl NatsKvLedger {
    /// `claim_many` once the options were checked: one answer per key, in
    /// order.
    pub(crate) async fn claim_batch(&self, keys: &[EffectKey], opts: &ClaimOptions) -> Vec<Result<Claim>> {
        let groups = by_key(keys.iter().map(EffectKey::as_str));
        pipelined(keys.len(), groups, |i| self.claim_key(&keys[i], opts)).await
    }

    /// `complete_many`: each lease completed as [`oncely::backend::Ledger::complete`]
    /// would (its outcome checked before any round trip, fenced by its own
    /// lease), one answer per lease, in order; then the completed keys'
    /// waiters are woken, with one notification for the batch.
    pub(crate) async fn complete_batch(&self, items: &[(Lease, Outcome)]) -> Vec<Result<()>> {
        let groups = by_key(items.iter().map(|(lease, _)| lease.key().as_str()));
        let answers = pipelined(items.len(), groups, |i| async move {
            let (lease, outcome) = &items[i];
            check_outcome(outcome, oncely::backend::MAX_OUTCOME_BYTES)?;
            self.writable("complete")?;
            self.complete_quietly(lease, outcome).await
        })
        .await;
        let mut done: Vec<&EffectKey> = Vec::with_capacity(items.len());
        for ((lease, _), answer) in items.iter().zip(&answers) {
            if answer.is_ok() {
                done.push(lease.key());
            }
        }
        self.inner.notifications.finished_many(done).await;
        answers
    }
}

/// The positions of `keys`, grouped by key in order of first occurrence.
fn by_key<'a>(keys: impl Iterator<Item = &'a str>) -> Vec<Vec<usize>> {
    let mut group_of: HashMap<&str, usize> = HashMap::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, key) in keys.enumerate() {
        let g = *group_of.entry(key).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[g].push(i);
    }
    groups
}

/// Runs `op` on every position: groups concurrently (at most [`IN_FLIGHT`]
/// at once), the positions of one group one after the other. The answers
/// come back in position order.
async fn pipelined<T, F, Fut>(n: usize, groups: Vec<Vec<usize>>, op: F) -> Vec<T>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = T>,
{
    let op = &op;
    let mut runs = futures_util::stream::iter(groups.into_iter().map(|group| async move {
        let mut out = Vec::with_capacity(group.len());
        for i in group {
            out.push((i, op(i).await));
        }
        out
    }))
    .buffer_unordered(IN_FLIGHT);
    let mut slots: Vec<Option<T>> = std::iter::repeat_with(|| None).take(n).collect();
    while let Some(done) = runs.next().await {
        for (i, answer) in done {
            slots[i] = Some(answer);
        }
    }
    // Every position is in exactly one group, and every group ran to its end.
    slots.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_keep_first_occurrence_order() {
        let keys = ["a", "b", "a", "c", "b", "a"];
        assert_eq!(
            by_key(keys.iter().copied()),
            vec![vec![0, 2, 5], vec![1, 4], vec![3]]
        );
        assert!(by_key(std::iter::empty()).is_empty());
    }

    #[tokio::test]
    async fn answers_come_back_in_position_order() {
        let groups = by_key(["x", "y", "x", "z"].into_iter());
        let seen = std::sync::Mutex::new(Vec::new());
        let out = pipelined(4, groups, |i| {
            let seen = &seen;
            async move {
                tokio::task::yield_now().await;
                seen.lock().unwrap().push(i);
                i * 10
            }
        })
        .await;
        assert_eq!(out, vec![0, 10, 20, 30]);
        let seen = seen.into_inner().unwrap();
        let pos = |i| seen.iter().position(|&s| s == i).unwrap();
        assert!(pos(0) < pos(2), "a key's occurrences run in order: {seen:?}");
    }
}

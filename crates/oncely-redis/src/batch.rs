//! Batches: `claim_many` and `complete_many`, one script call per slot, all
//! of a batch's calls at once (one round trip on one server, one per master
//! on a cluster, in parallel).

use std::collections::{BTreeMap, HashMap};
use std::time::SystemTime;

use oncely::backend::{Claim, Lease, Outcome};
use oncely::backend::{check_outcome, copy_error, from_micros, to_micros};
use oncely::{ClaimOptions, EffectKey, Error, Result};
use redis::{Cmd, Script, Value};

use crate::RedisLedger;
use crate::conn::Conn;
use crate::error::{task_failed, unexpected};
use crate::keys::slot;
use crate::ledger::{Acks, Answer, call, fenced_answer, read_only, replies};
use crate::lua::{self, CLAIM, ClaimItem, FENCED, FencedItem};

impl RedisLedger {
    /// Claims `keys`, one answer per key in the order given, each exactly as
    /// [`Ledger::claim`](oncely::backend::Ledger::claim) would answer it (a key listed twice: the first
    /// acquires, the second finds it in progress). One call of the claim
    /// script per slot, the calls of all slots at once: on one server one
    /// call and one round trip for the whole batch; on a cluster one round
    /// trip per master, in parallel (see the crate docs, Batches). The outer
    /// error is only for invalid options.
    ///
    /// Every rule of a single claim holds, the horizon included: on one
    /// server each key's script reads its watermark with its insert; on a
    /// cluster the keys that inserted with `sent_at` are checked after their
    /// inserts (each watermark read once) and taken back beyond it, and the
    /// batch then runs as a task of its own, so that a dropped future never
    /// leaves an unchecked insert behind. A key whose record may never have
    /// finished its horizon check is claimed on its own afterwards.
    pub async fn claim_many(&self, keys: &[EffectKey], opts: &ClaimOptions) -> Result<Vec<Result<Claim>>> {
        opts.validate()?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        if self.opts.read_only {
            return Ok(keys.iter().map(|_| Err(read_only("claim"))).collect());
        }
        if self.is_cluster() && opts.sent_at.is_some() {
            let (ledger, keys, opts) = (self.clone(), keys.to_vec(), opts.clone());
            return tokio::spawn(async move { ledger.claim_batch(&keys, &opts).await })
                .await
                .map_err(|e| task_failed("claim_many", e))?;
        }
        self.claim_batch(keys, opts).await
    }

    async fn claim_batch(&self, keys: &[EffectKey], opts: &ClaimOptions) -> Result<Vec<Result<Claim>>> {
        let sent_at = opts.sent_at.map(to_micros).transpose()?;
        let rkeys: Vec<String> = keys.iter().map(|k| self.redis_key(k)).collect();
        let hkeys: Vec<Option<String>> = keys
            .iter()
            .map(|k| sent_at.map(|_| self.horizon_key(k.tenant(), k.kind())))
            .collect();
        let in_script = !self.is_cluster();
        let groups = self.groups(rkeys.iter().map(String::as_str));
        let waiter = self.notes.waiter(opts);
        let touch = self.opts.wait.is_some();
        let cmds: Vec<Cmd> = groups
            .iter()
            .map(|group| {
                // One server: the watermarks go with the records, each once.
                let mut horizons: Vec<&str> = Vec::new();
                let items: Vec<ClaimItem<'_>> = group
                    .iter()
                    .map(|&i| ClaimItem {
                        rkey: &rkeys[i],
                        key: &keys[i],
                        horizon: hkeys[i].as_deref().filter(|_| in_script).map(|h| {
                            horizons.iter().position(|x| *x == h).unwrap_or_else(|| {
                                horizons.push(h);
                                horizons.len() - 1
                            })
                        }),
                        floor: None,
                    })
                    .collect();
                lua::claim(&items, &horizons, opts, sent_at, waiter, touch)
            })
            .collect();
        let slots = groups.iter().map(|g| slot(&rkeys[g[0]])).collect();
        let replies = self.call_all(&CLAIM, cmds, slots).await;
        let mut answers: Vec<Option<Result<Claim>>> = keys.iter().map(|_| None).collect();
        // What WAIT counted for each key's call.
        let mut acks = vec![Acks::NotAsked; keys.len()];
        let mut settle = Vec::new();
        let mut unchecked = Vec::new();
        for (group, reply) in groups.iter().zip(replies) {
            let parts = match reply {
                Ok((parts, got)) if parts.len() == group.len() => {
                    for &i in group {
                        acks[i] = got;
                    }
                    parts
                }
                other => {
                    let e = other
                        .err()
                        .unwrap_or_else(|| unexpected("a batch reply of another length"));
                    for &i in group {
                        answers[i] = Some(Err(copy_error(&e)));
                    }
                    continue;
                }
            };
            for (&i, parts) in group.iter().zip(parts) {
                match self.answer(&keys[i], &rkeys[i], opts, hkeys[i].as_deref(), in_script, &parts) {
                    Answer::Done(a) => answers[i] = Some(a),
                    Answer::Settle(lease) => settle.push((i, lease)),
                    Answer::Unchecked { .. } => unchecked.push(i),
                }
            }
        }
        if let Some(us) = sent_at {
            // After every insert of the batch: each watermark once.
            let mut marks: HashMap<&str, Result<Option<SystemTime>>> = HashMap::new();
            for (i, lease) in settle {
                let hkey = hkeys[i].as_deref().unwrap_or_default();
                if !marks.contains_key(hkey) {
                    marks.insert(hkey, self.watermark(hkey).await);
                }
                answers[i] = Some(match &marks[hkey] {
                    Ok(w) if !oncely::backend::is_beyond_horizon(Some(from_micros(us)), *w) => {
                        Ok(Claim::Acquired(lease))
                    }
                    Ok(_) => {
                        self.undo(&lease, us).await;
                        Err(Error::BeyondHorizon {
                            key: keys[i].to_string(),
                        })
                    }
                    Err(e) => {
                        self.undo(&lease, us).await;
                        Err(copy_error(e))
                    }
                });
            }
        }
        // Short of replicas: not granted, not answered from (rare; one
        // give-back at a time).
        if self.opts.wait.is_some() {
            for (answer, acks) in answers.iter_mut().zip(&acks) {
                if let Some(a) = answer.take() {
                    *answer = Some(self.acked_claim(a, *acks).await);
                }
            }
        }
        // Rare: records to check again first; one after the other, in order,
        // so a key listed twice still acquires once.
        for i in unchecked {
            answers[i] = Some(self.claim_once(&keys[i], opts).await);
        }
        Ok(answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(unexpected("a batch without an answer"))))
            .collect())
    }

    /// Completes each lease with its outcome, one answer per lease in the
    /// order given, each exactly as [`Ledger::complete`](oncely::backend::Ledger::complete) would answer it
    /// (fenced by its own lease; a stale one fails in its own slot). One
    /// call of the completion script per slot, all at once, as
    /// [`RedisLedger::claim_many`] claims.
    pub async fn complete_many(&self, items: &[(Lease, Outcome)]) -> Vec<Result<()>> {
        let mut answers: Vec<Option<Result<()>>> = items
            .iter()
            .map(|(_, outcome)| {
                let checked = self
                    .writable("complete")
                    .and_then(|()| check_outcome(outcome, oncely::backend::MAX_OUTCOME_BYTES));
                checked.err().map(Err)
            })
            .collect();
        let todo: Vec<usize> = (0..items.len()).filter(|&i| answers[i].is_none()).collect();
        let rkeys: Vec<String> = items.iter().map(|(l, _)| self.redis_key(l.key())).collect();
        let groups: Vec<Vec<usize>> = self
            .groups(todo.iter().map(|&i| rkeys[i].as_str()))
            .into_iter()
            .map(|g| g.into_iter().map(|j| todo[j]).collect())
            .collect();
        let cmds: Vec<Cmd> = groups
            .iter()
            .map(|group| {
                let fenced: Vec<FencedItem<'_>> = group
                    .iter()
                    .map(|&i| FencedItem {
                        rkey: &rkeys[i],
                        key: items[i].0.key(),
                        fence: items[i].0.fence(),
                        arg: items[i].1.as_bytes(),
                    })
                    .collect();
                lua::fenced("complete", &fenced, self.notes.mark(), self.notes.channel(), None)
            })
            .collect();
        let slots = groups.iter().map(|g| slot(&rkeys[g[0]])).collect();
        let replies = self.call_all(&FENCED, cmds, slots).await;
        for (group, reply) in groups.iter().zip(replies) {
            match reply {
                Ok((parts, acks)) if parts.len() == group.len() => {
                    for (&i, parts) in group.iter().zip(parts) {
                        let (lease, _) = &items[i];
                        let done = fenced_answer(lease.key(), lease.fence(), &rkeys[i], parts).map(drop);
                        if done.is_ok() {
                            self.notes.notify(lease.key());
                        }
                        answers[i] =
                            Some(done.and_then(|()| self.replicated(acks, "completion", lease.key())));
                    }
                }
                other => {
                    let e = other
                        .err()
                        .unwrap_or_else(|| unexpected("a batch reply of another length"));
                    for &i in group {
                        answers[i] = Some(Err(copy_error(&e)));
                    }
                }
            }
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(unexpected("a batch without an answer"))))
            .collect()
    }

    /// The indexes of `rkeys` grouped by slot, in order within each group:
    /// one group on a single server (any keys may share a script call), one
    /// per hash slot on a cluster (a script's keys must share one).
    fn groups<'a>(&self, rkeys: impl Iterator<Item = &'a str>) -> Vec<Vec<usize>> {
        if !self.is_cluster() {
            let all: Vec<usize> = rkeys.enumerate().map(|(i, _)| i).collect();
            return if all.is_empty() { Vec::new() } else { vec![all] };
        }
        let mut slots: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
        for (i, rkey) in rkeys.enumerate() {
            slots.entry(slot(rkey)).or_default().push(i);
        }
        slots.into_values().collect()
    }

    /// Sends `cmds` (calls of `script`, on the records of `slots`) all at
    /// once, one reply each, in order, each with what `WAIT` counted after
    /// it when the ledger waits for replicas. On a cluster each goes to its
    /// slot's master as a task of its own: the cluster connection pipelines
    /// those bound for one master, so the batch costs one round trip per
    /// master, in parallel.
    async fn call_all(
        &self,
        script: &'static Script,
        cmds: Vec<Cmd>,
        slots: Vec<u16>,
    ) -> Vec<Result<(Vec<Vec<Value>>, Acks)>> {
        let wait = self.opts.wait;
        let send = |conn: Conn, cmd: Cmd, slot: u16| async move {
            match wait {
                None => Ok((call(&conn, script, &cmd).await?, Acks::NotAsked)),
                Some(wait) => {
                    let (reply, got) = lua::run_and_wait(&conn, script, &cmd, wait, slot).await?;
                    Ok((replies(reply)?, Acks::Got(got)))
                }
            }
        };
        if cmds.len() <= 1 {
            let mut replies = Vec::with_capacity(1);
            for (cmd, slot) in cmds.into_iter().zip(slots) {
                replies.push(send(self.conn.clone(), cmd, slot).await);
            }
            return replies;
        }
        let tasks: Vec<_> = cmds
            .into_iter()
            .zip(slots)
            .map(|(cmd, slot)| tokio::spawn(send(self.conn.clone(), cmd, slot)))
            .collect();
        let mut replies = Vec::with_capacity(tasks.len());
        for task in tasks {
            replies.push(task.await.unwrap_or_else(|e| Err(task_failed("batch", e))));
        }
        replies
    }
}

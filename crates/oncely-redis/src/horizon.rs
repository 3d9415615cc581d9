//! The horizon, both sides: prune raises a tenant and kind's watermark and
//! only then deletes ([`RedisLedger::prune_page`]); a cluster claim reads
//! the watermark after its insert and takes the insert back if it is beyond
//! it ([`RedisLedger::settle_horizon`], [`RedisLedger::undo`]), and a claim
//! that finds a record whose check never finished checks again before it
//! takes it over ([`RedisLedger::recheck`]). On one server the claim script
//! reads the watermark itself (claim.lua) and only the prune side applies.
//! The argument for the order of these steps is written once, on
//! [`RedisLedger::settle_horizon`].

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use oncely::backend::Lease;
use oncely::backend::{Attempts, Backoff, from_micros, is_beyond_horizon, retry, to_micros};
use oncely::{EffectKey, Error, Result, Tenant};
use redis::Value;

use crate::RedisLedger;
use crate::conn::Conn;
use crate::error::{BACKEND, map_err, task_failed, unexpected};
use crate::lua::{HORIZON, PRUNE};
use crate::reply::{Due, array, corrupt, tag, text};

/// How often a cluster claim tries to take back an insert that turned out to
/// be beyond the horizon, on retryable errors, before it gives up and logs.
const UNDO_ATTEMPTS: u32 = 4;

/// The pauses between those attempts: 50, 100, 200 ms.
fn undo_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(50), Duration::from_millis(200))
}

impl RedisLedger {
    /// Reads a horizon watermark: `None` where nothing was ever pruned.
    pub(crate) async fn watermark(&self, hkey: &str) -> Result<Option<SystemTime>> {
        let bad = |what: String| Error::Corrupt {
            backend: BACKEND,
            message: format!("{hkey}: {what}"),
        };
        let mut conn = self.conn.clone();
        match redis::cmd("GET").arg(hkey).query_async::<Value>(&mut conn).await {
            Ok(Value::Nil) => Ok(None),
            Ok(v) => text(&v)
                .and_then(|s| s.parse::<i64>().ok())
                .map(|us| Some(from_micros(us)))
                .ok_or_else(|| bad(format!("horizon key holds {v:?}, not a watermark"))),
            Err(e) if e.code() == Some("WRONGTYPE") => {
                Err(bad("horizon key holds another type, not a watermark".into()))
            }
            Err(e) => Err(map_err(e)),
        }
    }

    /// The cluster half of the horizon check, for a claim with `sent_at`
    /// that inserted a new record: reads the watermark of the key's tenant
    /// and kind (another slot, so not in the claim's script) and, if the
    /// message is at or before it, takes the insert back and fails with
    /// [`Error::BeyondHorizon`]. A watermark that cannot be read takes the
    /// insert back too and fails with that error (fail closed: the
    /// redelivery claims again and checks again).
    ///
    /// Why this order cannot let a pruned effect run again: prune raises the
    /// watermark to at least a record's creation time and only *then*
    /// deletes the record (each step acknowledged before the next is sent).
    /// A replay's claim either runs its script before that delete, and
    /// finds the record (completed: the stored outcome, nothing runs), or
    /// after it; then the raise was acknowledged before the delete, the
    /// delete before the insert, and the insert before this read, so this
    /// read sees the raised watermark and refuses. Reading before the insert
    /// would leave a gap: prune could raise and delete between the read and
    /// the insert.
    ///
    /// A claim that never gets here (its reply lost, or its task gone) leaves
    /// its record marked with its `sent_at`, and so does one whose take-back
    /// fails; [`RedisLedger::recheck`] checks such a record again before
    /// anyone takes it over. A claim that passes leaves the mark too: its
    /// lease holder's first write clears it, at no extra round trip.
    pub(crate) async fn settle_horizon(&self, lease: Lease, hkey: &str, sent_us: i64) -> Result<Lease> {
        let watermark = self.watermark(hkey).await;
        if let Ok(w) = &watermark
            && !is_beyond_horizon(Some(from_micros(sent_us)), *w)
        {
            return Ok(lease);
        }
        self.undo(&lease, sent_us).await;
        match watermark {
            Ok(_) => Err(Error::BeyondHorizon {
                key: lease.key().to_string(),
            }),
            Err(e) => Err(e),
        }
    }

    /// Repeats the horizon check of the cluster claim that inserted `key`'s
    /// record, before anyone takes that expired record over: the record
    /// still carries the claim's `sent_at` (`hz`), so nobody knows that the
    /// check passed (the claim's reply may have been lost after the insert
    /// was applied, or its take-back may have failed). `fence`, `created`
    /// and `hz` are what the claim script found.
    ///
    /// Beyond the horizon, the record should never have existed: it is
    /// deleted, and the caller claims the key as absent (with its own
    /// `sent_at`, if it has one, checked like any insert's; a replay of the
    /// same message is refused). Otherwise its mark is cleared and the
    /// caller takes it over. Both writes are fenced on exactly that record
    /// (fenced.lua: in progress, its fence, creation time and mark), so one
    /// taken over meanwhile, or renewed by a holder that was only slow, is
    /// left alone, and the caller's next attempt answers for it.
    ///
    /// Why this keeps a pruned effect from running again: this read of the
    /// watermark follows the insert (the claim script found the record), so
    /// it sees at least what the inserting claim's own check would have
    /// seen, and [`RedisLedger::settle_horizon`]'s argument applies as is.
    /// A watermark that cannot be read fails the claim closed, with the
    /// record unchanged. An at-most-once record never gets here (it is
    /// never taken over: it reads as abandoned).
    pub(crate) async fn recheck(&self, key: &EffectKey, fence: u64, created: i64, hz: &str) -> Result<()> {
        let sent_us: i64 = hz.parse().map_err(|_| Error::Corrupt {
            backend: BACKEND,
            message: format!("{}: horizon mark {hz:?} is not a time", self.redis_key(key)),
        })?;
        let watermark = self
            .watermark(&self.horizon_key(key.tenant(), key.kind()))
            .await?;
        let beyond = is_beyond_horizon(Some(from_micros(sent_us)), watermark);
        let op = if beyond { "undo" } else { "checked" };
        let created = created.to_string();
        match self
            .fenced(key, fence, op, &[created.as_bytes(), hz.as_bytes()])
            .await
        {
            Ok(_) => {
                if beyond {
                    tracing::warn!(
                        effect_key = %key,
                        fence,
                        "removed a record whose claim was beyond the horizon and never finished its check"
                    );
                }
                Ok(())
            }
            Err(Error::LeaseLost { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Deletes the record a claim just inserted, if it is still exactly that
    /// record (fenced by the lease, its creation time and its mark, the
    /// claim's `sent_at`), retrying transient errors a few times. Failures
    /// are logged: the caller fails its claim either way, and the record
    /// left behind keeps its mark, so whoever would take it over checks the
    /// horizon again first ([`RedisLedger::recheck`]).
    pub(crate) async fn undo(&self, lease: &Lease, sent_us: i64) {
        let created = match to_micros(lease.first_claimed_at()) {
            Ok(us) => us.to_string(),
            Err(e) => {
                tracing::error!(key = %lease.key(), error = %e, "cannot take back a claim beyond the horizon");
                return;
            }
        };
        let hz = sent_us.to_string();
        let args = [created.as_bytes(), hz.as_bytes()];
        let undone = retry(
            Attempts::new(undo_backoff()).at_most(UNDO_ATTEMPTS),
            Error::is_retryable,
            || self.fenced(lease.key(), lease.fence(), "undo", &args),
        )
        .await;
        match undone {
            // Lost: no longer the record this claim wrote (taken over
            // after its lease ended), so nothing of ours to take back.
            Ok(_) | Err(Error::LeaseLost { .. }) => {}
            Err(e) => {
                tracing::error!(
                    key = %lease.key(),
                    fence = lease.fence(),
                    error = %e,
                    "cannot take back a claim beyond the horizon; its record stays in progress \
                     until its lease ends, and whoever would take it over then checks the horizon again"
                );
            }
        }
    }

    /// Prunes what is due among one `SCAN` page's keys, at most `budget`
    /// records: first raises the horizon of each tenant and kind to the
    /// newest creation time it will delete there, then deletes (see
    /// [`RedisLedger::settle_horizon`] for why in this order). A raise that
    /// fails stops prune before it deletes anything of that page.
    pub(crate) async fn prune_page(&self, conn: &mut Conn, keys: Vec<String>, budget: u64) -> Result<u64> {
        // One check per key, all of a page at once: they share the
        // multiplexed connection, so they travel pipelined rather than one
        // round trip after another (prune visits every record).
        let mut checks = tokio::task::JoinSet::new();
        for rkey in keys {
            let mut conn = conn.clone();
            checks.spawn(async move {
                let reply: Value = PRUNE
                    .key(&rkey)
                    .arg("")
                    .arg("check")
                    .invoke_async(&mut conn)
                    .await
                    .map_err(map_err)?;
                Ok::<_, Error>((rkey, reply))
            });
        }
        let mut due = Vec::new();
        while let Some(done) = checks.join_next().await {
            let (rkey, reply) = done.map_err(|e| task_failed("prune check", e))??;
            let parts = array(reply)?;
            if tag(&parts)? != "due" {
                continue;
            }
            let Due { key: stored, created } = Due::decode(&parts)?;
            match EffectKey::parse(&stored) {
                Ok(key) if self.redis_key(&key) == rkey => due.push((rkey, key, created)),
                _ => tracing::warn!(key = %rkey, "record stored under another key; not pruned"),
            }
        }
        due.truncate(usize::try_from(budget).unwrap_or(usize::MAX));
        let mut marks: HashMap<(Tenant, String), i64> = HashMap::new();
        for (_, key, created) in &due {
            let mark = marks
                .entry((key.tenant().clone(), key.kind().to_owned()))
                .or_insert(*created);
            *mark = (*mark).max(*created);
        }
        for ((tenant, kind), mark) in &marks {
            let hkey = self.horizon_key(tenant, kind);
            let reply: Value = HORIZON
                .key(&hkey)
                .arg(*mark)
                .invoke_async(conn)
                .await
                .map_err(map_err)?;
            let parts = array(reply)?;
            match tag(&parts)? {
                "ok" => {}
                "corrupt" => return Err(corrupt(&hkey, &parts)),
                other => return Err(unexpected(other)),
            }
        }
        let mut deleted = 0;
        for (rkey, key, _) in &due {
            let mark = marks[&(key.tenant().clone(), key.kind().to_owned())];
            let reply: Value = PRUNE
                .key(rkey)
                .arg(key.as_str())
                .arg("delete")
                .arg(mark)
                .invoke_async(conn)
                .await
                .map_err(map_err)?;
            if tag(&array(reply)?)? == "deleted" {
                deleted += 1;
            }
        }
        Ok(deleted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RedisLedgerOptions;
    use crate::lua::ClaimItem;
    use crate::reply::grant;
    use oncely::ClaimOptions;
    use oncely::backend::Grant;
    use oncely::backend::{Claim, Ledger};

    /// The pauses the take-back loop used to compute by hand (50 ms,
    /// doubling, for the attempts that follow a failure).
    #[test]
    fn undo_pauses_double_from_50_ms() {
        let mut b = undo_backoff();
        let pauses: Vec<_> = (1..UNDO_ATTEMPTS).map(|_| b.next_delay()).collect();
        assert_eq!(
            pauses,
            [50, 100, 200].map(Duration::from_millis).to_vec(),
            "one pause between each two of {UNDO_ATTEMPTS} attempts"
        );
    }

    /// Inserts `key`'s record as a cluster claim with `sent_us` does, before
    /// its horizon check (on any server: without the watermark in the
    /// script, the record carries the mark).
    async fn insert_marked(ledger: &RedisLedger, key: &EffectKey, lease: Duration, sent_us: i64) -> Lease {
        let opts = ClaimOptions::default()
            .lease(lease)
            .retention(Duration::from_secs(3600));
        let rkey = ledger.redis_key(key);
        let item = ClaimItem {
            rkey: &rkey,
            key,
            horizon: None,
            floor: None,
        };
        let (mut replies, _) = ledger
            .claim_script(&[item], &[], &opts, Some(sent_us))
            .await
            .unwrap();
        let parts = replies.pop().unwrap();
        assert_eq!(tag(&parts).unwrap(), "acquired");
        grant(key, false, &parts).unwrap()
    }

    /// The take-back of a claim beyond the horizon (and the second check's
    /// removal) deletes only the record that claim wrote: not one with
    /// another fence, creation time or mark, not one its holder renewed
    /// since, not one taken over after its lease ended. Clearing the mark
    /// is fenced the same way.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn undo_takes_back_only_the_record_its_claim_wrote() {
        use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
        let Some(url) = service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379")) else {
            return;
        };
        // The test server persists nothing: accepted explicitly.
        let ledger =
            match RedisLedger::connect_with(&url, RedisLedgerOptions::default().ephemeral(true)).await {
                Ok(l) => l,
                Err(e) => return skip_or_fail(&format!("redis at {url}: {e}")).unwrap_or(()),
            };
        let t = fresh_tenant();
        let acquire = |c: Claim| match c {
            Claim::Acquired(l) => l,
            other => panic!("expected Acquired, got {other:?}"),
        };
        let sent = to_micros(SystemTime::now()).unwrap() - 1_000_000;
        let short = Duration::from_millis(200);
        let mark = |ledger: &RedisLedger, k: &EffectKey| {
            let (ledger, rkey) = (ledger.clone(), ledger.redis_key(k));
            async move {
                let mut conn = ledger.conn.clone();
                redis::cmd("HGET")
                    .arg(rkey)
                    .arg("hz")
                    .query_async::<Option<String>>(&mut conn)
                    .await
                    .unwrap()
            }
        };
        let k = EffectKey::new(&t, "capture", "undo").unwrap();
        let l = insert_marked(&ledger, &k, short, sent).await;
        assert_eq!(mark(&ledger, &k).await, Some(sent.to_string()));
        ledger
            .undo(
                &Grant {
                    fence: l.fence() + 1,
                    ..Grant::from(&l)
                }
                .into_lease(),
                sent,
            )
            .await;
        ledger
            .undo(
                &Grant {
                    first_claimed_at: l.first_claimed_at() + Duration::from_micros(1),
                    ..Grant::from(&l)
                }
                .into_lease(),
                sent,
            )
            .await;
        ledger.undo(&l, sent + 1).await;
        let created = to_micros(l.first_claimed_at()).unwrap().to_string();
        let other = (sent + 1).to_string();
        let e = ledger
            .fenced(&k, l.fence(), "checked", &[created.as_bytes(), other.as_bytes()])
            .await
            .unwrap_err();
        assert!(e.is_lease_lost(), "{e:?}");
        assert_eq!(mark(&ledger, &k).await, Some(sent.to_string()));
        assert_eq!(ledger.get(&k).await.unwrap().unwrap().fence, l.fence());
        tokio::time::sleep(Duration::from_millis(500)).await;
        // The second check found it within the horizon: the mark is cleared,
        // and the record is then taken over like any other.
        let hz = sent.to_string();
        ledger
            .fenced(&k, l.fence(), "checked", &[created.as_bytes(), hz.as_bytes()])
            .await
            .unwrap();
        assert_eq!(mark(&ledger, &k).await, None);
        let l2 = acquire(
            ledger
                .claim(&k, &ClaimOptions::default().lease(short))
                .await
                .unwrap(),
        );
        assert!(l2.taken_over());
        ledger.undo(&l, sent).await;
        assert_eq!(ledger.get(&k).await.unwrap().unwrap().fence, l2.fence());

        // A holder that renewed wrote since its claim: its claim passed.
        let renewed = EffectKey::new(&t, "capture", "undo-renewed").unwrap();
        let l3 = insert_marked(&ledger, &renewed, short, sent).await;
        ledger.renew(&l3, short).await.unwrap();
        ledger.undo(&l3, sent).await;
        assert_eq!(ledger.get(&renewed).await.unwrap().unwrap().fence, l3.fence());

        let fresh = EffectKey::new(&t, "capture", "undo-fresh").unwrap();
        let l4 = insert_marked(&ledger, &fresh, short, sent).await;
        ledger.undo(&l4, sent).await;
        assert!(ledger.get(&fresh).await.unwrap().is_none());
    }
}

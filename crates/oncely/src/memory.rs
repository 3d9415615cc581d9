//! An in-process ledger for unit tests: a mutex around a map.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::error::{Error, Result};
use crate::key::{EffectKey, Tenant};
use crate::ledger::{Capabilities, Ledger};
use crate::record::{Claim, ClaimOptions, Lease, MAX_OUTCOME_BYTES, Outcome, Record, RecordState};

#[derive(Debug, Clone)]
struct Row {
    record: Record,
    retention: Duration,
}

/// A ledger in process memory. Nothing survives the process; use it in unit
/// tests of handlers, not in production.
///
/// Its clock is the process's clock plus an offset that tests can move with
/// [`MemoryLedger::advance`].
#[derive(Debug, Default)]
pub struct MemoryLedger {
    rows: Mutex<HashMap<EffectKey, Row>>,
    offset_us: AtomicU64,
}

impl MemoryLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves this ledger's clock forward (lease expiry, retention).
    pub fn advance(&self, by: Duration) {
        self.offset_us.fetch_add(by.as_micros() as u64, Ordering::SeqCst);
    }

    fn now(&self) -> SystemTime {
        SystemTime::now() + Duration::from_micros(self.offset_us.load(Ordering::SeqCst))
    }

    fn rows(&self) -> std::sync::MutexGuard<'_, HashMap<EffectKey, Row>> {
        // A panic while holding the lock cannot leave a row half-written (each
        // operation mutates one row in one assignment), so poison is ignored.
        self.rows.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fenced<T>(&self, lease: &Lease, f: impl FnOnce(&mut Row, SystemTime) -> T) -> Result<T> {
        let now = self.now();
        let mut rows = self.rows();
        match rows.get_mut(&lease.key) {
            Some(row) if row.record.fence == lease.fence && row.record.state == RecordState::InProgress => {
                Ok(f(row, now))
            }
            _ => Err(Error::LeaseLost {
                key: lease.key.to_string(),
                fence: lease.fence,
            }),
        }
    }
}

fn view(row: &Row, now: SystemTime) -> Record {
    let mut r = row.record.clone();
    r.read_at = now;
    if r.state == RecordState::InProgress && r.at_most_once && r.lease_expires_at.is_some_and(|e| e <= now) {
        r.state = RecordState::Abandoned;
    }
    r
}

impl Ledger for MemoryLedger {
    fn backend(&self) -> &'static str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            caller_transaction: false,
            durability: "none: process memory",
            replicated: false,
            clock: "process clock",
            max_key_bytes: crate::MAX_KEY_BYTES,
            max_outcome_bytes: MAX_OUTCOME_BYTES,
        }
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        let now = self.now();
        let mut rows = self.rows();
        let Some(row) = rows.get_mut(key) else {
            if opts.sent_at.is_some_and(|s| s + opts.retention < now) {
                return Err(Error::BeyondHorizon { key: key.to_string() });
            }
            let lease = Lease {
                key: key.clone(),
                fence: 1,
                expires_at: now + opts.lease,
                first_claimed_at: now,
                acquired_at: now,
                taken_over: false,
                at_most_once: opts.at_most_once,
            };
            rows.insert(
                key.clone(),
                Row {
                    record: Record {
                        key: key.clone(),
                        state: RecordState::InProgress,
                        fence: 1,
                        fingerprint: opts.fingerprint,
                        outcome: None,
                        at_most_once: opts.at_most_once,
                        created_at: now,
                        updated_at: now,
                        lease_expires_at: Some(lease.expires_at),
                        retain_until: now + opts.retention,
                        read_at: now,
                    },
                    retention: opts.retention,
                },
            );
            return Ok(Claim::Acquired(lease));
        };
        if let (Some(stored), Some(given)) = (row.record.fingerprint, opts.fingerprint)
            && stored != given
        {
            return Err(Error::FingerprintMismatch { key: key.to_string() });
        }
        let r = &mut row.record;
        let expired = r.lease_expires_at.is_none_or(|e| e <= now);
        match r.state {
            RecordState::Completed => return Ok(Claim::Completed(view(row, now))),
            RecordState::InProgress if !expired => {
                return Ok(Claim::InProgress {
                    fence: r.fence,
                    expires_at: r.lease_expires_at.unwrap_or(now),
                    first_claimed_at: r.created_at,
                    read_at: now,
                });
            }
            RecordState::InProgress | RecordState::Abandoned if r.at_most_once => {
                return Ok(Claim::Abandoned(view(row, now)));
            }
            _ => {}
        }
        r.state = RecordState::InProgress;
        r.fence += 1;
        r.at_most_once = opts.at_most_once;
        r.lease_expires_at = Some(now + opts.lease);
        r.updated_at = now;
        if r.fingerprint.is_none() {
            r.fingerprint = opts.fingerprint;
        }
        row.retention = opts.retention;
        Ok(Claim::Acquired(Lease {
            key: key.clone(),
            fence: r.fence,
            expires_at: now + opts.lease,
            first_claimed_at: r.created_at,
            acquired_at: now,
            taken_over: true,
            at_most_once: opts.at_most_once,
        }))
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        self.fenced(lease, |row, now| {
            let r = &mut row.record;
            r.state = RecordState::Completed;
            r.outcome = Some(outcome.clone());
            r.lease_expires_at = None;
            r.updated_at = now;
            r.retain_until = now + row.retention;
        })
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.fenced(lease, |row, now| {
            let r = &mut row.record;
            r.state = RecordState::Released;
            r.lease_expires_at = None;
            r.updated_at = now;
            r.retain_until = now + row.retention;
        })
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        self.fenced(lease, |row, now| {
            row.record.lease_expires_at = Some(now + extend_by);
            Lease {
                expires_at: now + extend_by,
                ..lease.clone()
            }
        })
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        let now = self.now();
        Ok(self.rows().get(key).map(|row| view(row, now)))
    }

    async fn prune(&self, limit: u64) -> Result<u64> {
        let now = self.now();
        let mut rows = self.rows();
        let doomed: Vec<EffectKey> = rows
            .values()
            .filter(|row| {
                matches!(row.record.state, RecordState::Completed | RecordState::Released)
                    && row.record.retain_until <= now
            })
            .map(|row| row.record.key.clone())
            .take(usize::try_from(limit).unwrap_or(usize::MAX))
            .collect();
        for k in &doomed {
            rows.remove(k);
        }
        Ok(doomed.len() as u64)
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        let now = self.now();
        let mut out: Vec<Record> = self
            .rows()
            .values()
            .filter(|row| row.record.key.tenant() == tenant)
            .map(|row| view(row, now))
            .filter(|r| r.state == RecordState::Abandoned)
            .collect();
        out.sort_by_key(|r| r.created_at);
        out.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        Ok(out)
    }
}

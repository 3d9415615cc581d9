//! An in-process ledger for unit tests: a mutex around a map.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::backend::{self, answer_existing, check_outcome, effective_state, is_beyond_horizon, next_fence};
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
    rows: Mutex<Rows>,
    offset_us: AtomicU64,
    notifier: crate::watch::Notifier,
}

#[derive(Debug, Default)]
struct Rows {
    records: HashMap<EffectKey, Row>,
    /// Per tenant and kind: the newest `created_at` that prune deleted.
    horizons: HashMap<(Tenant, String), SystemTime>,
}

impl MemoryLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves this ledger's clock forward (lease expiry, retention), by at
    /// most ten years in all.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_micros())
            .unwrap_or(u64::MAX)
            .min(MAX_OFFSET_US);
        let _ = self
            .offset_us
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |o| {
                Some(o.saturating_add(by).min(MAX_OFFSET_US))
            });
    }

    fn now(&self) -> SystemTime {
        SystemTime::now() + Duration::from_micros(self.offset_us.load(Ordering::SeqCst))
    }

    fn rows(&self) -> std::sync::MutexGuard<'_, Rows> {
        // A panic while holding the lock cannot leave a row half-written (each
        // operation mutates one row in one assignment), so poison is ignored.
        self.rows.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fenced<T>(&self, lease: &Lease, f: impl FnOnce(&mut Row, SystemTime) -> T) -> Result<T> {
        let now = self.now();
        let mut rows = self.rows();
        match rows.records.get_mut(&lease.key) {
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

/// Ten years of [`MemoryLedger::advance`]: far enough for any test, and no
/// overflow when leases and retentions are added to the clock.
const MAX_OFFSET_US: u64 = 10 * 366 * 86_400 * 1_000_000;

fn view(row: &Row, now: SystemTime) -> Record {
    let mut r = row.record.clone();
    r.read_at = now;
    r.state = effective_state(r.state, r.at_most_once, r.lease_expires_at, now);
    r
}

fn clock_us(now: SystemTime) -> i64 {
    backend::to_micros(now).unwrap_or(backend::MAX_MICROS)
}

impl crate::open::FromUrl for MemoryLedger {
    const SCHEMES: &'static [&'static str] = &["memory"];

    /// `memory:` (nothing after the colon): a fresh, empty ledger. It takes
    /// no query parameters: any is refused, as on every backend.
    async fn from_url(url: &str, _options: crate::open::OpenOptions) -> Result<Self> {
        let params = crate::open::UrlParams::parse(url.trim(), "memory", &[], &[])?;
        match params.driver_url().split_once(':') {
            Some((scheme, "")) if scheme.eq_ignore_ascii_case("memory") => Ok(MemoryLedger::new()),
            _ => Err(Error::Config(
                "a memory ledger's URL is `memory:`, with nothing after the colon".into(),
            )),
        }
    }
}

/// What an operator reads: this process's memory, gone with it.
impl std::fmt::Display for MemoryLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("memory (this process only)")
    }
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
            max_key_bytes: crate::key::MAX_KEY_BYTES,
            max_outcome_bytes: MAX_OUTCOME_BYTES,
            // One lock per call already; gathering calls only queues them.
            coalescing: false,
        }
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        let now = self.now();
        let mut rows = self.rows();
        let Rows { records, horizons } = &mut *rows;
        let Some(row) = records.get_mut(key) else {
            let horizon = horizons
                .get(&(key.tenant().clone(), key.kind().to_owned()))
                .copied();
            if is_beyond_horizon(opts.sent_at, horizon) {
                return Err(Error::BeyondHorizon { key: key.to_string() });
            }
            let lease = Lease {
                key: key.clone(),
                fence: next_fence(None, clock_us(now)),
                expires_at: now + opts.lease,
                first_claimed_at: now,
                acquired_at: now,
                taken_over: false,
                at_most_once: opts.at_most_once,
            };
            records.insert(
                key.clone(),
                Row {
                    record: Record {
                        key: key.clone(),
                        state: RecordState::InProgress,
                        fence: lease.fence,
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
        if let Some(answer) = answer_existing(key, opts, view(row, now))? {
            return Ok(answer);
        }
        let r = &mut row.record;
        r.state = RecordState::InProgress;
        r.fence = next_fence(Some(r.fence), clock_us(now));
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
        check_outcome(outcome, MAX_OUTCOME_BYTES)?;
        self.fenced(lease, |row, now| {
            let r = &mut row.record;
            r.state = RecordState::Completed;
            r.outcome = Some(outcome.clone());
            r.lease_expires_at = None;
            r.updated_at = now;
            r.retain_until = now + row.retention;
        })?;
        self.notifier.notify(lease.key.as_str());
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.fenced(lease, |row, now| {
            let r = &mut row.record;
            r.state = RecordState::Released;
            r.lease_expires_at = None;
            r.updated_at = now;
            r.retain_until = now + row.retention;
        })?;
        self.notifier.notify(lease.key.as_str());
        Ok(())
    }

    async fn watch(&self, key: &EffectKey) -> crate::watch::Watch {
        self.notifier.watch(key)
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        crate::backend::check_extension(extend_by)?;
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
        Ok(self.rows().records.get(key).map(|row| view(row, now)))
    }

    async fn prune(&self, limit: u64) -> Result<u64> {
        let now = self.now();
        let mut rows = self.rows();
        let Rows { records, horizons } = &mut *rows;
        let doomed: Vec<EffectKey> = records
            .values()
            .filter(|row| {
                matches!(row.record.state, RecordState::Completed | RecordState::Released)
                    && row.record.retain_until <= now
            })
            .map(|row| row.record.key.clone())
            .take(usize::try_from(limit).unwrap_or(usize::MAX))
            .collect();
        for k in &doomed {
            if let Some(row) = records.remove(k) {
                let horizon = horizons
                    .entry((k.tenant().clone(), k.kind().to_owned()))
                    .or_insert(row.record.created_at);
                *horizon = (*horizon).max(row.record.created_at);
            }
        }
        Ok(doomed.len() as u64)
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        let now = self.now();
        let mut out: Vec<Record> = self
            .rows()
            .records
            .values()
            .filter(|row| row.record.key.tenant() == tenant)
            .map(|row| view(row, now))
            .filter(|r| r.state == RecordState::Abandoned)
            .collect();
        out.sort_by_key(|r| r.created_at);
        out.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        Ok(out)
    }

    async fn horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
        Ok(self
            .rows()
            .horizons
            .get(&(tenant.clone(), kind.to_owned()))
            .copied())
    }
}

impl MemoryLedger {
    /// `Admin::erase` (`write`) or its dry run.
    fn erase_as(&self, tenant: &Tenant, subject: &str, write: bool) -> Result<crate::admin::Erasure> {
        backend::check_subject(subject)?;
        let now = self.now();
        let mut erasure = crate::admin::Erasure::new(now);
        for (key, row) in self.rows().records.iter_mut() {
            if key.tenant() != tenant || key.subject() != subject {
                continue;
            }
            let r = &mut row.record;
            if erasure.add(key.clone(), r.state) && write {
                r.outcome = None;
                r.fingerprint = None;
            }
        }
        Ok(erasure.sorted())
    }
}

impl crate::admin::Admin for MemoryLedger {
    async fn records(&self, query: &crate::admin::RecordQuery) -> Result<Vec<Record>> {
        let now = self.now();
        let mut out: Vec<Record> = self
            .rows()
            .records
            .values()
            .map(|row| view(row, now))
            .filter(|r| query.matches(r, now))
            .collect();
        out.sort_by(|a, b| {
            (a.created_at, a.key.as_str().as_bytes()).cmp(&(b.created_at, b.key.as_str().as_bytes()))
        });
        out.truncate(query.page_size() as usize);
        Ok(out)
    }

    async fn stats(&self, tenant: Option<&Tenant>) -> Result<Vec<crate::admin::KindStats>> {
        let now = self.now();
        let mut by: std::collections::BTreeMap<(String, String), crate::admin::KindStats> =
            std::collections::BTreeMap::new();
        for row in self.rows().records.values() {
            let r = view(row, now);
            if tenant.is_some_and(|t| r.key.tenant() != t) {
                continue;
            }
            by.entry((r.key.tenant().as_str().to_owned(), r.key.kind().to_owned()))
                .or_insert_with(|| crate::admin::KindStats::new(r.key.tenant().clone(), r.key.kind(), now))
                .count(&r, now);
        }
        Ok(by.into_values().collect())
    }

    async fn forget(&self, key: &EffectKey, fence: u64) -> Result<()> {
        let now = self.now();
        let mut rows = self.rows();
        match rows.records.get_mut(key) {
            Some(row) if row.record.fence == fence && row.record.state == RecordState::Completed => {
                let r = &mut row.record;
                r.state = RecordState::Released;
                r.outcome = None;
                r.lease_expires_at = None;
                r.updated_at = now;
                r.retain_until = now + row.retention;
                Ok(())
            }
            found => {
                let found = found.map(|row| view(row, now));
                Err(crate::backend::forget_refusal(key, fence, found))
            }
        }
    }

    async fn erase(&self, tenant: &Tenant, subject: &str) -> Result<crate::admin::Erasure> {
        self.erase_as(tenant, subject, true)
    }

    async fn erase_dry_run(&self, tenant: &Tenant, subject: &str) -> Result<crate::admin::Erasure> {
        self.erase_as(tenant, subject, false)
    }

    async fn replace_outcome(
        &self,
        key: &EffectKey,
        fence: u64,
        expected: &Outcome,
        outcome: &Outcome,
    ) -> Result<bool> {
        check_outcome(outcome, MAX_OUTCOME_BYTES)?;
        let mut rows = self.rows();
        Ok(match rows.records.get_mut(key) {
            Some(row)
                if row.record.fence == fence
                    && row.record.state == RecordState::Completed
                    && row.record.outcome.as_ref() == Some(expected) =>
            {
                row.record.outcome = Some(outcome.clone());
                true
            }
            _ => false,
        })
    }

    async fn prunable(&self) -> Result<u64> {
        let now = self.now();
        Ok(self
            .rows()
            .records
            .values()
            .filter(|row| {
                matches!(row.record.state, RecordState::Completed | RecordState::Released)
                    && row.record.retain_until <= now
            })
            .count() as u64)
    }
}

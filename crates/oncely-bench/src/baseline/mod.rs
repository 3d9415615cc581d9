//! The hand-written minimum each oncely row is compared with, per backend:
//! insert the outcome if the key is absent (the delivery that inserted runs
//! the effect), read the stored outcome on a duplicate. On the ledger's own
//! database or server, in a table, bucket or key space of its own.

use oncely::{Error, Result};
use oncely_any::AnyLedger;

use crate::server::Sample;

mod memory;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "redis")]
mod redis;
mod sql;

/// What the hand-written code answered for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Answer {
    /// This delivery inserted the key: it runs the effect.
    Won,
    /// The key was there: its stored outcome.
    Duplicate(String),
}

/// What the same-guarantees hand-written code answered for one key: the
/// delivery that wrote the key's in-progress row (or took over one whose
/// lease had ended) holds it under a fence and completes it, fenced; a
/// duplicate reads the outcome, or polls while the lease is live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Leased {
    /// This delivery holds the key's lease under this fence.
    Won(u64),
    /// The effect completed: its stored outcome.
    Done(String),
    /// Another delivery holds a live lease: poll again.
    Busy,
}

/// The lease the same-guarantees code takes, as oncely's default.
pub(super) const LEASE: std::time::Duration = std::time::Duration::from_secs(30);

/// The hand-written baseline on one backend.
pub(super) enum Baseline {
    Sql(sql::SqlBaseline),
    #[cfg(feature = "redis")]
    Redis(redis::RedisBaseline),
    #[cfg(feature = "nats")]
    // A KV store handle is large; the others are a few pointers.
    Nats(Box<nats::NatsBaseline>),
    Memory(memory::MemoryBaseline),
}

macro_rules! each {
    ($self:expr, $b:ident => $body:expr) => {
        match $self {
            Baseline::Sql($b) => $body,
            #[cfg(feature = "redis")]
            Baseline::Redis($b) => $body,
            #[cfg(feature = "nats")]
            Baseline::Nats($b) => $body,
            Baseline::Memory($b) => $body,
        }
    };
}

impl Baseline {
    /// Sets the baseline up next to `ledger`: a table in its SQL database
    /// (on its pool), a connection to its Redis or NATS server(s) from the
    /// same URL, or a map for `memory:`.
    pub(super) async fn open(ledger: &AnyLedger, url: &str, run_id: &str) -> Result<Baseline> {
        if let Some(pool) = ledger.pool() {
            return Ok(Baseline::Sql(sql::SqlBaseline::create(pool, run_id).await?));
        }
        match ledger {
            #[cfg(feature = "redis")]
            AnyLedger::Redis(l) => Ok(Baseline::Redis(
                redis::RedisBaseline::connect(url, l, run_id).await?,
            )),
            #[cfg(feature = "nats")]
            AnyLedger::Nats(_) => Ok(Baseline::Nats(Box::new(
                nats::NatsBaseline::create(url, run_id).await?,
            ))),
            AnyLedger::Memory(_) => Ok(Baseline::Memory(memory::MemoryBaseline::default())),
            #[allow(unreachable_patterns)]
            other => {
                let _ = url;
                Err(no_baseline(other.scheme().name()))
            }
        }
    }

    /// What the hand-written code does, for the report.
    pub(super) fn describe(&self) -> &'static str {
        each!(self, b => b.describe())
    }

    /// The baseline's key for a row's job.
    pub(super) fn key(&self, row: &str, job: usize) -> String {
        each!(self, b => b.key(row, job))
    }

    /// Inserts `outcome` under `key` unless the key exists; otherwise reads
    /// what is stored.
    pub(super) async fn claim(&self, key: &str, outcome: &str) -> Result<Answer> {
        each!(self, b => b.claim(key, outcome).await)
    }

    /// [`Baseline::claim`] for several distinct keys at once, one answer per
    /// key in order: one statement (plus one read for the duplicates) on SQL,
    /// pipelined requests on Redis and NATS.
    pub(super) async fn claim_many(&self, items: &[(String, String)]) -> Result<Vec<Answer>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        each!(self, b => b.claim_many(items).await)
    }

    /// The same guarantees by hand: writes the key's in-progress row with a
    /// [`LEASE`] unless it exists; else reads it, and takes a row whose lease
    /// ended over (fenced) on the database's clock where it has one.
    pub(super) async fn lease(&self, key: &str) -> Result<Leased> {
        self.lease_for(key, LEASE).await
    }

    /// [`Baseline::lease`] with a lease of `len` (the tests' short leases).
    async fn lease_for(&self, key: &str, len: std::time::Duration) -> Result<Leased> {
        each!(self, b => b.lease(key, len).await)
    }

    /// Completes the key's lease with `outcome` if `fence` still holds it;
    /// `false` when it was taken over.
    pub(super) async fn finish(&self, key: &str, fence: u64, outcome: &str) -> Result<bool> {
        each!(self, b => b.finish(key, fence, outcome).await)
    }

    /// What the same-guarantees code does, for the report.
    pub(super) fn describe_leased(&self) -> &'static str {
        each!(self, b => b.describe_leased())
    }

    /// The server's live counters, read on the baseline's connection
    /// ([`crate::server`]), and how many statements that reading adds to
    /// them.
    pub(super) async fn sample(&self) -> Result<(Sample, u64)> {
        match self {
            Baseline::Sql(b) => Ok((b.sample().await?, b.own_statements())),
            #[cfg(feature = "redis")]
            Baseline::Redis(b) => Ok((b.sample().await?, 0)),
            #[cfg(feature = "nats")]
            Baseline::Nats(_) => Ok((Sample::default(), 0)),
            Baseline::Memory(_) => Ok((Sample::default(), 0)),
        }
    }

    /// Removes what the baseline created: the table, the bucket, or `keys`
    /// (Redis, whose keys also expire on their own).
    pub(super) async fn remove(&self, keys: &[String]) -> Result<()> {
        each!(self, b => b.remove(keys).await)
    }
}

/// How long the baseline's keys live where the backend expires them
/// (Redis), in case the run is interrupted before it removes them.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
const KEY_TTL: std::time::Duration = std::time::Duration::from_secs(3600);

/// The bench was built without the backend's feature (or has no baseline
/// for it).
fn no_baseline(backend: &str) -> Error {
    Error::Config(format!(
        "the bench has no hand-written baseline for the {backend} backend"
    ))
}

/// An error of the baseline's own statements, named as such so that nobody
/// takes it for the ledger's.
pub(super) fn backend_error(
    backend: &'static str,
    message: impl std::fmt::Display,
    retryable: bool,
) -> Error {
    Error::Backend {
        backend,
        message: format!("bench baseline: {message}"),
        retryable,
    }
}

/// Pairs the keys a batch won with the stored outcomes of the others, in
/// the order of `items`.
fn merge(
    items: &[(String, String)],
    won: impl Fn(&str) -> bool,
    mut stored: std::collections::HashMap<String, String>,
    backend: &'static str,
) -> Result<Vec<Answer>> {
    items
        .iter()
        .map(|(key, _)| {
            if won(key) {
                return Ok(Answer::Won);
            }
            stored
                .remove(key)
                .map(Answer::Duplicate)
                .ok_or_else(|| backend_error(backend, format!("{key} was neither inserted nor found"), false))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    //! The same-guarantees baseline's takeover path, on every backend: the
    //! bench's 30 s lease never ends within a row, so only here does an
    //! expired lease get taken over and its old holder fenced out.

    use std::time::Duration;

    use oncely::conformance::{service_url, skip_or_fail};
    use oncely_any::AnyLedger;
    use oncely_any::scratch::{run_id, scratch_dir, scratch_ledger, sqlite_url};

    use super::{Baseline, Leased};

    const SHORT: Duration = Duration::from_millis(300);

    /// Holds, is refused while live, is taken over once expired (a higher
    /// fence), fences the old holder's completion out, completes under the
    /// new fence, and answers a later delivery with that outcome.
    async fn takes_an_expired_lease_over(ledger: &AnyLedger, url: &str) {
        let run = run_id();
        let baseline = Baseline::open(ledger, url, &run).await.unwrap();
        let key = baseline.key("leased-takeover", 0);
        let first = match baseline.lease_for(&key, SHORT).await.unwrap() {
            Leased::Won(fence) => fence,
            other => panic!("a fresh key was not won: {other:?}"),
        };
        assert_eq!(baseline.lease_for(&key, SHORT).await.unwrap(), Leased::Busy);
        tokio::time::sleep(SHORT * 3).await;
        let second = match baseline.lease_for(&key, SHORT).await.unwrap() {
            Leased::Won(fence) => fence,
            other => panic!("an expired lease was not taken over: {other:?}"),
        };
        assert!(
            second > first,
            "the takeover's fence {second} is not above {first}"
        );
        assert!(
            !baseline.finish(&key, first, "stale").await.unwrap(),
            "the old holder completed after a takeover"
        );
        assert!(baseline.finish(&key, second, "new").await.unwrap());
        assert_eq!(
            baseline.lease_for(&key, SHORT).await.unwrap(),
            Leased::Done("new".to_owned())
        );
        assert!(!baseline.finish(&key, second, "again").await.unwrap());
        baseline.remove(std::slice::from_ref(&key)).await.unwrap();
    }

    async fn on(var: &str, default: &str, port: u16) {
        let Some(url) = service_url(var, Some(default)) else {
            return;
        };
        if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
            return skip_or_fail(&format!("nothing answers at {url}")).unwrap_or(());
        }
        let ledger = AnyLedger::connect(&url).await.unwrap();
        takes_an_expired_lease_over(&ledger, &url).await;
        ledger.close().await;
    }

    #[tokio::test]
    async fn sqlite() {
        let dir = scratch_dir("oncely-bench-test-").unwrap();
        let url = sqlite_url(&dir.path().join("bench.db"));
        let ledger = scratch_ledger(&url).await.unwrap();
        takes_an_expired_lease_over(&ledger, &url).await;
        ledger.close().await;
    }

    #[tokio::test]
    async fn memory() {
        let ledger = AnyLedger::connect("memory:").await.unwrap();
        takes_an_expired_lease_over(&ledger, "memory:").await;
    }

    #[tokio::test]
    async fn postgres() {
        on(
            "ONCELY_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/test",
            5432,
        )
        .await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test]
    async fn mysql() {
        on("ONCELY_MYSQL_URL", "mysql://root@127.0.0.1:3306/test", 3306).await;
    }

    #[cfg(feature = "redis")]
    #[tokio::test]
    async fn redis() {
        let Some(url) = service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379")) else {
            return;
        };
        let sep = if url.contains('?') { '&' } else { '?' };
        // The machine's Redis persists nothing; the ledger refuses it unless told.
        on(
            "ONCELY_BENCH_REDIS_URL",
            &format!("{url}{sep}ephemeral=true"),
            6379,
        )
        .await;
    }

    #[cfg(feature = "nats")]
    #[tokio::test]
    async fn nats() {
        on("ONCELY_NATS_URL", "nats://127.0.0.1:4222", 4222).await;
    }
}

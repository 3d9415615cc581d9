//! Connections: what the server supports (asked once), running operations
//! to completion on the pool, and healing a connection that someone else
//! left inside a transaction.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use oncely::{Error, Lease, Result};
use sqlx::pool::PoolConnection;
use sqlx::{Executor, MySql, MySqlConnection, Row};

use crate::error::{self, BACKEND, corrupt, map, unexpected_violation};
use crate::{MySqlLedger, schema, sql};

/// How many times a ledger operation on the pool retries a deadlock or lock
/// wait timeout (each attempt is one autocommit statement, or a prune batch
/// that rolled back whole, so a retry is safe).
pub(crate) const LOCK_RETRIES: u32 = 8;

/// Why an attempt on the pool did not finish.
pub(crate) enum Retry {
    /// Deadlock or lock wait timeout: run it again.
    Lock(sqlx::Error),
    /// The row moved under a multi-statement claim (or a refreshed grant was
    /// taken over): run the claim again, and report this if it keeps
    /// happening.
    Moved(String),
    /// The pooled connection was inside a transaction someone else left
    /// open; it has been rolled back and nothing was written: run it again.
    Leaked,
    /// Final.
    Fail(Error),
}

impl From<Error> for Retry {
    fn from(e: Error) -> Self {
        Retry::Fail(e)
    }
}

pub(crate) fn retry_on_lock(e: sqlx::Error) -> Retry {
    if error::is_retryable(&e) {
        Retry::Lock(e)
    } else {
        Retry::Fail(map(e))
    }
}

/// A boxed, sendable future.
pub(crate) type BoxedFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

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

pub(crate) fn autocommit_off() -> Error {
    Error::Config(
        "the ledger's pool runs with autocommit = 0: its writes would never commit; \
         use a pool in autocommit mode (claim_in / complete_in join your transactions)"
            .to_owned(),
    )
}

pub(crate) fn join_error(e: tokio::task::JoinError) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("ledger task failed: {e}"),
        retryable: !e.is_panic(),
    }
}

pub(crate) fn lease_lost(lease: &Lease) -> Error {
    Error::LeaseLost {
        key: lease.key().to_string(),
        fence: lease.fence(),
    }
}

/// Whether a `VERSION()` string is MariaDB 10.5 or later.
pub(crate) fn mariadb_returning(version: &str) -> bool {
    if !version.to_ascii_lowercase().contains("mariadb") {
        return false;
    }
    // Old replication-compatible servers prefix the real version with 5.5.5-.
    let version = version.strip_prefix("5.5.5-").unwrap_or(version);
    let mut parts = version
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty());
    let major: u32 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let minor: u32 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    (major, minor) >= (10, 5)
}

/// Whether `SYSDATE(6)` reads the clock at call time: it ran this many µs
/// ahead of the statement start across a 2 ms sleep.
pub(crate) fn sysdate_is_live(ahead_us: Option<i64>) -> bool {
    ahead_us.is_some_and(|d| d >= 1_000)
}

impl MySqlLedger {
    /// Asks the server once what it supports (`RETURNING` on MariaDB 10.5+,
    /// `max_allowed_packet`, `@@in_transaction`, a live `SYSDATE()`) and
    /// checks the tables ([`schema::verify`]). Every operation calls it
    /// first, so a ledger made with `from_pool` is checked before its first
    /// use. `conn`: ask on the caller's connection (`claim_in`), so a pool
    /// whose connections are all inside the caller's transactions cannot
    /// stall it.
    pub(crate) async fn probe(&self, conn: Option<&mut MySqlConnection>) -> Result<()> {
        if self.inner.probed.initialized() {
            return Ok(());
        }
        self.inner
            .probed
            .get_or_try_init(|| async move {
                let in_caller_tx = conn.is_some();
                let mut pooled: PoolConnection<MySql>;
                let conn: &mut MySqlConnection = match conn {
                    Some(conn) => conn,
                    None => {
                        pooled = self.inner.pool.acquire().await.map_err(map)?;
                        &mut pooled
                    }
                };
                let row = sqlx::query("SELECT VERSION() AS v, @@max_allowed_packet AS p")
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(map)?;
                let version: String = row.try_get("v").map_err(map)?;
                let packet: u64 = row.try_get("p").map_err(map)?;
                // A server started with --sysdate-is-now would make every
                // "clock after the wait" the statement's start again.
                let ahead: Option<i64> = sqlx::query_scalar(sql::SYSDATE_PROBE)
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(map)?;
                if !sysdate_is_live(ahead) {
                    return Err(Error::Config(format!(
                        "SYSDATE() on this server returns the statement's start time \
                         (--sysdate-is-now?): {ahead:?} µs ahead after a 2 ms sleep; the ledger \
                         needs it to read the clock when a write takes effect"
                    )));
                }
                // A pool whose sessions run with autocommit = 0 would leave
                // every ledger write uncommitted (claim_in asks on the
                // caller's connection, which may legitimately be so).
                if !in_caller_tx {
                    let autocommit: i64 = sqlx::query_scalar("SELECT @@autocommit")
                        .fetch_one(&mut *conn)
                        .await
                        .map_err(map)?;
                    if autocommit == 0 {
                        return Err(autocommit_off());
                    }
                }
                // MariaDB tells whether a statement runs inside an open
                // transaction; MySQL 8 has no such variable (error 1193).
                let guarded = match sqlx::query_scalar::<_, u64>("SELECT @@in_transaction")
                    .fetch_one(&mut *conn)
                    .await
                {
                    Ok(_) => true,
                    Err(e) if error::number(&e) == Some(1193) => false,
                    Err(e) => return Err(map(e)),
                };
                schema::verify(conn, &self.inner.table).await?;
                let returning = self
                    .inner
                    .returning_pref
                    .unwrap_or_else(|| mariadb_returning(&version));
                self.inner.returning.store(returning, Ordering::Relaxed);
                // The outcome travels in one packet with the key, the fence and
                // the statement's framing; keep 4 KiB for those.
                let fits = usize::try_from(packet.saturating_sub(4096)).unwrap_or(usize::MAX);
                self.inner.max_outcome.fetch_min(fits, Ordering::Relaxed);
                self.inner.guarded.store(guarded, Ordering::Relaxed);
                Ok::<_, Error>(())
            })
            .await
            .map(|_| ())
    }

    /// Runs `f` on a pooled connection in a spawned task (so it finishes
    /// even if the caller's future is dropped), retrying lock conflicts.
    pub(crate) async fn on_pool<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: for<'c> Fn(&'c MySqlLedger, &'c mut MySqlConnection) -> BoxedFuture<'c, Result<T, Retry>>
            + Send
            + Sync
            + 'static,
    {
        let this = self.clone();
        tokio::spawn(async move {
            this.probe(None).await?;
            let mut last = None;
            for attempt in 0..LOCK_RETRIES {
                if attempt > 0 {
                    tokio::time::sleep(Duration::from_millis(2 << attempt.min(6))).await;
                }
                let mut conn = this.inner.pool.acquire().await.map_err(map)?;
                match f(&this, &mut conn).await {
                    Ok(v) => return Ok(v),
                    Err(Retry::Fail(e)) => return Err(e),
                    Err(other) => last = Some(other),
                }
            }
            Err(match last {
                Some(Retry::Lock(e)) => map(e),
                // The statement keeps missing the key's row: only a conflict
                // on another unique index does that.
                Some(Retry::Moved(why)) => unexpected_violation(&why),
                Some(Retry::Fail(e)) => e,
                Some(Retry::Leaked) | None => corrupt("retries exhausted"),
            })
        })
        .await
        .map_err(join_error)?
    }

    /// A fenced write matched no row: the lease is lost, unless the pooled
    /// connection sat inside a transaction someone else left open (checked
    /// when `may_leak`), which is healed so the write runs again.
    pub(crate) async fn fence_miss(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
        may_leak: bool,
    ) -> Retry {
        if may_leak {
            match self.heal_if_leaked(conn).await {
                Ok(true) => return Retry::Leaked,
                Ok(false) => {}
                Err(e) => return e,
            }
        }
        lease_lost(lease).into()
    }

    /// Whether a pooled connection sat inside a transaction that someone else
    /// left open (their `pool.begin()` dropped mid-way, an aborted `BEGIN`).
    /// If so, that transaction is rolled back, so the connection is clean for
    /// the retry and no lock of ours outlives it. Always `false` without
    /// `@@in_transaction` (MySQL 8).
    pub(crate) async fn heal_if_leaked(&self, conn: &mut MySqlConnection) -> Result<bool, Retry> {
        if !self.inner.guarded.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let row = sqlx::query("SELECT @@in_transaction AS open, @@autocommit AS autocommit")
            .fetch_one(&mut *conn)
            .await
            .map_err(retry_on_lock)?;
        let open: u64 = row.try_get("open").map_err(map)?;
        let autocommit: i64 = row.try_get("autocommit").map_err(map)?;
        if open == 0 {
            return Ok(false);
        }
        if autocommit == 0 {
            // Every statement opens a transaction that nobody commits: the
            // guard would trip forever. Say so instead.
            conn.execute("ROLLBACK").await.map_err(retry_on_lock)?;
            return Err(autocommit_off().into());
        }
        tracing::warn!(
            backend = BACKEND,
            "a pooled connection was inside a transaction left open by other code; rolling it back"
        );
        conn.execute("ROLLBACK").await.map_err(retry_on_lock)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returning_detection() {
        assert!(mariadb_returning("10.11.19-MariaDB-0+deb12u1"));
        assert!(mariadb_returning("10.5.0-MariaDB"));
        assert!(mariadb_returning("11.4.2-MariaDB-log"));
        assert!(!mariadb_returning("10.4.30-MariaDB"));
        assert!(!mariadb_returning("8.0.36"));
        assert!(
            mariadb_returning("5.5.5-10.11.6-MariaDB"),
            "the 5.5.5- prefix is not the version"
        );
    }

    #[test]
    fn tokens_are_unique() {
        let a = claim_token();
        let b = claim_token();
        assert_ne!(a, b);
        assert_eq!(a[..8], b[..8]);
    }

    #[test]
    fn a_sysdate_that_is_now_is_refused() {
        assert!(sysdate_is_live(Some(2_100)));
        assert!(!sysdate_is_live(Some(0)), "--sysdate-is-now");
        assert!(!sysdate_is_live(None));
    }
}

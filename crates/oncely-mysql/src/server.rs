//! What the server supports, asked once before a ledger's first operation:
//! `RETURNING` (MariaDB 10.5+), `SKIP LOCKED` (MySQL 8, MariaDB 10.6+: the
//! outbox's claim), `max_allowed_packet`, `@@in_transaction`
//! (the leaked-transaction guard), a `SYSDATE()` that reads the clock,
//! sessions that commit, and whether it is a Galera node (`@@wsrep_on`:
//! causal reads, `Capabilities::replicated`); then the tables are checked.

use std::sync::atomic::Ordering;

use oncely::{Error, Result};
use sqlx::{MySqlConnection, Row};

use crate::error::{self, autocommit_off, map};
use crate::guard::Conn;
use crate::row::only;
use crate::{MySqlLedger, schema, sql};

/// A MariaDB `VERSION()` string's (major, minor); `None` for MySQL.
fn mariadb_version(version: &str) -> Option<(u32, u32)> {
    if !version.to_ascii_lowercase().contains("mariadb") {
        return None;
    }
    // Old replication-compatible servers prefix the real version with 5.5.5-.
    let version = version.strip_prefix("5.5.5-").unwrap_or(version);
    let mut parts = version
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty());
    let major: u32 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let minor: u32 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    Some((major, minor))
}

/// Whether a `VERSION()` string is MariaDB 10.5 or later.
pub(crate) fn mariadb_returning(version: &str) -> bool {
    mariadb_version(version).is_some_and(|v| v >= (10, 5))
}

/// Whether the server takes `SELECT … FOR UPDATE SKIP LOCKED`: MySQL 8
/// (8.0.1+; this crate needs 8), MariaDB 10.6+. MariaDB 10.5 has no
/// `SKIP LOCKED`: there the outbox's claim waits for another relay's
/// claim instead of passing over its rows.
pub(crate) fn skip_locked(version: &str) -> bool {
    mariadb_version(version).is_none_or(|v| v >= (10, 6))
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
                let mut pooled: Conn;
                let conn: &mut MySqlConnection = match conn {
                    Some(conn) => conn,
                    None => {
                        pooled = self.acquire().await?;
                        &mut pooled
                    }
                };
                let row = sqlx::query(sql::SERVER)
                    .fetch_all(&mut *conn)
                    .await
                    .and_then(only)
                    .map_err(map)?;
                let version: String = row.try_get("v").map_err(map)?;
                let packet: u64 = row.try_get("p").map_err(map)?;
                // A server started with --sysdate-is-now would make every
                // "clock after the wait" the statement's start again.
                let ahead: Option<i64> = sqlx::query_scalar(sql::SYSDATE_PROBE)
                    .fetch_all(&mut *conn)
                    .await
                    .and_then(only)
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
                    let autocommit: i64 = sqlx::query_scalar(sql::AUTOCOMMIT)
                        .fetch_all(&mut *conn)
                        .await
                        .and_then(only)
                        .map_err(map)?;
                    if autocommit == 0 {
                        return Err(autocommit_off());
                    }
                }
                // MariaDB tells whether a statement runs inside an open
                // transaction; MySQL 8 has no such variable (error 1193).
                let guarded = match sqlx::query_scalar::<_, u64>(sql::IN_TRANSACTION)
                    .fetch_all(&mut *conn)
                    .await
                    .and_then(only)
                {
                    Ok(_) => true,
                    Err(e) if error::number(&e) == Some(1193) => false,
                    Err(e) => return Err(map(e)),
                };
                // A Galera node (wsrep_on); MySQL without wsrep has no such
                // variable (error 1193).
                let galera = match sqlx::query_scalar::<_, i64>(sql::WSREP_ON)
                    .fetch_all(&mut *conn)
                    .await
                    .and_then(only)
                {
                    Ok(on) => on == 1,
                    Err(e) if error::number(&e) == Some(1193) => false,
                    Err(e) => return Err(map(e)),
                };
                let mariadb = version.to_ascii_lowercase().contains("mariadb");
                if galera && !mariadb {
                    tracing::warn!(
                        backend = error::BACKEND,
                        %version,
                        "a Galera node that is not MariaDB: the ledger's reads are not causal here \
                         (they use MariaDB's SET STATEMENT); a duplicate may be answered from a read \
                         a few milliseconds behind the other nodes"
                    );
                }
                schema::verify(conn, &self.inner.table).await?;
                let returning = self
                    .inner
                    .returning_pref
                    .unwrap_or_else(|| mariadb_returning(&version));
                self.inner.returning.store(returning, Ordering::Relaxed);
                self.inner
                    .skip_locked
                    .store(skip_locked(&version), Ordering::Relaxed);
                // The outcome travels in one packet with the key, the fence and
                // the statement's framing; keep 4 KiB for those.
                let fits = usize::try_from(packet.saturating_sub(4096)).unwrap_or(usize::MAX);
                self.inner.max_outcome.fetch_min(fits, Ordering::Relaxed);
                self.inner.packet_budget.store(fits, Ordering::Relaxed);
                self.inner.guarded.store(guarded, Ordering::Relaxed);
                self.inner.galera.store(galera, Ordering::Relaxed);
                self.inner.causal.store(galera && mariadb, Ordering::Relaxed);
                Ok::<_, Error>(())
            })
            .await
            .map(|_| ())
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
    fn skip_locked_detection() {
        assert!(skip_locked("10.11.19-MariaDB-0+deb12u1"));
        assert!(skip_locked("10.6.0-MariaDB"));
        assert!(skip_locked("11.4.2-MariaDB-log"));
        assert!(!skip_locked("10.5.25-MariaDB"));
        assert!(!skip_locked("5.5.5-10.5.25-MariaDB"));
        assert!(skip_locked("8.0.36"));
        assert!(skip_locked("8.4.0-commercial"));
    }

    #[test]
    fn a_sysdate_that_is_now_is_refused() {
        assert!(sysdate_is_live(Some(2_100)));
        assert!(!sysdate_is_live(Some(0)), "--sysdate-is-now");
        assert!(!sysdate_is_live(None));
    }
}

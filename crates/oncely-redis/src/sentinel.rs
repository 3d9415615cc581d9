//! A primary found through Sentinel, and followed when Sentinel promotes
//! another one ([`SentinelConn`]).
//!
//! The ledger asks the Sentinels for the primary of its master name, checks
//! with `ROLE` that the server it names is a primary, and sends every
//! request there. A request that meets what a failover looks like from a
//! client (`READONLY` from a demoted primary, `MASTERDOWN`, a connection
//! refused, dropped or timed out) makes the ledger ask the Sentinels again;
//! when they name another primary, the ledger connects to it and sends its
//! requests there from then on. The request itself is sent again on the new
//! primary only when the old one cannot have applied it (`READONLY`,
//! `MASTERDOWN`, refused): a request that timed out or whose connection
//! dropped may have been applied, and its caller gets the error (retryable),
//! as with a single server.
//!
//! One discovery at a time per ledger, and at most one every
//! [`MIN_GAP`]: a hundred requests failing at once during a failover ask
//! the Sentinels once, not a hundred times.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use oncely::{Error, Result};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use redis::{
    Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo, RedisError, RedisFuture, RedisResult,
    ServerErrorKind, Value,
};

use crate::error::{BACKEND, map_err};
use crate::options::SentinelTarget;
use crate::reply::text;

/// The least time between two discoveries of one ledger.
const MIN_GAP: Duration = Duration::from_millis(200);

/// A connection to the primary the Sentinels name, following failovers.
/// Clones share it.
#[derive(Clone)]
pub(crate) struct SentinelConn(Arc<Inner>);

struct Inner {
    target: SentinelTarget,
    /// The primary's credentials, database and protocol, as the Sentinel
    /// client takes them.
    node: SentinelNodeConnectionInfo,
    config: ConnectionManagerConfig,
    /// How long one discovery may take: asking the Sentinels, checking and
    /// connecting to the primary they name.
    bound: Duration,
    current: RwLock<Current>,
    asking: tokio::sync::Mutex<Asking>,
}

/// The primary requests go to now.
#[derive(Clone)]
struct Current {
    /// How many times the ledger moved to another primary.
    moves: u64,
    addr: ConnectionAddr,
    conn: ConnectionManager,
}

/// The Sentinel client (it keeps a connection per Sentinel), and when it
/// last finished a discovery.
struct Asking {
    sentinel: Sentinel,
    last: Option<Instant>,
}

impl SentinelConn {
    /// Asks the Sentinels for the primary and connects to it. No Sentinel
    /// reachable, or none naming a primary that answers as one, is
    /// [`Error::Unavailable`].
    pub(crate) async fn open(
        target: SentinelTarget,
        config: ConnectionManagerConfig,
        bound: Duration,
    ) -> Result<SentinelConn> {
        let sentinel = Sentinel::build(target.sentinels.clone())
            .map_err(|e| Error::Config(format!("redis sentinel urls: {e}")))?;
        let settings = target
            .node_url("127.0.0.1", 1)
            .as_str()
            .into_connection_info()
            .map_err(|e| Error::Config(format!("redis sentinel url: {e}")))?
            .redis_settings()
            .clone();
        let node = SentinelNodeConnectionInfo::default().set_redis_connection_info(settings);
        let mut asking = Asking { sentinel, last: None };
        let (addr, conn) = primary(&mut asking.sentinel, &target.master, &node, &config, bound)
            .await
            .map_err(|e| no_primary(&target, &e))?;
        asking.last = Some(Instant::now());
        Ok(SentinelConn(Arc::new(Inner {
            target,
            node,
            config,
            bound,
            current: RwLock::new(Current { moves: 0, addr, conn }),
            asking: tokio::sync::Mutex::new(asking),
        })))
    }

    fn current(&self) -> Current {
        self.0.current.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The database requests go to.
    pub(crate) fn db(&self) -> i64 {
        self.0.target.db
    }

    /// The primary's address, as the Sentinels named it.
    pub(crate) fn primary(&self) -> String {
        self.current().addr.to_string()
    }

    /// How many times the ledger moved to another primary.
    pub(crate) fn moves(&self) -> u64 {
        self.current().moves
    }

    /// The primary as a URL, with the ledger's credentials and database,
    /// for the change-notification subscriber: asked of the Sentinels now
    /// (the subscriber's connection is lost at a failover too, and the
    /// ledger may not have sent anything since).
    pub(crate) async fn primary_url(&self) -> RedisResult<ConnectionInfo> {
        let mut asking = self.0.asking.lock().await;
        let found = tokio::time::timeout(
            self.0.bound,
            asking
                .sentinel
                .async_master_for(&self.0.target.master, Some(&self.0.node)),
        )
        .await
        .map_err(|_| timed_out())??;
        Ok(found.get_connection_info().clone())
    }

    /// Asks the Sentinels for the primary again after a request that had
    /// seen `moves` failed the way a failover fails, and moves there if
    /// they name another one. Returns whether requests now go elsewhere
    /// than when that request was sent.
    async fn follow(&self, moves: u64) -> bool {
        let mut asking = self.0.asking.lock().await;
        let now = self.current();
        if now.moves != moves {
            return true;
        }
        if asking.last.is_some_and(|t| t.elapsed() < MIN_GAP) {
            return false;
        }
        let inner = &self.0;
        let found = primary(
            &mut asking.sentinel,
            &inner.target.master,
            &inner.node,
            &inner.config,
            inner.bound,
        )
        .await;
        asking.last = Some(Instant::now());
        match found {
            Ok((addr, _)) if addr == now.addr => false,
            Ok((addr, conn)) => {
                tracing::warn!(
                    old = %now.addr,
                    new = %addr,
                    master = %inner.target.master,
                    "redis ledger: Sentinel names another primary; following it"
                );
                let mut current = inner.current.write().unwrap_or_else(|p| p.into_inner());
                *current = Current {
                    moves: now.moves + 1,
                    addr,
                    conn,
                };
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, master = %inner.target.master, "redis ledger: no new primary yet");
                false
            }
        }
    }
}

/// Asks the Sentinels for `master`'s primary, connects to it and checks it
/// is one, within `bound`.
async fn primary(
    sentinel: &mut Sentinel,
    master: &str,
    node: &SentinelNodeConnectionInfo,
    config: &ConnectionManagerConfig,
    bound: Duration,
) -> RedisResult<(ConnectionAddr, ConnectionManager)> {
    let found = async {
        // The Sentinel client checks the role of the server it returns, on
        // a connection of its own; a failover may come in between, so this
        // connection checks it again.
        let client = sentinel.async_master_for(master, Some(node)).await?;
        let addr = client.get_connection_info().addr().clone();
        let mut conn = ConnectionManager::new_with_config(client, config.clone()).await?;
        match role(&mut conn).await {
            Some(role) if role != "master" => Err(RedisError::from((
                ErrorKind::Server(ServerErrorKind::ReadOnly),
                "the server Sentinel named is not a primary",
                role,
            ))),
            _ => Ok((addr, conn)),
        }
    };
    tokio::time::timeout(bound, found)
        .await
        .map_err(|_| timed_out())?
}

fn timed_out() -> RedisError {
    std::io::Error::new(std::io::ErrorKind::TimedOut, "asking the Sentinels timed out").into()
}

/// What connecting says when no Sentinel names a primary that answers.
fn no_primary(target: &SentinelTarget, e: &RedisError) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        message: format!(
            "no Sentinel of {} names a reachable primary for master {:?}: {}",
            target.sentinels.len(),
            target.master,
            map_err(e.clone())
        ),
    }
}

/// What a failover looks like from a request: sent to a primary that was
/// demoted or is gone or frozen. Whether the request may have been applied
/// is [`not_applied`]'s question.
fn moved_on(reply: &RedisResult<Value>) -> bool {
    match reply {
        Ok(Value::ServerError(e)) => matches!(
            e.kind(),
            Some(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        ),
        Ok(_) => false,
        Err(e) => {
            e.is_io_error()
                || e.is_connection_refusal()
                || e.is_connection_dropped()
                || e.is_timeout()
                || matches!(
                    e.kind(),
                    ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
                )
        }
    }
}

/// Whether the server cannot have applied a request that failed so: a
/// replica refuses a write (`READONLY`, before the script writes anything),
/// and a refused connection sent nothing. Such a request is sent again on
/// the new primary.
fn not_applied(reply: &RedisResult<Value>) -> bool {
    match reply {
        Ok(Value::ServerError(e)) => matches!(
            e.kind(),
            Some(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        ),
        Ok(_) => false,
        Err(e) => {
            e.is_connection_refusal()
                || matches!(
                    e.kind(),
                    ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
                )
        }
    }
}

/// A pipeline's replies as one, for [`moved_on`] and [`not_applied`]: its
/// first. The pipelines of this crate are a write and the `WAIT` after it,
/// which a replica refuses both (the `WAIT` with a plain error).
fn first_reply(reply: &RedisResult<Vec<Value>>) -> RedisResult<Value> {
    match reply {
        Err(e) => Err(e.clone()),
        Ok(values) => Ok(values.first().cloned().unwrap_or(Value::Nil)),
    }
}

impl ConnectionLike for SentinelConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let Current { moves, mut conn, .. } = self.current();
            let reply = conn.req_packed_command(cmd).await;
            if moved_on(&reply) && self.follow(moves).await && not_applied(&reply) {
                let mut conn = self.current().conn;
                return conn.req_packed_command(cmd).await;
            }
            reply
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let Current { moves, mut conn, .. } = self.current();
            let reply = conn.req_packed_commands(pipeline, offset, count).await;
            let one = first_reply(&reply);
            if moved_on(&one) && self.follow(moves).await && not_applied(&one) {
                let mut conn = self.current().conn;
                return conn.req_packed_commands(pipeline, offset, count).await;
            }
            reply
        })
    }

    fn get_db(&self) -> i64 {
        self.db()
    }
}

/// The server's role (`master`, `slave`) from `ROLE`, else from `INFO
/// replication`; `None` if neither answers. Here rather than in `conn.rs`,
/// which reads it too, so that the two do not import each other.
pub(crate) async fn role(conn: &mut impl ConnectionLike) -> Option<String> {
    if let Ok(Value::Array(parts)) = redis::cmd("ROLE").query_async::<Value>(conn).await
        && let Some(role) = parts.first().and_then(text)
    {
        return Some(role);
    }
    let info = redis::cmd("INFO")
        .arg("replication")
        .query_async::<Value>(conn)
        .await
        .ok()?;
    text(&info)?
        .lines()
        .find_map(|l| l.trim().strip_prefix("role:"))
        .map(|r| r.trim().to_owned())
}

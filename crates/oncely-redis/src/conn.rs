//! One connection type over a single node, a cluster and a primary found
//! through Sentinel, so every ledger operation is written once: opening it
//! (with the role and eviction-policy checks), routing a command to one
//! master, a write and its `WAIT` on one connection, and walking every
//! master's keyspace.

use std::time::Duration;

use oncely::{Error, Result};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

use crate::error::map_err;
use crate::options::{RedisLedgerOptions, Target};
use crate::reply::{policy_of, scan_page};
use crate::sentinel::{SentinelConn, role};

/// How many keys one `SCAN` call asks a master for.
const SCAN_COUNT: usize = 500;

#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(SentinelConn),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Sentinel(c) => c.get_db(),
        }
    }
}

/// A master to run keyspace-wide commands (SCAN, CONFIG GET) on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Node {
    /// The one server of a single-node ledger.
    Only,
    /// A cluster master, by the address the cluster announces.
    Master { host: String, port: u16 },
}

impl Conn {
    /// Connects to what `target` names, with `opts`' timeouts. A URL the
    /// client refuses is [`Error::Config`]; a server that does not answer,
    /// the mapped driver error ([`Error::Unavailable`] when refused).
    pub(crate) async fn open(target: Target, opts: &RedisLedgerOptions) -> Result<Conn> {
        match target {
            Target::Single(url) => {
                let client =
                    redis::Client::open(url).map_err(|e| Error::Config(format!("redis url: {e}")))?;
                Conn::from_client(client, opts).await
            }
            Target::Sentinel(target) => {
                // One discovery: the Sentinels, then the primary they name.
                let bound = opts.connect_timeout + opts.request_timeout;
                let conn = SentinelConn::open(target, manager_config(opts), bound).await?;
                Ok(Conn::Sentinel(conn))
            }
            Target::Cluster(nodes) => {
                let client = ClusterClientBuilder::new(nodes)
                    .connection_timeout(opts.connect_timeout)
                    .response_timeout(opts.request_timeout)
                    .retries(3)
                    .build()
                    .map_err(|e| Error::Config(format!("redis cluster urls: {e}")))?;
                let conn = client.get_async_connection().await.map_err(map_err)?;
                Ok(Conn::Cluster(conn))
            }
        }
    }

    /// A connection to the one server `client` names, with `opts`'
    /// timeouts.
    pub(crate) async fn from_client(client: redis::Client, opts: &RedisLedgerOptions) -> Result<Conn> {
        let manager = ConnectionManager::new_with_config(client, manager_config(opts))
            .await
            .map_err(map_err)?;
        Ok(Conn::Single(manager))
    }

    /// Checks that a single server (or the primary Sentinel named) is a
    /// primary: a replica refuses every write with `READONLY`, so a ledger
    /// that writes is refused there with [`Error::Config`] before its first
    /// claim; a read-only one is accepted (it reads what the replica has,
    /// which may lag behind). A cluster client routes to masters itself.
    /// A server that answers neither `ROLE` nor `INFO replication` (an
    /// ACL) is accepted with a warning.
    pub(crate) async fn check_role(&mut self, read_only: bool) -> Result<()> {
        let sentinel = match self {
            Conn::Cluster(_) => return Ok(()),
            Conn::Single(_) => false,
            Conn::Sentinel(_) => true,
        };
        match role(self).await.as_deref() {
            Some("master") => Ok(()),
            Some(_) if read_only => Ok(()),
            Some(role) => Err(Error::Config(format!(
                "the Redis server is a {}, not a primary: it refuses every write (READONLY). Point the \
                 ledger at the primary{}, or open it read-only (RedisLedgerOptions::read_only)",
                if role == "slave" { "replica" } else { role },
                if sentinel {
                    ""
                } else {
                    ", or let Sentinel name it: redis+sentinel://host:26379,host:26379/<master name>"
                }
            ))),
            None => {
                tracing::warn!(
                    "cannot read the redis server's role (ROLE, INFO replication); make sure it is a primary"
                );
                Ok(())
            }
        }
    }

    /// Sends `write` (one script call) and `WAIT replicas timeout` after it
    /// as one pipeline, so both go over the same connection: `WAIT` counts
    /// the replicas that have this connection's writes, and a connection
    /// opened again in between (a reconnect, a failover) would have none and
    /// answer at once. On a cluster the pipeline goes to the master of
    /// `slot` (the write's). Server errors come back as
    /// [`Value::ServerError`] in their place.
    pub(crate) async fn write_and_wait(
        &mut self,
        write: &Cmd,
        replicas: u32,
        timeout_ms: u64,
        slot: u16,
    ) -> RedisResult<Vec<Value>> {
        let mut pipe = Pipeline::with_capacity(2);
        pipe.add_command(write.clone())
            .cmd("WAIT")
            .arg(replicas)
            .arg(timeout_ms)
            .ignore_errors();
        self.pipeline_on(pipe, 2, slot).await
    }

    /// Sends `pipe` (`count` commands) as one pipeline to the master of
    /// `slot` on a cluster, or to the one server (the Sentinel's primary):
    /// commands that must reach the same node, such as a record's read and
    /// the clock it is read at.
    pub(crate) async fn pipeline_on(
        &mut self,
        pipe: Pipeline,
        count: usize,
        slot: u16,
    ) -> RedisResult<Vec<Value>> {
        match self {
            Conn::Cluster(c) => {
                c.route_pipeline(
                    pipe,
                    0,
                    count,
                    SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master)),
                )
                .await
            }
            conn => conn.req_packed_commands(&pipe, 0, count).await,
        }
    }

    /// The primary a Sentinel ledger writes to now, and how many times it
    /// moved to another; `None` for a server or a cluster.
    pub(crate) fn primary(&self) -> Option<(String, u64)> {
        match self {
            Conn::Sentinel(c) => Some((c.primary(), c.moves())),
            _ => None,
        }
    }

    /// Reads `maxmemory-policy` on every master: anything but `noeviction`
    /// fails with [`Error::Config`] when `required` (eviction can drop live
    /// leases or completed records), and is logged otherwise; a server that
    /// does not allow `CONFIG` (managed services) is logged and accepted.
    pub(crate) async fn check_eviction(&mut self, required: bool) -> Result<()> {
        for node in self.masters().await.map_err(map_err)? {
            let reply = self
                .on(
                    &node,
                    redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy").clone(),
                )
                .await;
            match reply.as_ref().map(policy_of) {
                Ok(Some(p)) if p == "noeviction" => {}
                Ok(Some(p)) if required => {
                    return Err(Error::Config(format!(
                        "redis maxmemory-policy is {p} on {node:?}: eviction can drop live leases or \
                         completed records; set noeviction (or RedisLedgerOptions::require_noeviction(false))"
                    )));
                }
                Ok(Some(p)) => tracing::warn!(policy = %p, "redis maxmemory-policy is not noeviction"),
                Ok(None) | Err(_) => {
                    tracing::warn!("cannot read redis maxmemory-policy; make sure it is noeviction")
                }
            }
        }
        Ok(())
    }

    /// Walks the keys matching `pattern` on every master, one `SCAN` page at
    /// a time. The list of masters is read once, here.
    pub(crate) async fn scan(&self, pattern: String) -> Result<Scan> {
        let mut conn = self.clone();
        let nodes = conn.masters().await.map_err(map_err)?;
        Ok(Scan {
            conn,
            nodes,
            node: 0,
            cursor: None,
            pattern,
        })
    }

    /// Every master: SCAN walks one node's keyspace, so a cluster-wide listing
    /// visits each of them.
    pub(crate) async fn masters(&mut self) -> RedisResult<Vec<Node>> {
        let Conn::Cluster(c) = self else {
            return Ok(vec![Node::Only]);
        };
        let slots = c
            .route_command(
                redis::cmd("CLUSTER").arg("SLOTS").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
            )
            .await?;
        let mut nodes = Vec::new();
        if let Value::Array(ranges) = slots {
            for range in ranges {
                let Value::Array(parts) = range else { continue };
                // [start, end, [host, port, id, ...], replicas...]: the master is third.
                let Some(Value::Array(master)) = parts.get(2) else {
                    continue;
                };
                let host = match master.first() {
                    Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                    Some(Value::SimpleString(s)) => s.clone(),
                    _ => continue,
                };
                let Some(Value::Int(port)) = master.get(1) else {
                    continue;
                };
                let Ok(port) = u16::try_from(*port) else { continue };
                let node = Node::Master { host, port };
                if !nodes.contains(&node) {
                    nodes.push(node);
                }
            }
        }
        Ok(nodes)
    }

    /// Runs a command on one node.
    pub(crate) async fn on(&mut self, node: &Node, cmd: Cmd) -> RedisResult<Value> {
        match (self, node) {
            (Conn::Cluster(c), Node::Master { host, port }) => {
                c.route_command(
                    cmd,
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.clone(),
                        port: *port,
                    }),
                )
                .await
            }
            (conn, _) => cmd.query_async(conn).await,
        }
    }
}

/// The connection settings of a single server, and of each primary a
/// Sentinel ledger connects to.
fn manager_config(opts: &RedisLedgerOptions) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(opts.connect_timeout))
        .set_response_timeout(Some(opts.request_timeout))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_secs(1))
}

/// A walk over every master's keyspace ([`Conn::scan`]).
pub(crate) struct Scan {
    conn: Conn,
    nodes: Vec<Node>,
    /// The master being walked.
    node: usize,
    /// Where that master's walk goes on (`None`: from its start).
    cursor: Option<String>,
    pattern: String,
}

impl Scan {
    /// The next page of keys (possibly empty: `SCAN` may return none and go
    /// on), or `None` once every master has been walked. A key may appear in
    /// two pages, as `SCAN` allows.
    pub(crate) async fn next_page(&mut self) -> Result<Option<Vec<String>>> {
        let Some(node) = self.nodes.get(self.node) else {
            return Ok(None);
        };
        let cursor = self.cursor.take().unwrap_or_else(|| "0".to_owned());
        let reply = self
            .conn
            .on(
                node,
                redis::cmd("SCAN")
                    .arg(&cursor)
                    .arg("MATCH")
                    .arg(&self.pattern)
                    .arg("COUNT")
                    .arg(SCAN_COUNT)
                    .clone(),
            )
            .await
            .map_err(map_err)?;
        let (next, keys) = scan_page(reply)?;
        if next == "0" {
            self.node += 1;
        } else {
            self.cursor = Some(next);
        }
        Ok(Some(keys))
    }
}

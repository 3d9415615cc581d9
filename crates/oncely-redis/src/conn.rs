//! One connection type over a single node and a cluster, so every ledger
//! operation is written once.

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, RedisFuture, RedisResult, Value};

#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
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
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
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

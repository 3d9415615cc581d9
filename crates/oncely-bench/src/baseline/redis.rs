//! The hand-written baseline on Redis: `SET key outcome NX PX ttl`, then
//! `GET` on a duplicate, on one multiplexed connection (a cluster
//! connection for `redis+cluster://`; for `redis+sentinel://`, one to the
//! primary the ledger found). A batch sends its `SET`s at once (the
//! connection pipelines them, routed per node on a cluster), then the
//! duplicates' `GET`s. When the ledger waits for replicas
//! (`?wait_replicas=`), so does the baseline: `WAIT n timeout` after each
//! claim (after each batch), an answer short of replicas an error. Keys
//! `oncely-cli-bench:<run id>:<row>:<job>`, removed at the end and expiring
//! after an hour anyway.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::join_all;
use oncely::{Error, Result};
use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, FromRedisValue, RedisError, Script};

use super::{Answer, KEY_TTL, Leased, backend_error, merge};
use crate::server::{Sample, redis_info};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone)]
enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl Conn {
    async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T> {
        // Clones share the connection: concurrent requests are pipelined on it.
        match self {
            Conn::Single(c) => cmd.query_async(&mut c.clone()).await,
            Conn::Cluster(c) => cmd.query_async(&mut c.clone()).await,
        }
        .map_err(error)
    }

    async fn script<T: FromRedisValue>(&self, script: &Script, key: &str, args: &[&str]) -> Result<T> {
        let mut invocation = script.key(key);
        for a in args {
            invocation.arg(*a);
        }
        match self {
            Conn::Single(c) => invocation.invoke_async(&mut c.clone()).await,
            Conn::Cluster(c) => invocation.invoke_async(&mut c.clone()).await,
        }
        .map_err(error)
    }
}

/// The same-guarantees completion: the outcome replaces the key's
/// in-progress value only if it still carries this delivery's token.
const FINISH: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end return 0";

fn error(e: RedisError) -> Error {
    let retryable = e.is_io_error() || e.is_timeout() || e.is_connection_dropped();
    backend_error("redis", e, retryable)
}

/// The baseline's connection and key prefix, and the `WAIT` the ledger
/// does (replicas, timeout in ms).
pub(crate) struct RedisBaseline {
    conn: Conn,
    prefix: String,
    wait: Option<(u32, u64)>,
    /// The next in-progress token (the fence), unique per run.
    token: AtomicU64,
    finish: Script,
}

impl RedisBaseline {
    /// Connects to the server (or the cluster) the ledger's URL names, or
    /// to the primary a Sentinel ledger found, as `oncely-redis` reads the
    /// URL.
    pub(super) async fn connect(
        url: &str,
        ledger: &oncely_redis::RedisLedger,
        run_id: &str,
    ) -> Result<RedisBaseline> {
        let url = oncely_redis::RedisUrl::parse(url)?;
        let primary = ledger.primary().and_then(|(p, _)| url.primary_url(&p));
        let connecting = async {
            if url.is_cluster() {
                let client = ClusterClient::new(url.nodes().to_vec()).map_err(error)?;
                client
                    .get_async_connection()
                    .await
                    .map(Conn::Cluster)
                    .map_err(error)
            } else {
                let client =
                    redis::Client::open(primary.unwrap_or_else(|| url.nodes()[0].clone())).map_err(error)?;
                client
                    .get_multiplexed_async_connection()
                    .await
                    .map(Conn::Single)
                    .map_err(error)
            }
        };
        let conn = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
            .await
            .map_err(|_| Error::Unavailable {
                backend: "redis",
                message: format!("bench baseline: no connection within {CONNECT_TIMEOUT:?}"),
            })??;
        Ok(RedisBaseline {
            conn,
            prefix: format!("oncely-cli-bench:{run_id}:"),
            wait: ledger
                .wait_replicas()
                .map(|(n, t)| (n, u64::try_from(t.as_millis()).unwrap_or(u64::MAX))),
            token: AtomicU64::new(
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(1, |d| d.as_micros() as u64),
            ),
            finish: Script::new(FINISH),
        })
    }

    pub(super) fn describe(&self) -> &'static str {
        if self.wait.is_some() {
            "SET NX PX with the outcome, GET on a duplicate, then WAIT for the replicas (batches: the SETs, then \
             the GETs, pipelined, then one WAIT)"
        } else {
            "SET NX PX with the outcome, GET on a duplicate (batches: the SETs, then the GETs, pipelined)"
        }
    }

    /// `WAIT` after this connection's writes, when the ledger waits: fewer
    /// replicas than asked is an error, as the ledger's claim is.
    async fn replicated(&self) -> Result<()> {
        let Some((n, ms)) = self.wait else {
            return Ok(());
        };
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(n).arg(ms);
        let got: i64 = self.conn.query(&cmd).await?;
        if got < i64::from(n) {
            return Err(backend_error(
                "redis",
                format!("WAIT: {got} of {n} replicas within {ms} ms"),
                true,
            ));
        }
        Ok(())
    }

    pub(super) fn key(&self, row: &str, job: usize) -> String {
        format!("{}{row}:{job}", self.prefix)
    }

    fn set_nx(key: &str, outcome: &str) -> Cmd {
        let mut cmd = redis::cmd("SET");
        cmd.arg(key)
            .arg(outcome)
            .arg("NX")
            .arg("PX")
            .arg(KEY_TTL.as_millis() as u64);
        cmd
    }

    fn get(key: &str) -> Cmd {
        let mut cmd = redis::cmd("GET");
        cmd.arg(key);
        cmd
    }

    pub(super) async fn claim(&self, key: &str, outcome: &str) -> Result<Answer> {
        let set: Option<String> = self.conn.query(&Self::set_nx(key, outcome)).await?;
        if set.is_some() {
            self.replicated().await?;
            return Ok(Answer::Won);
        }
        let stored: Option<String> = self.conn.query(&Self::get(key)).await?;
        self.replicated().await?;
        stored
            .map(Answer::Duplicate)
            .ok_or_else(|| backend_error("redis", format!("{key} was neither set nor found"), false))
    }

    pub(super) async fn claim_many(&self, items: &[(String, String)]) -> Result<Vec<Answer>> {
        let sets = items.iter().map(|(k, o)| Self::set_nx(k, o)).collect::<Vec<_>>();
        let set: Vec<Option<String>> = join_all(sets.iter().map(|cmd| self.conn.query(cmd)))
            .await
            .into_iter()
            .collect::<Result<_>>()?;
        let rest: Vec<&str> = items
            .iter()
            .zip(&set)
            .filter(|(_, s)| s.is_none())
            .map(|((k, _), _)| k.as_str())
            .collect();
        let gets = rest.iter().map(|k| Self::get(k)).collect::<Vec<_>>();
        let got: Vec<Option<String>> = join_all(gets.iter().map(|cmd| self.conn.query(cmd)))
            .await
            .into_iter()
            .collect::<Result<_>>()?;
        let stored: HashMap<String, String> = rest
            .iter()
            .zip(got)
            .filter_map(|(k, v)| v.map(|v| ((*k).to_owned(), v)))
            .collect();
        self.replicated().await?;
        let won: Vec<bool> = set.iter().map(Option::is_some).collect();
        let won: HashMap<&str, bool> = items.iter().map(|(k, _)| k.as_str()).zip(won).collect();
        merge(items, |k| won.get(k).copied().unwrap_or(false), stored, "redis")
    }

    pub(super) fn describe_leased(&self) -> &'static str {
        "SET NX PX of an in-progress token (the lease: Redis expires it), GET on a duplicate, a script \
         that replaces the token with the outcome (fenced); a duplicate in flight polls"
    }

    pub(super) async fn lease(&self, key: &str, len: Duration) -> Result<Leased> {
        loop {
            let token = self.token.fetch_add(1, Ordering::Relaxed);
            let mut set = redis::cmd("SET");
            set.arg(key)
                .arg(format!("p:{token}"))
                .arg("NX")
                .arg("PX")
                .arg(len.as_millis() as u64);
            let won: Option<String> = self.conn.query(&set).await?;
            if won.is_some() {
                self.replicated().await?;
                return Ok(Leased::Won(token));
            }
            let stored: Option<String> = self.conn.query(&Self::get(key)).await?;
            match stored {
                Some(v) if v.starts_with("d:") => {
                    self.replicated().await?;
                    return Ok(Leased::Done(v[2..].to_owned()));
                }
                Some(_) => return Ok(Leased::Busy),
                // The lease ended between the two: set it again.
                None => continue,
            }
        }
    }

    pub(super) async fn finish(&self, key: &str, fence: u64, outcome: &str) -> Result<bool> {
        let ttl = KEY_TTL.as_millis().to_string();
        let token = format!("p:{fence}");
        let done = format!("d:{outcome}");
        let set: i64 = self
            .conn
            .script(&self.finish, key, &[&token, &done, &ttl])
            .await?;
        self.replicated().await?;
        Ok(set == 1)
    }

    /// The server's CPU, commands and scripts (`INFO cpu commandstats`);
    /// none on a cluster, whose counters are per node.
    pub(super) async fn sample(&self) -> Result<Sample> {
        match &self.conn {
            Conn::Single(_) => {
                let mut cmd = redis::cmd("INFO");
                cmd.arg("cpu").arg("commandstats");
                let info: String = self.conn.query(&cmd).await?;
                Ok(redis_info(&info))
            }
            Conn::Cluster(_) => Ok(Sample::default()),
        }
    }

    pub(super) async fn remove(&self, keys: &[String]) -> Result<()> {
        // One key per command: a cluster refuses multi-key commands across
        // slots.
        for chunk in keys.chunks(500) {
            let cmds: Vec<Cmd> = chunk
                .iter()
                .map(|k| {
                    let mut cmd = redis::cmd("UNLINK");
                    cmd.arg(k);
                    cmd
                })
                .collect();
            for done in join_all(cmds.iter().map(|cmd| self.conn.query::<i64>(cmd))).await {
                done?;
            }
        }
        Ok(())
    }
}

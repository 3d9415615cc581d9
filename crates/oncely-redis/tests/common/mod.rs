//! Shared by the test binaries: the single server, the test cluster, and a
//! private throwaway server for tests that stop or pause it.
#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use oncely::conformance::{service_url, skip_or_fail};
use oncely_redis::{RedisLedger, RedisLedgerOptions};

/// The machine's Redis (ONCELY_REDIS_URL, default 127.0.0.1:6379).
pub async fn single() -> Option<RedisLedger> {
    single_with(RedisLedgerOptions::default()).await
}

/// `url` with `?ephemeral=true`: the test servers persist nothing
/// (`--save "" --appendonly no`), which a ledger refuses unless told.
pub fn ephemeral(url: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}ephemeral=true")
}

/// `opts` on the machine's Redis, accepting that it persists nothing.
pub async fn single_with(opts: RedisLedgerOptions) -> Option<RedisLedger> {
    let url = service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379"))?;
    match RedisLedger::connect_with(&url, opts.ephemeral(true)).await {
        Ok(l) => Some(l),
        Err(e) => skip_or_fail(&format!("redis at {url}: {e}")),
    }
}

/// The cluster's node URLs: ONCELY_REDIS_CLUSTER_URLS (comma-separated), or
/// the three local masters that scripts/redis-cluster.sh starts, started once
/// per test binary.
pub fn cluster_urls() -> Option<Vec<String>> {
    if let Ok(urls) = std::env::var("ONCELY_REDIS_CLUSTER_URLS") {
        return Some(
            urls.split(',')
                .map(|u| u.trim().to_owned())
                .filter(|u| !u.is_empty())
                .collect(),
        );
    }
    static UP: OnceLock<Result<(), String>> = OnceLock::new();
    let up = UP.get_or_init(|| {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/redis-cluster.sh");
        match Command::new("bash")
            .arg(script)
            .arg("up")
            .stdin(Stdio::null())
            .output()
        {
            Ok(out) if out.status.success() => Ok(()),
            Ok(out) => Err(format!(
                "{script} up failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => Err(format!("{script}: {e}")),
        }
    });
    match up {
        Ok(()) => Some((7000..=7002).map(|p| format!("redis://127.0.0.1:{p}")).collect()),
        Err(e) => skip_or_fail(e),
    }
}

pub async fn cluster() -> Option<RedisLedger> {
    cluster_with(RedisLedgerOptions::default()).await
}

/// The cluster as one `redis+cluster://` URL, the way the ledger opens it.
pub fn cluster_url() -> Option<String> {
    Some(format!("redis+cluster://{}", cluster_urls()?.join(",")))
}

/// `opts` on the test cluster, accepting that it persists nothing.
pub async fn cluster_with(opts: RedisLedgerOptions) -> Option<RedisLedger> {
    let url = cluster_url()?;
    match RedisLedger::connect_with(&url, opts.ephemeral(true)).await {
        Ok(l) => Some(l),
        Err(e) => skip_or_fail(&format!("redis cluster at {url}: {e}")),
    }
}

/// A plain connection to one node, for looking under the ledger.
pub async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// A redis-server of this test's own on a free loopback port, killed on drop.
pub struct TempRedis {
    child: Child,
    pub port: u16,
    dir: std::path::PathBuf,
}

impl TempRedis {
    pub async fn start(extra: &[&str]) -> Option<TempRedis> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!("oncely-redis-test-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let child = match Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(&dir)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => return skip_or_fail(&format!("cannot start redis-server: {e}")),
        };
        let server = TempRedis { child, port, dir };
        for _ in 0..100 {
            if let Ok(client) = redis::Client::open(server.url())
                && let Ok(mut c) = client.get_multiplexed_async_connection().await
                && redis::cmd("PING").query_async::<String>(&mut c).await.is_ok()
            {
                return Some(server);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("redis-server on port {port} did not start");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// [`TempRedis::url`] for a ledger: it persists nothing unless `extra`
    /// said otherwise, so the URL accepts that.
    pub fn ledger_url(&self) -> String {
        ephemeral(&self.url())
    }

    /// Kills the server at once (no shutdown handshake) and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for TempRedis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

//! Shared by the test binaries: the single server, the test cluster, the
//! Sentinel fixture, and a private throwaway server for tests that stop or
//! pause it.
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
        signal(self.child.id(), "CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends the server a signal (`STOP`, `CONT`).
    pub fn signal(&self, sig: &str) {
        signal(self.child.id(), sig);
    }
}

/// `kill -<sig> <pid>`.
pub fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("kill");
    assert!(status.success() || sig == "CONT", "kill -{sig} {pid}");
}

/// Waits until the replica at `url` has its link to its primary up (a
/// replica that just started may drop a connection while it syncs: each
/// look takes a new one). A rejoining old primary loads its own
/// append-only file, then takes a full copy from the new primary: on a
/// busy machine that can take many seconds, so the bound is generous, and
/// a replica that never links fails with what it last reported.
pub async fn replica_linked(url: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let mut last = String::from("no answer");
    while std::time::Instant::now() < deadline {
        let info = async {
            let mut conn = redis::Client::open(url)?
                .get_multiplexed_async_connection()
                .await?;
            redis::cmd("INFO")
                .arg("replication")
                .query_async::<String>(&mut conn)
                .await
        };
        match tokio::time::timeout(Duration::from_secs(5), info).await {
            Ok(Ok(info)) if info.lines().any(|l| l.trim() == "master_link_status:up") => return,
            Ok(Ok(info)) => last = info,
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "no answer in 5 s".into(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the replica at {url} never linked to its primary; it last reported: {last}");
}

/// The Sentinel fixture's master name, its Sentinels, and the URL that
/// names its primary through them (scripts/redis-sentinel.sh).
pub const MASTER: &str = "mymaster";
pub const SENTINELS: [u16; 3] = [26390, 26391, 26392];
pub const PRIMARY: u16 = 6390;
pub const REPLICA: u16 = 6391;

pub fn sentinel_url() -> String {
    let list: Vec<String> = SENTINELS.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    format!("redis+sentinel://{}/{MASTER}", list.join(","))
}

/// Starts the Sentinel fixture (the primary on 6390, its replica, three
/// Sentinels), or finds it healthy; `false` (or a failure, with
/// ONCELY_REQUIRE_SERVICES=1) when it cannot.
pub fn sentinel_up() -> bool {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/redis-sentinel.sh");
    match Command::new("bash")
        .arg(script)
        .arg("up")
        .stdin(Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => true,
        Ok(out) => skip_or_fail::<()>(&format!(
            "{script} up failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
        .is_some(),
        Err(e) => skip_or_fail::<()>(&format!("{script}: {e}")).is_some(),
    }
}

/// Starts the fixture's server on `port` (the old primary, after a
/// failover) again as a replica of the new primary, and waits until it
/// replicates.
pub async fn sentinel_rejoin(port: u16) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/redis-sentinel.sh");
    let out = Command::new("bash")
        .arg(script)
        .arg("rejoin")
        .arg(port.to_string())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script} rejoin {port}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    replica_linked(&format!("redis://127.0.0.1:{port}")).await;
}

/// The pid of a fixture server (by port), from its pid file.
pub fn fixture_pid(port: u16) -> u32 {
    let dir =
        std::env::var("ONCELY_REDIS_SENTINEL_DIR").unwrap_or_else(|_| "/tmp/oncely-redis-sentinel".into());
    let file = format!("{dir}/{port}.pid");
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{file}: {e}"))
        .trim()
        .parse()
        .unwrap()
}

/// `opts` on the Sentinel fixture's primary, through its Sentinels: the
/// fixture started (or found healthy) once per test binary, for tests that
/// never fail it over.
pub async fn sentinel_with(opts: RedisLedgerOptions) -> Option<RedisLedger> {
    static UP: OnceLock<bool> = OnceLock::new();
    if !*UP.get_or_init(sentinel_up) {
        return None;
    }
    let url = sentinel_url();
    match RedisLedger::connect_with(&url, opts).await {
        Ok(l) => Some(l),
        Err(e) => skip_or_fail(&format!("redis sentinel at {url}: {e}")),
    }
}

impl Drop for TempRedis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

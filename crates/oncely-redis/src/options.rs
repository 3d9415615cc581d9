//! How a ledger opens: [`RedisLedgerOptions`], and the URL forms of this
//! backend (`redis://host:port[/db]` for one server,
//! `redis+cluster://h1:p1,h2:p2[?…]` for a cluster,
//! `redis+sentinel://s1:p1,s2:p2/master[/db]` for a primary found through
//! Sentinel) turned into what the redis client connects to ([`parse_url`]).
//! Nothing here touches a server.

use std::time::Duration;

use oncely::open::LedgerOptions;
use oncely::open::UrlParams;
use oncely::{Error, Result};
use redis::IntoConnectionInfo;

/// The schemes of [`FromUrl`](oncely::open::FromUrl): one server, a
/// cluster's seed nodes, or the Sentinels that name a primary.
pub(crate) const SCHEMES: &[&str] = &["redis", "redis+cluster", "redis+sentinel"];

const DEFAULT_PREFIX: &str = "oncely:";

/// What the messages of a malformed URL point to.
const FORMS: &str = "redis://host:port[/db], redis+cluster://host:port,host:port,… or redis+sentinel://host:port,host:port,…/master[/db]";

/// The port of a Sentinel that a `redis+sentinel://` URL lists without one.
const SENTINEL_PORT: u16 = 26379;

/// How long a `WAIT` waits when the URL sets `?wait_replicas=` and neither
/// it nor the options say how long.
const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(1);

/// The query parameters a URL may set on the ledger itself
/// ([`RedisLedgerOptions::prefix`], [`RedisLedgerOptions::ephemeral`],
/// [`RedisLedgerOptions::wait_replicas`]); the redis client never sees them.
const OWN_PARAMS: &[&str] = &["prefix", "ephemeral", "wait_replicas", "wait_timeout_ms"];

/// The query parameters the redis client reads (redis 1.x) on a TCP URL
/// (`redis://`, each node of `redis+cluster://`); it ignores any other.
const DRIVER_PARAMS: &[&str] = &["protocol"];

/// The ones it reads on a Unix socket's URL (`unix://`, `redis+unix://`).
const UNIX_DRIVER_PARAMS: &[&str] = &["db", "user", "pass", "protocol"];

/// Options of a [`RedisLedger`](crate::RedisLedger).
/// `RedisLedgerOptions::default()` gives the prefix `oncely:`, a 2 s
/// connect timeout, a 5 s request timeout, a required `noeviction`
/// policy, a server that must persist (not ephemeral), change
/// notifications, a ledger that writes, and no waiting for replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisLedgerOptions {
    pub(crate) prefix: String,
    pub(crate) connect_timeout: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) require_noeviction: bool,
    pub(crate) ephemeral: bool,
    pub(crate) read_only: bool,
    pub(crate) notifications: bool,
    pub(crate) wait: Option<Wait>,
}

/// `WAIT replicas timeout` after each lease write
/// ([`RedisLedgerOptions::wait_replicas`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wait {
    pub(crate) replicas: u32,
    pub(crate) timeout: Duration,
}

impl Default for RedisLedgerOptions {
    fn default() -> Self {
        RedisLedgerOptions {
            prefix: DEFAULT_PREFIX.to_owned(),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
            require_noeviction: true,
            ephemeral: false,
            read_only: false,
            notifications: true,
            wait: None,
        }
    }
}

impl RedisLedgerOptions {
    /// Sets the key prefix (default `oncely:`): at most 64 printable ASCII
    /// characters, none of `{ } * ? [ ] \` (they would change the hash tag or
    /// the `SCAN` patterns). Checked when connecting.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long establishing a connection may take (default 2 s): the
    /// first connection, each reconnection, the change-notification
    /// subscriber's.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long one request (a script call, a command) waits for the
    /// server's answer (default 5 s); a timeout is a retryable
    /// [`Error::Backend`] (the operation may still have been applied,
    /// exactly like a dropped future).
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Whether connecting fails on a `maxmemory-policy` other than
    /// `noeviction` (default `true`). Turn it off only for a server whose
    /// memory can never fill up.
    pub fn require_noeviction(mut self, yes: bool) -> Self {
        self.require_noeviction = yes;
        self
    }

    /// Whether the ledger accepts a server that persists nothing (default
    /// `false`): `appendonly no` and no `save` points, as a test server
    /// often runs. Connecting reads each master's persistence settings
    /// (see the crate docs, Durability) and refuses such a server with
    /// [`Error::Config`], since a restart would lose every claim and
    /// outcome and let redelivered effects run again; with `true` it is
    /// accepted and [`Capabilities::durability`](oncely::backend::Capabilities::durability)
    /// says none. The URL parameter `?ephemeral=true` sets it too, and wins
    /// over this option (`?ephemeral=false` turns it off). Nothing else
    /// changes: the ledger writes as it always does. A read-only ledger
    /// ([`RedisLedgerOptions::read_only`]) is never refused for this: it
    /// writes nothing, and what it reads is there until the server stops.
    pub fn ephemeral(mut self, yes: bool) -> Self {
        self.ephemeral = yes;
        self
    }

    /// Whether the ledger only reads (default `false`), for operator commands
    /// that must not change anything (`get`, `abandoned`, `horizon`). It
    /// connects exactly as a writing ledger does (Redis has nothing to create
    /// or migrate), and every write ([`claim`](oncely::backend::Ledger::claim),
    /// `complete`, `release`, `renew`, `prune`) fails with [`Error::Config`]
    /// before any round trip, as the SQL backends' read-only ledgers do.
    pub fn read_only(mut self, yes: bool) -> Self {
        self.read_only = yes;
        self
    }

    /// Whether the ledger subscribes to change notifications (default
    /// `true`): one more connection per ledger (per set of clones), so that
    /// a duplicate waiting for a record in progress is woken when another
    /// process completes or releases it (see the crate docs, Waiting).
    /// Without it, such a duplicate polls (5 ms, doubling up to 250 ms), and
    /// the ledger never asks others to publish. Turn it off where the
    /// server's ACL does not let the ledger's user subscribe to
    /// `<prefix>#changes@<db>`, or to save the connection.
    pub fn notifications(mut self, yes: bool) -> Self {
        self.notifications = yes;
        self
    }

    /// Whether a lease write is acknowledged only once `replicas` replicas
    /// have it (default: not asked, `0`). With `n` ≥ 1, each claim that
    /// acquires, each completion, release and renewal is followed by
    /// `WAIT n timeout` on the same connection, in the same round trip
    /// (pipelined), and counts only if at least `n` replicas acknowledged
    /// it within `timeout`:
    ///
    /// - a claim that acquired but fell short is *not granted*: it is given
    ///   back (released, so the next delivery can claim at once) and the
    ///   claim fails with [`Error::Unavailable`], retryable, before any
    ///   handler runs. The primary applied it and a replica may still get
    ///   it, so it may or may not survive a failover; not granting it is
    ///   the answer that is safe either way;
    /// - a claim that found the effect completed (or abandoned) answers so
    ///   only once `n` replicas have the record (the script rewrites one of
    ///   its fields to itself, so that the `WAIT` covers it): a duplicate is
    ///   never told "done" from a completion that a failover can still lose;
    /// - a completion, release or renewal that fell short fails with a
    ///   retryable [`Error::Backend`]: it was applied on the primary and a
    ///   failover may lose it. [`Effects::run`](oncely::Effects::run) turns a
    ///   completion's into [`Error::OutcomeUnknown`](oncely::Error::OutcomeUnknown).
    ///
    /// `timeout` must be at least 1 ms and shorter than the request timeout
    /// ([`Error::Config`] when connecting otherwise): a `WAIT` without a
    /// timeout blocks forever. Prune, the horizon and reads do not wait. The
    /// URL parameters `?wait_replicas=n` and `?wait_timeout_ms=t` set it too
    /// and win over this option (`?wait_replicas=0` turns it off). See the
    /// crate docs, Replication, for what `WAIT` still does not promise: it
    /// is not consensus.
    pub fn wait_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait = (replicas > 0).then_some(Wait { replicas, timeout });
        self
    }

    /// The default options with what `url`'s query sets (`?prefix=`,
    /// `?ephemeral=`, `?wait_replicas=`, `?wait_timeout_ms=`), checked:
    /// [`Error::Config`] for a malformed URL or a parameter neither the
    /// ledger nor the redis client reads. Nothing connects; the servers
    /// the URL names are [`RedisUrl`]'s.
    pub fn from_url(url: &str) -> Result<Self> {
        let options = RedisUrl::parse(url)?.apply(RedisLedgerOptions::default());
        options.check()?;
        Ok(options)
    }

    pub(crate) fn check(&self) -> Result<()> {
        if let Some(w) = self.wait
            && (w.timeout < Duration::from_millis(1) || w.timeout >= self.request_timeout)
        {
            return Err(Error::Config(format!(
                "RedisLedgerOptions::wait_replicas: the WAIT timeout ({:?}) must be at least 1 ms and shorter \
                 than the response timeout ({:?}, RedisLedgerOptions::request_timeout), or a replica that falls \
                 behind would end every write as a response timeout",
                w.timeout, self.request_timeout
            )));
        }
        let ok = self.prefix.len() <= 64
            && self.prefix.bytes().all(|b| {
                b.is_ascii_graphic() && !matches!(b, b'{' | b'}' | b'*' | b'?' | b'[' | b']' | b'\\')
            });
        if !ok {
            return Err(Error::Config(format!(
                "redis key prefix {:?} must be at most 64 printable ASCII characters without {{ }} * ? [ ] \\",
                self.prefix
            )));
        }
        Ok(())
    }
}

/// How [`FromUrl::from_url`](oncely::open::FromUrl::from_url) opens
/// ([`LedgerOptions::for_open`]). Redis has nothing to create or migrate,
/// so [`Access::Existing`](oncely::open::Access::Existing) opens as
/// [`Access::Migrate`](oncely::open::Access::Migrate) does.
impl LedgerOptions for RedisLedgerOptions {
    fn existing_only(self) -> Self {
        self
    }

    fn reads_only(self) -> Self {
        self.read_only(true)
    }

    fn open_within(self, timeout: Duration) -> Self {
        self.connect_timeout(timeout)
    }
}

/// The server(s) a URL names, as the redis client takes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// One server: a URL for `redis::Client::open`.
    Single(String),
    /// A cluster's seed nodes, each a `redis://` URL; never empty.
    Cluster(Vec<String>),
    /// A primary named by Sentinels.
    Sentinel(SentinelTarget),
}

/// What a `redis+sentinel://` URL names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SentinelTarget {
    /// The Sentinels, each `redis://host:port`; never empty.
    pub(crate) sentinels: Vec<String>,
    /// The name they monitor the primary under.
    pub(crate) master: String,
    /// `user:password@` or nothing: the primary's credentials.
    auth: String,
    /// The database on the primary.
    pub(crate) db: i64,
    /// `?protocol=…` or nothing: the client's parameters for the primary.
    query: String,
}

impl SentinelTarget {
    /// The URL of the primary (or a replica) the Sentinels name at
    /// `host:port`, with the URL's credentials, database and parameters.
    pub(crate) fn node_url(&self, host: &str, port: u16) -> String {
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        self.url_at(&format!("{host}:{port}"))
    }

    /// [`SentinelTarget::node_url`] of an address already written
    /// `host:port`.
    fn url_at(&self, addr: &str) -> String {
        format!("redis://{}{addr}/{}{}", self.auth, self.db, self.query)
    }
}

impl Target {
    /// The servers as an operator reads them (`host:port` each, or a
    /// socket's path), as the redis client reads each URL: never a
    /// credential or a parameter. For Sentinel, the Sentinels.
    pub(crate) fn servers(&self) -> String {
        let nodes = match self {
            Target::Single(url) => std::slice::from_ref(url),
            Target::Cluster(nodes) => nodes.as_slice(),
            Target::Sentinel(s) => s.sentinels.as_slice(),
        };
        nodes
            .iter()
            .map(|n| {
                n.as_str()
                    .into_connection_info()
                    .map_or_else(|_| "?".to_owned(), |i| i.addr().to_string())
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// What a Redis URL names (the forms of [`RedisLedger::connect`](crate::RedisLedger::connect)):
/// the server(s), and the ledger options its query sets. Parsed once, by
/// this crate, for the ledger and for any tool that needs the same servers
/// (`RedisUrl::from_str`, [`RedisUrl::parse`]). Its `Debug` may show
/// credentials; [`RedisUrl::servers`] never does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisUrl {
    /// The server(s), the ledger's own parameters taken off.
    pub(crate) target: Target,
    /// `?prefix=`.
    pub(crate) prefix: Option<String>,
    /// `?ephemeral=true|false`.
    pub(crate) ephemeral: Option<bool>,
    /// `?wait_replicas=n`, with `?wait_timeout_ms=t` if given.
    pub(crate) wait_replicas: Option<u32>,
    pub(crate) wait_timeout: Option<Duration>,
}

impl std::str::FromStr for RedisUrl {
    type Err = Error;

    /// [`RedisUrl::parse`].
    fn from_str(url: &str) -> Result<RedisUrl> {
        RedisUrl::parse(url)
    }
}

impl RedisUrl {
    /// Reads a URL: a malformed one, or a query parameter neither the
    /// ledger nor the redis client reads, is [`Error::Config`], and no
    /// message quotes the URL. Nothing connects.
    pub fn parse(url: &str) -> Result<RedisUrl> {
        let url = url.trim();
        let scheme = url.split_once("://").map_or("", |(s, _)| s);
        let driver = if ["unix", "redis+unix"]
            .iter()
            .any(|u| scheme.eq_ignore_ascii_case(u))
        {
            UNIX_DRIVER_PARAMS
        } else {
            DRIVER_PARAMS
        };
        let params = UrlParams::parse(url, "Redis", OWN_PARAMS, driver)?;
        let ephemeral = match params.get("ephemeral") {
            None => None,
            Some("true") => Some(true),
            Some("false") => Some(false),
            Some(_) => {
                return Err(Error::Config(
                    "Redis URL parameter ephemeral must be true or false".to_owned(),
                ));
            }
        };
        let number = |name: &str| -> Result<Option<u64>> {
            params
                .get(name)
                .map(|v| {
                    v.parse::<u64>().map_err(|_| {
                        Error::Config(format!("Redis URL parameter {name} must be a whole number"))
                    })
                })
                .transpose()
        };
        let wait_replicas = number("wait_replicas")?
            .map(|n| {
                u32::try_from(n)
                    .map_err(|_| Error::Config("Redis URL parameter wait_replicas is too large".into()))
            })
            .transpose()?;
        let wait_timeout = number("wait_timeout_ms")?.map(Duration::from_millis);
        if wait_timeout.is_some() && wait_replicas.is_none() {
            return Err(Error::Config(
                "Redis URL parameter wait_timeout_ms goes with wait_replicas (how many replicas to wait for)"
                    .to_owned(),
            ));
        }
        Ok(RedisUrl {
            target: parse_url(params.driver_url())?,
            prefix: params.get("prefix").map(str::to_owned),
            ephemeral,
            wait_replicas,
            wait_timeout,
        })
    }

    /// Whether the URL names a Redis Cluster (`redis+cluster://`).
    pub fn is_cluster(&self) -> bool {
        matches!(self.target, Target::Cluster(_))
    }

    /// The URL of each server the client connects to first, as the redis
    /// client takes it (credentials included, the ledger's own parameters
    /// taken off): the one server; a cluster's seed nodes, each with the
    /// credentials of the first node that has them and the URL's query; or
    /// the Sentinels of a `redis+sentinel://` URL.
    pub fn nodes(&self) -> &[String] {
        match &self.target {
            Target::Single(url) => std::slice::from_ref(url),
            Target::Cluster(nodes) => nodes,
            Target::Sentinel(s) => &s.sentinels,
        }
    }

    /// For a `redis+sentinel://` URL, the URL of the primary the Sentinels
    /// named at `addr` (`host:port`, as
    /// [`RedisLedger::primary`](crate::RedisLedger::primary) gives it),
    /// with the URL's credentials, database and client parameters; `None`
    /// for the other forms.
    pub fn primary_url(&self, addr: &str) -> Option<String> {
        match &self.target {
            Target::Sentinel(s) => Some(s.url_at(addr)),
            _ => None,
        }
    }

    /// The servers as an operator reads them (`host:port` each): never a
    /// credential or a parameter.
    pub fn servers(&self) -> String {
        self.target.servers()
    }

    /// `options` with what the URL sets. The URL's parameters win over the
    /// options': the URL is what a deployment configures.
    pub fn apply(&self, mut options: RedisLedgerOptions) -> RedisLedgerOptions {
        if let Some(prefix) = &self.prefix {
            options.prefix = prefix.clone();
        }
        if let Some(yes) = self.ephemeral {
            options.ephemeral = yes;
        }
        if let Some(n) = self.wait_replicas {
            let timeout = self
                .wait_timeout
                .or(options.wait.map(|w| w.timeout))
                .unwrap_or(DEFAULT_WAIT_TIMEOUT);
            options = options.wait_replicas(n, timeout);
        }
        options
    }
}

/// Refuses a URL whose scheme is not one of [`SCHEMES`] (case aside).
pub(crate) fn check_scheme(url: &str) -> Result<()> {
    match url.trim().split_once("://") {
        Some((scheme, _)) if SCHEMES.iter().any(|s| scheme.eq_ignore_ascii_case(s)) => Ok(()),
        _ => Err(Error::Config(format!("a Redis URL is {FORMS}"))),
    }
}

/// Splits a URL into what the ledger connects to:
///
/// - `redis+cluster://` followed by the seed nodes, comma-separated, each
///   `host:port` or `redis://host:port`. The credentials of the first node
///   (`redis+cluster://user:pw@h1:7000,h2:7000`) apply to the nodes that
///   carry none (every node of one cluster takes the same ones), and a query
///   string (`?protocol=resp3`) applies to every node.
/// - `redis+sentinel://` followed by the Sentinels (as a cluster's seeds,
///   port 26379 by default), `/`, the master's name and optionally `/db`
///   ([`SentinelTarget`]).
/// - `redis://host:port[/db]`: one server. A comma in its host part is
///   refused with a pointer to `redis+cluster://`, rather than handed to the
///   client as a host name that can never resolve. (Only the host part: a
///   password may hold a comma, as `connect` has always accepted.)
/// - any other scheme with `://` (`unix://`, `redis+unix://`, `rediss://`):
///   one server, the URL handed to the redis client as it is, as `connect`
///   always did (`rediss://` needs TLS features this crate does not enable,
///   so the client refuses it).
///
/// Messages never quote the URL: it may hold a password.
pub(crate) fn parse_url(url: &str) -> Result<Target> {
    let url = url.trim();
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(Error::Config(format!("a Redis URL is {FORMS}")));
    };
    if scheme.eq_ignore_ascii_case("redis+cluster") {
        return cluster_nodes(rest).map(Target::Cluster);
    }
    if scheme.eq_ignore_ascii_case("redis+sentinel") {
        return sentinel_target(rest).map(Target::Sentinel);
    }
    if !scheme.eq_ignore_ascii_case("redis") {
        return Ok(Target::Single(url.to_owned()));
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    if host.contains(',') {
        return Err(Error::Config(
            "a redis:// URL names one server; give a cluster's nodes as \
             redis+cluster://host:port,host:port,…"
                .to_owned(),
        ));
    }
    Ok(Target::Single(format!("redis://{rest}")))
}

/// What a `redis+sentinel://` URL names, after its `://`:
/// `[user:password@]host[:port],host[:port],…/master[/db][?…]`. The
/// Sentinels are listed like a cluster's seeds (port 26379 when none is
/// given); the credentials, the database and the query are the primary's:
/// the Sentinels are asked without credentials.
fn sentinel_target(rest: &str) -> Result<SentinelTarget> {
    const FORM: &str = "redis+sentinel://host:port,host:port,…/master[/db]";
    let (rest, query) = match rest.split_once('?') {
        Some((rest, query)) => (rest, format!("?{query}")),
        None => (rest, String::new()),
    };
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (auth, hosts) = match authority.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), authority),
    };
    let mut sentinels = Vec::new();
    for (i, item) in hosts.split(',').map(str::trim).enumerate() {
        if item.is_empty() {
            continue;
        }
        let has_port = item
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && !port.contains(']'));
        let node = if has_port {
            format!("redis://{item}")
        } else {
            format!("redis://{item}:{SENTINEL_PORT}")
        };
        if item.contains(['@', '/']) || node.as_str().into_connection_info().is_err() {
            return Err(Error::Config(format!(
                "redis+sentinel:// Sentinel {} is not host[:port] (expected {FORM})",
                i + 1
            )));
        }
        sentinels.push(node);
    }
    if sentinels.is_empty() {
        return Err(Error::Config(format!(
            "redis+sentinel:// lists no Sentinels (expected {FORM})"
        )));
    }
    let mut segments = path.split('/');
    let master = segments.next().unwrap_or_default();
    if master.is_empty() || master.contains(|c: char| c.is_whitespace() || c.is_control()) {
        return Err(Error::Config(format!(
            "redis+sentinel:// names no master (expected {FORM})"
        )));
    }
    let db = match segments.next() {
        None | Some("") => 0,
        Some(db) => db.parse::<i64>().ok().filter(|d| *d >= 0).ok_or_else(|| {
            Error::Config(format!(
                "redis+sentinel:// database must be a number (expected {FORM})"
            ))
        })?,
    };
    if segments.any(|s| !s.is_empty()) {
        return Err(Error::Config(format!(
            "redis+sentinel:// has more than a master and a database in its path (expected {FORM})"
        )));
    }
    let target = SentinelTarget {
        sentinels,
        master: master.to_owned(),
        auth,
        db,
        query,
    };
    // The credentials and parameters must make a URL the client takes.
    if target
        .node_url("127.0.0.1", 1)
        .as_str()
        .into_connection_info()
        .is_err()
    {
        return Err(Error::Config(format!(
            "redis+sentinel:// credentials or parameters are not valid (expected {FORM})"
        )));
    }
    Ok(target)
}

/// The seed nodes of a `redis+cluster://` URL, after its `://`.
fn cluster_nodes(rest: &str) -> Result<Vec<String>> {
    let (list, query) = match rest.split_once('?') {
        Some((list, query)) => (list, Some(query)),
        None => (rest, None),
    };
    let mut userinfo: Option<&str> = None;
    let mut nodes = Vec::new();
    for (i, item) in list.split(',').map(str::trim).enumerate() {
        if item.is_empty() {
            continue;
        }
        let item = match item.split_once("://") {
            Some((s, node)) if s.eq_ignore_ascii_case("redis") => node,
            Some(_) => {
                return Err(Error::Config(format!(
                    "redis+cluster:// node {} has a scheme other than redis://; \
                     nodes are host:port or redis://host:port",
                    i + 1
                )));
            }
            None => item,
        };
        let own = item.rsplit_once('@').map(|(u, _)| u);
        // The first node's credentials stand for the cluster's: every node
        // of one cluster takes the same ones.
        if nodes.is_empty() {
            userinfo = own;
        }
        let mut node = String::from("redis://");
        if let (None, Some(u)) = (own, userinfo) {
            node.push_str(u);
            node.push('@');
        }
        node.push_str(item);
        if let Some(q) = query {
            node.push('?');
            node.push_str(q);
        }
        nodes.push(node);
    }
    if nodes.is_empty() {
        return Err(Error::Config(format!(
            "redis+cluster:// lists no nodes (expected {FORMS})"
        )));
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_checked() {
        for good in ["oncely:", "", "app-1/ledger:", "a.b_c"] {
            assert!(
                RedisLedgerOptions::default().prefix(good).check().is_ok(),
                "{good:?}"
            );
        }
        for bad in [
            "a{b",
            "a}",
            "a*",
            "a?",
            "a[b]",
            "a\\b",
            "a b",
            "é",
            &"x".repeat(65),
        ] {
            let e = RedisLedgerOptions::default().prefix(bad).check().unwrap_err();
            assert!(matches!(e, Error::Config(_)), "{bad:?}");
        }
    }

    #[test]
    fn redis_urls_name_one_server_or_a_cluster() {
        let single = |url: &str| Target::Single(url.to_owned());
        let cluster = |nodes: &[&str]| Target::Cluster(nodes.iter().map(|n| n.to_string()).collect());
        let cases = [
            ("redis://127.0.0.1:6379", single("redis://127.0.0.1:6379")),
            ("REDIS://h:1/3", single("redis://h:1/3")),
            (" redis://h:1 ", single("redis://h:1")),
            ("redis+cluster://a:7000", cluster(&["redis://a:7000"])),
            ("Redis+Cluster://a:7000", cluster(&["redis://a:7000"])),
            (
                "redis+cluster://a:7000, b:7001 ,redis://c:7002,",
                cluster(&["redis://a:7000", "redis://b:7001", "redis://c:7002"]),
            ),
            // The first node's credentials go to the nodes without their
            // own; a node with its own keeps them.
            (
                "redis+cluster://u:pw@a:7000,b:7001,v:x@c:7002",
                cluster(&["redis://u:pw@a:7000", "redis://u:pw@b:7001", "redis://v:x@c:7002"]),
            ),
            // The query applies to every node.
            (
                "redis+cluster://a:7000,b:7001?protocol=resp3",
                cluster(&["redis://a:7000?protocol=resp3", "redis://b:7001?protocol=resp3"]),
            ),
            // A comma in a password is not a node list.
            ("redis://:a,b@h:1/2", single("redis://:a,b@h:1/2")),
            // Other single-server forms go to the client as given.
            ("unix:///run/redis.sock", single("unix:///run/redis.sock")),
        ];
        for (url, want) in cases {
            assert_eq!(parse_url(url).unwrap(), want, "{url}");
        }
    }

    #[test]
    fn bad_redis_urls_are_config_errors_without_the_password() {
        for (url, says) in [
            ("redis://:hunter2@a:7000,b:7001", "redis+cluster://"),
            ("redis://:hunter2@a:7000,b:7001/0", "redis+cluster://"),
            ("redis+cluster://", "no nodes"),
            ("redis+cluster://, ,", "no nodes"),
            ("redis+cluster://a:7000,nats://:hunter2@b:1", "node 2"),
            ("redis:hunter2", "redis://host:port"),
        ] {
            let m = match parse_url(url) {
                Err(Error::Config(m)) => m,
                other => panic!("{url}: expected Error::Config, got {other:?}"),
            };
            assert!(m.contains(says), "{url}: {m}");
            assert!(!m.contains("hunter2"), "{url}: {m}");
        }
    }

    #[test]
    fn the_url_names_the_prefix_and_nothing_unknown() {
        let u = RedisUrl::parse("redis://:pw@h:1/2?prefix=billing%3A&protocol=resp3").unwrap();
        assert_eq!(
            u.target,
            Target::Single("redis://:pw@h:1/2?protocol=resp3".to_owned())
        );
        assert_eq!(u.prefix.as_deref(), Some("billing:"));
        assert_eq!(u.target.servers(), "h:1");
        let opts = u.apply(RedisLedgerOptions::default().prefix("from_code:"));
        assert_eq!(opts.prefix, "billing:");
        let u = RedisUrl::parse("redis+cluster://u:pw@a:7000,b:7001?prefix=p:").unwrap();
        assert_eq!(
            u.target,
            Target::Cluster(vec![
                "redis://u:pw@a:7000".to_owned(),
                "redis://u:pw@b:7001".to_owned()
            ])
        );
        assert_eq!(u.target.servers(), "a:7000,b:7001");
        let u = RedisUrl::parse("redis://h:1").unwrap();
        assert_eq!(u.prefix, None);
        assert_eq!(u.apply(RedisLedgerOptions::default()).prefix, "oncely:");
        for (url, says) in [
            (
                "redis://:hunter2@h:1?prefx=a:",
                "unknown Redis URL parameter 'prefx' (expected prefix, ephemeral, wait_replicas, wait_timeout_ms, or one its driver reads: protocol)",
            ),
            ("redis+cluster://a:1,b:2?db=3", "unknown Redis URL parameter 'db'"),
            (
                "redis://h:1?prefix=a&prefix=b",
                "Redis URL parameter prefix is given twice",
            ),
            ("redis://h:1?hunter2:x", "unknown Redis URL parameter (expected"),
        ] {
            let m = match RedisUrl::parse(url) {
                Err(Error::Config(m)) => m,
                other => panic!("{url}: expected Error::Config, got {other:?}"),
            };
            assert!(m.contains(says), "{url}: {m}");
            assert!(!m.contains("hunter2"), "{url}: {m}");
        }
    }

    /// What a tool that connects to the same servers reads (the `oncely
    /// bench` baseline, which once split these URLs itself).
    #[test]
    fn a_parsed_url_gives_its_nodes_and_a_sentinel_primarys_url() {
        let url =
            RedisUrl::parse("redis+cluster://u:pw@a:7000, b:7001 ,redis://c:7002?protocol=resp3").unwrap();
        assert!(url.is_cluster());
        assert_eq!(
            url.nodes(),
            [
                "redis://u:pw@a:7000?protocol=resp3",
                "redis://u:pw@b:7001?protocol=resp3",
                "redis://u:pw@c:7002?protocol=resp3"
            ]
        );
        assert_eq!(url.primary_url("h:1"), None);
        let url: RedisUrl = "redis+cluster://a:1".parse().unwrap();
        assert_eq!(url.nodes(), ["redis://a:1"]);
        let url =
            RedisUrl::parse("redis+sentinel://u:pw@s1:26379,s2:26379/mymaster/3?wait_replicas=1").unwrap();
        assert!(!url.is_cluster());
        assert_eq!(
            url.primary_url("10.0.0.5:6379").as_deref(),
            Some("redis://u:pw@10.0.0.5:6379/3")
        );
        let url = RedisUrl::parse("redis+sentinel://s1/m").unwrap();
        assert_eq!(url.primary_url("h:1").as_deref(), Some("redis://h:1/0"));
        let url = RedisUrl::parse("redis://u:pw@h:6379/2?prefix=p:").unwrap();
        assert_eq!(url.nodes(), ["redis://u:pw@h:6379/2"]);
        assert_eq!(url.servers(), "h:6379");
    }

    #[test]
    fn options_from_a_url_are_the_defaults_with_its_parameters() {
        let o = RedisLedgerOptions::from_url("redis://h:6379?prefix=billing:&ephemeral=true").unwrap();
        assert_eq!(
            o,
            RedisLedgerOptions::default().prefix("billing:").ephemeral(true)
        );
        for bad in [
            "redis://h?prefix=a*b",
            "redis://h?wait_replicas=1&wait_timeout_ms=9000",
            "redis://h?x=1",
        ] {
            assert!(
                matches!(RedisLedgerOptions::from_url(bad), Err(Error::Config(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn sentinel_urls_name_the_sentinels_and_a_master() {
        let target = |url: &str| match parse_url(url).unwrap() {
            Target::Sentinel(s) => s,
            other => panic!("{url}: {other:?}"),
        };
        let s = target("redis+sentinel://127.0.0.1:26390, 127.0.0.1:26391 ,h3/mymaster");
        assert_eq!(
            s.sentinels,
            [
                "redis://127.0.0.1:26390",
                "redis://127.0.0.1:26391",
                "redis://h3:26379"
            ]
        );
        assert_eq!((s.master.as_str(), s.db), ("mymaster", 0));
        assert_eq!(s.node_url("10.0.0.5", 6379), "redis://10.0.0.5:6379/0");
        assert_eq!(s.node_url("::1", 6379), "redis://[::1]:6379/0");
        // The credentials, the database and the client's parameters are the
        // primary's; the Sentinels are asked without them.
        let s = target("REDIS+SENTINEL://u:p%2Cw@a:1,[::1]:2/billing/3?protocol=resp3");
        assert_eq!(s.sentinels, ["redis://a:1", "redis://[::1]:2"]);
        assert_eq!((s.master.as_str(), s.db), ("billing", 3));
        assert_eq!(s.node_url("h", 7), "redis://u:p%2Cw@h:7/3?protocol=resp3");
        assert_eq!(target("redis+sentinel://a/m/").db, 0);
        assert_eq!(
            Target::Sentinel(target("redis+sentinel://:pw@a:1,b/m")).servers(),
            "a:1,b:26379"
        );
        for (url, says) in [
            ("redis+sentinel://:hunter2@/m", "lists no Sentinels"),
            ("redis+sentinel://:hunter2@a:1", "names no master"),
            ("redis+sentinel://:hunter2@a:1/", "names no master"),
            ("redis+sentinel://:hunter2@a:1/m/x", "database must be a number"),
            ("redis+sentinel://:hunter2@a:1/m/-1", "database must be a number"),
            (
                "redis+sentinel://:hunter2@a:1/m/1/2",
                "more than a master and a database",
            ),
            (
                "redis+sentinel://:hunter2@a:1,b:x/m",
                "Sentinel 2 is not host[:port]",
            ),
        ] {
            let m = match parse_url(url) {
                Err(Error::Config(m)) => m,
                other => panic!("{url}: expected Error::Config, got {other:?}"),
            };
            assert!(m.contains(says), "{url}: {m}");
            assert!(!m.contains("hunter2"), "{url}: {m}");
        }
    }

    /// `?wait_replicas=` and `?wait_timeout_ms=` are the ledger's and win
    /// over the options'; `0` turns waiting off.
    #[test]
    fn wait_replicas_is_a_ledger_parameter() {
        let wait = |url: &str, opts: RedisLedgerOptions| {
            let u = RedisUrl::parse(url).unwrap();
            assert_eq!(u.target, parse_url("redis://h:1").unwrap(), "{url}");
            u.apply(opts).wait.map(|w| (w.replicas, w.timeout.as_millis()))
        };
        let none = RedisLedgerOptions::default;
        let set = || RedisLedgerOptions::default().wait_replicas(2, Duration::from_millis(300));
        assert_eq!(wait("redis://h:1", none()), None);
        assert_eq!(wait("redis://h:1", set()), Some((2, 300)));
        assert_eq!(wait("redis://h:1?wait_replicas=1", none()), Some((1, 1000)));
        assert_eq!(wait("redis://h:1?wait_replicas=1", set()), Some((1, 300)));
        assert_eq!(
            wait("redis://h:1?wait_timeout_ms=50&wait_replicas=3", set()),
            Some((3, 50))
        );
        assert_eq!(wait("redis://h:1?wait_replicas=0", set()), None);
        assert_eq!(none().wait_replicas(0, Duration::from_secs(1)).wait, None);
        assert!(set().check().is_ok());
        for bad in [Duration::ZERO, Duration::from_secs(5), Duration::from_secs(9)] {
            let e = none().wait_replicas(1, bad).check().unwrap_err();
            assert!(matches!(e, Error::Config(_)), "{bad:?}");
        }
        let shorter = none()
            .request_timeout(Duration::from_millis(500))
            .wait_replicas(1, Duration::from_millis(499));
        assert!(shorter.check().is_ok());
    }

    /// `?ephemeral=` is the ledger's, taken out of the URL before the
    /// client sees it; the client's own parameters stay.
    #[test]
    fn ephemeral_is_a_ledger_parameter() {
        for (url, rest, ephemeral) in [
            ("redis://h:1", "redis://h:1", None),
            ("redis://h:1/2?ephemeral=true", "redis://h:1/2", Some(true)),
            ("redis://h:1?ephemeral=false", "redis://h:1", Some(false)),
            (
                "redis://h:1?protocol=resp3&ephemeral=true",
                "redis://h:1?protocol=resp3",
                Some(true),
            ),
            (
                "redis+cluster://a:1,b:2?ephemeral=true&protocol=resp3",
                "redis+cluster://a:1,b:2?protocol=resp3",
                Some(true),
            ),
            ("redis://h:1?protocol=resp3", "redis://h:1?protocol=resp3", None),
        ] {
            let u = RedisUrl::parse(url).unwrap();
            assert_eq!(
                (u.target, u.ephemeral),
                (parse_url(rest).unwrap(), ephemeral),
                "{url}"
            );
        }
        for (url, says) in [
            ("redis://:hunter2@h:1?ephemeral=yes", "must be true or false"),
            ("redis://:hunter2@h:1?ephemeral", "must be true or false"),
            (
                "redis://:hunter2@h:1?ephemeral=true&ephemeral=false",
                "given twice",
            ),
        ] {
            let m = match RedisUrl::parse(url) {
                Err(Error::Config(m)) => m,
                other => panic!("{url}: expected Error::Config, got {other:?}"),
            };
            assert!(m.contains(says) && !m.contains("hunter2"), "{url}: {m}");
        }
    }

    /// `from_url` opens only its own schemes; `connect` also hands the other
    /// single-server forms to the client.
    #[test]
    fn from_url_schemes_are_redis_redis_cluster_and_redis_sentinel() {
        for url in [
            "redis://h:1",
            "REDIS://h:1",
            "redis+cluster://a:1,b:2",
            "Redis+Sentinel://a:1,b:2/m",
            " redis://h ",
        ] {
            assert!(check_scheme(url).is_ok(), "{url}");
        }
        for url in [
            "unix:///run/redis.sock",
            "rediss://:hunter2@h:1",
            "nats://h:1",
            "redis:hunter2",
            "",
        ] {
            let m = match check_scheme(url) {
                Err(Error::Config(m)) => m,
                other => panic!("{url}: expected Error::Config, got {other:?}"),
            };
            assert!(
                m.contains("redis+cluster://") && m.contains("redis+sentinel://"),
                "{url}: {m}"
            );
            assert!(!m.contains("hunter2"), "{url}: {m}");
        }
    }
}

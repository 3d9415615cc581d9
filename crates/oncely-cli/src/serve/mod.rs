//! `oncely serve`: an operator's web page over a ledger, rendered on the
//! server (HTML and an inline SVG chart, no JavaScript).
//!
//! | path | shows | from |
//! | --- | --- | --- |
//! | `/` | records per tenant and kind: live, stuck, abandoned, completed, released | [`Admin::stats`](oncely::admin::Admin::stats) |
//! | `/stuck`, `/abandoned` | those records, oldest first, with their ages, a page at a time | [`Admin::records`](oncely::admin::Admin::records) |
//! | `/record/{key}` | one record: state, fence, timestamps, outcome size, fingerprint | [`Ledger::get`] |
//! | `/lookup?tenant=T&principal=P&client_key=K` | redirects to the record `oncely-tower` stored for that principal's `Idempotency-Key` | [`EffectKey::client_subject`](oncely::EffectKey::client_subject) |
//! | `/gaps` | the redelivery-gap distribution, with the retention drawn across it | the consumers' Prometheus endpoints, summed ([`ServeConfig::metrics_urls`]) |
//!
//! Why the gap chart reads Prometheus and not the ledger: the gap (how long
//! after the first claim a duplicate arrived) is observed by the workers
//! that receive duplicates ([`REDELIVERY_GAP_SECONDS`]); a duplicate of a
//! completed effect is a read, nothing is written, so the ledger cannot
//! know it.
//!
//! Safety rails, checked before anything is served:
//! - the page listens on a loopback address unless
//!   [`ServeConfig::allow_remote`] says otherwise: it has no
//!   authentication and shows every listed key;
//! - it answers only requests whose `Host` is a loopback name or address
//!   (unless [`ServeConfig::allow_remote`]), so a web site cannot reach it
//!   through DNS rebinding;
//! - it is read-only (the ledger is opened with
//!   [`Access::ReadOnly`], so it writes nothing
//!   even by mistake) unless [`ServeConfig::allow_resolve`]: then stuck and
//!   abandoned records get a form that resolves them through
//!   [`resolve`](crate::commands::resolve::resolve), the path `oncely resolve`
//!   takes, fenced at the fence the page showed; the form carries a token
//!   drawn when the page started, and a POST from another origin is
//!   refused;
//! - it shows one tenant ([`Scope::Tenant`]) unless started for all
//!   ([`Scope::All`]); asking for another tenant answers 403 and shows
//!   nothing.
//!
//! [`REDELIVERY_GAP_SECONDS`]: oncely::telemetry::REDELIVERY_GAP_SECONDS

mod admin;
mod gaps;
mod pages;
mod text;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use oncely::backend::Ledger;
use oncely::{Error, Result, Tenant};
use oncely_any::{Access, AnyLedger};

pub use gaps::{GapHistogram, MetricsUrl, parse_gap_histograms};

/// Which tenants the page shows.
// Exhaustive by design (ARCHITECTURE.md, API boundaries): one tenant or all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// This tenant only (`--tenant`); a request for another is refused with
    /// 403.
    Tenant(Tenant),
    /// Every tenant (`--all-tenants`), one at a time with `?tenant=`.
    All,
}

/// What `oncely serve` was asked to do.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The ledger's database URL.
    pub database_url: String,
    /// Where to listen. A loopback address unless
    /// [`ServeConfig::allow_remote`].
    pub listen: SocketAddr,
    /// Listen on a non-loopback address. The page has no authentication:
    /// only behind a proxy that authenticates.
    pub allow_remote: bool,
    /// Which tenants the page shows.
    pub scope: Scope,
    /// The consumers' Prometheus endpoints (one per replica), for the
    /// redelivery-gap chart: their histograms are summed.
    pub metrics_urls: Vec<MetricsUrl>,
    /// The retention the chart draws across the gaps: how long completed
    /// records are kept ([`oncely::ClaimOptions::retention`]).
    pub retention: Duration,
    /// Offer to resolve stuck and abandoned records
    /// ([`resolve`](crate::commands::resolve::resolve): a stuck lease is taken
    /// over by a claim, an abandoned step written with its reconciliation
    /// lease, both fenced at the fence the page showed, and recorded).
    /// Without it the page writes nothing.
    pub allow_resolve: bool,
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scope::Tenant(t) => write!(f, "tenant {t}"),
            Scope::All => f.write_str("all tenants"),
        }
    }
}

impl ServeConfig {
    /// Checks what can be checked without connecting: the listen address is
    /// a loopback one (or [`ServeConfig::allow_remote`]) and the database
    /// URL names a backend this binary has. Fails with [`Error::Config`].
    pub fn validate(&self) -> Result<()> {
        if !self.listen.ip().is_loopback() && !self.allow_remote {
            return Err(Error::Config(format!(
                "refusing to listen on {}: not a loopback address. The page has no authentication \
                 and shows the ledger's keys; listen on 127.0.0.1 (or ::1), or pass --allow-remote \
                 to listen there anyway, behind a proxy that authenticates",
                self.listen
            )));
        }
        if self.retention.is_zero() {
            return Err(Error::Config("--retention must be longer than zero".to_owned()));
        }
        admin::check_scheme(crate::Scheme::of_url(&self.database_url)?)
    }
}

/// A bound, not yet serving, operator page: [`bind`] it, print
/// [`Server::local_addr`], then [`Server::run`] it.
pub struct Server {
    listener: tokio::net::TcpListener,
    app: Arc<pages::App>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("local_addr", &self.listener.local_addr().ok())
            .finish_non_exhaustive()
    }
}

/// Validates `config`, opens the ledger read-only (its schema must exist)
/// and binds the listen address.
pub async fn bind(config: ServeConfig) -> Result<Server> {
    config.validate()?;
    let ledger = AnyLedger::open(&config.database_url, Access::ReadOnly).await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| Error::Config(format!("cannot listen on {}: {e}", config.listen)))?;
    Ok(Server {
        listener,
        app: Arc::new(pages::App::new(ledger, config)?),
    })
}

impl Server {
    /// The address it listens on (the port the OS picked for port 0).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|e| Error::Config(format!("cannot read the listen address: {e}")))
    }

    /// Whether the page offers to resolve records
    /// ([`ServeConfig::allow_resolve`]).
    pub fn resolves(&self) -> bool {
        self.app.config.allow_resolve
    }

    /// The backend's name (`sqlite`, `postgres`, …).
    pub fn backend(&self) -> &'static str {
        self.app.ledger.backend()
    }

    /// What the page reads: the ledger's `Display` (backend, database,
    /// table), never a credential.
    pub fn ledger(&self) -> String {
        self.app.ledger.to_string()
    }

    /// Serves until `shutdown` resolves, then closes the ledger.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
        let ledger = self.app.ledger.clone();
        let served = axum::serve(self.listener, pages::router(self.app))
            .with_graceful_shutdown(shutdown)
            .await;
        ledger.close().await;
        served.map_err(|e| Error::Config(format!("the web server stopped: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(listen: &str) -> ServeConfig {
        ServeConfig {
            database_url: "memory:".to_owned(),
            listen: listen.parse().unwrap(),
            allow_remote: false,
            scope: Scope::All,
            metrics_urls: Vec::new(),
            retention: Duration::from_secs(3600),
            allow_resolve: false,
        }
    }

    #[test]
    fn a_non_loopback_address_is_refused_unless_allowed() {
        assert!(config("127.0.0.1:0").validate().is_ok());
        assert!(config("[::1]:0").validate().is_ok());
        let err = config("0.0.0.0:8080").validate().unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err:?}");
        assert!(err.to_string().contains("--allow-remote"), "{err}");
        let mut c = config("0.0.0.0:8080");
        c.allow_remote = true;
        assert!(c.validate().is_ok());
    }

    /// One GET over HTTP/1.0: the status and the body.
    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).await.unwrap();
        let code = raw.split_whitespace().nth(1).unwrap().parse().unwrap();
        (code, raw.split_once("\r\n\r\n").unwrap().1.to_owned())
    }

    /// Following the "next page" links lists every stuck record once, in
    /// pages of [`pages::PAGE`], and ends.
    #[tokio::test]
    async fn paging_lists_each_stuck_record_once() {
        use oncely::backend::{Claim, Ledger};
        use oncely::{ClaimOptions, EffectKey, MemoryLedger};
        let memory = Arc::new(MemoryLedger::new());
        let tenant = Tenant::new("acme").unwrap();
        let n = pages::PAGE as usize * 2 + 7;
        let opts = ClaimOptions::default().lease(Duration::from_secs(1));
        let mut ends = std::time::SystemTime::UNIX_EPOCH;
        for i in 0..n {
            let key = EffectKey::new(&tenant, "capture", format!("order-{i:03}")).unwrap();
            let Claim::Acquired(lease) = memory.claim(&key, &opts).await.unwrap() else {
                panic!("fresh")
            };
            ends = ends.max(lease.expires_at());
        }
        let probe = EffectKey::new(&tenant, "capture", "order-000").unwrap();
        while memory.get(&probe).await.unwrap().unwrap().read_at < ends {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut cfg = config("127.0.0.1:0");
        cfg.scope = Scope::Tenant(tenant);
        let listener = tokio::net::TcpListener::bind(cfg.listen).await.unwrap();
        let server = Server {
            listener,
            app: Arc::new(pages::App::new(AnyLedger::Memory(memory), cfg).unwrap()),
        };
        let addr = server.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(server.run(async {
            let _ = stopped.await;
        }));

        let mut seen = Vec::new();
        let mut path = "/stuck".to_owned();
        let mut pages_read = 0;
        loop {
            let (code, html) = get(addr, &path).await;
            assert_eq!(code, 200, "{html}");
            pages_read += 1;
            for part in html.split("href=\"/record/").skip(1) {
                seen.push(part[..part.find('"').unwrap()].to_owned());
            }
            match html.split_once("<a href=\"/stuck?after_t=") {
                Some((_, rest)) => {
                    let q = &rest[..rest.find('"').unwrap()];
                    path = format!("/stuck?after_t={}", q.replace("&amp;", "&"));
                }
                None => break,
            }
        }
        assert_eq!(pages_read, 3);
        assert_eq!(seen.len(), n);
        let mut unique = seen.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), n, "each record once");
        assert_eq!(seen, unique, "oldest first: created in key order");
        let _ = stop.send(());
        serving.await.unwrap().unwrap();
    }

    #[test]
    fn unknown_database_schemes_are_refused_before_connecting() {
        let mut c = config("127.0.0.1:0");
        c.database_url = "mongodb://localhost/x".to_owned();
        let err = c.validate().unwrap_err();
        assert!(err.to_string().contains("'mongodb'"), "{err}");
    }
}

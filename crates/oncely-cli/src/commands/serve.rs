//! `oncely serve`'s command line; the page itself is [`crate::serve`].

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{ArgGroup, Args as ClapArgs};
use oncely::{Result, Tenant};

use crate::serve::{self, MetricsUrl, Scope, ServeConfig};
use crate::time::parse_duration;

/// Serve the operator web page: stats, stuck and abandoned records, one
/// record's detail, and the redelivery-gap chart against the retention.
///
/// Server-rendered HTML, no JavaScript. Read-only (the ledger is opened
/// like `get` does) unless --allow-resolve, which offers a form on stuck
/// and abandoned records doing what `oncely resolve` does. Listens on
/// loopback unless
/// --allow-remote (the page has no authentication). Shows one tenant
/// (--tenant; any other answers 403) or all (--all-tenants). The gap
/// chart reads oncely_redelivery_gap_seconds from a consumer's
/// Prometheus endpoint (--metrics-url): duplicates are not stored in
/// the ledger. Runs until Ctrl-C.
#[derive(Debug, Clone, ClapArgs)]
#[command(group(ArgGroup::new("scope").required(true).args(["tenant", "all_tenants"])))]
pub struct Args {
    /// The ledger's database: sqlite:PATH, postgres://USER@HOST/DB or
    /// mysql://USER@HOST/DB (Redis and NATS cannot list records).
    #[arg(long, env = "ONCELY_DATABASE_URL")]
    pub database_url: String,
    /// Where to listen: a loopback address (127.0.0.1:PORT, or the IPv6
    /// loopback ::1 in brackets) unless --allow-remote.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Listen on a non-loopback address. The page has no authentication:
    /// put it behind a proxy that authenticates.
    #[arg(long)]
    pub allow_remote: bool,
    /// Show this tenant only; a request for another is refused (403).
    #[arg(long)]
    pub tenant: Option<String>,
    /// Show every tenant (pick one with ?tenant= in the URL).
    #[arg(long)]
    pub all_tenants: bool,
    /// A consumer's Prometheus endpoint (http://HOST:PORT/metrics), for the
    /// redelivery-gap chart. Give it once per replica: their histograms
    /// are summed.
    #[arg(long)]
    pub metrics_url: Vec<String>,
    /// The retention your claims keep completed records for, drawn across
    /// the gap chart: 7d, 36h, 1h30m, 90s.
    #[arg(long, default_value = "7d")]
    pub retention: String,
    /// Offer a form on stuck and abandoned records to resolve them (release
    /// the key, or mark it completed with a value), through the same fenced
    /// path as `oncely resolve`, recorded as an audit record. Without it
    /// the page is read-only.
    #[arg(long)]
    pub allow_resolve: bool,
}

impl Args {
    /// Checks the arguments and builds the configuration, connecting to
    /// nothing. Fails with [`oncely::Error::Config`] (or
    /// [`oncely::Error::InvalidKey`] for a malformed tenant).
    pub fn config(&self) -> Result<ServeConfig> {
        let scope = match &self.tenant {
            Some(t) => Scope::Tenant(Tenant::parse(t)?),
            None => Scope::All,
        };
        let config = ServeConfig {
            database_url: self.database_url.clone(),
            listen: self.listen,
            allow_remote: self.allow_remote,
            scope,
            metrics_urls: self
                .metrics_url
                .iter()
                .map(|u| MetricsUrl::parse(u))
                .collect::<Result<_>>()?,
            retention: parse_duration(&self.retention)?,
            allow_resolve: self.allow_resolve,
        };
        config.validate()?;
        Ok(config)
    }
}

/// Serves the page until Ctrl-C.
pub async fn run(args: Args) -> Result<ExitCode> {
    let config = args.config()?;
    let scope = config.scope.to_string();
    let server = serve::bind(config).await?;
    let addr = server.local_addr()?;
    println!(
        "oncely serve: http://{addr}/ ({}, {scope}, {}); Ctrl-C stops it",
        server.ledger(),
        if server.resolves() {
            "resolve allowed"
        } else {
            "read-only"
        }
    );
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    server.run(shutdown).await?;
    Ok(ExitCode::SUCCESS)
}

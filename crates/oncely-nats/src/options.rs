//! [`NatsKvLedgerOptions`], and the `nats://` URL a ledger is opened from
//! ([`NatsUrl`]).
//!
//! `nats://h1:p1[,h2:p2…][?bucket=B&replicas=R]`: one server or a
//! comma-separated list (each entry `host:port` or a full `nats://` URL, as
//! `async-nats` takes them). The query string, for the whole list, sets the
//! KV bucket and its replica count; any other parameter is refused. Every
//! message about a URL names its parts by position or by name and never
//! quotes it: it may carry a password or a token.

use std::time::Duration;

use async_nats::ServerAddr;
use oncely::open::LedgerOptions;
use oncely::open::UrlParams;
use oncely::{Error, Result};

/// The longest lease [`oncely::ClaimOptions::validate`] allows.
pub(crate) const MAX_LEASE: Duration = Duration::from_secs(86_400);

/// The URL forms, for messages.
const FORMS: &str = "nats://host:port[,host:port…][?bucket=NAME&replicas=1|3]";

/// The query parameters a URL may set on the ledger (the client reads none).
const OWN_PARAMS: &[&str] = &["bucket", "replicas"];

/// Options of [`NatsKvLedger::connect_with`](crate::NatsKvLedger::connect_with),
/// [`NatsKvLedger::from_client_with`](crate::NatsKvLedger::from_client_with)
/// and [`NatsKvLedger::from_store`](crate::NatsKvLedger::from_store).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsKvLedgerOptions {
    pub(crate) bucket: String,
    pub(crate) replicas: usize,
    pub(crate) max_age: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) open_timeout: Duration,
    pub(crate) migrate: bool,
    pub(crate) read_only: bool,
}

impl Default for NatsKvLedgerOptions {
    /// Bucket `oncely_effects`, one replica, a 30-day `max_age`, a 5 s
    /// connect timeout, a 5 s request timeout, a 30 s open timeout, the
    /// bucket created if absent, read-write.
    fn default() -> Self {
        NatsKvLedgerOptions {
            bucket: "oncely_effects".to_owned(),
            replicas: 1,
            max_age: Duration::from_secs(30 * 86_400),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            open_timeout: Duration::from_secs(30),
            migrate: true,
            read_only: false,
        }
    }
}

impl NatsKvLedgerOptions {
    /// The KV bucket (default `oncely_effects`): ASCII letters, digits, `_`
    /// and `-`.
    pub fn bucket(mut self, bucket: impl Into<String>) -> Self {
        self.bucket = bucket.into();
        self
    }

    /// Replicas of the bucket's stream: 1, or 3 on a cluster (default 1).
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// The bucket's `max_age`: the longest retention a claim may ask for, and
    /// the age at which the server drops a key nobody wrote to (default 30
    /// days, at least 2 days).
    pub fn max_age(mut self, max_age: Duration) -> Self {
        self.max_age = max_age;
        self
    }

    /// How long to wait for the initial connection (default 5 s).
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// How long one request (a JetStream API call, a read, a write) waits
    /// for its reply (default 5 s).
    pub fn request_timeout(mut self, t: Duration) -> Self {
        self.request_timeout = t;
        self
    }

    /// How long opening keeps asking while the bucket does not answer yet,
    /// as when a cluster that just restarted is still electing the stream's
    /// leader (default 30 s). Settings the ledger refuses fail at once.
    pub fn open_timeout(mut self, t: Duration) -> Self {
        self.open_timeout = t;
        self
    }

    /// Whether opening creates the bucket when it does not exist (default
    /// `true`). With `false` a missing bucket is [`Error::Config`]: what
    /// operator commands that must not create anything (`oncely get`,
    /// `abandoned`, `prune`) ask for. An existing bucket's settings are
    /// checked either way.
    pub fn migrate(mut self, yes: bool) -> Self {
        self.migrate = yes;
        self
    }

    /// A ledger that only reads (default false), for operators and auditors:
    /// implies `migrate(false)` (a missing bucket is [`Error::Config`],
    /// nothing is created), and the ledger refuses its own writes (claims,
    /// completions, releases, renewals, prune) with [`Error::Config`] before
    /// any round trip. [`oncely::backend::Ledger::get`], [`oncely::backend::Ledger::abandoned`]
    /// and [`oncely::backend::Ledger::horizon`] work.
    ///
    /// One message is still written: the clock probe on the bucket's
    /// reserved key `_oncely_clock` (crate docs, "Clocks"). NATS tells a
    /// client the server's time only by stamping a message, and judging
    /// leases needs it; a NATS user that may publish on
    /// `$KV.<bucket>._oncely_clock` and read the bucket is enough.
    pub fn read_only(mut self, yes: bool) -> Self {
        self.read_only = yes;
        self
    }

    /// The bucket ([`NatsKvLedgerOptions::bucket`]).
    pub fn get_bucket(&self) -> &str {
        &self.bucket
    }

    /// The replica count ([`NatsKvLedgerOptions::replicas`]).
    pub fn get_replicas(&self) -> usize {
        self.replicas
    }

    /// The bucket's `max_age` ([`NatsKvLedgerOptions::max_age`]).
    pub fn get_max_age(&self) -> Duration {
        self.max_age
    }

    /// The connect timeout ([`NatsKvLedgerOptions::connect_timeout`]).
    pub fn get_connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The request timeout ([`NatsKvLedgerOptions::request_timeout`]).
    pub fn get_request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// The open timeout ([`NatsKvLedgerOptions::open_timeout`]).
    pub fn get_open_timeout(&self) -> Duration {
        self.open_timeout
    }

    /// Whether opening may create the bucket ([`NatsKvLedgerOptions::migrate`]).
    pub fn get_migrate(&self) -> bool {
        self.migrate
    }

    /// Whether the ledger only reads ([`NatsKvLedgerOptions::read_only`]).
    pub fn get_read_only(&self) -> bool {
        self.read_only
    }

    /// The default options with what a `nats://` URL sets (`?bucket=`,
    /// `?replicas=`), checked: [`Error::Config`] for a malformed URL, an
    /// unknown parameter or a bad bucket or replica count. Nothing
    /// connects; the servers the URL lists are [`NatsUrl`]'s.
    pub fn from_url(url: &str) -> Result<Self> {
        let options = NatsUrl::parse(url)?.apply(NatsKvLedgerOptions::default());
        options.validate()?;
        Ok(options)
    }

    /// Whether opening may create a missing bucket.
    pub(crate) fn creates(&self) -> bool {
        self.migrate && !self.read_only
    }

    /// Checks the options; [`Error::Config`] before any round trip.
    pub(crate) fn validate(&self) -> Result<()> {
        if self.bucket.is_empty()
            || !self
                .bucket
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(Error::Config(format!(
                "bucket name {:?} must be non-empty ASCII letters, digits, '_' or '-'",
                self.bucket
            )));
        }
        if !matches!(self.replicas, 1 | 3) {
            return Err(Error::Config(format!(
                "replicas must be 1 or 3, got {}",
                self.replicas
            )));
        }
        if self.max_age < 2 * MAX_LEASE {
            return Err(Error::Config(format!(
                "max_age must be at least 2 days (longer than the longest lease), got {:?}",
                self.max_age
            )));
        }
        Ok(())
    }
}

/// How [`FromUrl::from_url`](oncely::open::FromUrl::from_url) opens
/// ([`LedgerOptions::for_open`]).
impl LedgerOptions for NatsKvLedgerOptions {
    fn existing_only(self) -> Self {
        self.migrate(false)
    }

    fn reads_only(self) -> Self {
        self.migrate(false).read_only(true)
    }

    /// Both the connection and the wait for the bucket to answer
    /// ([`NatsKvLedgerOptions::open_timeout`]): a caller that wants a quick
    /// answer wants it for the whole open.
    fn open_within(self, timeout: Duration) -> Self {
        self.connect_timeout(timeout).open_timeout(timeout)
    }
}

/// What a `nats://` URL names: the server list (as written, without the
/// query) and the ledger options given as query parameters. Parsed once,
/// by this crate, for the ledger and for any tool that needs the same
/// servers (`NatsUrl::from_str`, [`NatsUrl::parse`]). Its `Debug` may show
/// credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsUrl {
    /// The servers, comma-separated, as `async-nats` takes them.
    pub(crate) servers: String,
    /// `?bucket=`.
    pub(crate) bucket: Option<String>,
    /// `?replicas=`.
    pub(crate) replicas: Option<usize>,
}

impl std::str::FromStr for NatsUrl {
    type Err = Error;

    /// [`NatsUrl::parse`].
    fn from_str(url: &str) -> Result<NatsUrl> {
        NatsUrl::parse(url)
    }
}

impl NatsUrl {
    /// Splits a NATS URL into servers and options; [`Error::Config`] for
    /// anything else, without quoting the URL. Nothing connects.
    pub fn parse(url: &str) -> Result<NatsUrl> {
        let url = url.trim();
        match url.split_once("://") {
            Some((scheme, _)) if scheme.eq_ignore_ascii_case("nats") => {}
            _ => return Err(Error::Config(format!("a NATS URL is {FORMS}"))),
        }
        let params = UrlParams::parse(url, "NATS", OWN_PARAMS, &[])?;
        let replicas = params
            .get("replicas")
            .map(|n| {
                n.parse()
                    .map_err(|_| Error::Config("NATS URL parameter replicas must be 1 or 3".to_owned()))
            })
            .transpose()?;
        Ok(NatsUrl {
            servers: params.driver_url().to_owned(),
            bucket: params.get("bucket").map(str::to_owned),
            replicas,
        })
    }

    /// `options` with what the URL sets. The URL's parameters win over the
    /// options': the URL is what a deployment configures (an environment
    /// variable, the `oncely` command's argument), the options are the
    /// code's defaults.
    pub fn apply(&self, mut options: NatsKvLedgerOptions) -> NatsKvLedgerOptions {
        if let Some(bucket) = &self.bucket {
            options.bucket = bucket.clone();
        }
        if let Some(replicas) = self.replicas {
            options.replicas = replicas;
        }
        options
    }

    /// The server addresses, as `async-nats` connects to them (credentials
    /// included); a bad one is [`Error::Config`] naming its position in the
    /// list, never quoting it.
    pub fn addrs(&self) -> Result<Vec<ServerAddr>> {
        let addrs: Vec<ServerAddr> = self
            .servers
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .enumerate()
            .map(|(i, s)| {
                s.parse()
                    .map_err(|e| Error::Config(format!("NATS url #{} of the list: {e}", i + 1)))
            })
            .collect::<Result<_>>()?;
        if addrs.is_empty() {
            return Err(Error::Config("no NATS url given".into()));
        }
        Ok(addrs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nats_urls_carry_servers_and_options() {
        let t = NatsUrl::parse("nats://127.0.0.1:4222").unwrap();
        assert_eq!(
            t,
            NatsUrl {
                servers: "nats://127.0.0.1:4222".to_owned(),
                bucket: None,
                replicas: None
            }
        );
        let t =
            NatsUrl::parse("nats://u:pw@n1:4222,n2:4222,nats://n3:4222?bucket=payments&replicas=3").unwrap();
        assert_eq!(
            t,
            NatsUrl {
                servers: "nats://u:pw@n1:4222,n2:4222,nats://n3:4222".to_owned(),
                bucket: Some("payments".to_owned()),
                replicas: Some(3)
            }
        );
        assert_eq!(t.addrs().unwrap().len(), 3);
        let t = NatsUrl::parse("nats://n1?&replicas=1&").unwrap();
        assert_eq!((t.bucket, t.replicas), (None, Some(1)));
        // The scheme in any case, surrounding blanks, empty list entries.
        let t = NatsUrl::parse("  NATS://n1:4222, ,n2:4222,  ").unwrap();
        assert_eq!(t.addrs().unwrap().len(), 2);
    }

    #[test]
    fn bad_nats_parameters_are_config_errors() {
        for (url, says) in [
            ("nats://n1?replicas=three", "replicas must be 1 or 3"),
            ("nats://n1?replicas=", "replicas must be 1 or 3"),
            ("nats://n1?bucket=a&bucket=b", "bucket is given twice"),
            (
                "nats://n1?max_age=9",
                "unknown NATS URL parameter 'max_age' (expected bucket, replicas)",
            ),
            ("nats://n1?token:hunter2", "unknown NATS URL parameter (expected"),
            ("nats:n1", "nats://host:port"),
            // Another scheme is not a NATS URL, even with a NATS list after it.
            ("redis://:hunter2@n1:4222,nats://n2:4222", "nats://host:port"),
            ("not a url at all ::", "nats://host:port"),
        ] {
            let m = match NatsUrl::parse(url) {
                Err(Error::Config(m)) => m,
                other => panic!("{url}: expected Error::Config, got {other:?}"),
            };
            assert!(m.contains(says), "{url}: {m}");
            assert!(!m.contains("hunter2"), "{url}: {m}");
        }
    }

    /// A bad address in a list is named by position, never quoted.
    #[test]
    fn bad_addresses_are_named_by_position() {
        let t = NatsUrl::parse("nats://127.0.0.1:1,nats://u:hunter2@[bad:4222").unwrap();
        let m = match t.addrs() {
            Err(Error::Config(m)) => m,
            other => panic!("expected Error::Config, got {other:?}"),
        };
        assert!(m.contains("#2") && !m.contains("hunter2"), "{m}");
    }

    /// The URL's bucket and replicas override the options'; what it does not
    /// name is left as the options have it.
    #[test]
    fn url_parameters_override_the_options() {
        let opts = NatsKvLedgerOptions::default()
            .bucket("from_code")
            .replicas(3)
            .migrate(false);
        let t = NatsUrl::parse("nats://n1?bucket=from_url").unwrap();
        let applied = t.apply(opts.clone());
        assert_eq!((applied.bucket.as_str(), applied.replicas), ("from_url", 3));
        assert!(!applied.migrate);
        let t = NatsUrl::parse("nats://n1?replicas=1").unwrap();
        let applied = t.apply(opts.clone());
        assert_eq!((applied.bucket.as_str(), applied.replicas), ("from_code", 1));
        assert_eq!(NatsUrl::parse("nats://n1").unwrap().apply(opts.clone()), opts);
    }

    #[test]
    fn options_from_a_url_are_the_defaults_with_its_parameters() {
        let o =
            NatsKvLedgerOptions::from_url("nats://u:pw@n1:4222,n2:4222?bucket=payments&replicas=3").unwrap();
        assert_eq!(o, NatsKvLedgerOptions::default().bucket("payments").replicas(3));
        assert_eq!((o.get_bucket(), o.get_replicas()), ("payments", 3));
        for bad in ["nats://n1?replicas=2", "nats://n1?bucket=a.b", "redis://n1"] {
            assert!(
                matches!(NatsKvLedgerOptions::from_url(bad), Err(Error::Config(_))),
                "{bad}"
            );
        }
        let url: NatsUrl = "nats://n1:4222,n2:4222?replicas=3".parse().unwrap();
        assert_eq!(url.addrs().unwrap().len(), 2);
    }

    #[test]
    fn read_only_never_creates() {
        assert!(NatsKvLedgerOptions::default().creates());
        assert!(!NatsKvLedgerOptions::default().migrate(false).creates());
        assert!(!NatsKvLedgerOptions::default().read_only(true).creates());
    }
}

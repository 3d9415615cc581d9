//! Opening a ledger from a URL, for tools: [`FromUrl`] with its
//! [`OpenOptions`] and [`Access`] (which each backend's options type maps
//! through [`LedgerOptions`]), and [`UrlParams`] and [`split_hosts`],
//! which every backend's URL parser uses. An application that builds its
//! ledger in code does not need this module.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::ledger::Ledger;
/// What an opener may do to the ledger's storage (tables, a bucket).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Access {
    /// Create what is missing and upgrade it (the default of a backend's
    /// `connect`): `oncely migrate`, the demo, an application at startup.
    Migrate,
    /// Use what exists after checking it; create and upgrade nothing: writers
    /// that must not create a ledger by accident (`oncely prune`).
    Existing,
    /// Read only: create, migrate and write nothing, so a mistyped path is an
    /// error rather than a new empty ledger, and a role that may only read
    /// can use it (`oncely get`). The ledger refuses its own writes before
    /// any round trip. (One exception, documented by its crate: NATS learns
    /// the server's clock only by writing its clock probe key.)
    ReadOnly,
}

/// How [`FromUrl::from_url`] opens a ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpenOptions {
    /// What the opener may do to the storage.
    pub access: Access,
    /// How long to wait to connect (or for a pooled connection), when the
    /// caller wants a quicker answer than the backend's default (an operator
    /// at a terminal).
    pub connect_timeout: Option<Duration>,
}

impl OpenOptions {
    /// `access`, with the backend's own timeouts.
    pub fn new(access: Access) -> Self {
        OpenOptions {
            access,
            connect_timeout: None,
        }
    }

    /// Sets [`OpenOptions::connect_timeout`](#structfield.connect_timeout).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = Some(timeout);
        self
    }
}

/// A backend's options type (`PgLedgerOptions`, `RedisLedgerOptions`, …) as
/// [`OpenOptions`] sets it: the backend says what each part of an
/// [`Access`] and a connect timeout is in its own settings, and
/// [`LedgerOptions::for_open`] (written once, here) maps an
/// [`OpenOptions`] onto them, so that no backend restates the mapping.
pub trait LedgerOptions: Default {
    /// These options for [`Access::Existing`]: create and upgrade nothing,
    /// check what exists (a backend with nothing to create returns them
    /// unchanged).
    fn existing_only(self) -> Self;

    /// These options for [`Access::ReadOnly`]: create, migrate and write
    /// nothing, and refuse the ledger's own writes before any round trip.
    fn reads_only(self) -> Self;

    /// These options with [`OpenOptions::connect_timeout`] in force: every
    /// setting that bounds how long opening waits (to connect, for a pooled
    /// connection, for a lock or a bucket to answer).
    fn open_within(self, timeout: Duration) -> Self;

    /// The options [`FromUrl::from_url`] opens with: the defaults, as
    /// `open` asks.
    fn for_open(open: OpenOptions) -> Self {
        let options = Self::default();
        let options = match open.access {
            Access::Migrate => options,
            Access::Existing => options.existing_only(),
            Access::ReadOnly => options.reads_only(),
        };
        match open.connect_timeout {
            Some(timeout) => options.open_within(timeout),
            None => options,
        }
    }
}

/// A ledger that opens from a URL: the one shape every backend crate
/// offers, so that a tool (the `oncely` command) can pick the backend from a
/// URL with one line per backend. Each crate parses its own URLs, and its
/// query parameters through [`UrlParams`].
///
/// Its [`Display`](std::fmt::Display) says what the ledger reads, for an
/// operator: the backend, the server and database (or file), and the
/// table, bucket or key prefix (`postgres 127.0.0.1:5432/app, table
/// billing.effects`). It never shows a credential.
pub trait FromUrl: Ledger + std::fmt::Display + Sized {
    /// The URL schemes it opens, lowercase (`postgres`, `postgresql`).
    const SCHEMES: &'static [&'static str];

    /// Opens the ledger a URL names (one of [`FromUrl::SCHEMES`]). A
    /// malformed URL fails with [`Error::Config`] before anything connects,
    /// and its message never quotes the URL (it may carry a password).
    fn from_url(url: &str, options: OpenOptions) -> impl Future<Output = Result<Self>> + Send;
}

impl<L: FromUrl> FromUrl for std::sync::Arc<L> {
    const SCHEMES: &'static [&'static str] = L::SCHEMES;

    async fn from_url(url: &str, options: OpenOptions) -> Result<Self> {
        L::from_url(url, options).await.map(std::sync::Arc::new)
    }
}

/// The query parameters of a backend's URL (`?table=effects&sslmode=require`),
/// split into the ones the backend reads itself and the ones its driver
/// reads, so that a mistyped or unsupported parameter is refused with
/// [`Error::Config`] before anything connects, on every backend, instead of
/// being ignored (a driver that ignores `?tabel=x` would open the default
/// table, and an operator would read the wrong ledger).
///
/// A backend lists its own parameters and its driver's; a parameter it adds
/// joins its list. Its own parameters' values are percent-decoded as a
/// query string is (`+` is a space); the driver's are handed on untouched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlParams {
    own: Vec<(String, String)>,
    driver_url: String,
}

impl UrlParams {
    /// Reads the query string of `url` (after the first `?`, up to a `#`
    /// after it).
    /// `what` names the backend in messages (`PostgreSQL`); `own` lists the
    /// parameters the backend reads; `driver` those its driver reads, where
    /// an entry ending in `[…]` (`options[…]`) stands for any name with that
    /// stem and a bracketed part (`options[search_path]`).
    ///
    /// Fails with [`Error::Config`] on a parameter in neither list (naming
    /// it, unless it does not look like a name: it may be a mistyped
    /// credential, and messages never quote a URL), and on one of the
    /// backend's own given twice. Empty pairs (`?&a=1&`) are skipped.
    pub fn parse(url: &str, what: &str, own: &[&str], driver: &[&str]) -> Result<UrlParams> {
        // The first `?` starts the query wherever a `#` is: SQLite's driver
        // reads a `#` before it as part of the file name.
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let (query, fragment) = match query.split_once('#') {
            Some((q, f)) => (q, Some(f)),
            None => (query, None),
        };
        let mut params = UrlParams {
            own: Vec::new(),
            driver_url: base.to_owned(),
        };
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let Some((name, value)) = form_urlencoded::parse(pair.as_bytes()).next() else {
                continue;
            };
            if own.contains(&name.as_ref()) {
                if params.get(&name).is_some() {
                    return Err(Error::Config(format!(
                        "{what} URL parameter {name} is given twice"
                    )));
                }
                params.own.push((name.into_owned(), value.into_owned()));
            } else if driver.iter().any(|d| matches_param(d, &name)) {
                kept.push(pair);
            } else {
                return Err(unknown_param(what, &name, own, driver));
            }
        }
        if !kept.is_empty() {
            params.driver_url.push('?');
            params.driver_url.push_str(&kept.join("&"));
        }
        if let Some(f) = fragment {
            params.driver_url.push('#');
            params.driver_url.push_str(f);
        }
        Ok(params)
    }

    /// The value of one of the backend's own parameters, if the URL gives it.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.own.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The URL without the backend's own parameters: what its driver parses.
    pub fn driver_url(&self) -> &str {
        &self.driver_url
    }
}

fn matches_param(accepted: &str, name: &str) -> bool {
    match accepted.strip_suffix("[…]") {
        Some(stem) => name
            .strip_prefix(stem)
            .is_some_and(|rest| rest.len() > 2 && rest.starts_with('[') && rest.ends_with(']')),
        None => accepted == name,
    }
}

fn unknown_param(what: &str, name: &str, own: &[&str], driver: &[&str]) -> Error {
    let shown = if !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
    {
        format!(" '{name}'")
    } else {
        String::new()
    };
    let expected = match (own.is_empty(), driver.is_empty()) {
        (true, true) => "it takes none".to_owned(),
        (false, true) => format!("expected {}", own.join(", ")),
        (true, false) => format!("expected one its driver reads: {}", driver.join(", ")),
        (false, false) => format!(
            "expected {}, or one its driver reads: {}",
            own.join(", "),
            driver.join(", ")
        ),
    };
    Error::Config(format!("unknown {what} URL parameter{shown} ({expected})"))
}

/// Splits the authority of `url` (`scheme://[userinfo@]hosts[/…]`) into one
/// URL per host of a comma-separated list (`h1:5432,h2,[::1]:5433`), each
/// with the same user, path and query; a URL with one host comes back as it
/// is. An empty entry in the list (`h1,,h2`, a comma at either end) is
/// [`Error::Config`] naming `what` (`"PostgreSQL"`); messages never quote
/// the URL, which may hold a password. The host list of every SQL backend
/// that takes one (their drivers accept a single host).
pub fn split_hosts(url: &str, what: &str) -> Result<Vec<String>> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok(vec![url.to_owned()]);
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..]),
        None => ("", authority),
    };
    if !hosts.contains(',') {
        return Ok(vec![url.to_owned()]);
    }
    hosts
        .split(',')
        .map(|host| {
            if host.trim().is_empty() {
                Err(Error::Config(format!(
                    "the {what} URL's host list has an empty entry (h1,,h2, or a comma at either end)"
                )))
            } else {
                Ok(format!("{scheme}://{userinfo}{host}{tail}"))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_list_splits_into_one_url_per_host() {
        assert_eq!(
            split_hosts(
                "postgres://u:p%40w@h1:5440,h2,[::1]:5442/db?sslmode=disable",
                "PostgreSQL"
            )
            .unwrap(),
            [
                "postgres://u:p%40w@h1:5440/db?sslmode=disable",
                "postgres://u:p%40w@h2/db?sslmode=disable",
                "postgres://u:p%40w@[::1]:5442/db?sslmode=disable",
            ]
        );
        assert_eq!(
            split_hosts("mysql://h1:1,h2:2", "MySQL").unwrap(),
            ["mysql://h1:1", "mysql://h2:2"]
        );
        assert_eq!(
            split_hosts("mysql://u@h/db", "MySQL").unwrap(),
            ["mysql://u@h/db"]
        );
        assert_eq!(split_hosts("sqlite:x.db", "SQLite").unwrap(), ["sqlite:x.db"]);
        for bad in [
            "mysql://u:s3cret@h1,,h2/db",
            "mysql://u:s3cret@h1,/db",
            "mysql://u:s3cret@,h1/db",
            "mysql://u:s3cret@h1, ,h2/db",
        ] {
            assert!(
                matches!(split_hosts(bad, "MySQL"), Err(Error::Config(m)) if !m.contains("s3cret") && m.contains("MySQL")),
                "{bad}"
            );
        }
    }

    #[test]
    fn url_params_split_own_from_the_driver_s() {
        let p = UrlParams::parse(
            "postgres://u:pw@h/db?sslmode=disable&schema=billing&table=effects&options[search_path]=x#f",
            "PostgreSQL",
            &["schema", "table"],
            &["sslmode", "options[…]"],
        )
        .unwrap();
        assert_eq!(
            (p.get("schema"), p.get("table")),
            (Some("billing"), Some("effects"))
        );
        assert_eq!(p.get("sslmode"), None);
        assert_eq!(
            p.driver_url(),
            "postgres://u:pw@h/db?sslmode=disable&options[search_path]=x#f"
        );
        // Only its own parameters: the driver gets the URL without a query.
        let p = UrlParams::parse("nats://n1?&bucket=a%2Db+c&", "NATS", &["bucket"], &[]).unwrap();
        assert_eq!((p.get("bucket"), p.driver_url()), (Some("a-b c"), "nats://n1"));
        let p = UrlParams::parse("memory:", "memory", &[], &[]).unwrap();
        assert_eq!(p.driver_url(), "memory:");
    }

    #[test]
    fn url_params_nobody_reads_are_refused_without_quoting_the_url() {
        for (url, says) in [
            (
                "postgres://u:s3cret@h/db?tabel=x",
                "unknown PostgreSQL URL parameter 'tabel' (expected schema, table, or one its driver \
                 reads: sslmode, options[…])",
            ),
            (
                "postgres://u:s3cret@h/db?table=a&table=b",
                "PostgreSQL URL parameter table is given twice",
            ),
            (
                "postgres://u@h/db?token:s3cret",
                "unknown PostgreSQL URL parameter (expected",
            ),
            (
                "postgres://u@h/db?options[]=s3cret",
                "unknown PostgreSQL URL parameter (expected",
            ),
        ] {
            let e = UrlParams::parse(
                url,
                "PostgreSQL",
                &["schema", "table"],
                &["sslmode", "options[…]"],
            )
            .unwrap_err();
            let Error::Config(m) = e else {
                panic!("{url}: {e:?}")
            };
            assert!(m.contains(says), "{url}: {m}");
            assert!(!m.contains("s3cret"), "{url}: {m}");
        }
        let e = UrlParams::parse("memory:?x=1", "memory", &[], &[]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "configuration: unknown memory URL parameter 'x' (it takes none)"
        );
    }
}

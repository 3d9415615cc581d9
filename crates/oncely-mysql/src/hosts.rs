//! Which server the pool connects to: a URL's host list
//! (`mysql://app@db1:3306,db2:3306,db3:3306/app`, which sqlx refuses), the
//! check of every new connection, and moving to another host when the
//! current one goes away.
//!
//! Every new connection is checked in the pool's `after_connect`
//! ([`sql::SESSION_CHECK`]): a Galera node must be in the primary component
//! and synced (`wsrep_ready = ON`, `wsrep_cluster_status = Primary`,
//! `wsrep_local_state_comment = Synced`: a joiner, a donor or a node cut off
//! is refused), and a ledger that writes refuses a read-only server
//! (`@@read_only`, `@@super_read_only`, `@@innodb_read_only`: a replica),
//! instead of connecting and failing later. When an operation finds the
//! server gone (a connection error, 1047, 1053, no answer within the
//! operation timeout) or a new connection is refused, [`Hosts::suspect`]
//! starts one background search: it probes every host at once and points
//! the pool at the first that will do (`Pool::set_connect_options`, read by
//! connections opened from then on). Connections opened before a suspicion
//! are closed instead of handed out (`before_acquire`), so a pool full of
//! sockets to a dead or frozen node is not drained one timeout at a time.
//!
//! The same design as oncely-postgres' `hosts.rs` (which also follows
//! `target_session_attrs` and re-points a listener), written for this
//! driver's types; the two are to share one implementation once there is a
//! place for sqlx-generic code outside oncely's core.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely::backend::Backoff;
use oncely::{Error, Result};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{ConnectOptions, Connection, MySqlConnection, MySqlPool, Row};
use tokio::task::JoinSet;

use crate::error::BACKEND;
use crate::sql;

/// How long a background search keeps looking before it gives up (the next
/// failed operation starts another): a node rejoins in seconds, an operator
/// may take longer.
const SEARCH_FOR: Duration = Duration::from_secs(120);

/// The pauses between the search's rounds of probes.
const SEARCH_FIRST: Duration = Duration::from_millis(50);
const SEARCH_MAX: Duration = Duration::from_secs(1);

/// What the session check read on a server.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Server {
    /// The first of `read_only`, `super_read_only`, `innodb_read_only`
    /// that is on, if any.
    read_only: Option<String>,
    /// On a Galera node (`wsrep_on`): `wsrep_ready`,
    /// `wsrep_cluster_status`, `wsrep_local_state_comment`.
    galera: Option<(String, String, String)>,
}

impl Server {
    /// Reads the rows of [`sql::SESSION_CHECK`] (`name`, `value`).
    fn from_rows(rows: &[(String, String)]) -> Server {
        let get = |name: &str| {
            rows.iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        };
        let on = |v: Option<&str>| v.is_some_and(|v| v.eq_ignore_ascii_case("ON") || v == "1");
        let read_only = ["read_only", "super_read_only", "innodb_read_only"]
            .into_iter()
            .find(|name| on(get(name)))
            .map(str::to_owned);
        let galera = on(get("wsrep_on")).then(|| {
            let status = |name: &str| get(name).unwrap_or("(none)").to_owned();
            (
                status("wsrep_ready"),
                status("wsrep_cluster_status"),
                status("wsrep_local_state_comment"),
            )
        });
        Server { read_only, galera }
    }

    /// Why a ledger (`writes`: one that writes) cannot use this server, and
    /// whether that lasts (a read-only server stays so; a Galera node that
    /// is joining, donating or cut off serves again once synced).
    fn refusal(&self, writes: bool) -> Option<(String, bool)> {
        if let Some((ready, status, state)) = &self.galera
            && !(ready.eq_ignore_ascii_case("ON") && status == "Primary" && state == "Synced")
        {
            return Some((
                format!(
                    "a Galera node that does not serve (wsrep_ready={ready}, wsrep_cluster_status={status}, \
                     wsrep_local_state_comment={state}; it must be ON, Primary, Synced)"
                ),
                false,
            ));
        }
        if writes && let Some(var) = &self.read_only {
            return Some((
                format!(
                    "a read-only server (@@{var} is ON: a replica?), and this ledger writes \
                     (open it with MySqlLedgerOptions::read_only to read there)"
                ),
                true,
            ));
        }
        None
    }
}

/// The hosts of one ledger's URL, which of them the pool connects to, and
/// the search that moves it.
#[derive(Debug)]
pub(crate) struct Hosts {
    /// One set of connection options per host, in the URL's order.
    list: Vec<MySqlConnectOptions>,
    /// Whether the ledger writes (a read-only server is refused).
    writes: bool,
    /// The host the pool connects to now.
    current: AtomicUsize,
    /// Connections opened before this instant are closed, not handed out.
    epoch: Mutex<Instant>,
    /// Whether a search runs.
    searching: AtomicBool,
    /// The ledger's pool, which the search re-points; taken out when the
    /// ledger is dropped (the pool's hooks hold this, so the pool holding
    /// itself would never be freed).
    pool: Mutex<Option<MySqlPool>>,
    /// How long one probe may take (the pool's acquire timeout).
    probe_timeout: Duration,
    /// Why the last new connection was refused (for the error of an
    /// acquire that timed out meanwhile).
    refusal: Mutex<Option<String>>,
}

impl Hosts {
    pub(crate) fn new(list: Vec<MySqlConnectOptions>, writes: bool, probe_timeout: Duration) -> Arc<Hosts> {
        Arc::new(Hosts {
            list,
            writes,
            current: AtomicUsize::new(0),
            epoch: Mutex::new(Instant::now()),
            searching: AtomicBool::new(false),
            pool: Mutex::new(None),
            probe_timeout,
            refusal: Mutex::new(None),
        })
    }

    /// The connection options of host `n`.
    pub(crate) fn options(&self, n: usize) -> &MySqlConnectOptions {
        &self.list[n]
    }

    /// The index of a host that will do, probing all at once (the first to
    /// answer as wanted wins: a frozen host listed first does not hold up
    /// the others): [`Error::Config`] when every host answered and each is
    /// read-only, for a ledger that writes; else [`Error::Unavailable`]
    /// saying what each host answered.
    pub(crate) async fn locate(&self) -> Result<usize> {
        let mut probes = JoinSet::new();
        for (n, options) in self.list.iter().enumerate() {
            let options = options.clone();
            let timeout = self.probe_timeout;
            probes.spawn(async move { (n, tokio::time::timeout(timeout, probe(options)).await) });
        }
        let mut answers: Vec<Option<std::result::Result<Server, String>>> = vec![None; self.list.len()];
        while let Some(joined) = probes.join_next().await {
            let Ok((n, answer)) = joined else { continue };
            let answer = match answer {
                Ok(Ok(server)) => Ok(server),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {:?}", self.probe_timeout)),
            };
            if let Ok(server) = &answer
                && server.refusal(self.writes).is_none()
            {
                probes.abort_all();
                return Ok(n);
            }
            answers[n] = Some(answer);
        }
        let mut lasting = true;
        let said: Vec<String> = answers
            .iter()
            .zip(&self.list)
            .map(|(a, o)| {
                let what = match a {
                    Some(Ok(server)) => match server.refusal(self.writes) {
                        Some((why, lasts)) => {
                            lasting &= lasts;
                            why
                        }
                        None => "usable".to_owned(),
                    },
                    Some(Err(e)) => {
                        lasting = false;
                        e.clone()
                    }
                    None => {
                        lasting = false;
                        "no answer".to_owned()
                    }
                };
                format!("{}: {what}", host_name(o))
            })
            .collect();
        let message = if self.list.len() == 1 {
            said.join("")
        } else {
            format!("no host of the URL's list will do: {}", said.join("; "))
        };
        if lasting {
            Err(Error::Config(message))
        } else {
            Err(Error::Unavailable {
                backend: BACKEND,
                message,
            })
        }
    }

    /// Starts with host `n` (found by [`Hosts::locate`]) and re-points
    /// `pool` from now on.
    pub(crate) fn attach(&self, pool: &MySqlPool, n: usize) {
        self.current.store(n, Ordering::Release);
        *self.pool.lock().unwrap_or_else(|p| p.into_inner()) = Some(pool.clone());
    }

    /// Lets the pool go (the ledger is dropped).
    pub(crate) fn detach(&self) {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// Why the last new connection was refused, if one was.
    pub(crate) fn refusal(&self) -> Option<String> {
        self.refusal.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The pool options with the session check on every new connection
    /// (after `session`, the ledger's own session settings) and the epoch
    /// check on every idle one.
    pub(crate) fn hook(self: &Arc<Self>, options: MySqlPoolOptions, read_only: bool) -> MySqlPoolOptions {
        let on_connect = self.clone();
        let on_acquire = self.clone();
        options
            .after_connect(move |conn, _| {
                let hosts = on_connect.clone();
                Box::pin(async move {
                    use sqlx::Executor;
                    conn.execute(sql::STRICT_SESSION).await?;
                    if read_only {
                        conn.execute(sql::READ_ONLY_SESSION).await?;
                    }
                    let server = session(conn).await?;
                    let Some((why, _)) = server.refusal(hosts.writes) else {
                        return Ok(());
                    };
                    let message = format!("a new connection reached {why}");
                    *hosts.refusal.lock().unwrap_or_else(|p| p.into_inner()) = Some(message.clone());
                    hosts.suspect();
                    Err(sqlx::Error::Configuration(message.into()))
                })
            })
            .before_acquire(move |_, meta| {
                let fresh = meta.age < on_acquire.epoch_age();
                Box::pin(async move { Ok(fresh) })
            })
    }

    fn epoch_age(&self) -> Duration {
        self.epoch.lock().unwrap_or_else(|p| p.into_inner()).elapsed()
    }

    /// After an operation found the server gone or silent, or a new
    /// connection was refused: the pool's idle connections are not handed
    /// out any more, and a search for a host that will do starts (one at a
    /// time; none with one host, whose connections are simply made anew).
    pub(crate) fn suspect(self: &Arc<Self>) {
        *self.epoch.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        if self.list.len() < 2 || self.searching.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.searching.store(false, Ordering::Release);
            return;
        };
        runtime.spawn(search(self.clone()));
    }
}

/// The background search: probes every host until one will do, for at most
/// [`SEARCH_FOR`], and points the pool at it.
async fn search(hosts: Arc<Hosts>) {
    let started = Instant::now();
    let mut backoff = Backoff::new(SEARCH_FIRST, SEARCH_MAX);
    let found = loop {
        match hosts.locate().await {
            Ok(n) => break Some(n),
            Err(e) if started.elapsed() >= SEARCH_FOR => {
                tracing::warn!(backend = BACKEND, error = %e, "gave up looking for a host to connect to");
                break None;
            }
            Err(_) => backoff.wait(SEARCH_MAX).await,
        }
    };
    if let Some(n) = found {
        let before = hosts.current.swap(n, Ordering::AcqRel);
        if before != n {
            let pool = hosts.pool.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some(pool) = pool {
                pool.set_connect_options(hosts.list[n].clone());
            }
            *hosts.epoch.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
            tracing::warn!(
                backend = BACKEND,
                from = host_name(&hosts.list[before]),
                to = host_name(&hosts.list[n]),
                "the ledger now connects to another host"
            );
        }
        hosts.refusal.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
    hosts.searching.store(false, Ordering::Release);
}

/// Connects to one host and reads what kind of server it is.
async fn probe(options: MySqlConnectOptions) -> std::result::Result<Server, sqlx::Error> {
    let mut conn = options.connect().await?;
    let server = session(&mut conn).await;
    let _ = conn.close().await;
    server
}

/// Runs the session check on `conn` (text protocol: a Galera node outside
/// the primary component still answers `SHOW`).
async fn session(conn: &mut MySqlConnection) -> std::result::Result<Server, sqlx::Error> {
    let rows = sqlx::raw_sql(sql::SESSION_CHECK).fetch_all(&mut *conn).await?;
    let mut pairs = Vec::with_capacity(rows.len());
    for r in &rows {
        let name: String = r.try_get(0)?;
        let value: Option<String> = r.try_get(1)?;
        pairs.push((name, value.unwrap_or_default()));
    }
    Ok(Server::from_rows(&pairs))
}

/// `host:port` (or the socket) of one host, for messages.
pub(crate) fn host_name(o: &MySqlConnectOptions) -> String {
    match o.get_socket() {
        Some(socket) => socket.display().to_string(),
        None if o.get_host().contains(':') && !o.get_host().starts_with('[') => {
            format!("[{}]:{}", o.get_host(), o.get_port())
        }
        None => format!("{}:{}", o.get_host(), o.get_port()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(pairs: &[(&str, &str)]) -> Server {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect();
        Server::from_rows(&pairs)
    }

    #[test]
    fn what_a_ledger_refuses() {
        let plain = rows(&[
            ("read_only", "OFF"),
            ("innodb_read_only", "OFF"),
            ("wsrep_on", "OFF"),
        ]);
        assert_eq!(plain.refusal(true), None);
        let replica = rows(&[("read_only", "OFF"), ("super_read_only", "ON")]);
        let (why, lasts) = replica.refusal(true).unwrap();
        assert!(why.contains("@@super_read_only is ON") && lasts, "{why}");
        assert_eq!(replica.refusal(false), None, "a reading ledger may use a replica");
        let synced = [
            ("read_only", "OFF"),
            ("wsrep_on", "ON"),
            ("wsrep_ready", "ON"),
            ("wsrep_cluster_status", "Primary"),
            ("wsrep_local_state_comment", "Synced"),
        ];
        assert_eq!(rows(&synced).refusal(true), None);
        let mut donor = synced;
        donor[4].1 = "Donor/Desynced";
        let (why, lasts) = rows(&donor).refusal(false).unwrap();
        assert!(
            why.contains("wsrep_local_state_comment=Donor/Desynced") && !lasts,
            "{why}"
        );
        let mut cut_off = synced;
        cut_off[2].1 = "OFF";
        cut_off[3].1 = "non-Primary";
        let (why, _) = rows(&cut_off).refusal(true).unwrap();
        assert!(
            why.contains("wsrep_ready=OFF, wsrep_cluster_status=non-Primary"),
            "{why}"
        );
    }
}

//! Which server the pool connects to: a URL's host list
//! (`postgres://app@h1:5432,h2:5432/app`) and `target_session_attrs`, which
//! sqlx 0.9 reads neither of, and following a promotion.
//!
//! Every new connection is checked (`sql::SESSION`, in the pool's
//! `after_connect`) against the target: a ledger that writes refuses a
//! standby, so it never connects to one and fails later with "cannot
//! execute … in a read-only transaction". When an operation finds the
//! server gone (a connection error, no answer within the operation timeout)
//! or a new connection lands on a standby, [`Hosts::suspect`] starts one
//! background search: it probes every host at once and points the pool at
//! the first that answers as the target wants (`Pool::set_connect_options`,
//! read by connections opened from then on). Connections opened before a
//! suspicion are closed instead of handed out (`before_acquire`), so a pool
//! full of sockets to a dead or frozen primary is not drained one timeout
//! at a time.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely::backend::Backoff;
use oncely::{Error, Result};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::error::{BACKEND, map};
use crate::sql;

/// How long a background search for the writable server keeps looking
/// before it gives up (the next failed operation starts another): a
/// promotion takes seconds, an operator's failover can take longer.
const SEARCH_FOR: Duration = Duration::from_secs(120);

/// The pauses between the search's rounds of probes.
const SEARCH_FIRST: Duration = Duration::from_millis(50);
const SEARCH_MAX: Duration = Duration::from_secs(1);

/// What kind of server a connection must reach (libpq's
/// `target_session_attrs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// Whatever answers first (libpq's `any`).
    Any,
    /// A server that accepts writes: not in recovery, and
    /// `transaction_read_only` off.
    ReadWrite,
    /// A server not in recovery.
    Primary,
    /// A server in recovery, else any (`prefer-standby`).
    PreferStandby,
    /// A server in recovery.
    Standby,
    /// A server that refuses writes (in recovery, or read-only sessions).
    ReadOnly,
}

impl Target {
    /// The URL's value; `read_only` says whether the ledger only reads.
    pub(crate) fn parse(value: &str, read_only: bool) -> Result<Target> {
        let target = match value {
            "any" => Target::Any,
            "read-write" => Target::ReadWrite,
            "primary" => Target::Primary,
            "prefer-standby" => Target::PreferStandby,
            "standby" => Target::Standby,
            "read-only" => Target::ReadOnly,
            other => {
                return Err(Error::Config(format!(
                    "target_session_attrs={other:?} is not one of any, read-write, primary, read-only, \
                     standby, prefer-standby"
                )));
            }
        };
        if !read_only && matches!(target, Target::PreferStandby | Target::Standby | Target::ReadOnly) {
            return Err(Error::Config(format!(
                "target_session_attrs={value} is for a ledger that only reads (PgLedgerOptions::read_only): \
                 this one writes, and a standby refuses writes"
            )));
        }
        Ok(target)
    }

    /// What a ledger checks without the parameter: a writing one, a
    /// writable server; a reading one, any.
    pub(crate) fn default_for(read_only: bool) -> Target {
        if read_only { Target::Any } else { Target::ReadWrite }
    }

    /// Whether a server in this state will do; `first_pass` is false on
    /// the fallback pass of `prefer-standby`.
    fn accepts(self, state: Server, first_pass: bool) -> bool {
        match self {
            Target::Any => true,
            Target::ReadWrite => !state.in_recovery && !state.read_only,
            Target::Primary => !state.in_recovery,
            Target::PreferStandby => state.in_recovery || !first_pass,
            Target::Standby => state.in_recovery,
            Target::ReadOnly => state.in_recovery || state.read_only,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Target::Any => "any server",
            Target::ReadWrite => "a server that accepts writes (target_session_attrs=read-write)",
            Target::Primary => "a primary (target_session_attrs=primary)",
            Target::PreferStandby | Target::Standby => "a standby",
            Target::ReadOnly => "a read-only server",
        }
    }
}

/// What the session check read on a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Server {
    in_recovery: bool,
    read_only: bool,
}

impl Server {
    fn describe(self) -> &'static str {
        match (self.in_recovery, self.read_only) {
            (true, _) => "a standby (in recovery)",
            (false, true) => "read-only (transaction_read_only is on)",
            (false, false) => "a primary",
        }
    }
}

/// The hosts of one ledger's URL, which of them the pool connects to, and
/// the search that moves it.
#[derive(Debug)]
pub(crate) struct Hosts {
    /// One set of connection options per host, in the URL's order.
    list: Vec<PgConnectOptions>,
    target: Target,
    /// The host the pool connects to now.
    current: AtomicUsize,
    /// Connections opened before this instant are closed, not handed out.
    epoch: Mutex<Instant>,
    /// Whether a search runs.
    searching: AtomicBool,
    /// The ledger's pool, which the search re-points; taken out when the
    /// ledger is dropped (the pool's hooks hold this, so the pool holding
    /// itself would never be freed).
    pool: Mutex<Option<PgPool>>,
    /// How long one probe may take (the pool's connect timeout).
    probe_timeout: Duration,
    /// Bumped whenever the pool is pointed at another host: the listener
    /// reconnects.
    moved: watch::Sender<u64>,
    /// Why the last new connection was refused (for the error of an
    /// acquire that timed out meanwhile).
    refusal: Mutex<Option<String>>,
}

impl Hosts {
    pub(crate) fn new(list: Vec<PgConnectOptions>, target: Target, probe_timeout: Duration) -> Arc<Hosts> {
        Arc::new(Hosts {
            list,
            target,
            current: AtomicUsize::new(0),
            epoch: Mutex::new(Instant::now()),
            searching: AtomicBool::new(false),
            pool: Mutex::new(None),
            probe_timeout,
            moved: watch::Sender::new(0),
            refusal: Mutex::new(None),
        })
    }

    /// The connection options of host `n`.
    pub(crate) fn options(&self, n: usize) -> &PgConnectOptions {
        &self.list[n]
    }

    /// The index of the host that answers as the target wants, probing all
    /// at once: [`Error::Config`] when every host answered and none will
    /// do (every one a standby, for a ledger that writes), else
    /// [`Error::Unavailable`] saying what each host answered.
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
                // One host: its own error, as sqlx gave it (a refused
                // password stays what it is, not "unavailable").
                Ok(Err(e)) if self.list.len() == 1 => return Err(map(e)),
                Ok(Err(e)) => Err(map(e).to_string()),
                Err(_) => Err(format!("no answer within {:?}", self.probe_timeout)),
            };
            // The first to answer as wanted wins (a frozen host listed
            // first must not hold up the search); prefer-standby waits for
            // every answer before it settles for a primary.
            if let Ok(server) = answer
                && self.target.accepts(server, true)
            {
                probes.abort_all();
                return Ok(n);
            }
            answers[n] = Some(answer);
        }
        if let Some(n) = answers
            .iter()
            .position(|a| matches!(a, Some(Ok(s)) if self.target.accepts(*s, false)))
        {
            return Ok(n);
        }
        let said: Vec<String> = answers
            .iter()
            .zip(&self.list)
            .map(|(a, o)| {
                let what = match a {
                    Some(Ok(server)) => server.describe().to_owned(),
                    Some(Err(e)) => e.clone(),
                    None => "no answer".to_owned(),
                };
                format!("{}: {what}", host_name(o))
            })
            .collect();
        let every_answered = answers.iter().all(|a| matches!(a, Some(Ok(_))));
        let message = format!("no host is {}: {}", self.target.describe(), said.join("; "));
        if every_answered {
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
    pub(crate) fn attach(&self, pool: &PgPool, n: usize) {
        self.current.store(n, Ordering::Release);
        *self.pool.lock().unwrap_or_else(|p| p.into_inner()) = Some(pool.clone());
    }

    /// Lets the pool go (the ledger is dropped).
    pub(crate) fn detach(&self) {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// A receiver that changes whenever the pool is pointed at another host.
    pub(crate) fn moved(&self) -> watch::Receiver<u64> {
        self.moved.subscribe()
    }

    /// Why the last new connection was refused, if one was.
    pub(crate) fn refusal(&self) -> Option<String> {
        self.refusal.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The pool options with the session check on every new connection and
    /// the epoch check on every idle one.
    pub(crate) fn hook(self: &Arc<Self>, options: PgPoolOptions) -> PgPoolOptions {
        let on_connect = self.clone();
        let on_acquire = self.clone();
        options
            .after_connect(move |conn, _| {
                let hosts = on_connect.clone();
                Box::pin(async move {
                    if hosts.target == Target::Any {
                        return Ok(());
                    }
                    let server = session(conn).await?;
                    if hosts.target.accepts(server, false) {
                        return Ok(());
                    }
                    let message = format!(
                        "a new connection reached {}, not {}",
                        server.describe(),
                        hosts.target.describe()
                    );
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
    /// connection found the wrong kind of server: the pool's idle
    /// connections are not handed out any more, and a search for the right
    /// server starts (one at a time).
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

/// The background search: probes every host until one answers as wanted,
/// for at most [`SEARCH_FOR`], and points the pool at it.
async fn search(hosts: Arc<Hosts>) {
    let started = Instant::now();
    let mut backoff = Backoff::new(SEARCH_FIRST, SEARCH_MAX);
    let found = loop {
        match hosts.locate().await {
            Ok(n) => break Some(n),
            Err(e) if started.elapsed() >= SEARCH_FOR => {
                tracing::warn!(backend = BACKEND, error = %e, "gave up looking for the server to connect to");
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
            hosts.moved.send_modify(|m| *m += 1);
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
async fn probe(options: PgConnectOptions) -> std::result::Result<Server, sqlx::Error> {
    let mut conn = options.connect().await?;
    let server = session(&mut conn).await;
    let _ = conn.close().await;
    server
}

async fn session(conn: &mut sqlx::PgConnection) -> std::result::Result<Server, sqlx::Error> {
    let (in_recovery, read_only): (bool, bool) = sqlx::query_as(sql::SESSION).fetch_one(conn).await?;
    Ok(Server {
        in_recovery,
        read_only,
    })
}

/// `host:port` (or the socket) of one host, for messages.
pub(crate) fn host_name(o: &PgConnectOptions) -> String {
    match o.get_socket() {
        Some(socket) => socket.display().to_string(),
        None if o.get_host().contains(':') => format!("[{}]:{}", o.get_host(), o.get_port()),
        None => format!("{}:{}", o.get_host(), o.get_port()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        let standby = Server {
            in_recovery: true,
            read_only: true,
        };
        let primary = Server {
            in_recovery: false,
            read_only: false,
        };
        assert!(!Target::ReadWrite.accepts(standby, false));
        assert!(Target::ReadWrite.accepts(primary, true));
        assert!(!Target::PreferStandby.accepts(primary, true));
        assert!(Target::PreferStandby.accepts(primary, false));
        assert_eq!(Target::default_for(false), Target::ReadWrite);
        assert_eq!(Target::default_for(true), Target::Any);
        assert!(matches!(Target::parse("standby", false), Err(Error::Config(_))));
        assert_eq!(Target::parse("standby", true).unwrap(), Target::Standby);
        assert!(
            matches!(Target::parse("readwrite", false), Err(Error::Config(m)) if m.contains("read-write"))
        );
    }
}

//! What the server did for a row, per job, from its own counters read
//! before and after the row: its CPU time, and the statements, scripts,
//! write transactions, fsyncs and WAL bytes the backend counts live.
//!
//! Every counter is the server's (or the machine's) total, not the
//! bench's share of it: the figures are right on a server nobody else uses
//! while the bench runs, which is how the bench is meant to be run.
//!
//! | backend    | CPU                               | counted live |
//! |------------|-----------------------------------|--------------|
//! | PostgreSQL | `postgres` processes (`/proc`)    | write transactions (transaction ids handed out: `pg_snapshot_xmax`), WAL bytes (`pg_current_wal_lsn`) |
//! | MariaDB    | `mariadbd`/`mysqld` (`/proc`)     | statements (`Questions`), fsyncs (`Innodb_data_fsyncs`: the redo log's at each commit, and the data files') |
//! | Redis      | `INFO cpu` (the server's own)     | commands and scripts (`INFO commandstats`, less the bench's `INFO`) |
//! | NATS       | `nats-server` (`/proc`)           | none |
//!
//! CPU from `/proc` is read only when the URL names this machine
//! (loopback, `localhost` or a socket). PostgreSQL's statement counts and
//! WAL flushes are not here: the first needs `pg_stat_statements` preloaded,
//! and the server reports the second (`pg_stat_wal`) only when a backend
//! flushes its statistics, up to ten seconds later. `crates/oncely-postgres/tests/relaxed.rs`
//! counts the flushes per job on a one-connection ledger instead.

use serde::Serialize;

/// A server's counters at one moment; `None` where the backend has no such
/// counter, or the bench cannot read it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Sample {
    /// CPU time, microseconds.
    pub(super) cpu_us: Option<f64>,
    /// Statements or commands run.
    pub(super) statements: Option<u64>,
    /// Scripts run (Redis `EVALSHA`, `EVAL`, `FCALL` and their `_RO` forms).
    pub(super) scripts: Option<u64>,
    /// Transaction ids handed out (PostgreSQL: one per transaction that
    /// wrote).
    pub(super) write_transactions: Option<u64>,
    /// fsyncs of the redo log and the data files (MariaDB; since 10.8 the
    /// log's are counted there, one per group commit).
    pub(super) fsyncs: Option<u64>,
    /// WAL written, bytes (PostgreSQL).
    pub(super) wal_bytes: Option<u64>,
}

/// What the server did per job of a row (both of its deliveries, and the
/// redelivery of a rejected one): the difference of its counters over the
/// row, divided by the row's jobs. `None` where the backend has no such
/// counter (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ServerUse {
    /// Server CPU time per job, microseconds.
    pub cpu_us_per_job: Option<f64>,
    /// Statements (MariaDB `Questions`) or commands (Redis) per job.
    pub statements_per_job: Option<f64>,
    /// Redis scripts per job.
    pub scripts_per_job: Option<f64>,
    /// PostgreSQL transactions that wrote, per job.
    pub write_transactions_per_job: Option<f64>,
    /// MariaDB fsyncs (`Innodb_data_fsyncs`) per job.
    pub fsyncs_per_job: Option<f64>,
    /// PostgreSQL WAL bytes per job.
    pub wal_bytes_per_job: Option<f64>,
}

impl ServerUse {
    /// Whether any counter was read.
    pub fn is_empty(&self) -> bool {
        *self == ServerUse::default()
    }
}

impl Sample {
    /// Per job from `self` to `after`, less `own` statements per sample
    /// (those the bench's own reading ran, counted by the server).
    pub(super) fn until(&self, after: &Sample, jobs: u64, own: u64) -> ServerUse {
        let jobs = jobs.max(1) as f64;
        let per = |a: Option<u64>, b: Option<u64>, own: u64| {
            Some(b?.saturating_sub(a?).saturating_sub(own) as f64 / jobs)
        };
        ServerUse {
            cpu_us_per_job: self
                .cpu_us
                .zip(after.cpu_us)
                .map(|(a, b)| (b - a).max(0.0) / jobs),
            statements_per_job: per(self.statements, after.statements, own),
            scripts_per_job: per(self.scripts, after.scripts, 0),
            write_transactions_per_job: per(self.write_transactions, after.write_transactions, 0),
            fsyncs_per_job: per(self.fsyncs, after.fsyncs, 0),
            wal_bytes_per_job: per(self.wal_bytes, after.wal_bytes, 0),
        }
    }
}

/// The name of the server's processes on a backend whose CPU is read from
/// `/proc`, when `url` names this machine.
pub(super) fn local_processes(backend: &str, url: &str) -> &'static [&'static str] {
    let names: &'static [&'static str] = match backend {
        "postgres" => &["postgres"],
        "mysql" => &["mariadbd", "mysqld"],
        "nats" => &["nats-server"],
        _ => &[],
    };
    if names.is_empty() || !is_local(url) {
        return &[];
    }
    names
}

/// Whether the URL's host is this machine: empty (a socket), `localhost`,
/// or a loopback address (`127.x.x.x`, `::1`). The first host of a list.
fn is_local(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let first = host_port.split(',').next().unwrap_or("");
    let host = if let Some(v6) = first.strip_prefix('[') {
        v6.split(']').next().unwrap_or("")
    } else {
        first.split(':').next().unwrap_or("")
    };
    host.is_empty() || host == "localhost" || host.starts_with("127.") || host == "::1"
}

/// The CPU time (user and system) of every process named one of `names`,
/// in microseconds; `None` when there is none, or `/proc` cannot be read.
pub(super) fn proc_cpu_us(names: &[&str]) -> Option<f64> {
    if names.is_empty() {
        return None;
    }
    // /proc reports CPU times in clock ticks of USER_HZ, 100 per second on
    // Linux (fixed for user space whatever the kernel's HZ).
    const TICK_US: f64 = 10_000.0;
    let mut ticks = 0u64;
    let mut found = false;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        if !entry
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue; // it exited
        };
        if let Some((name, t)) = parse_stat(&stat)
            && names.contains(&name)
        {
            ticks += t;
            found = true;
        }
    }
    found.then_some(ticks as f64 * TICK_US)
}

/// A `/proc/<pid>/stat` line's command name and user + system ticks.
fn parse_stat(stat: &str) -> Option<(&str, u64)> {
    // `pid (comm) state ppid …`: comm may hold spaces and parentheses, so
    // it ends at the last ')'. utime and stime are fields 14 and 15.
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let name = stat.get(open + 1..close)?;
    let fields: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((name, utime + stime))
}

/// Redis's `INFO cpu commandstats` as a sample: the server's CPU, its
/// commands but `INFO`, and its scripts.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(super) fn redis_info(info: &str) -> Sample {
    let mut cpu = None::<f64>;
    let mut statements = 0u64;
    let mut scripts = 0u64;
    for line in info.lines() {
        let line = line.trim();
        if let Some(v) = line
            .strip_prefix("used_cpu_sys:")
            .or_else(|| line.strip_prefix("used_cpu_user:"))
        {
            if let Ok(seconds) = v.parse::<f64>() {
                *cpu.get_or_insert(0.0) += seconds * 1e6;
            }
        } else if let Some((command, stats)) = line
            .strip_prefix("cmdstat_")
            .and_then(|rest| rest.split_once(':'))
        {
            let calls: u64 = stats
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            if command == "info" {
                continue;
            }
            statements += calls;
            if matches!(
                command,
                "evalsha" | "eval" | "fcall" | "evalsha_ro" | "eval_ro" | "fcall_ro"
            ) {
                scripts += calls;
            }
        }
    }
    Sample {
        cpu_us: cpu,
        statements: Some(statements),
        scripts: Some(scripts),
        ..Sample::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_gives_its_name_and_ticks() {
        let stat = "4242 (postgres) S 1 4242 4242 0 -1 4194560 250 0 0 0 17 5 0 0 20 0 1 0 9 0 0";
        assert_eq!(parse_stat(stat), Some(("postgres", 22)));
        // A name with spaces and parentheses ends at the last ')'.
        let odd = "7 (a b) c) S 1 7 7 0 -1 0 0 0 0 0 3 4 0 0 20 0 1 0 9 0 0";
        assert_eq!(parse_stat(odd), Some(("a b) c", 7)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn only_urls_of_this_machine_read_its_processes() {
        for local in [
            "postgres://postgres@127.0.0.1:5432/test",
            "postgres:///test?host=/var/run/postgresql",
            "mysql://root@localhost/test",
            "mysql://root@127.0.0.1:4001,127.0.0.1:4002/test",
            "nats://[::1]:4222",
        ] {
            assert!(is_local(local), "{local}");
        }
        for remote in ["postgres://db.example:5432/x", "nats://10.0.0.2:4222", "memory:"] {
            assert!(!is_local(remote), "{remote}");
        }
        assert_eq!(
            local_processes("postgres", "postgres://127.0.0.1/test"),
            &["postgres"]
        );
        assert!(local_processes("postgres", "postgres://db.example/test").is_empty());
        assert!(local_processes("sqlite", "sqlite:/tmp/x.db").is_empty());
    }

    #[test]
    fn redis_info_counts_commands_but_its_own() {
        let info = "# CPU\r\nused_cpu_sys:1.500000\r\nused_cpu_user:2.250000\r\n\
                    # Commandstats\r\ncmdstat_evalsha:calls=10,usec=50,usec_per_call=5.00\r\n\
                    cmdstat_get:calls=4,usec=4,usec_per_call=1.00\r\n\
                    cmdstat_info:calls=99,usec=9,usec_per_call=0.09\r\n";
        let s = redis_info(info);
        assert_eq!(s.cpu_us, Some(3_750_000.0));
        assert_eq!((s.statements, s.scripts), (Some(14), Some(10)));
    }

    #[test]
    fn a_row_is_the_difference_per_job_less_the_bench_s_own() {
        let before = Sample {
            cpu_us: Some(1_000.0),
            statements: Some(100),
            write_transactions: Some(7),
            ..Sample::default()
        };
        let after = Sample {
            cpu_us: Some(3_000.0),
            statements: Some(301),
            write_transactions: Some(207),
            ..Sample::default()
        };
        let u = before.until(&after, 100, 1);
        assert_eq!(u.cpu_us_per_job, Some(20.0));
        assert_eq!(u.statements_per_job, Some(2.0));
        assert_eq!(u.write_transactions_per_job, Some(2.0));
        assert_eq!(u.scripts_per_job, None);
        assert!(!u.is_empty());
        assert!(Sample::default().until(&Sample::default(), 1, 0).is_empty());
    }
}

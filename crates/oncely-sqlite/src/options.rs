//! How a ledger opens its database: the options, the URL forms and what a
//! URL names (a file, or storage that does not survive), and from both, the
//! connect options of the pool ([`open`]). Nothing here touches a database.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use oncely::open::LedgerOptions;
use oncely::open::UrlParams;
use oncely::{Error, Result};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};

use crate::durability::{memory_fs, on_memory_fs};
use crate::sql;

/// How [`SqliteLedger::connect_with`](crate::SqliteLedger::connect_with)
/// opens the database, and what
/// [`SqliteLedger::from_pool_with`](crate::SqliteLedger::from_pool_with)
/// takes from them (the table, [`read_only`](Self::read_only),
/// [`multi_process`](Self::multi_process); the pool's settings are the
/// pool's).
#[derive(Debug, Clone)]
pub struct SqliteLedgerOptions {
    pub(crate) max_connections: u32,
    pub(crate) table: String,
    pub(crate) busy_timeout: Duration,
    pub(crate) acquire_timeout: Duration,
    pub(crate) synchronous: SqliteSynchronous,
    pub(crate) migrate: bool,
    pub(crate) read_only: bool,
    pub(crate) ephemeral: bool,
    pub(crate) multi_process: bool,
}

impl Default for SqliteLedgerOptions {
    /// 16 connections, table `oncely_effects`, a 5 s busy timeout, a 30 s
    /// acquire timeout, `PRAGMA synchronous = FULL`, migrations on connect,
    /// read-write, durable storage only, one process.
    fn default() -> Self {
        SqliteLedgerOptions {
            max_connections: 16,
            table: sql::DEFAULT_TABLE.to_owned(),
            busy_timeout: Duration::from_secs(5),
            acquire_timeout: Duration::from_secs(30),
            synchronous: SqliteSynchronous::default(),
            migrate: true,
            read_only: false,
            ephemeral: false,
            multi_process: false,
        }
    }
}

impl SqliteLedgerOptions {
    /// Most connections in the pool (default 16). SQLite runs one writer at a
    /// time; more connections help concurrent readers and keep waiting
    /// writers off each other's connections.
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// The ledger table (default `oncely_effects`). Its horizon table is
    /// `<table>_horizon`, its outbox `<table>_outbox`.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// How long a writer waits for SQLite's write lock before failing with a
    /// retryable error (default 5 s).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// How long an operation waits for a free pooled connection (default 30 s).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// `PRAGMA synchronous` (default `Full`; see the crate docs' table).
    pub fn synchronous(mut self, synchronous: SqliteSynchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// Create the file if it is missing and create or upgrade the tables on
    /// connect (default `true`). With `false`, connect creates and changes
    /// nothing: the file and the tables must exist at the current schema
    /// version, or connect fails with [`Error::Config`] naming what is
    /// missing.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Open the file read-only (default `false`): SQLite's `mode=ro`, no file
    /// is created, nothing is migrated (implies `migrate(false)`), the schema
    /// is verified, and every write ([`claim`](oncely::backend::Ledger::claim),
    /// `complete`, `release`, `renew`, `prune`, `begin`) fails with
    /// [`Error::Config`] before it reaches the database. For operator
    /// commands that only read (`get`, `abandoned`, `horizon`).
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// Accept a database that does not survive (default `false`):
    /// `sqlite::memory:`, `mode=memory`, `vfs=memdb`, an empty path
    /// (`sqlite:`), or a file on a memory file system (`tmpfs` or `ramfs`,
    /// such as `/dev/shm`; checked on Linux and Android). Without it such
    /// URLs fail with [`Error::Config`] (a read-only ledger may open a file
    /// on a memory file system: it writes nothing). With it, an in-memory
    /// URL opens one in-memory database shared by the ledger's whole pool
    /// (not one per connection), kept alive as long as any clone of the
    /// ledger exists, and reported as `durability` none; a file on a memory
    /// file system is opened as a file (shared with other processes, kept
    /// until the machine stops) and reported as such. A URL that names a
    /// file on a disk is refused with `ephemeral(true)`: the two requests
    /// contradict.
    pub fn ephemeral(mut self, ephemeral: bool) -> Self {
        self.ephemeral = ephemeral;
        self
    }

    /// Other processes claim and complete in this file too (default
    /// `false`). A duplicate that finds the effect in progress is woken by
    /// completions and releases made in this process only (SQLite cannot
    /// tell other processes); without this option it waits for that
    /// wake-up and, when the holder is in another process, looks again after
    /// [`NOTIFIED_FALLBACK`](oncely::backend::NOTIFIED_FALLBACK) (1 s) or when
    /// the holder's lease ends, whichever comes first. With it, waiters poll
    /// instead (5 ms, doubling up to 250 ms), which answers them sooner
    /// when the holder is elsewhere, at the cost of a claim statement per
    /// look.
    pub fn multi_process(mut self, multi_process: bool) -> Self {
        self.multi_process = multi_process;
        self
    }

    /// The default options with what a `sqlite:` URL sets (`?table=`,
    /// `mode=ro` as [`read_only`](Self::read_only)), checked:
    /// [`Error::Config`] for a parameter neither the ledger nor sqlx reads,
    /// or a bad table name. Nothing is opened; the URL's storage is checked
    /// when connecting.
    pub fn from_url(url: &str) -> Result<Self> {
        let target = parse(url)?;
        let mut options = SqliteLedgerOptions::default();
        if let Some(table) = target.table {
            sql::check_table_name(&table)?;
            options.table = table;
        }
        Ok(options.read_only(target.read_only))
    }
}

/// How [`FromUrl::from_url`](oncely::open::FromUrl::from_url) opens
/// ([`LedgerOptions::for_open`]).
impl LedgerOptions for SqliteLedgerOptions {
    fn existing_only(self) -> Self {
        self.migrate(false)
    }

    fn reads_only(self) -> Self {
        self.read_only(true)
    }

    /// Both waits that stand between a command and its answer: the busy
    /// timeout (SQLite's write lock) and the pool's acquire timeout.
    fn open_within(self, timeout: Duration) -> Self {
        self.busy_timeout(timeout).acquire_timeout(timeout)
    }
}

/// `PRAGMA synchronous`: when SQLite waits for the disk, and so what a
/// completed record survives (see the crate docs' table, and
/// [`Capabilities::durability`](oncely::backend::Capabilities::durability), which
/// reports the setting in effect).
///
/// This crate's own type rather than sqlx's, so that the option does not tie
/// a caller to the driver's version; the values are SQLite's, which are
/// fixed.
// Exhaustive by design (ARCHITECTURE.md, API boundaries): SQLite's own values, which are fixed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum SqliteSynchronous {
    /// No waiting for the disk: an OS crash or power loss may lose or corrupt
    /// records, and effects may run again.
    Off,
    /// Survives process crashes; with WAL, a power loss may roll back the
    /// last commits (an effect could run again).
    Normal,
    /// Survives process crashes and power loss once `complete` returns (the
    /// default).
    #[default]
    Full,
    /// `Full`, plus a sync of the directory after a rollback journal is
    /// deleted.
    Extra,
}

impl SqliteSynchronous {
    fn to_sqlx(self) -> sqlx::sqlite::SqliteSynchronous {
        match self {
            SqliteSynchronous::Off => sqlx::sqlite::SqliteSynchronous::Off,
            SqliteSynchronous::Normal => sqlx::sqlite::SqliteSynchronous::Normal,
            SqliteSynchronous::Full => sqlx::sqlite::SqliteSynchronous::Full,
            SqliteSynchronous::Extra => sqlx::sqlite::SqliteSynchronous::Extra,
        }
    }
}

/// Where the database a URL names lives.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Storage {
    /// A file on disk.
    File(PathBuf),
    /// Memory: gone with the last connection (or private to each one).
    Memory,
    /// An empty path: SQLite gives every connection its own temporary
    /// database, so a table made on one connection is missing on the next.
    Temporary,
}

/// The query parameters a `sqlite:` URL may set on the ledger itself
/// ([`SqliteLedgerOptions::table`]); sqlx never sees them.
const OWN_PARAMS: &[&str] = &["table"];

/// The query parameters sqlx reads (sqlx-sqlite 0.9,
/// `SqliteConnectOptions::from_db_and_params`).
const DRIVER_PARAMS: &[&str] = &["mode", "cache", "immutable", "vfs"];

/// A parsed URL.
struct Target {
    connect: SqliteConnectOptions,
    storage: Storage,
    /// The URL itself says `mode=ro`.
    read_only: bool,
    /// The URL's `?table=`.
    table: Option<String>,
}

/// Parses `sqlite:path`, `sqlite://path` (with optional `?…` parameters) or
/// a bare path, and tells what it names. Nothing is opened.
fn parse(url: &str) -> Result<Target> {
    let config = |e: sqlx::Error| Error::Config(format!("{url}: {e}"));
    let lower = url.to_ascii_lowercase();
    let own = if lower.starts_with("sqlite:") {
        Some(UrlParams::parse(url, "SQLite", OWN_PARAMS, DRIVER_PARAMS)?)
    } else {
        None
    };
    let (connect, database, params) = if let Some(own) = &own {
        // sqlx strips a lowercase scheme only, and splits off the parameters
        // the same way.
        let rest = &own.driver_url()["sqlite:".len()..];
        let connect = SqliteConnectOptions::from_str(&format!("sqlite:{rest}")).map_err(config)?;
        let rest = rest.strip_prefix("//").unwrap_or(rest);
        let (database, params) = rest.split_once('?').unwrap_or((rest, ""));
        (connect, database, params)
    } else {
        (SqliteConnectOptions::new().filename(url), url, "")
    };
    // sqlx keeps `mode` and `vfs` private (and its lossy URL panics on an
    // in-memory name), so the parameters it accepted are read again here.
    let param = |name: &str| {
        params.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            (k == name).then(|| v.to_ascii_lowercase())
        })
    };
    let mode = param("mode");
    // A bare path starting with `file:` reaches SQLite as a URI filename,
    // whose own parameters sqlx does not parse.
    let uri = database.to_ascii_lowercase();
    let uri_memory = uri.starts_with("file:")
        && (uri.contains(":memory:") || uri.contains("mode=memory") || uri.contains("vfs=memdb"));
    let storage = if database == ":memory:"
        || mode.as_deref() == Some("memory")
        || param("vfs").as_deref() == Some("memdb")
        || uri_memory
    {
        Storage::Memory
    } else if database.is_empty() {
        Storage::Temporary
    } else {
        Storage::File(connect.get_filename().to_path_buf())
    };
    Ok(Target {
        connect,
        storage,
        read_only: mode.as_deref() == Some("ro"),
        table: own.as_ref().and_then(|p| p.get("table")).map(str::to_owned),
    })
}

/// Why a URL's storage is refused without `ephemeral(true)`.
fn not_durable(url: &str, storage: &Storage) -> Error {
    let why = match storage {
        Storage::Temporary => {
            "an empty path opens a private temporary database for every pooled connection: \
             the tables migrate creates on one are missing on the next"
        }
        _ => {
            "an in-memory database does not survive the process, and records that vanish let effects run again"
        }
    };
    Error::Config(format!(
        "{url}: {why}. Use a file path, or SqliteLedgerOptions::ephemeral(true) for a \
         non-durable in-memory ledger (tests), or oncely::MemoryLedger"
    ))
}

static EPHEMERAL_SEQ: AtomicU64 = AtomicU64::new(0);

/// One in-memory database for a whole pool: SQLite's `memdb` VFS shares a
/// database among the connections of a process when its name starts with
/// `/`, and locks it like a file (so `BEGIN IMMEDIATE` and the busy timeout
/// behave as on disk, unlike a shared-cache `:memory:` database). The name
/// is unique per ledger.
fn ephemeral_options() -> SqliteConnectOptions {
    let n = EPHEMERAL_SEQ.fetch_add(1, Ordering::Relaxed);
    SqliteConnectOptions::new()
        .filename(format!("/oncely-ephemeral-{}-{n}", std::process::id()))
        .vfs("memdb")
        .create_if_missing(true)
}

/// What [`SqliteLedger::connect_with`](crate::SqliteLedger::connect_with)
/// opens, decided from the URL and the options.
pub(crate) struct Opening {
    /// The pool's connect options, with the ledger's settings applied.
    pub(crate) connect: SqliteConnectOptions,
    /// Asked for by the options or by the URL (`mode=ro`).
    pub(crate) read_only: bool,
    /// Create the file and migrate (never when read-only).
    pub(crate) migrate: bool,
    /// An in-memory database, which lives only while a connection to it
    /// is open (not a file, even one on a memory file system).
    pub(crate) memory: bool,
    /// The ledger table: the URL's `?table=`, else the options'.
    pub(crate) table: String,
}

/// Decides what to open and how. Options that contradict each other or the
/// URL, and storage that would not survive (unless `ephemeral`), are refused
/// with [`Error::Config`] here, before anything opens.
pub(crate) fn open(url: &str, options: &SqliteLedgerOptions) -> Result<Opening> {
    if options.max_connections == 0 {
        return Err(Error::Config("max_connections must be at least 1".to_owned()));
    }
    let target = parse(url)?;
    let table = target.table.unwrap_or_else(|| options.table.clone());
    sql::check_table_name(&table)?;
    let read_only = options.read_only || target.read_only;
    let migrate = options.migrate && !read_only;
    let memory = !matches!(target.storage, Storage::File(_));
    let connect = match (&target.storage, options.ephemeral) {
        (Storage::File(path), ephemeral) => {
            // Checked before anything opens, so that a refused path is not
            // left with a new database file in it.
            let fs = memory_fs(directory_of(path));
            match fs {
                Some(fs) if !ephemeral && !read_only => {
                    return Err(on_memory_fs(url, path.display(), fs));
                }
                None if ephemeral => {
                    return Err(Error::Config(format!(
                        "{url}: ephemeral(true) asks for an in-memory database, but this names the file {} \
                         on a disk; drop ephemeral(true) to keep records in it, or use sqlite::memory:",
                        path.display()
                    )));
                }
                _ => {}
            }
            // Only a migrating ledger creates the file: a mistyped path
            // in a read command must not become an empty new database.
            // (A `file:` URI filename is SQLite's to resolve; opening it
            // without create fails the same way, as Unavailable.)
            let uri = path.to_string_lossy().starts_with("file:");
            if !migrate && !uri && !path.exists() {
                let why = if read_only { "read-only" } else { "migrate(false)" };
                return Err(Error::Config(format!(
                    "no SQLite database at {} ({why} creates none): check the path, or run \
                     `oncely migrate` to create it",
                    path.display()
                )));
            }
            let mut connect = target.connect.create_if_missing(migrate).read_only(read_only);
            if !read_only {
                connect = connect.journal_mode(SqliteJournalMode::Wal);
            }
            connect
        }
        (storage, false) => return Err(not_durable(url, storage)),
        (_, true) if read_only => {
            return Err(Error::Config(format!(
                "{url}: an ephemeral database starts empty; opening it read-only leaves nothing to read"
            )));
        }
        (_, true) => ephemeral_options(),
    }
    .synchronous(options.synchronous.to_sqlx())
    .busy_timeout(options.busy_timeout)
    .foreign_keys(true);
    Ok(Opening {
        connect,
        read_only,
        migrate,
        memory,
        table,
    })
}

/// The directory a database file is (or would be) created in.
fn directory_of(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_classified_before_anything_opens() {
        for (url, storage) in [
            ("sqlite:data/app.db", Storage::File("data/app.db".into())),
            (
                "sqlite://data/app.db?mode=rwc",
                Storage::File("data/app.db".into()),
            ),
            ("SQLite:/tmp/x.db", Storage::File("/tmp/x.db".into())),
            ("data/app.db", Storage::File("data/app.db".into())),
            ("sqlite::memory:", Storage::Memory),
            ("sqlite://:memory:", Storage::Memory),
            (":memory:", Storage::Memory),
            ("sqlite://file?mode=memory", Storage::Memory),
            ("sqlite:/x.db?vfs=memdb", Storage::Memory),
            ("sqlite:/x.db?vfs=MEMDB", Storage::Memory),
            ("file:/x.db?vfs=memdb", Storage::Memory),
            ("file::memory:", Storage::Memory),
            ("sqlite:", Storage::Temporary),
            ("sqlite://", Storage::Temporary),
            ("sqlite://?cache=private", Storage::Temporary),
            ("", Storage::Temporary),
        ] {
            assert_eq!(parse(url).unwrap().storage, storage, "{url}");
        }
        assert!(parse("sqlite:x.db?mode=ro").unwrap().read_only);
        assert!(!parse("sqlite:x.db").unwrap().read_only);
        assert!(matches!(parse("sqlite:x.db?mode=bogus"), Err(Error::Config(_))));
    }

    #[test]
    fn options_from_a_url_are_the_defaults_with_its_table_and_mode() {
        let o = SqliteLedgerOptions::from_url("sqlite:data/app.db?mode=ro&table=effects").unwrap();
        assert_eq!(
            (o.table.as_str(), o.read_only, o.migrate),
            ("effects", true, true)
        );
        let o = SqliteLedgerOptions::from_url("data/app.db").unwrap();
        assert_eq!((o.table.as_str(), o.read_only), (sql::DEFAULT_TABLE, false));
        for bad in ["sqlite:x.db?tabel=effects", "sqlite:x.db?table=a-b"] {
            assert!(
                matches!(SqliteLedgerOptions::from_url(bad), Err(Error::Config(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_url_names_the_table_and_nothing_unknown() {
        let t = parse("sqlite://data/app.db?mode=rwc&table=effects").unwrap();
        assert_eq!(t.storage, Storage::File("data/app.db".into()));
        assert_eq!(t.table.as_deref(), Some("effects"));
        assert_eq!(parse("sqlite:data/app.db").unwrap().table, None);
        // A `#` before the query is the file's.
        let t = parse("sqlite:data#1.db?table=effects").unwrap();
        assert_eq!(t.storage, Storage::File("data#1.db".into()));
        for (bad, says) in [
            (
                "sqlite:x.db?tabel=effects",
                "unknown SQLite URL parameter 'tabel' (expected table, or one its driver reads: mode, cache, immutable, vfs)",
            ),
            (
                "sqlite:x.db?table=a&table=b",
                "SQLite URL parameter table is given twice",
            ),
        ] {
            match parse(bad) {
                Err(Error::Config(m)) => assert!(m.contains(says), "{bad}: {m}"),
                Err(e) => panic!("{bad}: {e:?}"),
                Ok(_) => panic!("{bad} parsed"),
            }
        }
    }
}

//! How a ledger opens its database: the options, what a URL names (a file,
//! or storage that does not survive), and what the opened database really
//! is (journal mode, `synchronous`), reported as its durability.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use oncely::{Error, Result};
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection, SqliteSynchronous};

use crate::error::map;
use crate::queries;

/// How [`SqliteLedger::connect_with`](crate::SqliteLedger::connect_with)
/// opens the database.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SqliteLedgerOptions {
    /// Most connections in the pool (default 16). SQLite runs one writer at a
    /// time; more connections help concurrent readers and keep waiting
    /// writers off each other's connections.
    pub max_connections: u32,
    /// The ledger table (default `oncely_effects`). Its horizon table is
    /// `<table>_horizon`.
    pub table: String,
    /// How long a writer waits for SQLite's write lock before failing with a
    /// retryable error (default 5 s).
    pub busy_timeout: Duration,
    /// How long an operation waits for a free pooled connection (default 30 s).
    pub acquire_timeout: Duration,
    /// `PRAGMA synchronous` (default `Full`; see the crate docs' table).
    pub synchronous: SqliteSynchronous,
    /// Create the file if it is missing and create or upgrade the tables on
    /// connect (default `true`). With `false`, connect creates and changes
    /// nothing: the file and the tables must exist at the current schema
    /// version, or connect fails with [`Error::Config`] naming what is
    /// missing.
    pub migrate: bool,
    /// Open the file read-only (default `false`): SQLite's `mode=ro`, no file
    /// is created, nothing is migrated (implies `migrate(false)`), the schema
    /// is verified, and every write ([`claim`](oncely::Ledger::claim),
    /// `complete`, `release`, `renew`, `prune`, `begin`) fails with
    /// [`Error::Config`] before it reaches the database. For operator
    /// commands that only read (`get`, `abandoned`, `horizon`).
    pub read_only: bool,
    /// Accept a database that does not survive the ledger (default `false`):
    /// `sqlite::memory:`, `mode=memory`, `vfs=memdb`, or an empty path
    /// (`sqlite:`). Without it such URLs fail with [`Error::Config`]. With it,
    /// the ledger opens one in-memory database shared by its whole pool (not
    /// one per connection), kept alive as long as any clone of the ledger
    /// exists, and reports `durability` as none. A URL that names a file is
    /// refused with `ephemeral(true)`: the two requests contradict.
    pub ephemeral: bool,
}

impl Default for SqliteLedgerOptions {
    fn default() -> Self {
        SqliteLedgerOptions {
            max_connections: 16,
            table: queries::DEFAULT_TABLE.to_owned(),
            busy_timeout: Duration::from_secs(5),
            acquire_timeout: Duration::from_secs(30),
            synchronous: SqliteSynchronous::Full,
            migrate: true,
            read_only: false,
            ephemeral: false,
        }
    }
}

impl SqliteLedgerOptions {
    /// Sets the pool size.
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// Sets the ledger table name.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// Sets the busy timeout.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Sets the pool acquire timeout.
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Sets `PRAGMA synchronous`.
    pub fn synchronous(mut self, synchronous: SqliteSynchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// Whether connect creates the file and creates or upgrades the tables
    /// (see [`SqliteLedgerOptions::migrate`](#structfield.migrate)).
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Whether to open the file read-only (see
    /// [`SqliteLedgerOptions::read_only`](#structfield.read_only)).
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// Whether to accept a database that does not survive the ledger (see
    /// [`SqliteLedgerOptions::ephemeral`](#structfield.ephemeral)).
    pub fn ephemeral(mut self, ephemeral: bool) -> Self {
        self.ephemeral = ephemeral;
        self
    }
}

/// Where the database a URL names lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Storage {
    /// A file on disk.
    File(PathBuf),
    /// Memory: gone with the last connection (or private to each one).
    Memory,
    /// An empty path: SQLite gives every connection its own temporary
    /// database, so a table made on one connection is missing on the next.
    Temporary,
}

/// A parsed URL.
pub(crate) struct Target {
    pub(crate) connect: SqliteConnectOptions,
    pub(crate) storage: Storage,
    /// The URL itself says `mode=ro`.
    pub(crate) read_only: bool,
}

/// Parses `sqlite:path`, `sqlite://path` (with optional `?…` parameters) or
/// a bare path, and tells what it names. Nothing is opened.
pub(crate) fn parse(url: &str) -> Result<Target> {
    let config = |e: sqlx::Error| Error::Config(format!("{url}: {e}"));
    let lower = url.to_ascii_lowercase();
    let (connect, database, params) = if lower.starts_with("sqlite:") {
        // sqlx strips a lowercase scheme only, and splits off the parameters
        // the same way.
        let rest = &url["sqlite:".len()..];
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
    })
}

/// Why a URL's storage is refused without `ephemeral(true)`.
pub(crate) fn not_durable(url: &str, storage: &Storage) -> Error {
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
pub(crate) fn ephemeral_options() -> SqliteConnectOptions {
    let n = EPHEMERAL_SEQ.fetch_add(1, Ordering::Relaxed);
    SqliteConnectOptions::new()
        .filename(format!("/oncely-ephemeral-{}-{n}", std::process::id()))
        .vfs("memdb")
        .create_if_missing(true)
}

const DURABLE_WAL_FULL: &str = "local file, WAL, synchronous=FULL: survives process crashes and power loss";
const DURABLE_WAL_EXTRA: &str = "local file, WAL, synchronous=EXTRA: survives process crashes and power loss";
const DURABLE_WAL_NORMAL: &str =
    "local file, WAL, synchronous=NORMAL: survives process crashes; a power loss may undo the last commits";
const DURABLE_ROLLBACK_FULL: &str =
    "local file, rollback journal, synchronous=FULL: survives process crashes and power loss";
const DURABLE_ROLLBACK_EXTRA: &str =
    "local file, rollback journal, synchronous=EXTRA: survives process crashes and power loss";
const DURABLE_ROLLBACK_NORMAL: &str = "local file, rollback journal, synchronous=NORMAL: survives process crashes; \
     a power loss at the wrong moment may corrupt the database";
const DURABLE_OFF: &str =
    "local file, synchronous=OFF: an OS crash or power loss may lose or corrupt records";
const DURABLE_READ_ONLY: &str = "local file opened read-only: this handle writes nothing; records are as durable \
     as the settings of the ledger that wrote them";
pub(crate) const DURABLE_EPHEMERAL: &str =
    "none: an in-memory database (ephemeral), lost when the last clone of the ledger is dropped";
pub(crate) const DURABLE_NONE: &str = "none: an in-memory or temporary database";
pub(crate) const DURABLE_UNCHECKED: &str =
    "unchecked: a caller's pool; call migrate() or verify() to read its journal mode and synchronous setting";

/// What one of the pool's connections says the database is.
#[derive(Debug)]
pub(crate) struct Probe {
    /// The main database's file (empty: memory or temporary).
    pub(crate) file: String,
    pub(crate) journal_mode: String,
    /// `PRAGMA synchronous`: 0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA.
    pub(crate) synchronous: i64,
}

impl Probe {
    pub(crate) async fn read(conn: &mut SqliteConnection) -> Result<Probe> {
        let file: String = sqlx::query_scalar("SELECT file FROM pragma_database_list WHERE name = 'main'")
            .fetch_one(&mut *conn)
            .await
            .map_err(map)?;
        let journal_mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&mut *conn)
            .await
            .map_err(map)?;
        let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous")
            .fetch_one(&mut *conn)
            .await
            .map_err(map)?;
        Ok(Probe {
            file,
            journal_mode: journal_mode.to_ascii_lowercase(),
            synchronous,
        })
    }

    /// Whether the records are kept in a file (not memory, not a
    /// per-connection temporary database). An in-memory VFS such as `memdb`
    /// names a file but cannot journal to disk: its journal mode says so.
    pub(crate) fn is_file(&self) -> bool {
        !self.file.is_empty() && !matches!(self.journal_mode.as_str(), "memory" | "off")
    }

    /// What a completed record survives, from the settings in effect.
    pub(crate) fn durability(&self, read_only: bool) -> &'static str {
        if !self.is_file() {
            return DURABLE_NONE;
        }
        if read_only {
            return DURABLE_READ_ONLY;
        }
        let wal = self.journal_mode == "wal";
        match (self.synchronous, wal) {
            (0, _) => DURABLE_OFF,
            (1, true) => DURABLE_WAL_NORMAL,
            (1, false) => DURABLE_ROLLBACK_NORMAL,
            (3, true) => DURABLE_WAL_EXTRA,
            (3, false) => DURABLE_ROLLBACK_EXTRA,
            (_, true) => DURABLE_WAL_FULL,
            (_, false) => DURABLE_ROLLBACK_FULL,
        }
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
}

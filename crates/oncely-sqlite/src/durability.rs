//! What an opened database really is (the file, its journal mode and
//! `synchronous` setting, read from SQLite itself, and the file system it
//! is on), and what a completed record in it survives:
//! [`Capabilities::durability`](oncely::backend::Capabilities::durability).

use std::path::Path;

use oncely::{Error, Result};
use sqlx::sqlite::SqliteConnection;
use sqlx::{Decode, Row, Sqlite, Type};

use crate::error::map;
use crate::sql;

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
const DURABLE_EPHEMERAL: &str =
    "none: an in-memory database (ephemeral), lost when the last clone of the ledger is dropped";
const DURABLE_NONE: &str = "none: an in-memory or temporary database";
const DURABLE_MEMORY_FS: &str = "until the machine stops: a file on a memory file system (tmpfs or ramfs) survives \
     process crashes; a reboot, an OS crash or a power loss loses every record";
const DURABLE_MEMORY_FS_READ_ONLY: &str = "a file on a memory file system (tmpfs or ramfs) opened read-only: this \
     handle writes nothing; a reboot, an OS crash or a power loss loses every record in the file";
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
    /// The memory file system the file is on ([`memory_fs`]), if any.
    pub(crate) memory_fs: Option<&'static str>,
}

impl Probe {
    pub(crate) async fn read(conn: &mut SqliteConnection) -> Result<Probe> {
        let file: String = read(conn, sql::DATABASE_FILE, "file").await?;
        let journal_mode: String = read(conn, sql::JOURNAL_MODE, "journal_mode").await?;
        let synchronous: i64 = read(conn, sql::SYNCHRONOUS, "synchronous").await?;
        let mut probe = Probe {
            file,
            journal_mode: journal_mode.to_ascii_lowercase(),
            synchronous,
            memory_fs: None,
        };
        // The file itself, now that it exists: the directory the URL named
        // was checked before opening, but a symbolic link or a `file:` URI
        // can put the file elsewhere.
        if probe.is_file() {
            probe.memory_fs = memory_fs(Path::new(&probe.file));
        }
        Ok(probe)
    }

    /// Whether the records are kept in a file (not memory, not a
    /// per-connection temporary database). An in-memory VFS such as `memdb`
    /// names a file but cannot journal to disk: its journal mode says so.
    pub(crate) fn is_file(&self) -> bool {
        !self.file.is_empty() && !matches!(self.journal_mode.as_str(), "memory" | "off")
    }

    /// The durability of a ledger [`connect_with`](crate::SqliteLedger::connect_with)
    /// has just opened: a URI filename or a VFS that the URL parser did not
    /// recognise must not pass for a durable file, so what SQLite opened is
    /// refused with [`Error::Config`] unless it is a file (or the caller
    /// asked for an ephemeral database). So is a file on a memory file
    /// system that the check before opening could not see (a symbolic
    /// link, a `file:` URI), unless `ephemeral` accepts it or the ledger
    /// only reads.
    pub(crate) fn opened(&self, url: &str, ephemeral: bool, read_only: bool) -> Result<&'static str> {
        // An ephemeral file (on a memory file system) is reported as the
        // file it is.
        if ephemeral && !self.is_file() {
            return Ok(DURABLE_EPHEMERAL);
        }
        if !self.is_file() {
            return Err(Error::Config(format!(
                "{url}: SQLite opened {} with journal_mode={}: not a durable file. Use a file path, or \
                 SqliteLedgerOptions::ephemeral(true) for a non-durable in-memory ledger",
                if self.file.is_empty() {
                    "no file"
                } else {
                    &self.file
                },
                self.journal_mode
            )));
        }
        if let Some(fs) = self.memory_fs
            && !ephemeral
            && !read_only
        {
            return Err(on_memory_fs(url, &self.file, fs));
        }
        Ok(self.durability(read_only))
    }

    /// What a completed record survives, from the settings in effect.
    pub(crate) fn durability(&self, read_only: bool) -> &'static str {
        if !self.is_file() {
            return DURABLE_NONE;
        }
        match (self.memory_fs, read_only) {
            (Some(_), true) => return DURABLE_MEMORY_FS_READ_ONLY,
            (Some(_), false) => return DURABLE_MEMORY_FS,
            (None, true) => return DURABLE_READ_ONLY,
            (None, false) => {}
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

/// Why a file on a memory file system is refused without `ephemeral(true)`.
pub(crate) fn on_memory_fs(url: &str, file: impl std::fmt::Display, fs: &str) -> Error {
    Error::Config(format!(
        "{url}: {file} is on a memory file system ({fs}): a reboot, an OS crash or a power loss would \
         lose every record, and records that vanish let effects run again. Use a path on a disk, or \
         SqliteLedgerOptions::ephemeral(true) to accept a ledger that lasts until the machine stops"
    ))
}

/// The memory file system (`tmpfs`, `ramfs`) that `path` is on, if it is
/// on one: its contents live in RAM (or swap) and are gone at reboot,
/// whatever SQLite syncs. `None` when it is not, or when it cannot be told
/// (the path does not exist).
///
/// Linux and Android only: `statfs` names the file system by a magic
/// number there. Elsewhere nothing is checked and a file on a RAM disk is
/// reported like any file, by its journal mode and `synchronous` setting.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub(crate) fn memory_fs(path: &Path) -> Option<&'static str> {
    use rustix::fs::FsWord;
    // linux/magic.h.
    const TMPFS_MAGIC: FsWord = 0x0102_1994;
    const RAMFS_MAGIC: FsWord = 0x8584_58f6_u32 as FsWord;
    match rustix::fs::statfs(path).ok()?.f_type {
        TMPFS_MAGIC => Some("tmpfs"),
        RAMFS_MAGIC => Some("ramfs"),
        _ => None,
    }
}

/// See the Linux version: no check on this system.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub(crate) fn memory_fs(_path: &Path) -> Option<&'static str> {
    None
}

/// The one column `column` of the one row `statement` returns.
async fn read<T>(conn: &mut SqliteConnection, statement: &'static str, column: &str) -> Result<T>
where
    T: for<'r> Decode<'r, Sqlite> + Type<Sqlite>,
{
    sqlx::query(statement)
        .fetch_one(&mut *conn)
        .await
        .map_err(map)?
        .try_get(column)
        .map_err(map)
}

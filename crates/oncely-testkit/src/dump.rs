//! What an operator's dump of a ledger table shows: the table dumped with
//! the database's own tool (`pg_dump`, `sqlite3 .dump`, `mysqldump`), and a
//! search of it for bytes in every form those tools print them. Data-protection
//! tests use it: after an erasure, or with an outcome codec, a dump must hold
//! none of an outcome's bytes.

use std::io;
use std::path::Path;
use std::process::Command;

/// Runs a dump tool and returns what it printed; a tool that is missing or
/// fails is an error naming it.
fn run(mut cmd: Command, what: &str) -> io::Result<Vec<u8>> {
    let out = cmd
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("{what}: {e}")))?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "{what} exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(out.stdout)
}

/// `pg_dump` of one table (`schema.table`) of the database at `url` (a
/// `postgres://` URL without oncely's own query parameters), schema and data.
pub fn postgres(url: &str, table: &str) -> io::Result<Vec<u8>> {
    let mut cmd = Command::new("pg_dump");
    cmd.arg("--dbname").arg(url).arg("--table").arg(table);
    run(cmd, "pg_dump")
}

/// `sqlite3 <file> .dump`: the whole database file, schema and data.
pub fn sqlite(path: &Path) -> io::Result<Vec<u8>> {
    let mut cmd = Command::new("sqlite3");
    cmd.arg(path).arg(".dump");
    run(cmd, "sqlite3 .dump")
}

/// `mysqldump` of one table of `database` on `host:port` as `root` with an
/// empty password, as it prints by default (binary columns as escaped
/// strings) and with `--hex-blob`, concatenated: a search sees both forms.
pub fn mysql(host: &str, port: u16, database: &str, table: &str) -> io::Result<Vec<u8>> {
    let mut all = Vec::new();
    for hex in [false, true] {
        let mut cmd = Command::new("mysqldump");
        cmd.arg("--host")
            .arg(host)
            .arg("--port")
            .arg(port.to_string())
            .arg("--user=root")
            .arg("--skip-ssl")
            .arg("--single-transaction");
        if hex {
            cmd.arg("--hex-blob");
        }
        cmd.arg(database).arg(table);
        all.extend(run(cmd, "mysqldump")?);
    }
    Ok(all)
}

/// Whether `dump` holds `needle` in any form a dump tool prints bytes in:
/// as they are, or as hexadecimal digits in either case (`pg_dump` prints
/// `bytea` as `\x…`, `sqlite3` blobs as `X'…'`, `mysqldump --hex-blob` as
/// `0x…`).
pub fn contains(dump: &[u8], needle: &[u8]) -> bool {
    if needle.is_empty() {
        return true;
    }
    let lower: String = needle.iter().map(|b| format!("{b:02x}")).collect();
    let upper = lower.to_uppercase();
    let dump_lower = dump.to_ascii_lowercase();
    [needle, lower.as_bytes(), upper.as_bytes()]
        .iter()
        .any(|n| dump.windows(n.len()).any(|w| w == *n))
        || dump_lower.windows(lower.len()).any(|w| w == lower.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::contains;

    #[test]
    fn finds_bytes_raw_and_in_hex() {
        assert!(contains(b"INSERT ... 'secret-123'", b"secret-123"));
        assert!(contains(b"VALUES(X'7365637265742D313233')", b"secret-123"));
        assert!(contains(b"\\x7365637265742d313233\t", b"secret-123"));
        assert!(!contains(b"\\x7365637265742d313234\t", b"secret-123"));
        assert!(!contains(b"nothing here", b"secret-123"));
    }
}

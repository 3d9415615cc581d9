//! What the server keeps of an acknowledged write: its persistence settings
//! (`appendonly`, `appendfsync`, `save`), read on every master when the
//! ledger connects, reported in
//! [`Capabilities::durability`](oncely::backend::Capabilities::durability), and a
//! server that persists nothing refused unless the ledger accepts it
//! ([`RedisLedgerOptions::ephemeral`](crate::RedisLedgerOptions::ephemeral)).

use oncely::{Error, Result};

use crate::conn::{Conn, Node};
use crate::error::map_err;
use crate::options::RedisLedgerOptions;
use crate::reply::{policy_of, text};

/// What one master's configuration keeps, from the least to the most: the
/// order is the one a cluster is reported by (its weakest master). A
/// setting that could not be read ranks with the worst it may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Persistence {
    /// `appendonly no` and no `save` points.
    None,
    /// `INFO persistence` says no AOF; `CONFIG` is not allowed, so whether
    /// snapshots are taken is unknown.
    NoAof,
    /// Neither `CONFIG GET` nor `INFO persistence` answered.
    Unknown,
    /// `save` points, `appendonly no`.
    Snapshots,
    /// `INFO persistence` says AOF; `CONFIG` is not allowed, so
    /// `appendfsync` is unknown.
    Aof,
    /// AOF, `appendfsync no`.
    AofNo,
    /// AOF, `appendfsync everysec` (Redis's default once AOF is on).
    AofEverysec,
    /// AOF, `appendfsync always`.
    AofAlways,
}

impl Persistence {
    /// From `CONFIG GET appendonly`, `appendfsync` and `save`.
    pub(crate) fn from_config(appendonly: &str, appendfsync: &str, save: &str) -> Persistence {
        if appendonly.eq_ignore_ascii_case("yes") {
            match appendfsync.to_ascii_lowercase().as_str() {
                "always" => Persistence::AofAlways,
                "no" => Persistence::AofNo,
                "everysec" => Persistence::AofEverysec,
                _ => Persistence::Aof,
            }
        } else if save.trim().is_empty() {
            Persistence::None
        } else {
            Persistence::Snapshots
        }
    }

    /// From `INFO persistence`, where `CONFIG` is not allowed: it tells
    /// whether AOF is on (`aof_enabled`), not how often it is synced nor
    /// whether snapshots are taken.
    pub(crate) fn from_info(info: &str) -> Persistence {
        let aof = info
            .lines()
            .find_map(|l| l.trim().strip_prefix("aof_enabled:"))
            .map(str::trim);
        match aof {
            Some("1") => Persistence::Aof,
            Some("0") => Persistence::NoAof,
            _ => Persistence::Unknown,
        }
    }

    /// What a completed record survives, for
    /// [`Capabilities::durability`](oncely::backend::Capabilities::durability).
    pub(crate) fn durability(self) -> &'static str {
        match self {
            Persistence::None => {
                "none: the Redis server persists nothing (appendonly no, no save points): a restart loses every record"
            }
            Persistence::NoAof => {
                "no AOF (from INFO persistence; CONFIG is not allowed, so RDB snapshots are unknown): at best \
                 a crash or restart loses every write since the last snapshot, at worst every record"
            }
            Persistence::Unknown => {
                "unknown: the Redis server answers neither CONFIG GET nor INFO persistence; ask its operator \
                 whether it runs with appendonly yes"
            }
            Persistence::Snapshots => {
                "RDB snapshots only (appendonly no): a crash or restart loses every write since the last snapshot"
            }
            Persistence::Aof => {
                "AOF (from INFO persistence; CONFIG is not allowed, so appendfsync is unknown): a crash loses \
                 nothing with appendfsync always, up to about 1 s of acknowledged writes with everysec"
            }
            Persistence::AofNo => {
                "AOF, appendfsync no: survives a crash of the Redis process; an OS crash or a power loss loses \
                 what the OS had not yet written to disk (typically up to 30 s of acknowledged writes)"
            }
            Persistence::AofEverysec => {
                "AOF, appendfsync everysec: a crash loses up to about 1 s of acknowledged writes (2 s when the \
                 disk is slow)"
            }
            Persistence::AofAlways => {
                "AOF, appendfsync always: every write is on disk before its reply; a crash of the server \
                 loses nothing it acknowledged"
            }
        }
    }
}

/// Reads the persistence of every master and returns the weakest's
/// durability. A master that persists nothing fails with [`Error::Config`]
/// unless the options accept it (`ephemeral`) or the ledger only reads
/// (what it reads is there either way). Settings that cannot be read are
/// reported, logged, and accepted: managed services often refuse `CONFIG`.
pub(crate) async fn check(conn: &mut Conn, options: &RedisLedgerOptions) -> Result<&'static str> {
    let mut weakest: Option<(Persistence, Node)> = None;
    for node in conn.masters().await.map_err(map_err)? {
        let found = read(conn, &node).await;
        if weakest.as_ref().is_none_or(|(p, _)| found < *p) {
            weakest = Some((found, node));
        }
    }
    let Some((persistence, node)) = weakest else {
        return Ok(Persistence::Unknown.durability());
    };
    let at = match &node {
        Node::Only => "the Redis server".to_owned(),
        Node::Master { host, port } => format!("the Redis master {host}:{port}"),
    };
    match persistence {
        Persistence::None if !options.ephemeral && !options.read_only => {
            return Err(Error::Config(format!(
                "{at} persists nothing (appendonly no, no save points): a restart loses every claim, \
                 outcome and horizon, and redeliveries then run their effects again. Run it with \
                 appendonly yes (appendfsync everysec or always), or accept a ledger that does not \
                 survive a restart: ?ephemeral=true in the URL, or RedisLedgerOptions::ephemeral(true)"
            )));
        }
        Persistence::NoAof | Persistence::Unknown | Persistence::Snapshots => {
            tracing::warn!(
                durability = persistence.durability(),
                "{at} may lose acknowledged claims and completions on a crash"
            );
        }
        _ => {}
    }
    Ok(persistence.durability())
}

/// One master's persistence: `CONFIG GET`, else `INFO persistence`.
async fn read(conn: &mut Conn, node: &Node) -> Persistence {
    let mut values = Vec::with_capacity(3);
    for param in ["appendonly", "appendfsync", "save"] {
        let reply = conn
            .on(node, redis::cmd("CONFIG").arg("GET").arg(param).clone())
            .await;
        match reply.as_ref().map(policy_of) {
            Ok(Some(v)) => values.push(v),
            Ok(None) | Err(_) => break,
        }
    }
    if let [appendonly, appendfsync, save] = values.as_slice() {
        return Persistence::from_config(appendonly, appendfsync, save);
    }
    // RESP2 sends a bulk string, RESP3 a verbatim one: `text` reads both.
    match conn.on(node, redis::cmd("INFO").arg("persistence").clone()).await {
        Ok(v) => text(&v).map_or(Persistence::Unknown, |t| Persistence::from_info(&t)),
        Err(_) => Persistence::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_classified() {
        for (appendonly, appendfsync, save, want) in [
            ("no", "everysec", "", Persistence::None),
            ("no", "always", " ", Persistence::None),
            (
                "no",
                "everysec",
                "3600 1 300 100 60 10000",
                Persistence::Snapshots,
            ),
            ("yes", "everysec", "", Persistence::AofEverysec),
            ("YES", "Always", "3600 1", Persistence::AofAlways),
            ("yes", "no", "", Persistence::AofNo),
            ("yes", "sometimes", "", Persistence::Aof),
        ] {
            assert_eq!(
                Persistence::from_config(appendonly, appendfsync, save),
                want,
                "{appendonly} {appendfsync} {save:?}"
            );
        }
        let info = "# Persistence\r\nloading:0\r\naof_enabled:1\r\naof_rewrite_in_progress:0\r\n";
        assert_eq!(Persistence::from_info(info), Persistence::Aof);
        assert_eq!(
            Persistence::from_info(&info.replace("aof_enabled:1", "aof_enabled:0")),
            Persistence::NoAof
        );
        assert_eq!(Persistence::from_info(""), Persistence::Unknown);
        // A cluster is reported by its weakest master.
        assert!(Persistence::None < Persistence::Unknown);
        assert!(Persistence::Snapshots < Persistence::AofNo);
        assert!(Persistence::AofEverysec < Persistence::AofAlways);
    }
}

//! The Lua scripts (`src/lua/*.lua`, each one atomic operation on the
//! server) and how a call to each is built and sent. The `ARGV` layout of a
//! script is written once, at the top of its file, and once here.

use std::sync::LazyLock;

use oncely::backend::duration_micros;
use oncely::{ClaimOptions, EffectKey, Result};
use redis::{Cmd, ErrorKind, Script, ServerErrorKind, Value};

use crate::conn::Conn;
use crate::error::map_err;
use crate::options::Wait;

/// A script: the shared prelude (record format, clock, `load`, `wake`) and
/// its file.
macro_rules! lua {
    ($file:literal) => {
        LazyLock::new(|| Script::new(concat!(include_str!("lua/prelude.lua"), include_str!($file))))
    };
}

/// Claims keys of one slot: create, take over, or answer with the record.
pub(crate) static CLAIM: LazyLock<Script> = lua!("lua/claim.lua");
/// Lease holders' writes (complete, release, renew) and the horizon check's
/// take-back and clear, each fenced on its record.
pub(crate) static FENCED: LazyLock<Script> = lua!("lua/fenced.lua");
/// Reads a record.
pub(crate) static GET: LazyLock<Script> = lua!("lua/get.lua");
/// Prune's check and delete of one record.
pub(crate) static PRUNE: LazyLock<Script> = lua!("lua/prune.lua");
/// Raises a horizon watermark (no prelude: it reads no record).
pub(crate) static HORIZON: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/horizon.lua")));

/// `EVALSHA <script> <numkeys>`, for the caller to add the keys and the
/// script's `ARGV`. The hot operations build their call as one [`Cmd`] (one
/// buffer) rather than through [`Script::key`], which first copies every
/// argument into a buffer of its own and then all of them again into a `Cmd`.
fn evalsha(script: &Script, numkeys: usize) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(numkeys);
    cmd
}

/// One record of a call of claim.lua.
pub(crate) struct ClaimItem<'a> {
    /// Its Redis key.
    pub(crate) rkey: &'a str,
    pub(crate) key: &'a EffectKey,
    /// Its horizon watermark's index in the call's `horizons` (one server,
    /// a claim with `sent_at`): read in the script.
    pub(crate) horizon: Option<usize>,
    /// A fence the key's next record must exceed (after a recheck removed
    /// its record).
    pub(crate) floor: Option<u64>,
}

/// A call of claim.lua on `items` (one slot; on one server, any keys).
/// `horizons`: the watermark keys the items name; `sent_at`: the message's
/// production time (µs); `waiter`: the mark left on a record in progress,
/// or `""`; `touch`: whether a record the claim answers with (completed,
/// abandoned) is written to as well, so that a `WAIT` after the call
/// covers it (RedisLedgerOptions::wait_replicas).
pub(crate) fn claim(
    items: &[ClaimItem<'_>],
    horizons: &[&str],
    opts: &ClaimOptions,
    sent_at: Option<i64>,
    waiter: &str,
    touch: bool,
) -> Cmd {
    let mut cmd = evalsha(&CLAIM, items.len() + horizons.len());
    for item in items {
        cmd.arg(item.rkey);
    }
    for hkey in horizons {
        cmd.arg(*hkey);
    }
    cmd.arg(items.len())
        .arg(duration_micros(opts.lease))
        .arg(duration_micros(opts.retention));
    match opts.fingerprint {
        Some(f) => cmd.arg(f.to_hex().as_str()),
        None => cmd.arg(""),
    };
    cmd.arg(if opts.at_most_once { "1" } else { "0" });
    match sent_at {
        Some(us) => cmd.arg(us),
        None => cmd.arg(""),
    };
    cmd.arg(waiter).arg(if touch { "1" } else { "" });
    for item in items {
        cmd.arg(item.key.as_str());
        match item.horizon {
            // The script counts its KEYS from 1, and the records come first.
            Some(i) => cmd.arg(i + 1),
            None => cmd.arg(""),
        };
        match item.floor {
            Some(f) => cmd.arg(f),
            None => cmd.arg(""),
        };
    }
    cmd
}

/// One record of a call of fenced.lua: its Redis key, its effect key, the
/// lease's fence, and the operation's argument (the outcome, the extension,
/// a creation time, or nothing).
pub(crate) struct FencedItem<'a> {
    pub(crate) rkey: &'a str,
    pub(crate) key: &'a EffectKey,
    pub(crate) fence: u64,
    pub(crate) arg: &'a [u8],
}

/// A call of fenced.lua: `op` on each item's record (one slot), only while
/// it is in progress at the item's fence. `mark` and `channel`: the writing
/// ledger's, for waking waiters (notify.rs); `hz`: the record's horizon
/// mark, for `undo` and `checked`.
pub(crate) fn fenced(
    op: &str,
    items: &[FencedItem<'_>],
    mark: &str,
    channel: &str,
    hz: Option<&[u8]>,
) -> Cmd {
    let mut cmd = evalsha(&FENCED, items.len());
    for item in items {
        cmd.arg(item.rkey);
    }
    cmd.arg(items.len()).arg(op).arg(mark).arg(channel);
    for item in items {
        cmd.arg(item.key.as_str()).arg(item.fence).arg(item.arg);
    }
    if let Some(hz) = hz {
        cmd.arg(hz);
    }
    cmd
}

/// A call of get.lua: `key`'s record at `rkey`.
pub(crate) fn get(rkey: &str, key: &EffectKey) -> Cmd {
    let mut cmd = evalsha(&GET, 1);
    cmd.arg(rkey).arg(key.as_str());
    cmd
}

/// Sends a call built here, loading `script` first when the server does
/// not have it (a restart, `SCRIPT FLUSH`, a new cluster node).
pub(crate) async fn run(conn: &Conn, script: &Script, cmd: &Cmd) -> Result<Value> {
    let mut conn = conn.clone();
    match cmd.query_async(&mut conn).await {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            script.load_async(&mut conn).await.map_err(map_err)?;
            cmd.query_async(&mut conn).await.map_err(map_err)
        }
        reply => reply.map_err(map_err),
    }
}

/// [`run`], and `WAIT wait.replicas wait.timeout` after it on the same
/// connection ([`Conn::write_and_wait`]; `slot`: the script's keys'):
/// the script's reply, and how many replicas acknowledged it.
pub(crate) async fn run_and_wait(
    conn: &Conn,
    script: &Script,
    cmd: &Cmd,
    wait: Wait,
    slot: u16,
) -> Result<(Value, u64)> {
    let mut conn = conn.clone();
    let timeout_ms = u64::try_from(wait.timeout.as_millis()).unwrap_or(u64::MAX);
    let mut loaded = false;
    loop {
        let replies = conn
            .write_and_wait(cmd, wait.replicas, timeout_ms, slot)
            .await
            .map_err(map_err)?;
        let [reply, acks]: [Value; 2] = replies
            .try_into()
            .map_err(|_| crate::error::unexpected("a WAIT pipeline of another length"))?;
        match reply.extract_error() {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) && !loaded => {
                script.load_async(&mut conn).await.map_err(map_err)?;
                loaded = true;
            }
            Err(e) => return Err(map_err(e)),
            Ok(reply) => {
                let acks = match acks.extract_error().map_err(map_err)? {
                    Value::Int(n) => u64::try_from(n).unwrap_or(0),
                    other => return Err(crate::error::unexpected(&format!("WAIT answered {other:?}"))),
                };
                return Ok((reply, acks));
            }
        }
    }
}

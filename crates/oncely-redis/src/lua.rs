//! The Lua scripts (`src/lua/*.lua`, each one atomic operation on the
//! server) and how a call to each is built and sent. The `ARGV` layout of a
//! script is written once, at the top of its file, and once here.

use std::sync::LazyLock;

use oncely::backend::duration_micros;
use oncely::{ClaimOptions, EffectKey, Result};
use redis::{Cmd, ErrorKind, Script, ServerErrorKind, Value};

use crate::conn::Conn;
use crate::error::map_err;

/// A script: the shared prelude (record format, clock, `load`) and its file.
macro_rules! lua {
    ($file:literal) => {
        LazyLock::new(|| Script::new(concat!(include_str!("lua/prelude.lua"), include_str!($file))))
    };
}

/// Claims a key: create, take over, or answer with the record.
pub(crate) static CLAIM: LazyLock<Script> = lua!("lua/claim.lua");
/// A lease holder's write (complete, release, renew) and the horizon
/// check's take-back and clear, fenced on the record.
pub(crate) static FENCED: LazyLock<Script> = lua!("lua/fenced.lua");
/// Reads a record.
pub(crate) static GET: LazyLock<Script> = lua!("lua/get.lua");
/// Prune's check and delete of one record.
pub(crate) static PRUNE: LazyLock<Script> = lua!("lua/prune.lua");
/// Raises a horizon watermark (no prelude: it reads no record).
pub(crate) static HORIZON: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/horizon.lua")));

/// `EVALSHA <script> <n> <rkey> [<horizon key>]`, for the caller to add the
/// script's `ARGV`. The hot operations build their call as one [`Cmd`] (one
/// buffer) rather than through [`Script::key`], which first copies every
/// argument into a buffer of its own and then all of them again into a `Cmd`.
fn evalsha(script: &Script, rkey: &str, horizon: Option<&str>) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash());
    match horizon {
        Some(hkey) => cmd.arg(2).arg(rkey).arg(hkey),
        None => cmd.arg(1).arg(rkey),
    };
    cmd
}

/// A call of claim.lua on `rkey`. `horizon`: the watermark key, read in the
/// script (one server, a claim with `sent_at`); `sent_at`: the message's
/// production time (µs); `floor`: a fence the key's next record must exceed.
pub(crate) fn claim(
    rkey: &str,
    horizon: Option<&str>,
    key: &EffectKey,
    opts: &ClaimOptions,
    sent_at: Option<i64>,
    floor: Option<u64>,
) -> Cmd {
    let mut cmd = evalsha(&CLAIM, rkey, horizon);
    cmd.arg(key.as_str())
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
    if let Some(f) = floor {
        cmd.arg(f);
    }
    cmd
}

/// A call of fenced.lua: `op` on `key`'s record at `rkey`, only while it is
/// in progress at `fence`; `args` are the operation's own (ARGV from 4 on).
pub(crate) fn fenced(rkey: &str, key: &EffectKey, fence: u64, op: &str, args: &[&[u8]]) -> Cmd {
    let mut cmd = evalsha(&FENCED, rkey, None);
    cmd.arg(key.as_str()).arg(fence).arg(op);
    for arg in args {
        cmd.arg(*arg);
    }
    cmd
}

/// A call of get.lua: `key`'s record at `rkey`.
pub(crate) fn get(rkey: &str, key: &EffectKey) -> Cmd {
    let mut cmd = evalsha(&GET, rkey, None);
    cmd.arg(key.as_str());
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

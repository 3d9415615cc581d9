//! Markers: how revision-checked writes stay exclusive on a replicated bucket
//! served by nats-server before 2.9.21.
//!
//! Every ledger write is conditional on the key's latest revision (the
//! `Nats-Expected-Last-Subject-Sequence` header). On a clustered stream,
//! nats-server up to 2.9.20 checks that condition only on the stream leader
//! *before* it proposes the message to Raft, against what the leader has
//! applied so far, and does not check it again when the entry is applied
//! (nats-server issue 4320). Two writes expecting the same revision `N`
//! that reach the leader before either is applied are both accepted: eight
//! claimants taking over one expired lease all got `Acquired`, with
//! revisions `N+1..N+8`. An expectation of revision 0 (the subject holds no
//! message) is the exception: those servers check it again when the entry is
//! applied, in the log's order, on every replica, so of all the messages
//! created on one empty subject exactly one is stored.
//!
//! So on such a server, a write on top of revision `N > 0` first *creates*
//! the marker key `_oncely_cas.<N>-<digest>`, where the digest covers the
//! key and the value it was read with at `N` (the *base*): everyone writing
//! on top of that revision names the same marker. (`N` alone would do if
//! every acknowledgement named the right sequence; a 2.9 cluster that lost
//! its leader was seen to acknowledge a write with a sequence the stream
//! reached only later, for another key. A marker made on such a phantom
//! revision then names a base nobody else reads, and blocks nothing.)
//! Only the marker's creator sends its
//! write; everyone else reads the marker and sends the *same* write the
//! marker describes (it names the key and carries the value, or says
//! "delete"), then reports a lost race. The marker decides which write goes
//! on top of `N`; copies of that one write are harmless even if several are
//! accepted (the record holds the same value, at a later revision and
//! stamp, which only lengthens a lease as the server measures it), and they
//! finish the write of a creator that died between its marker and its
//! write, so a crashed claimant never leaves a key stuck. The creator whose
//! own write is refused because a copy landed first finds its value on top
//! and counts the write as its own.
//!
//! From 2.9.21 to 2.11 the server checks every expected revision when the
//! entry is applied, and from 2.12 the leader refuses a conditional write
//! to a subject with one already in flight, so the ledger writes no markers
//! there (`markers_needed`). A single server (R=1) checks under the stream's
//! lock and needs none either.
//!
//! Markers are small and never read again once their revision is
//! superseded: [`oncely::backend::Ledger::prune`] purges those older than
//! [`MARKER_KEEP`] (a purge leaves no delete marker behind), and the
//! bucket's `max_age` drops any it misses.

use std::time::Duration;

use bytes::Bytes;

use crate::NatsKvLedger;
use crate::codec::MARKER_PREFIX;
use crate::error::backend_err;
use crate::kv::{Op, Write, unique_token, wrong_last_revision};

/// How old a marker must be before prune purges it: far longer than any
/// write can stay in flight between its marker and the stream, so a marker
/// is never gone while a write it decided could still land.
pub(crate) const MARKER_KEEP: Duration = Duration::from_secs(3600);

/// The KV key of the marker of the write on top of `revision` of `kv_key`,
/// read with the value `base` (its bytes as this crate encodes them; empty
/// for a delete marker).
pub(crate) fn marker_key(kv_key: &str, revision: u64, base: &[u8]) -> String {
    let mut h = blake3::Hasher::new_derive_key("oncely 2026 nats cas marker");
    h.update(&(kv_key.len() as u64).to_le_bytes());
    h.update(kv_key.as_bytes());
    h.update(base);
    format!("{MARKER_PREFIX}.{revision}-{}", &h.finalize().to_hex()[..32])
}

/// Whether a ledger on a bucket of `replicas`, served by nats-server
/// `version`, writes markers: replicated, and a server before 2.9.21 (or a
/// version it cannot read).
pub(crate) fn markers_needed(replicas: usize, version: &str) -> bool {
    if replicas <= 1 {
        return false;
    }
    let mut parts = version.trim_start_matches('v').split(['.', '-']);
    let mut next = || parts.next().and_then(|p| p.parse::<u64>().ok());
    match (next(), next(), next()) {
        (Some(major), Some(minor), Some(patch)) => (major, minor, patch) < (2, 9, 21),
        _ => true,
    }
}

const MAGIC: &str = "oncely-cas 1";

/// A marker's value: the key it is for, its creator's token, the write.
fn encode(kv_key: &str, token: &str, op: &Op) -> Bytes {
    let mut out = format!("{MAGIC}\n{kv_key}\n{token}\n").into_bytes();
    match op {
        Op::Put(v) => {
            out.push(b'P');
            out.extend_from_slice(v);
        }
        Op::Delete => out.push(b'D'),
    }
    out.into()
}

/// The key and write a marker describes; `None` if it is not a marker.
fn decode(raw: &Bytes) -> Option<(String, Op)> {
    let mut it = raw.splitn(4, |b| *b == b'\n');
    let (magic, key, _token, rest) = (it.next()?, it.next()?, it.next()?, it.next()?);
    if magic != MAGIC.as_bytes() {
        return None;
    }
    let key = std::str::from_utf8(key).ok()?.to_owned();
    let op = match rest.split_first()? {
        (b'P', v) => Op::Put(raw.slice_ref(v)),
        (b'D', []) => Op::Delete,
        _ => return None,
    };
    Some((key, op))
}

impl NatsKvLedger {
    /// `op` on `kv_key` if its latest revision is `revision` (0: it holds no
    /// message), read with the value `base` (see [`marker_key`]). On a bucket
    /// that needs markers, a write on top of a revision is first claimed by
    /// creating that revision's marker (module docs).
    pub(crate) async fn conditional(
        &self,
        kv_key: &str,
        op: Op,
        revision: u64,
        base: &[u8],
        what: &str,
    ) -> Result<Write, oncely::Error> {
        if revision == 0 || !self.inner.markers {
            return self.send(kv_key, &op, revision, what).await;
        }
        let mk = marker_key(kv_key, revision, base);
        let marker = encode(kv_key, &unique_token(), &op);
        match self.inner.store.update(&mk, marker, 0).await {
            Ok(_) => {}
            Err(e) if wrong_last_revision(&e) => {
                self.help(kv_key, &mk, revision, what).await?;
                return Ok(Write::Conflict);
            }
            Err(e) => return Err(backend_err(what, e)),
        }
        match self.send(kv_key, &op, revision, what).await? {
            Write::Done(rev) => Ok(Write::Done(rev)),
            // Only copies of this write can go on top of `revision`: a
            // helper's may have landed first. Found on top, it is this
            // write's; but a value equal to the base (a renewal of the same
            // length) cannot be told from the base itself (the revision may
            // be a phantom, above), so that one reports the lost race and its
            // caller reads again.
            Write::Conflict if matches!(&op, Op::Put(v) if v.as_ref() == base) => Ok(Write::Conflict),
            Write::Conflict => match self.read_raw(kv_key).await? {
                Some(raw)
                    if raw.revision > revision
                        && match &op {
                            Op::Put(v) => raw.payload.as_ref() == Some(v),
                            Op::Delete => raw.payload.is_none(),
                        } =>
                {
                    Ok(Write::Done(raw.revision))
                }
                _ => Ok(Write::Conflict),
            },
        }
    }

    /// Sends the write that the marker of `revision` describes, if it is for
    /// `kv_key`: the marker's creator may have died before sending it, and
    /// until it lands nobody else may write on top of `revision`. Its answer
    /// does not matter (a copy refused means the write is already there).
    async fn help(&self, kv_key: &str, mk: &str, revision: u64, what: &str) -> Result<(), oncely::Error> {
        let Some(raw) = self.read_raw(mk).await? else {
            return Ok(());
        };
        match raw.payload.as_ref().and_then(decode) {
            Some((key, op)) if key == kv_key => {
                if let Err(e) = self.send(kv_key, &op, revision, what).await {
                    tracing::debug!(kv_key, revision, error = %e, "copy of a marked write failed");
                }
            }
            _ => tracing::warn!(kv_key, revision, "a marker that names another key or is not one"),
        }
        Ok(())
    }

    /// Purges the markers at revisions below `below` (prune: those older
    /// than [`MARKER_KEEP`]). A purge leaves no delete marker.
    pub(crate) async fn purge_markers(&self, below: u64) -> Result<u64, oncely::Error> {
        let resp = self
            .inner
            .store
            .stream
            .purge()
            .filter(self.subject(&format!("{MARKER_PREFIX}.>")))
            .sequence(below)
            .await
            .map_err(|e| backend_err("purge markers", e))?;
        Ok(resp.purged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_replicated_buckets_on_servers_before_2_9_21_need_markers() {
        for (replicas, version, needed) in [
            (3, "2.9.10", true),
            (3, "v2.9.20", true),
            (3, "2.8.4", true),
            (3, "2.9.21", false),
            (3, "2.10.0", false),
            (3, "2.15.1", false),
            (3, "2.12.0-RC.1", false),
            (3, "", true),
            (3, "garbage", true),
            (1, "2.9.10", false),
        ] {
            assert_eq!(markers_needed(replicas, version), needed, "{replicas} {version}");
        }
    }

    #[test]
    fn markers_round_trip_and_refuse_anything_else() {
        let v = Bytes::from_static(b"{\"v\":1}\nwith a newline");
        let m = encode("t.abc", "tok", &Op::Put(v.clone()));
        assert_eq!(decode(&m), Some(("t.abc".to_owned(), Op::Put(v))));
        let d = encode("t.abc", "tok", &Op::Delete);
        assert_eq!(decode(&d), Some(("t.abc".to_owned(), Op::Delete)));
        assert_eq!(decode(&Bytes::from_static(b"{}")), None);
        assert_eq!(decode(&Bytes::from_static(b"oncely-cas 1\nk\nt\nX")), None);
        assert_eq!(decode(&Bytes::from_static(b"oncely-cas 1\nk\nt\nDx")), None);
        let k = marker_key("t.abc", 42, b"{}");
        assert!(k.starts_with("_oncely_cas.42-"), "{k}");
        assert_eq!(k.matches('.').count(), 1);
        assert!(
            k.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"-/_=.".contains(&c))
        );
        assert_ne!(k, marker_key("t.abd", 42, b"{}"));
        assert_ne!(k, marker_key("t.abc", 42, b""));
        assert_ne!(k, marker_key("t.abc", 43, b"{}"));
    }
}

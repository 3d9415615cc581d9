//! Every round trip to the bucket (the role `sql.rs` plays in the SQL
//! backends): a read of one key's latest revision from the stream leader, a
//! revision-checked write or delete, and the scan of many keys. The clock
//! probe is in `clock.rs`; the marker that precedes a write on top of a
//! revision on old replicated servers, in `marker.rs`.
//!
//! Every write is one revision-checked message, so a dropped future has
//! either been applied by the server or not, never half, and a write based
//! on a stale read is refused rather than applied.

use std::time::{Duration, SystemTime};

use async_nats::jetstream::kv;
use futures_util::StreamExt;
use oncely::Result;
use oncely::backend::Backoff;

use crate::NatsKvLedger;
use crate::codec::{MARKER_PREFIX, Stored, is_record_key};
use crate::error::{backend_err, corrupt};

/// How often one operation re-reads and retries after losing a race on the
/// same key; defined in `error.rs`, beside `gave_up`, the error that says so.
pub(crate) use crate::error::MAX_ATTEMPTS;

/// The pauses before asking again after the stream leader refused a
/// revision-checked delete whose revision still matched (NATS 2.9 clusters
/// do so under concurrent writes to other keys): short, since the refusal
/// passes as soon as those writes are applied, and growing, so that a busy
/// leader is not asked 64 times in a few milliseconds.
pub(crate) fn refusal_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(5), Duration::from_millis(50))
}

/// One message as read from the stream leader.
pub(crate) struct Raw {
    /// Its stream sequence: the key's revision.
    pub revision: u64,
    /// The server's stamp.
    pub at: SystemTime,
    /// `None`: a delete or purge marker (the key is absent).
    pub payload: Option<bytes::Bytes>,
}

/// One key's latest revision as read from the stream leader.
pub(crate) struct Current {
    /// The key's revision.
    pub revision: u64,
    /// The server's stamp of that revision.
    pub at: SystemTime,
    /// `None`: a delete or purge marker (the key is absent).
    pub value: Option<Stored>,
}

/// A conditional write: what [`NatsKvLedger::send`] sends, and what a
/// marker (`marker.rs`) describes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Op {
    /// Store this value.
    Put(bytes::Bytes),
    /// Delete the key (a delete marker).
    Delete,
}

/// The answer to a revision-checked write.
pub(crate) enum Write {
    /// Written; the new revision.
    Done(u64),
    /// The key's latest revision was not the one expected.
    Conflict,
}

/// Whether a revision-checked write was refused because the key's latest
/// revision was not the one expected: a lost race, not a failure.
/// async-nats 0.51 recognises the server's error code 10071; nats-server
/// 2.11 and later answer some of those refusals with 10164 (the same
/// refusal, without the sequence numbers), which it passes on as another
/// error.
pub(crate) fn wrong_last_revision(e: &kv::UpdateError) -> bool {
    use async_nats::jetstream::ErrorCode;
    if e.kind() == kv::UpdateErrorKind::WrongLastRevision {
        return true;
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(js) = s.downcast_ref::<async_nats::jetstream::Error>() {
            return matches!(
                js.error_code(),
                ErrorCode::STREAM_WRONG_LAST_SEQUENCE | ErrorCode::STREAM_WRONG_LAST_SEQUENCE_CONSTANT
            );
        }
        source = s.source();
    }
    false
}

/// Whether a message's headers mark a delete or a purge.
fn is_delete(headers: Option<&async_nats::HeaderMap>) -> bool {
    headers
        .and_then(|h| h.get("KV-Operation"))
        .is_some_and(|op| matches!(op.as_str(), "DEL" | "PURGE"))
}

impl NatsKvLedger {
    /// The subject of a KV key in the bucket's stream.
    pub(crate) fn subject(&self, kv_key: &str) -> String {
        format!("{}{}", self.inner.store.prefix, kv_key)
    }

    /// Reads a key's latest message from the stream leader (a direct get may
    /// be answered by a lagging replica).
    pub(crate) async fn read_raw(&self, kv_key: &str) -> Result<Option<Raw>> {
        use async_nats::jetstream::stream::LastRawMessageErrorKind as K;
        let msg = match self
            .inner
            .store
            .stream
            .get_last_raw_message_by_subject(&self.subject(kv_key))
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == K::NoMessageFound => return Ok(None),
            Err(e) => return Err(backend_err("read", e)),
        };
        let at = SystemTime::from(msg.time);
        self.inner.clock.observe(at);
        let deleted = is_delete(Some(&msg.headers));
        Ok(Some(Raw {
            revision: msg.sequence,
            at,
            payload: (!deleted).then_some(msg.payload),
        }))
    }

    /// Reads a record's latest revision from the stream leader. A value no
    /// oncely ledger wrote is [`oncely::Error::Corrupt`].
    pub(crate) async fn read(&self, kv_key: &str) -> Result<Option<Current>> {
        let Some(raw) = self.read_raw(kv_key).await? else {
            return Ok(None);
        };
        let value = raw
            .payload
            .map(|p| {
                Stored::decode(&p)
                    .map_err(|e| corrupt(format!("value at {kv_key} is not an oncely record: {e}")))
            })
            .transpose()?;
        Ok(Some(Current {
            revision: raw.revision,
            at: raw.at,
            value,
        }))
    }

    /// A record write that succeeds only if the key's latest revision is
    /// `revision` (0: the key has never been written, or its history is
    /// gone), which holds `base` (`None`: a delete marker).
    pub(crate) async fn write(
        &self,
        kv_key: &str,
        value: &Stored,
        revision: u64,
        base: Option<&Stored>,
    ) -> Result<Write> {
        let base = base.map_or(Ok(bytes::Bytes::new()), Stored::encode)?;
        self.write_raw(kv_key, value.encode()?, revision, &base).await
    }

    /// [`NatsKvLedger::write`] of any value.
    /// `base` is the value at `revision` as this crate encodes it (empty for
    /// a delete marker): it names the write's marker (`marker.rs`).
    pub(crate) async fn write_raw(
        &self,
        kv_key: &str,
        bytes: bytes::Bytes,
        revision: u64,
        base: &[u8],
    ) -> Result<Write> {
        self.conditional(kv_key, Op::Put(bytes), revision, base, "write")
            .await
    }

    /// Deletes `kv_key` if its latest revision is `revision`, which holds
    /// the record `base`: `false` when it is not, or when the stream leader
    /// refused a matching revision (the caller reads again to tell which).
    /// `what` names the operation in errors.
    pub(crate) async fn delete(
        &self,
        kv_key: &str,
        revision: u64,
        base: &Stored,
        what: &str,
    ) -> Result<bool> {
        let base = base.encode()?;
        Ok(matches!(
            self.conditional(kv_key, Op::Delete, revision, &base, what)
                .await?,
            Write::Done(_)
        ))
    }

    /// One revision-checked message, as it is (`marker.rs` decides when it
    /// may be sent). A delete answers `Done(0)`.
    pub(crate) async fn send(&self, kv_key: &str, op: &Op, revision: u64, what: &str) -> Result<Write> {
        let sent = match op {
            Op::Put(bytes) => self.inner.store.update(kv_key, bytes.clone(), revision).await,
            Op::Delete => self
                .inner
                .store
                .delete_expect_revision(kv_key, Some(revision))
                .await
                .map(|()| 0),
        };
        match sent {
            Ok(rev) => Ok(Write::Done(rev)),
            Err(e) if wrong_last_revision(&e) => Ok(Write::Conflict),
            Err(e) => Err(backend_err(what, e)),
        }
    }

    /// The latest revision of every record under `filter` (a subject), read by
    /// an ordered consumer that delivers the last message per subject, and
    /// the revision and stamp of every marker it meets (`marker.rs`).
    pub(crate) async fn scan(
        &self,
        filter: String,
    ) -> Result<(Vec<(String, Current)>, Vec<(u64, SystemTime)>)> {
        use async_nats::jetstream::consumer::{DeliverPolicy, ReplayPolicy, push};
        let consumer = self
            .inner
            .store
            .stream
            .create_consumer(push::OrderedConfig {
                deliver_subject: inbox(),
                filter_subject: filter,
                deliver_policy: DeliverPolicy::LastPerSubject,
                replay_policy: ReplayPolicy::Instant,
                description: Some("oncely scan".to_owned()),
                ..Default::default()
            })
            .await
            .map_err(|e| backend_err("scan", e))?;
        let mut out = Vec::new();
        let mut markers = Vec::new();
        // The consumer goes on delivering new writes after the snapshot; a
        // busy bucket would never let `pending` reach 0, so stop after as
        // many messages as the snapshot held (the live ones come first, in
        // stream order; anything rewritten since is recent anyway).
        let total = consumer.cached_info().num_pending;
        if total == 0 {
            return Ok((out, markers));
        }
        let mut seen = 0u64;
        let mut messages = consumer.messages().await.map_err(|e| backend_err("scan", e))?;
        let prefix = self.inner.store.prefix.clone();
        loop {
            // The pending count can go stale if keys are removed while the
            // scan runs; an idle consumer means everything was delivered.
            let next = match tokio::time::timeout(Duration::from_secs(2), messages.next()).await {
                Ok(Some(m)) => m.map_err(|e| backend_err("scan", e))?,
                Ok(None) | Err(_) => break,
            };
            let info = next.info().map_err(|e| backend_err("scan", e))?;
            let (pending, revision, at) = (
                info.pending,
                info.stream_sequence,
                SystemTime::from(info.published),
            );
            let deleted = is_delete(next.headers.as_ref());
            if let Some(k) = next.subject.strip_prefix(prefix.as_str())
                && is_record_key(k)
            {
                self.inner.clock.observe(at);
                let value = if deleted {
                    None
                } else {
                    match Stored::decode(&next.payload) {
                        Ok(v) => Some(v),
                        Err(e) => {
                            tracing::warn!(kv_key = k, error = %e, "skipping a value that is not an oncely record");
                            None
                        }
                    }
                };
                out.push((k.to_owned(), Current { revision, at, value }));
            } else if next
                .subject
                .strip_prefix(prefix.as_str())
                .is_some_and(|k| k.starts_with(MARKER_PREFIX))
            {
                markers.push((revision, at));
            }
            seen += 1;
            if pending == 0 || seen >= total {
                break;
            }
        }
        Ok((out, markers))
    }
}

/// A fresh inbox subject for one scan's consumer.
fn inbox() -> String {
    format!("_INBOX.oncely.{}", unique_token())
}

/// 32 hex digits no other call in any process is likely to produce: an
/// inbox, a marker's creator.
pub(crate) fn unique_token() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let mut h = blake3::Hasher::new();
    h.update(&std::process::id().to_le_bytes());
    h.update(&nanos.to_le_bytes());
    h.update(&SEQ.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    h.finalize().to_hex()[..32].to_owned()
}

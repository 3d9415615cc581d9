//! Opening the bucket: find it, create it when allowed, and refuse one
//! whose settings could lose or drop records (the role `schema.rs` plays in
//! the SQL backends). A bucket is never changed: an incompatible one is
//! [`Error::Config`] and left as it is.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv, stream};
use oncely::backend::{Attempts, Backoff, retry};
use oncely::{Error, Result};

use crate::NatsKvLedgerOptions;
use crate::codec::MAX_VALUE_BYTES;
use crate::error::{backend_err, no_responders};

/// When `connect` stops waiting for the bucket. Checked: an `open_timeout`
/// too long for `Instant` (`Duration::MAX`) means no deadline, not a panic.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline(Option<Instant>);

impl Deadline {
    /// `timeout` from now.
    pub(crate) fn after(timeout: Duration) -> Self {
        Deadline(Instant::now().checked_add(timeout))
    }

    /// The time left (`Duration::MAX` without a deadline).
    pub(crate) fn remaining(self) -> Duration {
        self.0
            .map_or(Duration::MAX, |d| d.saturating_duration_since(Instant::now()))
    }
}

/// The pauses of a wait for a bucket (or a stream leader) that does not
/// answer yet: a cluster that just (re)started elects leaders within
/// seconds, so asking every 100 ms at first, and at most once a second
/// after, finds it soon without flooding a server that is still starting.
pub(crate) fn opening_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(100), Duration::from_secs(1))
}

/// Opens the bucket, creating it when absent (if `opts` allows), and checks
/// its settings.
///
/// A stream just created on a cluster answers `STREAM.INFO` only once it has
/// elected a leader, so a request that times out (or any other retryable
/// error) is tried again until `deadline`. Settings this ledger cannot rely
/// on fail at once.
pub(crate) async fn open(
    js: &jetstream::Context,
    opts: &NatsKvLedgerOptions,
    deadline: Deadline,
) -> Result<kv::Store> {
    let mut last = String::new();
    let mut creates = 0;
    while creates < 3 {
        let answering = Attempts::new(opening_backoff()).within(deadline.remaining());
        let existing = retry(answering, Error::is_retryable, || async {
            let found = existing(js, opts).await;
            found.inspect_err(|e| tracing::debug!(error = %e, "bucket not answering yet"))
        })
        .await?;
        match existing {
            Some(store) => return Ok(store),
            None if !opts.creates() => {
                return Err(Error::Config(format!(
                    "NATS KV bucket {} does not exist (nothing was created); run `oncely migrate`",
                    opts.bucket
                )));
            }
            None => {
                let created = js.create_stream(stream_config(opts)).await;
                creates += 1;
                match created {
                    Ok(_) => continue,
                    // Another process may have created it meanwhile, with our
                    // settings or others: look again and judge what is there.
                    Err(e) => {
                        tracing::debug!(error = %e, "bucket create failed; re-reading");
                        last = format!("{e}: {:?}", std::error::Error::source(&e));
                    }
                }
            }
        }
    }
    Err(backend_err(
        "open bucket",
        format!("could not create or open bucket {}: {last}", opts.bucket),
    ))
}

/// The stream a KV bucket is made of, written out: the client's
/// `create_key_value` asks for account info in a newer shape than NATS 2.9
/// sends.
fn stream_config(opts: &NatsKvLedgerOptions) -> stream::Config {
    stream::Config {
        name: format!("KV_{}", opts.bucket),
        description: Some("oncely effect ledger".to_owned()),
        subjects: vec![format!("$KV.{}.>", opts.bucket)],
        max_messages_per_subject: 1,
        max_messages: -1,
        max_bytes: -1,
        max_age: opts.max_age,
        max_message_size: -1,
        storage: stream::StorageType::File,
        num_replicas: opts.replicas,
        allow_rollup: true,
        deny_delete: true,
        deny_purge: false,
        allow_direct: true,
        discard: stream::DiscardPolicy::New,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    }
}

/// The bucket, checked, if it exists.
async fn existing(js: &jetstream::Context, opts: &NatsKvLedgerOptions) -> Result<Option<kv::Store>> {
    use async_nats::jetstream::context::GetStreamErrorKind;
    match js.get_stream(format!("KV_{}", opts.bucket)).await {
        Ok(s) => check(&s.cached_info().config, opts)?,
        Err(e) => {
            return match e.kind() {
                GetStreamErrorKind::JetStream(j)
                    if j.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND =>
                {
                    Ok(None)
                }
                // Nobody subscribes to the JetStream API: the server runs
                // without JetStream. A restarting cluster answers late (a
                // timeout), never this, so waiting would not help.
                GetStreamErrorKind::Request if no_responders(&e) => Err(Error::Config(
                    "the NATS server has no JetStream (no responder on its JetStream API); \
                     start nats-server with -js or jetstream {} in its configuration"
                        .into(),
                )),
                _ => Err(backend_err("open bucket", e)),
            };
        }
    }
    js.get_key_value(&opts.bucket)
        .await
        .map(Some)
        .map_err(|e| backend_err("open bucket", e))
}

/// What an acknowledged write survives on a bucket of `replicas` (file
/// storage, the only kind [`check`] accepts), served by nats-server
/// `version` (the server this client is connected to, as it announced
/// itself), for [`Capabilities::durability`](oncely::backend::Capabilities::durability).
///
/// JetStream acknowledges a write once the stream's leader (R=1) or a
/// quorum of its replicas (R=3) has written it to the operating system,
/// and fsyncs its files on a timer: a crash of the server process loses
/// nothing acknowledged, an OS crash or a power loss may lose what was
/// written since the last sync. nats-server 2.9 syncs streams every 2
/// minutes and has no setting for it; from 2.10, `jetstream { sync_interval
/// }` sets the period (default 2 minutes), and `sync_interval: always`
/// syncs every write before its acknowledgement. A client cannot read that
/// setting (the monitoring endpoint `/varz` shows it), so on 2.10 and later
/// the report says what each setting gives.
pub(crate) fn durability(replicas: usize, version: &str) -> &'static str {
    let mut parts = version.trim_start_matches('v').split(['.', '-']);
    let major: Option<u32> = parts.next().and_then(|p| p.parse().ok());
    let minor: Option<u32> = parts.next().and_then(|p| p.parse().ok());
    let fixed_interval = matches!((major, minor), (Some(2), Some(m)) if m < 10);
    match (replicas > 1, fixed_interval) {
        (false, true) => {
            "JetStream file storage, R=1: a write is acknowledged once the server has handed it to the OS; \
             nats-server 2.9 fsyncs streams every 2 min (not configurable), so an OS crash or a power loss \
             can lose up to 2 min of acknowledged claims and completions (a crash of nats-server alone loses none)"
        }
        (false, false) => {
            "JetStream file storage, R=1: a write is acknowledged once the server has handed it to the OS; \
             it fsyncs every sync_interval (2 min unless configured; not readable by a client), so an OS \
             crash or a power loss can lose that long of acknowledged claims and completions, unless the \
             server runs with sync_interval: always (a crash of nats-server alone loses none)"
        }
        (true, true) => {
            "JetStream file storage, R=3: a write is acknowledged once a quorum (2 of 3) has handed it to \
             the OS; a crash or power loss of one node loses nothing acknowledged, but nats-server 2.9 \
             fsyncs only every 2 min (not configurable), so an OS crash or power loss of two nodes within \
             that window can lose acknowledged writes"
        }
        (true, false) => {
            "JetStream file storage, R=3: a write is acknowledged once a quorum (2 of 3) has handed it to \
             the OS; a crash or power loss of one node loses nothing acknowledged, but an OS crash or power \
             loss of two nodes within sync_interval (2 min unless configured; not readable by a client) can \
             lose acknowledged writes, unless the servers run with sync_interval: always"
        }
    }
}

/// Refuses a bucket whose settings could lose or drop records.
pub(crate) fn check(c: &stream::Config, opts: &NatsKvLedgerOptions) -> Result<()> {
    let mut problems = Vec::new();
    if c.max_messages_per_subject != 1 {
        problems.push(format!("history is {} (must be 1)", c.max_messages_per_subject));
    }
    if c.num_replicas.max(1) != opts.replicas {
        problems.push(format!(
            "replicas are {} (configured {})",
            c.num_replicas, opts.replicas
        ));
    }
    if c.storage != stream::StorageType::File {
        problems.push("storage is memory (must be file)".to_owned());
    }
    if !c.max_age.is_zero() && c.max_age < opts.max_age {
        problems.push(format!(
            "max_age is {:?}, shorter than the configured {:?}",
            c.max_age, opts.max_age
        ));
    }
    if c.max_messages > 0 {
        problems.push(format!(
            "max_msgs is {} (would drop live records)",
            c.max_messages
        ));
    }
    if c.max_bytes > 0 {
        problems.push(format!("max_bytes is {} (would drop live records)", c.max_bytes));
    }
    if c.max_message_size > 0 && (c.max_message_size as usize) < MAX_VALUE_BYTES {
        problems.push(format!(
            "max_value_size is {} (records need up to {MAX_VALUE_BYTES})",
            c.max_message_size
        ));
    }
    if c.sealed {
        problems.push("the bucket is sealed".to_owned());
    }
    if c.mirror.is_some() {
        problems.push("the bucket is a mirror (read-only)".to_owned());
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "NATS KV bucket {} is incompatible with oncely: {}; it was left unchanged",
            opts.bucket,
            problems.join("; ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// nats-server 2.9 syncs on a fixed 2-minute timer; 2.10 and later on
    /// `sync_interval`, which `always` turns into a sync per write.
    #[test]
    fn durability_names_the_sync_policy_of_the_server_version() {
        for (replicas, version, says) in [
            (1, "2.9.10", "R=1"),
            (1, "v2.9.25", "nats-server 2.9 fsyncs streams every 2 min"),
            (3, "2.9.10", "2.9 fsyncs only every 2 min"),
            (1, "2.10.0", "sync_interval: always"),
            (1, "2.12.1-beta.2", "sync_interval: always"),
            (3, "2.11.4", "R=3"),
            (3, "3.0.0", "sync_interval: always"),
            (1, "", "sync_interval: always"),
        ] {
            let d = durability(replicas, version);
            assert!(d.contains(says), "{replicas} {version}: {d}");
        }
        assert!(!durability(1, "2.10.0").contains("2.9"));
    }
}

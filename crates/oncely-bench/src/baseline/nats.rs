//! The hand-written baseline on NATS: a JetStream KV bucket of the run's own
//! (`oncely_cli_bench_<run id>`, history 1, the URL's replica count, file
//! storage as the ledger's bucket; deleted at the end), `create(key, outcome)`, then `get` on a duplicate. A batch
//! sends its creates at once (the client pipelines them), then the
//! duplicates' gets.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, kv, stream};
use futures_util::future::join_all;
use oncely::{Error, Result};

use super::{Answer, Leased, backend_error, merge};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The baseline's bucket.
pub(crate) struct NatsBaseline {
    js: jetstream::Context,
    kv: kv::Store,
    bucket: String,
}

impl NatsBaseline {
    /// Connects to the servers the ledger's URL lists and creates the run's
    /// bucket with the URL's `replicas` (default 1), as `oncely-nats` reads
    /// the URL.
    pub(super) async fn create(url: &str, run_id: &str) -> Result<NatsBaseline> {
        let url = oncely_nats::NatsUrl::parse(url)?;
        let replicas = url
            .apply(oncely_nats::NatsKvLedgerOptions::default())
            .get_replicas();
        let servers = url.addrs()?;
        let unavailable = |e: &dyn std::fmt::Display| Error::Unavailable {
            backend: "nats",
            message: format!("bench baseline: {e}"),
        };
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(CONNECT_TIMEOUT)
            .connect(servers)
            .await
            .map_err(|e| unavailable(&e))?;
        let js = jetstream::new(client);
        let bucket = format!("oncely_cli_bench_{run_id}");
        // The bucket's stream written out, as `oncely-nats` does: the
        // client's `create_key_value` expects account info in a newer shape
        // than NATS 2.9 sends.
        js.create_stream(stream::Config {
            name: format!("KV_{bucket}"),
            subjects: vec![format!("$KV.{bucket}.>")],
            max_messages_per_subject: 1,
            max_messages: -1,
            max_bytes: -1,
            max_message_size: -1,
            storage: stream::StorageType::File,
            num_replicas: replicas,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: stream::DiscardPolicy::New,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .map_err(|e| unavailable(&e))?;
        let kv = js.get_key_value(&bucket).await.map_err(|e| unavailable(&e))?;
        Ok(NatsBaseline { js, kv, bucket })
    }

    pub(super) fn describe(&self) -> &'static str {
        "KV create with the outcome, get on a duplicate (batches: the creates, then the gets, pipelined)"
    }

    pub(super) fn key(&self, row: &str, job: usize) -> String {
        format!("{row}.{job}")
    }

    async fn create_key(&self, key: &str, outcome: &str) -> Result<bool> {
        // `update` expecting revision 0 is the create itself; the client's
        // `create` would follow a refusal with a direct get, which a
        // replica that has not applied the winner yet answers with nothing.
        match self.kv.update(key, outcome.to_owned().into(), 0).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(false),
            Err(e) => Err(backend_error("nats", e, true)),
        }
    }

    /// From the stream leader, as `oncely-nats` reads: on a replicated
    /// bucket a direct get may come from a replica that lags the create.
    async fn read(&self, key: &str) -> Result<String> {
        self.read_revision(key).await.map(|(value, _)| value)
    }

    /// [`NatsBaseline::read`] with the value's revision.
    async fn read_revision(&self, key: &str) -> Result<(String, u64)> {
        use async_nats::jetstream::stream::LastRawMessageErrorKind;
        let subject = format!("$KV.{}.{key}", self.bucket);
        match self.kv.stream.get_last_raw_message_by_subject(&subject).await {
            Ok(m) => Ok((String::from_utf8_lossy(&m.payload).into_owned(), m.sequence)),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Err(backend_error(
                "nats",
                format!("{key} was neither created nor found"),
                false,
            )),
            Err(e) => Err(backend_error("nats", e, true)),
        }
    }

    pub(super) async fn claim(&self, key: &str, outcome: &str) -> Result<Answer> {
        if self.create_key(key, outcome).await? {
            return Ok(Answer::Won);
        }
        self.read(key).await.map(Answer::Duplicate)
    }

    pub(super) async fn claim_many(&self, items: &[(String, String)]) -> Result<Vec<Answer>> {
        let created: Vec<bool> = join_all(items.iter().map(|(k, o)| self.create_key(k, o)))
            .await
            .into_iter()
            .collect::<Result<_>>()?;
        let rest: Vec<&str> = items
            .iter()
            .zip(&created)
            .filter(|(_, won)| !**won)
            .map(|((k, _), _)| k.as_str())
            .collect();
        let stored: HashMap<String, String> = rest
            .iter()
            .map(|k| (*k).to_owned())
            .zip(
                join_all(rest.iter().map(|k| self.read(k)))
                    .await
                    .into_iter()
                    .collect::<Result<Vec<_>>>()?,
            )
            .collect();
        let won: HashMap<&str, bool> = items.iter().map(|(k, _)| k.as_str()).zip(created).collect();
        merge(items, |k| won.get(k).copied().unwrap_or(false), stored, "nats")
    }

    pub(super) fn describe_leased(&self) -> &'static str {
        "KV create of an in-progress value with a lease end (this worker's clock), get on a duplicate \
         and an update at its revision to take an expired lease over, an update at the lease's revision \
         with the outcome (fenced); a duplicate in flight polls"
    }

    /// Writes `value` at `revision` (0: creates it); `None` when another
    /// write came first.
    async fn write_at(&self, key: &str, value: String, revision: u64) -> Result<Option<u64>> {
        match self.kv.update(key, value.into(), revision).await {
            Ok(rev) => Ok(Some(rev)),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(None),
            Err(e) => Err(backend_error("nats", e, true)),
        }
    }

    pub(super) async fn lease(&self, key: &str, len: Duration) -> Result<Leased> {
        let now_ms = || {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64)
        };
        let until = || format!("p:{}", now_ms() + len.as_millis() as u64);
        if let Some(rev) = self.write_at(key, until(), 0).await? {
            return Ok(Leased::Won(rev));
        }
        let (value, revision) = self.read_revision(key).await?;
        if let Some(outcome) = value.strip_prefix("d:") {
            return Ok(Leased::Done(outcome.to_owned()));
        }
        let ends: u64 = value.strip_prefix("p:").and_then(|t| t.parse().ok()).unwrap_or(0);
        if ends > now_ms() {
            return Ok(Leased::Busy);
        }
        Ok(match self.write_at(key, until(), revision).await? {
            Some(rev) => Leased::Won(rev),
            None => Leased::Busy,
        })
    }

    pub(super) async fn finish(&self, key: &str, fence: u64, outcome: &str) -> Result<bool> {
        Ok(self.write_at(key, format!("d:{outcome}"), fence).await?.is_some())
    }

    pub(super) async fn remove(&self, _keys: &[String]) -> Result<()> {
        self.js
            .delete_stream(format!("KV_{}", self.bucket))
            .await
            .map(drop)
            .map_err(|e| backend_error("nats", e, true))
    }
}

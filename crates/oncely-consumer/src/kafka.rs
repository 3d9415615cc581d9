//! Kafka consumer groups through rdkafka (feature `kafka`; librdkafka is
//! built from the sources rdkafka bundles).
//!
//! | loop action | what the adapter does |
//! | --- | --- |
//! | ack | the offset is finished; the partition's committed offset moves to the lowest offset not yet finished (or past the highest received), committed by the poll thread |
//! | redeliver after `delay` | Kafka has no per-message redelivery: the delivery is handed to the loop again after `delay`, in this process, with its count + 1. Its offset stays uncommitted meanwhile, so a crash redelivers it from the broker |
//! | dead-letter with a reason | produce a copy (same key, payload and headers) to the dead-letter topic with the headers `oncely-reason` and `oncely-broker-id`, wait for its delivery report, then finish the offset. A crash between the two dead-letters it twice, never zero times. A copy the broker refused is handed to the loop again a second later |
//! | delivery count | counted in this process (1 on the first delivery from the broker); Kafka keeps none |
//!
//! Offsets are committed only for messages whose handling finished (ran,
//! replayed or dead-lettered), in offset order per partition: a crash at any
//! point makes the group redeliver from the lowest unfinished offset, so a
//! message may come again (oncely replays its effects) and is never skipped.
//! A message waiting for a delayed redelivery holds its partition's commit
//! point back, as any in-order commit must.
//!
//! When a rebalance revokes a partition, the adapter stops handing that
//! partition's queued deliveries to the loop, waits up to
//! [`KafkaConfig::revoke_grace`] for its running handlers to finish, commits
//! what finished and only then lets the partition go. Handlers still running
//! after the grace are abandoned: their settlements are refused (counted as
//! settle errors) and the partition's new owner redelivers their messages,
//! which then meet the effects in the ledger. Keep `revoke_grace` below
//! `max.poll.interval.ms`.
//!
//! Deliveries received and not finished are bounded by
//! [`KafkaConfig::max_in_flight`]: past it the poll thread pauses every
//! assigned partition and goes on polling (group membership and rebalances
//! are served, `max.poll.interval.ms` is never exceeded), and resumes once
//! half of them are settled.
//!
//! **Keys come from the payload.** A message's topic, partition and offset
//! name a copy, not the event: a producer that retries or re-publishes
//! writes the event again at a new offset, a topic mirrored to another
//! cluster (MirrorMaker, Replicator) gets new offsets and often a new topic
//! name, and a reprocessing job that reads a topic from the start sees the
//! same events at the same offsets under another group. The handler derives
//! every effect key from the payload (an order id, an event id), so each of
//! those copies replays the effect instead of running it again; the broker
//! id (`topic/partition@offset`) is for logs only.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::{mpsc, watch};

use crate::broker::{BrokerError, Delivery, Source};

pub use rdkafka;

/// Header with the reason of a dead-lettered message.
pub const REASON_HEADER: &str = "oncely-reason";
/// Header with the broker id (`topic/partition@offset`) of a dead-lettered
/// message.
pub const BROKER_ID_HEADER: &str = "oncely-broker-id";

/// How long the poll thread waits for a message before it looks at
/// backpressure, commits and the stop flag again.
const POLL: Duration = Duration::from_millis(100);
/// How often the poll thread commits every partition's commit point again,
/// moved or not: a refusal librdkafka reports only per partition (or not at
/// all to this client) never leaves an offset uncommitted for long.
const RECOMMIT: Duration = Duration::from_secs(5);
/// How long a dead-letter copy may wait in the producer's queue.
const DEAD_LETTER_TIMEOUT: Duration = Duration::from_secs(30);
/// When a dead-letter copy failed, how soon the delivery is tried again.
const DEAD_LETTER_RETRY: Duration = Duration::from_secs(1);

/// What went wrong in the Kafka adapter.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaError {
    /// The client refused its configuration, or could not subscribe.
    #[error("kafka client: {0}")]
    Client(#[from] rdkafka::error::KafkaError),
    /// The partition was revoked (or reassigned) before this settlement:
    /// its new owner redelivers the message from the last committed offset.
    #[error(
        "{broker_id}: the partition was revoked before this settlement; its new owner redelivers the message"
    )]
    Revoked {
        /// The message, `topic/partition@offset`.
        broker_id: String,
    },
    /// The source was aborted ([`KafkaHandle::abort`]): nothing more is
    /// committed, and the group redelivers what was not.
    #[error("the Kafka source was aborted; uncommitted messages are redelivered to the group")]
    Aborted,
    /// The dead-letter copy was not delivered (the delivery is tried again).
    #[error("dead-letter copy to {topic}: {source}")]
    DeadLetter {
        /// The dead-letter topic.
        topic: String,
        /// The producer's error.
        #[source]
        source: rdkafka::error::KafkaError,
    },
    /// The poll thread could not be started.
    #[error("could not start the Kafka poll thread: {0}")]
    Thread(#[source] std::io::Error),
    /// The consumer failed for good (a fatal librdkafka error).
    #[error("kafka consumer failed: {0}")]
    Fatal(rdkafka::error::KafkaError),
}

impl KafkaError {
    /// Whether trying again (later, or on a new source) may succeed: every
    /// case but a configuration the client refused.
    pub fn is_retryable(&self) -> bool {
        match self {
            KafkaError::Client(e) => !matches!(e, rdkafka::error::KafkaError::ClientConfig(..)),
            _ => true,
        }
    }
}

impl From<KafkaError> for BrokerError {
    fn from(e: KafkaError) -> Self {
        BrokerError::new(e)
    }
}

/// A consumer group's subscription and its dead-letter topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaConfig {
    /// `bootstrap.servers`: `host:port[,host:port…]`.
    pub brokers: String,
    /// `group.id`: the consumer group every worker joins.
    pub group_id: String,
    /// The topics the group consumes.
    pub topics: Vec<String>,
    /// Where dead-lettered messages go (default `{first topic}.dead`).
    pub dead_letter_topic: String,
    /// Further librdkafka properties for the consumer and the dead-letter
    /// producer (`session.timeout.ms`, `security.protocol`, …).
    /// `enable.auto.commit` and `enable.auto.offset.store` are always
    /// `false`: the adapter commits.
    pub props: BTreeMap<String, String>,
    /// Deliveries received and not yet finished before the partitions are
    /// paused (default 256).
    pub max_in_flight: usize,
    /// How long a revocation waits for the revoked partitions' running
    /// handlers (default 10 s).
    pub revoke_grace: Duration,
}

impl KafkaConfig {
    /// The group `group_id` on `brokers` consuming `topics`, with the
    /// defaults: `auto.offset.reset=earliest` (a new group starts at the
    /// beginning: nothing published before it joined is skipped).
    pub fn new(brokers: &str, group_id: &str, topics: &[&str]) -> Self {
        let first = topics.first().copied().unwrap_or("oncely");
        KafkaConfig {
            brokers: brokers.to_owned(),
            group_id: group_id.to_owned(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            dead_letter_topic: format!("{first}.dead"),
            props: BTreeMap::from([("auto.offset.reset".to_owned(), "earliest".to_owned())]),
            max_in_flight: 256,
            revoke_grace: Duration::from_secs(10),
        }
    }

    /// Sets [`KafkaConfig::dead_letter_topic`].
    pub fn dead_letter_topic(mut self, topic: &str) -> Self {
        self.dead_letter_topic = topic.to_owned();
        self
    }

    /// Sets a librdkafka property ([`KafkaConfig::props`]).
    pub fn set(mut self, key: &str, value: &str) -> Self {
        self.props.insert(key.to_owned(), value.to_owned());
        self
    }

    /// Sets [`KafkaConfig::max_in_flight`] (at least 1).
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n.max(1);
        self
    }

    /// Sets [`KafkaConfig::revoke_grace`].
    pub fn revoke_grace(mut self, d: Duration) -> Self {
        self.revoke_grace = d;
        self
    }

    /// The consumer's librdkafka configuration: the brokers, the group,
    /// [`KafkaConfig::props`], and manual commits.
    pub fn consumer_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers);
        c.set("group.id", &self.group_id);
        for (k, v) in &self.props {
            c.set(k, v);
        }
        c.set("enable.auto.commit", "false");
        c.set("enable.auto.offset.store", "false");
        c
    }

    /// A producer's librdkafka configuration: the brokers, the
    /// [`KafkaConfig::props`] a producer understands, and an idempotent
    /// producer (`enable.idempotence=true`, `acks=all`): a retried send is
    /// written once.
    pub fn producer_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers);
        for (k, v) in &self.props {
            if !CONSUMER_ONLY.contains(&k.as_str()) {
                c.set(k, v);
            }
        }
        c.set("enable.idempotence", "true");
        c.set("acks", "all");
        c
    }

    /// An idempotent producer on the same brokers
    /// ([`KafkaConfig::producer_config`]), for the dead-letter topic or an
    /// application's own messages.
    pub fn producer(&self) -> Result<FutureProducer, KafkaError> {
        Ok(self.producer_config().create()?)
    }
}

/// Consumer properties a producer would warn about.
const CONSUMER_ONLY: &[&str] = &[
    "auto.offset.reset",
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "max.poll.interval.ms",
    "partition.assignment.strategy",
    "group.instance.id",
    "fetch.wait.max.ms",
    "fetch.min.bytes",
    "fetch.max.bytes",
    "isolation.level",
];

type PartitionKey = (String, i32);

/// One assigned partition's offsets.
#[derive(Debug)]
struct Part {
    /// Which assignment this is: a settlement from an earlier one is refused.
    generation: u64,
    /// Offsets received and not finished. The commit point is the lowest of
    /// them: a set of open offsets, not a run of finished ones, so that the
    /// gaps Kafka leaves in a partition (compaction, transaction markers)
    /// never hold a commit back.
    open: BTreeSet<i64>,
    /// One past the highest offset received.
    high: i64,
    /// The offset last committed (or being committed); -1: none yet.
    committed: i64,
    /// Deliveries handed to the loop and not settled.
    running: usize,
    /// Being revoked: queued deliveries are no longer handed out.
    revoking: bool,
}

impl Part {
    fn commit_point(&self) -> i64 {
        self.open.first().copied().unwrap_or(self.high)
    }
}

#[derive(Debug, Default)]
struct Tracker {
    parts: HashMap<PartitionKey, Part>,
    generations: u64,
    open: usize,
}

impl Tracker {
    /// The partitions (all, or those in `only`) whose commit point moved,
    /// marked as committed.
    fn advanced(&mut self, only: Option<&[PartitionKey]>) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        for ((topic, partition), p) in &mut self.parts {
            if only.is_some_and(|o| !o.iter().any(|(t, n)| t == topic && n == partition)) {
                continue;
            }
            let point = p.commit_point();
            if point > p.committed
                && tpl
                    .add_partition_offset(topic, *partition, Offset::Offset(point))
                    .is_ok()
            {
                p.committed = point;
            }
        }
        tpl
    }
}

#[derive(Debug)]
struct Shared {
    state: Mutex<Tracker>,
    /// Signalled when a running delivery settles (a revocation waits on it).
    settled: Condvar,
    dirty: AtomicBool,
    stop: AtomicBool,
    aborted: AtomicBool,
    assignment_changed: AtomicBool,
    revoke_grace: Duration,
    revoked: AtomicU64,
    abandoned: AtomicU64,
    commit_failures: AtomicU64,
    /// A revocation is waiting for running handlers.
    revoking: AtomicBool,
}

fn broker_id(topic: &str, partition: i32, offset: i64) -> String {
    format!("{topic}/{partition}@{offset}")
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Tracker> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn receive(&self, topic: &str, partition: i32, offset: i64) -> u64 {
        let mut st = self.lock();
        let st = &mut *st;
        let key = (topic.to_owned(), partition);
        if !st.parts.contains_key(&key) {
            st.generations += 1;
            st.parts.insert(
                key.clone(),
                Part {
                    generation: st.generations,
                    open: BTreeSet::new(),
                    high: offset,
                    committed: -1,
                    running: 0,
                    revoking: false,
                },
            );
        }
        let p = st.parts.get_mut(&key).expect("inserted above");
        if p.open.insert(offset) {
            st.open += 1;
        }
        p.high = p.high.max(offset + 1);
        p.generation
    }

    /// Hands a queued delivery to the loop, unless its partition has been
    /// revoked since (then its new owner has it).
    fn start(&self, topic: &str, partition: i32, generation: u64) -> bool {
        if self.aborted.load(Ordering::Acquire) {
            return false;
        }
        let mut st = self.lock();
        match st.parts.get_mut(&(topic.to_owned(), partition)) {
            Some(p) if p.generation == generation && !p.revoking => {
                p.running += 1;
                true
            }
            _ => false,
        }
    }

    /// Settles a running delivery: `finished` (ack, dead-letter) or not
    /// (redelivered later).
    fn settle(&self, msg: &OwnedMessage, generation: u64, finished: bool) -> Result<(), KafkaError> {
        let mut st = self.lock();
        let st = &mut *st;
        let key = (msg.topic().to_owned(), msg.partition());
        let Some(p) = st.parts.get_mut(&key).filter(|p| p.generation == generation) else {
            return Err(KafkaError::Revoked {
                broker_id: broker_id(msg.topic(), msg.partition(), msg.offset()),
            });
        };
        // Not running any more, whatever happens to it: a revocation waits
        // for this.
        p.running = p.running.saturating_sub(1);
        self.settled.notify_all();
        if self.aborted.load(Ordering::Acquire) {
            return Err(KafkaError::Aborted);
        }
        if finished && p.open.remove(&msg.offset()) {
            st.open -= 1;
            self.dirty.store(true, Ordering::Release);
        }
        self.settled.notify_all();
        Ok(())
    }

    fn is_current(&self, msg: &OwnedMessage, generation: u64) -> bool {
        !self.aborted.load(Ordering::Acquire)
            && self
                .lock()
                .parts
                .get(&(msg.topic().to_owned(), msg.partition()))
                .is_some_and(|p| p.generation == generation && !p.revoking)
    }

    /// A rebalance takes `keys` away: stop handing out their queued
    /// deliveries, wait for their running handlers (up to the grace),
    /// commit what finished, forget them.
    fn revoke(&self, consumer: &BaseConsumer<GroupContext>, keys: &[PartitionKey]) {
        let aborted = self.aborted.load(Ordering::Acquire);
        let deadline = Instant::now() + self.revoke_grace;
        let mut st = self.lock();
        for k in keys {
            if let Some(p) = st.parts.get_mut(k) {
                p.revoking = true;
            }
        }
        let mut tpl = TopicPartitionList::new();
        if !aborted {
            self.revoking.store(true, Ordering::Release);
            loop {
                let running: usize = keys
                    .iter()
                    .filter_map(|k| st.parts.get(k))
                    .map(|p| p.running)
                    .sum();
                if running == 0 || self.aborted.load(Ordering::Acquire) {
                    break;
                }
                let now = Instant::now();
                if now >= deadline {
                    tracing::warn!(
                        running,
                        grace = ?self.revoke_grace,
                        "partitions revoked with handlers still running: abandoned to the new owner"
                    );
                    self.abandoned.fetch_add(running as u64, Ordering::Relaxed);
                    break;
                }
                st = self
                    .settled
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            self.revoking.store(false, Ordering::Release);
            if !self.aborted.load(Ordering::Acquire) {
                tpl = st.advanced(Some(keys));
            }
        }
        let mut gone = 0;
        for k in keys {
            if let Some(p) = st.parts.remove(k) {
                gone += p.open.len();
            }
        }
        st.open -= gone;
        drop(st);
        if tpl.count() > 0
            && let Err(e) = consumer.commit(&tpl, CommitMode::Sync)
        {
            // The new owner starts from the previous commit: redeliveries,
            // replayed by the ledger.
            self.commit_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "commit on revocation refused; the new owner redelivers");
        }
        self.revoked.fetch_add(keys.len() as u64, Ordering::Relaxed);
        self.settled.notify_all();
    }
}

/// The consumer's librdkafka context: rebalances and commit results.
struct GroupContext {
    shared: Arc<Shared>,
}

impl ClientContext for GroupContext {}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                let keys: Vec<PartitionKey> = tpl
                    .elements()
                    .iter()
                    .map(|e| (e.topic().to_owned(), e.partition()))
                    .collect();
                self.shared.revoke(consumer, &keys);
            }
            Rebalance::Assign(_) => self.shared.assignment_changed.store(true, Ordering::Release),
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance failed"),
        }
    }

    fn commit_callback(&self, result: rdkafka::error::KafkaResult<()>, offsets: &TopicPartitionList) {
        // A refusal may be the whole request's or a partition's (Kafka
        // answers REBALANCE_IN_PROGRESS per partition).
        let refused: Vec<(PartitionKey, i64)> = offsets
            .elements()
            .iter()
            .filter(|el| result.is_err() || el.error().is_err())
            .filter_map(|el| match el.offset() {
                Offset::Offset(o) => Some(((el.topic().to_owned(), el.partition()), o)),
                _ => None,
            })
            .collect();
        if refused.is_empty() {
            return;
        }
        // Committed again by the poll thread (a later commit covers it).
        self.shared.commit_failures.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            ?result,
            partitions = refused.len(),
            "offset commit refused; trying again"
        );
        let mut st = self.shared.lock();
        for (key, o) in refused {
            if let Some(p) = st.parts.get_mut(&key)
                && p.committed <= o
            {
                p.committed = -1;
            }
        }
        self.shared.dirty.store(true, Ordering::Release);
    }
}

/// A delivery queued for the loop: from the poll thread, or handed back by
/// a delayed redelivery.
struct Queued {
    msg: Arc<OwnedMessage>,
    generation: u64,
    count: u32,
}

type Queue = mpsc::UnboundedSender<Result<Queued, KafkaError>>;

/// One group member's subscription: a poll thread that owns the librdkafka
/// consumer (it keeps polling while handlers run, so rebalances are served
/// and `max.poll.interval.ms` holds), and the loop's side of it.
///
/// Dropping the source (as [`Consumer::run`](crate::Consumer::run) does
/// when it returns, every delivery settled) stops the poll thread: it
/// commits what finished and leaves the group.
pub struct KafkaSource {
    rx: mpsc::UnboundedReceiver<Result<Queued, KafkaError>>,
    tx: Queue,
    shared: Arc<Shared>,
    dead_letter: Arc<DeadLetter>,
    aborted: watch::Receiver<bool>,
    handle: KafkaHandle,
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource")
            .field("dead_letter_topic", &self.dead_letter.topic)
            .finish_non_exhaustive()
    }
}

struct DeadLetter {
    producer: FutureProducer,
    topic: String,
}

/// Watches and stops a [`KafkaSource`] from outside the loop.
#[derive(Clone)]
pub struct KafkaHandle {
    shared: Arc<Shared>,
    abort: Arc<watch::Sender<bool>>,
    closed: watch::Receiver<bool>,
}

impl std::fmt::Debug for KafkaHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaHandle")
            .field("partitions_revoked", &self.partitions_revoked())
            .finish_non_exhaustive()
    }
}

impl KafkaHandle {
    /// Stops the source the way a crash would, without the crash: nothing
    /// more is committed (the running handlers' settlements are refused),
    /// the source's `next` fails so the loop winds down, and the consumer
    /// leaves the group, whose other members get its partitions and
    /// redeliver every uncommitted message. For a supervisor that must drop
    /// a stuck member, and for tests.
    pub fn abort(&self) {
        self.shared.aborted.store(true, Ordering::Release);
        self.shared.stop.store(true, Ordering::Release);
        self.shared.settled.notify_all();
        self.abort.send_replace(true);
    }

    /// Resolves once the poll thread has committed what finished (unless
    /// aborted) and closed the consumer.
    pub async fn closed(&self) {
        let mut closed = self.closed.clone();
        let _ = closed.wait_for(|c| *c).await;
    }

    /// Partitions taken from this member by rebalances (and by its own
    /// close) so far.
    pub fn partitions_revoked(&self) -> u64 {
        self.shared.revoked.load(Ordering::Relaxed)
    }

    /// Handlers still running when their partition's revocation grace ran
    /// out (their messages went to the new owner).
    pub fn abandoned(&self) -> u64 {
        self.shared.abandoned.load(Ordering::Relaxed)
    }

    /// Offset commits the broker refused (each is covered by a later one, or
    /// the new owner redelivers).
    pub fn commit_failures(&self) -> u64 {
        self.shared.commit_failures.load(Ordering::Relaxed)
    }

    /// Whether a rebalance is revoking partitions from this member right
    /// now, waiting for their running handlers.
    pub fn revoking(&self) -> bool {
        self.shared.revoking.load(Ordering::Acquire)
    }

    /// Deliveries received and not finished.
    pub fn in_flight(&self) -> usize {
        self.shared.lock().open
    }
}

impl KafkaSource {
    /// Joins `config.group_id`, subscribes to `config.topics` and starts
    /// the poll thread; the dead-letter producer is made from the same
    /// config ([`KafkaConfig::producer`]).
    pub fn subscribe(config: &KafkaConfig) -> Result<Self, KafkaError> {
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            settled: Condvar::new(),
            dirty: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
            assignment_changed: AtomicBool::new(false),
            revoke_grace: config.revoke_grace,
            revoked: AtomicU64::new(0),
            abandoned: AtomicU64::new(0),
            commit_failures: AtomicU64::new(0),
            revoking: AtomicBool::new(false),
        });
        let consumer: BaseConsumer<GroupContext> =
            config.consumer_config().create_with_context(GroupContext {
                shared: shared.clone(),
            })?;
        let topics: Vec<&str> = config.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics)?;
        let dead_letter = Arc::new(DeadLetter {
            producer: config.producer()?,
            topic: config.dead_letter_topic.clone(),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let (abort_tx, aborted) = watch::channel(false);
        let (closed_tx, closed) = watch::channel(false);
        let poll = PollThread {
            consumer,
            shared: shared.clone(),
            tx: tx.clone(),
            max_in_flight: config.max_in_flight,
        };
        std::thread::Builder::new()
            .name("oncely-kafka-poll".to_owned())
            .spawn(move || {
                poll.run();
                closed_tx.send_replace(true);
            })
            .map_err(KafkaError::Thread)?;
        Ok(KafkaSource {
            rx,
            tx,
            shared: shared.clone(),
            dead_letter,
            aborted,
            handle: KafkaHandle {
                shared,
                abort: Arc::new(abort_tx),
                closed,
            },
        })
    }

    /// A handle to watch or abort this source from outside the loop.
    pub fn handle(&self) -> KafkaHandle {
        self.handle.clone()
    }
}

impl Drop for KafkaSource {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
    }
}

impl Source for KafkaSource {
    type Delivery = KafkaDelivery;

    async fn next(&mut self) -> Result<Option<KafkaDelivery>, BrokerError> {
        loop {
            let queued = tokio::select! {
                biased;
                _ = self.aborted.wait_for(|a| *a) => return Err(KafkaError::Aborted.into()),
                q = self.rx.recv() => q,
            };
            let q = match queued {
                Some(Ok(q)) => q,
                Some(Err(e)) => return Err(e.into()),
                // The source holds a sender: never.
                None => return Ok(None),
            };
            if !self.shared.start(q.msg.topic(), q.msg.partition(), q.generation) {
                continue;
            }
            let broker_id = broker_id(q.msg.topic(), q.msg.partition(), q.msg.offset());
            return Ok(Some(KafkaDelivery {
                msg: q.msg,
                generation: q.generation,
                count: q.count,
                broker_id,
                shared: self.shared.clone(),
                queue: self.tx.clone(),
                dead_letter: self.dead_letter.clone(),
            }));
        }
    }
}

struct PollThread {
    consumer: BaseConsumer<GroupContext>,
    shared: Arc<Shared>,
    tx: Queue,
    max_in_flight: usize,
}

impl PollThread {
    fn run(self) {
        let mut paused = false;
        let mut recommit = Instant::now() + RECOMMIT;
        while !self.shared.stop.load(Ordering::Acquire) {
            self.backpressure(&mut paused);
            if Instant::now() >= recommit {
                recommit = Instant::now() + RECOMMIT;
                for p in self.shared.lock().parts.values_mut() {
                    p.committed = p.committed.min(p.commit_point() - 1);
                }
                self.shared.dirty.store(true, Ordering::Release);
            }
            match self.consumer.poll(POLL) {
                Some(Ok(m)) => {
                    let msg = m.detach();
                    drop(m);
                    let generation = self.shared.receive(msg.topic(), msg.partition(), msg.offset());
                    let _ = self.tx.send(Ok(Queued {
                        msg: Arc::new(msg),
                        generation,
                        count: 1,
                    }));
                }
                Some(Err(e @ rdkafka::error::KafkaError::MessageConsumptionFatal(_))) => {
                    tracing::error!(error = %e, "Kafka consumer failed");
                    let _ = self.tx.send(Err(KafkaError::Fatal(e)));
                    break;
                }
                // librdkafka recovers from the rest (a broker down, a leader
                // moved) by itself.
                Some(Err(e)) => tracing::debug!(error = %e, "Kafka poll"),
                None => {}
            }
            self.commit(CommitMode::Async);
        }
        if !self.shared.aborted.load(Ordering::Acquire) {
            self.commit(CommitMode::Sync);
        }
        // Dropping the consumer closes it: the revocation callback runs here
        // (nothing is running any more) and the member leaves the group.
    }

    fn commit(&self, mode: CommitMode) {
        if !self.shared.dirty.swap(false, Ordering::AcqRel) && matches!(mode, CommitMode::Async) {
            return;
        }
        let tpl = self.shared.lock().advanced(None);
        if tpl.count() == 0 {
            return;
        }
        if let Err(e) = self.consumer.commit(&tpl, mode) {
            self.shared.commit_failures.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(error = %e, "offset commit refused; trying again");
            let mut st = self.shared.lock();
            for el in tpl.elements() {
                if let Some(p) = st.parts.get_mut(&(el.topic().to_owned(), el.partition())) {
                    p.committed = -1;
                }
            }
            self.shared.dirty.store(true, Ordering::Release);
        }
    }

    /// Pauses every assigned partition while too many deliveries are open,
    /// resumes once half of them are settled.
    fn backpressure(&self, paused: &mut bool) {
        let open = self.shared.lock().open;
        let changed = self.shared.assignment_changed.swap(false, Ordering::AcqRel);
        let want = if *paused {
            open > self.max_in_flight / 2
        } else {
            open >= self.max_in_flight
        };
        // After a rebalance the wanted state is applied to the whole new
        // assignment, resumed as well as paused: a partition paused here,
        // revoked and assigned back can come back paused, and nothing else
        // would ever resume it (the group stops delivering).
        if want == *paused && !changed {
            return;
        }
        let Ok(assignment) = self.consumer.assignment() else {
            self.shared.assignment_changed.fetch_or(changed, Ordering::AcqRel);
            return;
        };
        let r = if want {
            self.consumer.pause(&assignment)
        } else {
            self.consumer.resume(&assignment)
        };
        match r {
            Ok(()) => *paused = want,
            Err(e) => {
                tracing::debug!(error = %e, pause = want, "pause/resume");
                self.shared.assignment_changed.fetch_or(changed, Ordering::AcqRel);
            }
        }
    }
}

/// A message from a Kafka partition.
pub struct KafkaDelivery {
    msg: Arc<OwnedMessage>,
    generation: u64,
    count: u32,
    broker_id: String,
    shared: Arc<Shared>,
    queue: Queue,
    dead_letter: Arc<DeadLetter>,
}

impl std::fmt::Debug for KafkaDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaDelivery")
            .field("broker_id", &self.broker_id)
            .field("count", &self.count)
            .finish_non_exhaustive()
    }
}

impl KafkaDelivery {
    /// The message as rdkafka gave it (topic, partition, offset, key,
    /// headers, timestamp).
    pub fn message(&self) -> &OwnedMessage {
        &self.msg
    }

    fn requeue(self, delay: Duration) {
        let (queue, queued) = (
            self.queue,
            Queued {
                msg: self.msg,
                generation: self.generation,
                count: self.count.saturating_add(1),
            },
        );
        if delay.is_zero() {
            let _ = queue.send(Ok(queued));
            return;
        }
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            // Dropped by `next` if the partition was revoked meanwhile.
            let _ = queue.send(Ok(queued));
        });
    }
}

impl Delivery for KafkaDelivery {
    fn payload(&self) -> &[u8] {
        self.msg.payload().unwrap_or_default()
    }

    fn broker_id(&self) -> &str {
        &self.broker_id
    }

    fn delivery_count(&self) -> Option<u32> {
        Some(self.count)
    }

    async fn ack(self) -> Result<(), BrokerError> {
        Ok(self.shared.settle(&self.msg, self.generation, true)?)
    }

    async fn nack(self, delay: Duration) -> Result<(), BrokerError> {
        self.shared.settle(&self.msg, self.generation, false)?;
        self.requeue(delay);
        Ok(())
    }

    async fn dead_letter(self, reason: &str) -> Result<(), BrokerError> {
        if !self.shared.is_current(&self.msg, self.generation) {
            // The partition's new owner handles (and dead-letters) it.
            return Ok(self.shared.settle(&self.msg, self.generation, false)?);
        }
        let mut headers = OwnedHeaders::new();
        if let Some(h) = self.msg.headers() {
            for h in h.iter() {
                if h.key != REASON_HEADER && h.key != BROKER_ID_HEADER {
                    headers = headers.insert(Header {
                        key: h.key,
                        value: h.value,
                    });
                }
            }
        }
        let headers = headers
            .insert(Header {
                key: REASON_HEADER,
                value: Some(reason),
            })
            .insert(Header {
                key: BROKER_ID_HEADER,
                value: Some(self.broker_id.as_str()),
            });
        let mut record = FutureRecord::<[u8], [u8]>::to(&self.dead_letter.topic).headers(headers);
        if let Some(key) = self.msg.key() {
            record = record.key(key);
        }
        if let Some(payload) = self.msg.payload() {
            record = record.payload(payload);
        }
        match self.dead_letter.producer.send(record, DEAD_LETTER_TIMEOUT).await {
            Ok(_) => Ok(self.shared.settle(&self.msg, self.generation, true)?),
            Err((source, _)) => {
                self.shared.settle(&self.msg, self.generation, false)?;
                let topic = self.dead_letter.topic.clone();
                self.requeue(DEAD_LETTER_RETRY);
                Err(KafkaError::DeadLetter { topic, source }.into())
            }
        }
    }
}

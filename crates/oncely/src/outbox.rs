//! The transactional outbox: publishing an event as an effect of the same
//! transaction as the business writes.
//!
//! A handler that marks an order paid and publishes `order.paid` has two
//! effects on two systems. Publishing after the commit loses the event when
//! the process dies in between; publishing before it announces a payment
//! that may still roll back. The outbox closes the gap: the message is a row
//! written by [`TransactionalOutbox::enqueue_in`] in the caller's
//! transaction, so it commits with the business writes (and, inside
//! [`Job::step_in`](crate::Job::step_in), with the step's completion) or not
//! at all; a [`Relay`] publishes committed rows afterwards and marks them
//! sent once the broker has confirmed them.
//!
//! - **One message per effect key.** The step's key names its message:
//!   enqueueing the same key twice leaves one message
//!   ([`Enqueued::Already`]), so a step that runs again after a rollback
//!   cannot publish twice.
//! - **At least once to the broker, once downstream.** A relay that dies
//!   after the broker confirmed a message and before marking it sent
//!   publishes it again (or another relay does). Every copy carries the same
//!   message id ([`Pending::message_id`], the effect key's
//!   [`provider_key`](crate::EffectKey::provider_key)), which the broker's
//!   duplicate window (JetStream's `Nats-Msg-Id`, Kafka's idempotent
//!   producer within one session) or the consumer's own oncely ledger (an
//!   effect keyed on the event) drops.
//! - **In order per ordering key.** A message's ordering key (by default the
//!   effect key's tenant and subject: every event about `order-123`) is
//!   published only once every earlier unsent message of that key was: a
//!   claim takes, per ordering key, only the oldest unsent message. Messages
//!   enqueued by concurrent transactions for one ordering key have no
//!   defined order between them (they had none when they were written).
//! - **Fenced relays.** A relay claims messages under a lease with a fence
//!   that grows on every claim ([`backend::next_fence`](crate::backend::next_fence)
//!   on the database's clock). Several relays never hold one message at once; a
//!   relay that stalls past its lease loses it to the next claim, and its
//!   late "sent" ([`Outbox::mark_sent`]) is refused. What it published late
//!   is a duplicate the message id lets downstream drop.
//! - **Retries, then failure.** A message the broker refuses is retried with
//!   back-off; after [`RelayOptions::max_attempts`] it is marked failed
//!   (listed in [`OutboxStats::failed`]) and no longer holds back its
//!   ordering key.
//! - **Pruned like effect records.** Sent messages are deleted after their
//!   retention ([`Outbox::prune_sent`]).

use std::future::Future;
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::backoff::Backoff;
use crate::error::{Error, Result};
use crate::key::EffectKey;
use crate::ledger::TransactionalLedger;

/// The largest payload a message may carry.
pub const MAX_PAYLOAD_BYTES: usize = 1 << 20;
/// The longest destination (a topic, subject, stream or routing key).
pub const MAX_DESTINATION_BYTES: usize = 255;
/// The longest ordering key.
pub const MAX_ORDERING_KEY_BYTES: usize = 255;
/// How many headers a message may carry.
pub const MAX_HEADERS: usize = 32;
/// The longest header name.
pub const MAX_HEADER_NAME_BYTES: usize = 128;
/// The longest header value.
pub const MAX_HEADER_VALUE_BYTES: usize = 4096;

/// A message to publish: where to, its headers and its payload, and
/// optionally the ordering key it is published in order with (by default
/// the effect key's tenant and subject). Validated on construction, before
/// any round trip: a bad message is [`Error::InvalidInput`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    destination: String,
    headers: Vec<(String, String)>,
    payload: Vec<u8>,
    ordering_key: Option<String>,
}

fn invalid(what: String) -> Error {
    Error::InvalidInput(what)
}

/// Printable, without control characters, not empty, at most `max` bytes.
fn check_text(what: &str, value: &str, max: usize) -> Result<()> {
    if value.is_empty() {
        return Err(invalid(format!("{what} is empty")));
    }
    if value.len() > max {
        return Err(invalid(format!("{what} is {} bytes, over {max}", value.len())));
    }
    if value.chars().any(char::is_control) {
        return Err(invalid(format!("{what} {value:?} contains a control character")));
    }
    Ok(())
}

impl Message {
    /// A message for `destination` (a topic, a subject, a stream, a routing
    /// key: the [`Publisher`] says which) with `payload`.
    pub fn new(destination: impl Into<String>, payload: impl Into<Vec<u8>>) -> Result<Self> {
        let destination = destination.into();
        let payload = payload.into();
        check_text("the destination", &destination, MAX_DESTINATION_BYTES)?;
        if payload.len() > MAX_PAYLOAD_BYTES {
            return Err(invalid(format!(
                "the payload is {} bytes, over {MAX_PAYLOAD_BYTES}",
                payload.len()
            )));
        }
        Ok(Message {
            destination,
            headers: Vec::new(),
            payload,
            ordering_key: None,
        })
    }

    /// A message whose payload is `value` as JSON.
    pub fn json<T: Serialize + ?Sized>(destination: impl Into<String>, value: &T) -> Result<Self> {
        Message::new(destination, serde_json::to_vec(value)?)
    }

    /// Adds a header (`name` printable ASCII without spaces or `:`; `value`
    /// printable). A name given twice is refused.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Result<Self> {
        let (name, value) = (name.into(), value.into());
        check_text("a header name", &name, MAX_HEADER_NAME_BYTES)?;
        if !name.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
            return Err(invalid(format!(
                "header name {name:?}: printable ASCII without spaces or ':' only"
            )));
        }
        if value.len() > MAX_HEADER_VALUE_BYTES || value.chars().any(char::is_control) {
            return Err(invalid(format!(
                "header {name}: the value must be printable and at most {MAX_HEADER_VALUE_BYTES} bytes"
            )));
        }
        if self.headers.len() >= MAX_HEADERS {
            return Err(invalid(format!(
                "a message carries at most {MAX_HEADERS} headers"
            )));
        }
        if self.headers.iter().any(|(n, _)| n.eq_ignore_ascii_case(&name)) {
            return Err(invalid(format!("header {name} given twice")));
        }
        self.headers.push((name, value));
        Ok(self)
    }

    /// Publishes this message in order with the other messages of `key`
    /// instead of the default (the effect key's tenant and subject).
    pub fn ordering_key(mut self, key: impl Into<String>) -> Result<Self> {
        let key = key.into();
        check_text("the ordering key", &key, MAX_ORDERING_KEY_BYTES)?;
        self.ordering_key = Some(key);
        Ok(self)
    }

    /// Where the message goes.
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// Its headers, in the order given.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// Its payload.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The ordering key it is published under as the message of `key`: the
    /// one set, or `tenant/subject`.
    pub fn ordering_key_for(&self, key: &EffectKey) -> String {
        match &self.ordering_key {
            Some(k) => k.clone(),
            None => format!("{}/{}", key.tenant(), key.subject()),
        }
    }

    /// The headers as a backend stores them (a JSON array of pairs).
    pub fn encoded_headers(&self) -> String {
        encode_headers(&self.headers)
    }
}

/// Headers as stored: a JSON array of `[name, value]` pairs.
pub fn encode_headers(headers: &[(String, String)]) -> String {
    serde_json::to_string(headers).unwrap_or_else(|_| "[]".to_owned())
}

/// Headers as stored, read back ([`encode_headers`]); anything else is
/// [`Error::Corrupt`] for `backend`.
pub fn decode_headers(backend: &'static str, stored: &str) -> Result<Vec<(String, String)>> {
    serde_json::from_str(stored).map_err(|e| Error::Corrupt {
        backend,
        message: format!("outbox headers {stored:?}: {e}"),
    })
}

/// What [`TransactionalOutbox::enqueue_in`] did.
// Exhaustive by design (ARCHITECTURE.md, API boundaries): the key names a new message or one already there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// A new message, with its id (the order it was enqueued in).
    New(u64),
    /// The key already names a message (enqueued before, perhaps already
    /// sent): nothing was written.
    Already,
}

/// A relay's hold on one claimed message: its id and the fence of the
/// claim. Every write about the message is fenced on both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    /// The message's id.
    pub id: u64,
    /// The claim's fence.
    pub fence: u64,
}

/// A message a relay claimed, to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    /// Its id: the order messages were enqueued in.
    pub id: u64,
    /// The effect key that names it.
    pub key: EffectKey,
    /// Its ordering key.
    pub ordering_key: String,
    /// Where it goes.
    pub destination: String,
    /// Its headers.
    pub headers: Vec<(String, String)>,
    /// Its payload.
    pub payload: Vec<u8>,
    /// How many claims it has had, this one included.
    pub attempts: u32,
    /// This claim's fence.
    pub fence: u64,
    /// When it was enqueued (the enqueuing transaction's write, on the
    /// database's clock).
    pub enqueued_at: SystemTime,
    /// When this claim's lease ends, on the database's clock.
    pub lease_expires_at: SystemTime,
}

impl Pending {
    /// The id every copy of this message is published with: the effect
    /// key's [`provider_key`](EffectKey::provider_key), the same for every
    /// relay and every attempt.
    pub fn message_id(&self) -> String {
        self.key.provider_key()
    }

    /// The claim's [`Ticket`].
    pub fn ticket(&self) -> Ticket {
        Ticket {
            id: self.id,
            fence: self.fence,
        }
    }
}

/// What an outbox holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutboxStats {
    /// Messages not sent yet (claimed ones included).
    pub pending: u64,
    /// Of those, the ones a relay holds under a live lease.
    pub claimed: u64,
    /// Messages sent and not pruned yet.
    pub sent: u64,
    /// Messages given up after their attempts (they no longer hold back
    /// their ordering key).
    pub failed: u64,
    /// When the oldest pending message was enqueued.
    pub oldest_pending: Option<SystemTime>,
}

/// The relay's side of an outbox: claim, mark, retry, prune. The SQL
/// backends implement it on a table beside their ledger's
/// (`<table>_outbox`).
///
/// The contract, rule by rule:
/// - [`Outbox::claim_messages`] takes, per ordering key, only the oldest
///   message that is neither sent nor failed, and only when it is due
///   (its retry time has come) and not held under a live lease; it grants a
///   lease of `lease` on the database's clock and a fence above every
///   earlier fence of that message. Two claims never hold one message.
/// - [`Outbox::mark_sent`], [`Outbox::retry_later`] and
///   [`Outbox::mark_failed`] write only when the message is still pending at
///   the ticket's fence (a relay whose lease was taken over writes
///   nothing), and say whether they wrote.
/// - A sent or failed message is never claimed again.
pub trait Outbox: Send + Sync {
    /// Claims up to `limit` due messages (see the contract above), oldest
    /// first.
    fn claim_messages(
        &self,
        limit: u32,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<Pending>>> + Send;

    /// Marks messages sent, each fenced on its ticket: one answer per
    /// ticket, in order (`false`: the ticket's claim was taken over, nothing
    /// was written for it).
    fn mark_sent(&self, tickets: &[Ticket]) -> impl Future<Output = Result<Vec<bool>>> + Send;

    /// Gives a claimed message back, to be claimed again after `delay`,
    /// recording `error` (fenced; `false`: nothing written).
    fn retry_later(
        &self,
        ticket: Ticket,
        delay: Duration,
        error: &str,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Gives a claimed message up, recording `error` (fenced; `false`:
    /// nothing written). It is never published again and no longer holds
    /// back its ordering key.
    fn mark_failed(&self, ticket: Ticket, error: &str) -> impl Future<Output = Result<bool>> + Send;

    /// Deletes up to `limit` messages sent at least `older_than` ago, on the
    /// database's clock; returns how many.
    fn prune_sent(&self, older_than: Duration, limit: u32) -> impl Future<Output = Result<u64>> + Send;

    /// What the outbox holds now.
    fn outbox_stats(&self) -> impl Future<Output = Result<OutboxStats>> + Send;
}

/// The application's side of an outbox: enqueue a message in the caller's
/// transaction.
pub trait TransactionalOutbox: Outbox + TransactionalLedger {
    /// Writes `message` as the message of `key`, in the transaction open on
    /// `conn`: it commits with the caller's other writes or not at all.
    /// Inside [`Job::step_in`](crate::Job::step_in), pass the step's key
    /// ([`StepContext::key`](crate::StepContext::key)). A key that already
    /// names a message (committed, or written earlier in this transaction)
    /// writes nothing: [`Enqueued::Already`].
    fn enqueue_in(
        &self,
        conn: &mut Self::Connection,
        key: &EffectKey,
        message: &Message,
    ) -> impl Future<Output = Result<Enqueued>> + Send;
}

impl<O: Outbox + ?Sized> Outbox for &O {
    fn claim_messages(
        &self,
        limit: u32,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<Pending>>> + Send {
        (**self).claim_messages(limit, lease)
    }
    fn mark_sent(&self, tickets: &[Ticket]) -> impl Future<Output = Result<Vec<bool>>> + Send {
        (**self).mark_sent(tickets)
    }
    fn retry_later(
        &self,
        ticket: Ticket,
        delay: Duration,
        error: &str,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).retry_later(ticket, delay, error)
    }
    fn mark_failed(&self, ticket: Ticket, error: &str) -> impl Future<Output = Result<bool>> + Send {
        (**self).mark_failed(ticket, error)
    }
    fn prune_sent(&self, older_than: Duration, limit: u32) -> impl Future<Output = Result<u64>> + Send {
        (**self).prune_sent(older_than, limit)
    }
    fn outbox_stats(&self) -> impl Future<Output = Result<OutboxStats>> + Send {
        (**self).outbox_stats()
    }
}

impl<O: Outbox + ?Sized> Outbox for std::sync::Arc<O> {
    fn claim_messages(
        &self,
        limit: u32,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<Pending>>> + Send {
        (**self).claim_messages(limit, lease)
    }
    fn mark_sent(&self, tickets: &[Ticket]) -> impl Future<Output = Result<Vec<bool>>> + Send {
        (**self).mark_sent(tickets)
    }
    fn retry_later(
        &self,
        ticket: Ticket,
        delay: Duration,
        error: &str,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).retry_later(ticket, delay, error)
    }
    fn mark_failed(&self, ticket: Ticket, error: &str) -> impl Future<Output = Result<bool>> + Send {
        (**self).mark_failed(ticket, error)
    }
    fn prune_sent(&self, older_than: Duration, limit: u32) -> impl Future<Output = Result<u64>> + Send {
        (**self).prune_sent(older_than, limit)
    }
    fn outbox_stats(&self) -> impl Future<Output = Result<OutboxStats>> + Send {
        (**self).outbox_stats()
    }
}

/// Why a broker did not take a message.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PublishError {
    /// Whether trying again may succeed (the broker was unreachable, did
    /// not confirm in time), as opposed to a message it will never take (a
    /// destination that does not exist, a payload over its limit).
    pub retryable: bool,
    /// What the broker said.
    pub message: String,
}

impl PublishError {
    /// A failure that may pass.
    pub fn retryable(message: impl Into<String>) -> Self {
        PublishError {
            retryable: true,
            message: message.into(),
        }
    }

    /// A message the broker will never take.
    pub fn permanent(message: impl Into<String>) -> Self {
        PublishError {
            retryable: false,
            message: message.into(),
        }
    }
}

/// A broker a [`Relay`] publishes to. `publish` returns once the broker has
/// confirmed the message (a publisher confirm, a JetStream ack, a Kafka
/// delivery report, an `XADD` reply), never before: the relay marks it sent
/// on that answer. Every copy of a message must carry
/// [`Pending::message_id`] where the broker has a place for it.
pub trait Publisher: Send + Sync {
    /// Publishes one message and waits for the broker's confirmation.
    fn publish(
        &self,
        message: &Pending,
    ) -> impl Future<Output = std::result::Result<(), PublishError>> + Send;

    /// What the relay's logs and report call the broker (no credentials).
    fn describe(&self) -> String;
}

impl<P: Publisher + ?Sized> Publisher for &P {
    fn publish(
        &self,
        message: &Pending,
    ) -> impl Future<Output = std::result::Result<(), PublishError>> + Send {
        (**self).publish(message)
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
}

impl<P: Publisher + ?Sized> Publisher for std::sync::Arc<P> {
    fn publish(
        &self,
        message: &Pending,
    ) -> impl Future<Output = std::result::Result<(), PublishError>> + Send {
        (**self).publish(message)
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
}

/// How a [`Relay`] works.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    /// The most messages one pass claims (one per ordering key).
    pub batch: u32,
    /// How long a claim holds its messages. A pass that has not marked its
    /// messages by then may lose them to another relay (which publishes them
    /// again: downstream drops the copy by its message id).
    pub lease: Duration,
    /// How long a pass that found nothing waits before the next.
    pub idle: Duration,
    /// Claims after which a message the broker keeps refusing is given up.
    pub max_attempts: u32,
    /// The first delay before a refused message is retried; it doubles up
    /// to `max_retry_delay`.
    pub retry_delay: Duration,
    /// The longest delay between retries.
    pub max_retry_delay: Duration,
    /// How long sent messages are kept before pruning (`None`: this relay
    /// prunes nothing).
    pub retention: Option<Duration>,
}

impl Default for RelayOptions {
    fn default() -> Self {
        RelayOptions {
            batch: 100,
            lease: Duration::from_secs(30),
            idle: Duration::from_millis(200),
            max_attempts: 20,
            retry_delay: Duration::from_millis(500),
            max_retry_delay: Duration::from_secs(60),
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
        }
    }
}

impl RelayOptions {
    /// Checks the options ([`Error::InvalidInput`]): a batch of 1 to 10,000,
    /// a lease of at least a second, at least one attempt.
    pub fn validate(&self) -> Result<()> {
        if self.batch == 0 || self.batch > 10_000 {
            return Err(invalid(format!("batch must be 1 to 10000, got {}", self.batch)));
        }
        if self.lease < Duration::from_secs(1) || self.lease > Duration::from_secs(86_400) {
            return Err(invalid(format!(
                "the relay's lease must be between 1 s and 1 day, got {:?}",
                self.lease
            )));
        }
        if self.max_attempts == 0 {
            return Err(invalid("max_attempts must be at least 1".to_owned()));
        }
        Ok(())
    }
}

/// What one [`Relay::pass`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pass {
    /// Messages claimed.
    pub claimed: u64,
    /// Published and marked sent.
    pub sent: u64,
    /// Published, but the mark was refused: another relay had taken the
    /// message over (it publishes its own copy).
    pub fenced: u64,
    /// Refused by the broker, to be retried.
    pub retried: u64,
    /// Given up after their attempts, or refused for good by the broker.
    pub failed: u64,
    /// Sent messages pruned.
    pub pruned: u64,
}

impl Pass {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: Pass) {
        self.claimed += other.claimed;
        self.sent += other.sent;
        self.fenced += other.fenced;
        self.retried += other.retried;
        self.failed += other.failed;
        self.pruned += other.pruned;
    }
}

/// Publishes an outbox's messages to a broker: claim a batch (one message
/// per ordering key), publish each and wait for the broker's confirmation,
/// mark the confirmed ones sent in one fenced write, give the refused ones
/// back with back-off, and prune what was sent long enough ago. Run as many
/// relays as you like on one outbox: claims are fenced.
#[derive(Debug)]
pub struct Relay<O, P> {
    outbox: O,
    publisher: P,
    opts: RelayOptions,
}

impl<O: Outbox, P: Publisher> Relay<O, P> {
    /// A relay from `outbox` to `publisher`.
    pub fn new(outbox: O, publisher: P, opts: RelayOptions) -> Result<Self> {
        opts.validate()?;
        Ok(Relay {
            outbox,
            publisher,
            opts,
        })
    }

    /// The outbox it reads.
    pub fn outbox(&self) -> &O {
        &self.outbox
    }

    /// One pass: claim, publish, mark. Returns what it did; an error of the
    /// outbox (the database unreachable) is returned as is, and the messages
    /// it had claimed are claimed again once their lease ends.
    pub async fn pass(&self) -> Result<Pass> {
        let claimed = self
            .outbox
            .claim_messages(self.opts.batch, self.opts.lease)
            .await?;
        let mut pass = Pass {
            claimed: claimed.len() as u64,
            ..Pass::default()
        };
        if claimed.is_empty() {
            return Ok(pass);
        }
        // One message per ordering key: publishing them at once keeps each
        // key's order. Each publish is bounded by the lease.
        let results = futures_util::future::join_all(claimed.iter().map(|m| async move {
            match tokio::time::timeout(self.opts.lease, self.publisher.publish(m)).await {
                Ok(r) => r,
                Err(_) => Err(PublishError::retryable(format!(
                    "no confirmation from {} within the lease ({:?})",
                    self.publisher.describe(),
                    self.opts.lease
                ))),
            }
        }))
        .await;
        let mut confirmed = Vec::new();
        for (m, result) in claimed.iter().zip(results) {
            match result {
                Ok(()) => confirmed.push(m.ticket()),
                Err(e) => {
                    let give_up = !e.retryable || m.attempts >= self.opts.max_attempts;
                    tracing::warn!(
                        effect_key = %m.key,
                        destination = %m.destination,
                        attempts = m.attempts,
                        give_up,
                        error = %e,
                        "the broker did not take an outbox message"
                    );
                    let wrote = if give_up {
                        self.outbox.mark_failed(m.ticket(), &e.message).await?
                    } else {
                        let delay = self.retry_delay(m.attempts);
                        self.outbox.retry_later(m.ticket(), delay, &e.message).await?
                    };
                    match (wrote, give_up) {
                        (false, _) => pass.fenced += 1,
                        (true, true) => pass.failed += 1,
                        (true, false) => pass.retried += 1,
                    }
                }
            }
        }
        if !confirmed.is_empty() {
            let marked = self.outbox.mark_sent(&confirmed).await?;
            for (ticket, wrote) in confirmed.iter().zip(marked) {
                if wrote {
                    pass.sent += 1;
                } else {
                    pass.fenced += 1;
                    tracing::warn!(
                        id = ticket.id,
                        fence = ticket.fence,
                        "an outbox message was published after another relay took it over: \
                         it is published again under the same message id"
                    );
                }
            }
        }
        crate::telemetry::relay_pass(&pass);
        Ok(pass)
    }

    fn retry_delay(&self, attempts: u32) -> Duration {
        let mut b = Backoff::new(self.opts.retry_delay, self.opts.max_retry_delay);
        let mut d = b.next_delay();
        for _ in 1..attempts.min(32) {
            d = b.next_delay();
        }
        d
    }

    /// Runs passes until `shutdown` resolves: at once after a pass that
    /// claimed a full batch, after [`RelayOptions::idle`] otherwise, and
    /// after a growing pause (up to 5 s) while the outbox is unreachable.
    /// Prunes sent messages every minute when [`RelayOptions::retention`]
    /// is set. Returns the sum of what the passes did.
    pub async fn run_until(&self, shutdown: impl Future<Output = ()>) -> Pass {
        let mut total = Pass::default();
        let mut failing = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut last_prune: Option<std::time::Instant> = None;
        tokio::pin!(shutdown);
        loop {
            let pause = match self.pass().await {
                Ok(pass) => {
                    failing = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
                    total.add(pass);
                    if pass.claimed >= u64::from(self.opts.batch) {
                        Duration::ZERO
                    } else {
                        self.opts.idle
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "outbox relay pass failed");
                    failing.next_delay()
                }
            };
            if let Some(retention) = self.opts.retention
                && last_prune.is_none_or(|t| t.elapsed() >= Duration::from_secs(60))
            {
                last_prune = Some(std::time::Instant::now());
                match self.outbox.prune_sent(retention, 10_000).await {
                    Ok(n) => total.pruned += n,
                    Err(e) => tracing::warn!(error = %e, "outbox prune failed"),
                }
            }
            tokio::select! {
                _ = &mut shutdown => return total,
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }
}

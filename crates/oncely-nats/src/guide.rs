//! # oncely-nats: the guide
//!
//! What [the crate docs](crate) leave out of their first screen: the
//! guarantees and limits, and how it works.
//!
//! ## Opening
//!
//! A ledger opens from a URL, `nats://h1:p1[,h2:p2…][?bucket=B&replicas=R]`:
//! one server or a comma-separated list (each entry `host:port` or a full
//! `nats://` URL; credentials go on each entry that needs them), and for the
//! whole list the KV bucket (`bucket`, default `oncely_effects`) and its
//! replica count (`replicas`, 1 or 3, default 1). Any other parameter is
//! refused with [`oncely::Error::Config`], and no message quotes the URL (it
//! may carry a password or a token).
//!
//! - [`NatsKvLedger::connect`]`(url)`: the default options; creates the
//!   bucket if it is missing.
//! - [`NatsKvLedger::connect_with`]`(url, options)`: [`NatsKvLedgerOptions`] for
//!   the rest (timeouts, `max_age`); the URL's parameters override the
//!   options' bucket and replicas. [`NatsKvLedgerOptions::migrate`]`(false)` never
//!   creates a bucket (a missing one is [`oncely::Error::Config`]);
//!   [`NatsKvLedgerOptions::read_only`] neither, and the ledger refuses its own
//!   writes before any round trip (it still writes its clock probe: see
//!   there).
//! - [`NatsKvLedger::from_store`]`(client, store, options)`: a bucket the
//!   caller opened, checked like one `connect` finds; `client` carries the
//!   completion notifications (see "Waiting").
//! - [`oncely::open::FromUrl`] (scheme `nats`), for tools that pick the
//!   backend from a URL: [`oncely::open::Access`] `Migrate`, `Existing`
//!   (`migrate(false)`) or `ReadOnly` (`read_only(true)`); its
//!   `connect_timeout` bounds the connection and the wait for the bucket.
//!
//! | URL part | what it sets |
//! | --- | --- |
//! | `nats://user:password@h1:p1,h2:p2,…` | the servers (each entry `host:port` or a full `nats://` URL) |
//! | `?bucket=payments` | [`NatsKvLedgerOptions::bucket`] (default `oncely_effects`) |
//! | `?replicas=3` | [`NatsKvLedgerOptions::replicas`] (1 or 3, default 1) |
//! | any other parameter (`?buckt=x`) | refused: [`oncely::Error::Config`] naming it and the accepted ones, before anything connects (the rule every backend shares, [`oncely::open::UrlParams`]) |
//!
//! A ledger's [`Display`](std::fmt::Display) says what it reads (`nats
//! n1:4222,n2:4222, bucket payments`), never a credential.
//!
//! ## Guarantees and limits
//!
//! | | |
//! | --- | --- |
//! | atomic claim | `create` (expected last subject sequence 0) for an absent key; takeover of an expired or released record by `update` expecting the revision just read. A lost race re-reads and decides again. On a replicated bucket served by nats-server before 2.9.21, whose cluster can accept two writes expecting the same revision, each write on top of a revision is first claimed by creating a marker key: see Replicated buckets. |
//! | caller's transaction | no: NATS has none. Use `ProviderKeyed` or `AtMostOnce` steps. |
//! | durability | JetStream file storage (a memory-backed bucket is refused). A write is acknowledged once the leader (R=1) or a quorum (R=3) has handed it to the OS, **not once it is on disk**: the server fsyncs on a timer (every 2 minutes by default). A crash of nats-server loses nothing acknowledged; an OS crash or a power loss of an R=1 server can lose up to 2 minutes of acknowledged claims and completions, unless the server runs with `sync_interval: always` (nats-server 2.10 and later; 2.9 has no such setting). [`Capabilities::durability`](oncely::backend::Capabilities::durability) reports it for the replica count and the server version. See Durability. |
//! | replication | `replicas = 3`: Raft, acknowledged after a quorum has it; survives the loss of one node (its crash, OS crash or power loss), with claimants connected to any node. One holder per key and no acknowledged completion lost, tested with claimants on all three nodes on nats-server 2.9.10 and 2.15.1 (see Replicated buckets). `replicas = 1`: none. |
//! | clock | NATS server timestamps of each revision; "now" is a lower bound of the server's clock (see below), never the worker's wall clock. |
//! | max key | [`oncely::backend::MAX_KEY_BYTES`] (the displayed key is stored in the value; the KV key is `<tenant>.<blake3 hex>`). |
//! | max outcome | [`oncely::backend::MAX_OUTCOME_BYTES`] (stored base64, far below JetStream's 1 MiB message limit). |
//! | fences | the server clock's µs (its lower bound, below) when a record is created, `max(previous + 1, clock µs)` on takeover ([`oncely::backend::next_fence`]): they grow for the life of the bucket, across prunes and `max_age` drops, as long as retentions are longer than the clock estimate's lag (a probe's round trip, below). |
//! | horizon | per tenant and kind: the later of a watermark that `prune` raises before it deletes, and `now - max_age` (what the bucket drops by itself). See below. |
//! | round trips | claim of a new key: 1 (2 with `sent_at`: the create, then the watermark). complete / release / renew: 1 when this ledger made the claim (it remembers the revision), else 2 (read, conditional write); complete and release also publish one core NATS message (no reply awaited). On a replicated bucket of nats-server before 2.9.21, every write on top of an existing revision (complete, release, renew, a takeover, prune's deletes, a watermark raise) costs one more: its marker. |
//! | batches | `claim_many` / `complete_many`: the single operations pipelined on the connection (up to 128 keys in flight), each keeping every rule of the single one; answers in the order given, a key listed twice claimed in list order. See below. |
//! | waiting | a duplicate that finds the effect in progress is woken when it is completed or released, by this process's own write at once, by another's through a core NATS subject of the bucket; polling while the subscription is down. See below. |
//! | prune / abandoned | read the latest revision of every key (the whole bucket / one tenant's keys) through an ordered consumer: cost grows with the keys kept, so prune in batches off the hot path. Prune also writes each pruned tenant and kind's watermark once per call (2 round trips each). |
//! | retention | per claim, enforced by [`oncely::backend::Ledger::prune`]; the bucket's `max_age` is the hard ceiling (a longer retention is refused). |
//! | operator view | not offered: this crate does not implement [`oncely::admin::Admin`] (listing and counting records by tenant and kind, `forget`, a prune dry run): the bucket has no secondary index, so it would read every key. `oncely inspect`, `resolve` and tenant-scoped `abandoned` work; the other operator commands say they are not available here. |
//!
//! ### Durability
//!
//! JetStream writes each acknowledged message to its files before the
//! acknowledgement, but leaves them in the OS's cache and fsyncs them on a
//! timer. What an acknowledged claim or completion survives:
//!
//! | configuration | a crash of nats-server | an OS crash or power loss of one server | of two or more at once |
//! | --- | --- | --- | --- |
//! | R=1, the default sync (2 min) | nothing lost | up to 2 min of acknowledged writes lost | (one server) |
//! | R=1, `sync_interval: always` (2.10+) | nothing lost | nothing lost | (one server) |
//! | R=3, the default sync | nothing lost | nothing lost: the other two have it, and the node catches up | writes acknowledged within the sync period can be lost |
//! | R=3, `sync_interval: always` (2.10+) | nothing lost | nothing lost | nothing lost, as long as the disks keep what was synced |
//!
//! nats-server 2.9 fsyncs streams every 2 minutes and has no setting for
//! it (its configuration refuses `sync_interval`); 2.10 added `jetstream {
//! sync_interval: <duration> | always }`, which applies to every stream of
//! the server and costs write throughput with `always`. A client cannot
//! read that setting (only the monitoring endpoint `/varz` shows it), so
//! [`Capabilities::durability`](oncely::backend::Capabilities::durability) names the
//! replica count, the server version it connected to and what each
//! setting gives. Jepsen's analysis of nats-server 2.12.1 (2025) found that
//! the default sync can also lose acknowledged writes at R=3 when one
//! node's OS crash coincides with a partition or a process pause, and that
//! file corruption on a minority of nodes can lose writes; `sync_interval:
//! always` removes the first. A lost write lets an effect run again, as
//! with any backend that forgets a record: provider keys and fenced writes
//! bound what that does.
//!
//! ### Replicated buckets
//!
//! Every write of this ledger is conditional on the key's latest revision
//! (the `Nats-Expected-Last-Subject-Sequence` header): that is what makes a
//! claim, a takeover and a fenced completion atomic. A single server checks
//! the condition under the stream's lock. A clustered stream's leader
//! checks it before proposing the write to Raft, and what happens next
//! depends on the server version:
//!
//! | nats-server | a write expecting revision 0 (an empty key) | a write expecting revision N > 0 | what the ledger does |
//! | --- | --- | --- | --- |
//! | 2.9.20 and older | checked again when applied: exactly one of several racing creates is stored | **not** checked again when applied (nats-server issue 4320): several writes racing for one revision can all be accepted | creates a marker first (below) |
//! | 2.9.21 to 2.11 | checked when applied | checked when applied | nothing more |
//! | 2.12 and later | the leader refuses a conditional write to a key that has one in flight, until it is applied | the same | nothing more |
//!
//! On 2.9.10 (Debian's package), three-node tests saw up to all 24 of 24
//! writes racing for one revision accepted, and several claimants of one
//! expired lease all `Acquired`; creates of one empty key raced through the
//! three nodes never had more than one winner. So where the server the
//! ledger connects to is older than 2.9.21 and the bucket is replicated, a
//! write on top of revision N first creates the marker key
//! `_oncely_cas.<N>-<digest of the key and the value read at N>` (a
//! create: exactly one succeeds). Only its creator sends its write; anyone
//! else who wanted to write on top of N reads the marker, sends a copy of
//! the write it describes, and reports a lost race (the operation reads
//! again and decides on what it finds, as after any lost race). Copies of
//! one write are harmless if several land (the record holds the same
//! value, a little later), and they finish the write of a creator that died
//! between its marker and its write, so a crashed claimant never blocks a
//! key. This covers every conditional write: takeovers, completions,
//! releases and renewals racing a takeover of their expired lease, prune's
//! deletes, the undo of a claim beyond the horizon, creates over a delete
//! marker, and the horizon watermark (two prunes racing could otherwise
//! lower it). Markers cost one round trip per write on top of a revision
//! (a claim of a new key costs none); `prune` purges those older than an
//! hour, and the bucket's `max_age` drops any left. They are not records:
//! scans, `abandoned` and prune skip them.
//!
//! Limits. The ledger decides from the version of the server it connects
//! to: in a cluster that mixes nodes older than 2.9.21 with newer ones (a
//! rolling upgrade), a ledger connected to a new node writes no markers
//! while an old node may lead the bucket's stream; upgrade every node, or
//! connect the ledgers to old nodes until then. On 2.12 and later the
//! in-flight check is the stream leader's own state and is cleared when
//! leadership changes (nats-server issue 8469 proposes checking it again
//! when applied); no double grant was seen in the node-loss tests, but a
//! write racing another for one revision across a leader change is not
//! proven exclusive there, and a client cannot close that. A 2.9.10
//! cluster that lost its leader was also seen acknowledging a write with a
//! sequence other than its own: the ledger's next write with it is refused
//! and reads again, and the marker's digest keeps such a phantom revision
//! from ever blocking another write. Tested: nats-server 2.9.10 and 2.15.1,
//! three nodes on one machine (`tests/cluster.rs`, `tests/node_loss.rs`).
//!
//! ### Clocks
//!
//! A revision's server timestamp is when it was written; a record stores the
//! lease *length* and retention *length*, not instants, so expiry is "server
//! now - revision timestamp > lease". The server never sends its current
//! time, so each ledger keeps a lower bound of it: a probe write to a
//! reserved key, read back, renewed by the first operation after it is 2 s
//! old, advanced meanwhile by the worker's monotonic clock (0.1 % allowance
//! for rate differences), and raised by every timestamp the ledger reads.
//! It is never ahead of the server, and behind by at most a probe's round
//! trip plus 0.1 % of 2 s; leases therefore expire at most that late, never
//! early. A lease is enforced from the stamp of the revision that granted or
//! renewed it; the [`oncely::backend::Lease`] a claim or renewal returns has
//! `acquired_at` = the estimate read just before that write (so at or before
//! the stamp) and `expires_at = acquired_at + length`: it never ends later
//! than the lease the server enforces, so the runner's deadline and safety
//! margin, computed from it, err on the safe side. Timestamps in
//! [`oncely::backend::Record`] and [`oncely::backend::Lease`] are server stamps or this
//! estimate. Cluster nodes' clocks must be in sync (NTP), as JetStream
//! itself assumes. A server clock outside 1970..9999 is an error
//! ([`oncely::Error::Backend`], not retryable), never a panic.
//!
//! ### Retention and `max_age`
//!
//! The bucket's `max_age` (default 30 days) drops any key not written for
//! that long. Claims whose retention exceeds the configured `max_age` are
//! refused before any round trip ([`oncely::Error::InvalidInput`]) so no
//! completed record vanishes before its retention ends. Shorter retention
//! is honoured by `prune`, which deletes completed and released records past
//! it with a revision-checked delete (a record changed meanwhile is left
//! alone). Limits that follow from `max_age`: an abandoned at-most-once step
//! (or a lease nobody takes over) disappears `max_age` after its last write,
//! so reconcile abandoned steps within `max_age`; and a deleted key leaves a
//! small delete marker until `max_age`. A key whose record was pruned or
//! dropped gets a fence above all its earlier ones when claimed again.
//! `max_age` must be at least 2 days (longer than the longest lease).
//!
//! ### Horizon
//!
//! [`oncely::backend::Ledger::horizon`] of a tenant and kind is the later of two instants:
//! the newest `created_at` among the records `prune` deleted there (a
//! watermark kept in the bucket at `<tenant>.horizon.<blake3 hex of the
//! kind>`, raised with a revision-checked update *before* each delete), and
//! `now - max_age` of the bucket (a record untouched that long vanished, and
//! was created before). A claim of an absent key whose
//! [`oncely::ClaimOptions::sent_at`] is at or before the horizon fails with
//! [`oncely::Error::BeyondHorizon`] and leaves nothing behind: older than
//! `now - max_age` before any write; otherwise the claim creates the record,
//! then reads the watermark, and deletes exactly the revision it created if
//! the message is beyond it. That order (prune: raise, then delete; claim:
//! create, then read) is what makes a replay of a pruned effect unable to
//! run again; `horizon.rs` has the argument. A claim's own retention plays
//! no part. A record whose claimant died between its create and that check
//! is checked again by whoever takes its expired lease over. Without
//! `sent_at`, a claim cannot tell a replay of a pruned effect from new work:
//! it runs it; give messages their production time where replays can come
//! late. An existing record always answers for itself, however old the
//! message.
//!
//! ### Waiting
//!
//! A duplicate run with [`oncely::OnInProgress::Wait`] that finds the effect
//! in progress takes a watch ([`oncely::backend::Ledger::watch`]) and is woken when
//! the holder completes or releases, instead of polling. After each
//! completion or release the ledger wakes the key's watches in its own
//! process at once, then publishes the displayed key on the core NATS
//! subject `oncely.<bucket>.done` (the bucket's name, one subject token; no
//! reply is awaited, so it costs no round trip; a `complete_many` publishes
//! one message with all the keys it completed, one per line). Each ledger holds one subscription to that subject and
//! relays what other processes publish to its waiters. A wake-up is a hint:
//! the waiter claims again and answers from the record, so a lost
//! notification costs latency (at most [`oncely::backend::NOTIFIED_FALLBACK`],
//! and never beyond the holder's lease), never a wrong answer.
//!
//! Why not a KV watch: a watch is a JetStream consumer, created and deleted
//! with API round trips and held as server state; one per waiter would add
//! both to every wait, under the load where duplicates pile up, and one
//! bucket-wide per ledger would deliver every write with its value. The
//! notification needs no durability, so the cheapest carrier wins (the
//! reasoning in full is in `notify.rs`).
//!
//! Limits: every ledger on a bucket receives every completion of that
//! bucket (the key, at most 255 bytes). A NATS user needs permission to
//! publish and subscribe on `oncely.<bucket>.done`; without it, waiters in
//! other processes are woken by the fallback, once a second.
//! [`NatsKvLedger::is_listening`] says whether the subscription is up (while
//! the connection is down, watches poll: 5 ms doubling to 250 ms);
//! [`NatsKvLedger::notifications_received`] counts what it relayed. A
//! read-only ledger does not subscribe. A lease that simply expires is not
//! announced: its waiters look again when it ends.
//!
//! ### Batches
//!
//! [`oncely::backend::Ledger::claim_many`] and [`oncely::backend::Ledger::complete_many`] run
//! the single claim and completion of each key concurrently on the one
//! connection: JetStream has no multi-key conditional write, but pipelined
//! requests cost about one round trip for the batch plus the server's time
//! per write. Each key keeps every rule above (create first; with `sent_at`
//! the horizon read after the create and the undo of exactly that revision;
//! fences from the clock's lower bound; the recheck of an unchecked record
//! before a takeover), so a batch answers exactly what single claims in the
//! same order would. A key listed twice is claimed twice, in list order:
//! the first occurrence acquires, the second finds it in progress. Invalid
//! options, a retention above `max_age` and a read-only ledger fail the
//! whole `claim_many` before any round trip; everything else is answered
//! per key.
//!
//! ### Errors
//!
//! Cannot connect: [`oncely::Error::Unavailable`]. JetStream unavailable, no
//! quorum, timeouts: [`oncely::Error::Backend`] with `retryable: true`;
//! `connect` itself keeps asking for up to `open_timeout` (default 30 s)
//! while a cluster that just (re)started elects the bucket's leader. A
//! server running without JetStream: [`oncely::Error::Config`] at once. A
//! bucket with incompatible settings (history other than 1, a shorter
//! `max_age`, other replicas, memory storage, message or byte limits that
//! could drop live leases): [`oncely::Error::Config`], and nothing is
//! changed. A write on a read-only ledger: [`oncely::Error::Config`], before
//! any round trip. Every write is one revision-checked message, so a dropped
//! future has either been applied by the server or not, never half, and a
//! write based on a stale read is refused rather than applied. (Where
//! markers are written, a future dropped between its marker and its write
//! leaves the write to be finished by the next writer on that revision: a
//! dropped completion may still be recorded, a dropped takeover holds the
//! key until its lease ends.)
//!
//! ## Source layout
//!
//! `options.rs` (the options and the URL), `ledger.rs` (the type, its
//! constructors, `Ledger` and `FromUrl`), `claim.rs` (create or take over),
//! `batch.rs` (`claim_many` and `complete_many`, pipelined), `marker.rs`
//! (the markers that keep writes exclusive on old replicated servers), `notify.rs`
//! (completion notifications and the relay that wakes waiters), `prune.rs`, `horizon.rs` (the watermark, and why its order is safe),
//! `clock.rs` (the server clock's estimate and its probe), `kv.rs` (every
//! read, write and scan of records and watermarks: what `sql.rs` is to the
//! SQL backends), `codec.rs` (keys and
//! values, and decoding a value into a record: what `row.rs` is to the SQL
//! backends), `bucket.rs` (opening and checking the bucket: what
//! `schema.rs` is to them) and `error.rs`.

// The guide links to the crate's items by name, as the crate docs did.
#[allow(unused_imports)]
use crate::*;

//! The `oncely` command: argument parsing and printing only. What each
//! command does lives in the `oncely_cli` library.
#![forbid(unsafe_code)]
// `run` awaits every command's future, and the deepest (opening any backend
// through a host list, then the pipeline) nests past the default 128 when
// the release build computes its layout ("queries overflow the depth
// limit").
#![recursion_limit = "256"]

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use comfy_table::Table;
use comfy_table::presets::NOTHING;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use oncely::Error;
use oncely::admin::Filter;
use oncely_cli::admin::{self, ActionReport, History, Inspection, StatsReport};
use oncely_cli::bench::{self, BenchConfig, BenchReport};
use oncely_cli::chaos;
use oncely_cli::demo::{self, DemoConfig, DemoReport, Guard, Progress};
use oncely_cli::ops::{self, Read, RecordView};
use oncely_cli::reconcile::{self, ReconcileConfig, ReconcileReport};
use oncely_cli::serve::{self, ServeArgs};

/// Make job and message handlers safe to run twice.
///
/// oncely records each effect (a charge, an email) under a key derived from
/// the business fact, claimed atomically in a database, so a redelivered or
/// concurrent duplicate message changes nothing. This command runs the
/// double-charge demo, measures duplicates next to hand-written code, and
/// lets operators inspect and maintain a ledger.
///
/// Database URLs: sqlite:PATH or sqlite://PATH (add ?mode=rwc to create the
/// file), postgres://USER@HOST/DB, mysql://USER@HOST/DB or mariadb://USER@HOST/DB,
/// redis://HOST:PORT[/DB] (one server), redis+cluster://HOST:PORT,HOST:PORT,...
/// (a Redis Cluster's seed nodes), redis+sentinel://HOST:PORT,...,/MASTER[/DB]
/// (the primary Sentinel names; add ?wait_replicas=N to acknowledge writes only
/// once N replicas have them; on any Redis URL, ?ephemeral=true writes to a
/// server that persists nothing), nats://HOST:PORT[,HOST:PORT...] with
/// optional ?bucket=NAME&replicas=1|3 (JetStream KV), memory: (an empty
/// in-process ledger). The URL names the ledger's table too: ?table=T on
/// SQLite and MySQL (whose schema is the URL's database), ?schema=S&table=T
/// on PostgreSQL, ?prefix=P on Redis, ?bucket=B on NATS; an unknown
/// parameter is a usage error. Every answer names the ledger it read.
///
/// Exit codes: 0 success; 1 runtime failure (database unreachable, backend
/// error, oncely charged twice in the demo, an effect ran twice in the
/// bench, resolve or forget refused: a live lease, a fence that moved;
/// reconcile could not settle a record); 2 usage error (bad arguments, invalid key or tenant, unknown URL
/// scheme, a command the backend does not offer); 3 `get`, `inspect`,
/// `resolve` or `forget` found no record.
#[derive(Debug, Parser)]
#[command(name = "oncely", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show a naive guard charging twice, and oncely charging once.
    ///
    /// Each order's "charge" message is delivered several times; all
    /// deliveries are shuffled into one queue that several workers consume
    /// concurrently, so duplicates of one order overlap. The same deliveries
    /// run twice against a real database: first with the naive guard (read
    /// the order's status, charge if not paid, write 'paid'), then with
    /// oncely (claim capture:order-N, charge with the provider key, mark the
    /// order paid). A fake payment provider counts the charges.
    ///
    /// By default the database is a fresh SQLite file in a temporary
    /// directory, removed afterwards. With --database-url the ledger records
    /// stay (tenant demo-<run id>, kept one hour) and the orders tables are
    /// dropped. On Redis, NATS and memory: the orders table lives in a
    /// scratch SQLite file. Exits 1 if oncely charged any order twice.
    Demo(DemoArgs),
    /// Measure duplicates: oncely next to hand-written code, on one database.
    ///
    /// Each of --jobs jobs is delivered twice: sequentially (one worker, the
    /// duplicate sent when the first delivery has returned) and concurrently
    /// (--workers workers, both deliveries of a job dispatched at the same
    /// instant). Each mode runs with single claims and with batches of
    /// --batch jobs (claim_many / complete_many), with oncely (Effects::run
    /// under the Wait policy, and for concurrent duplicates under Reject)
    /// and with the hand-written minimum on the same database: PostgreSQL
    /// INSERT ... ON CONFLICT DO NOTHING RETURNING, then SELECT on a
    /// duplicate; MySQL INSERT IGNORE, then SELECT; SQLite INSERT ... ON
    /// CONFLICT DO NOTHING, then SELECT; Redis SET NX PX, then GET; NATS KV
    /// create, then get; a mutex-guarded map for memory:.
    ///
    /// Each row prints deliveries/s, the claim latency (p50, p99), the
    /// wake-up latency of duplicates that waited for the first delivery
    /// (from its return to theirs), the effects executed (must equal --jobs)
    /// and the ratio of deliveries/s to the hand-written row. By default the
    /// database is a fresh SQLite file in a temporary directory, removed
    /// afterwards. The baseline's table, bucket or keys are removed at the
    /// end; the ledger's records stay under tenant bench-<run id>, kept one
    /// hour. Exits 1, naming the row, if any effect ran twice or never.
    Bench(BenchArgs),
    /// Run the payment pipeline across the endpoints of one replicated
    /// deployment while your scripts inject faults; print what happened.
    ///
    /// Each order is delivered twice at once; worker W starts on endpoint
    /// W mod N and a delivery that fails retryably moves to the next one.
    /// The job: a provider-keyed capture (a fake provider that deduplicates
    /// by idempotency key), then an at-most-once receipt. Every completion
    /// a worker saw acknowledged is read back at the end. Prints the
    /// topology, the faults, the deliveries, the effects performed, the
    /// duplicates (orders charged twice or sent two receipts: must be 0),
    /// the acknowledged completions lost, the abandoned receipts and what
    /// was retried. Exits 1 if any duplicate, any lost acknowledgement, or
    /// any order unfinished by the deadline.
    Chaos(ChaosArgs),
    /// Print one effect's record as JSON.
    ///
    /// The key is the displayed form tenant/kind:subject, e.g.
    /// acme/capture:order-123. Exits 3 (and prints null) when the key has
    /// no record. Opens the ledger read-only: it creates, migrates and
    /// writes nothing (a missing database or table is an error), so a role
    /// that may only SELECT can run it.
    Get {
        /// The effect key, tenant/kind:subject.
        key: String,
        #[command(flatten)]
        db: DbArgs,
    },
    /// Show one effect's record for an operator: its state, fence, lease,
    /// timestamps, outcome size, whether a fingerprint is stored, and how
    /// often it was granted.
    ///
    /// The key is tenant/kind:subject. Stored: state, fence, at-most-once,
    /// fingerprint, outcome, created/updated/lease-end/retain-until times.
    /// Derived (nothing counts claims): the class (live, stuck: lease
    /// ended and not at-most-once, abandoned: at-most-once and lease ended,
    /// completed, released) on the backend's clock at the read; "granted":
    /// 1 when the fence equals the first claim's clock in microseconds
    /// (every first claim writes it so), "2 or more" when it is above it
    /// (a takeover of an ended lease, a claim after a release or a forget;
    /// the exact count is not stored), with the latest grant's time read
    /// from the fence. Exits 3 when the key has no record. Read-only, every
    /// backend.
    Inspect {
        /// The effect key, tenant/kind:subject.
        key: String,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        db: DbArgs,
    },
    /// Did this run twice? Every record of a subject, and a verdict.
    ///
    /// Lists the tenant's records (of one kind, one subject, created since
    /// a time: all optional), oldest first, each with what `inspect`
    /// derives, the resolve and forget actions recorded on them, and a
    /// one-line verdict from what is stored: "no" when each record was
    /// granted once; "possibly" when a record was granted again (a
    /// takeover after its lease ended: the work may have started twice).
    /// Duplicates answered from a stored outcome are reads and leave no
    /// record; count them with the oncely_duplicates_suppressed_total
    /// metric. Read-only; SQL backends only.
    History {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// Only this kind (capture).
        #[arg(long)]
        kind: Option<String>,
        /// Only this subject (order-123), in every kind unless --kind.
        #[arg(long)]
        subject: Option<String>,
        /// Only records first claimed at or after this RFC 3339 time
        /// (2026-11-30T08:00:00Z) or date (2026-11-30).
        #[arg(long)]
        since: Option<String>,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        db: DbArgs,
    },
    /// Count records per tenant and kind: live, stuck, abandoned,
    /// completed, released, and the oldest open ones.
    ///
    /// Judged on the backend's clock. Duplicates suppressed are not
    /// stored (a duplicate of a completed effect is a read, not a write):
    /// count them with the oncely_duplicates_suppressed_total metric.
    /// Read-only; SQL backends only.
    Stats {
        #[command(flatten)]
        scope: ScopeArgs,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        db: DbArgs,
    },
    /// List stuck leases: in progress, lease ended, not at-most-once.
    ///
    /// A worker died or stalled and nobody has claimed the key since; the
    /// next delivery takes it over (with fence + 1). Resolve one by hand
    /// with `resolve`. Oldest first. Read-only; SQL backends only.
    Stuck {
        #[command(flatten)]
        scope: ScopeArgs,
        /// Only this kind.
        #[arg(long)]
        kind: Option<String>,
        /// Only records first claimed at or after this RFC 3339 time
        /// (2026-11-30T08:00:00Z) or date (2026-11-30).
        #[arg(long)]
        since: Option<String>,
        /// At most this many records (up to 1000).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// Print a JSON array instead of the table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        db: DbArgs,
    },
    /// List abandoned at-most-once steps as a JSON array.
    ///
    /// An at-most-once step (an email, a push) whose worker died between
    /// marking it attempted and completing it is never re-run
    /// automatically: it may or may not have happened, and someone has to
    /// check (then `resolve` it). This lists them, oldest first, as JSON
    /// (as it always has; --json says so explicitly). One tenant works on
    /// every backend; --all-tenants, --kind and --since need a SQL backend.
    /// Read-only, like `get`.
    Abandoned {
        #[command(flatten)]
        scope: ScopeArgs,
        /// Only this kind.
        #[arg(long)]
        kind: Option<String>,
        /// Only records first claimed at or after this RFC 3339 time
        /// (2026-11-30T08:00:00Z) or date (2026-11-30).
        #[arg(long)]
        since: Option<String>,
        /// At most this many records.
        #[arg(long, default_value_t = 100)]
        limit: u64,
        /// Print JSON (the default and only format of this command).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        db: DbArgs,
    },
    /// Resolve a stuck lease or an abandoned at-most-once step by hand:
    /// complete it with an outcome, or release it so the next delivery of
    /// its message runs it (an oncely consumer holds an abandoned step's
    /// delivery until then; what to replay if none is left is printed).
    ///
    /// A stuck lease is taken over atomically by a claim (granted only if
    /// its lease is still ended; fence + 1), then completed or released
    /// with that lease. An abandoned step is completed or released at its
    /// fence (Record::reconciliation_lease), a fenced write. A live lease,
    /// a completed or released record, or a fence other than --fence is
    /// refused and nothing changes. --completed takes the handler's value
    /// as JSON and stores it as the runners do ({"ok": VALUE}), so
    /// duplicates replay it. Recorded: writes an audit record (kind
    /// oncely-audit, same tenant) and emits a tracing event.
    #[command(group(clap::ArgGroup::new("resolution").required(true).args(["completed", "released"])))]
    Resolve {
        /// The effect key, tenant/kind:subject.
        key: String,
        /// Complete it with this value (JSON), e.g. '{"charge":"ch_1"}'.
        #[arg(long, value_name = "OUTCOME_JSON")]
        completed: Option<String>,
        /// Release it: the next delivery runs the effect.
        #[arg(long)]
        released: bool,
        /// Refuse unless the record is still at this fence (as listed).
        #[arg(long)]
        fence: Option<u64>,
        /// Print one JSON object instead of a line.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        db: DbArgs,
    },
    /// Settle stuck leases and abandoned at-most-once steps by asking a
    /// command of yours about each (like a git hook).
    ///
    /// Lists the tenant's doubtful records (--all-tenants: every
    /// tenant's): stuck leases first, then abandoned steps, oldest first.
    /// For each, runs CHECK through `sh -c` and applies its answer with
    /// fenced writes: a stuck lease is taken over by a claim (fence + 1),
    /// then completed or released; an abandoned step is completed or
    /// released at its fence. A record that moved on meanwhile is left
    /// alone (counted as moved).
    ///
    /// The protocol. The record reaches CHECK only as data, never on its
    /// command line: on stdin, one JSON object and a newline, with key,
    /// tenant, kind, subject, doubt ("stuck" or "abandoned"), fence, state,
    /// at_most_once, created_at, lease_expires_at (RFC 3339 UTC) and
    /// provider_key (the idempotency key the step sent the provider); in
    /// the environment, ONCELY_KEY, ONCELY_DOUBT and ONCELY_PROVIDER_KEY.
    /// CHECK prints exactly one line on stdout:
    ///
    ///   done <JSON>   the effect happened: complete the record with this
    ///                 value, stored as a runner stores a handler's value
    ///                 ({"ok": JSON}), so duplicates replay it (done null
    ///                 for a step that returns nothing);
    ///
    ///   not-done      it certainly did not happen: release the record, the
    ///                 next delivery of its message runs the step (an oncely
    ///                 consumer holds an abandoned step's delivery until
    ///                 then, and dead-letters it with the reason abandoned
    ///                 after its last allowed delivery: replay it from
    ///                 there); the released keys are listed at the end;
    ///
    ///   unknown       the provider cannot tell: write nothing, the record
    ///                 stays listed.
    ///
    /// Any other output, a non-zero exit, or no answer within
    /// --check-timeout (CHECK is then killed) is an error for that record:
    /// nothing is written for it and the run goes on. Log to stderr; its
    /// end is quoted in the error. With --dry-run, CHECK is still asked
    /// (it should only read from the provider) but nothing is written.
    ///
    /// Prints each examined record (key, doubt, fence, verdict, result)
    /// and the totals, or one JSON object with --json. Exits 1 if any
    /// record failed or the listing failed; 2 on bad input, and on Redis
    /// and NATS (they cannot list records: settle known keys with
    /// `resolve`). SQL backends only.
    Reconcile(ReconcileArgs),
    /// Let a completed effect run again, on purpose.
    ///
    /// One fenced write turns the completed record (at its current fence,
    /// or --fence) into a released one without its outcome; the row stays,
    /// so the next delivery takes it over at a higher fence and fences stay
    /// above every earlier one. Refused, changing nothing, when the key has
    /// no record (exit 3), is not completed, or its fence moved. Recorded:
    /// writes an audit record (kind oncely-audit, same tenant) and emits a
    /// tracing event. SQL backends only.
    Forget {
        /// The effect key, tenant/kind:subject.
        key: String,
        /// Refuse unless the record is still at this fence.
        #[arg(long)]
        fence: Option<u64>,
        /// Print one JSON object instead of a line.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        db: DbArgs,
    },
    /// Delete completed and released records past their retention.
    ///
    /// Never deletes a live lease or an unresolved abandoned step. Run it
    /// periodically; each call deletes at most --limit records and prints
    /// how many it deleted. It raises the ledger's horizon (per tenant and
    /// kind) to what it deleted, so a replay of a pruned effect is refused
    /// rather than run again. Uses the existing ledger; creates nothing.
    /// With --dry-run, counts what would go now and deletes nothing
    /// (read-only; SQL backends only).
    Prune {
        /// Delete at most this many records in this call.
        #[arg(long, default_value_t = 10_000)]
        limit: u64,
        /// Records per batch: each batch is one short transaction, so claims
        /// keep their latency while a large backlog goes.
        #[arg(long, default_value_t = 500)]
        batch: u64,
        /// Delete at most this many records per second (default: no limit).
        #[arg(long, value_name = "ROWS_PER_SEC")]
        rate: Option<u64>,
        /// Count the records past retention; delete nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print one JSON object ({"pruned": N} or {"would_prune": N}).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        db: DbArgs,
    },
    /// Create or upgrade the ledger's schema, then print the backend's
    /// guarantees.
    ///
    /// SQL backends create or upgrade their tables and then check them (a
    /// table someone else created without a unique key on the effect key,
    /// or with a case-insensitive key, is refused); NATS creates its KV
    /// bucket (or checks an existing one's settings); Redis checks the
    /// server's eviction policy and needs no schema. With `demo`, the only
    /// command that creates anything.
    Migrate {
        #[command(flatten)]
        db: DbArgs,
    },
    /// Serve the operator web page: stats, stuck and abandoned records, one
    /// record's detail, and the redelivery-gap chart against the retention.
    ///
    /// Server-rendered HTML, no JavaScript. Read-only (the ledger is opened
    /// like `get` does) unless --allow-resolve, which offers a form on stuck
    /// and abandoned records doing what `oncely resolve` does. Listens on
    /// loopback unless
    /// --allow-remote (the page has no authentication). Shows one tenant
    /// (--tenant; any other answers 403) or all (--all-tenants). The gap
    /// chart reads oncely_redelivery_gap_seconds from a consumer's
    /// Prometheus endpoint (--metrics-url): duplicates are not stored in
    /// the ledger. Runs until Ctrl-C.
    Serve(ServeArgs),
}

#[derive(Debug, Args)]
struct DbArgs {
    /// The ledger's database: sqlite:PATH[?table=T],
    /// postgres://USER@HOST/DB[?schema=S&table=T], mysql://USER@HOST/DB[?table=T]
    /// (or mariadb://), redis://HOST:PORT[?prefix=P],
    /// redis+cluster://HOST:PORT,HOST:PORT,..., redis+sentinel://HOST:PORT,.../MASTER,
    /// nats://HOST:PORT[,HOST:PORT...][?bucket=NAME&replicas=1|3] or memory:.
    #[arg(long, env = "ONCELY_DATABASE_URL")]
    database_url: String,
}

/// Which tenants a read covers: one, or every tenant when asked for
/// explicitly.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
struct ScopeArgs {
    /// The tenant whose records to read.
    #[arg(long)]
    tenant: Option<String>,
    /// Read every tenant's records (an operator view across tenants).
    #[arg(long)]
    all_tenants: bool,
}

#[derive(Debug, Args)]
struct ReconcileArgs {
    #[command(flatten)]
    scope: ScopeArgs,
    /// The command to ask about each record, run through `sh -c` (see the
    /// protocol above), e.g. './check-provider.sh'.
    #[arg(long, value_name = "CMD")]
    check: String,
    /// How long CHECK may take for one record before it is killed, with
    /// everything it started (its process group): 500ms, 30s, 5m.
    #[arg(long, default_value = "30s", value_parser = duration_arg)]
    check_timeout: Duration,
    /// Ask, but write nothing: the report says what would be done.
    #[arg(long)]
    dry_run: bool,
    /// Leave alone records whose lease ended less than this long ago, on
    /// the database's clock (a stalled worker may still call the provider):
    /// 30s, 5m, 2h, 1d.
    #[arg(long, default_value = "0s", value_parser = duration_arg)]
    grace: Duration,
    /// Records listed per page.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    batch: u32,
    /// Stop after examining this many records.
    #[arg(long)]
    max: Option<u64>,
    /// At most this many records per second (the provider's rate limit).
    #[arg(long, value_name = "PER_SEC")]
    rate: Option<f64>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DbArgs,
}

fn duration_arg(s: &str) -> Result<Duration, String> {
    reconcile::parse_duration(s).map_err(|e| match e {
        Error::InvalidInput(m) => m,
        other => other.to_string(),
    })
}

#[derive(Debug, Args)]
struct DemoArgs {
    /// How many orders.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    orders: u32,
    /// How many times each order's charge message is delivered.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1000))]
    deliveries: u32,
    /// How many workers consume the deliveries concurrently.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    workers: u32,
    /// Run against this database instead of a temporary SQLite file
    /// (sqlite:PATH?mode=rwc, postgres://USER@HOST/DB, mysql://USER@HOST/DB
    /// or mariadb://, redis://HOST:PORT, redis+cluster://HOST:PORT,HOST:PORT,...,
    /// redis+sentinel://HOST:PORT,.../MASTER[?wait_replicas=N],
    /// nats://HOST:PORT[,HOST:PORT...][?bucket=NAME&replicas=1|3], memory:).
    /// Unlike the other commands, the demo ignores ONCELY_DATABASE_URL: it
    /// writes only where it is told to.
    #[arg(long)]
    database_url: Option<String>,
    /// Print exactly one JSON object on stdout instead of the table (and no
    /// progress bar).
    #[arg(long)]
    json: bool,
    /// Seed of the delivery order, to replay a run's queue (timing still
    /// varies).
    #[arg(long)]
    seed: Option<u64>,
}

#[derive(Debug, Args)]
struct ChaosArgs {
    /// One endpoint (node) of the deployment, as a ledger URL; repeat for
    /// each (--endpoint mysql://root@127.0.0.1:3311/test --endpoint …).
    #[arg(long = "endpoint", required = true, value_name = "URL")]
    endpoints: Vec<String>,
    /// The topology's name in the report.
    #[arg(long, default_value = "unnamed")]
    topology: String,
    /// How many orders (each delivered twice).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    orders: u32,
    /// How many concurrent workers.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    workers: u32,
    /// The steps' lease.
    #[arg(long, default_value = "2s", value_parser = duration_arg)]
    lease: Duration,
    /// A fault: AT=COMMAND, run through `sh -c` AT after the start
    /// (--fault '2s=scripts/galera-cluster.sh kill 2'); repeat for more.
    #[arg(long = "fault", value_name = "AT=COMMAND", value_parser = fault_arg)]
    faults: Vec<chaos::Fault>,
    /// Stop redelivering what has not acked this long after the start.
    #[arg(long, default_value = "120s", value_parser = duration_arg)]
    deadline: Duration,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

fn fault_arg(s: &str) -> Result<chaos::Fault, String> {
    chaos::Fault::parse(s, duration_arg)
}

#[derive(Debug, Args)]
struct BenchArgs {
    /// How many jobs; each is delivered twice.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    jobs: u32,
    /// How many workers send the concurrent deliveries (each has one job's
    /// two deliveries, or one batch's, in flight).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    workers: u32,
    /// Jobs per batch in the batch rows.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    batch: u32,
    /// Run against this database instead of a temporary SQLite file
    /// (sqlite:PATH?mode=rwc, postgres://USER@HOST/DB, mysql://USER@HOST/DB
    /// or mariadb://, redis://HOST:PORT, redis+cluster://HOST:PORT,HOST:PORT,...,
    /// redis+sentinel://HOST:PORT,.../MASTER[?wait_replicas=N],
    /// nats://HOST:PORT[,HOST:PORT...][?bucket=NAME&replicas=1|3], memory:).
    /// Like the demo, the bench ignores ONCELY_DATABASE_URL: it writes only
    /// where it is told to.
    #[arg(long)]
    database_url: Option<String>,
    /// Print exactly one JSON object on stdout instead of the table (and no
    /// progress bar).
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(run(cli.command))
}

async fn run(command: Command) -> ExitCode {
    match command {
        Command::Demo(args) => run_demo(args).await,
        Command::Bench(args) => run_bench(args).await,
        Command::Chaos(args) => run_chaos(args).await,
        Command::Get { key, db } => match ops::get(&db.database_url, &key).await {
            Ok(Read {
                ledger,
                value: Some(record),
            }) => print_json(&Read {
                ledger,
                value: RecordView::from(&record),
            }),
            Ok(Read { ledger, value: None }) => {
                println!("null");
                no_record(&key, &ledger)
            }
            Err(e) => fail(&e),
        },
        Command::Inspect { key, json, db } => match admin::inspect(&db.database_url, &key).await {
            Ok(r @ Read { value: Some(_), .. }) if json => print_json(&r),
            Ok(Read {
                ledger,
                value: Some(i),
            }) => {
                print_inspection(&i, &ledger);
                ExitCode::SUCCESS
            }
            Ok(Read { ledger, value: None }) => {
                if json {
                    println!("null");
                }
                no_record(&key, &ledger)
            }
            Err(e) => fail(&e),
        },
        Command::History {
            tenant,
            kind,
            subject,
            since,
            json,
            db,
        } => {
            let q = admin::HistoryQuery {
                tenant,
                kind,
                subject,
                since,
            };
            match admin::history(&db.database_url, &q).await {
                Ok(h) if json => print_json(&h),
                Ok(h) => {
                    print_history(&h);
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
        Command::Stats { scope, json, db } => {
            let tenant = match admin::scope(scope.tenant.as_deref(), scope.all_tenants) {
                Ok(t) => t,
                Err(e) => return fail(&e),
            };
            match admin::stats(&db.database_url, tenant.as_ref()).await {
                Ok(r) if json => print_json(&r),
                Ok(r) => {
                    print_stats(&r);
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
        Command::Stuck {
            scope,
            kind,
            since,
            limit,
            json,
            db,
        } => {
            let tenant = match admin::scope(scope.tenant.as_deref(), scope.all_tenants) {
                Ok(t) => t,
                Err(e) => return fail(&e),
            };
            let listing = admin::Listing {
                tenant,
                kind,
                since,
                limit,
            };
            match admin::list(&db.database_url, Filter::Stuck, &listing).await {
                Ok(list) if json => {
                    if list.value.is_empty() {
                        eprintln!("no stuck records in {}", list.ledger);
                    }
                    print_json(&list)
                }
                Ok(list) => {
                    print_listing(&list, "stuck");
                    if list.value.len() == limit as usize {
                        eprintln!(
                            "showing the oldest {limit}; there may be more (narrow with --kind or \
                             --since, or raise --limit up to 1000)"
                        );
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
        Command::Abandoned {
            scope,
            kind,
            since,
            limit,
            json: _,
            db,
        } => {
            let tenant = match admin::scope(scope.tenant.as_deref(), scope.all_tenants) {
                Ok(t) => t,
                Err(e) => return fail(&e),
            };
            match ops::abandoned_in(
                &db.database_url,
                tenant.as_ref(),
                kind.as_deref(),
                since.as_deref(),
                limit,
            )
            .await
            {
                Ok(records) => {
                    if records.value.is_empty() {
                        eprintln!("no abandoned records in {}", records.ledger);
                    }
                    print_json(&records.map(|r| r.iter().map(RecordView::from).collect::<Vec<_>>()))
                }
                Err(e) => fail(&e),
            }
        }
        Command::Resolve {
            key,
            completed,
            released: _,
            fence,
            json,
            db,
        } => {
            let resolution = match completed {
                Some(text) => match serde_json::from_str(&text) {
                    Ok(v) => admin::Resolution::Completed(v),
                    Err(e) => {
                        return fail(&Error::InvalidInput(format!(
                            "--completed takes the outcome as JSON (quote strings: '\"sent\"'): {e}"
                        )));
                    }
                },
                None => admin::Resolution::Released,
            };
            match admin::resolve(&db.database_url, &key, &resolution, fence).await {
                Ok(r) => print_action(r, &key, json),
                Err(e) => fail(&e),
            }
        }
        Command::Reconcile(args) => run_reconcile(args).await,
        Command::Forget { key, fence, json, db } => {
            match admin::forget(&db.database_url, &key, fence).await {
                Ok(r) => print_action(r, &key, json),
                Err(e) => fail(&e),
            }
        }
        Command::Prune {
            dry_run: true,
            json,
            db,
            ..
        } => match ops::prune_dry_run(&db.database_url).await {
            Ok(n) if json => print_json(&n.map(|n| serde_json::json!({ "would_prune": n, "dry_run": true }))),
            Ok(Read { ledger, value: n }) => {
                println!(
                    "would prune {n} record{} in {ledger} (dry run: nothing deleted)",
                    if n == 1 { "" } else { "s" }
                );
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        Command::Prune {
            limit,
            batch,
            rate,
            json,
            db,
            ..
        } => {
            let plan = ops::PrunePlan {
                limit,
                batch,
                rows_per_second: rate,
            };
            // A count on stderr while a backlog goes (hidden when stderr is
            // not a terminal, and with --json).
            let bar = if json {
                ProgressBar::hidden()
            } else {
                ProgressBar::with_draw_target(Some(limit), ProgressDrawTarget::stderr())
            };
            bar.set_style(
                ProgressStyle::with_template("pruning {pos}/{len} records ({per_sec}, {elapsed})")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            let pruned = ops::prune(&db.database_url, plan, |rows| bar.inc(rows)).await;
            bar.finish_and_clear();
            match pruned {
                Ok(n) if json => print_json(&n.map(|n| serde_json::json!({ "pruned": n }))),
                Ok(Read { ledger, value: n }) => {
                    println!("pruned {n} record{} from {ledger}", if n == 1 { "" } else { "s" });
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
        Command::Migrate { db } => match ops::migrate(&db.database_url).await {
            Ok(Read {
                ledger,
                value: report,
            }) => {
                println!("{} ledger schema is up to date", report.backend);
                println!("  ledger:               {ledger}");
                println!(
                    "  caller's transaction: {}",
                    if report.caller_transaction { "yes" } else { "no" }
                );
                println!("  durability:           {}", report.durability);
                println!("  clock:                {}", report.clock);
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        Command::Serve(args) => run_serve(args).await,
    }
}

async fn run_serve(args: ServeArgs) -> ExitCode {
    let config = match args.config() {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    let scope = config.scope.to_string();
    let server = match serve::bind(config).await {
        Ok(s) => s,
        Err(e) => return fail(&e),
    };
    match server.local_addr() {
        Ok(addr) => println!(
            "oncely serve: http://{addr}/ ({}, {scope}, {}); Ctrl-C stops it",
            server.ledger(),
            if server.resolves() {
                "resolve allowed"
            } else {
                "read-only"
            }
        ),
        Err(e) => return fail(&e),
    }
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    match server.run(shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

async fn run_demo(args: DemoArgs) -> ExitCode {
    let config = DemoConfig {
        orders: args.orders,
        deliveries_per_order: args.deliveries,
        workers: args.workers as usize,
        database_url: args.database_url.clone(),
        seed: args.seed,
        ..DemoConfig::default()
    };
    let show_bar = !args.json && std::io::stderr().is_terminal();
    let progress = Arc::new(Bar {
        enabled: show_bar,
        bar: Mutex::new(None),
    });
    // On Ctrl-C the demo's future is dropped, which removes its temporary
    // SQLite directories; PostgreSQL and MySQL orders tables of an
    // interrupted run stay.
    let report = tokio::select! {
        r = demo::run(&config, progress.clone()) => match r {
            Ok(r) => r,
            Err(e) => return fail(&e),
        },
        _ = tokio::signal::ctrl_c() => {
            progress.finish(Guard::Naive);
            eprintln!("interrupted");
            return ExitCode::from(130);
        }
    };
    if args.json {
        let _ = print_json(&report);
    } else {
        print_table(&report, args.database_url.is_some() && report.backend != "memory");
    }
    let problems = report.oncely_problems();
    if problems.is_empty() {
        return ExitCode::SUCCESS;
    }
    for p in problems {
        eprintln!("error: {p}");
    }
    ExitCode::from(1)
}

async fn run_reconcile(args: ReconcileArgs) -> ExitCode {
    let tenant = match admin::scope(args.scope.tenant.as_deref(), args.scope.all_tenants) {
        Ok(t) => t,
        Err(e) => return fail(&e),
    };
    let config = ReconcileConfig {
        check_timeout: args.check_timeout,
        dry_run: args.dry_run,
        grace: args.grace,
        batch: args.batch as usize,
        max: args.max,
        rate: args.rate,
        ..ReconcileConfig::new(tenant, args.check)
    };
    // The check runs in a process group of its own, out of the terminal's
    // reach: on Ctrl-C the run's future is dropped, which kills that group.
    let report = tokio::select! {
        r = reconcile::reconcile(&args.db.database_url, &config) => match r {
            Ok(r) => r,
            Err(e) => return fail(&e),
        },
        _ = tokio::signal::ctrl_c() => {
            eprintln!("interrupted");
            return ExitCode::from(130);
        }
    };
    if args.json {
        let code = print_json(&report);
        if code != ExitCode::SUCCESS {
            return code;
        }
    } else {
        print_reconcile(&report);
    }
    let report = &report.value;
    if let Some(why) = &report.aborted {
        eprintln!("error: the run stopped early: {why}");
    }
    if report.errors > 0 {
        eprintln!(
            "error: {} record{} could not be settled (left as they were)",
            report.errors,
            if report.errors == 1 { "" } else { "s" }
        );
    }
    if report.failed() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

fn print_reconcile(read: &Read<ReconcileReport>) {
    let r = &read.value;
    if r.entries.is_empty() {
        println!("no doubtful records in {}", read.ledger);
    } else {
        println!("ledger: {}", read.ledger);
        let mut t = plain_table();
        t.set_header(["key", "doubt", "fence", "verdict", "result", "detail"]);
        for e in &r.entries {
            let detail = match (&e.error, &e.outcome) {
                (Some(err), _) => err.clone(),
                (None, Some(v)) => v.to_string(),
                (None, None) => "-".to_owned(),
            };
            t.add_row([
                e.key.clone(),
                e.doubt.unwrap_or("-").to_owned(),
                e.fence.to_string(),
                e.verdict.unwrap_or("-").to_owned(),
                e.result.to_owned(),
                detail,
            ]);
        }
        println!("{}", padded(t));
    }
    println!(
        "examined {}: completed {}, released {}, unknown {}, moved {}, skipped {}, errors {}{}",
        r.examined,
        r.completed,
        r.released,
        r.unknown,
        r.moved,
        r.skipped,
        r.errors,
        if r.dry_run {
            " (dry run: nothing written)"
        } else {
            ""
        }
    );
    // Released records need a delivery to be performed: say so once per
    // kind of doubt, with the keys.
    for doubt in ["stuck", "abandoned"] {
        let released: Vec<&str> = r
            .entries
            .iter()
            .filter(|e| e.doubt == Some(doubt) && e.next.is_some())
            .map(|e| e.key.as_str())
            .collect();
        if let Some(next) = admin::after_release(doubt).filter(|_| !released.is_empty()) {
            println!("released {doubt} ({}): {next}", released.join(", "));
        }
    }
}

fn print_table(r: &DemoReport, kept: bool) {
    println!(
        "oncely demo: {} orders x {} deliveries = {} deliveries, {} workers, {} ledger (seed {})",
        r.orders, r.deliveries_per_order, r.deliveries, r.workers, r.backend, r.seed
    );
    println!();
    println!("{}", r.table());
    println!();
    if r.naive.duplicate_charges > 0 {
        println!(
            "The naive guard charged {} of {} orders more than once.",
            r.naive.orders_charged_twice, r.orders
        );
    } else {
        println!("The naive guard got lucky this time: no overlapping duplicates. Run it again.");
    }
    if r.oncely_problems().is_empty() {
        println!("oncely charged each order exactly once.");
    }
    if kept {
        println!(
            "Inspect a record: oncely get {}/capture:order-1 --database-url <same URL>",
            r.tenant
        );
    }
}

async fn run_bench(args: BenchArgs) -> ExitCode {
    let config = BenchConfig {
        jobs: args.jobs,
        workers: args.workers as usize,
        batch: args.batch as usize,
        database_url: args.database_url.clone(),
    };
    let progress = Arc::new(Bar {
        enabled: !args.json && std::io::stderr().is_terminal(),
        bar: Mutex::new(None),
    });
    // On Ctrl-C the bench's future is dropped, which removes its temporary
    // SQLite directory; a baseline table, bucket or keys on a server stay
    // (the Redis keys expire within an hour).
    let report = tokio::select! {
        r = bench::run(&config, progress.clone()) => match r {
            Ok(r) => r,
            Err(e) => return fail(&e),
        },
        _ = tokio::signal::ctrl_c() => {
            bench::Progress::finish(progress.as_ref());
            eprintln!("interrupted");
            return ExitCode::from(130);
        }
    };
    if args.json {
        let _ = print_json(&report);
    } else {
        print_bench_table(&report);
    }
    bench_verdict(&report)
}

async fn run_chaos(args: ChaosArgs) -> ExitCode {
    let config = chaos::ChaosConfig {
        endpoints: args.endpoints,
        topology: args.topology,
        orders: args.orders,
        workers: args.workers as usize,
        lease: args.lease,
        faults: args.faults,
        deadline: args.deadline,
    };
    let report = match chaos::run(&config).await {
        Ok(r) => r,
        Err(e) => return fail(&e),
    };
    if args.json {
        let _ = print_json(&report);
    } else {
        let mut t = plain_table();
        t.set_header([
            "topology",
            "faults",
            "deliveries",
            "charges",
            "receipts",
            "duplicates",
            "acked",
            "acked lost",
            "unread",
            "abandoned",
            "unfinished",
        ]);
        t.add_row([
            report.topology.clone(),
            report.faults.len().to_string(),
            report.deliveries.to_string(),
            format!("{} ({} calls)", report.charges, report.provider_calls),
            report.receipts.to_string(),
            report.duplicates.to_string(),
            report.acknowledged.to_string(),
            report.lost.to_string(),
            report.unread.to_string(),
            report.abandoned.len().to_string(),
            report.unfinished.to_string(),
        ]);
        println!("{}", padded(t));
        for f in &report.faults {
            println!(
                "fault at {:.1}s: {} (exit {})",
                f.at_seconds,
                f.command,
                f.exit.map_or("none".to_owned(), |c| c.to_string())
            );
        }
        if !report.retried.is_empty() {
            let retried: Vec<String> = report.retried.iter().map(|(k, n)| format!("{k} {n}")).collect();
            println!("retried: {}", retried.join(", "));
        }
        for key in &report.abandoned {
            println!("abandoned (reconcile it): {key}");
        }
    }
    for g in &report.gave_up {
        eprintln!(
            "order {} unfinished: {} ({})",
            g.order,
            g.error,
            if g.retryable {
                "retryable; the deadline passed"
            } else {
                "not retryable"
            }
        );
    }
    if report.failed() {
        eprintln!(
            "error: {} duplicate(s), {} acknowledged completion(s) lost, {} unread, {} order(s) unfinished",
            report.duplicates, report.lost, report.unread, report.unfinished
        );
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// Exit 1, naming each row, when an effect ran twice (or never) or a
/// delivery got another job's outcome; 0 otherwise.
fn bench_verdict(report: &BenchReport) -> ExitCode {
    let problems = report.problems();
    if problems.is_empty() {
        return ExitCode::SUCCESS;
    }
    for p in problems {
        eprintln!("error: {p}");
    }
    ExitCode::from(1)
}

fn print_bench_table(r: &BenchReport) {
    println!(
        "oncely bench: {} jobs x {} deliveries, {} workers, batches of {}, {} ledger (tenant {})",
        r.jobs, r.deliveries_per_job, r.workers, r.batch, r.backend, r.tenant
    );
    println!("hand-written: {}", r.baseline);
    println!();
    println!("{}", r.table());
    println!();
    println!(
        "claim: one claim or claim_many call (hand-written: its insert, and its read on a duplicate); \
         wake-up: from the first delivery's return to the waiting duplicate's; \
         ratio: deliveries/s over the hand-written row's."
    );
    if r.problems().is_empty() {
        println!("Every effect ran exactly once.");
    }
}

fn print_json<T: serde::Serialize>(value: &T) -> ExitCode {
    match serde_json::to_string(value) {
        Ok(s) => {
            println!("{s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: cannot encode the output as JSON: {e}");
            ExitCode::from(1)
        }
    }
}

/// Prints the error and picks the exit code: 2 for what the caller can fix
/// in the command line, 1 for everything that went wrong at run time.
fn fail(e: &Error) -> ExitCode {
    eprintln!("error: {e}");
    match e {
        Error::InvalidKey { .. }
        | Error::Config(_)
        | Error::Misuse(_)
        | Error::InvalidInput(_)
        | Error::OutcomeTooLarge { .. } => ExitCode::from(2),
        Error::NotFound { .. } => ExitCode::from(3),
        _ => ExitCode::from(1),
    }
}

fn plain_table() -> Table {
    let mut t = Table::new();
    t.load_preset(NOTHING);
    t
}

fn padded(mut t: Table) -> Table {
    for (i, column) in t.column_iter_mut().enumerate() {
        column.set_padding((if i == 0 { 0 } else { 2 }, 0));
    }
    t
}

fn or_dash(v: Option<&str>) -> String {
    v.unwrap_or("-").to_owned()
}

/// "No record" for `key` in `ledger`: the answer of `get`, `inspect`,
/// `resolve` and `forget` (exit 3).
fn no_record(key: &str, ledger: &str) -> ExitCode {
    eprintln!("no record for {key} in {ledger}");
    ExitCode::from(3)
}

fn print_inspection(i: &Inspection, ledger: &str) {
    let r = &i.record;
    let mut t = plain_table();
    let lease = match i.lease_left_seconds {
        Some(s) if s > 0.0 => format!("{} (ends in {s:.1} s)", or_dash(r.lease_expires_at.as_deref())),
        Some(s) => format!(
            "{} (ended {:.1} s ago)",
            or_dash(r.lease_expires_at.as_deref()),
            -s
        ),
        None => "-".to_owned(),
    };
    let granted = match &i.claims.latest_grant_at {
        Some(at) => format!("{} (derived from the fence; latest grant {at})", i.claims.grants),
        None => format!("{} (derived from the fence)", i.claims.grants),
    };
    for (k, v) in [
        ("ledger", ledger.to_owned()),
        ("key", r.key.clone()),
        ("state", format!("{} (stored {})", i.class, r.state)),
        ("fence", r.fence.to_string()),
        ("granted", granted),
        ("at-most-once", r.at_most_once.to_string()),
        ("created", r.created_at.clone()),
        ("updated", r.updated_at.clone()),
        ("lease", lease),
        ("retain until", r.retain_until.clone()),
        (
            "outcome",
            i.outcome_bytes.map_or("-".to_owned(), |n| format!("{n} bytes")),
        ),
        (
            "fingerprint",
            if i.fingerprint_present { "stored" } else { "none" }.to_owned(),
        ),
        ("provider key", r.provider_key.clone()),
        ("read at", i.read_at.clone()),
    ] {
        t.add_row([k.to_owned(), v]);
    }
    println!("{}", padded(t));
}

fn print_listing(read: &Read<Vec<Inspection>>, what: &str) {
    let list = &read.value;
    if list.is_empty() {
        println!("no {what} records in {}", read.ledger);
        return;
    }
    println!("ledger: {}", read.ledger);
    let mut t = plain_table();
    t.set_header(["key", "state", "fence", "granted", "created", "lease ended"]);
    for i in list {
        t.add_row([
            i.record.key.clone(),
            i.class.to_owned(),
            i.record.fence.to_string(),
            i.claims.grants.to_owned(),
            i.record.created_at.clone(),
            or_dash(i.record.lease_expires_at.as_deref()),
        ]);
    }
    println!("{}", padded(t));
}

fn print_history(read: &Read<History>) {
    let h = &read.value;
    println!("ledger: {}", read.ledger);
    if !h.records.is_empty() {
        let mut t = plain_table();
        t.set_header([
            "key", "state", "fence", "granted", "created", "updated", "outcome",
        ]);
        for i in &h.records {
            t.add_row([
                i.record.key.clone(),
                i.class.to_owned(),
                i.record.fence.to_string(),
                i.claims.grants.to_owned(),
                i.record.created_at.clone(),
                i.record.updated_at.clone(),
                i.outcome_bytes.map_or("-".to_owned(), |n| format!("{n} B")),
            ]);
        }
        println!("{}", padded(t));
    }
    for a in &h.audits {
        println!(
            "recorded: {} of {} at fence {} ({})",
            a.entry["action"].as_str().unwrap_or("?"),
            a.entry["key"].as_str().unwrap_or("?"),
            a.entry["fence"],
            a.entry["at"].as_str().unwrap_or("?")
        );
    }
    println!("verdict: {}", h.verdict);
}

fn print_stats(read: &Read<StatsReport>) {
    let r = &read.value;
    if r.kinds.is_empty() {
        println!("no records in {}", read.ledger);
    } else {
        println!("ledger: {}", read.ledger);
        let mut t = plain_table();
        t.set_header([
            "tenant",
            "kind",
            "live",
            "stuck",
            "abandoned",
            "completed",
            "released",
            "oldest live",
            "oldest stuck",
            "oldest abandoned",
        ]);
        for k in &r.kinds {
            t.add_row([
                k.tenant.clone(),
                k.kind.clone(),
                k.live.to_string(),
                k.stuck.to_string(),
                k.abandoned.to_string(),
                k.completed.to_string(),
                k.released.to_string(),
                or_dash(k.oldest_live.as_deref()),
                or_dash(k.oldest_stuck.as_deref()),
                or_dash(k.oldest_abandoned.as_deref()),
            ]);
        }
        println!("{}", padded(t));
    }
    println!("note: {}", r.note);
}

/// What `resolve` or `forget` did, or "no record" (nothing written).
fn print_action(read: Read<Option<ActionReport>>, key: &str, json: bool) -> ExitCode {
    let Some(r) = read.value else {
        if json {
            println!("null");
        }
        return no_record(key, &read.ledger);
    };
    if json {
        return print_json(&Read {
            ledger: read.ledger,
            value: r,
        });
    }
    println!(
        "{}: {} in {} was {} at fence {}, now {} (fence {}); recorded as {}",
        r.action, r.key, read.ledger, r.was, r.fence, r.now, r.new_fence, r.audit_key
    );
    if let Some(next) = r.next {
        println!("next: {next}");
    }
    ExitCode::SUCCESS
}

/// The demo's progress bar on stderr, one per run; drawn only on a terminal.
struct Bar {
    enabled: bool,
    bar: Mutex<Option<ProgressBar>>,
}

impl Progress for Bar {
    fn start(&self, guard: Guard, deliveries: u64) {
        if !self.enabled {
            return;
        }
        let bar = ProgressBar::with_draw_target(Some(deliveries), ProgressDrawTarget::stderr());
        if let Ok(style) =
            ProgressStyle::with_template("{prefix:>7} [{bar:40}] {pos}/{len} deliveries {elapsed}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(guard.name());
        *self.bar.lock().unwrap_or_else(|p| p.into_inner()) = Some(bar);
    }

    fn delivered(&self) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            bar.inc(1);
        }
    }

    fn finish(&self, _guard: Guard) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).take() {
            bar.finish_and_clear();
        }
    }
}

/// The bench's progress bar: one per row, drawn only on a terminal.
impl bench::Progress for Bar {
    fn start(&self, row: &str, deliveries: u64) {
        if !self.enabled {
            return;
        }
        let bar = ProgressBar::with_draw_target(Some(deliveries), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template("{prefix:>38} [{bar:30}] {pos}/{len} {elapsed}") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(row.to_owned());
        *self.bar.lock().unwrap_or_else(|p| p.into_inner()) = Some(bar);
    }

    fn delivered(&self, n: u64) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            bar.inc(n);
        }
    }

    fn finish(&self) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).take() {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oncely_cli::bench::{Guard, Latency, Mode, Policy, RowReport};

    fn row(effects: u64, twice: u64) -> RowReport {
        RowReport {
            name: "concurrent, single, oncely Wait".to_owned(),
            mode: Mode::Concurrent,
            batch: 1,
            guard: Guard::Oncely(Policy::Wait),
            policy: Some(Policy::Wait),
            jobs: 200,
            deliveries: 400,
            seconds: 0.5,
            deliveries_per_sec: 800.0,
            claim_calls: 420,
            claim_latency: Latency::of(vec![std::time::Duration::from_micros(250); 420]),
            in_progress_answers: 20,
            waiters: 20,
            wake_up_latency: Latency::of(vec![std::time::Duration::from_micros(90); 20]),
            rejected: 0,
            retries: 0,
            effects,
            jobs_run_twice: twice,
            jobs_not_run: 0,
            wrong_outcomes: 0,
            ratio: Some(0.7),
        }
    }

    fn report(row: RowReport) -> BenchReport {
        BenchReport {
            backend: "memory",
            jobs: 200,
            deliveries_per_job: 2,
            workers: 8,
            batch: 100,
            tenant: "bench-test".to_owned(),
            baseline: "a mutex-guarded map",
            rows: vec![row],
        }
    }

    #[test]
    fn a_report_with_a_duplicate_effect_fails_the_command() {
        assert_eq!(bench_verdict(&report(row(200, 0))), ExitCode::SUCCESS);
        assert_eq!(bench_verdict(&report(row(201, 1))), ExitCode::from(1));
    }
}

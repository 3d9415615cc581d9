//! # oncely-cli
//!
//! The `oncely` command and the pieces behind it. The binary parses the
//! command line and calls the command's module in [`commands`]; everything
//! it runs lives in this library:
//!
//! - [`demo`]: the double-charge demo (`oncely demo`): concurrent
//!   redeliveries of a "charge" message, processed once with a naive
//!   status-check guard and once with [`oncely::Effects::run`], on a real
//!   database. It returns a [`demo::DemoReport`].
//! - [`oncely_bench`] (its own crate, `oncely-bench`): the duplicate-storm
//!   bench (`oncely bench`): every job delivered twice, one delivery after
//!   the other and both at once, with single claims and batches, under
//!   oncely's `Wait` and `Reject` policies, each next to the hand-written
//!   minimum on the same database. It returns an
//!   [`oncely_bench::BenchReport`]; [`commands::bench`] prints it.
//! - [`commands`]: one module per command (`oncely get`, `inspect`,
//!   `history`, `stats`, `stuck`, `abandoned`, `resolve`, `forget`,
//!   `prune`, `migrate`, and the command lines of the others): its clap
//!   arguments, its run, and how its answer is printed. What they share:
//!   [`read`] (opening the ledger, the answer naming it), [`view`] (records
//!   as printed), [`audit`] (`resolve` and `forget` are recorded in the
//!   ledger as audit records) and [`time`] (RFC 3339).
//! - [`serve`]: the operator web page (`oncely serve`): stats, stuck and
//!   abandoned records, one record, and the redelivery-gap chart against
//!   the retention, rendered on the server.
//! - [`reconcile`](mod@reconcile): `oncely reconcile`, which settles stuck
//!   leases and abandoned steps by asking an external command about each
//!   ([`reconcile::CheckCommand`], a [`oncely::reconcile::Reconciler`]).
//! - [`AnyLedger`] (the `oncely-any` crate, re-exported here): one
//!   [`oncely::backend::Ledger`] whose backend is picked from a database URL
//!   at run time, like sqlx's `Any` driver.
//!
//! ```text
//! $ cargo run --release -p oncely-cli -- demo
//! $ oncely demo --database-url mysql://root@127.0.0.1:3306/test
//! $ oncely bench --database-url postgres://postgres@127.0.0.1/test --jobs 5000 --json
//! $ oncely get acme/capture:order-123 --database-url sqlite:ledger.db
//! $ oncely abandoned --tenant acme --database-url postgres://localhost/app
//! $ oncely prune --limit 10000 --database-url 'nats://n1:4222,n2:4222,n3:4222?replicas=3'
//! $ oncely migrate --database-url redis+cluster://10.0.0.1:7000,10.0.0.2:7000
//! $ export ONCELY_DATABASE_URL=postgres://localhost/app
//! $ oncely history --tenant acme --subject order-123     # did this run twice?
//! $ oncely stats --all-tenants --json
//! $ oncely resolve acme/receipt:order-123 --released     # recorded as an audit record
//! $ oncely serve --database-url postgres://localhost/app --tenant acme --metrics-url http://127.0.0.1:9000/metrics
//! $ oncely reconcile --tenant acme --check ./check-provider.sh --grace 10m --dry-run
//! ```
//!
//! Exit codes: 0 success, 1 runtime failure (database unreachable, backend
//! error, a demo in which oncely charged twice, a bench row in which an
//! effect ran twice, a resolve or forget refused by the record's state or
//! fence, a reconcile that could not settle a record), 2 usage error (bad
//! arguments, an invalid key or tenant, an unknown URL scheme, a command the
//! backend does not offer), 3 `get`, `inspect`, `resolve` or `forget` found
//! no record.
//!
//! ```no_run
//! use oncely::{ClaimOptions, EffectKey, Effects, Tenant};
//! use oncely_cli::AnyLedger;
//!
//! # async fn example() -> oncely::Result<()> {
//! let ledger = AnyLedger::connect("sqlite://ledger.db?mode=rwc").await?;
//! let effects = Effects::new(ledger);
//! let key = EffectKey::new(&Tenant::new("acme")?, "capture", "order-123")?;
//! let charge: String = effects
//!     .run(&key, &ClaimOptions::default(), |lease| async move {
//!         Ok(format!("charged with idempotency key {}", lease.provider_key()))
//!     })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! | URL | backend | cargo feature |
//! | --- | --- | --- |
//! | `sqlite:path[?table=T]`, `sqlite://path` | `oncely-sqlite` | `sqlite` (default) |
//! | `postgres://…[?schema=S&table=T]`, `postgresql://…` | `oncely-postgres` | `postgres` (default) |
//! | `mysql://…/db[?table=T]`, `mariadb://…` | `oncely-mysql` | `mysql` (default) |
//! | `redis://host:port[/db][?prefix=P]` | `oncely-redis`, one server | `redis` (default) |
//! | `redis+cluster://h1:p1,h2:p2,…[?prefix=P]` | `oncely-redis`, Redis Cluster (seed nodes) | `redis` (default) |
//! | `redis+sentinel://s1:p1,s2:p2,…/master[/db][?prefix=P&wait_replicas=N]` | `oncely-redis`, the primary Sentinel names | `redis` (default) |
//! | `nats://h1:p1[,h2:p2,…][?bucket=B&replicas=1\|3]` | `oncely-nats` (JetStream KV) | `nats` (default) |
//! | `memory:` | the core's in-process ledger, empty on every connect | always |
//!
//! The URL names the whole ledger (its table, key prefix or bucket); an
//! unknown query parameter is a usage error naming it. Every command's
//! answer says which ledger it read ([`read::Read`]): a `ledger: …` line
//! above a listing, `no record for KEY in …`, a `ledger` field in `--json`.
//! See [`oncely_any`] for the multi-node syntax. A Redis server (or cluster) that
//! persists nothing (`appendonly no`, no `save` points) is refused by the
//! commands that write, `demo`, `bench` and `migrate` included, unless the
//! URL accepts it with `?ephemeral=true`
//! (`redis://127.0.0.1:6379?ephemeral=true`): a restart would forget every
//! record. The commands that only read (`get`, `inspect`, `abandoned`,
//! `serve`, …) open it without. `oncely migrate` prints what the server
//! keeps (durability), for every backend. The demo keeps its orders table in
//! the ledger's database on SQLite, PostgreSQL and MySQL, and in a scratch
//! SQLite file on Redis, NATS and `memory:`. A backend left out of the build
//! (`--no-default-features --features sqlite`) is a clear usage error when
//! its URL is given.
#![forbid(unsafe_code)]
#![deny(missing_docs)]
// The commands' futures nest deep (a command's run over AnyLedger's
// dispatch over each backend's operation): the release build computes
// their layout past the default limit ("queries overflow the depth limit",
// first seen on audit::write once AnyLedger moved to oncely-any).
#![recursion_limit = "256"]

pub mod audit;
pub mod chaos;
pub mod commands;
pub mod demo;
pub mod read;
pub mod reconcile;
pub mod serve;
pub mod time;
pub mod view;

pub use oncely_any::{Access, AnyLedger, AnyPool, Scheme};

//! # oncely-cli
//!
//! The `oncely` command and the pieces behind it. The binary parses
//! arguments and prints; everything it runs lives in this library and
//! returns data:
//!
//! - [`demo`]: the double-charge demo (`oncely demo`): concurrent
//!   redeliveries of a "charge" message, processed once with a naive
//!   status-check guard and once with [`oncely::Effects::run`], on a real
//!   database. It returns a [`demo::DemoReport`].
//! - [`ops`]: the operator commands (`oncely get`, `abandoned`, `prune`,
//!   `migrate`).
//! - [`AnyLedger`]: one [`oncely::Ledger`] whose backend is picked from a
//!   database URL at run time, like sqlx's `Any` driver.
//!
//! ```text
//! $ cargo run --release -p oncely-cli -- demo
//! $ oncely get acme/capture:order-123 --database-url sqlite:ledger.db
//! $ oncely abandoned --tenant acme --database-url postgres://localhost/app
//! $ oncely prune --limit 10000 --database-url postgres://localhost/app
//! ```
//!
//! Exit codes: 0 success, 1 runtime failure (database unreachable, backend
//! error, a demo in which oncely charged twice), 2 usage error (bad
//! arguments, an invalid key or tenant, an unknown URL scheme), 3 `get`
//! found no record.
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
//! | `sqlite:path`, `sqlite://path` | `oncely-sqlite` | `sqlite` (default) |
//! | `postgres://…`, `postgresql://…` | `oncely-postgres` | `postgres` (default) |
//! | `memory:` | the core's in-process ledger, empty on every connect | always |
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod any;
pub mod demo;
pub mod ops;

pub use any::{AnyLedger, AnyPool, Scheme};

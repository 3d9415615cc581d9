//! [`Admin`] on an [`AnyLedger`]: the backends that implement it (SQLite,
//! PostgreSQL, MySQL, memory) answer; Redis and NATS are refused when the
//! page starts, before anything connects.

use oncely::admin::{Admin, KindStats, RecordQuery};
use oncely::{Error, Record, Result, Tenant};

use crate::any::{AnyLedger, Scheme};

/// Refuses the backends without [`Admin`], naming why.
pub(crate) fn check_scheme(scheme: Scheme) -> Result<()> {
    match scheme {
        Scheme::Redis | Scheme::Nats => Err(no_admin(scheme)),
        _ => Ok(()),
    }
}

fn no_admin(scheme: Scheme) -> Error {
    Error::Config(format!(
        "oncely serve lists and counts records, which the {scheme} backend cannot do (its store has \
         no index by tenant and kind); use a SQLite, PostgreSQL or MySQL ledger"
    ))
}

macro_rules! admin {
    ($ledger:expr, $l:ident => $body:expr) => {
        match $ledger {
            #[cfg(feature = "sqlite")]
            AnyLedger::Sqlite($l) => $body,
            #[cfg(feature = "postgres")]
            AnyLedger::Postgres($l) => $body,
            #[cfg(feature = "mysql")]
            AnyLedger::MySql($l) => $body,
            AnyLedger::Memory($l) => $body,
            #[allow(unreachable_patterns)]
            other => Err(no_admin(other.scheme())),
        }
    };
}

/// [`Admin::records`] on whichever backend.
pub(crate) async fn records(ledger: &AnyLedger, query: &RecordQuery) -> Result<Vec<Record>> {
    admin!(ledger, l => l.records(query).await)
}

/// [`Admin::stats`] on whichever backend.
pub(crate) async fn stats(ledger: &AnyLedger, tenant: Option<&Tenant>) -> Result<Vec<KindStats>> {
    admin!(ledger, l => l.stats(tenant).await)
}

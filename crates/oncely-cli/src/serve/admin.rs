//! The page needs [`Admin`](oncely::admin::Admin) (listings and counts),
//! which [`AnyLedger`](crate::AnyLedger) offers on SQLite, PostgreSQL,
//! MySQL and memory; Redis and NATS are refused when the page starts,
//! before anything connects, rather than on every page.

use oncely::{Error, Result};
use oncely_any::Scheme;

/// Refuses the backends without [`Admin`], naming why.
pub(crate) fn check_scheme(scheme: Scheme) -> Result<()> {
    if scheme.has_admin() {
        Ok(())
    } else {
        Err(no_admin(scheme))
    }
}

fn no_admin(scheme: Scheme) -> Error {
    Error::Config(format!(
        "oncely serve lists and counts records, which the {scheme} backend cannot do (its store has \
         no index by tenant and kind); use a SQLite, PostgreSQL or MySQL ledger"
    ))
}

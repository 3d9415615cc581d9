//! The fenced writes of a lease: complete, release, renew.

use oncely::EffectKey;
use oncely::backend::Outcome;

use super::{Bound, Statements, query};

/// The fenced writes: no rows; the callers read `rows_affected` (sqlx sets
/// CLIENT_FOUND_ROWS, so it is the number of rows matched). `in_caller_tx`
/// is the leaked-transaction guard's parameter: true on a caller's
/// transaction.
impl Statements {
    /// [`Statements::complete`]: `outcome` for the lease of `key` at `fence`.
    pub(crate) fn bind_complete(
        &self,
        outcome: &Outcome,
        key: &EffectKey,
        fence: u64,
        in_caller_tx: bool,
    ) -> Bound {
        query(&self.complete)
            .bind(outcome.as_bytes())
            .bind(key.as_str())
            .bind(fence)
            .bind(in_caller_tx)
    }

    /// [`Statements::release`] of the lease of `key` at `fence`.
    pub(crate) fn bind_release(&self, key: &EffectKey, fence: u64, in_caller_tx: bool) -> Bound {
        query(&self.release)
            .bind(key.as_str())
            .bind(fence)
            .bind(in_caller_tx)
    }

    /// [`Statements::renew`]: the lease of `key` at `fence` until
    /// `extend_us` from now, reported as `last_insert_id`.
    pub(crate) fn bind_renew(
        &self,
        extend_us: i64,
        key: &EffectKey,
        fence: u64,
        in_caller_tx: bool,
    ) -> Bound {
        query(&self.renew)
            .bind(extend_us)
            .bind(key.as_str())
            .bind(fence)
            .bind(in_caller_tx)
    }
}

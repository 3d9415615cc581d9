//! The claim of one key (with and without `RETURNING`, with and without
//! the horizon), the read that precedes it and the read-back that follows
//! it; and the claim's own fenced writes on a fresh grant (refresh, undo).

use oncely::{ClaimOptions, EffectKey};

use super::{Bound, Statements, claim_values, query};

/// The claim's statements: their rows are [`Stored`](super::Stored) rows.
impl Statements {
    /// [`Statements::peek`] of `key`: a [`Stored`](super::Stored) row with `in_tx`, or none.
    pub(crate) fn bind_peek(&self, key: &EffectKey) -> Bound {
        query(&self.peek).bind(key.as_str())
    }

    /// [`Statements::read_back`] of `key`: a [`Stored`](super::Stored) row with `in_tx`, or
    /// none.
    pub(crate) fn bind_read_back(&self, key: &EffectKey) -> Bound {
        query(&self.read_back).bind(key.as_str())
    }

    /// [`Statements::read_back_h`] of `key`: a [`Stored`](super::Stored) row with `in_tx`
    /// and `horizon_us`, or none.
    pub(crate) fn bind_read_back_h(&self, key: &EffectKey) -> Bound {
        query(&self.read_back_h).bind(key.as_str())
    }

    /// The claim of `key` with `token`, without `sent_at`: with `returning`
    /// ([`Statements::claim_returning`]) one [`Stored`](super::Stored) row with `in_tx`;
    /// without ([`Statements::claim`]) no row (read it back with
    /// [`Statements::bind_read_back`]).
    pub(crate) fn bind_claim(
        &self,
        returning: bool,
        key: &EffectKey,
        opts: &ClaimOptions,
        token: &[u8; 16],
    ) -> Bound {
        let text = if returning {
            &self.claim_returning
        } else {
            &self.claim
        };
        claim_values(query(text), key, opts, token)
    }

    /// The claim of `key` with `token` and the horizon after the write, no
    /// pre-check: with `returning` ([`Statements::claim_returning_h`]) one
    /// [`Stored`](super::Stored) row with `in_tx` and `horizon_us`; without
    /// ([`Statements::claim`]) no row (read it back with
    /// [`Statements::bind_read_back_h`]).
    pub(crate) fn bind_claim_h(
        &self,
        returning: bool,
        key: &EffectKey,
        opts: &ClaimOptions,
        token: &[u8; 16],
    ) -> Bound {
        let text = if returning {
            &self.claim_returning_h
        } else {
            &self.claim
        };
        claim_values(query(text), key, opts, token)
    }

    /// The claim of `key` with `token` that inserts only after the horizon
    /// (`sent_us`): the claim's ten parameters, then the guard
    /// (`in_caller_tx`), the key's tenant and kind, `sent_us`. With
    /// `returning` ([`Statements::claim_pre_returning_h`]) one [`Stored`](super::Stored)
    /// row with `in_tx` and `horizon_us`, none when refused; without
    /// ([`Statements::claim_pre`]) no row, and 0 rows affected when refused.
    pub(crate) fn bind_claim_pre(
        &self,
        returning: bool,
        key: &EffectKey,
        opts: &ClaimOptions,
        token: &[u8; 16],
        in_caller_tx: bool,
        sent_us: i64,
    ) -> Bound {
        let text = if returning {
            &self.claim_pre_returning_h
        } else {
            &self.claim_pre
        };
        claim_values(query(text), key, opts, token)
            .bind(in_caller_tx)
            .bind(key.tenant().as_str())
            .bind(key.kind())
            .bind(sent_us)
    }
}

/// The claim's fenced writes on its own fresh grant: no rows, as
/// [`Statements::bind_complete`]'s.
impl Statements {
    /// [`Statements::refresh`]: a new expiry `lease_us` from now for the
    /// fresh grant of `key` held by `token` at `fence`.
    pub(crate) fn bind_refresh(
        &self,
        lease_us: i64,
        key: &EffectKey,
        token: &[u8; 16],
        fence: u64,
        in_caller_tx: bool,
    ) -> Bound {
        query(&self.refresh)
            .bind(lease_us)
            .bind(key.as_str())
            .bind(&token[..])
            .bind(fence)
            .bind(in_caller_tx)
    }

    /// [`Statements::undo`]: deletes the fresh row of `key` held by `token`
    /// at `fence`.
    pub(crate) fn bind_undo(
        &self,
        key: &EffectKey,
        token: &[u8; 16],
        fence: u64,
        in_caller_tx: bool,
    ) -> Bound {
        query(&self.undo)
            .bind(key.as_str())
            .bind(&token[..])
            .bind(fence)
            .bind(in_caller_tx)
    }
}

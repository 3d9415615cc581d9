//! The claim token: 16 random bytes each claim call writes into the row it
//! inserts or takes over, in the same statement, so that a claim whose
//! answer was lost (the connection died during the statement or its
//! commit, or no answer came in time) can recognise its own row on a new
//! connection (`PgLedger::resolve_claim`) instead of taking itself for
//! another holder, or claiming blind.
//!
//! Only equality matters: a token is never read back as anything but "this
//! row was written by this call". 128 bits from the operating system's
//! generator, so two calls' tokens never meet in practice. The statement
//! stores it followed by its transaction's id, which ties it to the row
//! version it wrote (`sql.rs`, `token_written` and `own`).

use std::sync::atomic::{AtomicBool, Ordering};

use oncely::{Error, Result};

use crate::error::BACKEND;

/// One claim call's token (see the module docs).
#[derive(Clone, Copy)]
pub(crate) struct Token([u8; 16]);

impl Token {
    /// A fresh token. Fails (retryable) only if the operating system gives
    /// no randomness.
    pub(crate) fn new() -> Result<Token> {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes).map_err(|e| Error::Backend {
            backend: BACKEND,
            message: format!("no random bytes for the claim token: {e}"),
            retryable: true,
        })?;
        Ok(Token(bytes))
    }

    /// The bytes bound to the claim statement.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// One claim call: its token, and whether its statement has been handed to
/// a connection (from then on an error may hide a write that committed, so
/// a lost answer is resolved; before, nothing was written).
pub(crate) struct Attempt {
    token: Token,
    sent: AtomicBool,
}

impl Attempt {
    /// A call with a fresh token.
    pub(crate) fn new() -> Result<Attempt> {
        Ok(Attempt {
            token: Token::new()?,
            sent: AtomicBool::new(false),
        })
    }

    /// The same call again (the same token), nothing sent yet: a
    /// resolution's run of the claim statement.
    pub(crate) fn again(&self) -> Attempt {
        Attempt {
            token: self.token,
            sent: AtomicBool::new(false),
        }
    }

    pub(crate) fn token(&self) -> &Token {
        &self.token
    }

    /// Records that the statement is being sent.
    pub(crate) fn sending(&self) {
        self.sent.store(true, Ordering::Relaxed);
    }

    /// Whether a statement was sent.
    pub(crate) fn sent(&self) -> bool {
        self.sent.load(Ordering::Relaxed)
    }
}

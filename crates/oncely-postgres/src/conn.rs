//! A pooled connection bounded by its operation's deadline, shared by the
//! ledger's operations and the announcer (`notify.rs`).

use std::time::Instant;

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, Postgres};

/// A pooled connection that is closed, not returned to the pool, when it
/// is dropped at or past its operation's deadline: the operation timed out
/// with a statement in flight, and the pool's check of a returned
/// connection (a ping, which waits for that statement's answer) would hang
/// on a server that stopped answering, holding a pool slot forever.
pub(crate) struct Conn {
    conn: PoolConnection<Postgres>,
    deadline: Option<Instant>,
}

impl Conn {
    pub(crate) fn new(conn: PoolConnection<Postgres>, deadline: Option<Instant>) -> Self {
        Conn { conn, deadline }
    }
}

impl std::ops::Deref for Conn {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl std::ops::DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            self.conn.close_on_drop();
        }
    }
}

//! Driver errors and unexpected replies mapped to the core's errors: no
//! driver type crosses the API.

use oncely::Error;
use redis::{ErrorKind, RedisError, ServerErrorKind};

/// The backend's name in errors and [`Ledger::backend`](oncely::backend::Ledger::backend).
pub(crate) const BACKEND: &str = "redis";

/// Maps a driver error to the core's.
pub(crate) fn map_err(e: RedisError) -> Error {
    let message = e.to_string();
    if e.is_connection_refusal()
        || e.is_connection_dropped()
        || matches!(e.kind(), ErrorKind::ClusterConnectionNotFound)
    {
        return Error::Unavailable {
            backend: BACKEND,
            message,
        };
    }
    if e.is_timeout() {
        return Error::Backend {
            backend: BACKEND,
            message,
            retryable: true,
        };
    }
    let retryable = match e.kind() {
        ErrorKind::Io => true,
        ErrorKind::Server(
            ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::BusyLoading
            | ServerErrorKind::ReadOnly
            | ServerErrorKind::Moved
            | ServerErrorKind::Ask,
        ) => true,
        _ => e.code() == Some("BUSY"),
    };
    Error::Backend {
        backend: BACKEND,
        message,
        retryable,
    }
}

/// A task of ours (a cluster claim, a prune check) that panicked or was
/// cancelled with its runtime: the operation may or may not have been
/// applied, like a dropped request, so the caller may retry.
pub(crate) fn task_failed(what: &str, e: tokio::task::JoinError) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("{what} did not finish: {e}"),
        retryable: true,
    }
}

/// A script reply this crate does not know: a bug, or scripts and code of
/// different versions.
pub(crate) fn unexpected(what: &str) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("unexpected script reply {what:?}"),
        retryable: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_errors_map_to_core_errors() {
        let refused: RedisError = std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
        assert!(matches!(map_err(refused), Error::Unavailable { .. }));
        let timeout: RedisError = std::io::Error::from(std::io::ErrorKind::TimedOut).into();
        assert!(matches!(map_err(timeout), Error::Backend { retryable: true, .. }));
        let parse: RedisError = (ErrorKind::Parse, "garbage").into();
        assert!(matches!(map_err(parse), Error::Backend { retryable: false, .. }));
    }
}

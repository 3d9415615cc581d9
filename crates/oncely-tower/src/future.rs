//! [`ResponseFuture`]: the future [`Idempotency`](crate::Idempotency) returns.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;

type BoxFuture<B, E> = Pin<Box<dyn Future<Output = Result<Response<B>, E>> + Send>>;

/// The response future of [`Idempotency`](crate::Idempotency): the inner
/// service's response, its replay, or the layer's own answer.
///
/// Dropping it (a client that hangs up) does not cancel a handler that
/// already started: that runs to the end in a task of its own, so its
/// response is stored for the client's retry.
pub struct ResponseFuture<B, E> {
    inner: BoxFuture<B, E>,
}

impl<B, E> ResponseFuture<B, E> {
    pub(crate) fn new(inner: BoxFuture<B, E>) -> Self {
        ResponseFuture { inner }
    }
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<B>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<B, E> std::fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

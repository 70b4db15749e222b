//! The HTTP accept loop, with the timeouts that keep slow and idle connections from holding the
//! server: a connection must send a request's headers within `[limits] header_read_timeout_ms`
//! of starting to wait for them (a new connection, even one that sends nothing at all, or a
//! kept-alive one between requests), and a
//! request's body must arrive whole within `body_read_timeout_ms` of its headers (a deadline,
//! not an idle timer, so a body trickled a byte a second is cut off too: 408
//! `request_timeout`). HTTP/1.1 and HTTP/2 (by preface or ALPN) on one port, plain or TLS
//! ([`crate::tls`] hands its connections in as a listener). Shutdown stops accepting, then
//! lets open connections finish what they serve.
//! Not here: gRPC (tonic serves its own port, HTTP/2 with its own keepalive).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tower::ServiceExt;

/// The timeouts of one port.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub header_read: Duration,
    pub body_read: Duration,
}

/// Serves `app` on `listener` until `shutdown` resolves, then waits for the open connections.
pub async fn serve<L>(
    mut listener: L,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    timeouts: Timeouts,
) where
    L: axum::serve::Listener,
{
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(timeouts.header_read);
    builder.http2().timer(TokioTimer::new());
    let body_read = timeouts.body_read;
    let app = app.layer(axum::middleware::from_fn(
        move |request: Request, next: axum::middleware::Next| {
            let request = request.map(|body| Body::new(DeadlineBody::new(body, body_read)));
            next.run(request)
        },
    ));
    tokio::pin!(shutdown);
    loop {
        let (io, _) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(
            app.clone()
                .map_request(|r: Request<hyper::body::Incoming>| r.map(Body::new)),
        );
        // The protocol is told by the first bytes (HTTP/2 preface or not), before hyper's
        // header timer runs: a connection that sends nothing is closed by this deadline.
        let io = FirstByteDeadline::new(io, timeouts.header_read);
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(io), service)
            .into_owned();
        let watched = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = watched.await {
                tracing::debug!(target: "rampart::http", error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// A connection that fails its reads when its first byte has not come within the deadline.
struct FirstByteDeadline<I> {
    io: I,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<I> FirstByteDeadline<I> {
    fn new(io: I, limit: Duration) -> Self {
        Self {
            io,
            deadline: Some(Box::pin(tokio::time::sleep(limit))),
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for FirstByteDeadline<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        match &read {
            Poll::Ready(Ok(())) if buf.filled().len() > before => this.deadline = None,
            Poll::Pending => {
                if let Some(deadline) = &mut this.deadline {
                    if deadline.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "no request on the connection in time",
                        )));
                    }
                }
            }
            _ => {}
        }
        read
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for FirstByteDeadline<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Why a body stopped: it did not arrive whole in time.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub struct BodyTimedOut(pub Duration);

/// A request body that fails once its deadline has passed.
struct DeadlineBody {
    inner: Body,
    deadline: Pin<Box<tokio::time::Sleep>>,
    limit: Duration,
}

impl DeadlineBody {
    fn new(inner: Body, limit: Duration) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep(limit)),
            limit,
        }
    }
}

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        if this.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(axum::Error::new(BodyTimedOut(this.limit)))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Whether a body read failed on its deadline (else: too large, or the client went away).
pub fn timed_out(error: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if e.is::<BodyTimedOut>() {
            return true;
        }
        source = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_trickled_body_is_cut_off_at_its_deadline() {
        let (tx, rx) =
            tokio::sync::mpsc::channel::<Result<http_body::Frame<Bytes>, axum::Error>>(4);
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let body = Body::new(http_body_util::StreamBody::new(stream));
        let trickle = tokio::spawn(async move {
            for _ in 0..100 {
                if tx
                    .send(Ok(http_body::Frame::data(Bytes::from_static(b"a"))))
                    .await
                    .is_err()
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        let body = Body::new(DeadlineBody::new(body, Duration::from_millis(150)));
        let e = axum::body::to_bytes(body, 1 << 20).await.unwrap_err();
        assert!(timed_out(&e), "{e}");
        trickle.abort();
        // A body that arrives in time is read whole.
        let body = Body::new(DeadlineBody::new(
            Body::from("whole"),
            Duration::from_millis(150),
        ));
        assert_eq!(axum::body::to_bytes(body, 1 << 20).await.unwrap(), "whole");
    }
}

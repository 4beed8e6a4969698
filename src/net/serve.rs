//! Serving the gRPC listeners' HTTP/2 connections, one task each, so that
//! every close the server decides on is graceful: an HTTP/2 GOAWAY (hyper's
//! graceful shutdown: a GOAWAY naming the highest stream id and a PING,
//! then, once the PING is answered, a GOAWAY naming the last stream taken),
//! so that a peer sends nothing new on the connection and its gRPC library
//! resends, on another connection, any call the server did not take; the
//! streams taken finish; then the connection closes. A peer that does not
//! finish the close within a bound is cut (see [`drain_bound`]).
//!
//! Graceful closes: a connection marked to close by its registry (idle,
//! evicted, at its address's cap, past the auth deadline; see
//! [`crate::net::conns`]), one at its maximum age, and every connection at
//! shutdown. Each is counted by cause (`stateseal_goaways_sent_total`),
//! and a cut after the bound in `stateseal_connections_cut_after_drain_total`.
//! The attack cases are closed at once by the connection's own I/O.
//!
//! Each request gets what tonic's own server gives it: the connection's
//! information in its extensions (`ConnInfo`), and a timeout, the shorter
//! of the server's request timeout and the caller's `grpc-timeout`, after
//! which it is answered `CANCELLED` ("Timeout expired").

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::Connected;

use crate::net::conns::{Cause, Conn, ConnInfo};
use crate::net::limits::TransportLimits;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A peer that has no stream open this long after the GOAWAY (it did not
/// answer the PING, or does not close) is cut: a client closes within a
/// round trip.
pub const QUIET_BOUND: Duration = Duration::from_secs(1);

/// How long a graceful close may take: streams still open after the GOAWAY
/// finish within the request timeout and the stream-age margin (a unary
/// answer its peer takes); at the maximum age, the configured grace.
pub fn drain_bound(lim: &TransportLimits, cause: Cause) -> Duration {
    match cause {
        Cause::MaxAge => lim.max_connection_age_grace,
        // It never sent a valid credential: its streams are nobody's.
        Cause::AuthDeadline => QUIET_BOUND,
        _ => lim
            .request_timeout
            .saturating_add(crate::net::limits::STREAM_AGE_MARGIN),
    }
}

/// A connection the loop serves: what the listeners yield, with the
/// connection's information for each request.
pub trait ServedIo<P>:
    AsyncRead + AsyncWrite + Connected<ConnectInfo = ConnInfo<P>> + Unpin + Send + 'static
{
}

impl<P, T> ServedIo<P> for T where
    T: AsyncRead + AsyncWrite + Connected<ConnectInfo = ConnInfo<P>> + Unpin + Send + 'static
{
}

/// A service the loop serves: tonic's routes behind the server's layers.
pub trait GrpcService:
    tower_service::Service<
        Request<tonic::body::Body>,
        Response = Response<Self::Body>,
        Future: Send + 'static,
        Error: Into<BoxError> + Send,
    > + Clone
    + Send
    + 'static
{
    /// The answers' body.
    type Body: http_body::Body<Data = bytes::Bytes, Error: Into<BoxError>> + Send + 'static;
}

impl<S, RB> GrpcService for S
where
    S: tower_service::Service<Request<tonic::body::Body>, Response = Response<RB>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + Send,
    RB: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Body = RB;
}

/// The HTTP/2 server settings of `lim`, with at most `max_streams` streams
/// per connection.
fn http2(
    lim: &TransportLimits,
    max_streams: u32,
) -> hyper::server::conn::http2::Builder<TokioExecutor> {
    let mut b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    b.timer(TokioTimer::new())
        .max_concurrent_streams(max_streams)
        .max_header_list_size(lim.max_header_list_size)
        .keep_alive_interval(lim.keepalive_interval)
        .keep_alive_timeout(lim.keepalive_timeout)
        .max_local_error_reset_streams(lim.max_local_error_resets)
        .max_pending_accept_reset_streams(
            (max_streams as usize).saturating_mul(crate::net::limits::PENDING_RESETS_PER_STREAM),
        )
        // Per-stream and per-connection receive windows: what a peer may
        // have in flight before we read it.
        .initial_stream_window_size(256 * 1024)
        .initial_connection_window_size(1024 * 1024)
        .adaptive_window(false)
        // gRPC answers carry no `date` header.
        .auto_date_header(false);
    b
}

/// Serves `svc` on every connection `incoming` yields, each bounded by
/// `lim` (at most `max_streams` streams), until `stop` completes; then
/// closes every connection gracefully and waits until they are closed.
pub async fn serve<I, IO, P, S>(
    incoming: I,
    svc: S,
    lim: &TransportLimits,
    max_streams: u32,
    stop: impl Future<Output = ()>,
) where
    I: Stream<Item = std::io::Result<IO>>,
    IO: ServedIo<P>,
    P: Clone + Send + Sync + 'static,
    S: GrpcService,
{
    let builder = Arc::new(http2(lim, max_streams));
    let lim = Arc::new(lim.clone());
    // Every connection's task holds a receiver: shutdown is a send, and
    // the end of the last task closes the channel.
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    {
        let mut incoming = std::pin::pin!(incoming);
        let mut stop = std::pin::pin!(stop);
        loop {
            let io = tokio::select! {
                () = &mut stop => break,
                io = incoming.next() => match io {
                    Some(Ok(io)) => io,
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "accept failed");
                        continue;
                    }
                    None => break,
                },
            };
            tokio::spawn(connection(
                io,
                svc.clone(),
                builder.clone(),
                Arc::clone(&lim),
                shutdown_rx.clone(),
            ));
        }
    }
    let _ = shutdown_tx.send(true);
    drop(shutdown_rx);
    shutdown_tx.closed().await;
}

/// Serves one connection until it ends, closing it gracefully when its
/// registry marks it, at its maximum age, or at shutdown.
async fn connection<IO, P, S>(
    io: IO,
    svc: S,
    builder: Arc<hyper::server::conn::http2::Builder<TokioExecutor>>,
    lim: Arc<TransportLimits>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) where
    IO: ServedIo<P>,
    P: Clone + Send + Sync + 'static,
    S: GrpcService,
{
    let info = io.connect_info();
    let conn: Arc<Conn> = info.conn.clone();
    let timeout = lim.request_timeout;
    let hyper_svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        // Sent well after the GOAWAY: by a peer that ignores it, to keep
        // the connection (and its slot) busy through the drain. Refused
        // unprocessed, and not counted as a stream.
        let late = info.conn.late_after_goaway();
        let mut req = req.map(tonic::body::Body::new);
        req.extensions_mut().insert(info.clone());
        let within = grpc_timeout(req.headers()).map_or(timeout, |t| t.min(timeout));
        let mut svc = svc.clone();
        async move {
            if late {
                return Ok(tonic::Status::unavailable(
                    "connection closing (GOAWAY sent): send the call again on a new connection",
                )
                .into_http());
            }
            let answered = tokio::time::timeout(within, async {
                std::future::poll_fn(|cx| svc.poll_ready(cx)).await?;
                svc.call(req).await
            })
            .await;
            Ok::<_, std::convert::Infallible>(match answered {
                Ok(Ok(resp)) => resp.map(tonic::body::Body::new),
                Ok(Err(e)) => tonic::Status::from_error(e.into()).into_http(),
                Err(_) => tonic::Status::cancelled("Timeout expired").into_http(),
            })
        }
    });
    let served = builder.serve_connection(TokioIo::new(io), hyper_svc);
    let mut served = std::pin::pin!(served);
    let age = tokio::time::sleep(lim.max_connection_age);
    let mut age = std::pin::pin!(age);
    // Once the GOAWAY is sent: when, and how long the close may take.
    let mut closing: Option<(tokio::time::Instant, Duration)> = None;
    let mut tick = tokio::time::interval(QUIET_BOUND / 4);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let cause = tokio::select! {
            r = served.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended");
                }
                return;
            }
            requested = std::future::poll_fn(|cx| conn.poll_close_requested(cx)), if closing.is_none() => {
                match requested {
                    Some(cause) => cause,
                    // Closed at once: its I/O ends it.
                    None => {
                        closing = Some((tokio::time::Instant::now(), drain_bound(&lim, Cause::Evicted)));
                        continue;
                    }
                }
            }
            () = age.as_mut(), if closing.is_none() => Cause::MaxAge,
            _ = shutdown.wait_for(|s| *s), if closing.is_none() => Cause::Shutdown,
            _ = tick.tick(), if closing.is_some() => {
                if let Some((since, bound)) = closing {
                    let held = since.elapsed();
                    if held >= bound || (held >= QUIET_BOUND && conn.active_streams() == 0) {
                        conn.stats().cut_after_drain.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(held_ms = held.as_millis() as u64, "connection cut: its graceful close did not finish");
                        return;
                    }
                }
                continue;
            }
        };
        conn.stats().goaways[cause as usize].fetch_add(1, Ordering::Relaxed);
        conn.goaway_sent();
        served.as_mut().graceful_shutdown();
        closing = Some((tokio::time::Instant::now(), drain_bound(&lim, cause)));
        tick.reset();
    }
}

/// The caller's `grpc-timeout` (gRPC over HTTP/2: at most 8 digits and a
/// unit), if it has a valid one.
fn grpc_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    let v = headers.get("grpc-timeout")?.to_str().ok()?;
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_as_the_spec_writes_them() {
        let t = |v: &str| {
            let mut h = http::HeaderMap::new();
            h.insert("grpc-timeout", http::HeaderValue::from_str(v).unwrap());
            grpc_timeout(&h)
        };
        assert_eq!(t("5S"), Some(Duration::from_secs(5)));
        assert_eq!(t("250m"), Some(Duration::from_millis(250)));
        assert_eq!(t("99999999H"), Some(Duration::from_secs(99_999_999 * 3600)));
        assert_eq!(t("1u"), Some(Duration::from_micros(1)));
        assert_eq!(t("7n"), Some(Duration::from_nanos(7)));
        assert_eq!(t("2M"), Some(Duration::from_secs(120)));
        for bad in ["", "S", "5", "5s", "123456789S", "-1S", "1.5S", "+5S"] {
            assert_eq!(t(bad), None, "{bad:?}");
        }
        assert_eq!(grpc_timeout(&http::HeaderMap::new()), None);
    }
}

//! Transport and work limits: what keeps the process bounded in memory and
//! responsive under hostile load, on every listener.
//!
//! - Connections: each listener takes a permit *before* `accept`, so at most
//!   `max_connections` are open; over that, new connections wait in the
//!   kernel's backlog instead of costing memory here.
//! - HTTP/2: streams per connection, header list size, keepalive with a
//!   timeout, a maximum connection age (which also bounds how long a
//!   connection outlives a replaced client CA), reset-flood limits, and a
//!   per-request timeout (see [`TransportLimits::apply`]).
//! - Request bytes in flight, process-wide: every DATA frame of every
//!   request takes permits from one byte budget, held until the response is
//!   produced; a frame that does not fit fails its request at once with
//!   `RESOURCE_EXHAUSTED` ([`InflightBytesLayer`]).
//! - Canonicalization of `params_json`: small inputs run inline; larger ones
//!   on the blocking pool, at most `max_canonicalizations` at once with a
//!   bounded queue; over the queue, `RESOURCE_EXHAUSTED` at once
//!   ([`CanonPool`]).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::Connected;

use crate::net::conns::{Closing, Conn, ConnInfo, ConnStats, Conns};

/// Every limit of the transport, with the defaults docs/configuration.md documents.
#[derive(Clone, Debug)]
pub struct TransportLimits {
    /// HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS` on every connection.
    pub max_concurrent_streams: u32,
    /// Open connections on the main port.
    pub max_connections: usize,
    /// Open connections on the health port and on the metrics port, each.
    pub max_aux_connections: usize,
    /// HTTP/2 `SETTINGS_MAX_HEADER_LIST_SIZE`.
    pub max_header_list_size: u32,
    /// Bound on handling one request (from its headers to its answer).
    pub request_timeout: Duration,
    /// HTTP/2 PING interval, and how long a PING may go unanswered.
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    /// Connections are closed (GOAWAY) after this age, and cut after the
    /// grace period that follows.
    pub max_connection_age: Duration,
    pub max_connection_age_grace: Duration,
    /// Streams a peer may make us reset, and reset streams not yet
    /// accepted, before the connection is closed (reset floods).
    pub max_local_error_resets: usize,
    pub max_pending_accept_resets: usize,
    /// TLS handshakes (and, in plaintext, the HTTP/2 preface): each bounded
    /// in time; at most this many at once per listener (a new one evicts the
    /// oldest, see [`HandshakeSlots`]).
    pub tls_handshake_timeout: Duration,
    pub max_tls_handshakes: usize,
    /// Request bytes in flight, process-wide.
    pub max_inflight_bytes: usize,
    /// Canonicalizations of `params_json` running at once, and waiting.
    pub max_canonicalizations: usize,
    pub max_canon_queue: usize,
    /// After SIGTERM: how long in-flight requests may take before they are
    /// cut and the process exits (ledger flushed).
    pub shutdown_grace: Duration,
    /// Connections per source address on each gRPC listener (0: a quarter
    /// of the listener's cap); see [`crate::net::conns`].
    pub max_connections_per_ip: usize,
    /// A connection with no open stream for this long is closed.
    pub idle_timeout: Duration,
    /// Bearer authentication: the time a connection has to send a request
    /// with a valid credential.
    pub auth_deadline: Duration,
}

impl Default for TransportLimits {
    fn default() -> Self {
        TransportLimits {
            max_concurrent_streams: 128,
            max_connections: 1024,
            max_aux_connections: 64,
            max_header_list_size: 16 * 1024,
            request_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
            max_connection_age: Duration::from_secs(600),
            max_connection_age_grace: Duration::from_secs(30),
            max_local_error_resets: 128,
            max_pending_accept_resets: 32,
            tls_handshake_timeout: Duration::from_secs(5),
            max_tls_handshakes: 64,
            max_inflight_bytes: 16 * 1024 * 1024,
            max_canonicalizations: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2)
                .clamp(1, 8),
            max_canon_queue: 64,
            shutdown_grace: Duration::from_secs(20),
            max_connections_per_ip: 0,
            idle_timeout: Duration::from_secs(300),
            auth_deadline: Duration::from_secs(10),
        }
    }
}

impl TransportLimits {
    /// The connection policy of a listener capped at `cap` connections;
    /// `bearer`: callers authenticate per request with a bearer secret.
    pub fn conn_policy(&self, cap: usize, bearer: bool) -> crate::net::conns::ConnPolicy {
        crate::net::conns::ConnPolicy {
            idle_timeout: self.idle_timeout,
            per_ip: match self.max_connections_per_ip {
                0 => (cap / 4).max(1),
                n => n,
            },
            auth_deadline: bearer.then_some(self.auth_deadline),
            max_auth_failures: 16,
        }
    }

    /// A tonic server builder with these limits.
    pub fn apply(&self, b: tonic::transport::Server) -> tonic::transport::Server {
        b.max_concurrent_streams(self.max_concurrent_streams)
            .http2_max_header_list_size(self.max_header_list_size)
            .timeout(self.request_timeout)
            .http2_keepalive_interval(Some(self.keepalive_interval))
            .http2_keepalive_timeout(Some(self.keepalive_timeout))
            .max_connection_age(self.max_connection_age)
            .max_connection_age_grace(self.max_connection_age_grace)
            .http2_max_local_error_reset_streams(Some(self.max_local_error_resets))
            .http2_max_pending_accept_reset_streams(Some(self.max_pending_accept_resets))
            // Per-stream and per-connection receive windows: what a peer may
            // have in flight before we read it.
            .initial_stream_window_size(256 * 1024)
            .initial_connection_window_size(1024 * 1024)
            .tcp_nodelay(true)
    }
}

/// Refusals of the work bounds, for the metrics endpoint: one per server,
/// shared by its request-byte budget and its canonicalization pool.
#[derive(Debug, Default)]
pub struct LimitStats {
    pub inflight_refused: AtomicU64,
    pub canon_refused: AtomicU64,
}

// === connections ===

/// A connection that holds one of its listener's permits while it is open,
/// its place among the listener's connections (see [`crate::net::conns`]), and
/// what its handshake established about the peer (`P`).
pub struct Counted<IO, P = ()> {
    inner: IO,
    peer: P,
    conn: Arc<Conn>,
    _permit: OwnedSemaphorePermit,
}

impl<IO> Counted<IO> {
    /// An established connection (its handshake is over).
    pub fn new(inner: IO, permit: OwnedSemaphorePermit, conn: Arc<Conn>) -> Self {
        conn.established();
        Counted {
            inner,
            peer: (),
            conn,
            _permit: permit,
        }
    }
}

impl<IO, P> Counted<IO, P> {
    pub fn with_peer<Q>(self, peer: Q) -> Counted<IO, Q> {
        Counted {
            inner: self.inner,
            peer,
            conn: self.conn,
            _permit: self._permit,
        }
    }
    pub fn peer(&self) -> &P {
        &self.peer
    }
    pub fn conn(&self) -> &Arc<Conn> {
        &self.conn
    }
}

impl Connected for Counted<TcpStream> {
    type ConnectInfo = ConnInfo<()>;
    fn connect_info(&self) -> ConnInfo<()> {
        ConnInfo {
            peer: (),
            conn: self.conn.clone(),
        }
    }
}

impl<IO: AsyncRead + Unpin, P: Unpin> AsyncRead for Counted<IO, P> {
    /// End of stream once the connection is marked to be closed (idle too
    /// long, evicted, or unauthenticated): the HTTP/2 server then drops it.
    /// An idle or evicted connection is closed only when nothing waits to
    /// be read: bytes already sent (a request that crossed the close) are
    /// read and served first, and a stream they open calls the close off.
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.conn.poll_closing(cx) {
            Closing::No => Pin::new(&mut self.inner).poll_read(cx, buf),
            Closing::Now => Poll::Ready(Ok(())),
            Closing::WhenQuiet => match Pin::new(&mut self.inner).poll_read(cx, buf) {
                Poll::Pending => Poll::Ready(Ok(())),
                other => other,
            },
        }
    }
}

impl<IO: AsyncWrite + Unpin, P: Unpin> AsyncWrite for Counted<IO, P> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    /// Reported as not vectored, whatever the socket can do. h2 then
    /// copies a DATA frame under 1 KiB into its write buffer with the
    /// frames around it, and answers to many streams leave in one write.
    /// Over vectored I/O it keeps every DATA payload of 256 B or more as a
    /// buffer of its own and writes it out before it takes the next frame:
    /// each Seal answer (a ~420-character token) and each Open answer of a
    /// few hundred bytes cost a system call and a TCP segment of their own.
    /// Measured in docs/performance.md ("Coalesced writes").
    fn is_write_vectored(&self) -> bool {
        false
    }
}

/// Accepts one connection once a permit is free (the permit is taken
/// first: a full listener stops accepting). Sets TCP_NODELAY: without it, a
/// response written in more than one segment waits for the peer's delayed
/// ACK (~40 ms).
///
/// With `handshakes`: when every permit is taken, the oldest connection
/// still in its handshake is evicted to make room, so connections that say
/// nothing cannot keep the listener from accepting; then the established
/// connection idle longest. Only when every connection has a stream open
/// does the listener wait. A connection from an address at its cap
/// evicts that address's idlest connection, or is refused.
pub async fn accept_limited(
    listener: &TcpListener,
    permits: &Arc<Semaphore>,
    handshakes: Option<&Arc<HandshakeSlots>>,
    conns: &Arc<Conns>,
) -> Option<(
    TcpStream,
    std::net::SocketAddr,
    OwnedSemaphorePermit,
    Arc<Conn>,
)> {
    let permit = loop {
        match permits.clone().try_acquire_owned() {
            Ok(p) => break p,
            Err(tokio::sync::TryAcquireError::Closed) => return None,
            Err(tokio::sync::TryAcquireError::NoPermits) => {}
        }
        if handshakes.is_some_and(|h| h.evict_oldest()) || conns.evict_idlest(None) {
            // The evicted connection's task drops it (and its permit) soon.
            let waited =
                tokio::time::timeout(Duration::from_millis(200), permits.clone().acquire_owned())
                    .await;
            match waited {
                Ok(Ok(p)) => break p,
                Ok(Err(_)) => return None,
                Err(_) => continue,
            }
        }
        // Every permit belongs to a connection with a stream open: wait.
        break permits.clone().acquire_owned().await.ok()?;
    };
    loop {
        match listener.accept().await {
            Ok((tcp, addr)) => {
                let Some(conn) = conns.register(addr.ip()) else {
                    // Its address is at its cap with every connection busy.
                    drop(tcp);
                    continue;
                };
                let _ = tcp.set_nodelay(true);
                return Some((tcp, addr, permit, conn));
            }
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The HTTP/2 client connection preface (RFC 9113 §3.4).
const PREFACE_LEN: usize = 24;

/// Waits until the peer has sent the 24-byte HTTP/2 preface (peeked, not
/// read), for at most `limit`. A connection that sends nothing, or a byte at
/// a time, is dropped instead of holding a connection slot.
async fn preface_within(tcp: &TcpStream, limit: Duration) -> bool {
    let mut buf = [0u8; PREFACE_LEN];
    tokio::time::timeout(limit, async {
        loop {
            match tcp.peek(&mut buf).await {
                Ok(n) if n >= PREFACE_LEN => return true,
                Ok(0) | Err(_) => return false, // closed
                Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await
    .unwrap_or(false)
}

/// Connections still in their handshake (TLS, or the HTTP/2 preface in
/// plaintext). At most `max` at once; when a new one arrives and all slots
/// are taken, the *oldest* is evicted. A flood of peers that connect and say
/// nothing therefore cannot lock out a real client, which completes its
/// handshake within a round trip of connecting.
#[derive(Debug)]
pub struct HandshakeSlots {
    max: usize,
    /// Where evictions are counted (the listener's connection counters).
    stats: Arc<ConnStats>,
    next: AtomicU64,
    queue: Mutex<std::collections::VecDeque<(u64, tokio::sync::oneshot::Sender<()>)>>,
}

/// A connection's place among the handshakes; leaves on drop.
pub struct HandshakeTicket {
    id: u64,
    slots: Arc<HandshakeSlots>,
    /// Completes when this handshake is evicted.
    pub evicted: tokio::sync::oneshot::Receiver<()>,
}

impl Drop for HandshakeTicket {
    fn drop(&mut self) {
        let mut q = self.slots.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.retain(|(id, _)| *id != self.id);
    }
}

impl HandshakeSlots {
    pub fn new(max: usize, stats: Arc<ConnStats>) -> Arc<Self> {
        Arc::new(HandshakeSlots {
            max: max.max(1),
            stats,
            next: AtomicU64::new(0),
            queue: Mutex::default(),
        })
    }

    /// Evicts the oldest handshake in progress; false if there is none.
    pub fn evict_oldest(&self) -> bool {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        match q.pop_front() {
            Some((_, evict)) => {
                self.stats
                    .handshakes_evicted
                    .fetch_add(1, Ordering::Relaxed);
                let _ = evict.send(());
                true
            }
            None => false,
        }
    }

    /// Takes a slot, evicting the oldest handshake if all are taken.
    pub fn admit(self: &Arc<Self>) -> HandshakeTicket {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        while q.len() >= self.max {
            if let Some((_, evict)) = q.pop_front() {
                self.stats
                    .handshakes_evicted
                    .fetch_add(1, Ordering::Relaxed);
                let _ = evict.send(());
            }
        }
        q.push_back((id, tx));
        HandshakeTicket {
            id,
            slots: self.clone(),
            evicted: rx,
        }
    }
}

/// Plaintext connections from `listener`, at most `max` open at once; each
/// must send the HTTP/2 preface within `handshake_timeout`, and at most
/// `max_handshakes` may be waiting to (see [`HandshakeSlots`]).
pub fn limited_incoming(
    listener: TcpListener,
    max: usize,
    max_handshakes: usize,
    handshake_timeout: Duration,
    conns: Arc<Conns>,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<Counted<TcpStream>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let permits = Arc::new(Semaphore::new(max.max(1)));
    let slots = HandshakeSlots::new(max_handshakes, conns.stats().clone());
    tokio::spawn(async move {
        while let Some((tcp, _, permit, conn)) =
            accept_limited(&listener, &permits, Some(&slots), &conns).await
        {
            let conn_tx = tx.clone();
            let mut ticket = slots.admit();
            let stats = conns.stats().clone();
            tokio::spawn(async move {
                let ok = tokio::select! {
                    ok = preface_within(&tcp, handshake_timeout) => ok,
                    _ = &mut ticket.evicted => false,
                };
                drop(ticket);
                if ok {
                    let _ = conn_tx.send(Ok(Counted::new(tcp, permit, conn))).await;
                } else {
                    stats.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                }
            });
            if tx.is_closed() {
                return; // the server stopped
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

// === request bytes in flight ===

/// The server's budget of request bytes in flight.
#[derive(Debug)]
struct Budget {
    used: AtomicUsize,
    max: usize,
    stats: Arc<LimitStats>,
}

impl Budget {
    /// Takes `n` bytes if they fit.
    fn take(&self, n: usize) -> bool {
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            let Some(next) = cur.checked_add(n).filter(|v| *v <= self.max) else {
                return false;
            };
            match self
                .used
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(seen) => cur = seen,
            }
        }
    }
}

/// The bytes one request holds: shared by its body (while tonic reads it)
/// and its response future (until the answer exists); given back when the
/// last of the two is dropped.
#[derive(Debug)]
struct Held {
    bytes: AtomicUsize,
    budget: Arc<Budget>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget
            .used
            .fetch_sub(*self.bytes.get_mut(), Ordering::AcqRel);
    }
}

/// A tower layer charging every request's body bytes to one budget.
#[derive(Clone, Debug)]
pub struct InflightBytesLayer {
    budget: Arc<Budget>,
}

impl InflightBytesLayer {
    /// A budget of `max_bytes`, counting refusals into `stats`.
    pub fn new(max_bytes: usize, stats: Arc<LimitStats>) -> Self {
        InflightBytesLayer {
            budget: Arc::new(Budget {
                used: AtomicUsize::new(0),
                max: max_bytes.max(64 * 1024),
                stats,
            }),
        }
    }
    /// Bytes currently free in the budget.
    pub fn available(&self) -> usize {
        self.budget.max
            - self
                .budget
                .used
                .load(Ordering::Relaxed)
                .min(self.budget.max)
    }
}

impl<S> tower_layer::Layer<S> for InflightBytesLayer {
    type Service = InflightBytes<S>;
    fn layer(&self, inner: S) -> InflightBytes<S> {
        InflightBytes {
            inner,
            budget: self.budget.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct InflightBytes<S> {
    inner: S,
    budget: Arc<Budget>,
}

impl<S> tower_service::Service<http::Request<tonic::body::Body>> for InflightBytes<S>
where
    S: tower_service::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = HoldingFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let held = Arc::new(Held {
            bytes: AtomicUsize::new(0),
            budget: self.budget.clone(),
        });
        let (parts, body) = req.into_parts();
        let body = tonic::body::Body::new(Metered {
            inner: body,
            held: held.clone(),
        });
        HoldingFuture {
            inner: self.inner.call(http::Request::from_parts(parts, body)),
            _held: held,
        }
    }
}

pin_project_lite::pin_project! {
    /// The inner response future, holding the request's bytes until it ends.
    pub struct HoldingFuture<F> {
        #[pin]
        inner: F,
        _held: Arc<Held>,
    }
}

impl<F: std::future::Future> std::future::Future for HoldingFuture<F> {
    type Output = F::Output;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.project().inner.poll(cx)
    }
}

pin_project_lite::pin_project! {
    struct Metered {
        #[pin]
        inner: tonic::body::Body,
        held: Arc<Held>,
    }
}

impl HttpBody for Metered {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = self.project();
        match this.inner.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    let n = data.len();
                    if !this.held.budget.take(n) {
                        this.held
                            .budget
                            .stats
                            .inflight_refused
                            .fetch_add(1, Ordering::Relaxed);
                        return Poll::Ready(Some(Err(
                            crate::domain::error::Reject::Overloaded.into()
                        )));
                    }
                    this.held.bytes.fetch_add(n, Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

// === canonicalization ===

/// Runs canonicalizations of `params_json` off the async workers, bounded.
#[derive(Debug)]
pub struct CanonPool {
    running: Arc<Semaphore>,
    admitted: AtomicUsize,
    max_admitted: usize,
    stats: Arc<LimitStats>,
}

/// Inputs up to this size are canonicalized inline: a few microseconds,
/// cheaper than a hand-off to the blocking pool.
pub const INLINE_CANON_BYTES: usize = 4 * 1024;

/// The pool is full: answer `RESOURCE_EXHAUSTED` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

impl CanonPool {
    /// At most `running` at once and `queue` waiting; refusals counted
    /// into `stats`.
    pub fn new(running: usize, queue: usize, stats: Arc<LimitStats>) -> Self {
        let running = running.max(1);
        CanonPool {
            running: Arc::new(Semaphore::new(running)),
            admitted: AtomicUsize::new(0),
            max_admitted: running + queue,
            stats,
        }
    }

    /// Runs `f` over `input`: inline when small, else on the blocking pool
    /// under the bounds. `Err(Busy)` when running and queued are full.
    pub async fn run<T, F>(&self, input: String, f: F) -> Result<T, Busy>
    where
        T: Send + 'static,
        F: FnOnce(&str) -> T + Send + 'static,
    {
        if input.len() <= INLINE_CANON_BYTES {
            return Ok(f(&input));
        }
        if self.admitted.fetch_add(1, Ordering::AcqRel) >= self.max_admitted {
            self.admitted.fetch_sub(1, Ordering::AcqRel);
            self.stats.canon_refused.fetch_add(1, Ordering::Relaxed);
            return Err(Busy);
        }
        struct Admitted<'a>(&'a AtomicUsize);
        impl Drop for Admitted<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let _admitted = Admitted(&self.admitted);
        let permit = self
            .running
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Busy)?;
        tokio::task::spawn_blocking(move || {
            let r = f(&input);
            drop(permit);
            r
        })
        .await
        .map_err(|_| Busy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A connection says it does not write vectored (so h2 coalesces
    /// answers under 1 KiB, docs/performance.md "Coalesced writes"), and a
    /// vectored write through it still delivers every byte, in order.
    #[tokio::test]
    async fn connections_coalesce_and_still_write_every_slice() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).await.unwrap();
            got
        });
        let (tcp, peer) = listener.accept().await.unwrap();
        assert!(tcp.is_write_vectored(), "the socket itself writes vectored");
        let permit = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let registry = Conns::new(
            TransportLimits::default().conn_policy(4, false),
            Arc::default(),
        );
        let mut conn = Counted::new(tcp, permit, registry.register(peer.ip()).unwrap());
        assert!(!conn.is_write_vectored());
        let (a, b) = (vec![1u8; 300], vec![2u8; 700]);
        let mut slices = [std::io::IoSlice::new(&a), std::io::IoSlice::new(&b)];
        let mut slices = &mut slices[..];
        while !slices.is_empty() {
            let n = conn.write_vectored(slices).await.unwrap();
            std::io::IoSlice::advance_slices(&mut slices, n);
        }
        conn.shutdown().await.unwrap();
        drop(conn);
        let got = client.await.unwrap();
        assert_eq!(got, [a, b].concat());
    }
}

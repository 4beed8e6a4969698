//! Accepting connections under the limits: each accepted connection takes
//! a permit before it is served, so at most `max_connections` are open (and
//! one more waits for its permit); over that, new connections wait in the
//! kernel's backlog instead of costing memory here, or an arrival evicts a
//! connection still in its handshake, or the idlest one.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::Connected;

use crate::net::conns::{Closing, Conn, ConnInfo, ConnStats, Conns};

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
    /// End of stream once the connection is to be closed at once (the
    /// attack cases, see [`crate::net::conns`]): the HTTP/2 server then
    /// drops it. A graceful close (GOAWAY) is the serving task's
    /// (`net::serve`): until it ends the connection, reads go on.
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        match this.conn.poll_closing(cx) {
            Closing::Now => Poll::Ready(Ok(())),
            _ => Pin::new(&mut this.inner).poll_read(cx, buf),
        }
    }
}

/// What a write that its peer did not take at once becomes on a connection
/// closed at once ([`Conn::ending`]): an error, which ends the connection.
/// Its peer may be one that stopped reading to keep the connection, and
/// its permit, after it was cut.
fn unless_ending<T>(conn: &Conn, p: Poll<std::io::Result<T>>) -> Poll<std::io::Result<T>> {
    match p {
        Poll::Pending if conn.ending() => Poll::Ready(Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "connection closed by the server",
        ))),
        p => p,
    }
}

impl<IO: AsyncWrite + Unpin, P: Unpin> AsyncWrite for Counted<IO, P> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let p = Pin::new(&mut self.inner).poll_write(cx, buf);
        unless_ending(&self.conn, p)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let p = Pin::new(&mut self.inner).poll_flush(cx);
        unless_ending(&self.conn, p)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let p = Pin::new(&mut self.inner).poll_shutdown(cx);
        unless_ending(&self.conn, p)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let p = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        unless_ending(&self.conn, p)
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

/// Accepts one connection and takes a permit for it: a full listener holds
/// that one connection until a permit is free, and accepts no other (the
/// rest wait in the kernel's backlog). Eviction happens for an arrival,
/// never ahead of one: evicting ahead of it took the handshake of the
/// connection accepted last, often the only one in its handshake. Sets
/// TCP_NODELAY: without it, a response written in more than one segment
/// waits for the peer's delayed ACK (~40 ms).
///
/// With `handshakes`: when every permit is taken, the oldest connection
/// still in its handshake is evicted to make room, so connections that say
/// nothing cannot keep the listener from accepting; then the established
/// connection idle longest. Only while every connection has a stream open
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
    loop {
        let (tcp, addr) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(conn) = conns.register(addr.ip()) else {
            // Its address is at its cap with every connection busy.
            drop(tcp);
            continue;
        };
        let permit = permit_for_arrival(permits, handshakes, conns).await?;
        let _ = tcp.set_nodelay(true);
        return Some((tcp, addr, permit, conn));
    }
}

/// A permit for a connection that has arrived (and is not yet among the
/// handshakes, so it cannot be the one evicted): free, or made free by
/// evicting the oldest handshake, else the idlest connection; when every
/// connection has a stream open, waits, looking again every
/// [`EVICT_AGAIN`] (streams end, and the connections they leave idle are
/// evicted, not kept until their idle timeout).
async fn permit_for_arrival(
    permits: &Arc<Semaphore>,
    handshakes: Option<&Arc<HandshakeSlots>>,
    conns: &Arc<Conns>,
) -> Option<OwnedSemaphorePermit> {
    loop {
        match permits.clone().try_acquire_owned() {
            Ok(p) => return Some(p),
            Err(tokio::sync::TryAcquireError::Closed) => return None,
            Err(tokio::sync::TryAcquireError::NoPermits) => {}
        }
        // The evicted connection's task drops it (and its permit) soon.
        let evicted = handshakes.is_some_and(|h| h.evict_oldest()) || conns.evict_idlest();
        let wait = if evicted { EVICTED_LEAVES } else { EVICT_AGAIN };
        match tokio::time::timeout(wait, permits.clone().acquire_owned()).await {
            Ok(Ok(p)) => return Some(p),
            Ok(Err(_)) => return None,
            Err(_) => {}
        }
    }
}

/// How long a full listener whose connections all have a stream open waits
/// for a permit before it looks again for a connection to evict.
const EVICT_AGAIN: Duration = Duration::from_millis(500);

/// How long an arrival waits for the connection it evicted to leave before
/// it evicts another: an evicted connection may first serve a request that
/// crossed its close (up to the grace, its stream, the drain); a shorter
/// wait lets one arrival evict several idle connections.
const EVICTED_LEAVES: Duration = Duration::from_secs(2);

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
                    // A preface already there wins over an eviction that
                    // raced it.
                    biased;
                    ok = preface_within(&tcp, handshake_timeout) => ok,
                    _ = &mut ticket.evicted => false,
                    // Evicted at its address's cap: never served.
                    () = conn.marked() => false,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::limits::TransportLimits;
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
            TransportLimits::default().conn_policy(4, crate::net::limits::CallerAuth::None),
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

    type Piped = (
        tokio::io::DuplexStream,
        Arc<Conns>,
        Counted<tokio::io::DuplexStream>,
    );

    /// An established connection over an in-memory pipe of 1 KiB, on a
    /// listener whose callers authenticate as `auth` says: its far end,
    /// its registry and the connection itself.
    fn piped(auth: crate::net::limits::CallerAuth) -> Piped {
        let (near, far) = tokio::io::duplex(1024);
        let permit = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let registry = Conns::new(
            TransportLimits::default().conn_policy(4, auth),
            Arc::default(),
        );
        let conn = Counted::new(
            near,
            permit,
            registry.register([127, 0, 0, 1].into()).unwrap(),
        );
        (far, registry, conn)
    }

    /// A connection closed at once whose peer does not take its bytes
    /// ends at the write that would wait (a peer that stops reading keeps
    /// h2 from reading, so the end of its reads alone would never come),
    /// and its reads end; one marked to close gracefully waits like an
    /// unmarked one (its serving task bounds that close).
    #[tokio::test(start_paused = true)]
    async fn a_write_that_would_wait_ends_a_connection_closed_at_once() {
        let (_far, registry, mut conn) = piped(crate::net::limits::CallerAuth::Certificate);
        for _ in 0..16 {
            conn.conn().auth_failed();
        }
        assert!(conn.conn().ending(), "16 failed requests close it at once");
        conn.write_all(&[0u8; 1024]).await.unwrap(); // the pipe's buffer
        let ended = tokio::time::timeout(Duration::from_secs(60), conn.write_all(b"PONG")).await;
        let e = ended.expect("the write waits").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionAborted);
        let mut buf = [0u8; 8];
        assert_eq!(conn.read(&mut buf).await.unwrap(), 0);
        drop(registry);

        for evict in [true, false] {
            let (_far, registry, mut conn) = piped(crate::net::limits::CallerAuth::None);
            if evict {
                assert!(registry.evict_idlest(), "the idle connection is evicted");
                assert!(conn.conn().is_closing() && !conn.conn().ending());
            }
            conn.write_all(&[0u8; 1024]).await.unwrap();
            let waited =
                tokio::time::timeout(Duration::from_secs(60), conn.write_all(b"PONG")).await;
            assert!(waited.is_err(), "evicted {evict}: the write was cut");
        }
    }

    /// A plaintext listener on loopback of `max` connections, with the
    /// connection policy of a `cap` (a quarter of it per address) and a
    /// handshake timeout of a minute: its address, registry and stream.
    async fn listening(
        max: usize,
        cap: usize,
    ) -> (
        std::net::SocketAddr,
        Arc<Conns>,
        tokio_stream::wrappers::ReceiverStream<std::io::Result<Counted<TcpStream>>>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let registry = Conns::new(
            TransportLimits::default().conn_policy(cap, crate::net::limits::CallerAuth::None),
            Arc::default(),
        );
        let incoming =
            limited_incoming(listener, max, 8, Duration::from_secs(60), registry.clone());
        (addr, registry, incoming)
    }

    /// A full listener whose only connection has a stream open waits; when
    /// the stream ends, the now idle connection is evicted for the waiting
    /// arrival, instead of keeping its permit until it closes on its own
    /// (its idle timeout, 300 s).
    #[tokio::test]
    async fn a_full_listener_evicts_a_connection_once_its_stream_ends() {
        use tokio_stream::StreamExt;
        let (addr, _registry, mut incoming) = listening(1, 64).await;
        let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        let mut a_peer = TcpStream::connect(addr).await.unwrap();
        a_peer.write_all(preface).await.unwrap();
        let bound = Duration::from_secs(20);
        let a = tokio::time::timeout(bound, incoming.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let stream = crate::net::conns::StreamGuard::enter(Some(a.conn().clone()));
        let mut b_peer = TcpStream::connect(addr).await.unwrap();
        b_peer.write_all(preface).await.unwrap();
        tokio::time::sleep(EVICT_AGAIN * 2).await;
        assert!(
            !a.conn().is_closing(),
            "a connection with a stream open was evicted"
        );
        drop(stream);
        let evicted = tokio::time::timeout(bound, async {
            while !a.conn().is_closing() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(
            evicted.is_ok(),
            "the idle connection was not evicted for the waiting one"
        );
        drop(a); // its reads would end it; its permit goes back
        let b = tokio::time::timeout(bound, incoming.next()).await;
        assert!(
            matches!(b, Ok(Some(Ok(_)))),
            "the waiting connection was not served"
        );
    }

    /// A connection evicted at its address's cap while still in its
    /// handshake is dropped then, not served when its handshake ends (and
    /// not after the handshake timeout, a minute here).
    #[tokio::test]
    async fn a_connection_evicted_in_its_handshake_is_dropped_at_once() {
        // A cap of 4: one connection per address.
        let (addr, registry, _incoming) = listening(4, 4).await;
        let mut first = TcpStream::connect(addr).await.unwrap();
        let _second = TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 1];
        let ended = tokio::time::timeout(Duration::from_secs(20), first.read(&mut buf)).await;
        assert!(
            matches!(ended, Ok(Ok(0) | Err(_))),
            "the evicted handshake is still open: {ended:?}"
        );
        assert_eq!(registry.stats().evicted.load(Ordering::Relaxed), 1);
    }
}

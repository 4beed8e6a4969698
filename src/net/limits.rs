//! Transport limits: every bound that keeps the process small in memory
//! and responsive under hostile load, with their defaults, and how they are
//! applied to the HTTP/2 server (streams per connection, header list size,
//! keepalive with a timeout, a maximum connection age, which also bounds
//! how long a connection outlives a replaced client CA, reset-flood limits,
//! and a per-request timeout; see `net::serve`). The bounds
//! are enforced where connections are accepted (`accept.rs`), by the
//! request-byte budget (`budget.rs`) and by the service's canonicalization
//! pool.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

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
    /// Streams a peer may make us reset before the connection is closed
    /// (reset floods). Streams the peer reset before the server took them
    /// up are bounded by [`PENDING_RESETS_PER_STREAM`] times
    /// `max_concurrent_streams`.
    pub max_local_error_resets: usize,
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

/// Streams a peer may reset before the server takes them up, per stream of
/// `max_concurrent_streams`, before h2 closes the connection with GOAWAY
/// `ENHANCE_YOUR_CALM` (the rapid-reset defence). A client cancels each
/// call whose deadline expires; when the server was stalled, it reads all
/// those resets at once: a client that queued calls up to four times its
/// stream limit is not taken for an attacker (the queue Go's http2 server
/// allows its peer), one that opened and reset more streams than that
/// while they waited is.
pub const PENDING_RESETS_PER_STREAM: usize = 4;

/// How much longer than the request timeout a stream may stay open before
/// its connection is closed (see `ConnPolicy::max_stream_age`): a unary
/// answer leaves within the timeout unless its peer does not take it.
pub const STREAM_AGE_MARGIN: Duration = Duration::from_secs(5);

/// How a listener's callers authenticate, as its connection policy sees
/// it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallerAuth {
    /// Not at all (or a port with no caller authentication: health,
    /// metrics).
    None,
    /// A bearer secret with each request.
    Bearer,
    /// A client certificate that maps to a tenant.
    Certificate,
}

impl TransportLimits {
    /// The connection policy of a listener capped at `cap` connections
    /// whose callers authenticate as `auth` says.
    pub fn conn_policy(&self, cap: usize, auth: CallerAuth) -> crate::net::conns::ConnPolicy {
        crate::net::conns::ConnPolicy {
            idle_timeout: self.idle_timeout,
            per_ip: match self.max_connections_per_ip {
                0 => (cap / 4).max(1),
                n => n,
            },
            auth_deadline: (auth == CallerAuth::Bearer).then_some(self.auth_deadline),
            max_auth_failures: 16,
            max_stream_age: self.request_timeout.saturating_add(STREAM_AGE_MARGIN),
            callers_authenticate: auth != CallerAuth::None,
        }
    }
}

/// Refusals of the work bounds, for the metrics endpoint: one per server,
/// shared by its request-byte budget and its canonicalization pool.
#[derive(Debug, Default)]
pub struct LimitStats {
    pub inflight_refused: AtomicU64,
    pub canon_refused: AtomicU64,
}

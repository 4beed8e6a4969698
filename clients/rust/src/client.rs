//! A typed async client for `stateseal.v1.RequestState` (tonic).

use std::time::Duration;

use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request, Status};
use tonic_types::StatusExt;

use crate::proto;
use crate::reasons;

/// A rejection (or transport failure) from stateseal.
///
/// `reason` is stateseal's `ErrorInfo` reason (the service README's error
/// table; `proto/stateseal/v1/reasons.json`), or the gRPC code's name when
/// the failure did not come from stateseal itself (`from_stateseal` is then
/// false; a connection that failed under the call is `UNAVAILABLE`). The
/// message is stateseal's fixed one: never a token or a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatesealError {
    pub reason: String,
    pub code: Code,
    pub message: String,
    pub from_stateseal: bool,
}

impl std::fmt::Display for StatesealError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.reason, self.message)
    }
}

impl std::error::Error for StatesealError {}

/// The gRPC code's name as reasons.json spells it.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

impl StatesealError {
    /// A failure the transport answered (no stateseal reason).
    pub fn transport(code: Code, message: impl Into<String>) -> Self {
        Self {
            reason: code_name(code).to_owned(),
            code,
            message: message.into(),
            from_stateseal: false,
        }
    }

    /// A transient outage: the same request may be retried.
    pub fn retryable(&self) -> bool {
        if self.from_stateseal {
            reasons::TRANSIENT_REASONS.contains(&self.reason.as_str())
        } else {
            reasons::TRANSPORT_TRANSIENT_CODES.contains(&code_name(self.code))
        }
    }

    /// A rejection of what the MCP client sent (token, binding, answers, or
    /// a message too large for the service).
    pub fn client_fault(&self) -> bool {
        if self.from_stateseal {
            reasons::CLIENT_REASONS.contains(&self.reason.as_str())
        } else {
            reasons::TRANSPORT_CLIENT_CODES.contains(&code_name(self.code))
        }
    }

    fn from_status(s: &Status) -> Self {
        if let Some(info) = s.get_error_details().error_info() {
            if info.domain == reasons::DOMAIN {
                return Self {
                    reason: info.reason.clone(),
                    code: s.code(),
                    message: s.message().to_owned(),
                    from_stateseal: true,
                };
            }
        }
        // The connection failed under the call (stateseal restarted, the
        // connection was reset): tonic answers UNKNOWN "transport error",
        // with the failure as its source, where the other gRPC stacks
        // answer UNAVAILABLE. No answer came, so its outcome is unknown:
        // counted as UNAVAILABLE, an Open (same attempt id), a Commit or a
        // Release is sent again.
        if s.code() == Code::Unknown && std::error::Error::source(s).is_some() {
            return Self::transport(Code::Unavailable, s.message());
        }
        // The call's own deadline ran out in tonic's channel, which answers
        // CANCELLED "Timeout expired" (the other gRPC stacks and this
        // client's own timer: DEADLINE_EXCEEDED): a Commit try given up
        // after a third of the lease is tried again, never abandoned.
        if s.code() == Code::Cancelled && s.message() == tonic::TimeoutExpired(()).to_string() {
            return Self::transport(Code::DeadlineExceeded, "timed out");
        }
        // A call the server never took: its connection closed (hyper:
        // canceled) or refused it by a GOAWAY (HTTP/2 §6.8: streams above
        // the GOAWAY's last stream id were not processed), as at an idle
        // close. tonic answers CANCELLED or INTERNAL; the other gRPC stacks
        // resend such a call by themselves. Counted as UNAVAILABLE: any call
        // may be sent again.
        if not_processed(s) {
            return Self::transport(Code::Unavailable, s.message());
        }
        Self::transport(s.code(), s.message())
    }
}

/// Whether the transport says the call never reached the server.
fn not_processed(s: &Status) -> bool {
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(s);
    while let Some(e) = src {
        if e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_canceled)
        {
            return true;
        }
        if let Some(h) = e.downcast_ref::<h2::Error>() {
            return h.is_go_away() && h.is_remote() && h.reason() == Some(h2::Reason::NO_ERROR);
        }
        src = e.source();
    }
    false
}

/// A sealed `requestState`.
#[derive(Clone)]
pub struct Sealed {
    pub request_state: String,
    pub expires_at_unix: i64,
    pub key_id: String,
}

impl std::fmt::Debug for Sealed {
    // Never the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealed")
            .field("expires_at_unix", &self.expires_at_unix)
            .field("key_id", &self.key_id)
            .finish()
    }
}

/// An opened `requestState`.
#[derive(Clone, Default)]
pub struct Opened {
    pub state: Vec<u8>,
    pub expires_at_unix: i64,
    pub key_id: String,
    pub consumed: bool,
    /// Reserve mode on a single-use token: pass it to renew, commit or
    /// release.
    pub reservation: String,
    /// When the lease ends, by the ledger's clock (informative only).
    pub lease_expires_at_unix: u64,
    /// The answers filtered against the token's sealed manifest (as sent
    /// when it has none), and what was dropped, as (key, reason).
    pub input_responses_json: String,
    pub dropped: Vec<(String, String)>,
    /// Reserve mode: the lease granted, in seconds. Renew every third of it.
    pub lease_seconds: u32,
    /// One per reservation the call carried ([`RequestStateClient::open_carrying`]),
    /// in order: `None` when committed, else the error a Commit would have
    /// answered.
    pub commits: Vec<Option<StatesealError>>,
}

/// The most reservations one Open may carry to commit (the service's bound).
pub const MAX_CARRIED_COMMITS: usize = 16;

impl std::fmt::Debug for Opened {
    // Never the state, the reservation or the answers.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("key_id", &self.key_id)
            .field("consumed", &self.consumed)
            .field("reserved", &!self.reservation.is_empty())
            .field("lease_seconds", &self.lease_seconds)
            .field("dropped", &self.dropped.len())
            .field("commits", &self.commits)
            .finish_non_exhaustive()
    }
}

/// A renewed lease: when it ends (the ledger's clock) and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub lease_expires_at_unix: u64,
    pub lease_seconds: u32,
}

/// How an Open counts a single-use token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Consumed when the Open succeeds.
    Consume,
    /// Reserved for a lease; then commit or release it.
    Reserve,
}

/// What a Seal or Open binds: the subject, the method and the binding-v2
/// params digest (computed by [`crate::binding`]).
#[derive(Clone)]
pub struct Binding {
    pub subject: String,
    pub method: String,
    pub params_digest: [u8; 32],
}

impl Binding {
    fn to_proto(&self) -> proto::Binding {
        proto::Binding {
            subject: self.subject.clone(),
            method: self.method.clone(),
            params: Some(proto::binding::Params::ParamsDigest(
                self.params_digest.to_vec(),
            )),
            binding_version: crate::binding::BINDING_VERSION,
        }
    }
}

/// The credentials this MCP server presents to stateseal.
#[derive(Clone, Default)]
pub struct Credentials {
    /// TLS, with a client identity for mTLS (`ClientTlsConfig::identity`).
    pub tls: Option<ClientTlsConfig>,
    /// A bearer secret, sent as `authorization: Bearer …`.
    pub bearer: Option<String>,
}

impl std::fmt::Debug for Credentials {
    // Never the bearer secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("tls", &self.tls.is_some())
            .field("bearer", &self.bearer.is_some())
            .finish()
    }
}

/// Async client of one stateseal service. Cheap to clone: clones share one
/// HTTP/2 channel, which connects lazily and reconnects by itself.
#[derive(Clone)]
pub struct RequestStateClient {
    inner: proto::request_state_client::RequestStateClient<Channel>,
    auth: Option<MetadataValue<tonic::metadata::Ascii>>,
    timeout: Duration,
}

impl std::fmt::Debug for RequestStateClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RequestStateClient(..)")
    }
}

/// A client that could not be built (a bad address, TLS configuration or
/// bearer secret).
#[derive(Debug)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stateseal client configuration: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

impl RequestStateClient {
    /// A client of `target` (`host:port`, or a URI `http://…` / `https://…`)
    /// without credentials; 5 s per call.
    pub fn new(target: &str) -> Result<Self, ConfigError> {
        Self::with(target, Credentials::default(), Duration::from_secs(5))
    }

    /// A client with credentials and a per-call timeout.
    pub fn with(
        target: &str,
        credentials: Credentials,
        timeout: Duration,
    ) -> Result<Self, ConfigError> {
        let scheme = if credentials.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let uri = match target.split_once("://") {
            // With TLS credentials the connection must be TLS: tonic speaks
            // plaintext to an http:// URI whatever the TLS configuration.
            Some((s, _)) if credentials.tls.is_some() && !s.eq_ignore_ascii_case("https") => {
                return Err(ConfigError(
                    "TLS credentials need an https:// target (or host:port)".into(),
                ));
            }
            Some(_) => target.to_owned(),
            None => format!("{scheme}://{target}"),
        };
        let mut endpoint = Endpoint::from_shared(uri)
            .map_err(|_| ConfigError("the target is not a valid address".into()))?
            .connect_timeout(timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true);
        if let Some(tls) = credentials.tls {
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| ConfigError(format!("TLS: {e}")))?;
        }
        let auth = match credentials.bearer {
            Some(secret) => {
                let mut v: MetadataValue<tonic::metadata::Ascii> =
                    format!("Bearer {secret}").parse().map_err(|_| {
                        ConfigError("the bearer secret is not a valid header value".into())
                    })?;
                // Kept out of HPACK's index and of Debug output.
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        Ok(Self {
            inner: proto::request_state_client::RequestStateClient::new(endpoint.connect_lazy()),
            auth,
            timeout,
        })
    }

    /// The deadline of each call (unless given a shorter one).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn request<T>(&self, msg: T, timeout: Duration) -> Request<T> {
        let mut r = Request::new(msg);
        r.set_timeout(timeout);
        if let Some(auth) = &self.auth {
            r.metadata_mut().insert("authorization", auth.clone());
        }
        r
    }

    async fn call<T, R, F, Fut>(&self, msg: T, f: F) -> Result<R, StatesealError>
    where
        F: FnOnce(proto::request_state_client::RequestStateClient<Channel>, Request<T>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<R>, Status>>,
    {
        self.call_within(msg, self.timeout, f).await
    }

    /// [`Self::call`] within `deadline`, never more than the client's
    /// timeout.
    async fn call_within<T, R, F, Fut>(
        &self,
        msg: T,
        deadline: Duration,
        f: F,
    ) -> Result<R, StatesealError>
    where
        F: FnOnce(proto::request_state_client::RequestStateClient<Channel>, Request<T>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<R>, Status>>,
    {
        let timeout = deadline.min(self.timeout);
        let req = self.request(msg, timeout);
        // The whole call, connecting included, within the timeout.
        match tokio::time::timeout(timeout, f(self.inner.clone(), req)).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(StatesealError::from_status(&s)),
            Err(_) => Err(StatesealError::transport(
                Code::DeadlineExceeded,
                "timed out",
            )),
        }
    }

    /// Seals `state` under `binding`. With `input_requests_json` (an
    /// input_required result's `inputRequests`), the questions are validated
    /// and sealed as a manifest that Open filters answers against; `{}` asks
    /// nothing (Open drops every answer). An empty string seals no manifest:
    /// Open passes answers through unfiltered, never right for a round that
    /// asks.
    pub async fn seal(
        &self,
        binding: &Binding,
        state: Vec<u8>,
        ttl_seconds: u32,
        single_use: bool,
        input_requests_json: String,
    ) -> Result<Sealed, StatesealError> {
        let msg = proto::SealRequest {
            binding: Some(binding.to_proto()),
            state,
            ttl_seconds,
            single_use,
            input_requests_json,
        };
        let r = self
            .call(msg, |mut c, r| async move { c.seal(r).await })
            .await?;
        Ok(Sealed {
            request_state: r.request_state,
            expires_at_unix: r.expires_at_unix,
            key_id: r.key_id,
        })
    }

    /// Opens a token. A single-use token is consumed, or with
    /// [`OpenMode::Reserve`] reserved for a lease. With `attempt_id`, the same
    /// attempt opening again gets the same success, so a retry after a
    /// timeout is safe.
    pub async fn open(
        &self,
        request_state: &str,
        binding: &Binding,
        mode: OpenMode,
        lease_seconds: u32,
        attempt_id: &str,
        input_responses_json: String,
    ) -> Result<Opened, StatesealError> {
        self.open_carrying(
            request_state,
            binding,
            mode,
            lease_seconds,
            attempt_id,
            input_responses_json,
            &[],
        )
        .await
    }

    /// [`RequestStateClient::open`], carrying `commit`: reservations of
    /// earlier Opens (at most [`MAX_CARRIED_COMMITS`]) to commit in the same
    /// call, each as [`RequestStateClient::commit`] would; their outcomes are
    /// in [`Opened::commits`]. When this call fails, whether they were
    /// committed is unknown: commit them again (Commit is idempotent). More
    /// than the bound, or a reservation with a comma (none has one), is
    /// refused here, `INVALID_ARGUMENT`, without a call.
    #[allow(clippy::too_many_arguments)]
    pub async fn open_carrying(
        &self,
        request_state: &str,
        binding: &Binding,
        mode: OpenMode,
        lease_seconds: u32,
        attempt_id: &str,
        input_responses_json: String,
        commit: &[String],
    ) -> Result<Opened, StatesealError> {
        if commit.len() > MAX_CARRIED_COMMITS || commit.iter().any(|r| r.contains(',')) {
            return Err(StatesealError::transport(
                Code::InvalidArgument,
                "at most 16 reservations, none with a comma: not sent",
            ));
        }
        let msg = proto::OpenRequest {
            request_state: request_state.to_owned(),
            binding: Some(binding.to_proto()),
            mode: match mode {
                OpenMode::Consume => proto::OpenMode::Consume,
                OpenMode::Reserve => proto::OpenMode::Reserve,
            } as i32,
            lease_seconds,
            attempt_id: attempt_id.to_owned(),
            input_responses_json,
            commit: commit.join(","),
        };
        let r = self
            .call(msg, |mut c, r| async move { c.open(r).await })
            .await?;
        Ok(Opened {
            state: r.state,
            expires_at_unix: r.expires_at_unix,
            key_id: r.key_id,
            consumed: r.consumed,
            reservation: r.reservation,
            lease_expires_at_unix: r.lease_expires_at_unix,
            input_responses_json: r.input_responses_json,
            dropped: r.dropped.into_iter().map(|d| (d.key, d.reason)).collect(),
            lease_seconds: r.lease_seconds,
            commits: r
                .commits
                .into_iter()
                .map(|o| {
                    (!o.reason.is_empty()).then(|| StatesealError {
                        reason: o.reason,
                        code: Code::from_i32(o.code),
                        message: "carried commit refused".to_owned(),
                        from_stateseal: true,
                    })
                })
                .collect(),
        })
    }

    /// Makes a reservation a durable consumption (idempotent).
    pub async fn commit(&self, reservation: &str) -> Result<(), StatesealError> {
        self.commit_within(reservation, self.timeout).await
    }

    /// [`Self::commit`] within `deadline` (never more than the client's
    /// timeout): a try that outlives a third of its lease is of no use, the
    /// lease is renewed between tries.
    pub async fn commit_within(
        &self,
        reservation: &str,
        deadline: Duration,
    ) -> Result<(), StatesealError> {
        let msg = proto::CommitRequest {
            reservation: reservation.to_owned(),
        };
        self.call_within(msg, deadline, |mut c, r| async move { c.commit(r).await })
            .await
            .map(drop)
    }

    /// Extends a reservation's lease from now (`lease_seconds` 0 = the server
    /// default). LEASE_EXPIRED once another attempt took the token over.
    pub async fn renew(
        &self,
        reservation: &str,
        lease_seconds: u32,
    ) -> Result<Lease, StatesealError> {
        self.renew_within(reservation, lease_seconds, self.timeout)
            .await
    }

    /// [`Self::renew`] within `deadline` (never more than the client's
    /// timeout): a renewal that outlives its lease is of no use, so keep it
    /// well within the lease (the boundary gives each a third of it).
    pub async fn renew_within(
        &self,
        reservation: &str,
        lease_seconds: u32,
        deadline: Duration,
    ) -> Result<Lease, StatesealError> {
        let msg = proto::RenewRequest {
            reservation: reservation.to_owned(),
            lease_seconds,
        };
        let r = self
            .call_within(msg, deadline, |mut c, r| async move { c.renew(r).await })
            .await?;
        Ok(Lease {
            lease_expires_at_unix: r.lease_expires_at_unix,
            lease_seconds: r.lease_seconds,
        })
    }

    /// Gives a reservation back: the token can be opened again.
    pub async fn release(&self, reservation: &str) -> Result<(), StatesealError> {
        let msg = proto::ReleaseRequest {
            reservation: reservation.to_owned(),
        };
        self.call(msg, |mut c, r| async move { c.release(r).await })
            .await
            .map(drop)
    }
}

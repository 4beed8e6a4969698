//! The one rejection type every layer returns. Each variant has a fixed reason
//! string (the `google.rpc.ErrorInfo.reason` on the wire) and a fixed message:
//! no variant carries data, so no token, key or payload byte can end up in an
//! error by accident. `status.rs` turns it into a `tonic::Status`.

use std::fmt;

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reject {
    /// The request or token is not well formed (bad base64, truncated, bad
    /// header, missing binding, bad params JSON, bad digest length).
    Malformed,
    /// An input is over its configured limit (state, token, params, subject,
    /// TTL above the maximum).
    TooLarge,
    /// `method` is not one of `tools/call`, `prompts/get`, `resources/read`.
    BadMethod,
    /// The token is authentic but past its expiry.
    Expired,
    /// A single-use token was already consumed.
    Replayed,
    /// The token names a key that is unknown or retired.
    UnknownKey,
    /// The token failed authentication: tampered, or sealed for another
    /// tenant, subject, method or params digest.
    Rejected,
    /// The single-use ledger could not answer; the service fails closed.
    LedgerUnavailable,
    /// The server is at a work bound (canonicalizations queued); retry later.
    Overloaded,
    /// This replica's clock disagrees with the reference by more than the
    /// skew allowance: it neither seals nor opens until they agree.
    ClockUnsynced,
    /// A single-use token is reserved by another attempt whose lease lives.
    InUse,
    /// The reservation's lease ended (or was taken over) before Commit.
    LeaseExpired,
    /// `input_requests_json` is not a valid MCP `inputRequests` object, or a
    /// form field asks for a credential (policy `deny`).
    BadInputRequests,
    /// The audit log cannot be written and `--audit-on-failure closed` is in
    /// force: no decision is answered without its line.
    AuditUnavailable,
}

impl Reject {
    /// Every reason, for documentation checks and metrics.
    pub const ALL: [Reject; 14] = [
        Reject::Malformed,
        Reject::TooLarge,
        Reject::BadMethod,
        Reject::Expired,
        Reject::Replayed,
        Reject::UnknownKey,
        Reject::Rejected,
        Reject::LedgerUnavailable,
        Reject::Overloaded,
        Reject::ClockUnsynced,
        Reject::InUse,
        Reject::LeaseExpired,
        Reject::BadInputRequests,
        Reject::AuditUnavailable,
    ];

    /// The machine-readable reason (`google.rpc.ErrorInfo.reason`).
    pub const fn reason(self) -> &'static str {
        match self {
            Reject::Malformed => "MALFORMED",
            Reject::TooLarge => "TOO_LARGE",
            Reject::BadMethod => "BAD_METHOD",
            Reject::Expired => "EXPIRED",
            Reject::Replayed => "REPLAYED",
            Reject::UnknownKey => "UNKNOWN_KEY",
            Reject::Rejected => "REJECTED",
            Reject::LedgerUnavailable => "LEDGER_UNAVAILABLE",
            Reject::Overloaded => "OVERLOADED",
            Reject::ClockUnsynced => "CLOCK_UNSYNCED",
            Reject::InUse => "IN_USE",
            Reject::LeaseExpired => "LEASE_EXPIRED",
            Reject::BadInputRequests => "BAD_INPUT_REQUESTS",
            Reject::AuditUnavailable => "AUDIT_UNAVAILABLE",
        }
    }

    /// The fixed, human-readable message.
    pub const fn message(self) -> &'static str {
        match self {
            Reject::Malformed => "malformed request or token",
            Reject::TooLarge => "input exceeds a configured limit",
            Reject::BadMethod => "method must be tools/call, prompts/get or resources/read",
            Reject::Expired => "token expired",
            Reject::Replayed => "single-use token already consumed",
            Reject::UnknownKey => "token key is unknown or retired",
            Reject::Rejected => "token rejected",
            Reject::LedgerUnavailable => "single-use ledger unavailable",
            Reject::Overloaded => "server busy; retry later",
            Reject::ClockUnsynced => "server clock out of agreement; retry on another replica",
            Reject::InUse => "single-use token reserved by another attempt",
            Reject::LeaseExpired => "reservation lease expired",
            Reject::BadInputRequests => "input requests invalid or not allowed",
            Reject::AuditUnavailable => "audit log unavailable",
        }
    }
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for Reject {}

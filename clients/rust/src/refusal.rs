//! What the boundary answers when a stateseal call fails: the table all
//! three packages are tested against (`clients/boundary.json`).

use tonic::Code;

use crate::client::StatesealError;

/// JSON-RPC "Invalid params".
pub const INVALID_PARAMS: i32 = -32602;
/// JSON-RPC "Internal error".
pub const INTERNAL_ERROR: i32 = -32603;

/// The level a refusal is logged at. Nothing an end user sends is logged
/// at `Error`: it is kept for what an operator must act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Info,
    Warn,
    Error,
}

/// The branch a refusal takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Run the request again without its state, so the handler asks afresh.
    Reask,
    /// The token was already used.
    Replayed,
    /// Another attempt with this token is running its handler (retryable).
    InUse,
    /// Transient: retry.
    Unavailable,
    /// The token or what came with it was refused.
    Rejected,
    /// Between this server and stateseal (credentials, configuration).
    Internal,
}

impl Kind {
    /// The name clients/boundary.json gives it.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Reask => "reask",
            Kind::Replayed => "replayed",
            Kind::InUse => "in_use",
            Kind::Unavailable => "unavailable",
            Kind::Rejected => "rejected",
            Kind::Internal => "internal",
        }
    }
}

/// An MCP error or a re-ask, and the level to log it at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub kind: Kind,
    pub code: i32,
    pub message: &'static str,
    /// The JSON-RPC error's `data.reason`, when it has one.
    pub data_reason: Option<&'static str>,
    pub log: Level,
}

/// What a replayed token gets (`on_replay`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnReplay {
    /// REPLAYED is -32602 "requestState already used"; IN_USE is the
    /// retryable -32603 "Request in progress; retry later".
    #[default]
    Error,
    /// Both run the request again without its state (subject to `reask`).
    Reask,
}

const fn refusal(
    kind: Kind,
    code: i32,
    message: &'static str,
    data_reason: Option<&'static str>,
    log: Level,
) -> Refusal {
    Refusal {
        kind,
        code,
        message,
        data_reason,
        log,
    }
}

/// The answer to a request whose token stateseal refused to open.
pub fn open_refusal(e: &StatesealError, on_replay: OnReplay, reask: bool) -> Refusal {
    if e.client_fault() && on_replay == OnReplay::Error {
        match e.reason.as_str() {
            "REPLAYED" => {
                return refusal(
                    Kind::Replayed,
                    INVALID_PARAMS,
                    "requestState already used",
                    Some("request_state_used"),
                    Level::Warn,
                )
            }
            "IN_USE" => {
                return refusal(
                    Kind::InUse,
                    INTERNAL_ERROR,
                    "Request in progress; retry later",
                    Some("in_progress"),
                    Level::Info,
                )
            }
            _ => {}
        }
    }
    let reask_on: &[&str] = match on_replay {
        OnReplay::Error => &["EXPIRED"],
        OnReplay::Reask => &["REPLAYED", "EXPIRED", "IN_USE"],
    };
    if e.client_fault() && reask && reask_on.contains(&e.reason.as_str()) {
        return refusal(Kind::Reask, 0, "", None, Level::Info);
    }
    call_refusal(e, false)
}

/// The answer to any other failed stateseal call (`sealing`: the Seal of a
/// handler's result, where a client fault is this server's own).
pub fn call_refusal(e: &StatesealError, sealing: bool) -> Refusal {
    if e.retryable() {
        return refusal(
            Kind::Unavailable,
            INTERNAL_ERROR,
            "Temporarily unavailable; retry",
            None,
            Level::Warn,
        );
    }
    if e.client_fault() && !sealing {
        // A message stateseal's transport refused as too large is the end
        // user's doing: not an operator alarm.
        let log = if e.from_stateseal {
            Level::Warn
        } else {
            Level::Info
        };
        return refusal(
            Kind::Rejected,
            INVALID_PARAMS,
            "Invalid or expired requestState",
            Some("invalid_request_state"),
            log,
        );
    }
    refusal(
        Kind::Internal,
        INTERNAL_ERROR,
        "Internal error",
        None,
        Level::Error,
    )
}

/// An Open (same attempt id) or a Release is sent again: the connection was
/// lost or the call timed out.
pub fn resend(e: &StatesealError) -> bool {
    !e.from_stateseal && matches!(e.code, Code::Unavailable | Code::DeadlineExceeded)
}

/// A Commit is retried (it is idempotent): any transient failure.
pub fn retry_commit(e: &StatesealError) -> bool {
    e.retryable()
}

/// Renewing stops: another attempt took the token over.
pub fn renewal_lost(e: &StatesealError) -> bool {
    e.from_stateseal && e.reason == "LEASE_EXPIRED"
}

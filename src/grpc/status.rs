//! The one place errors become `tonic::Status`: a fixed code and message per
//! reason, with a `google.rpc.ErrorInfo` (domain `stateseal`) in the details.

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::domain::error::Reject;

/// The `google.rpc.ErrorInfo.domain` of every rejection.
pub const DOMAIN: &str = "stateseal";

impl Reject {
    pub const fn code(self) -> Code {
        match self {
            Reject::Malformed | Reject::TooLarge | Reject::BadMethod | Reject::BadInputRequests => {
                Code::InvalidArgument
            }
            Reject::Expired | Reject::UnknownKey | Reject::LeaseExpired => Code::FailedPrecondition,
            Reject::InUse => Code::Aborted,
            Reject::Replayed => Code::AlreadyExists,
            Reject::Rejected => Code::PermissionDenied,
            Reject::LedgerUnavailable | Reject::ClockUnsynced | Reject::AuditUnavailable => {
                Code::Unavailable
            }
            Reject::Overloaded => Code::ResourceExhausted,
        }
    }
}

impl From<Reject> for Status {
    fn from(r: Reject) -> Status {
        Status::with_error_details(
            r.code(),
            r.message(),
            ErrorDetails::with_error_info(r.reason(), DOMAIN, HashMap::<String, String>::new()),
        )
    }
}

/// The reason of a status produced by stateseal, if any.
pub fn reason_of(status: &Status) -> Option<String> {
    status
        .get_details_error_info()
        .filter(|i| i.domain == DOMAIN)
        .map(|i| i.reason)
}

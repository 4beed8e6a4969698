//! The gRPC face: the one path from the proto to the domain core and back
//! ([`service`]), reasons as statuses ([`status`]) and caller
//! authentication ([`auth`]).

pub mod auth;
pub mod service;
pub mod status;

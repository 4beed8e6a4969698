//! The gRPC face: the one path from the proto to the domain core and back
//! ([`service`]), reasons as statuses ([`status`]) and caller
//! authentication ([`auth`]), and the bounded pool that canonicalizes big
//! params ([`canon_pool`]).

pub mod auth;
pub mod canon_pool;
pub mod service;
pub mod status;

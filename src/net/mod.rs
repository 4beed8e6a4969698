//! Transport: the connection registry and its counters ([`conns`]), the
//! listener, stream and in-flight limits ([`limits`]), and TLS ([`tls`]).

pub mod conns;
pub mod limits;
pub mod tls;

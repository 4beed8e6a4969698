//! Transport: the connection registry and its counters ([`conns`]), the
//! limits and their defaults ([`limits`]), accepting connections under them
//! ([`accept`]), the request-byte budget ([`budget`]), and TLS ([`tls`]).

pub mod accept;
pub mod budget;
pub mod conns;
pub mod limits;
pub mod tls;

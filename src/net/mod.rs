//! Transport: the connection registry and its counters ([`conns`]), the
//! limits and their defaults ([`limits`]), accepting connections under them
//! ([`accept`]), the request-byte budget ([`budget`]), TLS ([`tls`]), and
//! serving HTTP/2 connections with graceful closes ([`serve`]).

pub mod accept;
pub mod budget;
pub mod conns;
pub mod limits;
pub mod serve;
pub mod tls;

//! Operations: the metrics registry made once per server and handed down
//! ([`metrics`]), keyset reload ([`reload`]) and process hardening
//! ([`hardening`]).

pub mod hardening;
pub mod metrics;
pub mod reload;

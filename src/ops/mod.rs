//! Operations: the metrics registry made once per server and handed down
//! ([`metrics`]), keyset reload ([`reload`]), the audit log ([`audit`]) and
//! process hardening ([`hardening`]).

pub mod audit;
pub mod hardening;
pub mod kek;
pub mod metrics;
pub mod reload;

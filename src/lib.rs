//! # stateseal
//!
//! Seals and opens the `requestState` of MCP Multi-Round-Trip Requests
//! (MCP 2026-07-28) for every replica of an MCP server at once.
//!
//! ## Threat model
//! The MCP client, and anyone on its path, controls the `requestState` it
//! echoes back. stateseal assumes an attacker who can read, replay, truncate,
//! extend, splice and forge tokens, replay them to other replicas and other
//! tenants, and send any bytes to the gRPC API. It trusts its keyset file, its
//! ledger storage and the authentication of its callers (the MCP servers).
//!
//! ## Guarantees
//! - **Integrity and confidentiality**: XChaCha20-Poly1305 with random 192-bit
//!   nonces under HKDF-SHA256 subkeys; any changed byte is rejected and the
//!   token reveals nothing of the state ([`token`]).
//! - **Binding**: a token opens only for the tenant, subject, method and
//!   params digest it was sealed for, and only before its expiry ([`binding`]).
//! - **Single use**: a single-use token is accepted at most once; the
//!   consumption is durable before the answer, and a failing ledger fails
//!   closed ([`ledger`]).
//! - **Rotation**: staged → primary → retired keys ([`keyring`]).
//! - **No secret leaks**: keys zeroize on drop and have no revealing `Debug`;
//!   logs never hold keys, state or tokens — only tenants, key ids, reasons
//!   and counts. Errors carry fixed messages ([`error`], [`status`]).
//!
//! ## Map, by layer (lowest first)
//! A module names modules on its own layer or below, never above;
//! `.ci/layers.py` checks it (no import cycle, no upward import).
//! - Foundation: [`error`] (rejection reasons), [`canon`] (RFC 8785),
//!   [`clock`] (injected time; the clock guard over a reference clock the
//!   ledgers implement), [`conns`] (connection registry and counters),
//!   [`status`], [`hardening`].
//! - Binding and keys: [`binding`] (tenant, method, params digest),
//!   [`manifest`], [`keyring`] (keyset file, rotation, HKDF subkeys).
//! - Token format: [`token`] (seal, bounds-checked parse, open).
//! - Ledgers: [`ledger`] (the trait; [`ledger::sled`], [`ledger::postgres`]).
//! - Domain core: [`sealer`] (limits, expiry, single use; reports to a
//!   `LedgerFigures` it is given).
//! - Transport and callers: [`limits`], [`tls`], [`auth`], [`reload`].
//! - Operations: [`metrics`] (one registry per server, handed down).
//! - gRPC face: [`service`]; then [`server`] (listeners and background
//!   tasks) and [`config`] (command line, environment, the composition
//!   root).

// No unsafe code ships. Only the unit tests that read a dropped key's
// memory back (keyring/tests.rs) allow it, locally.
#![cfg_attr(not(test), forbid(unsafe_code))]
#![cfg_attr(test, deny(unsafe_code))]
#![deny(clippy::mem_forget)]

pub mod auth;
pub mod binding;
pub mod canon;
pub mod clock;
pub mod config;
pub mod conns;
pub mod error;
pub mod hardening;
pub mod keyring;
pub mod ledger;
pub mod limits;
pub mod manifest;
pub mod metrics;
pub mod reload;
pub mod sealer;
pub mod server;
pub mod service;
pub mod status;
pub mod tls;
pub mod token;

/// Generated from `proto/stateseal/v1/stateseal.proto`.
#[allow(clippy::all, missing_docs)]
pub mod proto {
    tonic::include_proto!("stateseal.v1");
    /// The encoded descriptor set, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/stateseal_descriptor.bin"));

    // Redacting Debug: lengths and non-secret fields only, never the state,
    // a token, a subject or params.
    use std::fmt;

    impl fmt::Debug for Binding {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            let params = match &self.params {
                Some(binding::Params::ParamsDigest(d)) => format!("digest({} bytes)", d.len()),
                Some(binding::Params::ParamsJson(j)) => format!("json({} bytes)", j.len()),
                None => "none".into(),
            };
            f.debug_struct("Binding")
                .field("subject_len", &self.subject.len())
                .field("method", &self.method)
                .field("params", &params)
                .finish()
        }
    }
    impl fmt::Debug for SealRequest {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("SealRequest")
                .field("binding", &self.binding)
                .field("state_len", &self.state.len())
                .field("ttl_seconds", &self.ttl_seconds)
                .field("single_use", &self.single_use)
                .field("input_requests_len", &self.input_requests_json.len())
                .finish()
        }
    }
    impl fmt::Debug for SealResponse {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("SealResponse")
                .field("request_state_len", &self.request_state.len())
                .field("expires_at_unix", &self.expires_at_unix)
                .field("key_id", &self.key_id)
                .finish()
        }
    }
    impl fmt::Debug for OpenRequest {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("OpenRequest")
                .field("request_state_len", &self.request_state.len())
                .field("binding", &self.binding)
                .field("mode", &self.mode)
                .field("lease_seconds", &self.lease_seconds)
                .field("attempt_id_len", &self.attempt_id.len())
                .field("input_responses_len", &self.input_responses_json.len())
                .finish()
        }
    }
    impl fmt::Debug for OpenResponse {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("OpenResponse")
                .field("state_len", &self.state.len())
                .field("expires_at_unix", &self.expires_at_unix)
                .field("key_id", &self.key_id)
                .field("consumed", &self.consumed)
                .field("reservation_len", &self.reservation.len())
                .field("lease_expires_at_unix", &self.lease_expires_at_unix)
                .field("input_responses_len", &self.input_responses_json.len())
                .field("dropped", &self.dropped.len())
                .finish()
        }
    }
    impl fmt::Debug for CommitRequest {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("CommitRequest")
                .field("reservation_len", &self.reservation.len())
                .finish()
        }
    }
    impl fmt::Debug for ReleaseRequest {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("ReleaseRequest")
                .field("reservation_len", &self.reservation.len())
                .finish()
        }
    }
}

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
//!   token reveals nothing of the state (`domain::token`).
//! - **Binding**: a token opens only for the tenant, subject, method and
//!   params digest it was sealed for, and only before its expiry (`domain::binding`).
//! - **Single use**: a single-use token is accepted at most once; the
//!   consumption is durable before the answer, and a failing ledger fails
//!   closed (`ledger`).
//! - **Rotation**: staged → primary → retired keys (`domain::keyring`).
//! - **No secret leaks**: keys zeroize on drop and have no revealing `Debug`;
//!   logs never hold keys, state or tokens — only tenants, key ids, reasons
//!   and counts. Errors carry fixed messages (`domain::error`, `grpc::status`).
//!
//! ## Map, by layer (lowest first)
//! A module names modules on its own layer or below, never above;
//! `.ci/layers.py` checks it (no import cycle, no upward import).
//! - `clock/`: injected time; the clock guard over a reference clock the
//!   ledgers implement.
//! - `ledger/`: the single-use ledger trait and its sled and PostgreSQL
//!   backends.
//! - `domain/`: rejection reasons, RFC 8785, binding, manifest, keyring,
//!   the token format and the sealer. No tonic, no clap, no statics.
//! - `net/`: connection registry, listener and stream limits, TLS.
//! - `ops/`: the metrics registry (one per server, handed down), keyset
//!   reload, process hardening.
//! - `grpc/`: the one proto ↔ core path, reasons as statuses, caller
//!   authentication.
//! - `cli/`: the command line and environment, clap types only.
//! - `app/`: the composition root (`build`: arguments → prepared server)
//!   and the server with its listeners and background tasks.
//!
//! The modules are private. The public surface is re-exported below;
//! tests, benches and fuzz targets reach the rest through the hidden
//! [`internals`] module, which is not a stable interface.

// No unsafe code ships. Only the unit tests that read a dropped key's
// memory back (keyring/tests.rs) allow it, locally.
#![cfg_attr(not(test), forbid(unsafe_code))]
#![cfg_attr(test, deny(unsafe_code))]
#![deny(clippy::mem_forget)]

mod app;
mod cli;
mod clock;
mod domain;
mod grpc;
mod ledger;
mod net;
mod ops;

pub use app::build::{ConfigError, Prepared};
pub use app::server::{run, runtime, ServeOptions};
pub use cli::{AuditCommand, Cli, Command, KekUri, KeysCommand, LogFormat, ServeArgs};
pub use clock::{Clock, SystemClock};
pub use domain::error::Reject;
pub use domain::keyring::{human_age, KeyListing, KeyState, Keyring, KeysetFile};
pub use ops::audit::verify::{unhex32, verify as verify_audit_log, Report as AuditReport};
pub use ops::hardening::{disable_core_dumps, withhold_panic_details};
pub use ops::kek::{generate as generate_kek, open as open_kek};

/// The server's global allocator (set in `src/main.rs`, which says why); the
/// benches that measure as the server runs set it too. Not set here: a
/// library leaves the choice to its binary.
pub use mimalloc::MiMalloc as Allocator;

/// The modules the tests, benches and fuzz targets drive directly. Not a
/// stable interface.
#[doc(hidden)]
pub mod internals {
    pub use crate::app::{build, server};
    pub use crate::domain::{binding, canon, error, keyring, manifest, sealer, token};
    pub use crate::grpc::{auth, canon_pool, service, status};
    pub use crate::net::{accept, conns, limits, serve};
    pub use crate::ops::{audit, hardening, kek, metrics};
    /// The clock and the clock guard.
    pub mod clock {
        pub use crate::clock::*;
    }
    /// The ledger trait and its backends.
    pub mod ledger {
        pub use crate::ledger::*;
    }
}

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
                .field("commit", &self.commit.len())
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
                .field("commits", &self.commits)
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
    impl fmt::Debug for RenewRequest {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("RenewRequest")
                .field("reservation_len", &self.reservation.len())
                .field("lease_seconds", &self.lease_seconds)
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

//! # stateseal-rmcp
//!
//! stateseal in front of an [rmcp](https://docs.rs/rmcp) server: the
//! `requestState` of MCP multi-round-trip requests (MCP 2026-07-28) sealed
//! (XChaCha20-Poly1305), bound to the audience, the principal, the method
//! and the params, filtered against the questions asked, and consumed at
//! most once across every replica, whatever their language. The same
//! behaviour, reactions and error table as the Python and TypeScript
//! packages (`clients/boundary.json`).
//!
//! ```no_run
//! # use stateseal_rmcp::{RequestStateClient, StatesealBoundary};
//! # fn f<H: rmcp::ServerHandler>(my_server: H) -> Result<(), Box<dyn std::error::Error>> {
//! let client = RequestStateClient::new("127.0.0.1:50051")?;
//! let boundary = StatesealBoundary::new(client, "my-mcp-service");
//! let handler = boundary.wrap(my_server); // an rmcp ServerHandler
//! # Ok(()) }
//! ```

pub mod binding;
mod boundary;
mod client;
mod handler;
pub mod refusal;
pub mod steps;

#[allow(clippy::all, missing_docs)]
mod proto {
    tonic::include_proto!("stateseal.v1");
}

mod reasons {
    include!(concat!(env!("OUT_DIR"), "/reasons.rs"));
}

pub use boundary::{
    principal_from_extensions, Builder, Principal, PrincipalFn, PrincipalRefused, Sealed,
    StatesealBoundary, DEFAULT_COMMIT_DELAY, DEFAULT_COMMIT_WINDOW,
    DEFAULT_MAX_INPUT_RESPONSES_BYTES, DEFAULT_MAX_PENDING, DEFAULT_MAX_REQUEST_STATE_BYTES,
    MAX_COMMIT_DELAY,
};
pub use client::{
    code_name, Binding, ConfigError, Credentials, Lease, OpenMode, Opened, RequestStateClient,
    Sealed as SealedState, StatesealError, MAX_CARRIED_COMMITS,
};
pub use refusal::OnReplay;
/// The TLS configuration type [`Credentials::tls`] takes (tonic's).
pub use tonic::transport::{Certificate, ClientTlsConfig, Identity};

//! The integration tests: one binary, one module per area, helpers in
//! [`common`] (a [`common::TestServer`] in process, `common::process` for
//! the real binary, PostgreSQL claims in `common::pg`).
//!
//! Run one area with `cargo test --test it AREA::`, one test with
//! `cargo test --test it -- --exact AREA::NAME`.
#![allow(clippy::unwrap_used)]

mod at_most_once;
mod audit;
mod auth;
mod binding_vectors;
mod clock;
mod common;
mod disk;
mod docs;
mod failure;
mod golden;
mod grpc;
mod hostile;
mod hygiene;
mod idle_flood;
mod kek;
mod ledger_bound;
mod ledger_contract;
mod manifest;
mod patroni;
mod pg_tls;
mod pod;
mod process;
mod properties;
mod replicas;
mod rfc8785;
mod rotation;
mod sealer;

//! The composition root: the command line and environment ([`config`])
//! become a [`Prepared`](config::Prepared) server, which [`server`] runs
//! with its listeners and background tasks.

pub mod config;
pub mod server;

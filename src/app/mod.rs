//! The composition root: [`build`] turns the parsed command line
//! ([`crate::cli`]) into a [`Prepared`](build::Prepared) server, which
//! [`server`] runs with its listeners and background tasks.

pub mod build;
pub mod server;

//! The load generator's parts (benches/load.rs runs them), lowest first:
//! - [`baselines`]: what stateseal is measured against (the echo server and
//!   its journal, the fdatasync file, the handoff thread, redis-server);
//! - [`clients`]: the bench's connections and calls;
//! - [`args`]: the command line;
//! - [`server`]: the stateseal server this bench starts;
//! - [`scenarios`]: what each scenario measures, its op and its tokens;
//! - [`runner`]: one window of one scenario, its callers and latencies;
//! - [`measure`]: what the server and the disk did over each window, and
//!   each scenario's totals;
//! - [`samples`]: the soak's samples of the server;
//! - [`h2load`]: the request bodies for `benches/h2load.sh`;
//! - [`rounds`]: the interleaved rounds;
//! - [`report`]: the table, the smoke run's checks, `--plot` and `--json`.
//!
//! Each uses only those above it in this list.

pub mod args;
pub mod baselines;
pub mod clients;
pub mod h2load;
pub mod measure;
pub mod report;
pub mod rounds;
pub mod runner;
pub mod samples;
pub mod scenarios;
pub mod server;

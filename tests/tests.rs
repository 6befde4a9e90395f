//! kunci's integration tests: one binary, one module per area.

mod abuse;
mod bench;
mod client;
mod core;
mod endpoint;
mod fencing;
mod protocol;
mod regression;
mod restart;
mod run_command;
mod server;
mod simulation;
mod util;

//! kunci's integration tests: one binary, one module per area.

mod client;
mod run_command;
mod server;
mod util;

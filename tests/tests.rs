//! kunci's integration tests: one binary, one module per area.

mod abuse;
mod core;
mod protocol;
mod restart;
mod server;
mod simulation;
mod util;

//! kunci's integration tests: one binary, one module per area.

mod client;
mod server;
mod util;

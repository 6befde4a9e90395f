//! kunci's integration tests: one binary, one module per area.

mod abuse;
mod restart;
mod server;
mod util;

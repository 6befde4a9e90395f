//! kunci's integration tests: one binary, one module per area.

mod core;
mod protocol;
mod simulation;
mod util;

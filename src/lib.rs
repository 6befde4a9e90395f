//! kunci — a small, exact, fast lock server.
//!
//! `acquire(key, wait, lease)` with bounded FIFO waiting, a lease the
//! server reclaims when a client dies, and a strictly increasing u64
//! fencing token per grant. The wire protocol is described in
//! `docs/PROTOCOL.md`.
//!
//! # Layout
//!
//! - [`protocol`] — frames: decode, encode, limits, error codes; no IO.
//! - [`core`] — the sans-IO server: lock table, waiter queues, leases,
//!   and the endpoint that owns every connection's bytes, phase and
//!   deadlines; every call takes `now`, outputs are pulled.
//! - [`server`] — the mio shell: accept, read, write, close, the clock and
//!   the state directory; a shutdown handle (the binary installs signals).
//! - [`client`] — the official client: sessions, deadlines, correlation,
//!   [`client::Ticket`]; the rules live in a sans-IO engine.
//! - [`metrics`] — Prometheus exposition and its bounded HTTP exchange.
//! - [`addr`] — server addresses (`HOST:PORT`, `unix:PATH`).
//! - [`stream`] — the one TCP/Unix stream type the server, client and bench share.
//! - `decimal` — durations and rates as decimal text, without floats.
//! - [`timer_wheel`] — the hierarchical timer wheel and the 1 ms tick
//!   rounding, shared by the core, the endpoint and the client engine.
//! - `cli` — the `kunci` subcommands (feature `cli`, on by default; without
//!   it the library builds without the binary's dependencies); `main.rs`
//!   only calls `cli::main`.

// The crate's own tests include helpers of the integration tests
// (`tests/util/etcd.rs`), which name the crate `kunci`.
#[cfg(test)]
extern crate self as kunci;

pub mod addr;
#[cfg(feature = "cli")]
pub mod cli;
pub mod client;
pub mod core;
pub(crate) mod decimal;
#[cfg(any(feature = "cli", feature = "etcd"))]
pub(crate) mod mailbox;
pub mod metrics;
pub mod protocol;
pub mod server;
pub mod stream;
pub mod timer_wheel;
#[cfg(feature = "tls")]
pub mod tls;

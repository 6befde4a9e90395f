//! kunci's integration tests: one binary, one module per area.

mod abuse;
mod access;
mod access_client;
mod access_server;
mod adoption;
mod bench;
mod client;
mod core;
mod edges;
mod endpoint;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "etcd")]
mod etcd_interop;
#[cfg(feature = "etcd")]
mod etcd_leader;
mod fencing;
mod grant_quota;
mod hand_over;
mod hostile;
mod leader;
mod metrics;
mod observe;
mod operations;
mod permit_options;
mod permits_server;
mod proclaim;
mod protocol;
mod regression;
mod restart;
mod run_command;
mod server;
mod simulation;
#[cfg(feature = "tls")]
mod tls;
mod util;
mod who;
mod who_server;

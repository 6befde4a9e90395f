//! The seam between a [`Client`](super::Client) and where its requests
//! go: kunci servers through the I/O thread (`io.rs`), or an etcd cluster
//! (`etcd/`). [`Backend`] starts the one the addresses name and forwards
//! every call to it.

use std::sync::Arc;

use super::config::Config;
#[cfg(feature = "etcd")]
use super::etcd;
use super::handoff::{Message, Reply};
use super::io;
use super::vocabulary::{Outcome, Submission};
use crate::addr::Address;

/// Where requests go: kunci servers through the I/O thread, or an etcd
/// cluster (`etcd://`, docs/ETCD.md). Both give the same outcomes.
pub(crate) enum Backend {
    Kunci(Arc<io::Shared>),
    #[cfg(feature = "etcd")]
    Etcd(Arc<etcd::Shared>),
}

/// The TLS configuration of `etcds://` members.
#[cfg(all(feature = "etcd", feature = "tls"))]
fn etcd_tls(tls: bool, config: &Config) -> std::io::Result<etcd::http::Tls> {
    if !tls {
        return Ok(None);
    }
    crate::tls::client_config(&config.tls)
        .map(Some)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("TLS: {e}")))
}

#[cfg(all(feature = "etcd", not(feature = "tls")))]
fn etcd_tls(tls: bool, _: &Config) -> std::io::Result<etcd::http::Tls> {
    if tls {
        return Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "etcds:// needs kunci built with the `tls` feature",
        ));
    }
    Ok(None)
}

impl Backend {
    pub(crate) fn start(servers: Vec<Address>, config: &Config) -> std::io::Result<Backend> {
        let etcd: Vec<&Address> = servers
            .iter()
            .filter(|address| matches!(address, Address::Etcd { .. }))
            .collect();
        if etcd.is_empty() {
            let tls = io::tls_config(&servers, config)?;
            return io::start(servers, config, tls).map(Backend::Kunci);
        }
        if etcd.len() != servers.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "etcd:// addresses cannot be mixed with kunci servers",
            ));
        }
        #[cfg(feature = "etcd")]
        {
            let tls = servers
                .iter()
                .any(|address| matches!(address, Address::Etcd { tls: true, .. }));
            let layout = crate::addr::EtcdLayout::of(&servers)
                .map_err(|why| std::io::Error::new(std::io::ErrorKind::InvalidInput, why))?;
            let endpoints = servers
                .into_iter()
                .flat_map(|address| match address {
                    Address::Etcd { endpoints, .. } => endpoints,
                    _ => Vec::new(),
                })
                .collect();
            let tls = etcd_tls(tls, config)?;
            etcd::Shared::start(
                endpoints,
                config.connect_timeout,
                config.etcd_credentials.clone(),
                tls,
                layout,
            )
            .map(Backend::Etcd)
        }
        #[cfg(not(feature = "etcd"))]
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "this kunci was built without etcd support (cargo feature `etcd`)",
        ))
    }

    pub(crate) fn call(&self, submission: Submission<Reply>) -> Outcome {
        match self {
            Backend::Kunci(shared) => shared.call(submission),
            #[cfg(feature = "etcd")]
            Backend::Etcd(shared) => shared.call(submission),
        }
    }

    pub(crate) fn submit(&self, submission: Submission<Reply>) -> bool {
        match self {
            Backend::Kunci(shared) => shared.submit(submission),
            #[cfg(feature = "etcd")]
            Backend::Etcd(shared) => shared.submit(submission),
        }
    }

    pub(crate) fn send(&self, message: Message) -> bool {
        match self {
            Backend::Kunci(shared) => shared.send(message),
            #[cfg(feature = "etcd")]
            Backend::Etcd(shared) => shared.send(message),
        }
    }

    pub(crate) fn shutdown_notices(&self) -> u64 {
        match self {
            Backend::Kunci(shared) => shared.shutdown_notices(),
            #[cfg(feature = "etcd")]
            Backend::Etcd(_) => 0,
        }
    }

    pub(crate) fn last_connect_failure(&self) -> Option<String> {
        match self {
            Backend::Kunci(shared) => shared.last_connect_failure(),
            #[cfg(feature = "etcd")]
            Backend::Etcd(_) => None,
        }
    }

    pub(crate) fn unresolved_names(&self) -> Vec<String> {
        match self {
            Backend::Kunci(shared) => shared.unresolved_names(),
            #[cfg(feature = "etcd")]
            Backend::Etcd(_) => Vec::new(),
        }
    }

    pub(crate) fn close(&self) {
        match self {
            Backend::Kunci(shared) => shared.close(),
            #[cfg(feature = "etcd")]
            Backend::Etcd(shared) => shared.close(),
        }
    }
}

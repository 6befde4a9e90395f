//! The metrics listener's sockets: accept, read one small request, write
//! the answer, close. Every rule about the bytes lives in
//! [`crate::metrics::http`]; this is only the syscalls, run by the
//! server's own event loop.
//!
//! Nobody scraping costs nothing: the listener sits in the poller, and a
//! deadline exists only while a scrape is open. A scrape costs the loop
//! O(1) in the number of connections (spec §4, v5): the core's own counts,
//! and process figures read from `/proc` at most once a second.

use std::io::{self, Read, Write};

use log::{debug, warn};
use mio::{Interest, Registry, Token};
use slab::Slab;

use super::listener::{Listener, Peer};
use crate::addr::Address;
use crate::core::{Core, Micros};
use crate::metrics::http::Exchange;
use crate::metrics::{ProcessSample, Snapshot, render};
use crate::stream::Stream;

/// Scrapes served at once; more are closed at accept. Prometheus sends one
/// at a time per target; the slots are there for hosts that half-send a
/// request, each held at most [`EXCHANGE_TIMEOUT`](crate::metrics::http::EXCHANGE_TIMEOUT).
pub const SCRAPES_MAX: usize = 32;
/// Scrapes one peer address may hold at once (every unix-socket peer
/// counts as one), so that filling the slots takes eight hosts, and one
/// host's half-sent requests never keep another's scrape out (issues 27,
/// 38).
pub const SCRAPES_PER_PEER_MAX: usize = 4;

/// The listener's token; scrape `slot` has `SCRAPE_TOKEN_BASE + slot`.
/// Far above any client connection's id and below the listeners' tokens.
pub const METRICS_LISTENER_TOKEN: Token = Token(usize::MAX / 2);
const SCRAPE_TOKEN_BASE: usize = usize::MAX / 2 + 1;

/// Whether `token` belongs to the metrics endpoint.
pub fn is_metrics_token(token: Token) -> bool {
    (METRICS_LISTENER_TOKEN.0..SCRAPE_TOKEN_BASE + SCRAPES_MAX).contains(&token.0)
}

struct Scrape {
    stream: Stream,
    exchange: Exchange,
    /// The peer's IP address; `None` on a unix socket.
    peer: Option<std::net::IpAddr>,
}

/// The metrics listener and its open scrapes.
pub struct MetricsEndpoint {
    listener: Listener,
    address: Address,
    scrapes: Slab<Scrape>,
    process: ProcessSample,
}

impl MetricsEndpoint {
    /// Binds `address` and registers it with `registry`.
    pub fn bind(address: &Address, unix_mode: u32, registry: &Registry) -> io::Result<Self> {
        let mut listener = Listener::bind(address, unix_mode)
            .map_err(|e| io::Error::new(e.kind(), format!("--metrics {address}: {e}")))?;
        registry.register(&mut listener, METRICS_LISTENER_TOKEN, Interest::READABLE)?;
        let address = listener.local_address()?;
        Ok(MetricsEndpoint {
            listener,
            address,
            scrapes: Slab::with_capacity(SCRAPES_MAX),
            process: ProcessSample::default(),
        })
    }

    /// The address actually bound.
    pub fn address(&self) -> &Address {
        &self.address
    }

    /// The earliest scrape deadline, or `None` when none is open.
    pub fn poll_timeout(&self) -> Option<Micros> {
        self.scrapes
            .iter()
            .map(|(_, scrape)| scrape.exchange.deadline())
            .min()
    }

    /// Handles a readiness event for `token`.
    pub fn ready(&mut self, token: Token, registry: &Registry, core: &Core, now: Micros) {
        if token == METRICS_LISTENER_TOKEN {
            self.accept_all(registry, now);
        } else {
            let slot = token.0 - SCRAPE_TOKEN_BASE;
            self.serve(slot, registry, core, now);
        }
    }

    /// Closes every scrape whose deadline has passed.
    pub fn expire(&mut self, registry: &Registry, now: Micros) {
        if self.scrapes.is_empty() {
            return;
        }
        let late: Vec<usize> = self
            .scrapes
            .iter()
            .filter(|(_, scrape)| scrape.exchange.deadline() <= now)
            .map(|(slot, _)| slot)
            .collect();
        for slot in late {
            debug!("metrics: scrape {slot} took too long; closing it");
            self.close(slot, registry);
        }
    }

    /// Stops listening and closes every scrape (at shutdown).
    pub fn close_all(&mut self, registry: &Registry) {
        let _ = registry.deregister(&mut self.listener);
        self.listener.remove_file();
        let slots: Vec<usize> = self.scrapes.iter().map(|(slot, _)| slot).collect();
        for slot in slots {
            self.close(slot, registry);
        }
    }

    fn accept_all(&mut self, registry: &Registry, now: Micros) {
        loop {
            let (stream, peer) = match self.listener.accept() {
                Ok((stream, Peer::Tcp(peer))) => (stream, Some(peer.ip())),
                Ok((stream, Peer::Unix)) => (stream, None),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => continue,
                Err(e) => {
                    // Out of descriptors, most likely: the scraper retries
                    // at its next interval; client connections go first.
                    warn!("metrics: accept: {e}");
                    return;
                }
            };
            if self.scrapes.len() >= SCRAPES_MAX {
                debug!("metrics: {SCRAPES_MAX} scrapes open; closing a new one");
                continue; // dropping the stream closes it
            }
            let held = self
                .scrapes
                .iter()
                .filter(|(_, scrape)| scrape.peer == peer)
                .count();
            if held >= SCRAPES_PER_PEER_MAX {
                debug!("metrics: {peer:?} holds {held} scrapes; closing a new one");
                continue;
            }
            let entry = self.scrapes.vacant_entry();
            let slot = entry.key();
            let scrape = entry.insert(Scrape {
                stream,
                exchange: Exchange::new(now),
                peer,
            });
            if let Err(e) = registry.register(
                &mut scrape.stream,
                Token(SCRAPE_TOKEN_BASE + slot),
                Interest::READABLE | Interest::WRITABLE,
            ) {
                warn!("metrics: register: {e}");
                self.scrapes.remove(slot);
            }
        }
    }

    /// Reads what the scraper sent, answers once the request is whole,
    /// writes as much as the socket takes, and closes when done.
    fn serve(&mut self, slot: usize, registry: &Registry, core: &Core, now: Micros) {
        let process = &mut self.process;
        let Some(scrape) = self.scrapes.get_mut(slot) else {
            return;
        };
        let mut buffer = [0u8; 1024];
        let mut broken = false;
        while scrape.exchange.wants_input() {
            match scrape.stream.read(&mut buffer) {
                Ok(0) => scrape.exchange.peer_closed(),
                Ok(n) => scrape.exchange.receive(&buffer[..n], |out| {
                    render(&Snapshot::of(core), process.get(now), out)
                }),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    broken = true;
                    break;
                }
            }
        }
        while !broken && !scrape.exchange.output().is_empty() {
            match scrape.stream.write(scrape.exchange.output()) {
                Ok(0) => broken = true,
                Ok(n) => scrape.exchange.advance(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => broken = true,
            }
        }
        if broken || scrape.exchange.is_finished() {
            if !broken {
                scrape.stream.shutdown_write();
            }
            self.close(slot, registry);
        }
    }

    fn close(&mut self, slot: usize, registry: &Registry) {
        if let Some(mut scrape) = self.scrapes.try_remove(slot) {
            let _ = registry.deregister(&mut scrape.stream);
        }
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        self.listener.remove_file();
    }
}

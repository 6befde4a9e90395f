//! The mio shell around the sans-IO [`Endpoint`]: syscalls and nothing
//! else. It accepts, reads, writes, shuts and closes sockets, reads the
//! clock, and sleeps in `epoll_wait` until the endpoint's next deadline.
//! Every rule about what the bytes mean, when to stop reading, and when to
//! close lives in [`crate::core::endpoint`].
//!
//! One thread does everything. Each wake-up reads what the ready sockets
//! have (stamping each read with the clock) and hands it to the endpoint,
//! fires due timers, then writes every connection's queued answers with
//! one `write` each. The poll timeout is the endpoint's earliest deadline,
//! or none: an idle server sleeps.

mod listener;
mod scrape;
pub mod state;
pub mod state_location;

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use log::{debug, info, warn};
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;

use crate::addr::{Address, Network};
use crate::core::access::AccessList;
use crate::core::connection::READ_CHUNK;
use crate::core::endpoint::{Action, Endpoint};
use crate::core::restart::{CleanStop, Promise};
use crate::core::{ConnId, Core, Limits, Micros};
use crate::stream::Stream;
use listener::{Listener, Peer};
use scrape::MetricsEndpoint;
use state::StateDir;

/// Bytes one connection may read per wake-up before others get a turn.
const READ_BUDGET: usize = 4 * READ_CHUNK;
/// After `accept` keeps failing (no file descriptors), retry this much later.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// Connections refused with the spare descriptor per wake-up before the
/// loop backs off and serves the connections it has.
const ACCEPT_REFUSALS_PER_WAKEUP: usize = 64;

const WAKE_TOKEN: Token = Token(usize::MAX);
const LISTENER_TOKEN_BASE: usize = usize::MAX - 1;

fn listener_token(index: usize) -> Token {
    Token(LISTENER_TOKEN_BASE - index)
}

/// What `kunci serve` is configured with.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: Vec<Address>,
    pub limits: Limits,
    /// Permissions of `unix:` socket files.
    pub unix_mode: u32,
    /// When not empty, TCP peers outside these networks get `X 9` at
    /// accept and are closed (and counted as `refused`).
    pub allow: Vec<Network>,
    /// Where to keep the token high-water mark and lease horizon that make
    /// restarts safe (see [`state`]); `None` keeps nothing on disk.
    pub state_dir: Option<std::path::PathBuf>,
    /// Without `state_dir`: keep the state in the subdirectory of this
    /// one named after the first address bound (spec §7, "state by
    /// default"; see [`state_location`]).
    pub state_base: Option<std::path::PathBuf>,
    /// Where to serve Prometheus metrics over HTTP (see [`crate::metrics`]);
    /// `None` serves none.
    pub metrics: Option<Address>,
    /// With `--auth`: who may connect and what each may do (spec §12);
    /// `None` lets every session do everything.
    pub access: Option<AccessList>,
    /// The most connections one TCP peer address may hold (spec §4);
    /// `None`: half of `limits.max_connections`.
    pub max_connections_per_peer: Option<usize>,
    /// The certificate, key and optional client CA of the `tls://`
    /// listeners; required when there is one.
    #[cfg(feature = "tls")]
    pub tls: Option<crate::tls::ServerFiles>,
}

/// The TLS configuration of one listener (`None` for plaintext).
#[cfg(feature = "tls")]
type ListenerTls = Option<Arc<rustls::ServerConfig>>;
#[cfg(not(feature = "tls"))]
type ListenerTls = Option<std::convert::Infallible>;

impl Config {
    /// Whether the listener on `address` admits only clients with a
    /// certificate from `--tls-client-ca`: a `tls://` listener when that
    /// option is given (for the start-up warning about open listeners).
    pub fn requires_client_certificate(&self, address: &Address) -> bool {
        #[cfg(feature = "tls")]
        if let Some(files) = &self.tls {
            return files.client_ca.is_some() && matches!(address, Address::Tls(_));
        }
        let _ = address;
        false
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: vec![Address::Tcp(crate::addr::DEFAULT_ADDRESS.to_owned())],
            limits: Limits::default(),
            unix_mode: 0o600,
            allow: Vec::new(),
            state_dir: None,
            state_base: None,
            metrics: None,
            access: None,
            max_connections_per_peer: None,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }
}

/// Asks a running server to shut down gracefully, from any thread. The
/// binary calls it from its signal handling; the library installs none.
#[derive(Clone)]
pub struct ShutdownHandle {
    requested: Arc<AtomicBool>,
    waker: Arc<Waker>,
}

impl ShutdownHandle {
    pub fn shut_down(&self) {
        self.requested.store(true, Ordering::SeqCst);
        let _ = self.waker.wake();
    }
}

/// The first token of this run (spec §7): above every token an earlier run
/// can have issued, unless the wall clock stepped back.
pub fn first_token_from_clock() -> u64 {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as u64);
    millis.saturating_mul(1 << 20).max(1)
}

/// A bound server, ready to [`run`](Server::run).
pub struct Server {
    poll: Poll,
    listeners: Vec<Listener>,
    /// Per listener, in the same order.
    listener_tls: Vec<ListenerTls>,
    /// Per listener: whether it admits only peers with a certificate from
    /// `--tls-client-ca`.
    listener_checks_certificates: Vec<bool>,
    addresses: Vec<Address>,
    shutdown: ShutdownHandle,
    shell: Shell,
}

/// An accepted socket and what its readiness last said.
struct Socket {
    stream: Stream,
    /// The peer's end-of-file has been reported: read until it is seen,
    /// since no later readiness event will report it again.
    read_closed: bool,
    /// In the list of sockets to read without waiting for readiness.
    in_ready: bool,
}

/// Everything the loop mutates, apart from the poll and the listeners.
struct Shell {
    registry: mio::Registry,
    state: Option<StateDir>,
    endpoint: Endpoint,
    sockets: Slab<Socket>,
    clock_start: Instant,
    /// The clock (µs since `clock_start`) as last read.
    clock: Micros,
    /// Whether the loop slept since `clock` was read: a write then reads
    /// the clock itself (see `now_for_write`).
    clock_stale: bool,
    read_buffer: Box<[u8]>,
    /// Sockets to read before the next poll.
    ready: Vec<usize>,
    accept_paused_until: Option<Micros>,
    /// A descriptor held in reserve, given up to accept-and-refuse when
    /// the process runs out of descriptors.
    spare_fd: Option<File>,
    metrics: Option<MetricsEndpoint>,
    limit_log: LimitLog,
}

/// Logs at `warn` when a capacity limit turns requests away: once per
/// limit per minute, so that a flood of `B` is one line a minute.
#[derive(Default)]
struct LimitLog {
    /// The core's counters as last seen: `busy`, `X 7` at the connection
    /// limit, `X 7` for lack of descriptors, `X 14`.
    seen: [u64; 4],
    /// When each limit was last logged.
    logged_at: [Option<Micros>; LIMIT_NAMES.len()],
}

/// The limits [`LimitLog`] tells apart, by what a user changes.
const LIMIT_NAMES: [&str; 6] = [
    "--max-keys",
    "--max-waiters",
    "--max-waiters-per-key or --max-waits-per-conn",
    "--max-connections",
    "the file descriptor limit (ulimit -n)",
    "--max-watches, --max-watches-per-conn or an identity's max-watches",
];

/// How often one limit is logged at most.
const LIMIT_LOG_EVERY: Micros = 60_000_000;

impl LimitLog {
    /// Compares the core's counters with what was seen last, and logs
    /// each limit that was hit since, unless it was logged in the last
    /// minute. A `B` is put down to the key or waiter limit that is full
    /// now; when neither is, to the per-key or per-connection limit.
    fn check(&mut self, core: &crate::core::Core, now: Micros) {
        let stats = core.stats();
        let counters = [
            stats.busy,
            stats.refused_max_connections,
            stats.refused_fd_limit,
            stats.errors_by_code[crate::protocol::ErrorCode::TooManyWatches as usize],
        ];
        if counters == self.seen {
            return;
        }
        let limits = core.limits();
        let mut hit = Vec::new();
        if counters[0] > self.seen[0] {
            let refused = counters[0] - self.seen[0];
            if core.keys() >= limits.max_keys {
                let keys = counted(core.keys() as u64, "key");
                hit.push((0, refused, format!("{keys} in the table")));
            } else if core.waiter_count() >= limits.max_waiters {
                let waiters = counted(core.waiter_count() as u64, "waiter");
                hit.push((1, refused, format!("{waiters} queued")));
            } else {
                hit.push((2, refused, "a queue or a connection was full".to_owned()));
            }
        }
        if counters[1] > self.seen[1] {
            let refused = counters[1] - self.seen[1];
            let open = counted(core.connections() as u64, "connection");
            hit.push((3, refused, format!("{open} open")));
        }
        if counters[2] > self.seen[2] {
            hit.push((
                4,
                counters[2] - self.seen[2],
                "no descriptor left".to_owned(),
            ));
        }
        if counters[3] > self.seen[3] {
            let held = match core.watch_count() {
                1 => "1 watch held".to_owned(),
                count => format!("{count} watches held"),
            };
            hit.push((5, counters[3] - self.seen[3], held));
        }
        self.seen = counters;
        for (limit, refused, state) in hit {
            if self.logged_at[limit].is_some_and(|at| now < at + LIMIT_LOG_EVERY) {
                continue;
            }
            self.logged_at[limit] = Some(now);
            let (what, answer) = if limit == 5 {
                ("request", "refused with X 14")
            } else if limit >= 3 {
                ("connection", "refused with X 7")
            } else {
                ("request", "answered busy (B)")
            };
            warn!(
                "limit reached: {} ({state}): {} {answer}; \
                 not logged again for this limit within a minute",
                LIMIT_NAMES[limit],
                counted(refused, what),
            );
        }
    }
}

impl Server {
    /// Binds every listen address, opens the state directory if one is
    /// configured, and prepares the loop.
    pub fn bind(config: Config) -> io::Result<Server> {
        config
            .limits
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let tls = tls_config(&config)?;
        let poll = Poll::new()?;
        let mut listeners = Vec::new();
        let mut listener_tls = Vec::new();
        let mut listener_checks_certificates = Vec::new();
        let mut addresses = Vec::new();
        for (index, address) in config.listen.iter().enumerate() {
            listener_checks_certificates.push(config.requires_client_certificate(address));
            let mut listener = Listener::bind(address, config.unix_mode)
                .map_err(|e| io::Error::new(e.kind(), format!("{address}: {e}")))?;
            poll.registry()
                .register(&mut listener, listener_token(index), Interest::READABLE)?;
            let mut local = listener.local_address()?;
            if let (Address::Tls(_), Address::Tcp(host_port)) = (address, &local) {
                local = Address::Tls(host_port.clone());
                listener_tls.push(tls.as_ref().cloned());
            } else {
                listener_tls.push(None);
            }
            addresses.push(local);
            listeners.push(listener);
        }
        // Opened once the listeners are bound: a per-address directory is
        // named after the port actually bound when 0 was asked.
        let state_dir = config.state_dir.clone().or_else(|| {
            let base = config.state_base.as_ref()?;
            let location = state_location::StateLocation::PerAddress(base.clone());
            Some(location.resolve(addresses.first()?))
        });
        let mut state = match &state_dir {
            Some(dir) => Some(StateDir::open(dir)?),
            None => None,
        };
        let token_high_water = state.as_ref().map_or(0, StateDir::token_high_water);
        let first_token = first_token_from_clock().max(token_high_water);
        let metrics = match &config.metrics {
            Some(address) => Some(MetricsEndpoint::bind(
                address,
                config.unix_mode,
                poll.registry(),
            )?),
            None => None,
        };
        let shutdown = ShutdownHandle {
            requested: Arc::new(AtomicBool::new(false)),
            waker: Arc::new(Waker::new(poll.registry(), WAKE_TOKEN)?),
        };
        // Listeners, the poller, the state directory: a few dozen more.
        let wanted = config.limits.max_connections + 64;
        if let Some(limit) = raise_fd_limit(wanted).filter(|&l| l < wanted as u64) {
            warn!(
                "file descriptor limit {limit} is below --max-connections {} + 64: \
                 connections beyond it are refused",
                config.limits.max_connections
            );
        }
        let clock_start = Instant::now();
        let mut core = Core::new(config.limits, first_token);
        if let Some(state) = state.as_mut() {
            state.resume(&mut core)?;
        }
        let mut endpoint = Endpoint::new(core, config.allow.clone());
        if let Some(max) = config.max_connections_per_peer {
            endpoint.limit_connections_per_peer(max);
        }
        if let Some(access) = config.access {
            endpoint.require_authentication(access);
        }
        if let Some(state) = state.as_mut() {
            endpoint.require_durability();
            // This run's first promise replaces the earlier run's file
            // before any connection is accepted.
            if let Some(promise) = endpoint.poll_persist() {
                state.write_first(promise)?;
                endpoint.handle_persisted(promise);
            }
        }
        let shell = Shell {
            registry: poll.registry().try_clone()?,
            state,
            endpoint,
            sockets: Slab::new(),
            clock_start,
            clock: 0,
            clock_stale: true,
            read_buffer: vec![0; READ_CHUNK].into_boxed_slice(),
            ready: Vec::new(),
            accept_paused_until: None,
            spare_fd: File::open("/dev/null").ok(),
            metrics,
            limit_log: LimitLog::default(),
        };
        Ok(Server {
            poll,
            listeners,
            listener_tls,
            listener_checks_certificates,
            addresses,
            shutdown,
            shell,
        })
    }

    /// The state directory in use, if any.
    pub fn state_dir(&self) -> Option<&std::path::Path> {
        self.shell.state.as_ref().map(StateDir::path)
    }

    /// The addresses actually bound, in the order given.
    pub fn addresses(&self) -> &[Address] {
        &self.addresses
    }

    /// Where the metrics are served, if anywhere (the real port when 0 was
    /// asked).
    pub fn metrics_address(&self) -> Option<&Address> {
        self.shell.metrics.as_ref().map(MetricsEndpoint::address)
    }

    pub fn limits(&self) -> &Limits {
        self.shell.endpoint.core().limits()
    }

    /// The bound addresses that any host that can reach them may use with
    /// nothing checking who it is (spec §12.4): `kunci serve` warns about
    /// each at start.
    pub fn unguarded_addresses(&self) -> Vec<&Address> {
        (0..self.addresses.len())
            .filter(|&index| !self.is_guarded(index))
            .map(|index| &self.addresses[index])
            .collect()
    }

    /// The plaintext listeners that clients reach from beyond this host on
    /// a server with `--auth` (spec §12.5): their secrets cross the
    /// network in clear. Neither `tls://`, loopback nor unix.
    pub fn secrets_in_clear_addresses(&self) -> Vec<&Address> {
        if !self.shell.endpoint.authenticates() {
            return Vec::new();
        }
        self.addresses
            .iter()
            .filter(|address| !address.keeps_secrets_private())
            .collect()
    }

    /// Whether the listener with this index checks its peers, or only this
    /// host can reach it: a loopback or unix listener, a server with
    /// `--auth` or an `--allow` list, or a `tls://` listener that requires
    /// client certificates. Every other check that says who a peer is
    /// belongs here.
    fn is_guarded(&self, index: usize) -> bool {
        let endpoint = &self.shell.endpoint;
        let only_this_host = match &self.addresses[index] {
            Address::Unix(_) => true,
            Address::Tcp(text) | Address::Tls(text) => text
                .parse::<std::net::SocketAddr>()
                .is_ok_and(|address| address.ip().is_loopback()),
            Address::Etcd { .. } => false,
        };
        only_this_host
            || self.listener_checks_certificates[index]
            || endpoint.authenticates()
            || endpoint.checks_peers()
    }

    /// A handle that shuts the server down gracefully (spec §4) from any
    /// thread — `kunci serve` calls it on SIGTERM, SIGINT and SIGHUP.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// Runs until a [`ShutdownHandle`] asks it to stop, then shuts down
    /// gracefully (spec §4) and returns. An error is returned when the
    /// poller fails; a state file that cannot be written is survived
    /// (spec §7.6, see `Shell::make_durable`).
    pub fn run(mut self) -> io::Result<()> {
        let mut events = Events::with_capacity(1024);
        loop {
            let timeout = self.shell.poll_timeout();
            if let Err(error) = self.poll.poll(&mut events, timeout) {
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(error);
            }
            // Connections that spent their share of the last turn go on
            // first (spec §4, fairness); what they answer is written below.
            // The clock is read for the turn only when one does: otherwise
            // the first read stamps its bytes itself, and a P=1 wake-up
            // reads the clock once fewer (issue 38).
            self.shell.clock_stale = true;
            if self.shell.endpoint.has_yielded() {
                let now = self.shell.now();
                self.shell.endpoint.begin_turn(now);
            } else {
                self.shell.endpoint.begin_turn(self.shell.clock);
            }
            for event in events.iter() {
                match event.token() {
                    WAKE_TOKEN => {
                        if self.shutdown.requested.load(Ordering::SeqCst) {
                            self.begin_shutdown();
                        }
                    }
                    token if scrape::is_metrics_token(token) => self.shell.serve_metrics(token),
                    Token(token) if token > LISTENER_TOKEN_BASE - self.listeners.len() => {
                        let index = LISTENER_TOKEN_BASE - token;
                        if let Some(listener) = self.listeners.get(index) {
                            self.shell.accept_all(listener, &self.listener_tls[index]);
                        }
                    }
                    Token(id) => {
                        if event.is_writable() {
                            self.shell.flush(id)?;
                        }
                        if event.is_read_closed() || event.is_error() {
                            if let Some(socket) = self.shell.sockets.get_mut(id) {
                                socket.read_closed = true;
                            }
                        }
                        if event.is_readable() || event.is_read_closed() || event.is_error() {
                            self.shell.read(id);
                            // Answer at once, while the bytes are hot:
                            // one write per connection per wake-up.
                            self.shell.flush(id)?;
                        }
                    }
                }
            }
            let shell = &mut self.shell;
            for id in std::mem::take(&mut shell.ready) {
                if let Some(socket) = shell.sockets.get_mut(id) {
                    socket.in_ready = false;
                    shell.read(id);
                    shell.flush(id)?;
                }
            }
            let now = shell.now();
            shell.endpoint.handle_timeout(now);
            // A horizon brought down as leases ended is written even when
            // no answer is waiting to go.
            shell.make_durable()?;
            if let Some(metrics) = shell.metrics.as_mut() {
                metrics.expire(&shell.registry, now);
            }
            if shell.accept_paused_until.is_some_and(|until| until <= now) {
                shell.accept_paused_until = None;
                for (listener, tls) in self.listeners.iter().zip(&self.listener_tls) {
                    shell.accept_all(listener, tls);
                }
            }
            shell.flush_all()?;
            if !shell.endpoint.is_shutting_down() {
                shell.limit_log.check(shell.endpoint.core(), now);
            }
            if shell.endpoint.is_shut_down(now) {
                shell.record_clean_stop(now);
                info!("shut down");
                return Ok(());
            }
        }
    }

    fn begin_shutdown(&mut self) {
        if self.shell.endpoint.is_shutting_down() {
            return;
        }
        info!("shutting down: answering waiters and closing connections");
        for listener in &mut self.listeners {
            let _ = self.poll.registry().deregister(listener);
            listener.remove_file();
        }
        self.listeners.clear();
        self.listener_tls.clear();
        if let Some(metrics) = self.shell.metrics.as_mut() {
            metrics.close_all(&self.shell.registry);
        }
        self.shell.metrics = None;
        let now = self.shell.now();
        self.shell.accept_paused_until = None;
        self.shell.endpoint.shut_down(now);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        for listener in &self.listeners {
            listener.remove_file();
        }
    }
}

fn micros(duration: Duration) -> Micros {
    duration.as_micros() as Micros
}

impl Shell {
    /// Reads the clock (and remembers it in `clock`).
    fn now(&mut self) -> Micros {
        self.clock = micros(self.clock_start.elapsed());
        self.clock_stale = false;
        self.clock
    }

    /// The clock for a write: the last read or wake-up's when the loop has
    /// not slept since (recent enough for what a write can start: frames
    /// held back were read earlier, a linger deadline), else read now.
    fn now_for_write(&mut self) -> Micros {
        if self.clock_stale {
            self.now()
        } else {
            self.clock
        }
    }

    fn poll_timeout(&self) -> Option<Duration> {
        if !self.ready.is_empty() || self.endpoint.has_yielded() {
            return Some(Duration::ZERO);
        }
        let scrape_deadline = self
            .metrics
            .as_ref()
            .and_then(MetricsEndpoint::poll_timeout);
        let next = [
            self.endpoint.poll_timeout(),
            self.accept_paused_until,
            scrape_deadline,
        ]
        .into_iter()
        .flatten()
        .min()?;
        let now = micros(self.clock_start.elapsed());
        Some(Duration::from_micros(next.saturating_sub(now)))
    }

    /// A readiness event on the metrics listener or one of its scrapes.
    fn serve_metrics(&mut self, token: Token) {
        let now = self.now();
        if let Some(metrics) = self.metrics.as_mut() {
            metrics.ready(token, &self.registry, self.endpoint.core(), now);
        }
    }

    /// Reads socket `id` until it would block, reaches end-of-file, the
    /// endpoint wants no more, or the budget is spent. A short read means
    /// the socket is drained — edge-triggered readiness reports the next
    /// bytes, which saves an `EAGAIN` read per wake-up — *unless* the peer
    /// has closed: then its end-of-file may already sit behind the bytes
    /// read and no event would report it again, so reading goes on until
    /// it is seen.
    fn read(&mut self, id: usize) {
        let mut budget = READ_BUDGET;
        loop {
            if !self.endpoint.wants_read(id as ConnId) {
                return;
            }
            let Some(socket) = self.sockets.get_mut(id) else {
                return;
            };
            match socket.stream.read(&mut self.read_buffer) {
                Ok(0) => {
                    let now = self.now();
                    return self.endpoint.handle_eof(id as ConnId, now);
                }
                Ok(n) => {
                    let drained = n < self.read_buffer.len() && !socket.read_closed;
                    let now = self.now();
                    self.endpoint
                        .handle_read(id as ConnId, &self.read_buffer[..n], now);
                    budget = budget.saturating_sub(n);
                    if drained {
                        return;
                    }
                    if budget == 0 {
                        return self.read_later(id);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    let now = self.now();
                    return self.endpoint.handle_broken(id as ConnId, now);
                }
            }
        }
    }

    /// Reads `id` again before the next poll, after others had a turn.
    fn read_later(&mut self, id: usize) {
        if let Some(socket) = self.sockets.get_mut(id) {
            if !socket.in_ready {
                socket.in_ready = true;
                self.ready.push(id);
            }
        }
    }

    /// Writes what every connection has queued, then carries out the
    /// endpoint's socket actions.
    fn flush_all(&mut self) -> io::Result<()> {
        while let Some(id) = self.endpoint.next_transmit() {
            self.flush(id as usize)?;
        }
        self.apply_actions();
        Ok(())
    }

    /// Writes `id`'s queued output until it is all sent or the socket
    /// would block (its write readiness then brings it back).
    fn flush(&mut self, id: usize) -> io::Result<()> {
        // Durability before visibility: only output about to leave needs
        // the promise on disk (most flushes find none).
        if self.state.is_some() && self.endpoint.has_output(id as ConnId) {
            self.make_durable_with_state()?;
        }
        loop {
            let Some(socket) = self.sockets.get_mut(id) else {
                return Ok(());
            };
            let Some(bytes) = self.endpoint.transmit(id as ConnId) else {
                return Ok(());
            };
            match socket.stream.write(bytes) {
                Ok(0) => {
                    let now = self.now();
                    self.endpoint.handle_broken(id as ConnId, now);
                    return Ok(());
                }
                Ok(n) => {
                    // No clock read per write (see `now_for_write`).
                    let now = self.now_for_write();
                    self.endpoint.handle_written(id as ConnId, n, now);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    let now = self.now();
                    self.endpoint.handle_broken(id as ConnId, now);
                    return Ok(());
                }
            }
        }
    }

    fn apply_actions(&mut self) {
        while let Some((id, action)) = self.endpoint.poll_action() {
            let id = id as usize;
            match action {
                Action::ShutWrite => {
                    if let Some(socket) = self.sockets.get(id) {
                        socket.stream.shutdown_write();
                    }
                }
                Action::Read => self.read_later(id),
                Action::Close => {
                    if self.sockets.contains(id) {
                        let mut socket = self.sockets.remove(id);
                        let _ = self.registry.deregister(&mut socket.stream);
                    }
                }
            }
        }
    }

    /// With a state directory: before any answer leaves the process, make
    /// the endpoint's promise durable (every token issued, every lease
    /// granted), so a crash can never show a token or lease twice; the
    /// endpoint transmits nothing until then. Without one this is nothing.
    ///
    /// A write that fails (disk full, I/O error, read-only) does not stop
    /// the server (spec §7.6): the endpoint then serves within what the
    /// file holds (`B` for what needs more), holds back the answers that
    /// waited for this write, and the write is tried again each second
    /// until one succeeds; the failure is logged at most once a minute.
    ///
    /// Only the test for a state directory is inline (it runs before
    /// every write): what follows it would cost a server without one in
    /// every caller.
    #[inline(always)]
    fn make_durable(&mut self) -> io::Result<()> {
        if self.state.is_none() {
            return Ok(());
        }
        self.make_durable_with_state()
    }

    #[cold]
    #[inline(never)]
    fn make_durable_with_state(&mut self) -> io::Result<()> {
        match self.endpoint.poll_persist() {
            Some(promise) => self.write_promise(promise),
            None => Ok(()),
        }
    }

    /// Writes `promise` to the state file when a write is due (see
    /// `make_durable`).
    #[inline(never)]
    fn write_promise(&mut self, promise: Promise) -> io::Result<()> {
        let Some(state) = self.state.as_mut() else {
            return Ok(());
        };
        let now = micros(self.clock_start.elapsed());
        if !self.endpoint.write_due(now) {
            return Ok(());
        }
        match state.write_running(promise, now) {
            Ok(()) => {
                // Once per write (a block of grants, or 5 s of horizon):
                // whether the tokens ran too far ahead of the clock to
                // stay bound to their keys (spec §7.6's 2^52 mark).
                if self
                    .endpoint
                    .core_mut()
                    .watch_token_clock(first_token_from_clock())
                {
                    warn!(
                        "state: tokens ran 2^51 above the clock's (unix time ms × 2^20; more \
                         than ~16,000 grants a second for a long time): from token {} on \
                         they go +1 apart, not bound to their keys; after a crash their \
                         holders cannot adopt their keys (docs/OPERATIONS.md, \"Restarts\")",
                        self.endpoint.core().next_token()
                    );
                }
                if let Some(failures) = self.endpoint.handle_persisted(promise) {
                    info!(
                        "state: the state file is written again (after {}); \
                         grants and renewals are served as before",
                        counted(failures, "failed write")
                    );
                }
            }
            Err(e) => {
                if self.endpoint.handle_persist_failed(promise, now) {
                    log::error!(
                        "state directory {}: cannot write the state file: {e}; serving on \
                         without it: a grant or renewal that needs a promise the file does \
                         not hold (a token from {} on, a lease past its horizon) gets B \
                         until a write succeeds (tried every second; logged at most once \
                         a minute; state_errors in I and metrics)",
                        state.path().display(),
                        self.endpoint
                            .on_disk()
                            .map_or(0, |promise| promise.token_high_water),
                    );
                }
            }
        }
        Ok(())
    }

    /// Persists every held grant (spec §7.1) once no request can arrive.
    fn record_clean_stop(&mut self, now: Micros) {
        let Some(state) = self.state.as_mut() else {
            return;
        };
        let core = self.endpoint.core();
        let started = Instant::now();
        let stop = CleanStop::of(core, now);
        match state.save_clean_stop(&stop) {
            Ok(()) => info!(
                "state: saved {} in {} ms; the state file was written {} in this run",
                counted(stop.count as u64, "grant"),
                crate::decimal::millis(started.elapsed(), 0),
                counted(state.writes, "time"),
            ),
            // The running file still promises its horizon: the next run
            // starts with a grace instead of the grants.
            Err(e) => log::error!("state directory: cannot record the clean stop: {e}"),
        }
    }

    fn accept_all(&mut self, listener: &Listener, tls: &ListenerTls) {
        if self.accept_paused_until.is_some() || self.endpoint.is_shutting_down() {
            return;
        }
        let mut refused = 0;
        loop {
            match listener.accept() {
                Ok((stream, peer)) => self.admit(stream, peer, tls),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => {}
                Err(e) if is_out_of_descriptors(&e) => {
                    if refused == 0 {
                        warn!("accept: out of file descriptors; refusing new connections");
                    }
                    refused += 1;
                    if refused > ACCEPT_REFUSALS_PER_WAKEUP
                        || !self.refuse_with_spare_fd(listener, tls.is_some())
                    {
                        return self.pause_accepting();
                    }
                }
                Err(e) => {
                    warn!("accept: {e}");
                    return self.pause_accepting();
                }
            }
        }
    }

    /// Out of descriptors: give up the spare one to accept the waiting
    /// peer and tell it so with `X 7`, rather than leave it hanging in the
    /// backlog. Returns whether a spare descriptor was there to use.
    /// A TLS peer is closed with nothing sent, as at the connection limit.
    fn refuse_with_spare_fd(&mut self, listener: &Listener, tls: bool) -> bool {
        if self.spare_fd.take().is_none() {
            self.spare_fd = File::open("/dev/null").ok();
            return false;
        }
        if let Ok((mut stream, _)) = listener.accept() {
            let frame = self.endpoint.refusal_without_descriptor();
            let frame = if tls { &[][..] } else { &frame[..] };
            let _ = stream.write(frame);
            stream.shutdown_write();
        }
        self.spare_fd = File::open("/dev/null").ok();
        self.spare_fd.is_some()
    }

    /// Stops accepting briefly instead of spinning on an accept that keeps
    /// failing; the poll timeout brings us back.
    fn pause_accepting(&mut self) {
        self.accept_paused_until = Some(self.now() + micros(ACCEPT_BACKOFF));
    }

    fn admit(&mut self, stream: Stream, peer: Peer, tls: &ListenerTls) {
        let entry = self.sockets.vacant_entry();
        let id = entry.key();
        if id as u64 > crate::core::endpoint::CONN_ID_MAX {
            // More sockets than the limit allows are waiting to close.
            warn!("refusing {peer:?}: too many sockets still closing");
            return;
        }
        let socket = entry.insert(Socket {
            stream,
            read_closed: false,
            in_ready: false,
        });
        // Registered for both directions once, edge-triggered: no
        // re-registration syscalls when output comes and goes.
        if let Err(e) = self.registry.register(
            &mut socket.stream,
            Token(id),
            Interest::READABLE | Interest::WRITABLE,
        ) {
            warn!("register connection: {e}");
        }
        debug!("connection {id} from {peer:?}");
        let ip: Option<IpAddr> = match peer {
            Peer::Tcp(address) => Some(address.ip()),
            Peer::Unix => None,
        };
        let now = self.now();
        match tls {
            #[cfg(feature = "tls")]
            Some(config) => self.endpoint.accept_tls(id as ConnId, ip, config, now),
            #[cfg(not(feature = "tls"))]
            Some(never) => match *never {},
            None => self.endpoint.accept(id as ConnId, ip, now),
        }
    }
}

/// The TLS configuration shared by the `tls://` listeners, checked before
/// anything is bound: a missing or unreadable certificate or key stops the
/// start with the file and the problem named.
#[cfg(feature = "tls")]
fn tls_config(config: &Config) -> io::Result<ListenerTls> {
    let wanted = config
        .listen
        .iter()
        .any(|address| matches!(address, Address::Tls(_)));
    let invalid = |text: String| io::Error::new(io::ErrorKind::InvalidInput, text);
    match (&config.tls, wanted) {
        (Some(files), true) => crate::tls::server_config(files)
            .map(Some)
            .map_err(|e| invalid(format!("TLS: {e}"))),
        (None, true) => Err(invalid(
            "TLS: a tls:// listener needs --tls-cert and --tls-key".to_owned(),
        )),
        (Some(_), false) => Err(invalid(
            "TLS: --tls-cert, --tls-key and --tls-client-ca need a tls:// listener".to_owned(),
        )),
        (None, false) => Ok(None),
    }
}

#[cfg(not(feature = "tls"))]
fn tls_config(config: &Config) -> io::Result<ListenerTls> {
    if config
        .listen
        .iter()
        .any(|address| matches!(address, Address::Tls(_)))
    {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "TLS: tls:// listeners need kunci built with the `tls` feature",
        ));
    }
    Ok(None)
}

fn is_out_of_descriptors(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE) | Some(libc::ENFILE)
    )
}

/// `n` and `noun`, in the plural unless `n` is 1: `1 grant`, `2 grants`.
pub(crate) fn counted(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Raises the soft descriptor limit towards `wanted` (never above the
/// hard limit) and returns the soft limit now in force.
pub(crate) fn raise_fd_limit(wanted: usize) -> Option<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    // `None` is RLIM_INFINITY.
    let wanted = wanted as u64;
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current.unwrap_or(u64::MAX);
    if soft < wanted {
        let hard = limit.maximum.unwrap_or(u64::MAX);
        let raised = rustix::process::Rlimit {
            current: Some(wanted.min(hard)).filter(|&n| n != u64::MAX),
            maximum: limit.maximum,
        };
        let _ = setrlimit(Resource::Nofile, raised);
    }
    Some(getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX))
}

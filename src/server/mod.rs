//! The mio shell around the sans-IO [`Core`]: listeners, connections in a
//! slab, per-connection buffers, signals, and the poll loop.
//!
//! One thread does everything. Each wake-up reads what the ready sockets
//! have (stamping each read with the clock), decodes whole frames straight
//! from a shared scratch buffer, hands them to the core, and writes every
//! connection's answers with one `write` per connection. The poll timeout
//! is the earliest armed timer, or none: an idle server sleeps.

mod connection;
mod listener;
pub mod state;

use std::fs::File;
use std::io::{self, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use log::{debug, error, info, warn};
use mio::{Events, Interest, Poll, Token, Waker};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook_mio::v1_0::Signals;
use slab::Slab;

use crate::addr::{Address, Network};
use crate::core::timer_wheel::{TimerId, TimerLinks, TimerStore, TimerWheel};
use crate::core::{ConnId, Core, Limits, Micros};
use crate::protocol::{self, Decoded, ErrorCode};
use connection::{Connection, Flushed, Phase};
use listener::{Listener, Peer, Stream};
use state::StateDir;

/// Bytes read from a socket at a time; also the most input one
/// connection can have waiting behind backpressure.
const READ_CHUNK: usize = 64 * 1024;
/// Bytes one connection may read per wake-up before others get a turn.
const READ_BUDGET: usize = 4 * READ_CHUNK;
/// Stop reading a connection whose unsent output passes this...
const OUTPUT_HIGH_WATER: usize = 64 * 1024;
/// ...and resume once it is below this.
const OUTPUT_LOW_WATER: usize = 16 * 1024;
/// A frame left incomplete this long closes the connection.
pub const PARTIAL_FRAME_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a closing connection may take to drain its last answers and
/// its peer's unread input before it is dropped.
const LINGER: Duration = Duration::from_secs(2);
/// At most this many connections refused at the limit linger at once;
/// beyond it they are closed right after a best-effort `X 7`.
const LINGERING_REFUSED_MAX: usize = 256;
/// How long a graceful shutdown waits for peers to take their last bytes.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);
/// After `accept` keeps failing (no file descriptors), retry this much later.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// Connections refused with the spare descriptor per wake-up before the
/// loop backs off and serves the connections it has.
const ACCEPT_REFUSALS_PER_WAKEUP: usize = 64;

const SIGNAL_TOKEN: Token = Token(usize::MAX);
const WAKE_TOKEN: Token = Token(usize::MAX - 1);
const LISTENER_TOKEN_BASE: usize = usize::MAX - 2;

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
    /// When not empty, TCP peers outside these networks are closed at
    /// accept (and counted as `refused`).
    pub allow: Vec<Network>,
    /// Where to keep the token high-water mark and lease horizon that make
    /// restarts safe (see [`state`]); `None` keeps nothing on disk.
    pub state_dir: Option<std::path::PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: vec![Address::Tcp(crate::addr::DEFAULT_ADDRESS.to_owned())],
            limits: Limits::default(),
            unix_mode: 0o600,
            allow: Vec::new(),
            state_dir: None,
        }
    }
}

/// Asks a running server to shut down gracefully, from any thread.
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
    addresses: Vec<Address>,
    signals: Signals,
    shutdown: ShutdownHandle,
    loop_state: EventLoop,
}

/// Everything the loop mutates, apart from the poll and the listeners.
struct EventLoop {
    registry: mio::Registry,
    allow: Vec<Network>,
    state: Option<StateDir>,
    core: Core,
    conns: Slab<Connection>,
    conn_timers: TimerWheel,
    clock_start: Instant,
    read_buffer: Box<[u8]>,
    write_buffer: Vec<u8>,
    /// Connections with output to flush before the next poll.
    dirty: Vec<usize>,
    /// Connections to service before the next poll.
    ready: Vec<usize>,
    refused_lingering: usize,
    accept_paused_until: Option<Micros>,
    /// A descriptor held in reserve, given up to accept-and-refuse when
    /// the process runs out of descriptors.
    spare_fd: Option<File>,
    shutdown_deadline: Option<Micros>,
}

impl Server {
    /// Binds every listen address, opens the state directory if one is
    /// configured, and prepares the loop.
    pub fn bind(config: Config) -> io::Result<Server> {
        let mut state = match &config.state_dir {
            Some(dir) => Some(StateDir::open(dir)?),
            None => None,
        };
        let token_high_water = state.as_ref().map_or(0, StateDir::token_high_water);
        let first_token = first_token_from_clock().max(token_high_water);
        let poll = Poll::new()?;
        let mut listeners = Vec::new();
        let mut addresses = Vec::new();
        for (index, address) in config.listen.iter().enumerate() {
            let mut listener = Listener::bind(address, config.unix_mode)
                .map_err(|e| io::Error::new(e.kind(), format!("{address}: {e}")))?;
            poll.registry()
                .register(&mut listener, listener_token(index), Interest::READABLE)?;
            addresses.push(listener.local_address()?);
            listeners.push(listener);
        }
        let mut signals = Signals::new([SIGTERM, SIGINT])?;
        poll.registry()
            .register(&mut signals, SIGNAL_TOKEN, Interest::READABLE)?;
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
        let loop_state = EventLoop {
            registry: poll.registry().try_clone()?,
            allow: config.allow.clone(),
            state,
            core,
            conns: Slab::new(),
            conn_timers: TimerWheel::new(),
            clock_start,
            read_buffer: vec![0; READ_CHUNK].into_boxed_slice(),
            write_buffer: Vec::new(),
            dirty: Vec::new(),
            ready: Vec::new(),
            refused_lingering: 0,
            accept_paused_until: None,
            spare_fd: File::open("/dev/null").ok(),
            shutdown_deadline: None,
        };
        Ok(Server {
            poll,
            listeners,
            addresses,
            signals,
            shutdown,
            loop_state,
        })
    }

    /// The addresses actually bound, in the order given.
    pub fn addresses(&self) -> &[Address] {
        &self.addresses
    }

    pub fn limits(&self) -> &Limits {
        self.loop_state.core.limits()
    }

    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// Runs until SIGTERM, SIGINT or a [`ShutdownHandle`], then shuts down
    /// gracefully (spec §4) and returns.
    pub fn run(mut self) -> io::Result<()> {
        let mut events = Events::with_capacity(1024);
        loop {
            let timeout = self.loop_state.poll_timeout();
            if let Err(error) = self.poll.poll(&mut events, timeout) {
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(error);
            }
            for event in events.iter() {
                match event.token() {
                    SIGNAL_TOKEN => {
                        if self.signals.pending().next().is_some() {
                            self.begin_shutdown();
                        }
                    }
                    WAKE_TOKEN => {
                        if self.shutdown.requested.load(Ordering::SeqCst) {
                            self.begin_shutdown();
                        }
                    }
                    Token(token) if token > LISTENER_TOKEN_BASE - self.listeners.len() => {
                        let index = LISTENER_TOKEN_BASE - token;
                        if let Some(listener) = self.listeners.get(index) {
                            self.loop_state.accept_all(listener);
                        }
                    }
                    Token(id) => {
                        if event.is_writable() {
                            self.loop_state.on_writable(id);
                        }
                        if event.is_readable() || event.is_read_closed() || event.is_error() {
                            self.loop_state.service(id);
                        }
                    }
                }
            }
            let state = &mut self.loop_state;
            state.service_ready();
            let now = state.now();
            state.core.handle_timeout(now);
            state.route_outbox(None);
            state.fire_conn_timers(now);
            if state.accept_paused_until.is_some_and(|until| until <= now) {
                state.accept_paused_until = None;
                for listener in &self.listeners {
                    state.accept_all(listener);
                }
            }
            state.flush_dirty();
            if let Some(deadline) = state.shutdown_deadline {
                if state.conns.is_empty() || now >= deadline {
                    state.record_clean_stop(now);
                    info!("shut down");
                    return Ok(());
                }
            }
        }
    }

    fn begin_shutdown(&mut self) {
        let state = &mut self.loop_state;
        if state.shutdown_deadline.is_some() {
            return;
        }
        info!("shutting down: answering waiters and closing connections");
        for listener in &mut self.listeners {
            let _ = self.poll.registry().deregister(listener);
            listener.remove_file();
        }
        self.listeners.clear();
        let now = state.now();
        state.shutdown_deadline = Some(now + SHUTDOWN_GRACE.as_micros() as u64);
        state.accept_paused_until = None;
        state.core.shut_down();
        state.route_outbox(None);
        let ids: Vec<usize> = state.conns.iter().map(|(id, _)| id).collect();
        for id in ids {
            state.begin_close(id, now);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        for listener in &self.listeners {
            listener.remove_file();
        }
    }
}

/// Gives the connection timer wheel the links inside connections.
struct ConnTimers<'a>(&'a mut Slab<Connection>);

impl TimerStore for ConnTimers<'_> {
    fn links(&mut self, id: TimerId) -> &mut TimerLinks {
        &mut self.0[id as usize].timer
    }
}

fn micros(duration: Duration) -> Micros {
    duration.as_micros() as Micros
}

impl EventLoop {
    fn now(&self) -> Micros {
        micros(self.clock_start.elapsed())
    }

    fn poll_timeout(&self) -> Option<Duration> {
        if !self.ready.is_empty() {
            return Some(Duration::ZERO);
        }
        let next = [
            self.core.poll_timeout(),
            self.conn_timers.next_tick().map(|tick| tick * 1_000),
            self.accept_paused_until,
            self.shutdown_deadline,
        ]
        .into_iter()
        .flatten()
        .min()?;
        Some(Duration::from_micros(next.saturating_sub(self.now())))
    }

    /// With a state directory: before any answer leaves the process, make
    /// sure the state file covers every token issued and every lease
    /// granted, so a crash can never show a token or lease twice. Without
    /// one this is nothing.
    fn make_durable(&mut self) {
        let Some(state) = self.state.as_mut() else {
            return;
        };
        let now = micros(self.clock_start.elapsed());
        let core = &self.core;
        let covered = state.cover(
            core.next_token(),
            core.lease_deadline_max(),
            core.grace_until(),
            now,
        );
        if let Err(e) = covered {
            // Answering without the promise on disk could, after a crash,
            // hand a key to two holders: stop instead.
            error!("state directory: cannot persist: {e}; exiting");
            std::process::exit(1);
        }
    }

    /// Persists every held grant (spec §7.1) once no request can arrive.
    fn record_clean_stop(&mut self, now: Micros) {
        if let Some(state) = self.state.as_mut() {
            let started = Instant::now();
            match state.save_clean_stop(&self.core, now) {
                Ok(()) => info!(
                    "state: saved {} grants in {:.0} ms",
                    self.core.held(),
                    started.elapsed().as_secs_f64() * 1e3
                ),
                // The last run's running file still promises its horizon:
                // the next run starts with a grace instead of the grants.
                Err(e) => error!("state directory: cannot record the clean stop: {e}"),
            }
        }
    }

    fn accept_all(&mut self, listener: &Listener) {
        if self.accept_paused_until.is_some() || self.shutdown_deadline.is_some() {
            return;
        }
        let mut refused = 0;
        loop {
            match listener.accept() {
                Ok((stream, peer)) => self.admit(stream, peer),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => {}
                Err(e) if is_out_of_descriptors(&e) => {
                    if refused == 0 {
                        warn!("accept: out of file descriptors; refusing new connections");
                    }
                    refused += 1;
                    if refused > ACCEPT_REFUSALS_PER_WAKEUP || !self.refuse_with_spare_fd(listener)
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
    fn refuse_with_spare_fd(&mut self, listener: &Listener) -> bool {
        if self.spare_fd.take().is_none() {
            self.spare_fd = File::open("/dev/null").ok();
            return false;
        }
        let accepted = listener.accept();
        if let Ok((stream, _)) = accepted {
            let mut conn = Connection::new(stream);
            self.send_connection_limit(&mut conn);
            conn.stream.shutdown_write();
        }
        self.spare_fd = File::open("/dev/null").ok();
        self.spare_fd.is_some()
    }

    /// Stops accepting briefly instead of spinning on an accept that keeps
    /// failing; the poll timeout brings us back.
    fn pause_accepting(&mut self) {
        self.accept_paused_until = Some(self.now() + micros(ACCEPT_BACKOFF));
    }

    fn send_connection_limit(&mut self, conn: &mut Connection) {
        let mut frame = Vec::with_capacity(40);
        protocol::encode_response(&ErrorCode::ConnectionLimit.response(0), &mut frame);
        self.core.stats_mut().errors += 1;
        match conn.write_some(&frame) {
            Flushed::All => {}
            Flushed::Partial(n) => conn.output = frame[n..].to_vec(),
            Flushed::Broken => {}
        }
    }

    fn admit(&mut self, stream: Stream, peer: Peer) {
        if let Peer::Tcp(address) = peer {
            if !self.allow.is_empty()
                && !self
                    .allow
                    .iter()
                    .any(|network| network.contains(address.ip()))
            {
                debug!("refusing {address}: not in --allow");
                self.core.stats_mut().refused += 1;
                return;
            }
        }
        let mut conn = Connection::new(stream);
        if self.core.connections() >= self.core.limits().max_connections {
            debug!("refusing {peer:?}: connection limit");
            self.send_connection_limit(&mut conn);
            if self.refused_lingering >= LINGERING_REFUSED_MAX {
                return;
            }
            self.refused_lingering += 1;
            conn.refused = true;
            let id = self.insert_connection(conn);
            let now = self.now();
            self.begin_close(id, now);
            return;
        }
        let id = self.insert_connection(conn);
        self.core.connect(id as ConnId);
        debug!("connection {id} from {peer:?}");
    }

    fn insert_connection(&mut self, conn: Connection) -> usize {
        let entry = self.conns.vacant_entry();
        let id = entry.key();
        let conn = entry.insert(conn);
        // Registered for both directions once, edge-triggered: no
        // re-registration syscalls when output comes and goes.
        if let Err(e) = self.registry.register(
            &mut conn.stream,
            Token(id),
            Interest::READABLE | Interest::WRITABLE,
        ) {
            warn!("register connection: {e}");
        }
        id
    }
}

fn is_out_of_descriptors(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE) | Some(libc::ENFILE)
    )
}

/// Raises the soft descriptor limit towards `wanted` (never above the
/// hard limit) and returns the soft limit now in force.
pub(crate) fn raise_fd_limit(wanted: usize) -> Option<u64> {
    let wanted = wanted as libc::rlim_t;
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return None;
        }
        if limit.rlim_cur < wanted {
            limit.rlim_cur = wanted.min(limit.rlim_max);
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return None;
        }
    }
    Some(limit.rlim_cur)
}

/// How one pass over a connection's input ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum InputEnd {
    /// Everything readable was read (or the budget ran out).
    Drained,
    /// Output passed the high-water mark; input waits.
    Backpressure,
    /// The peer closed its write side.
    PeerClosed,
    /// The socket failed.
    Broken,
    /// The peer's bytes broke framing; an `X` is queued.
    Fatal,
}

impl EventLoop {
    /// Reads, decodes and evaluates what connection `id` sent, and writes
    /// the answers with one `write`.
    fn service(&mut self, id: usize) {
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        conn.ready = false;
        if conn.phase == Phase::Closing {
            return self.discard_input(id);
        }
        if conn.paused {
            return;
        }
        // Answers go to the shared write buffer unless earlier output is
        // still queued, which they must follow.
        let mut out = if conn.output.is_empty() {
            std::mem::take(&mut self.write_buffer)
        } else {
            std::mem::take(&mut conn.output)
        };
        let mut budget = READ_BUDGET;
        let mut progress = false;
        let end = loop {
            if out.len() >= OUTPUT_HIGH_WATER {
                break InputEnd::Backpressure;
            }
            let conn = &mut self.conns[id];
            let carried = conn.input.len().min(self.read_buffer.len());
            self.read_buffer[..carried].copy_from_slice(&conn.input[..carried]);
            conn.input = Vec::new();
            let mut end = None;
            let mut filled = carried;
            let mut now = 0;
            if carried < self.read_buffer.len() {
                match conn.stream.read(&mut self.read_buffer[carried..]) {
                    Ok(0) => end = Some(InputEnd::PeerClosed),
                    Ok(n) => {
                        filled += n;
                        budget = budget.saturating_sub(n);
                        now = micros(self.clock_start.elapsed());
                        // A short read emptied the socket: edge-triggered
                        // readiness will report the next bytes.
                        if filled < self.read_buffer.len() || budget == 0 {
                            end = Some(InputEnd::Drained);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        end = Some(InputEnd::Drained)
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => end = Some(InputEnd::Broken),
                }
            }
            if now == 0 {
                now = self.now();
            }
            let (consumed, fatal) = self.evaluate(id, filled, now, &mut out);
            progress |= consumed > 0;
            let conn = &mut self.conns[id];
            if consumed < filled {
                conn.input = self.read_buffer[consumed..filled].to_vec();
            }
            if fatal {
                break InputEnd::Fatal;
            }
            if out.len() >= OUTPUT_HIGH_WATER {
                break InputEnd::Backpressure;
            }
            if let Some(end) = end {
                if end == InputEnd::Drained && budget == 0 && !conn.ready {
                    conn.ready = true;
                    self.ready.push(id);
                }
                break end;
            }
        };
        let now = self.now();
        if !out.is_empty() {
            self.make_durable();
        }
        let conn = &mut self.conns[id];
        let broken = match conn.write_some(&out) {
            Flushed::All => false,
            Flushed::Partial(n) => {
                conn.output = out[n..].to_vec();
                false
            }
            Flushed::Broken => true,
        };
        out.clear();
        if out.capacity() <= 4 * OUTPUT_HIGH_WATER {
            self.write_buffer = out;
        }
        if broken || end == InputEnd::Broken {
            return self.close(id);
        }
        match end {
            InputEnd::Fatal | InputEnd::PeerClosed => {
                if end == InputEnd::PeerClosed {
                    debug!("connection {id} closed by peer");
                }
                self.begin_close(id, now);
            }
            InputEnd::Backpressure => {
                let conn = &mut self.conns[id];
                if conn.output.len() >= OUTPUT_LOW_WATER {
                    conn.paused = true;
                } else if !conn.ready {
                    // The socket took the batch: go on after others had a turn.
                    conn.ready = true;
                    self.ready.push(id);
                }
                // Our output is late, not the peer's input.
                self.conn_timers
                    .cancel(&mut ConnTimers(&mut self.conns), id as TimerId);
            }
            InputEnd::Drained | InputEnd::Broken => self.arm_partial_frame_timer(id, progress, now),
        }
    }

    /// Decodes and evaluates the frames in `read_buffer[..filled]` until
    /// input runs out, output passes the high-water mark, or framing
    /// breaks. Returns the bytes consumed and whether framing broke.
    fn evaluate(
        &mut self,
        id: usize,
        filled: usize,
        now: Micros,
        out: &mut Vec<u8>,
    ) -> (usize, bool) {
        let conn_id = id as ConnId;
        let mut at = 0;
        while at < filled && out.len() < OUTPUT_HIGH_WATER {
            match protocol::decode_request(&self.read_buffer[at..filled]) {
                Decoded::Incomplete => break,
                Decoded::Request { request, len } => {
                    self.core.handle_request(conn_id, &request, now);
                    at += len;
                }
                Decoded::Invalid { error, len } => {
                    self.core.handle_invalid(conn_id, error);
                    at += len;
                }
                Decoded::Fatal(error) => {
                    debug!("connection {id}: {}", error.code);
                    self.core.handle_invalid(conn_id, error);
                    route(
                        &mut self.core,
                        &mut self.conns,
                        &mut self.dirty,
                        Some((id, out)),
                    );
                    return (filled, true);
                }
            }
            route(
                &mut self.core,
                &mut self.conns,
                &mut self.dirty,
                Some((id, out)),
            );
        }
        (at, false)
    }

    /// (Re)starts the incomplete-frame clock when a new frame was left
    /// incomplete; stops it when no input is left.
    fn arm_partial_frame_timer(&mut self, id: usize, progress: bool, now: Micros) {
        let Some(conn) = self.conns.get(id) else {
            return;
        };
        let (idle, armed) = (conn.input.is_empty(), conn.timer.is_armed());
        let mut timers = ConnTimers(&mut self.conns);
        if idle {
            self.conn_timers.cancel(&mut timers, id as TimerId);
        } else if progress || !armed {
            let deadline = now + micros(PARTIAL_FRAME_TIMEOUT);
            self.conn_timers
                .arm(&mut timers, id as TimerId, deadline.div_ceil(1_000));
        }
    }

    fn service_ready(&mut self) {
        let ready = std::mem::take(&mut self.ready);
        for id in ready {
            self.service(id);
        }
    }

    fn on_writable(&mut self, id: usize) {
        self.make_durable();
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        if !conn.flush_output() {
            return self.close(id);
        }
        self.after_flush(id);
    }

    /// After output drained: resume a paused reader, finish a closing
    /// connection's write side.
    fn after_flush(&mut self, id: usize) {
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        if conn.phase == Phase::Closing {
            if conn.output.is_empty() {
                if conn.peer_closed {
                    return self.close(id);
                }
                if !conn.write_shut {
                    conn.stream.shutdown_write();
                    conn.write_shut = true;
                }
            }
            return;
        }
        if conn.paused && conn.output.len() < OUTPUT_LOW_WATER {
            conn.paused = false;
            if !conn.ready {
                conn.ready = true;
                self.ready.push(id);
            }
        }
    }

    /// Routes the core's queued answers to their connections' output.
    fn route_outbox(&mut self, current: Option<(usize, &mut Vec<u8>)>) {
        route(&mut self.core, &mut self.conns, &mut self.dirty, current);
    }

    fn flush_dirty(&mut self) {
        if self.dirty.is_empty() {
            return;
        }
        self.make_durable();
        let dirty = std::mem::take(&mut self.dirty);
        for &id in &dirty {
            let Some(conn) = self.conns.get_mut(id) else {
                continue;
            };
            conn.dirty = false;
            if !conn.flush_output() {
                self.close(id);
                continue;
            }
            self.after_flush(id);
        }
        let mut dirty = dirty;
        dirty.clear();
        if self.dirty.is_empty() {
            self.dirty = dirty;
        }
    }

    fn fire_conn_timers(&mut self, now: Micros) {
        let tick = now / 1_000;
        while let Some(id) = self
            .conn_timers
            .poll(&mut ConnTimers(&mut self.conns), tick)
        {
            let id = id as usize;
            match self.conns.get(id).map(|conn| conn.phase) {
                Some(Phase::Open) => {
                    debug!("connection {id}: frame incomplete for {PARTIAL_FRAME_TIMEOUT:?}");
                    self.close(id);
                }
                Some(Phase::Closing) => self.close(id),
                None => {}
            }
        }
    }

    /// Stops reading requests from `id` (the core must already have
    /// forgotten it), flushes what is queued, then shuts the write side and
    /// discards input until the peer closes or the linger time passes.
    /// Closing this way, rather than at once, keeps unread input from
    /// turning our close into a reset that could destroy the last answer.
    fn begin_close(&mut self, id: usize, now: Micros) {
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        if conn.phase == Phase::Closing {
            return;
        }
        if conn.phase == Phase::Open {
            self.core.disconnect(id as ConnId);
        }
        conn.phase = Phase::Closing;
        conn.paused = false;
        conn.input = Vec::new();
        let deadline = now + micros(LINGER);
        self.conn_timers.arm(
            &mut ConnTimers(&mut self.conns),
            id as TimerId,
            deadline.div_ceil(1_000),
        );
        self.on_writable(id);
        self.discard_input(id);
    }

    fn discard_input(&mut self, id: usize) {
        loop {
            let Some(conn) = self.conns.get_mut(id) else {
                return;
            };
            match conn.stream.read(&mut self.read_buffer) {
                Ok(0) => {
                    conn.peer_closed = true;
                    if conn.output.is_empty() {
                        return self.close(id);
                    }
                    return;
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => return self.close(id),
            }
        }
    }

    fn close(&mut self, id: usize) {
        if !self.conns.contains(id) {
            return;
        }
        self.conn_timers
            .cancel(&mut ConnTimers(&mut self.conns), id as TimerId);
        let mut conn = self.conns.remove(id);
        if conn.phase == Phase::Open {
            self.core.disconnect(id as ConnId);
        }
        if conn.refused {
            self.refused_lingering -= 1;
        }
        let _ = self.registry.deregister(&mut conn.stream);
        debug!("connection {id} closed");
    }
}

/// Encodes the core's queued responses: those for `current` into its
/// buffer, the rest into their connection's output (marked dirty).
fn route(
    core: &mut Core,
    conns: &mut Slab<Connection>,
    dirty: &mut Vec<usize>,
    mut current: Option<(usize, &mut Vec<u8>)>,
) {
    for (conn_id, response) in core.drain_outbox() {
        let id = conn_id as usize;
        if let Some((current_id, out)) = current.as_mut() {
            if *current_id == id {
                protocol::encode_response(&response, out);
                continue;
            }
        }
        let Some(conn) = conns.get_mut(id) else {
            continue;
        };
        protocol::encode_response(&response, &mut conn.output);
        if !conn.dirty {
            conn.dirty = true;
            dirty.push(id);
        }
    }
}

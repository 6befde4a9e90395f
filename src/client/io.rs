//! The client's I/O thread: one mio loop per [`Client`](super::Client)
//! that moves bytes between its sessions' sockets and the [`Engine`].
//!
//! Callers hand requests over through [`Shared::submit`] (a mutex-guarded
//! vector the loop swaps out whole, and a waker rung only when the vector
//! was empty, so a burst of requests costs one wake-up) and block on a
//! per-thread [`Slot`] until the loop delivers the outcome. Everything that
//! piles up while the loop is busy is written in one batch per session:
//! write coalescing comes from the loop's own latency.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use mio::net::{TcpStream, UnixStream};
use mio::{Events, Interest, Poll, Registry, Token, Waker};

use super::config::Config;
use super::engine::{Action, Engine, SessionId};
use super::handoff::{KeepTask, KeptLeases, Message, Reply, Slot};
use super::permits::Label;
use super::vocabulary::{Key, Op, Outcome, Submission, TRANSPORT_DEADLINE, Unavailable};
use crate::addr::Address;
use crate::stream::Stream;

const WAKER: Token = Token(usize::MAX);

/// Bytes read from a socket per `read` call.
const READ_CHUNK: usize = 64 * 1024;

/// How long past its deadline a caller waits for the I/O thread before it
/// assumes the thread is stuck. The engine always answers by the deadline
/// (plus a timer tick), so this only guards against a bug.
const CALL_GRACE: Duration = Duration::from_secs(1);

/// The most the last handle's drop waits for the background releases
/// (spec §8 rule 9: one bounded flush when the program ends).
pub(crate) const EXIT_FLUSH: Duration = Duration::from_millis(500);

/// The name of the client's I/O thread.
const IO_THREAD: &str = "kunci-client";

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What callers and the I/O thread share.
pub(crate) struct Shared {
    queue: Mutex<Vec<Message>>,
    waker: Waker,
    /// Set when the last handle is dropped: finish background work, exit.
    closed: AtomicBool,
    /// Cleared when the I/O thread exits.
    running: AtomicBool,
    /// The engine's count of `X 8` (server shutting down) frames.
    shutdown_notices: AtomicU64,
    /// Why the latest connection attempt failed, with its address.
    last_connect_failure: Mutex<Option<String>>,
    /// The addresses whose name did not resolve at their latest attempt,
    /// each with why.
    unresolved: Mutex<BTreeMap<String, String>>,
}

impl Shared {
    /// Hands a request to the I/O thread; `false` if it has stopped.
    pub(crate) fn submit(&self, submission: Submission<Reply>) -> bool {
        self.send(Message::Request(submission))
    }

    /// Hands a message to the I/O thread; `false` if it has stopped.
    pub(crate) fn send(&self, message: Message) -> bool {
        if !self.running.load(Ordering::Acquire) {
            return false;
        }
        let mut queue = lock(&self.queue);
        let was_empty = queue.is_empty();
        queue.push(message);
        drop(queue);
        if was_empty && let Err(error) = self.waker.wake() {
            log::warn!("cannot wake the client's I/O thread: {error}");
        }
        true
    }

    /// Submits a request and blocks until its outcome is known.
    pub(crate) fn call(&self, mut submission: Submission<Reply>) -> Outcome {
        let slot = Slot::for_this_thread();
        let seq = slot.next_call();
        let give_up = submission.deadline + CALL_GRACE;
        submission.reply = Some(Reply::Call {
            slot: slot.clone(),
            seq,
        });
        if !self.submit(submission) {
            return Outcome::Unavailable(Unavailable::Unreachable);
        }
        slot.wait(give_up).unwrap_or_else(|| {
            log::error!("the client's I/O thread did not answer by the deadline");
            Outcome::Indeterminate
        })
    }

    /// Tells the I/O thread that no handle is left.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let _ = self.waker.wake();
        // Spec §8 rule 9: the releases of tickets dropped just before (the
        // end of `main` drops them, then the client) go out before the
        // program can end, in one wait of at most EXIT_FLUSH. Not on the
        // I/O thread itself, which would only wait for itself.
        if std::thread::current().name() == Some(IO_THREAD) {
            return;
        }
        let give_up = Instant::now() + EXIT_FLUSH;
        while self.running.load(Ordering::Acquire) && Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// How many times a server said it is shutting down (`X 8`).
    pub(crate) fn shutdown_notices(&self) -> u64 {
        self.shutdown_notices.load(Ordering::Acquire)
    }

    /// Why the latest connection attempt failed, if one did.
    pub(crate) fn last_connect_failure(&self) -> Option<String> {
        lock(&self.last_connect_failure).clone()
    }

    /// The addresses whose host name did not resolve at their latest
    /// connection attempt, each with why (`address: error`).
    pub(crate) fn unresolved_names(&self) -> Vec<String> {
        lock(&self.unresolved)
            .iter()
            .map(|(address, error)| format!("{address}: {error}"))
            .collect()
    }
}

/// The TLS configuration of `tls://` sessions (`None` when no address is
/// one). A CA or certificate file that cannot be used is an error here,
/// before any session starts.
#[cfg(feature = "tls")]
pub(crate) fn tls_config(addresses: &[Address], config: &Config) -> io::Result<TlsConfig> {
    if !addresses.iter().any(|a| matches!(a, Address::Tls(_))) {
        return Ok(None);
    }
    crate::tls::client_config(&config.tls)
        .map(Some)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("TLS: {e}")))
}

#[cfg(not(feature = "tls"))]
pub(crate) fn tls_config(addresses: &[Address], _config: &Config) -> io::Result<TlsConfig> {
    if addresses.iter().any(|a| matches!(a, Address::Tls(_))) {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "tls:// addresses need kunci built with the `tls` feature",
        ));
    }
    Ok(None)
}

#[cfg(feature = "tls")]
pub(crate) type TlsConfig = Option<Arc<rustls::ClientConfig>>;
#[cfg(not(feature = "tls"))]
pub(crate) type TlsConfig = Option<std::convert::Infallible>;

/// Starts the I/O thread for these addresses, `per_server` sessions each.
pub(crate) fn start(
    addresses: Vec<Address>,
    config: &Config,
    tls: TlsConfig,
) -> io::Result<Arc<Shared>> {
    let per_server = config.sessions_per_server;
    let poll = Poll::new()?;
    let waker = Waker::new(poll.registry(), WAKER)?;
    let shared = Arc::new(Shared {
        queue: Mutex::new(Vec::new()),
        waker,
        closed: AtomicBool::new(false),
        running: AtomicBool::new(true),
        shutdown_notices: AtomicU64::new(0),
        last_connect_failure: Mutex::new(None),
        unresolved: Mutex::new(BTreeMap::new()),
    });
    let per_server = per_server.max(1);
    let sessions = addresses.len() * per_server;
    let mut engine = Engine::new(
        addresses.len(),
        per_server,
        config.connect_timeout,
        Instant::now(),
    );
    if let Some(secret) = &config.secret {
        engine.authenticate_with(secret.clone());
    }
    if let Some(problem) = config.plaintext_secret_problem(&addresses) {
        engine.refuse_every_request(problem);
    }
    if config.end_at_refusal {
        engine.end_at_refusal();
    }
    let mut shell = Shell {
        poll,
        shared: shared.clone(),
        engine,
        kept: KeptLeases::default(),
        addresses,
        per_server,
        conns: (0..sessions).map(|_| None).collect(),
        generations: vec![0; sessions],
        attempts: vec![0; sessions],
        buf: vec![0; READ_CHUNK],
        tls,
        observe_ids: super::random_u64(),
    };
    std::thread::Builder::new()
        .name(IO_THREAD.into())
        .spawn(move || shell.run())?;
    Ok(shared)
}

struct Conn {
    stream: Stream,
    connecting: bool,
    writable: bool,
}

struct Shell {
    poll: Poll,
    shared: Arc<Shared>,
    engine: Engine<Reply>,
    kept: KeptLeases,
    addresses: Vec<Address>,
    per_server: usize,
    conns: Vec<Option<Conn>>,
    /// Bumped per connection of a slot, and part of its token, so that an
    /// event for a connection already dropped is recognised and ignored.
    generations: Vec<u32>,
    /// Connection attempts per slot: picks among a name's addresses.
    attempts: Vec<usize>,
    buf: Vec<u8>,
    /// How `tls://` sessions start.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    tls: TlsConfig,
    /// The ids of the label checks' `O`s: a random base, counted up, so
    /// that they meet no id of the client's own calls (nor 0).
    observe_ids: u64,
}

fn would_block(error: &io::Error) -> bool {
    error.kind() == io::ErrorKind::WouldBlock
}

fn interrupted(error: &io::Error) -> bool {
    error.kind() == io::ErrorKind::Interrupted
}

impl Shell {
    fn run(&mut self) {
        let mut events = Events::with_capacity(256);
        let mut messages = Vec::new();
        loop {
            let next = match (self.engine.poll_timeout(), self.kept.poll_timeout()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let timeout = next.map(|at| at.saturating_duration_since(Instant::now()));
            if let Err(error) = self.poll.poll(&mut events, timeout)
                && !interrupted(&error)
            {
                log::error!("client I/O thread: poll failed: {error}");
                break;
            }
            let now = Instant::now();
            for event in events.iter() {
                if event.token() == WAKER {
                    continue;
                }
                let s = event.token().0 & 0xffff_ffff;
                let generation = (event.token().0 >> 32) as u32;
                if self.generations.get(s) != Some(&generation) {
                    continue;
                }
                let Some(conn) = self.conns.get_mut(s).and_then(Option::as_mut) else {
                    continue;
                };
                if conn.connecting {
                    match conn.stream.connect_done() {
                        Ok(false) => continue,
                        Ok(true) => {
                            conn.connecting = false;
                            self.engine.connected(s, now);
                        }
                        Err(error) => {
                            log::debug!("session {s}: connect failed: {error}");
                            self.connect_failure(s, &error);
                            self.drop_conn(s);
                            if self.is_refusal(s, &error) {
                                self.engine.connect_refused(s, now);
                            } else {
                                self.engine.connect_failed(s, now);
                            }
                            continue;
                        }
                    }
                }
                if event.is_writable() {
                    if let Some(conn) = self.conns[s].as_mut() {
                        conn.writable = true;
                        // Records a TLS session could not write before.
                        if let Err(error) = conn.stream.flush() {
                            log::debug!("session {s}: write failed: {error}");
                        }
                    }
                }
                if event.is_readable() || event.is_read_closed() || event.is_error() {
                    self.read(s, now);
                }
            }
            std::mem::swap(&mut messages, &mut *lock(&self.shared.queue));
            let now = Instant::now();
            for message in messages.drain(..) {
                match message {
                    Message::Request(submission) => self.engine.submit(submission, now),
                    Message::Lease(message) => self.kept.receive(message, now),
                }
            }
            self.engine.handle_timeout(now);
            self.kept.handle_timeout(now);
            self.perform_actions();
            self.engine.expire(Instant::now());
            self.perform_actions();
            self.settle();
            self.shared
                .shutdown_notices
                .store(self.engine.shutdown_notices(), Ordering::Release);
            if self.shared.closed.load(Ordering::Acquire)
                && self.engine.is_idle()
                && lock(&self.shared.queue).is_empty()
            {
                break;
            }
        }
        self.shared.running.store(false, Ordering::Release);
        // Whatever is left (only after a poll failure) can no longer be
        // answered by this thread, and no lease can be renewed.
        while let Some((reply, _)) = self.engine.poll_completion() {
            if let Reply::Call { slot, seq } = reply {
                slot.deliver(seq, Outcome::Indeterminate);
            }
        }
        self.kept.lose_all();
    }

    /// Delivers outcomes, turns the kept leases' steps into requests and
    /// writes, until nothing more happens.
    fn settle(&mut self) {
        loop {
            let mut progressed = false;
            while let Some((reply, outcome)) = self.engine.poll_completion() {
                progressed = true;
                match reply {
                    Reply::Call { slot, seq } => slot.deliver(seq, outcome),
                    Reply::KeepAlive(id) => {
                        self.kept.set_connections(self.engine.sessions_ended());
                        self.kept.handle_outcome(id, outcome, Instant::now());
                    }
                    Reply::CheckLabel(check) => {
                        let (key, token, label) = *check;
                        self.proclaim_again(key, token, label, outcome);
                    }
                }
            }
            progressed |= self.run_keep_tasks();
            self.write_all();
            self.perform_actions();
            if !progressed {
                return;
            }
        }
    }

    /// Performs what the kept leases ask for; `true` if anything was.
    fn run_keep_tasks(&mut self) -> bool {
        let mut any = false;
        while let Some(task) = self.kept.poll_task() {
            any = true;
            let now = Instant::now();
            match task {
                KeepTask::Renew {
                    id,
                    key,
                    token,
                    lease_s,
                } => self.engine.submit(
                    Submission {
                        op: Op::Extend { token, lease_s },
                        key,
                        deadline: now + TRANSPORT_DEADLINE,
                        reply: Some(Reply::KeepAlive(id)),
                    },
                    now,
                ),
                KeepTask::Release { key, token } => {
                    self.engine.release_in_background(key, token, now)
                }
                KeepTask::CheckLabel { key, token, label } => {
                    self.observe_ids = self.observe_ids.wrapping_add(1);
                    self.engine.submit(
                        Submission {
                            op: Op::Observe {
                                id: self.observe_ids,
                                since: 0,
                                wait_s: 0,
                                seen: None,
                            },
                            key,
                            deadline: now + TRANSPORT_DEADLINE,
                            reply: Some(Reply::CheckLabel(Box::new((key, token, label)))),
                        },
                        now,
                    );
                }
            }
        }
        any
    }

    /// After a renewal through an outage or a reconnect (spec §7.5): the
    /// grant's label again when the read shows the grant without it (a
    /// server restarted after a crash adopted it). Only then: a server
    /// without `C` would end the connection that carries one. Nobody
    /// waits for the proclaim; a failure is left to the renewals.
    fn proclaim_again(&mut self, key: Key, token: u64, label: Label, read: Outcome) {
        let Outcome::Observed(state) = read else {
            log::debug!("reading {key:?} to restore its label: {}", read.summary());
            return;
        };
        if state.token != token || state.label == label.as_str() {
            return;
        }
        log::debug!(
            "{key:?}: grant {token} lost its label (adopted after a crash); proclaiming it again"
        );
        let now = Instant::now();
        self.engine.submit(
            Submission {
                op: Op::Proclaim { token, label },
                key,
                deadline: now + TRANSPORT_DEADLINE,
                reply: None,
            },
            now,
        );
    }

    fn perform_actions(&mut self) {
        while let Some(action) = self.engine.poll_action() {
            match action {
                Action::Connect(s) => self.connect(s),
                Action::Close(s) => self.drop_conn(s),
                Action::Drain(s) => self.read(s, Instant::now()),
            }
        }
    }

    /// Reads what has arrived on session `s` and feeds it to the engine.
    fn read(&mut self, s: SessionId, now: Instant) {
        loop {
            let Some(conn) = self.conns.get_mut(s).and_then(Option::as_mut) else {
                return;
            };
            if conn.connecting {
                return;
            }
            match conn.stream.read(&mut self.buf) {
                Ok(0) => {
                    log::debug!("session {s}: closed by the server");
                    self.drop_conn(s);
                    self.engine.session_closed(s, now);
                    return;
                }
                Ok(n) => {
                    self.engine.handle_input(s, &self.buf[..n], now);
                }
                Err(error) if would_block(&error) => return,
                Err(error) if interrupted(&error) => {}
                Err(error) => {
                    log::debug!("session {s}: read failed: {error}");
                    self.drop_conn(s);
                    #[cfg(feature = "tls")]
                    if let Some(failure) = crate::tls::failure(&error) {
                        return self.tls_failed(s, failure, now);
                    }
                    self.engine.session_closed(s, now);
                    return;
                }
            }
        }
    }

    /// The TLS session of `s` failed: a certificate problem ends its
    /// requests (spec §12.5), anything else is a session that died.
    #[cfg(feature = "tls")]
    fn tls_failed(&mut self, s: SessionId, failure: crate::tls::Failure, now: Instant) {
        use super::engine::Refusal;
        use crate::tls::Failure;
        // Its address as the user wrote it (`Display`; `Debug` of every
        // address kind would cost the binary 1.6 KB for this line).
        let address = match self.addresses.get(s / self.per_server) {
            Some(address) => address.to_string(),
            None => String::new(),
        };
        let why = match failure {
            Failure::Untrusted(why) | Failure::Other(why) => {
                log::debug!("session {s}: TLS with {address}: {why}");
                Refusal::Unavailable(Unavailable::Untrusted(why))
            }
            Failure::NotTls(why) => {
                log::debug!("session {s}: TLS with {address}: {why}");
                Refusal::Unavailable(Unavailable::WrongProtocol(why))
            }
            Failure::Refused(why) => {
                log::debug!("session {s}: TLS with {address}: {why}");
                Refusal::PermissionDenied(why)
            }
        };
        self.engine.tls_failed(s, why, now);
    }

    /// Writes every session's pending requests, encoding each batch just
    /// before its write.
    fn write_all(&mut self) {
        for s in 0..self.conns.len() {
            loop {
                if !self.engine.wants_write(s) {
                    break;
                }
                let Some(conn) = self.conns[s].as_mut().filter(|conn| conn.writable) else {
                    break;
                };
                let now = Instant::now();
                let Some(bytes) = self.engine.poll_transmit(s, now) else {
                    break;
                };
                match conn.stream.write(bytes) {
                    Ok(n) => self.engine.transmitted(s, n),
                    Err(error) if would_block(&error) => {
                        conn.writable = false;
                        self.engine.transmitted(s, 0);
                    }
                    Err(error) if interrupted(&error) => self.engine.transmitted(s, 0),
                    Err(error) => {
                        log::debug!("session {s}: write failed: {error}");
                        self.drop_conn(s);
                        self.engine.session_closed(s, now);
                    }
                }
            }
        }
    }

    fn connect(&mut self, s: SessionId) {
        self.drop_conn(s);
        let now = Instant::now();
        let Some(address) = self.addresses.get(s / self.per_server) else {
            self.engine.connect_failed(s, now);
            return;
        };
        let attempt = self.attempts[s];
        self.attempts[s] = attempt.wrapping_add(1);
        let resolved = match address {
            Address::Tcp(host_port) => Some(resolve(host_port, attempt)),
            #[cfg(feature = "tls")]
            Address::Tls(host_port) => Some(resolve(host_port, attempt)),
            _ => None,
        };
        let unresolved = matches!(resolved, Some(Err(_)));
        {
            let mut names = lock(&self.shared.unresolved);
            match &resolved {
                Some(Err(error)) => {
                    names.insert(address.to_string(), error.to_string());
                }
                _ => {
                    names.remove(&address.to_string());
                }
            }
        }
        let resolved =
            move || resolved.unwrap_or_else(|| Err(io::Error::other("no address to resolve")));
        let stream = match address {
            Address::Tcp(_) => resolved().and_then(TcpStream::connect).and_then(|stream| {
                stream.set_nodelay(true)?;
                Ok(Stream::Tcp(stream))
            }),
            Address::Unix(path) => UnixStream::connect(path).map(Stream::Unix),
            #[cfg(feature = "tls")]
            Address::Tls(host_port) => match &self.tls {
                Some(config) => crate::tls::server_name(host_port)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
                    .and_then(|name| {
                        let stream = TcpStream::connect(resolved()?)?;
                        stream.set_nodelay(true)?;
                        Stream::tls(stream, config.clone(), name)
                    }),
                None => Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "no TLS configuration",
                )),
            },
            #[cfg(not(feature = "tls"))]
            Address::Tls(_) => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "tls:// addresses need kunci built with the `tls` feature",
            )),
            // `Client::new` sends etcd addresses to the etcd backend.
            Address::Etcd { .. } => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "not a kunci server address",
            )),
        };
        let mut stream = match stream {
            Ok(stream) => stream,
            Err(error) => {
                log::debug!("session {s}: cannot connect to {address}: {error}");
                let failure = format!("{address}: {error}");
                *lock(&self.shared.last_connect_failure) = Some(failure);
                if !unresolved && self.is_refusal(s, &error) {
                    self.engine.connect_refused(s, now);
                } else {
                    self.engine.connect_failed(s, now);
                }
                return;
            }
        };
        self.generations[s] = self.generations[s].wrapping_add(1);
        let token = Token(((self.generations[s] as usize) << 32) | s);
        if let Err(error) = register(self.poll.registry(), &mut stream, token) {
            log::warn!("session {s}: cannot register its socket: {error}");
            self.engine.connect_failed(s, now);
            return;
        }
        self.conns[s] = Some(Conn {
            stream,
            connecting: true,
            writable: false,
        });
    }

    /// Keeps why session `s`'s connection attempt failed, for the message
    /// of an `Unavailable` that may follow.
    fn connect_failure(&self, s: SessionId, error: &io::Error) {
        if let Some(address) = self.addresses.get(s / self.per_server) {
            *lock(&self.shared.last_connect_failure) = Some(format!("{address}: {error}"));
        }
    }

    /// Whether a failed connect of session `s` was a refusal: nothing
    /// listens on the TCP port, or the unix socket is missing or this
    /// user may not open it (a name that does not resolve is not one).
    fn is_refusal(&self, s: SessionId, error: &io::Error) -> bool {
        match self.addresses.get(s / self.per_server) {
            Some(Address::Unix(_)) => matches!(
                error.kind(),
                io::ErrorKind::ConnectionRefused
                    | io::ErrorKind::NotFound
                    | io::ErrorKind::PermissionDenied
            ),
            Some(Address::Tcp(_) | Address::Tls(_)) => {
                error.kind() == io::ErrorKind::ConnectionRefused
            }
            _ => false,
        }
    }

    fn drop_conn(&mut self, s: SessionId) {
        if let Some(mut conn) = self.conns.get_mut(s).and_then(Option::take) {
            let _ = self.poll.registry().deregister(&mut conn.stream);
        }
    }
}

fn register(registry: &Registry, stream: &mut Stream, token: Token) -> io::Result<()> {
    registry.register(stream, token, Interest::READABLE | Interest::WRITABLE)
}

/// One of the addresses `host_port` names, a different one per attempt.
fn resolve(host_port: &str, attempt: usize) -> io::Result<SocketAddr> {
    let addresses: Vec<SocketAddr> = host_port.to_socket_addrs()?.collect();
    if addresses.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("{host_port} resolves to no address"),
        ));
    }
    Ok(addresses[attempt % addresses.len()])
}

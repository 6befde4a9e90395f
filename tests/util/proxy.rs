//! A fault-injecting TCP proxy between a client and a real server.
//!
//! It can refuse connections for a while (its port is bound but not yet
//! listening, so connects are refused by the kernel), accept and close
//! before reading, cut a connection after N request bytes, swallow
//! requests or answers, delay answers, and drop answers. It decodes both
//! directions and records every request frame it sees — whether it was
//! forwarded to the server — and every answer it passed on.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kunci::protocol::{self, Decoded, Request, Response};

/// What the proxy does to the traffic. Read live: changes apply to
/// connections already open.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Close each new connection at once, before reading anything.
    pub close_on_accept: bool,
    /// Forward this many request bytes per connection, then cut it.
    pub cut_after_request_bytes: Option<usize>,
    /// Read requests (and record them) but never forward them.
    pub swallow_requests: bool,
    /// Forward requests but never pass an answer back.
    pub swallow_answers: bool,
    /// Hold each answer this long after it came from the server.
    pub answer_delay: Duration,
    /// Drop the next this-many answers (whole frames).
    pub drop_answers: usize,
}

/// A request frame the proxy saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub op: u8,
    /// `A`: the wait on the wire.
    pub wait_s: u8,
    /// `A`, `E`: the lease.
    pub lease_s: u8,
    /// `A`: the owner; `R`, `E`: the token; `P`: the nonce.
    pub id: u64,
    pub key: String,
    /// When its last byte was read from the client.
    pub at: Instant,
    /// Whether it was passed to the server.
    pub forwarded: bool,
}

struct State {
    upstream: Mutex<String>,
    faults: Mutex<Faults>,
    frames: Mutex<Vec<Frame>>,
    answers: Mutex<Vec<Response>>,
    accepted: AtomicUsize,
    /// Connections the client closed (end of stream from its side).
    client_closes: AtomicUsize,
    streams: Mutex<Vec<TcpStream>>,
    stopped: AtomicBool,
}

/// A running proxy; stops (closing every connection) when dropped.
pub struct Proxy {
    /// Where clients connect: `127.0.0.1:PORT`.
    pub addr: String,
    state: Arc<State>,
}

impl Proxy {
    /// A proxy to `upstream` that accepts at once.
    pub fn start(upstream: &str) -> Proxy {
        Proxy::start_refusing(upstream, Some(Duration::ZERO))
    }

    /// A proxy whose connects are refused for `refuse_for` (`None`:
    /// forever), then accepted.
    pub fn start_refusing(upstream: &str, refuse_for: Option<Duration>) -> Proxy {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("socket");
        let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
        socket.bind(&local.into()).expect("bind");
        let addr = socket
            .local_addr()
            .unwrap()
            .as_socket()
            .expect("inet address")
            .to_string();
        let state = Arc::new(State {
            upstream: Mutex::new(upstream.to_owned()),
            faults: Mutex::new(Faults::default()),
            frames: Mutex::new(Vec::new()),
            answers: Mutex::new(Vec::new()),
            accepted: AtomicUsize::new(0),
            client_closes: AtomicUsize::new(0),
            streams: Mutex::new(Vec::new()),
            stopped: AtomicBool::new(false),
        });
        let listen = |socket: socket2::Socket| -> TcpListener {
            socket.listen(128).expect("listen");
            socket.into()
        };
        match refuse_for {
            Some(Duration::ZERO) => {
                let listener = listen(socket);
                let state = state.clone();
                std::thread::spawn(move || accept_loop(listener, state));
            }
            Some(delay) => {
                let state = state.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    if !state.stopped.load(Ordering::SeqCst) {
                        accept_loop(listen(socket), state);
                    }
                });
            }
            // Bound and never listening: every connect is refused.
            None => std::mem::forget(socket),
        }
        Proxy { addr, state }
    }

    pub fn set_faults(&self, faults: Faults) {
        *self.state.faults.lock().unwrap() = faults;
    }

    pub fn set_upstream(&self, upstream: &str) {
        *self.state.upstream.lock().unwrap() = upstream.to_owned();
    }

    /// Every request frame seen so far.
    pub fn frames(&self) -> Vec<Frame> {
        self.state.frames.lock().unwrap().clone()
    }

    /// The request frames that reached the server.
    pub fn forwarded(&self) -> Vec<Frame> {
        self.frames().into_iter().filter(|f| f.forwarded).collect()
    }

    /// Every answer passed back to the client.
    pub fn answers(&self) -> Vec<Response> {
        self.state.answers.lock().unwrap().clone()
    }

    pub fn accepted(&self) -> usize {
        self.state.accepted.load(Ordering::SeqCst)
    }

    pub fn client_closes(&self) -> usize {
        self.state.client_closes.load(Ordering::SeqCst)
    }

    /// Cuts every open connection.
    pub fn cut_all(&self) {
        for stream in self.state.streams.lock().unwrap().drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state.stopped.store(true, Ordering::SeqCst);
        self.cut_all();
        // Unblock the accept loop.
        let _ = TcpStream::connect(&self.addr);
    }
}

fn accept_loop(listener: TcpListener, state: Arc<State>) {
    for client in listener.incoming() {
        if state.stopped.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = client else { continue };
        state.accepted.fetch_add(1, Ordering::SeqCst);
        if state.faults.lock().unwrap().close_on_accept {
            drop(client);
            continue;
        }
        let upstream = state.upstream.lock().unwrap().clone();
        let Ok(server) = TcpStream::connect(&upstream) else {
            drop(client);
            continue;
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        {
            let mut streams = state.streams.lock().unwrap();
            streams.push(client.try_clone().unwrap());
            streams.push(server.try_clone().unwrap());
        }
        let (up_state, down_state) = (state.clone(), state.clone());
        let (client_reader, server_writer) =
            (client.try_clone().unwrap(), server.try_clone().unwrap());
        std::thread::spawn(move || pump_requests(client_reader, server_writer, up_state));
        std::thread::spawn(move || pump_answers(server, client, down_state));
    }
}

fn pump_requests(mut client: TcpStream, mut server: TcpStream, state: Arc<State>) {
    let mut chunk = [0u8; 4096];
    let mut pending = Vec::new();
    let mut forwarded_bytes = 0usize;
    loop {
        let n = match client.read(&mut chunk) {
            Ok(0) | Err(_) => {
                if !state.stopped.load(Ordering::SeqCst) {
                    state.client_closes.fetch_add(1, Ordering::SeqCst);
                }
                let _ = server.shutdown(Shutdown::Both);
                return;
            }
            Ok(n) => n,
        };
        let faults = state.faults.lock().unwrap().clone();
        let mut bytes = &chunk[..n];
        let mut cut = false;
        if let Some(limit) = faults.cut_after_request_bytes {
            let room = limit.saturating_sub(forwarded_bytes);
            if bytes.len() >= room {
                bytes = &bytes[..room];
                cut = true;
            }
        }
        let forward = !faults.swallow_requests;
        // Record before forwarding: the answer may reach the client (and the
        // test read `frames()`) before this thread runs again.
        pending.extend_from_slice(bytes);
        record_frames(&mut pending, forward, &state);
        if forward && !bytes.is_empty() && server.write_all(bytes).is_err() {
            let _ = client.shutdown(Shutdown::Both);
            return;
        }
        forwarded_bytes += bytes.len();
        if cut {
            let _ = client.shutdown(Shutdown::Both);
            let _ = server.shutdown(Shutdown::Both);
            return;
        }
    }
}

fn record_frames(pending: &mut Vec<u8>, forwarded: bool, state: &State) {
    loop {
        let (frame, len) = match protocol::decode_request(pending) {
            Decoded::Request { request, len } => {
                let (op, wait_s, lease_s, id, key) = match request {
                    Request::Acquire {
                        wait_s,
                        lease_s,
                        owner,
                        key,
                        ..
                    } if request.is_plain_acquire() => (b'A', wait_s, lease_s, owner, key),
                    Request::Acquire {
                        wait_s,
                        lease_s,
                        owner,
                        key,
                        ..
                    } => (b'S', wait_s, lease_s, owner, key),
                    Request::Release { token, key } => (b'R', 0, 0, token, key),
                    Request::Extend {
                        lease_s,
                        token,
                        key,
                    } => (b'E', 0, lease_s, token, key),
                    Request::Query { key } => (b'Q', 0, 0, 0, key),
                    Request::Ping { nonce } => (b'P', 0, 0, nonce, ""),
                    Request::Info => (b'I', 0, 0, 0, ""),
                    Request::Holders { id, key } => (b'H', 0, 0, id, key),
                    Request::List { id, prefix, .. } => (b'L', 0, 0, id, prefix),
                    Request::Authenticate { .. } => (b'U', 0, 0, 0, ""),
                    Request::Observe {
                        wait_s, id, key, ..
                    } => (b'O', wait_s, 0, id, key),
                    Request::Proclaim { token, key, .. } => (b'C', 0, 0, token, key),
                };
                let frame = Frame {
                    op,
                    wait_s,
                    lease_s,
                    id,
                    key: key.to_owned(),
                    at: Instant::now(),
                    forwarded,
                };
                (frame, len)
            }
            Decoded::Incomplete => return,
            Decoded::Invalid { len, .. } => {
                pending.drain(..len);
                continue;
            }
            Decoded::Fatal(_) => {
                pending.clear();
                return;
            }
        };
        state.frames.lock().unwrap().push(frame);
        pending.drain(..len);
    }
}

fn pump_answers(mut server: TcpStream, mut client: TcpStream, state: Arc<State>) {
    let mut chunk = [0u8; 4096];
    let mut pending = Vec::new();
    loop {
        let n = match server.read(&mut chunk) {
            Ok(0) | Err(_) => {
                let _ = client.shutdown(Shutdown::Both);
                return;
            }
            Ok(n) => n,
        };
        let arrived = Instant::now();
        pending.extend_from_slice(&chunk[..n]);
        while let Ok(Some((response, len))) = protocol::decode_response(&pending) {
            let frame: Vec<u8> = pending.drain(..len).collect();
            let pass = {
                let mut faults = state.faults.lock().unwrap();
                if faults.swallow_answers {
                    None
                } else if faults.drop_answers > 0 {
                    faults.drop_answers -= 1;
                    None
                } else {
                    Some(faults.answer_delay)
                }
            };
            let Some(delay) = pass else { continue };
            let due = arrived + delay;
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if client.write_all(&frame).is_err() {
                let _ = server.shutdown(Shutdown::Both);
                return;
            }
            state.answers.lock().unwrap().push(response);
        }
    }
}

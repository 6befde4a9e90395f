//! Test helpers shared by the modules: a real `kunci serve` on port 0, and
//! a raw-socket peer that speaks bytes.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kunci::protocol::{self, Request, Response};

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod frames;
pub mod proxy;
pub mod scripted;
mod temp;
mod tool;
pub mod wire;

pub use temp::TempDir;
pub use tool::require_tool;

/// An `S` frame written out byte by byte as the spec lays it out (§2.1:
/// `S wait lease owner:u64 limit:u16 take:u16 klen:u8 key label \n`), not
/// by the library's encoder, so the tests check the wire independently.
pub fn s_frame(
    wait_s: u8,
    lease_s: u8,
    owner: u64,
    limit: u16,
    take: u16,
    key: &[u8],
    label: &[u8],
) -> Vec<u8> {
    let mut frame = vec![b'S', wait_s, lease_s];
    frame.extend_from_slice(&owner.to_be_bytes());
    frame.extend_from_slice(&limit.to_be_bytes());
    frame.extend_from_slice(&take.to_be_bytes());
    frame.push(u8::try_from(key.len()).expect("a key of at most 255 bytes"));
    frame.extend_from_slice(key);
    frame.extend_from_slice(label);
    frame.push(b'\n');
    frame
}

/// The `kunci` binary under test.
pub fn kunci_bin() -> &'static str {
    env!("CARGO_BIN_EXE_kunci")
}

/// `kunci ARGS` against `server` (as `KUNCI_SERVER`), with stdin closed and
/// no `RUST_LOG`, so that only what the command itself says shows.
pub fn kunci_command(server: &str, args: &[&str]) -> Command {
    let mut command = Command::new(kunci_bin());
    command
        .args(args)
        .env("KUNCI_SERVER", server)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    command
}

/// `kunci ARGS` against `server`, run to its end.
pub fn kunci(server: &str, args: &[&str]) -> Output {
    kunci_command(server, args).output().expect("run kunci")
}

/// `kunci ARGS` against `server`, started with its stdout piped (for
/// [`stdout_lines`]) and its stderr dropped.
pub fn spawn_kunci(server: &str, args: &[&str]) -> Child {
    kunci_command(server, args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kunci")
}

/// The lines a child prints, as they come.
pub fn stdout_lines(child: &mut Child) -> mpsc::Receiver<String> {
    let stdout = child.stdout.take().expect("piped stdout");
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if sender.send(line).is_err() {
                return;
            }
        }
    });
    receiver
}

/// The next line of [`stdout_lines`], within `limit`.
#[track_caller]
pub fn next_line(lines: &mpsc::Receiver<String>, limit: Duration) -> String {
    let caller = std::panic::Location::caller();
    lines
        .recv_timeout(limit)
        .unwrap_or_else(|_| panic!("no line within {limit:?} (at {caller})"))
}

/// Sends `signal` to a child of this test.
pub fn signal(child: &Child, signal: i32) {
    // SAFETY: kill(2) with our own child's pid.
    unsafe {
        libc::kill(child.id() as i32, signal);
    }
}

/// A command's stdout as text.
pub fn stdout_text(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A `kunci serve` child process, killed when dropped.
pub struct TestServer {
    child: Option<Child>,
    /// Run by a wrapper, in a process group of its own.
    wrapped: bool,
    /// The TCP address it listens on (`127.0.0.1:PORT`), if any.
    pub addr: String,
    /// Every address it listens on, as the start-up line names them.
    pub addresses: Vec<String>,
    /// Everything it has logged so far.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl TestServer {
    /// Starts `kunci serve ARGS`, listening on `127.0.0.1:0` unless ARGS
    /// has a `--listen`, and waits for its start-up line.
    pub fn start(args: &[&str]) -> TestServer {
        Self::start_with(args, |_| {})
    }

    /// As [`start`](Self::start), letting the caller adjust the command
    /// (environment, resource limits) before it runs.
    pub fn start_with(args: &[&str], adjust: impl FnOnce(&mut Command)) -> TestServer {
        Self::start_under(&[], args, adjust)
    }

    /// As [`start_with`](Self::start_with), run by `wrapper` (a program
    /// and its arguments, e.g. `faketime -f -1h`) when it is not empty.
    pub fn start_under(
        wrapper: &[&str],
        args: &[&str],
        adjust: impl FnOnce(&mut Command),
    ) -> TestServer {
        Self::spawn(wrapper, args, adjust, false)
    }

    /// `kunci serve ARGS` with no state flag added: the server picks its
    /// default state directory (spec §7) from `HOME`, `XDG_STATE_HOME`
    /// and `STATE_DIRECTORY`, which this sets (`home`) and clears.
    pub fn start_with_default_state(args: &[&str], home: &std::path::Path) -> TestServer {
        Self::spawn(
            &[],
            args,
            |command| {
                command
                    .env("HOME", home)
                    .env_remove("XDG_STATE_HOME")
                    .env_remove("STATE_DIRECTORY");
            },
            true,
        )
    }

    fn spawn(
        wrapper: &[&str],
        args: &[&str],
        adjust: impl FnOnce(&mut Command),
        default_state: bool,
    ) -> TestServer {
        let mut command = match wrapper.split_first() {
            Some((program, wrapper_args)) => {
                let mut command = Command::new(program);
                command.args(wrapper_args).arg(kunci_bin());
                // A wrapper such as faketime forks the server: its own
                // process group lets `kill` reach both.
                std::os::unix::process::CommandExt::process_group(&mut command, 0);
                command
            }
            None => Command::new(kunci_bin()),
        };
        command.arg("serve");
        if !args.contains(&"--listen") {
            command.args(["--listen", "127.0.0.1:0"]);
        }
        // Tests never write under the user's home: a test that wants a
        // state directory names one (or starts the server with a HOME of
        // its own, `start_with_default_state`).
        let state_named = args
            .iter()
            .any(|arg| *arg == "--state-dir" || *arg == "--no-state-dir");
        if !state_named && !default_state {
            command.arg("--no-state-dir");
        }
        command
            .args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        adjust(&mut command);
        let mut child = command.spawn().expect("spawn kunci serve");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (started, listening) = mpsc::channel();
        let lines = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.split("listening on ").nth(1) {
                    let addresses = rest.split(';').next().unwrap_or("").to_owned();
                    let _ = started.send(addresses);
                }
                lines.lock().unwrap().push(line);
            }
        });
        let addresses = match listening.recv_timeout(Duration::from_secs(20)) {
            Ok(addresses) => addresses,
            Err(_) => {
                let _ = child.kill();
                panic!("server did not start; log: {:?}", log.lock().unwrap());
            }
        };
        let addresses: Vec<String> = addresses.split(' ').map(str::to_owned).collect();
        let addr = addresses
            .iter()
            .find(|a| !a.starts_with("unix:"))
            .cloned()
            .unwrap_or_default();
        TestServer {
            child: Some(child),
            wrapped: !wrapper.is_empty(),
            addr,
            addresses,
            log,
        }
    }

    /// The first line logged that `wanted` accepts, waiting up to 10 s
    /// for it (lines logged after the start-up line come in later).
    pub fn wait_log_line(&self, wanted: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(line) = self.log.lock().unwrap().iter().find(|l| wanted(l)) {
                return line.clone();
            }
            assert!(
                Instant::now() < deadline,
                "line not logged: {:?}",
                self.log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// A raw peer connected to the server's TCP address.
    pub fn peer(&self) -> Peer {
        Peer::connect(&self.addr)
    }

    /// Sends `signal` to the server.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) with our own child's pid.
        unsafe {
            libc::kill(self.pid() as i32, signal);
        }
    }

    /// Waits for the server to exit, up to `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGTERM, then waits up to 10 s for the exit status.
    pub fn stop(mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait_exit(Duration::from_secs(10))
            .expect("server did not exit within 10 s of SIGTERM")
    }

    /// SIGKILL: an unclean stop.
    pub fn kill(mut self) {
        self.kill_now();
    }

    /// SIGKILL to the server (and to its wrapper's whole group), reaped.
    fn kill_now(&mut self) {
        if let Some(mut child) = self.child.take() {
            if self.wrapped {
                // SAFETY: kill(2) with a plain process-group id.
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The server's resident set size in KiB, from /proc.
    pub fn rss_kib(&self) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    }

    /// The `I` line of a server with `--auth`, asked with `secret`.
    pub fn info_with(&self, secret: &[u8]) -> std::collections::HashMap<String, String> {
        let mut peer = self.peer();
        peer.request(&Request::Authenticate { secret });
        assert!(matches!(peer.recv(), Response::Authenticated { .. }));
        peer.send(b"I\n");
        match peer.recv() {
            Response::Info(text) => parse_info(&text),
            other => panic!("expected info, got {other:?}"),
        }
    }

    /// The server's `I` line as name → value.
    pub fn info(&self) -> std::collections::HashMap<String, String> {
        let mut peer = self.peer();
        peer.send(b"I\n");
        match peer.recv() {
            Response::Info(text) => parse_info(&text),
            other => panic!("expected info, got {other:?}"),
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.kill_now();
    }
}

/// Parses an `I` line into name → value.
pub fn parse_info(text: &str) -> std::collections::HashMap<String, String> {
    text.split(' ')
        .filter_map(|pair| pair.split_once('='))
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect()
}

/// How long a test waits for an answer that should come before it fails.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// A raw protocol peer over TCP or a Unix socket.
pub struct Peer {
    stream: Box<dyn ReadWrite>,
    buffer: Vec<u8>,
}

pub trait ReadWrite: Read + Write + Send {
    fn set_timeout(&self, timeout: Option<Duration>);
}

impl ReadWrite for TcpStream {
    fn set_timeout(&self, timeout: Option<Duration>) {
        self.set_read_timeout(timeout).unwrap();
    }
}

impl ReadWrite for std::os::unix::net::UnixStream {
    fn set_timeout(&self, timeout: Option<Duration>) {
        self.set_read_timeout(timeout).unwrap();
    }
}

impl Peer {
    pub fn connect(addr: &str) -> Peer {
        if let Some(path) = addr.strip_prefix("unix:") {
            let stream = std::os::unix::net::UnixStream::connect(path).expect("connect unix");
            return Peer::from_stream(Box::new(stream));
        }
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_nodelay(true).unwrap();
        Peer::from_stream(Box::new(stream))
    }

    pub fn from_tcp(stream: TcpStream) -> Peer {
        Peer::from_stream(Box::new(stream))
    }

    fn from_stream(stream: Box<dyn ReadWrite>) -> Peer {
        stream.set_timeout(Some(PATIENCE));
        Peer {
            stream,
            buffer: Vec::new(),
        }
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("send");
    }

    pub fn request(&mut self, request: &Request<'_>) {
        let mut bytes = Vec::new();
        protocol::encode_request(request, &mut bytes);
        self.send(&bytes);
    }

    /// Receives exactly the next `n` bytes.
    pub fn recv_bytes(&mut self, n: usize) -> Vec<u8> {
        while self.buffer.len() < n {
            self.fill()
                .unwrap_or_else(|| panic!("connection closed; had {:?}", self.buffer));
        }
        self.buffer.drain(..n).collect()
    }

    /// Receives the next response frame.
    pub fn recv(&mut self) -> Response {
        self.try_recv()
            .expect("connection closed before a response")
    }

    /// Receives the next response frame, or `None` at end of stream.
    pub fn try_recv(&mut self) -> Option<Response> {
        loop {
            match protocol::decode_response(&self.buffer) {
                Ok(Some((response, len))) => {
                    self.buffer.drain(..len);
                    return Some(response);
                }
                Ok(None) => {}
                Err(e) => panic!("undecodable response {:?}: {e}", self.buffer),
            }
            self.fill()?;
        }
    }

    /// Waits for the server to close the connection (end of stream or
    /// reset) with nothing more sent; panics on more bytes.
    pub fn expect_closed(&mut self) {
        if let Some(bytes) = self.fill() {
            panic!(
                "expected the connection to close, got {bytes} more bytes: {:?}",
                self.buffer
            );
        }
    }

    /// Whether nothing arrives within `quiet`.
    pub fn is_silent_for(&mut self, quiet: Duration) -> bool {
        if !self.buffer.is_empty() {
            return false;
        }
        self.stream.set_timeout(Some(quiet));
        let mut byte = [0u8; 1];
        let silent = match self.stream.read(&mut byte) {
            Ok(0) => false,
            Ok(_) => {
                self.buffer.push(byte[0]);
                false
            }
            Err(_) => true,
        };
        self.stream.set_timeout(Some(PATIENCE));
        silent
    }

    fn fill(&mut self) -> Option<usize> {
        let mut chunk = [0u8; 4096];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => return None,
                Ok(n) => {
                    self.buffer.extend_from_slice(&chunk[..n]);
                    return Some(n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
                // A read with a timeout is not restarted after a signal
                // handler ran on this thread (other tests in this process
                // install handlers): read again.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => panic!("read failed (timeout is {PATIENCE:?}): {e}"),
            }
        }
    }
}

/// The request `frame` decodes to, checking that it is one whole frame and
/// that the encoder makes the same bytes of it.
pub fn decoded(frame: &[u8]) -> Request<'_> {
    let protocol::Decoded::Request { request, len } = protocol::decode_request(frame) else {
        panic!("not a valid request: {frame:?}");
    };
    assert_eq!(len, frame.len());
    let mut again = Vec::new();
    protocol::encode_request(&request, &mut again);
    assert_eq!(again, frame);
    request
}

/// The plain exclusive `A` (spec §10.1: limit 0, take 0, no label).
pub fn plain_acquire(wait_s: u8, lease_s: u8, owner: u64, key: &str) -> Request<'_> {
    Request::Acquire {
        wait_s,
        lease_s,
        owner,
        key,
        limit: 0,
        take: 0,
        label: "",
    }
}

/// Request builders.
pub fn acquire(wait_s: u8, lease_s: u8, owner: u64, key: &str) -> Vec<u8> {
    encode(&plain_acquire(wait_s, lease_s, owner, key))
}

pub fn release(token: u64, key: &str) -> Vec<u8> {
    encode(&Request::Release { token, key })
}

pub fn extend(lease_s: u8, token: u64, key: &str) -> Vec<u8> {
    encode(&Request::Extend {
        lease_s,
        token,
        key,
    })
}

pub fn query(key: &str) -> Vec<u8> {
    encode(&Request::Query { key })
}

pub fn ping(nonce: u64) -> Vec<u8> {
    encode(&Request::Ping { nonce })
}

fn encode(request: &Request<'_>) -> Vec<u8> {
    let mut bytes = Vec::new();
    protocol::encode_request(request, &mut bytes);
    bytes
}

/// The token of an `A`, panicking on anything else.
pub fn granted(response: Response, owner: u64) -> u64 {
    match response {
        Response::Acquired { owner: o, token } if o == owner => token,
        other => panic!("expected A for owner {owner}, got {other:?}"),
    }
}

pub mod fake;
pub mod model;

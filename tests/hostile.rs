//! Issue 27: one hostile or buggy peer must not stall or lock out everyone
//! else (spec §4 fairness and per-peer share, §12.2 the `U` deadline).
//! Each test reproduces one measured attack; the endpoint ones run on a
//! fake clock, the others against a real `kunci serve`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kunci::core::access::AccessList;
use kunci::core::connection::{PARTIAL_FRAME_TIMEOUT_US, Phase};
use kunci::core::endpoint::{Action, Endpoint};
use kunci::core::{Core, Limits};
use kunci::protocol::{self, ErrorCode, Request, Response};

use crate::access::{LOCKER, auth_file, authenticate};
use crate::util::fake::FIRST_TOKEN;
use crate::util::{Peer, TempDir, TestServer, acquire, ping, s_frame};

fn encode(request: &Request<'_>) -> Vec<u8> {
    let mut bytes = Vec::new();
    protocol::encode_request(request, &mut bytes);
    bytes
}

/// Pipelines `frames` into `count` connections that read and drop every
/// answer, for as long as the returned guard lives.
struct Flood {
    stop: Arc<AtomicBool>,
    streams: Vec<TcpStream>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Flood {
    fn start(addr: &str, count: usize, setup: &[u8], frames: &[u8]) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let mut streams = Vec::new();
        let mut threads = Vec::new();
        let burst: Vec<u8> = frames.repeat((64 * 1024 / frames.len()).max(1));
        for _ in 0..count {
            let stream = TcpStream::connect(addr).unwrap();
            let mut reader = stream.try_clone().unwrap();
            threads.push(std::thread::spawn(move || {
                let mut sink = vec![0; 1 << 16];
                while matches!(reader.read(&mut sink), Ok(n) if n > 0) {}
            }));
            let mut writer = stream.try_clone().unwrap();
            let stop = stop.clone();
            let burst = burst.clone();
            let setup = setup.to_vec();
            threads.push(std::thread::spawn(move || {
                if writer.write_all(&setup).is_err() {
                    return;
                }
                while !stop.load(Ordering::Relaxed) {
                    if writer.write_all(&burst).is_err() {
                        return;
                    }
                }
            }));
            streams.push(stream);
        }
        Flood {
            stop,
            streams,
            threads,
        }
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for stream in &self.streams {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Another client's ping round trips (sorted) while `flood` runs.
fn pings_during(server: &TestServer, flood: &Flood, n: u64) -> Vec<Duration> {
    let _ = flood;
    // Let the flood fill the server's buffers first.
    std::thread::sleep(Duration::from_millis(300));
    let mut peer = server.peer();
    let mut times = Vec::new();
    for nonce in 0..n {
        let start = Instant::now();
        peer.send(&ping(nonce));
        assert_eq!(peer.recv(), Response::Pong { nonce });
        times.push(start.elapsed());
        std::thread::sleep(Duration::from_millis(5));
    }
    times.sort();
    times
}

/// Sends `frames` on a fresh connection and reads `answers` frames back.
fn prepare(server: &TestServer, frames: &[u8], answers: usize) {
    let mut peer = server.peer();
    peer.send(frames);
    for _ in 0..answers {
        peer.recv();
    }
}

/// Finding 1: with 16,000 keys, connections pipelining `L` for a prefix
/// nothing has (16,000 slots examined each, ~85 µs) made other clients'
/// pings take seconds: one wake-up ran every `L` it had read. Now each
/// connection gets a bounded share of each turn of the loop.
#[test]
fn pipelined_lists_do_not_stall_other_clients() {
    let server = TestServer::start(&[]);
    let keys: Vec<u8> = (0..16_000)
        .flat_map(|n| acquire(0, 255, 1, &format!("k{n:05}")))
        .collect();
    prepare(&server, &keys, 16_000);
    let list = encode(&Request::List {
        id: 1,
        cursor: 0,
        count: 1_000,
        prefix: "zzz",
    });
    let flood = Flood::start(&server.addr, 4, &[], &list);
    let times = pings_during(&server, &flood, 20);
    drop(flood);
    let median = times[times.len() / 2];
    assert!(
        median < Duration::from_millis(100),
        "ping median {median:?} under the L flood: {times:?}"
    );
}

/// Finding 2: the same with `H` on a key with 65,535 grants (~200 µs to
/// walk each).
#[test]
fn pipelined_holders_do_not_stall_other_clients() {
    let server = TestServer::start(&[]);
    let grants: Vec<u8> = (0..65_535u64)
        .flat_map(|owner| s_frame(0, 255, owner, 65_535, 1, b"h", b""))
        .collect();
    prepare(&server, &grants, 65_535);
    let holders = encode(&Request::Holders { id: 1, key: "h" });
    let flood = Flood::start(&server.addr, 2, &[], &holders);
    let times = pings_during(&server, &flood, 20);
    drop(flood);
    let median = times[times.len() / 2];
    assert!(
        median < Duration::from_millis(100),
        "ping median {median:?} under the H flood: {times:?}"
    );
}

/// Finding 3, first half: on an `--auth` server a session that sends
/// nothing was never closed, so idle connections could fill the table.
/// Now it gets `X 12` exactly 10 s after its accept, and is counted as
/// an authentication failure.
#[test]
fn an_unauthenticated_idle_session_is_closed_at_10_s() {
    let mut endpoint = Endpoint::new(Core::new(Limits::default(), FIRST_TOKEN), Vec::new());
    endpoint.require_authentication(AccessList::parse(&auth_file()).unwrap());
    endpoint.accept(0, None, 1_000);
    endpoint.accept(1, None, 1_000);
    // One session authenticates in time: it stays, idle, for as long as
    // it likes.
    endpoint.handle_read(1, &authenticate(LOCKER), 9_000_000);
    endpoint.handle_timeout(PARTIAL_FRAME_TIMEOUT_US + 999);
    endpoint.check_invariants();
    assert_eq!(endpoint.connection(0).map(|c| c.phase()), Some(Phase::Open));
    endpoint.handle_timeout(1_000 + PARTIAL_FRAME_TIMEOUT_US);
    endpoint.check_invariants();
    let mut sent = Vec::new();
    while let Some(bytes) = endpoint.transmit(0) {
        sent.extend_from_slice(bytes);
        let n = bytes.len();
        endpoint.handle_written(0, n, 1_000 + PARTIAL_FRAME_TIMEOUT_US);
    }
    let mut expected = Vec::new();
    protocol::encode_response(&ErrorCode::NotAuthenticated.response(0), &mut expected);
    assert_eq!(sent, expected);
    let actions: Vec<_> = std::iter::from_fn(|| endpoint.poll_action()).collect();
    assert_eq!(actions, [(0, Action::ShutWrite)]);
    assert_eq!(endpoint.core().stats().auth_failures, 1);
    assert_eq!(endpoint.connection(1).map(|c| c.phase()), Some(Phase::Open));
    endpoint.handle_timeout(3_600_000_000);
    assert_eq!(endpoint.connection(1).map(|c| c.phase()), Some(Phase::Open));
}

/// A connection from `ip` (a loopback address other than 127.0.0.1 is
/// another peer) to `addr`.
fn connect_from(ip: &str, addr: &str) -> Peer {
    let addr: SocketAddr = addr.parse().unwrap();
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    let from: SocketAddr = format!("{ip}:0").parse().unwrap();
    socket.bind(&from.into()).unwrap();
    socket.connect(&addr.into()).unwrap();
    Peer::from_tcp(socket.into())
}

/// Finding 3, second half: one host could take every connection. Now one
/// peer address holds at most its share (half of --max-connections by
/// default), and another address (127.0.0.2 too) still gets in.
#[test]
fn one_peer_address_holds_at_most_its_share_of_the_connections() {
    let server = TestServer::start(&["--max-connections", "4"]);
    let mut held = Vec::new();
    for nonce in 0..2 {
        let mut peer = connect_from("127.0.0.1", &server.addr);
        peer.send(&ping(nonce));
        assert_eq!(peer.recv(), Response::Pong { nonce });
        held.push(peer);
    }
    let mut third = connect_from("127.0.0.1", &server.addr);
    assert_eq!(third.recv(), ErrorCode::ConnectionLimit.response(0));
    third.expect_closed();
    let mut other = connect_from("127.0.0.2", &server.addr);
    other.send(&ping(7));
    assert_eq!(other.recv(), Response::Pong { nonce: 7 });
    // A closed connection gives its place back.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut again = connect_from("127.0.0.1", &server.addr);
        again.send(&ping(8));
        match again.recv() {
            Response::Pong { nonce: 8 } => break,
            other => assert!(Instant::now() < deadline, "{other:?}"),
        }
    }
}

/// Finding 7: every failed secret logged a line (36,631 lines a second
/// from one client). Now one line per peer per minute, and the counter
/// stays exact.
#[test]
fn authentication_failures_are_logged_once_per_peer_and_counted_exactly() {
    let (_dir, path) = crate::access_server::auth_dir("auth-flood");
    let server = TestServer::start(&["--auth", &path]);
    let wrong = b"wrong-secret-that-is-long-enough-to-hash";
    for _ in 0..50 {
        let mut peer = server.peer();
        peer.send(&authenticate(wrong));
        assert_eq!(peer.recv(), ErrorCode::NotAuthenticated.response(0));
        peer.expect_closed();
    }
    let info = server.info_with(crate::access::EVERYTHING);
    assert_eq!(info["auth_failures"], "50");
    let lines = server
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|line| line.contains("authentication failed"))
        .count();
    assert_eq!(lines, 1);
}

fn mode_of(path: &std::path::Path) -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).unwrap().mode() & 0o7777
}

/// `kunci serve ARGS` that must fail at start; its stderr. A start that
/// hangs (a FIFO read) fails the test after 10 s.
fn failed_start(args: &[&std::ffi::OsStr]) -> String {
    let mut child = std::process::Command::new(crate::util::kunci_bin())
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut stderr)
                .unwrap();
            assert!(!status.success(), "started: {stderr}");
            return stderr;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kunci serve {args:?} neither started nor failed in 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Finding 8: the state directory was 0755 and its files 0644 under
/// umask 022, and it holds every key and label after a clean stop. Now
/// the directory is 0700 and the files 0600, and a directory that others
/// may write is refused.
#[test]
fn the_state_directory_is_private_and_one_others_may_write_is_refused() {
    let parent = TempDir::new("private-state");
    let dir = parent.join("state");
    let state = dir.display().to_string();
    let server = TestServer::start(&["--state-dir", &state]);
    let mut peer = server.peer();
    peer.send(&acquire(0, 60, 1, "secret/key"));
    peer.recv();
    assert!(server.stop().success());
    assert_eq!(mode_of(&dir), 0o700);
    assert_eq!(mode_of(&dir.join("kunci.state")), 0o600);
    assert_eq!(mode_of(&dir.join("kunci.lock")), 0o600);

    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let stderr = failed_start(&["--state-dir".as_ref(), dir.as_os_str()]);
    assert!(stderr.contains("lets others write it"), "{stderr}");
}

/// Finding 8: a FIFO where the state file belongs hung the start (the
/// read waited for a writer), and a symbolic link was followed. Both are
/// now a clear error at start.
#[test]
fn a_fifo_or_a_symbolic_link_for_the_state_file_stops_the_start() {
    // A valid state file elsewhere, linked to.
    let elsewhere = TempDir::new("linked-state");
    let server = TestServer::start(&["--state-dir", &elsewhere.0.display().to_string()]);
    assert!(server.stop().success());
    let link_dir = TempDir::new("symlink-state");
    std::os::unix::fs::symlink(elsewhere.join("kunci.state"), link_dir.join("kunci.state"))
        .unwrap();
    let stderr = failed_start(&["--state-dir".as_ref(), link_dir.0.as_os_str()]);
    assert!(stderr.contains("symbolic link"), "{stderr}");

    if !crate::util::require_tool("mkfifo", "coreutils") {
        return;
    }
    let fifo_dir = TempDir::new("fifo-state");
    let status = std::process::Command::new("mkfifo")
        .arg(fifo_dir.join("kunci.state"))
        .status()
        .unwrap();
    assert!(status.success());
    let stderr = failed_start(&["--state-dir".as_ref(), fifo_dir.0.as_os_str()]);
    assert!(stderr.contains("is a FIFO, not a regular file"), "{stderr}");
}

/// A connection from `ip` to the metrics listener at `metrics`.
fn metrics_from(ip: &str, metrics: &str) -> TcpStream {
    let addr: SocketAddr = metrics.parse().unwrap();
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    let from: SocketAddr = format!("{ip}:0").parse().unwrap();
    socket.bind(&from.into()).unwrap();
    socket.connect(&addr.into()).unwrap();
    socket.into()
}

/// Issue 38, finding 2: eight half-sent `GET`s from two addresses held
/// every metrics slot for 5 s at a time. Now three hosts' half-sent
/// requests (4 each, the most one address may hold) leave a fourth host's
/// scrape served at once, and each is closed at its 2 s deadline, not
/// before.
#[test]
fn half_sent_scrapes_keep_no_other_host_out_and_end_at_2_s() {
    let (_server, metrics) = crate::metrics::server_with_metrics(&[]);
    let started = Instant::now();
    let mut held: Vec<TcpStream> = Vec::new();
    for host in 1..=3 {
        for _ in 0..4 {
            let mut stream = metrics_from(&format!("127.0.0.{host}"), &metrics);
            stream.write_all(b"GET /metr").unwrap();
            held.push(stream);
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    let mut other = metrics_from("127.0.0.4", &metrics);
    other
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    other
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: kunci\r\n\r\n")
        .unwrap();
    let mut answer = Vec::new();
    let _ = other.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
    for mut stream in held {
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
        assert!(rest.is_empty(), "a half-sent request was answered");
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(2) && waited < Duration::from_millis(3_500),
            "closed after {waited:?}"
        );
    }
}

/// Finding 9: one host could hold every metrics slot (8) open. Now one
/// peer address holds at most 4 and a scrape from another (127.0.0.2)
/// is served while they stay open.
#[test]
fn one_peer_address_holds_at_most_half_of_the_metrics_slots() {
    let (_server, metrics) = crate::metrics::server_with_metrics(&[]);
    let connect = |ip: &str| metrics_from(ip, &metrics);
    let held: Vec<TcpStream> = (0..8).map(|_| connect("127.0.0.1")).collect();
    let mut other = connect("127.0.0.2");
    other
        .set_read_timeout(Some(Duration::from_secs(4)))
        .unwrap();
    other
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: kunci\r\n\r\n")
        .unwrap();
    let mut answer = Vec::new();
    let _ = other.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer:?}");
    // The first 4 of the 8 are being served; the others were closed.
    let mut closed = 0;
    for mut stream in held {
        stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut byte = [0];
        if matches!(stream.read(&mut byte), Ok(0)) {
            closed += 1;
        }
    }
    assert_eq!(closed, 4);
}

/// Issue 38, finding 1: a held watch costs at most 64 bytes plus its key's
/// bytes once per watched key (spec §13.3); on distinct 200-byte keys that
/// is at most 350 bytes of the server's RSS per watch (695 on 240-byte keys
/// when the key was kept twice).
#[test]
fn a_held_watch_on_a_distinct_200_byte_key_costs_at_most_350_bytes() {
    const CONNECTIONS: usize = 5;
    const PER_CONNECTION: usize = 4_000;
    let server = TestServer::start(&[]);
    let mut peers: Vec<Peer> = (0..CONNECTIONS).map(|_| server.peer()).collect();
    for (nonce, peer) in peers.iter_mut().enumerate() {
        peer.send(&ping(nonce as u64));
        assert_eq!(
            peer.recv(),
            Response::Pong {
                nonce: nonce as u64
            }
        );
    }
    let before = server.rss_kib();
    for (index, peer) in peers.iter_mut().enumerate() {
        let mut frames = Vec::new();
        for n in 0..PER_CONNECTION {
            let key = format!("{index}/{n:08}/{}", "k".repeat(189));
            assert_eq!(key.len(), 200);
            frames.extend_from_slice(&encode(&Request::Observe {
                wait_s: 255,
                id: n as u64,
                since: 0,
                key: &key,
            }));
        }
        frames.extend_from_slice(&ping(7));
        peer.send(&frames);
        // The ping's answer comes after every `O` was read and held.
        assert_eq!(peer.recv(), Response::Pong { nonce: 7 });
    }
    assert_eq!(
        server.info()["watches"],
        (CONNECTIONS * PER_CONNECTION).to_string()
    );
    let after = server.rss_kib();
    let per_watch = after.saturating_sub(before) * 1024 / (CONNECTIONS * PER_CONNECTION) as u64;
    assert!(per_watch <= 350, "{per_watch} B of RSS per watch");
}

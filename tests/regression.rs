//! One test per fixed defect, named after it.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use kunci::protocol::{self, Response};

use crate::util::{self, Peer, TestServer, acquire, granted, ping, query, release};

/// Sends `bytes` and the FIN in one TCP segment: with `TCP_CORK` the data
/// waits in the socket, and `shutdown` puts the FIN on that same segment.
fn send_with_fin(address: &str, bytes: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(address).expect("connect");
    let on: libc::c_int = 1;
    // SAFETY: setsockopt on a socket we own, with a c_int option value.
    let corked = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CORK,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(corked, 0, "TCP_CORK");
    stream.write_all(bytes).expect("send");
    stream.shutdown(Shutdown::Write).expect("shutdown");
    stream
        .set_read_timeout(Some(util::PATIENCE))
        .expect("timeout");
    stream
}

/// Reads until end-of-file (or a reset) and returns everything read and
/// how long the server took to close.
fn read_to_close(stream: &mut TcpStream) -> (Vec<u8>, Duration) {
    let started = Instant::now();
    let mut bytes = Vec::new();
    let mut chunk = [0u8; 256];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => bytes.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the server did not close the connection: {e}"),
        }
    }
    (bytes, started.elapsed())
}

/// Issue 10: a request and the peer's FIN in one readiness event. The
/// server stopped reading after the short read and never saw the FIN:
/// the waiters stayed queued and the key went to a dead peer.
#[test]
fn half_closed_waiters_in_the_same_segment_are_removed_and_closed() {
    let server = TestServer::start(&[]);
    let mut holder = server.peer();
    holder.send(&acquire(0, 60, 1, "half-closed"));
    let token = granted(holder.recv(), 1);
    let mut waiters: Vec<TcpStream> = (0..20)
        .map(|i| send_with_fin(&server.addr, &acquire(60, 60, 100 + i, "half-closed")))
        .collect();
    for waiter in &mut waiters {
        let (bytes, took) = read_to_close(waiter);
        assert_eq!(bytes, b"", "a half-closed waiter got an answer");
        assert!(took < Duration::from_secs(5), "closed after {took:?}");
    }
    let mut observer = server.peer();
    observer.send(&query("half-closed"));
    match observer.recv() {
        Response::Query {
            token: t, waiters, ..
        } => {
            assert_eq!(t, token);
            assert_eq!(waiters, 0, "half-closed waiters still queued");
        }
        other => panic!("unexpected {other:?}"),
    }
    holder.send(&release(token, "half-closed"));
    assert_eq!(holder.recv(), Response::Released { token });
    observer.send(&query("half-closed"));
    assert_eq!(
        observer.recv(),
        Response::Query {
            token: 0,
            owner: 0,
            lease_ms: 0,
            waiters: 0
        },
        "the key went to a closed peer"
    );
    let info = server.info();
    assert_eq!(info["grants"], "1");
    assert_eq!(info["waiters"], "0");
}

/// Issue 10: `P` + FIN in one segment left the connection in CLOSE_WAIT
/// until keepalive reaped it. The pong must still arrive (a half-closed
/// peer reads), then the close.
#[test]
fn ping_then_fin_in_the_same_segment_is_answered_and_closed() {
    let server = TestServer::start(&[]);
    let mut pingers: Vec<TcpStream> = (0..20)
        .map(|nonce| send_with_fin(&server.addr, &ping(nonce)))
        .collect();
    for (nonce, pinger) in pingers.iter_mut().enumerate() {
        let (bytes, took) = read_to_close(pinger);
        let mut expected = Vec::new();
        protocol::encode_response(
            &Response::Pong {
                nonce: nonce as u64,
            },
            &mut expected,
        );
        assert_eq!(bytes, expected);
        assert!(took < Duration::from_secs(5), "closed after {took:?}");
    }
    let mut observer = Peer::connect(&server.addr);
    observer.send(&ping(7));
    assert_eq!(observer.recv(), Response::Pong { nonce: 7 });
    observer.send(b"I\n");
    let Response::Info(text) = observer.recv() else {
        panic!("expected info");
    };
    assert_eq!(
        util::parse_info(&text)["connections"],
        "1",
        "half-closed peers still open"
    );
}

/// Issue 10, then spec §7.6 (issue 36): the library called
/// `process::exit` when the state directory could not be written; then
/// the server exited 1. Now it stays up: the answer that needed the
/// failed write waits for the disk, another peer is served (`B` for what
/// needs a promise), and once a write succeeds the held answer goes out.
/// A clean stop still removes the unix socket file.
#[test]
fn a_state_directory_that_cannot_be_written_leaves_the_server_serving() {
    let dir = util::TempDir::new("unwritable-state");
    let socket = dir.join("k.sock");
    let unix = format!("unix:{}", socket.display());
    let state = dir.join("state");
    let state_arg = state.display().to_string();
    let server = TestServer::start(&["--listen", &unix, "--state-dir", &state_arg]);
    // The state file is replaced through this temporary name: a directory
    // there makes every write fail, even for root.
    let blocker = state.join("kunci.state.tmp");
    std::fs::create_dir_all(&blocker).expect("mkdir");
    let mut peer = Peer::connect(&unix);
    peer.send(&acquire(0, 30, 1, "k"));
    server.wait_log_line(|line| line.contains("cannot write the state file"));
    let mut other = Peer::connect(&unix);
    other.send(&acquire(0, 30, 2, "other"));
    assert_eq!(other.recv(), Response::Busy { owner: 2 });
    std::fs::remove_dir(&blocker).expect("rmdir");
    // Retried within a second or so: the grant that waited goes out.
    let token = match peer.recv() {
        Response::Acquired { owner: 1, token } => token,
        other => panic!("expected the grant, got {other:?}"),
    };
    other.send(&acquire(0, 30, 3, "other"));
    match other.recv() {
        Response::Acquired {
            owner: 3,
            token: later,
        } => assert!(later > token),
        other => panic!("expected a grant, got {other:?}"),
    }
    assert!(server.stop().success());
    assert!(!socket.exists(), "the unix socket file was left behind");
}

/// Every input the `endpoint_streams` fuzzer kept as a seed or a
/// regression (`fuzz/seeds/endpoint_streams/`) still passes its checks.
#[test]
fn endpoint_streams_fuzz_seeds_and_regressions_pass() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/endpoint_streams");
    let mut ran = 0;
    for entry in std::fs::read_dir(&dir).expect("the seed directory") {
        let path = entry.expect("an entry").path();
        kunci::core::script::run(&std::fs::read(&path).expect("a seed"));
        ran += 1;
    }
    assert!(ran > 0, "no seeds in {}", dir.display());
}

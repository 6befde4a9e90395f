//! End-to-end tests of `kunci serve` over real sockets: framing on the
//! wire, ordering, errors, timing, limits, shutdown, restarts.

use std::time::{Duration, Instant};

use kunci::protocol::Response;

use crate::util::{self, Peer, TestServer, acquire, granted, ping, query, release};

#[test]
fn pipelined_requests_are_answered_in_order() {
    let server = TestServer::start(&[]);
    let mut peer = server.peer();
    let mut batch = Vec::new();
    batch.extend(acquire(0, 30, 1, "pipe"));
    batch.extend(acquire(0, 30, 2, "pipe"));
    batch.extend(ping(0x0A0A_0A0A_0A0A_0A0A));
    batch.extend(query("pipe"));
    batch.extend(b"Qother\n");
    peer.send(&batch);
    let token = granted(peer.recv(), 1);
    assert_eq!(peer.recv(), Response::Timeout { owner: 2 });
    assert_eq!(
        peer.recv(),
        Response::Pong {
            nonce: 0x0A0A_0A0A_0A0A_0A0A
        }
    );
    match peer.recv() {
        Response::Query {
            token: held,
            owner,
            lease_ms,
            waiters,
        } => {
            assert_eq!((held, owner, waiters), (token, 1, 0));
            assert!((29_000..=30_000).contains(&lease_ms), "lease_ms {lease_ms}");
        }
        other => panic!("expected Q, got {other:?}"),
    }
    assert_eq!(
        peer.recv_bytes(26),
        b"Q\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\n".to_vec()
    );
}

#[test]
fn exact_reply_bytes_for_acquire_release_and_errors() {
    let server = TestServer::start(&[]);
    let mut peer = server.peer();
    // Owner bytes 0x0A in the fixed header must not end the frame.
    peer.send(b"A\x00\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0abytes\n");
    let reply = peer.recv_bytes(18);
    assert_eq!(&reply[..9], b"A\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a");
    assert_eq!(reply[17], b'\n');
    let token = u64::from_be_bytes(reply[9..17].try_into().unwrap());
    let mut frame = vec![b'R'];
    frame.extend(token.to_be_bytes());
    frame.extend(b"bytes\n");
    peer.send(&frame);
    let mut expected = vec![b'R'];
    expected.extend(token.to_be_bytes());
    expected.push(b'\n');
    assert_eq!(peer.recv_bytes(10), expected);
    // Releasing again: not held, same token echoed.
    peer.send(&frame);
    expected[0] = b'N';
    assert_eq!(peer.recv_bytes(10), expected);
    // Non-fatal: empty key (code 3), the connection goes on.
    peer.send(b"A\x00\x05\x00\x00\x00\x00\x00\x00\x00\x07\n");
    let mut x3 = b"X\x03\x00\x00\x00\x00\x00\x00\x00\x07".to_vec();
    x3.extend(b"key is empty\n");
    assert_eq!(peer.recv_bytes(x3.len()), x3);
    peer.send(&ping(9));
    assert_eq!(peer.recv(), Response::Pong { nonce: 9 });
}

#[test]
fn every_non_fatal_error_keeps_the_connection() {
    let server = TestServer::start(&[]);
    let mut peer = server.peer();
    let cases: [(&[u8], u8, u64); 5] = [
        (b"Q\n", 3, 0),
        (b"R\x00\x00\x00\x00\x00\x00\x00\x05\xff\xfe\n", 4, 5),
        (b"A\x01\x00\x00\x00\x00\x00\x00\x00\x00\x09k\n", 5, 9),
        (b"E\x00\x00\x00\x00\x00\x00\x00\x00\x04k\n", 5, 4),
        (b"P\x00\x00\x00\x00\x00\x00\x00\x03x\n", 6, 3),
    ];
    for (frame, code, id) in cases {
        peer.send(frame);
        match peer.recv() {
            Response::Error { code: c, id: i, .. } => assert_eq!((c, i), (code, id), "{frame:?}"),
            other => panic!("expected X {code} for {frame:?}, got {other:?}"),
        }
    }
    peer.send(b"Ix\n");
    assert!(matches!(
        peer.recv(),
        Response::Error { code: 6, id: 0, .. }
    ));
    peer.send(&ping(1));
    assert_eq!(peer.recv(), Response::Pong { nonce: 1 });
    assert_eq!(server.info()["errors"], "6");
}

#[test]
fn unknown_op_is_fatal_and_leaves_others_untouched() {
    let server = TestServer::start(&[]);
    let mut holder = server.peer();
    holder.send(&acquire(0, 30, 1, "kept"));
    let token = granted(holder.recv(), 1);
    let mut bad = server.peer();
    bad.send(&ping(5));
    bad.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(bad.recv(), Response::Pong { nonce: 5 });
    assert!(matches!(bad.recv(), Response::Error { code: 1, id: 0, .. }));
    bad.expect_closed();
    holder.send(&query("kept"));
    assert!(matches!(holder.recv(), Response::Query { token: t, .. } if t == token));
}

#[test]
fn frame_too_long_is_fatal_at_exactly_256_bytes() {
    let server = TestServer::start(&[]);
    let mut peer = server.peer();
    let longest = "k".repeat(255);
    peer.send(&acquire(0, 30, 3, &longest));
    granted(peer.recv(), 3);
    let mut frame = b"A\x00\x05\x00\x00\x00\x00\x00\x00\x00\x04".to_vec();
    frame.extend(vec![b'k'; 256]);
    peer.send(&frame);
    match peer.recv() {
        Response::Error { code: 2, id: 4, .. } => {}
        other => panic!("expected X 2 with the owner, got {other:?}"),
    }
    peer.expect_closed();
}

#[test]
fn frames_split_at_every_byte_are_decoded() {
    let server = TestServer::start(&[]);
    let mut peer = server.peer();
    let mut stream = Vec::new();
    stream.extend(acquire(0, 30, 11, "split\u{e9}"));
    stream.extend(ping(0x0A));
    stream.extend(b"I\n");
    for byte in &stream {
        peer.send(&[*byte]);
        std::thread::sleep(Duration::from_millis(1));
    }
    granted(peer.recv(), 11);
    assert_eq!(peer.recv(), Response::Pong { nonce: 0x0A });
    assert!(matches!(peer.recv(), Response::Info(_)));
}

#[test]
fn release_answer_precedes_the_hand_over_on_the_same_connection() {
    let server = TestServer::start(&[]);
    let mut peer = server.peer();
    peer.send(&acquire(0, 30, 1, "order"));
    let first = granted(peer.recv(), 1);
    peer.send(&acquire(10, 30, 2, "order"));
    assert!(peer.is_silent_for(Duration::from_millis(100)));
    peer.send(&release(first, "order"));
    assert_eq!(peer.recv(), Response::Released { token: first });
    let second = granted(peer.recv(), 2);
    assert!(second > first);
}

#[test]
fn waiters_are_served_first_in_first_out_across_connections() {
    let server = TestServer::start(&[]);
    let mut holder = server.peer();
    holder.send(&acquire(0, 30, 100, "fifo"));
    let mut token = granted(holder.recv(), 100);
    let mut waiters: Vec<Peer> = (0..5).map(|_| server.peer()).collect();
    for (i, waiter) in waiters.iter_mut().enumerate() {
        waiter.send(&acquire(30, 30, i as u64, "fifo"));
        // Make the arrival order unambiguous.
        waiter.send(&ping(0));
        assert_eq!(waiter.recv(), Response::Pong { nonce: 0 });
    }
    holder.send(&release(token, "fifo"));
    assert_eq!(holder.recv(), Response::Released { token });
    for (i, waiter) in waiters.iter_mut().enumerate() {
        let next = granted(waiter.recv(), i as u64);
        assert!(next > token);
        token = next;
        waiter.send(&release(token, "fifo"));
        assert_eq!(waiter.recv(), Response::Released { token });
    }
}

#[test]
fn closing_a_connection_drops_its_waiters_but_not_its_grants() {
    let server = TestServer::start(&[]);
    let mut holder = server.peer();
    holder.send(&acquire(0, 30, 1, "orphan"));
    let token = granted(holder.recv(), 1);
    {
        let mut waiter = server.peer();
        waiter.send(&acquire(30, 30, 2, "orphan"));
        waiter.send(&ping(1));
        assert_eq!(waiter.recv(), Response::Pong { nonce: 1 });
    }
    let mut observer = server.peer();
    let deadline = Instant::now() + util::PATIENCE;
    loop {
        observer.send(&query("orphan"));
        match observer.recv() {
            Response::Query { waiters: 0, .. } => break,
            Response::Query { .. } if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            other => panic!("waiter not removed: {other:?}"),
        }
    }
    drop(holder);
    std::thread::sleep(Duration::from_millis(50));
    observer.send(&query("orphan"));
    assert!(matches!(observer.recv(), Response::Query { token: t, owner: 1, .. } if t == token));
    observer.send(&release(token, "orphan"));
    assert_eq!(observer.recv(), Response::Released { token });
    observer.send(&query("orphan"));
    assert!(matches!(
        observer.recv(),
        Response::Query {
            token: 0,
            waiters: 0,
            ..
        }
    ));
    assert_eq!(server.info()["keys"], "0");
}

#[test]
fn limits_answer_busy() {
    let server = TestServer::start(&[
        "--max-keys",
        "2",
        "--max-waiters-per-key",
        "1",
        "--max-waits-per-conn",
        "2",
        "--max-waiters",
        "3",
    ]);
    let mut peer = server.peer();
    peer.send(&acquire(0, 30, 1, "a"));
    granted(peer.recv(), 1);
    peer.send(&acquire(0, 30, 2, "b"));
    granted(peer.recv(), 2);
    peer.send(&acquire(0, 30, 3, "c"));
    assert_eq!(peer.recv(), Response::Busy { owner: 3 });
    peer.send(&acquire(5, 30, 4, "a"));
    peer.send(&acquire(5, 30, 5, "a"));
    assert_eq!(peer.recv(), Response::Busy { owner: 5 });
    peer.send(&acquire(5, 30, 6, "b"));
    peer.send(&acquire(5, 30, 7, "b"));
    // Per connection: two queued waits already.
    let mut other = server.peer();
    other.send(&acquire(5, 30, 8, "b"));
    assert_eq!(other.recv(), Response::Busy { owner: 8 });
    assert_eq!(peer.recv(), Response::Busy { owner: 7 });
    let info = server.info();
    assert_eq!(
        (info["busy"].as_str(), info["waiters"].as_str()),
        ("4", "2")
    );
}

#[test]
fn connection_limit_sends_x7_and_closes() {
    let server = TestServer::start(&["--max-connections", "2", "--max-connections-per-peer", "2"]);
    let mut first = server.peer();
    let mut second = server.peer();
    first.send(&ping(1));
    second.send(&ping(2));
    assert_eq!(first.recv(), Response::Pong { nonce: 1 });
    assert_eq!(second.recv(), Response::Pong { nonce: 2 });
    let mut third = server.peer();
    third.send(&ping(3));
    assert!(matches!(
        third.recv(),
        Response::Error { code: 7, id: 0, .. }
    ));
    third.expect_closed();
    drop(first);
    std::thread::sleep(Duration::from_millis(100));
    let mut fourth = server.peer();
    fourth.send(&ping(4));
    assert_eq!(fourth.recv(), Response::Pong { nonce: 4 });
}

#[test]
fn graceful_shutdown_answers_waiters_busy_then_x8() {
    for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        graceful_shutdown_on(signal);
    }
}

fn graceful_shutdown_on(signal: i32) {
    let mut server = TestServer::start(&[]);
    let mut holder = server.peer();
    holder.send(&acquire(0, 30, 1, "down"));
    granted(holder.recv(), 1);
    let mut waiter = server.peer();
    waiter.send(&acquire(60, 30, 2, "down"));
    waiter.send(&ping(0));
    assert_eq!(waiter.recv(), Response::Pong { nonce: 0 });
    let _silent = server.peer();
    let started = Instant::now();
    server.signal(signal);
    assert_eq!(waiter.recv(), Response::Busy { owner: 2 });
    assert!(matches!(
        waiter.recv(),
        Response::Error { code: 8, id: 0, .. }
    ));
    waiter.expect_closed();
    assert!(matches!(
        holder.recv(),
        Response::Error { code: 8, id: 0, .. }
    ));
    holder.expect_closed();
    let status = server.wait_exit(Duration::from_secs(10)).expect("exit");
    assert!(status.success(), "signal {signal}: {status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn shutdown_finishes_even_when_a_peer_never_reads() {
    let mut server = TestServer::start(&[]);
    let mut hog = server.peer();
    // Fill the server's output towards this peer without ever reading.
    let batch: Vec<u8> = (0..20_000).flat_map(ping).collect();
    for _ in 0..20 {
        hog.send(&batch);
    }
    let started = Instant::now();
    server.signal(libc::SIGINT);
    let status = server.wait_exit(Duration::from_secs(10)).expect("exit");
    assert!(status.success());
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn tokens_increase_across_restarts() {
    let server = TestServer::start(&[]);
    let mut peer = server.peer();
    peer.send(&acquire(0, 30, 1, "restart"));
    let before = granted(peer.recv(), 1);
    server.stop();
    let server = TestServer::start(&[]);
    let mut peer = server.peer();
    peer.send(&acquire(0, 30, 1, "restart"));
    let after = granted(peer.recv(), 1);
    assert!(after > before, "{after} <= {before}");
}

#[test]
fn unix_socket_listener_with_private_mode() {
    use std::os::unix::fs::PermissionsExt;
    let dir = util::TempDir::new("unix");
    let path = dir.join("kunci.sock");
    let listen = format!("unix:{}", path.display());
    let server = TestServer::start(&["--listen", &listen, "--listen", "127.0.0.1:0"]);
    assert_eq!(server.addresses[0], listen);
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let mut local = Peer::connect(&listen);
    local.send(&acquire(0, 30, 1, "shared"));
    let token = granted(local.recv(), 1);
    let mut remote = server.peer();
    remote.send(&query("shared"));
    assert!(matches!(remote.recv(), Response::Query { token: t, .. } if t == token));
    server.stop();
    assert!(!path.exists(), "socket file left behind");
}

#[test]
fn a_slow_reader_does_not_stall_others_and_stays_bounded() {
    let server = TestServer::start(&[]);
    let rss_before = server.rss_kib();
    let mut hog = server.peer();
    let batch: Vec<u8> = (0..10_000).flat_map(ping).collect();
    // About 4 MB of requests whose answers are never read.
    let writer = std::thread::spawn(move || {
        for _ in 0..40 {
            hog.send(&batch);
        }
        hog
    });
    std::thread::sleep(Duration::from_millis(300));
    let mut other = server.peer();
    for nonce in 0..50 {
        let sent = Instant::now();
        other.send(&ping(nonce));
        assert_eq!(other.recv(), Response::Pong { nonce });
        assert!(
            sent.elapsed() < Duration::from_millis(500),
            "{:?}",
            sent.elapsed()
        );
    }
    let rss_growth = server.rss_kib().saturating_sub(rss_before);
    assert!(rss_growth < 8 * 1024, "server grew by {rss_growth} KiB");
    drop(writer);
}

#[test]
fn info_reports_every_counter() {
    let server = TestServer::start(&[]);
    let mut peer = server.peer();
    peer.send(&acquire(0, 30, 1, "i"));
    let token = granted(peer.recv(), 1);
    peer.send(&acquire(0, 30, 2, "i"));
    assert_eq!(peer.recv(), Response::Timeout { owner: 2 });
    peer.send(&util::extend(30, token, "i"));
    assert_eq!(peer.recv(), Response::Extended { token });
    peer.send(&release(token + 1, "i"));
    assert_eq!(peer.recv(), Response::NotHeld { token: token + 1 });
    let info = server.info();
    for name in [
        "version",
        "uptime_s",
        "connections",
        "keys",
        "held",
        "waiters",
        "grants",
        "timeouts",
        "busy",
        "expired",
        "released",
        "extended",
        "not_held",
        "errors",
        "next_token",
    ] {
        assert!(info.contains_key(name), "missing {name}");
    }
    let expected = [
        ("connections", "2"),
        ("keys", "1"),
        ("held", "1"),
        ("waiters", "0"),
        ("grants", "1"),
        ("timeouts", "1"),
        ("extended", "1"),
        ("not_held", "1"),
        ("released", "0"),
    ];
    for (name, value) in expected {
        assert_eq!(info[name], value, "{name}");
    }
    assert_eq!(info["next_token"], (token + 1).to_string());
}

#[test]
fn many_pipelined_frames_in_one_burst() {
    let server = TestServer::start(&[]);
    let count = 50_000u64;
    let mut burst = Vec::new();
    for i in 0..count {
        burst.extend(acquire(0, 30, i, &format!("burst-{}", i % 100)));
    }
    let stream = std::net::TcpStream::connect(&server.addr).unwrap();
    let mut writer = stream.try_clone().unwrap();
    let writer =
        std::thread::spawn(move || std::io::Write::write_all(&mut writer, &burst).unwrap());
    let mut peer = Peer::from_tcp(stream);
    let mut granted_count = 0;
    for i in 0..count {
        match peer.recv() {
            Response::Acquired { owner, .. } => {
                assert_eq!(owner, i);
                granted_count += 1;
            }
            Response::Timeout { owner } => assert_eq!(owner, i),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(granted_count, 100);
    writer.join().unwrap();
}

#[test]
fn limits_beyond_the_internal_bounds_are_a_usage_error_at_start_up() {
    for (flag, value) in [
        ("--max-keys", "1073741824"),
        ("--max-waiters", "1073741824"),
        ("--max-connections", "4294967295"),
    ] {
        let output = std::process::Command::new(util::kunci_bin())
            .args(["serve", "--listen", "127.0.0.1:0", flag, value])
            .output()
            .expect("run kunci serve");
        assert_eq!(output.status.code(), Some(2), "{flag} {value}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(&format!("{flag} {value} is above")),
            "{stderr}"
        );
    }
}

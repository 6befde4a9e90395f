//! Abusive peers, each bounded in time and in the server's memory, each
//! checked against a well-behaved client served meanwhile.

use std::io::Write;
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use kunci::protocol::Response;

use crate::util::{Peer, TestServer, acquire, granted, ping, query, release};

/// A well-behaved client's round trip must stay prompt.
fn assert_prompt(server: &TestServer, what: &str) -> Duration {
    let mut peer = server.peer();
    let sent = Instant::now();
    peer.send(&ping(77));
    assert_eq!(peer.recv(), Response::Pong { nonce: 77 });
    let round_trip = sent.elapsed();
    assert!(
        round_trip < Duration::from_millis(500),
        "{what}: ping took {round_trip:?}"
    );
    round_trip
}

/// CPU seconds the process has used (user + system), from /proc.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after_name.split(' ').collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

#[test]
fn a_thousand_partial_frames_are_closed_after_the_timeout() {
    let server = TestServer::start(&[]);
    let rss_before = server.rss_kib();
    let mut partial: Vec<Peer> = (0..1000).map(|_| server.peer()).collect();
    for (i, peer) in partial.iter_mut().enumerate() {
        peer.send(&acquire(0, 5, i as u64, "slowloris")[..7]);
    }
    let started = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(server.info()["connections"], "1001");
    let rss_growth = server.rss_kib().saturating_sub(rss_before);
    assert!(
        rss_growth < 2 * 1024,
        "1000 partial frames cost {rss_growth} KiB"
    );
    assert_prompt(&server, "with 1000 partial frames");
    for peer in &mut partial {
        peer.expect_closed();
    }
    let closed_after = started.elapsed();
    assert!(
        closed_after >= Duration::from_millis(9_500),
        "closed early: {closed_after:?}"
    );
    assert!(
        closed_after < Duration::from_secs(13),
        "closed late: {closed_after:?}"
    );
    assert_eq!(server.info()["connections"], "1");
}

#[test]
fn a_flood_past_max_connections_is_refused_with_x7() {
    let server = TestServer::start(&[
        "--max-connections",
        "50",
        "--max-connections-per-peer",
        "50",
    ]);
    let mut kept: Vec<Peer> = (0..49).map(|_| server.peer()).collect();
    let mut probe = server.peer();
    probe.send(&ping(1));
    assert_eq!(probe.recv(), Response::Pong { nonce: 1 });
    let mut refused = 0;
    for _ in 0..300 {
        let mut extra = server.peer();
        match extra.try_recv() {
            Some(Response::Error { code: 7, id: 0, .. }) => refused += 1,
            other => panic!("expected X 7, got {other:?}"),
        }
        extra.expect_closed();
    }
    assert_eq!(refused, 300);
    // The admitted connections are untouched.
    for (i, peer) in kept.iter_mut().enumerate() {
        peer.send(&ping(i as u64));
        assert_eq!(peer.recv(), Response::Pong { nonce: i as u64 });
    }
    drop(kept);
    std::thread::sleep(Duration::from_millis(200));
    assert_prompt(&server, "after the flood");
    assert_eq!(server.info()["errors"], "300");
}

#[test]
fn descriptor_exhaustion_neither_spins_nor_stops_accepting() {
    let server = TestServer::start_with(&[], |command| {
        // SAFETY: setrlimit is async-signal-safe; runs in the child only.
        unsafe {
            command.pre_exec(|| {
                let limit = libc::rlimit {
                    rlim_cur: 48,
                    rlim_max: 48,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    });
    let mut admitted = Vec::new();
    let mut refused = 0;
    for i in 0..80u64 {
        let mut peer = server.peer();
        peer.send(&ping(i));
        match peer.try_recv() {
            Some(Response::Pong { nonce }) if nonce == i => admitted.push(peer),
            Some(Response::Error { code: 7, .. }) | None => refused += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(admitted.len() >= 30, "only {} admitted", admitted.len());
    assert!(refused >= 30, "only {refused} refused");
    // Clients are left waiting in the backlog while descriptors are short:
    // the server must sleep, not spin.
    let waiting: Vec<TcpStream> = (0..10)
        .map(|_| TcpStream::connect(&server.addr).unwrap())
        .collect();
    let cpu_before = cpu_seconds(server.pid());
    std::thread::sleep(Duration::from_secs(1));
    let cpu_used = cpu_seconds(server.pid()) - cpu_before;
    assert!(
        cpu_used < 0.3,
        "server burnt {cpu_used:.2} s of CPU while out of descriptors"
    );
    drop(waiting);
    drop(admitted);
    std::thread::sleep(Duration::from_millis(300));
    // Descriptors are free again: new connections are served.
    for i in 0..20 {
        let mut peer = server.peer();
        peer.send(&ping(i));
        assert_eq!(peer.recv(), Response::Pong { nonce: i });
    }
}

#[test]
fn garbage_http_and_tls_get_a_clear_error_and_nothing_else_is_disturbed() {
    let server = TestServer::start(&[]);
    let mut holder = server.peer();
    holder.send(&acquire(0, 30, 1, "steady"));
    let token = granted(holder.recv(), 1);
    holder.send(&acquire(30, 30, 2, "steady"));
    let tls_client_hello: &[u8] = &[
        0x16, 0x03, 0x01, 0x00, 0xa5, 0x01, 0x00, 0x00, 0xa1, 0x03, 0x03, 0x0a, 0x0a, 0x00,
    ];
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut random_bytes = Vec::new();
    for _ in 0..4096 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        random_bytes.push(seed as u8);
    }
    // Make sure the first byte is no valid op.
    random_bytes[0] = 0xff;
    let inputs: [&[u8]; 4] = [
        b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
        tls_client_hello,
        &random_bytes,
        b"\n\n\n",
    ];
    for input in inputs {
        let mut bad = server.peer();
        bad.send(input);
        match bad.recv() {
            Response::Error {
                code: 1,
                id: 0,
                text,
            } => assert_eq!(text, "unknown op byte"),
            other => panic!("expected X 1, got {other:?}"),
        }
        bad.expect_closed();
    }
    holder.send(&query("steady"));
    assert!(matches!(
        holder.recv(),
        Response::Query { token: t, waiters: 1, .. } if t == token
    ));
    holder.send(&release(token, "steady"));
    assert_eq!(holder.recv(), Response::Released { token });
    granted(holder.recv(), 2);
}

#[test]
fn a_reset_in_the_middle_of_a_frame_or_a_wait_removes_only_that_peer() {
    let server = TestServer::start(&[]);
    let mut holder = server.peer();
    holder.send(&acquire(0, 30, 1, "reset"));
    let token = granted(holder.recv(), 1);
    for frame_cut in [true, false] {
        let mut stream = TcpStream::connect(&server.addr).unwrap();
        let frame = acquire(30, 30, 99, "reset");
        if frame_cut {
            stream.write_all(&frame[..5]).unwrap();
        } else {
            stream.write_all(&frame).unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
        // SO_LINGER 0: close sends RST.
        socket2::SockRef::from(&stream)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(stream);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    // The holder and the connection that asks.
    while server.info()["connections"] != "2" {
        assert!(Instant::now() < deadline, "reset connections linger");
        std::thread::sleep(Duration::from_millis(10));
    }
    holder.send(&query("reset"));
    assert!(matches!(holder.recv(), Response::Query { waiters: 0, .. }));
    holder.send(&release(token, "reset"));
    assert_eq!(holder.recv(), Response::Released { token });
    holder.send(&query("reset"));
    assert!(matches!(holder.recv(), Response::Query { token: 0, .. }));
    assert_prompt(&server, "after resets");
}

#[test]
fn a_pipelining_peer_that_never_reads_stays_bounded() {
    let server = TestServer::start(&[]);
    let rss_before = server.rss_kib();
    let stream = TcpStream::connect(&server.addr).unwrap();
    stream
        .set_write_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut writer = stream.try_clone().unwrap();
    // Acquires and releases of many keys: the answers are never read.
    let batch: Vec<u8> = (0..5_000u64)
        .flat_map(|i| acquire(0, 1, i, &format!("never-read-{i}")))
        .collect();
    let started = Instant::now();
    let mut sent = 0usize;
    while started.elapsed() < Duration::from_secs(2) {
        match writer.write_all(&batch) {
            Ok(()) => sent += batch.len(),
            Err(_) => break,
        }
    }
    let round_trip = assert_prompt(&server, "while a peer never reads");
    let rss_growth = server.rss_kib().saturating_sub(rss_before);
    // The server holds at most ~64 KiB of input and ~64 KiB of output for
    // the peer, plus the keys it granted before it stopped reading.
    assert!(
        rss_growth < 16 * 1024,
        "grew {rss_growth} KiB after {sent} bytes"
    );
    eprintln!(
        "never-reading peer: {sent} bytes accepted, RSS +{rss_growth} KiB, ping {round_trip:?}"
    );
    drop(stream);
}

#[test]
fn peers_outside_the_allow_list_get_x9_at_accept_and_are_counted() {
    let dir = crate::util::TempDir::new("allow");
    let unix = format!("unix:{}", dir.join("k.sock").display());
    let server = TestServer::start(&[
        "--listen",
        "127.0.0.1:0",
        "--listen",
        &unix,
        "--allow",
        "10.0.0.0/8",
    ]);
    let mut outsider = server.peer();
    // `X 9` comes at accept, before the server reads a byte (spec §6).
    assert_eq!(
        outsider.recv_bytes(27),
        b"X\x09\0\0\0\0\0\0\0\0peer not allowed\n"
    );
    outsider.send(&ping(1));
    outsider.expect_closed();
    let mut local = Peer::connect(&unix);
    local.send(b"I\n");
    match local.recv() {
        Response::Info(text) => {
            let info = crate::util::parse_info(&text);
            assert_eq!(info["refused"], "1");
            assert_eq!(info["connections"], "1");
        }
        other => panic!("expected info, got {other:?}"),
    }
    let allowed = TestServer::start(&["--allow", "127.0.0.0/8", "--allow", "::1/128"]);
    let mut insider = allowed.peer();
    insider.send(&ping(2));
    assert_eq!(insider.recv(), Response::Pong { nonce: 2 });
}

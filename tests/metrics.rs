//! The metrics endpoint: the core's finer counters and wait histogram, and
//! (with a real server) a scrape over a socket, checked by `promtool`.

use kunci::core::Stats;
use kunci::metrics::{Snapshot, render};
use kunci::protocol::{ErrorCode, Request};

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kunci::protocol::Response;

use crate::util::fake::{Fake, MS, S};
use crate::util::{TestServer, acquire, extend, granted, release, require_tool};

#[test]
fn queued_waits_are_observed_at_grant_and_timeout_only() {
    let mut fake = Fake::with_conns(4);
    let token = fake.grant(1, "a", 100, 1);
    fake.set_now(10 * MS);
    fake.enqueue(2, "a", 1, 30, 2);
    fake.enqueue(3, "a", 5, 30, 3);
    fake.set_now(13 * MS);
    fake.acquire(3, "b", 5, 30, 4); // free: granted at once, not observed
    // Owner 2 times out at its deadline, 1 s after it queued.
    fake.run_until(S + 10 * MS);
    // Owner 3 is granted 2 s after it queued.
    fake.set_now(2 * S + 10 * MS);
    fake.release(1, "a", token);
    let wait = fake.core.stats().acquire_wait;
    assert_eq!(wait.count, 2);
    assert_eq!(wait.sum_micros, 3 * S);
    let cumulative = wait.cumulative();
    // Buckets ..., 0.5 s (index 8), 1 s (9), 2.5 s (10).
    assert_eq!(cumulative[8], 0);
    assert_eq!(cumulative[9], 1);
    assert_eq!(cumulative[10], 2);
    // A waiter whose connection closes is neither granted nor timed out.
    fake.enqueue(2, "a", 5, 30, 5);
    fake.core.disconnect(2, fake.now);
    assert_eq!(fake.core.stats().acquire_wait.count, 2);
}

#[test]
fn not_held_is_split_by_request_and_errors_by_code() {
    let mut fake = Fake::with_conns(2);
    let token = fake.grant(1, "a", 100, 1);
    fake.release(1, "a", token + 1);
    fake.release(1, "b", token);
    fake.extend(1, "a", 5, token + 7);
    fake.extend(1, "a", 5, token);
    fake.core.send_error(1, ErrorCode::EmptyKey, 0);
    fake.request(1, &Request::Holders { id: 1, key: "a" });
    for cursor in [0, 1] {
        let count = 1;
        fake.request(
            1,
            &Request::List {
                id: 2,
                cursor,
                count,
                prefix: "",
            },
        );
    }
    fake.core
        .stats_mut()
        .count_error(ErrorCode::ConnectionLimit);
    fake.drain();
    let stats: Stats = *fake.core.stats();
    assert_eq!(
        (
            stats.not_held,
            stats.release_not_held,
            stats.extend_not_held
        ),
        (3, 2, 1)
    );
    assert_eq!(stats.extended, 1);
    assert_eq!(stats.errors, 2);
    assert_eq!(stats.errors_by_code[3], 1);
    assert_eq!(stats.errors_by_code[7], 1);
    assert_eq!(stats.connections_accepted, 2);

    let mut text = String::new();
    render(&Snapshot::of(&fake.core), None, &mut text);
    for line in [
        "kunci_locks_held 1",
        "kunci_grants_held 1",
        "kunci_keys 1",
        "kunci_connections 2",
        "kunci_acquires_total{result=\"acquired\"} 1",
        "kunci_releases_total{result=\"released\"} 0",
        "kunci_releases_total{result=\"not_held\"} 2",
        "kunci_renewals_total{result=\"extended\"} 1",
        "kunci_renewals_total{result=\"not_held\"} 1",
        "kunci_listings_total{request=\"holders\"} 1",
        "kunci_listings_total{request=\"keys\"} 2",
        "kunci_errors_total{code=\"3\"} 1",
        "kunci_errors_total{code=\"7\"} 1",
        "kunci_connections_accepted_total 2",
    ] {
        assert!(text.lines().any(|l| l == line), "{line:?} missing:\n{text}");
    }
}

/// `promtool check metrics` on `exposition`: `None` when promtool is not
/// installed (the test is skipped; under CI it fails: `require_tool`),
/// else its verdict (success, and what it printed).
pub fn promtool_check(exposition: &str) -> Option<(bool, String)> {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    if !require_tool("promtool", "prometheus") {
        return None;
    }
    let mut child = match Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => panic!("cannot run promtool: {e}"),
    };
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(exposition.as_bytes())
        .expect("write to promtool");
    let output = child.wait_with_output().expect("promtool");
    let said = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    Some((output.status.success(), said))
}

#[test]
fn promtool_accepts_the_exposition_of_a_busy_core() {
    let mut fake = Fake::with_conns(3);
    let token = fake.grant(1, "a", 100, 1);
    fake.enqueue(2, "a", 1, 30, 2);
    fake.run_until(2 * S);
    fake.release(1, "a", token);
    fake.release(1, "a", token);
    fake.core.send_error(1, ErrorCode::ZeroLease, 0);
    fake.drain();
    let mut text = String::new();
    render(
        &Snapshot::of(&fake.core),
        kunci::metrics::ProcessStats::read().as_ref(),
        &mut text,
    );
    match promtool_check(&text) {
        None => {} // skipped, as require_tool said
        Some((ok, said)) => {
            assert!(ok, "promtool check metrics failed:\n{said}\n{text}");
            // Lint warnings are printed even when it exits 0.
            assert_eq!(said.trim(), "", "promtool complains:\n{said}");
        }
    }
}

/// Starts a server with `--metrics 127.0.0.1:0` and returns it with the
/// metrics address its log names.
pub fn server_with_metrics(args: &[&str]) -> (TestServer, String) {
    let mut all = vec!["--metrics", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let server = TestServer::start(&all);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = server.log.lock().expect("log").iter().find_map(|line| {
            let rest = line.split("metrics at http://").nth(1)?;
            Some(rest.trim_end_matches("/metrics").to_owned())
        });
        if let Some(address) = found {
            return (server, address);
        }
        assert!(Instant::now() < deadline, "no metrics address logged");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sends `request` on a fresh connection and reads until the server
/// closes it: (head, body).
fn http(address: &str, request: &[u8]) -> (String, String) {
    let mut stream = TcpStream::connect(address).expect("connect to metrics");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    stream.write_all(request).expect("send request");
    let mut response = Vec::new();
    stream.read_to_end(&mut response).expect("read response");
    let text = String::from_utf8(response).expect("UTF-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
    (head.to_owned(), body.to_owned())
}

pub fn scrape(address: &str) -> String {
    let (head, body) = http(
        address,
        b"GET /metrics HTTP/1.1\r\nHost: kunci\r\nAccept: text/plain\r\n\r\n",
    );
    assert_eq!(
        head,
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
             Content-Length: {}\r\nConnection: close",
            body.len()
        )
    );
    body
}

pub fn assert_lines(text: &str, lines: &[&str]) {
    for line in lines {
        assert!(
            text.lines().any(|l| l == *line),
            "{line:?} missing:\n{text}"
        );
    }
}

#[test]
fn a_scrape_over_a_socket_shows_what_the_server_did() {
    let (server, metrics) =
        server_with_metrics(&["--max-connections", "2", "--max-connections-per-peer", "2"]);
    let mut holder = server.peer();
    holder.send(&acquire(0, 60, 1, "a"));
    let token_a = granted(holder.recv(), 1);
    holder.send(&acquire(0, 60, 2, "b"));
    let token_b = granted(holder.recv(), 2);
    holder.send(&release(token_a + 100, "a"));
    assert_eq!(
        holder.recv(),
        Response::NotHeld {
            token: token_a + 100
        }
    );
    holder.send(&extend(60, token_b, "b"));
    assert_eq!(holder.recv(), Response::Extended { token: token_b });
    holder.send(&acquire(0, 0, 3, "c")); // lease 0: X 5
    assert!(matches!(holder.recv(), Response::Error { code: 5, .. }));

    let mut waiter = server.peer();
    waiter.send(&acquire(1, 60, 4, "a"));
    assert_eq!(waiter.recv(), Response::Timeout { owner: 4 });
    // A third connection is one too many: X 7 at accept.
    let mut third = server.peer();
    assert!(matches!(third.recv(), Response::Error { code: 7, .. }));

    let body = scrape(&metrics);
    assert_lines(
        &body,
        &[
            "# HELP kunci_locks_held Keys held by a grant now.",
            "# TYPE kunci_locks_held gauge",
            "kunci_locks_held 2",
            "kunci_keys 2",
            "kunci_waiters 0",
            "kunci_connections 2",
            "kunci_limit{limit=\"connections\"} 2",
            "# TYPE kunci_acquires_total counter",
            "kunci_acquires_total{result=\"acquired\"} 2",
            "kunci_acquires_total{result=\"timeout\"} 1",
            "kunci_acquires_total{result=\"busy\"} 0",
            "kunci_releases_total{result=\"released\"} 0",
            "kunci_releases_total{result=\"not_held\"} 1",
            "kunci_renewals_total{result=\"extended\"} 1",
            "kunci_renewals_total{result=\"not_held\"} 0",
            "kunci_lease_expiries_total 0",
            "kunci_connections_accepted_total 2",
            "kunci_connections_refused_total{reason=\"allow\"} 0",
            "kunci_connections_refused_total{reason=\"max_connections\"} 1",
            "kunci_errors_total{code=\"5\"} 1",
            "kunci_errors_total{code=\"7\"} 1",
            "# TYPE kunci_acquire_wait_seconds histogram",
            "kunci_acquire_wait_seconds_bucket{le=\"0.5\"} 0",
            "kunci_acquire_wait_seconds_bucket{le=\"2.5\"} 1",
            "kunci_acquire_wait_seconds_bucket{le=\"+Inf\"} 1",
            "kunci_acquire_wait_seconds_count 1",
            &format!(
                "kunci_build_info{{version=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            ),
            "# TYPE process_cpu_seconds_total counter",
            "# TYPE process_resident_memory_bytes gauge",
        ],
    );
    for name in [
        "process_open_fds ",
        "process_max_fds ",
        "process_virtual_memory_bytes ",
        "process_start_time_seconds ",
    ] {
        assert!(body.lines().any(|l| l.starts_with(name)), "{name}:\n{body}");
    }
    match promtool_check(&body) {
        None => {} // skipped, as require_tool said
        Some((ok, said)) => assert!(ok && said.trim().is_empty(), "promtool:\n{said}"),
    }
    // Scraping is not a client connection and changes no counter.
    let again = scrape(&metrics);
    assert_lines(
        &again,
        &["kunci_connections 2", "kunci_connections_accepted_total 2"],
    );
    drop(third);
    drop((holder, waiter));
    server.stop();
}

#[test]
fn the_metrics_listener_answers_only_get_metrics_and_bounds_every_request() {
    let (server, metrics) = server_with_metrics(&[]);
    let (head, body) = http(&metrics, b"GET / HTTP/1.1\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 404 Not Found\r\n"), "{head}");
    assert_eq!(body, "kunci: the metrics are at /metrics\n");
    let (head, _) = http(&metrics, b"DELETE /metrics HTTP/1.1\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 405 "), "{head}");
    assert!(head.contains("\r\nAllow: GET, HEAD"), "{head}");
    let (head, _) = http(&metrics, b"A\x00\x01\x02 not http\n\n\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 400 "), "{head}");
    let mut huge = b"GET /metrics HTTP/1.1\r\nX-Pad: ".to_vec();
    huge.resize(5000, b'x');
    let (head, _) = http(&metrics, &huge);
    assert!(head.starts_with("HTTP/1.1 431 "), "{head}");

    // A scraper that never finishes its request is closed at the deadline,
    // and the lock service goes on meanwhile.
    let started = Instant::now();
    let mut stalled = TcpStream::connect(&metrics).expect("connect");
    stalled
        .set_read_timeout(Some(Duration::from_secs(15)))
        .expect("timeout");
    stalled.write_all(b"GET /metr").expect("send");
    let mut client = server.peer();
    client.send(&acquire(0, 5, 9, "k"));
    granted(client.recv(), 9);
    let mut rest = Vec::new();
    let closed = stalled.read_to_end(&mut rest);
    let waited = started.elapsed();
    assert!(closed.is_ok() || rest.is_empty(), "{closed:?}");
    assert!(rest.is_empty(), "answered a partial request: {rest:?}");
    // The deadline is 2 s after accept, which came after `started`.
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_millis(3_500),
        "closed after {waited:?}"
    );

    // At most 4 scrapes at once from one address: a fifth is closed at
    // accept.
    let open: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(&metrics).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let mut fifth = TcpStream::connect(&metrics).expect("connect");
    fifth
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let _ = fifth.write_all(b"GET /metrics HTTP/1.1\r\n\r\n");
    let mut answer = Vec::new();
    let asked = Instant::now();
    let _ = fifth.read_to_end(&mut answer);
    assert!(answer.is_empty(), "the fifth scrape was served");
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "not closed at once"
    );
    drop(open);
    server.stop();
}

/// The value of the sample line `name` in an exposition.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}

/// Issue 38, finding 2: a scrape listed `/proc/self/fd` on the event loop,
/// O(connections). Now the process figures are read at most once a second
/// (scrapes within it share one reading) and the connection count is the
/// core's own, current at every scrape.
#[test]
fn process_figures_are_read_at_most_once_a_second_connections_at_every_scrape() {
    let (server, metrics) = server_with_metrics(&[]);
    let started = Instant::now();
    let first = scrape(&metrics);
    let peers: Vec<_> = (0..20)
        .map(|nonce| {
            let mut peer = server.peer();
            peer.send(&crate::util::ping(nonce));
            assert_eq!(peer.recv(), Response::Pong { nonce });
            peer
        })
        .collect();
    let second = scrape(&metrics);
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "too slow to test the sampling"
    );
    assert_lines(&first, &["kunci_connections 0"]);
    assert_lines(&second, &["kunci_connections 20"]);
    let fds = sample(&first, "process_open_fds");
    assert!(fds >= 3.0, "{fds}");
    assert_eq!(sample(&second, "process_open_fds"), fds);
    std::thread::sleep(Duration::from_millis(1_100));
    let third = scrape(&metrics);
    assert!(
        sample(&third, "process_open_fds") >= fds + 20.0,
        "{fds} then:\n{third}"
    );
    drop(peers);
    server.stop();
}

/// Voluntary context switches of the server's event-loop thread.
fn loop_thread_switches(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/status"))
        .expect("read the server's status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|value| value.trim().parse().ok())
        .expect("voluntary_ctxt_switches")
}

#[test]
fn an_unscraped_metrics_listener_never_wakes_the_server() {
    let (server, metrics) = server_with_metrics(&[]);
    scrape(&metrics); // the scrape path has run and left nothing armed
    std::thread::sleep(Duration::from_millis(200));
    let before = loop_thread_switches(server.pid());
    std::thread::sleep(Duration::from_millis(1_500));
    assert_eq!(loop_thread_switches(server.pid()), before);
    server.stop();
}

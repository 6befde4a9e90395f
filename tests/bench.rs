//! `kunci bench` against a real server: short runs of each workload that
//! check its report and that it leaves the server as it found it. Speed
//! is measured by `docs/bench/`, never here.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::util::{TestServer, kunci_bin};

fn bench(server: &TestServer, args: &[&str]) -> Output {
    Command::new(kunci_bin())
        .arg("bench")
        .args(args)
        .args(["--server", &server.addr, "--json"])
        .stdin(Stdio::null())
        .output()
        .expect("run kunci bench")
}

/// The number after `"name":` in the report (the first occurrence).
fn field(json: &str, name: &str) -> u64 {
    let pattern = format!("\"{name}\":");
    let at = json
        .find(&pattern)
        .unwrap_or_else(|| panic!("no {name} in {json}"))
        + pattern.len();
    let digits: String = json[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("{name} is not a number in {json}"))
}

fn report(output: &Output) -> String {
    let json = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    assert!(
        json.starts_with('{') && json.ends_with('}'),
        "not one JSON object: {json:?}, stderr {}",
        String::from_utf8_lossy(&output.stderr)
    );
    json
}

fn assert_clean(server: &TestServer) {
    let info = server.info();
    for gauge in ["held", "waiters", "keys"] {
        assert_eq!(info[gauge], "0", "{gauge} left on the server: {info:?}");
    }
}

#[test]
fn pairs_counts_every_reply_and_releases_what_it_took() {
    let server = TestServer::start(&[]);
    let output = bench(
        &server,
        &[
            "pairs",
            "--connections",
            "4",
            "--pipeline",
            "8",
            "--keys",
            "1000",
            "--duration",
            "0.5",
            "--warmup",
            "0.2",
        ],
    );
    let json = report(&output);
    assert!(output.status.success(), "{json}");
    assert!(
        json.starts_with("{\"workload\":\"pairs\",\"server\":"),
        "{json}"
    );
    assert_eq!(field(&json, "errors"), 0, "{json}");
    let (a, t, r) = (field(&json, "A"), field(&json, "T"), field(&json, "R"));
    let pairs = field(&json, "pairs");
    assert!(pairs > 100, "{json}");
    // Each slot alternates acquire and release: inside the window the
    // counts differ by at most the requests in flight at its edges.
    assert!(r == pairs && a.abs_diff(r) <= 32, "{json}");
    assert_eq!(field(&json, "requests"), a + t + r, "{json}");
    assert_eq!(field(&json, "misses"), t, "{json}");
    assert!(json.contains("\"acquire\":{\"count\":"), "{json}");
    assert!(json.contains("\"release\":{\"count\":"), "{json}");
    assert_clean(&server);
}

#[test]
fn contended_hands_over_in_turn_and_reports_fairness() {
    let server = TestServer::start(&[]);
    let output = bench(
        &server,
        &[
            "contended",
            "--connections",
            "6",
            "--keys",
            "2",
            "--hold",
            "5",
            "--wait",
            "5",
            "--duration",
            "0.6",
            "--warmup",
            "0",
        ],
    );
    let json = report(&output);
    assert!(output.status.success(), "{json}");
    assert_eq!(field(&json, "errors"), 0, "{json}");
    assert_eq!(field(&json, "T"), 0, "{json}");
    assert_eq!(field(&json, "misses"), 0, "{json}");
    let grants = field(&json, "grants");
    // Two keys held 5 ms each: at most ~2 × 600 / 5 grants in 0.6 s.
    assert!((20..=260).contains(&grants), "{json}");
    assert!(field(&json, "grants_per_conn_min") >= 1, "{json}");
    // FIFO hand-over: a waiter waits for at most the other 5 connections'
    // holds on its key, so no wait is anywhere near --wait.
    let max_wait = json
        .split("\"acquire\":")
        .nth(1)
        .map(|rest| field(rest, "max"))
        .unwrap_or(u64::MAX);
    assert!(max_wait < 1_000_000, "{json}");
    assert_clean(&server);
}

#[test]
fn hold_keeps_its_keys_until_interrupted_then_releases_them() {
    let server = TestServer::start(&[]);
    let child = Command::new(kunci_bin())
        .args(["bench", "hold", "1000", "--connections", "2", "--json"])
        .args(["--server", &server.addr])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kunci bench hold");
    let started = Instant::now();
    while server.info()["held"] != "1000" {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{:?}",
            server.info()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let output = child.wait_with_output().expect("wait for kunci bench");
    let json = report(&output);
    assert!(output.status.success(), "{json}");
    assert_eq!(field(&json, "held"), 1000, "{json}");
    assert_eq!(field(&json, "A"), 1000, "{json}");
    assert_eq!(field(&json, "errors"), 0, "{json}");
    assert_clean(&server);
}

#[test]
fn waiters_queue_behind_held_keys_and_drain_at_the_end() {
    let server = TestServer::start(&[]);
    let output = bench(
        &server,
        &[
            "waiters",
            "500",
            "--connections",
            "3",
            "--keys",
            "10",
            "--duration",
            "0.5",
        ],
    );
    let json = report(&output);
    assert!(output.status.success(), "{json}");
    assert_eq!(field(&json, "queued"), 500, "{json}");
    assert_eq!(field(&json, "errors"), 0, "{json}");
    assert_clean(&server);
}

#[test]
fn idle_connections_each_answer_one_ping() {
    let server = TestServer::start(&[]);
    let output = bench(&server, &["idle", "200", "--duration", "0.3"]);
    let json = report(&output);
    assert!(output.status.success(), "{json}");
    assert_eq!(field(&json, "ready"), 200, "{json}");
    assert_eq!(field(&json, "P"), 200, "{json}");
    // The server notices the closes shortly after the bench exits; only
    // the `I` connection itself remains.
    let closed = Instant::now();
    while server.info()["connections"] != "1" {
        assert!(
            closed.elapsed() < Duration::from_secs(5),
            "{:?}",
            server.info()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `watches N` (issue 38): every event wakes all N watches, and the run
/// leaves no watch, key or grant behind; the innocent client's pings are
/// reported, also those during the events.
#[test]
fn watches_wake_all_n_each_event_and_leave_nothing_behind() {
    let server = TestServer::start(&[]);
    let output = bench(
        &server,
        &["watches", "5000", "--duration", "1", "--warmup", "0.2"],
    );
    let json = report(&output);
    assert!(output.status.success(), "{json}");
    let events = field(&json, "events");
    assert!(events >= 1, "{json}");
    assert_eq!(field(&json, "wakes"), events * 5_000, "{json}");
    for series in ["\"wake\":", "\"wake_all\":", "\"innocent_ping\":"] {
        assert!(json.contains(series), "{series} missing: {json}");
    }
    assert_clean(&server);
    assert_eq!(server.info()["watches"], "0");
}

/// `handover N` (issue 38): the releases hand all N readers their grants
/// each round, and the run leaves nothing behind.
#[test]
fn handover_grants_all_n_readers_each_round_and_leaves_nothing_behind() {
    let server = TestServer::start(&[]);
    let output = bench(
        &server,
        &["handover", "20000", "--duration", "1", "--warmup", "0.2"],
    );
    let json = report(&output);
    assert!(output.status.success(), "{json}");
    let events = field(&json, "events");
    assert!(events >= 1, "{json}");
    assert_eq!(field(&json, "grants"), events * 20_000, "{json}");
    for series in ["\"handover\":", "\"handover_all\":", "\"innocent_ping\":"] {
        assert!(json.contains(series), "{series} missing: {json}");
    }
    assert_clean(&server);
}

/// `--scrapers` (issue 38): threads scrape the metrics listener in a loop
/// beside any workload, with an innocent client pinging.
#[test]
fn scrapers_scrape_in_a_loop_beside_idle_connections() {
    let (server, metrics) = crate::metrics::server_with_metrics(&[]);
    let output = bench(
        &server,
        &[
            "idle",
            "100",
            "--scrapers",
            "2",
            "--metrics",
            &metrics,
            "--duration",
            "0.5",
        ],
    );
    let json = report(&output);
    assert!(output.status.success(), "{json}");
    assert!(field(&json, "scrapes") >= 2, "{json}");
    assert!(json.contains("\"innocent_ping\":"), "{json}");
}

#[test]
fn timers_measure_timeouts_and_expiries_never_early() {
    let server = TestServer::start(&[]);
    let output = bench(
        &server,
        &[
            "timers",
            "--connections",
            "2",
            "--duration",
            "2.2",
            "--warmup",
            "0",
        ],
    );
    let json = report(&output);
    // An early timer is counted as an error by the bench itself.
    assert!(output.status.success(), "{json}");
    assert_eq!(field(&json, "errors"), 0, "{json}");
    for series in ["timeout_late", "expiry_late"] {
        let rest = json
            .split(&format!("\"{series}\":"))
            .nth(1)
            .unwrap_or_else(|| panic!("no {series} in {json}"));
        assert!(field(rest, "count") >= 2, "{json}");
    }
    assert_clean(&server);
}

#[test]
fn errors_from_the_server_are_counted_printed_and_fail_the_run() {
    let server = TestServer::start(&["--max-connections", "2", "--max-connections-per-peer", "2"]);
    let output = bench(
        &server,
        &[
            "pairs",
            "--connections",
            "4",
            "--duration",
            "0.3",
            "--warmup",
            "0",
        ],
    );
    let json = report(&output);
    assert_eq!(output.status.code(), Some(1), "{json}");
    // Two refused connections: each an `X 7` and then a close, both seen
    // (not left to the end-of-run drain).
    assert_eq!(field(&json, "errors"), 4, "{json}");
    assert_eq!(json.matches("closed by the server").count(), 2, "{json}");
    assert_eq!(field(&json, "X"), 2, "{json}");
    assert!(json.contains("X 7 id=0"), "{json}");
}

#[test]
fn bad_options_are_usage_errors() {
    for args in [
        &["bogus"][..],
        &["--lease", "0"],
        &["--connections", "0"],
        &["hold"],
        &["hold", "10", "--keys", "5"],
        &["--key-prefix", &"x".repeat(250)],
        &["semaphore", "--limit", "0"],
        &["semaphore", "--limit", "65536"],
        &["contended", "--limit", "3"],
        &["rw", "--writers", "101"],
        &["semaphore", "--writers", "10"],
        &["contended", "--write-hold", "5"],
        &["pairs", "--exclusive-only"],
        &["watches", "10", "--connections", "3"],
        &["watches", "10", "--keys", "3"],
        &["handover", "100000", "--keys", "2"],
        &["idle", "10", "--scrapers", "2"],
    ] {
        let output = Command::new(kunci_bin())
            .arg("bench")
            .args(args)
            .args(["--server", "127.0.0.1:1"])
            .output()
            .expect("run kunci bench");
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(!output.stderr.is_empty(), "{args:?}");
    }
}

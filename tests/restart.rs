//! Restart safety with and without `--state-dir`, with real `kill -9`.

use std::time::{Duration, Instant};

use kunci::protocol::Response;

use crate::util::{TempDir, TestServer, acquire, granted, query, release};

fn state_args(dir: &TempDir) -> Vec<String> {
    vec!["--state-dir".into(), dir.0.display().to_string()]
}

fn start(args: &[String]) -> TestServer {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    TestServer::start(&args)
}

#[test]
fn after_kill_9_keys_stay_held_until_the_lease_horizon() {
    let dir = TempDir::new("kill9");
    let server = start(&state_args(&dir));
    let mut peer = server.peer();
    peer.send(&acquire(0, 2, 1, "crash"));
    let before = granted(peer.recv(), 1);
    server.kill();

    let server = start(&state_args(&dir));
    let mut peer = server.peer();
    // Any key, even one never used, counts as held by the earlier run.
    for key in ["crash", "never-used"] {
        peer.send(&acquire(0, 5, 2, key));
        assert_eq!(peer.recv(), Response::Timeout { owner: 2 }, "{key}");
        peer.send(&query(key));
        match peer.recv() {
            Response::Query {
                token: 0,
                owner: 0,
                lease_ms,
                waiters: 0,
            } => assert!(lease_ms > 2_000, "horizon too close: {lease_ms} ms"),
            other => panic!("expected an unknown holder, got {other:?}"),
        }
    }
    // A release with token 0 never matches the unknown holder.
    peer.send(&release(0, "crash"));
    assert_eq!(peer.recv(), Response::NotHeld { token: 0 });
    // A wait shorter than the horizon times out; it does not get the key.
    let sent = Instant::now();
    peer.send(&acquire(1, 5, 3, "crash"));
    assert_eq!(peer.recv(), Response::Timeout { owner: 3 });
    assert!(sent.elapsed() >= Duration::from_secs(1));
    // Tokens go on above everything the killed run could have shown.
    let info = server.info();
    let next: u64 = info["next_token"].parse().unwrap();
    assert!(next > before);
}

#[test]
fn waits_queued_during_the_grace_are_granted_at_the_horizon() {
    let dir = TempDir::new("grace");
    // A recorded horizon 1.5 s from now, as an unclean stop leaves it.
    let horizon_ms = kunci::server::state::wall_clock_ms() + 1_500;
    std::fs::write(
        dir.join("kunci.state"),
        format!("kunci-state 1 token_high_water=5 lease_horizon_ms={horizon_ms}\n"),
    )
    .unwrap();
    let server = start(&state_args(&dir));
    let mut peer = server.peer();
    peer.send(&acquire(10, 5, 1, "queued"));
    peer.send(&query("queued"));
    assert!(matches!(
        peer.recv(),
        Response::Query {
            token: 0,
            waiters: 1,
            ..
        }
    ));
    let token = granted(peer.recv(), 1);
    let granted_at_ms = kunci::server::state::wall_clock_ms();
    assert!(
        granted_at_ms >= horizon_ms,
        "granted {} ms early",
        horizon_ms - granted_at_ms
    );
    assert!(granted_at_ms < horizon_ms + 1_000, "granted late");
    assert!(token > 5);
    // After the horizon, keys are simply free.
    peer.send(&acquire(0, 5, 2, "fresh"));
    granted(peer.recv(), 2);
}

#[test]
fn a_clean_stop_without_leases_needs_no_grace() {
    let dir = TempDir::new("clean");
    let server = start(&state_args(&dir));
    let mut peer = server.peer();
    peer.send(&acquire(0, 30, 1, "tidy"));
    let token = granted(peer.recv(), 1);
    peer.send(&release(token, "tidy"));
    assert_eq!(peer.recv(), Response::Released { token });
    drop(peer);
    assert!(server.stop().success());

    let server = start(&state_args(&dir));
    let mut peer = server.peer();
    peer.send(&acquire(0, 30, 2, "tidy"));
    assert!(granted(peer.recv(), 2) > token);
}

#[test]
fn a_clean_stop_with_a_lease_outstanding_keeps_it_until_it_ends() {
    let dir = TempDir::new("clean-held");
    let server = start(&state_args(&dir));
    let mut peer = server.peer();
    let sent = Instant::now();
    peer.send(&acquire(0, 2, 1, "held"));
    granted(peer.recv(), 1);
    drop(peer);
    assert!(server.stop().success());

    let server = start(&state_args(&dir));
    let mut peer = server.peer();
    peer.send(&acquire(0, 5, 2, "held"));
    assert_eq!(peer.recv(), Response::Timeout { owner: 2 });
    peer.send(&acquire(10, 5, 3, "held"));
    granted(peer.recv(), 3);
    let held = sent.elapsed();
    assert!(held >= Duration::from_secs(2), "lease cut short: {held:?}");
    assert!(held < Duration::from_secs(4), "grace too long: {held:?}");
}

#[test]
fn the_high_water_mark_wins_over_a_clock_that_stepped_back() {
    let dir = TempDir::new("hwm");
    // A mark far above what the clock gives, as a run under a clock that
    // was ahead would have left it.
    let mark = u64::MAX / 2;
    std::fs::write(
        dir.join("kunci.state"),
        format!("kunci-state 1 token_high_water={mark} lease_horizon_ms=0\n"),
    )
    .unwrap();
    let server = start(&state_args(&dir));
    let mut peer = server.peer();
    peer.send(&acquire(0, 5, 1, "mark"));
    let token = granted(peer.recv(), 1);
    assert!(token >= mark, "{token} < {mark}");
    server.kill();
    // After a crash, the next run starts above every token the last run
    // could have shown.
    let server = start(&state_args(&dir));
    let info = server.info();
    let next: u64 = info["next_token"].parse().unwrap();
    assert!(next > token);
}

#[test]
fn two_servers_cannot_share_a_state_directory() {
    let dir = TempDir::new("shared");
    let _first = start(&state_args(&dir));
    let output = std::process::Command::new(crate::util::kunci_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
        .arg(&dir.0)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("another kunci server"), "{stderr}");
}

#[test]
fn without_a_state_dir_a_restart_frees_every_key() {
    let server = TestServer::start(&[]);
    let mut peer = server.peer();
    peer.send(&acquire(0, 60, 1, "volatile"));
    let token = granted(peer.recv(), 1);
    server.kill();
    let server = TestServer::start(&[]);
    let mut peer = server.peer();
    peer.send(&acquire(0, 60, 2, "volatile"));
    assert!(granted(peer.recv(), 2) > token);
}

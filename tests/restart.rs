//! Restart safety with and without `--state-dir`, with real `kill -9`.

use std::time::{Duration, Instant};

use kunci::protocol::Response;

use crate::util::{Peer, TempDir, TestServer, acquire, granted, query, release, require_tool};

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
    // was ahead would have left it (within spec §7.6's 2^52 of plausible).
    let clock = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64)
        << 20;
    let mark = clock + (1 << 50);
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

/// Spec §7, state by default: a server given no state flag keeps its
/// state under `$HOME/.local/state/kunci/`, one directory per first listen
/// address (0700, named in the start-up line), so a `kill -9` does not hand
/// a held key to a second client.
#[test]
fn a_default_server_keeps_a_held_key_from_a_second_client_after_kill_9() {
    use std::os::unix::fs::PermissionsExt;
    let home = TempDir::new("default-home");
    let server = TestServer::start_with_default_state(&["--listen", "127.0.0.1:0"], &home.0);
    let port = port_of(&server);
    let dir = home.0.join(format!(".local/state/kunci/127.0.0.1_{port}"));
    let started = server.wait_log_line(|line| line.contains("listening on"));
    assert!(
        started.contains(&format!("; state dir {}", dir.display())),
        "{started}"
    );
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
    assert!(dir.join("kunci.state").is_file());
    // A second default server on another port gets a directory of its own.
    let other = TestServer::start_with_default_state(&["--listen", "127.0.0.1:0"], &home.0);
    let other_dir = home
        .0
        .join(format!(".local/state/kunci/127.0.0.1_{}", port_of(&other)));
    assert!(other_dir.join("kunci.state").is_file());
    assert_ne!(other_dir, dir);
    drop(other);

    let mut holder = server.peer();
    holder.send(&acquire(0, 30, 1, "leader"));
    let token = granted(holder.recv(), 1);
    server.kill();
    let listen = format!("127.0.0.1:{port}");
    let server = TestServer::start_with_default_state(&["--listen", &listen], &home.0);
    let mut second = server.peer();
    second.send(&acquire(0, 30, 2, "leader"));
    assert_eq!(second.recv(), Response::Timeout { owner: 2 });
    // The holder keeps its key by renewing, as after any crash.
    let mut holder = server.peer();
    holder.send(&crate::util::extend(30, token, "leader"));
    assert_eq!(holder.recv(), Response::Extended { token });
}

#[test]
fn no_state_dir_warns_in_one_line_that_a_crash_frees_every_key() {
    let server = TestServer::start(&["--no-state-dir"]);
    let started = server.wait_log_line(|line| line.contains("listening on"));
    assert!(started.ends_with("; no state dir"), "{started}");
    let warning = server.wait_log_line(|line| line.contains("--no-state-dir"));
    assert!(
        warning.ends_with(
            "WARN  --no-state-dir: a crash frees every key at once (two holders for up to one \
             lease) and tokens rely on the wall clock never stepping back"
        ),
        "{warning}"
    );
    let output = std::process::Command::new(crate::util::kunci_bin())
        .args(["serve", "--no-state-dir", "--state-dir", "/tmp/x"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&output.stderr)
            .starts_with("kunci serve: --state-dir and --no-state-dir exclude each other\n")
    );
}

// ---- restarts without an outage (spec §7) ------------------------------------------

/// A server on `127.0.0.1:port` (0: any) with the state directory `dir`.
fn start_on(dir: &TempDir, port: u16) -> TestServer {
    start_under(&[], dir, port)
}

fn start_under(wrapper: &[&str], dir: &TempDir, port: u16) -> TestServer {
    let listen = format!("127.0.0.1:{port}");
    let state_dir = dir.0.display().to_string();
    let args = ["--listen", &listen, "--state-dir", &state_dir];
    TestServer::start_under(wrapper, &args, |_| {})
}

/// A server on `dir` (any port) that granted `key` for `lease_s` to owner 1
/// of a peer; the server, the peer and the grant's token.
fn start_holding(dir: &TempDir, key: &str, lease_s: u8) -> (TestServer, Peer, u64) {
    let server = start_on(dir, 0);
    let mut peer = server.peer();
    peer.send(&acquire(0, lease_s, 1, key));
    let token = granted(peer.recv(), 1);
    (server, peer, token)
}

fn port_of(server: &TestServer) -> u16 {
    server.addr.rsplit(':').next().unwrap().parse().unwrap()
}

/// `Q key` as (token, owner, lease_ms, waiters).
fn query_key(peer: &mut crate::util::Peer, key: &str) -> (u64, u64, u32, u32) {
    peer.send(&query(key));
    match peer.recv() {
        Response::Query {
            token,
            owner,
            lease_ms,
            waiters,
        } => (token, owner, lease_ms, waiters),
        other => panic!("expected Q, got {other:?}"),
    }
}

#[test]
fn a_clean_stop_restores_every_grant_with_its_token_owner_and_deadline() {
    let dir = TempDir::new("restore");
    let server = start_on(&dir, 0);
    let mut peer = server.peer();
    peer.send(&acquire(0, 6, 41, "held"));
    let held = granted(peer.recv(), 41);
    // The lease started before this instant (its answer is in).
    let granted_by = Instant::now();
    peer.send(&acquire(0, 200, 42, "long"));
    let long = granted(peer.recv(), 42);
    peer.send(&acquire(0, 30, 43, "released"));
    let released = granted(peer.recv(), 43);
    peer.send(&release(released, "released"));
    assert_eq!(peer.recv(), Response::Released { token: released });
    // A waiter gets B at the stop; waiters are not restored.
    let mut waiter = server.peer();
    waiter.send(&acquire(60, 5, 44, "held"));
    assert_eq!(query_key(&mut waiter, "held").3, 1);
    let port = port_of(&server);
    assert!(server.stop().success());
    assert_eq!(waiter.recv(), Response::Busy { owner: 44 });

    let server = start_on(&dir, port);
    let mut peer = server.peer();
    // `Q` is evaluated after this instant: at least `since` of the lease
    // has gone by then.
    let since = granted_by.elapsed().as_millis() as u32;
    let (token, owner, lease_ms, waiters) = query_key(&mut peer, "held");
    assert_eq!((token, owner, waiters), (held, 41, 0));
    // The downtime counted against the lease, never for it.
    // (`Q` rounds the time left up to the next ms.)
    assert!(
        lease_ms <= 6_000 + 1 - since.min(6_000),
        "{lease_ms} ms left after {since} ms"
    );
    assert!(
        lease_ms + since > 6_000 - 1_000,
        "{lease_ms} ms left after {since} ms"
    );
    assert_eq!(query_key(&mut peer, "long").0, long);
    // Other keys are free at once.
    for key in ["released", "never-used"] {
        peer.send(&acquire(0, 5, 45, key));
        assert!(granted(peer.recv(), 45) > long, "{key}");
    }
    peer.send(&acquire(0, 5, 46, "held"));
    assert_eq!(peer.recv(), Response::Timeout { owner: 46 });
    // E and R act on the restored grants as before.
    let renewed = Instant::now();
    peer.send(&crate::util::extend(2, held, "held"));
    assert_eq!(peer.recv(), Response::Extended { token: held });
    assert_eq!(query_key(&mut peer, "held").0, held);
    peer.send(&release(long, "long"));
    assert_eq!(peer.recv(), Response::Released { token: long });
    peer.send(&release(long, "long"));
    assert_eq!(peer.recv(), Response::NotHeld { token: long });
    // The renewed lease still ends: wait for the key.
    peer.send(&acquire(20, 5, 47, "held"));
    granted(peer.recv(), 47);
    let waited = renewed.elapsed();
    assert!(
        waited >= Duration::from_secs(2),
        "lease cut short: {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(4),
        "lease not ended: {waited:?}"
    );
}

#[test]
fn after_kill_9_a_holder_keeps_its_key_by_renewing_and_frees_it_by_releasing() {
    let dir = TempDir::new("adopt");
    let (server, mut peer, kept) = start_holding(&dir, "kept", 20);
    peer.send(&acquire(0, 20, 2, "freed"));
    let freed = granted(peer.recv(), 2);
    let port = port_of(&server);
    server.kill();

    let server = start_on(&dir, port);
    let mut peer = server.peer();
    let mut other = server.peer();
    other.send(&acquire(60, 5, 3, "freed"));
    // Renewing adopts the key: owner 0, the new lease from now.
    peer.send(&crate::util::extend(9, kept, "kept"));
    assert_eq!(peer.recv(), Response::Extended { token: kept });
    let (token, owner, lease_ms, _) = query_key(&mut peer, "kept");
    assert_eq!((token, owner), (kept, 0));
    assert!(lease_ms > 8_000 && lease_ms <= 9_000, "{lease_ms}");
    other.send(&acquire(0, 5, 4, "kept"));
    assert_eq!(other.recv(), Response::Timeout { owner: 4 });
    // Releasing frees the key and hands it to the head waiter.
    peer.send(&release(freed, "freed"));
    assert_eq!(peer.recv(), Response::Released { token: freed });
    assert!(granted(other.recv(), 3) > kept);
    // A token of this run never adopts, and an adopted key is no longer the
    // unknown grant's.
    let next: u64 = server.info()["next_token"].parse().unwrap();
    for (token, key) in [(next, "untouched"), (kept - 1, "kept"), (freed, "freed")] {
        peer.send(&crate::util::extend(9, token, key));
        assert_eq!(peer.recv(), Response::NotHeld { token }, "{key}");
    }
}

/// Spec §7.3 v5 end to end: after kill -9 another client cannot take a
/// held key with a made-up token — token 1, the holder's ±1, a token of
/// another key, one above the last grant — and the real holder still
/// adopts its key by renewing.
#[test]
fn after_kill_9_only_the_holders_own_token_adopts_its_key() {
    let dir = TempDir::new("adopt-bound");
    let (server, mut peer, held) = start_holding(&dir, "db", 20);
    peer.send(&acquire(0, 20, 2, "other"));
    let other = granted(peer.recv(), 2);
    assert!(other > held, "tokens increase");
    let port = port_of(&server);
    server.kill();

    let server = start_on(&dir, port);
    let mut thief = server.peer();
    for token in [1, held - 1, held + 1, other, other + 1, other + (1 << 16)] {
        thief.send(&crate::util::extend(9, token, "db"));
        assert_eq!(thief.recv(), Response::NotHeld { token }, "E {token}");
        thief.send(&release(token, "db"));
        assert_eq!(thief.recv(), Response::NotHeld { token }, "R {token}");
    }
    assert_eq!(
        query_key(&mut thief, "db").0,
        0,
        "still the unknown grant's"
    );
    // The holder renews as usual (another connection from the same address
    // has 12 refusals, below 16): it adopts its key.
    let mut holder = server.peer();
    holder.send(&crate::util::extend(9, held, "db"));
    assert_eq!(holder.recv(), Response::Extended { token: held });
    assert_eq!(query_key(&mut holder, "db").0, held);
    holder.send(&crate::util::extend(9, other, "other"));
    assert_eq!(holder.recv(), Response::Extended { token: other });
}

/// After kill -9 with one lease of `lease_s` outstanding: (the time left to
/// the horizon `Q` shows at the restart, the time from the grant to the
/// restart).
fn grace_after_kill_9(lease_s: u8) -> (Duration, Duration) {
    let dir = TempDir::new("grace-measure");
    let server = start_on(&dir, 0);
    let mut peer = server.peer();
    let granted_at = Instant::now();
    peer.send(&acquire(0, lease_s, 1, "leased"));
    granted(peer.recv(), 1);
    server.kill();
    let server = start_on(&dir, 0);
    let mut peer = server.peer();
    let (token, _, lease_ms, _) = query_key(&mut peer, "another-key");
    assert_eq!(token, 0);
    (Duration::from_millis(lease_ms.into()), granted_at.elapsed())
}

#[test]
fn the_grace_after_kill_9_is_at_most_the_longest_lease_plus_5_s() {
    for lease_s in [2u8, 30] {
        let (grace, since_grant) = grace_after_kill_9(lease_s);
        let lease = Duration::from_secs(lease_s.into());
        let total = grace + since_grant;
        eprintln!("lease {lease_s} s: grace {grace:?} at the restart, {total:?} after the grant");
        // Every lease is covered; the horizon is at most 5 s past it.
        assert!(
            total >= lease,
            "grace ends {total:?} after a {lease:?} grant"
        );
        assert!(
            grace <= lease + Duration::from_secs(5),
            "grace {grace:?} for a {lease:?} lease"
        );
    }
    // With a 2 s lease, a wait on any key is granted within 7 s of the
    // grant (and never before the lease could have ended).
    let dir = TempDir::new("grace-wait");
    let server = start_on(&dir, 0);
    let mut peer = server.peer();
    let granted_at = Instant::now();
    peer.send(&acquire(0, 2, 1, "leased"));
    granted(peer.recv(), 1);
    server.kill();
    let server = start_on(&dir, 0);
    let mut peer = server.peer();
    peer.send(&acquire(30, 5, 2, "leased"));
    granted(peer.recv(), 2);
    let waited = granted_at.elapsed();
    eprintln!("lease 2 s: key granted again {waited:?} after the first grant");
    assert!(waited >= Duration::from_secs(2), "{waited:?}");
    assert!(waited <= Duration::from_millis(7_500), "{waited:?}");
}

/// Issue 25 defect 10 (spec §7.2): the horizon comes down as long leases
/// end, so after releasing a 30 s lease and holding a 2 s one, kill -9
/// costs about the 2 s lease + 5 s, not the released 30 s.
#[test]
fn the_grace_after_kill_9_follows_the_leases_outstanding_not_one_released_before() {
    let dir = TempDir::new("grace-lowered");
    let (server, mut peer, long) = start_holding(&dir, "long", 30);
    peer.send(&release(long, "long"));
    assert_eq!(peer.recv(), Response::Released { token: long });
    let granted_at = Instant::now();
    peer.send(&acquire(0, 2, 2, "short"));
    granted(peer.recv(), 2);
    server.kill();
    let server = start_on(&dir, 0);
    let mut peer = server.peer();
    let (token, _, lease_ms, _) = query_key(&mut peer, "another-key");
    assert_eq!(
        token, 0,
        "no grace at all after kill -9 with a lease running"
    );
    let total = Duration::from_millis(lease_ms.into()) + granted_at.elapsed();
    // The 2 s lease is covered; the horizon is 5 s past it (rounded up to
    // 100 ms), with time for two starts.
    assert!(total >= Duration::from_secs(2), "{total:?}");
    assert!(
        total <= Duration::from_millis(2_000 + 5_100 + 1_500),
        "grace ends {total:?} after a 2 s grant: the released 30 s lease still counts"
    );
}

/// Issue 25 defect 11 (spec §10.2), the repro with the CLI: after
/// kill -9 of a run that made a counted grant, with `k`'s old token
/// adopted by a renewal, `acquire k --limit 7` gets `T` and sets nothing,
/// so `acquire k --limit 9` gets `T` too, not `X 10` "limit of 7".
#[test]
fn during_a_crash_grace_a_timeout_sets_no_limit_end_to_end() {
    let dir = TempDir::new("grace-limit");
    let server = start_on(&dir, 0);
    let port = port_of(&server);
    let kunci = |server: &TestServer, args: &[&str]| {
        std::process::Command::new(crate::util::kunci_bin())
            .args(args)
            .env("KUNCI_SERVER", &server.addr)
            .env_remove("RUST_LOG")
            .output()
            .unwrap()
    };
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).trim().to_owned();
    let acquired = kunci(&server, &["acquire", "k", "--lease", "120"]);
    assert_eq!(
        acquired.status.code(),
        Some(0),
        "{}",
        text(&acquired.stderr)
    );
    let token = text(&acquired.stdout);
    let other = kunci(&server, &["acquire", "other", "--limit", "3"]);
    assert_eq!(other.status.code(), Some(0), "{}", text(&other.stderr));
    server.kill();
    let server = start_on(&dir, port);
    let renewed = kunci(&server, &["renew", "k", &token]);
    assert_eq!(renewed.status.code(), Some(0), "{}", text(&renewed.stderr));
    for limit in ["7", "9"] {
        let attempt = kunci(&server, &["acquire", "k", "--limit", limit]);
        assert_eq!(
            attempt.status.code(),
            Some(1),
            "--limit {limit}: {}",
            text(&attempt.stderr)
        );
    }
    let who = kunci(&server, &["who", "k", "--json"]);
    assert_eq!(who.status.code(), Some(0), "{}", text(&who.stderr));
    let json = text(&who.stdout);
    assert!(json.contains("\"limit\":0"), "{json}");
}

/// `faketime` and its arguments for a clock `offset` away, or `None` (the
/// test is skipped; under CI it fails) when faketime is not installed.
fn faketime(offset: &'static str) -> Option<[&'static str; 3]> {
    if !require_tool("faketime", "faketime") {
        return None;
    }
    Some(["faketime", "-f", offset])
}

#[test]
fn a_clock_stepped_back_an_hour_does_not_lengthen_the_grace() {
    let Some(stepped_back) = faketime("-1h") else {
        return;
    };
    let dir = TempDir::new("step-back");
    let (server, _peer, before) = start_holding(&dir, "crash", 1);
    server.kill();

    let server = start_under(&stepped_back, &dir, 0);
    let mut peer = server.peer();
    let (token, _, lease_ms, _) = query_key(&mut peer, "crash");
    assert_eq!(token, 0);
    assert!(lease_ms <= 6_000, "grace {lease_ms} ms after a 1 s lease");
    // Tokens stay above the earlier run's, though the clock went back.
    let next: u64 = server.info()["next_token"].parse().unwrap();
    assert!(next > before);
    peer.send(&acquire(10, 5, 2, "crash"));
    assert!(granted(peer.recv(), 2) > before);
}

#[test]
fn a_clock_stepped_forward_an_hour_does_not_shorten_the_grace() {
    let Some(stepped_forward) = faketime("+1h") else {
        return;
    };
    let dir = TempDir::new("step-forward");
    let (server, _peer, token) = start_holding(&dir, "running", 30);
    server.kill();

    let server = start_under(&stepped_forward, &dir, 0);
    let mut peer = server.peer();
    peer.send(&acquire(0, 5, 2, "running"));
    assert_eq!(peer.recv(), Response::Timeout { owner: 2 });
    let (_, _, lease_ms, _) = query_key(&mut peer, "running");
    assert!(lease_ms >= 25_000, "grace {lease_ms} ms for a 30 s lease");
    // The holder renews as usual.
    peer.send(&crate::util::extend(30, token, "running"));
    assert_eq!(peer.recv(), Response::Extended { token });
}

/// Starts a server on `dir` that must fail; returns its stderr.
fn failed_start(dir: &std::path::Path) -> String {
    let output = std::process::Command::new(crate::util::kunci_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
        .arg(dir)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn a_damaged_state_file_stops_the_start_with_what_is_wrong() {
    let dir = TempDir::new("damaged");
    let (server, _peer, _) = start_holding(&dir, "k", 30);
    assert!(server.stop().success());
    let file = dir.join("kunci.state");
    let good = std::fs::read(&file).unwrap();
    let cases: [(&[u8], &str); 4] = [
        (&good[..good.len() - 5], "checksum"),
        (&good[..9], "truncated"),
        (b"kunci-state 9\n...", "newer kunci"),
        (b"\x00\x01garbage", "not a kunci state file"),
    ];
    for (bytes, what) in cases {
        std::fs::write(&file, bytes).unwrap();
        let stderr = failed_start(&dir.0);
        assert!(stderr.contains("cannot start: state dir"), "{stderr}");
        assert!(stderr.contains(&file.display().to_string()), "{stderr}");
        assert!(stderr.contains(what), "{what}: {stderr}");
        // And what to do about it.
        assert!(
            stderr.contains(
                "ERROR hint: the file was left as it was. Restore it from a backup, or move \
                 it aside to start without it"
            ),
            "{stderr}"
        );
        // Never a silent reset: the file is left as it was.
        assert_eq!(std::fs::read(&file).unwrap(), bytes);
    }
    // A state dir that cannot be one says so, not "cannot listen".
    let not_a_dir = dir.join("plain-file");
    std::fs::write(&not_a_dir, b"").unwrap();
    let stderr = failed_start(&not_a_dir);
    assert!(stderr.contains("state dir"), "{stderr}");
    assert!(stderr.contains(": not a directory"), "{stderr}");
    assert!(!stderr.contains("cannot listen"), "{stderr}");
}

/// Spec §7.6: a high-water mark no earlier run can have left (within 2^32
/// of `u64::MAX`, or more than 2^52 above the clock's first token) stops
/// the start with a message naming the file; one just below is accepted.
#[test]
fn an_implausible_high_water_mark_is_refused_at_start_naming_the_file() {
    use kunci::server::state::{Promise, StateDir};
    let dir = TempDir::new("implausible");
    let file = dir.join("kunci.state");
    let clock = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64)
        << 20;
    let write = |token_high_water: u64| {
        // Open refuses the file an earlier case left: start afresh.
        let _ = std::fs::remove_file(&file);
        let mut state = StateDir::open(&dir.0).unwrap();
        let promise = Promise {
            token_high_water,
            horizon: 0,
            counted_grants: false,
            macs_until: 0,
        };
        state.write_running(promise, 0).unwrap();
    };
    for high_water in [u64::MAX, u64::MAX - (1 << 32) + 1, clock + (1 << 53)] {
        write(high_water);
        let stderr = failed_start(&dir.0);
        assert!(
            stderr.contains(&format!(
                "cannot start: state dir {}: {}: implausible token high-water mark {high_water}",
                dir.0.display(),
                file.display()
            )),
            "{stderr}"
        );
    }
    // Ahead of the clock by less than 2^52: an earlier run's, accepted.
    write(clock + (1 << 40));
    let server = start(&state_args(&dir));
    let next: u64 = server.info()["next_token"].parse().unwrap();
    assert!(next >= clock + (1 << 40));
}

/// Runs `kunci run survive --lease 4` whose command writes its token, then
/// runs for 7 s. While it runs, `interrupt` stops the server and a new one
/// starts on the same port and state directory; a second client probes the
/// key all along. Returns (kunci's exit code, the command's token, every
/// token `Q` showed meanwhile).
fn kunci_run_across_a_restart(name: &str, interrupt: fn(TestServer)) -> (i32, u64, Vec<u64>) {
    let dir = TempDir::new(name);
    let server = start_on(&dir, 0);
    let port = port_of(&server);
    let token_file = dir.join("token");
    let done_file = dir.join("done");
    let script = format!(
        "echo $KUNCI_TOKEN > {token}.tmp && mv {token}.tmp {token}; sleep 7; echo done > {done}",
        token = token_file.display(),
        done = done_file.display()
    );
    let mut run = std::process::Command::new(crate::util::kunci_bin())
        .args(["run", "survive", "--lease", "4", "--", "sh", "-c", &script])
        .env("KUNCI_SERVER", &server.addr)
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let token: u64 = loop {
        if let Ok(text) = std::fs::read_to_string(&token_file) {
            break text.trim().parse().unwrap();
        }
        assert!(Instant::now() < deadline, "the command never started");
        std::thread::sleep(Duration::from_millis(10));
    };
    std::thread::sleep(Duration::from_millis(1_500));
    interrupt(server);
    let server = start_on(&dir, port);
    let mut probe = server.peer();
    let mut seen = Vec::new();
    let mut owner = 100;
    let status = loop {
        if let Some(status) = run.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline + Duration::from_secs(15),
            "kunci run did not end"
        );
        owner += 1;
        probe.send(&acquire(0, 5, owner, "survive"));
        match probe.recv() {
            Response::Timeout { .. } => {}
            other => {
                if std::fs::read(&done_file).is_err() {
                    panic!("the key was given to another client while the command ran: {other:?}");
                }
            }
        }
        let (held_by, ..) = query_key(&mut probe, "survive");
        if held_by != 0 && seen.last() != Some(&held_by) {
            seen.push(held_by);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        std::fs::read(&done_file).is_ok(),
        "the command did not finish"
    );
    // The final release found the lease: the key is free now.
    assert_eq!(query_key(&mut probe, "survive"), (0, 0, 0, 0));
    (status.code().unwrap_or(-1), token, seen)
}

#[test]
fn kunci_run_keeps_its_command_running_across_a_clean_restart() {
    let (code, token, seen) = kunci_run_across_a_restart("run-clean", |server| {
        assert!(server.stop().success());
    });
    assert_eq!(code, 0);
    assert_eq!(seen, vec![token], "Q showed other holders");
}

#[test]
fn kunci_run_keeps_its_command_running_across_kill_9_and_a_restart() {
    let (code, token, seen) = kunci_run_across_a_restart("run-kill9", TestServer::kill);
    assert_eq!(code, 0);
    assert_eq!(seen, vec![token], "Q showed other holders");
}

#[test]
fn sighup_and_sigint_save_the_grants_as_sigterm_does() {
    for signal in [libc::SIGHUP, libc::SIGINT] {
        let dir = TempDir::new("signals");
        let server = start_on(&dir, 0);
        let mut peer = server.peer();
        peer.send(&acquire(0, 60, 7, "kept"));
        let token = granted(peer.recv(), 7);
        let port = port_of(&server);
        let mut server = server;
        server.signal(signal);
        let status = server.wait_exit(Duration::from_secs(10));
        assert!(
            status.is_some_and(|s| s.success()),
            "signal {signal}: {status:?}"
        );
        let server = start_on(&dir, port);
        let mut peer = server.peer();
        let (held_by, owner, lease_ms, _) = query_key(&mut peer, "kept");
        assert_eq!((held_by, owner), (token, 7), "signal {signal}");
        assert!(lease_ms > 50_000, "signal {signal}: {lease_ms} ms left");
    }
}

/// Issue 18 defects 3 and 4 (spec §9 `--wait inf`): a planned restart of a
/// `--state-dir` server costs a queued `kunci run --wait inf` nothing — it
/// asks again and gets the key when the holder lets go — and neither it
/// nor the holder's `kunci run` says anything about the restart.
#[test]
fn a_planned_restart_is_quiet_and_wait_inf_waits_through_it() {
    let dir = TempDir::new("wait-inf-restart");
    let server = start_on(&dir, 0);
    let port = port_of(&server);
    let started_file = dir.join("started");
    let holder_script = format!(
        "echo $KUNCI_TOKEN > {started}.tmp && mv {started}.tmp {started}; sleep 3",
        started = started_file.display()
    );
    let kunci_run = |args: &[&str]| {
        std::process::Command::new(crate::util::kunci_bin())
            .arg("run")
            .args(args)
            .env("KUNCI_SERVER", &server.addr)
            .env_remove("RUST_LOG")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let holder = kunci_run(&["planned", "--lease", "4", "--", "sh", "-c", &holder_script]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let holder_token: u64 = loop {
        if let Ok(text) = std::fs::read_to_string(&started_file) {
            break text.trim().parse().unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "the holder's command never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let waiter = kunci_run(&[
        "planned",
        "--wait",
        "inf",
        "--",
        "sh",
        "-c",
        "echo $KUNCI_TOKEN",
    ]);
    // Queued behind the holder.
    let mut peer = server.peer();
    while query_key(&mut peer, "planned").3 != 1 {
        assert!(Instant::now() < deadline, "the waiter never queued");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(peer);
    assert!(server.stop().success());
    let restarted = start_on(&dir, port);
    let holder = holder.wait_with_output().unwrap();
    let waiter = waiter.wait_with_output().unwrap();
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    assert_eq!(waiter.status.code(), Some(0), "{}", text(&waiter.stderr));
    assert_eq!(text(&waiter.stderr), "");
    assert_eq!(holder.status.code(), Some(0), "{}", text(&holder.stderr));
    assert_eq!(
        text(&holder.stderr),
        "",
        "the holder warned about the restart"
    );
    let waiter_token: u64 = text(&waiter.stdout).trim().parse().unwrap();
    assert!(waiter_token > holder_token);
    let mut peer = restarted.peer();
    assert_eq!(query_key(&mut peer, "planned"), (0, 0, 0, 0));
}

/// Issue 18: the crash grace is visible — `kunci query` says the key is
/// held by the previous run's unknown grant (not `token=0 owner=0`), and a
/// timeout during the grace says why — and a clean restart logs
/// "restored 1 grant".
#[test]
fn the_crash_grace_is_named_by_query_and_timeout() {
    let dir = TempDir::new("grace-visible");
    let server = start_on(&dir, 0);
    let port = port_of(&server);
    let mut peer = server.peer();
    peer.send(&acquire(0, 30, 7, "graced"));
    granted(peer.recv(), 7);
    server.kill();
    let server = start_on(&dir, port);
    let kunci = |args: &[&str]| {
        std::process::Command::new(crate::util::kunci_bin())
            .args(args)
            .env("KUNCI_SERVER", &server.addr)
            .env_remove("RUST_LOG")
            .output()
            .unwrap()
    };
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    let query = kunci(&["query", "graced"]);
    assert_eq!(query.status.code(), Some(0));
    let line = text(&query.stdout);
    assert!(
        line.starts_with(
            "held by an unknown grant of the server's previous run (crash grace) lease_ms="
        ) && line.ends_with(" waiters=0\n"),
        "{line}"
    );
    let timeout = kunci(&["acquire", "graced"]);
    assert_eq!(timeout.status.code(), Some(1));
    let message = text(&timeout.stderr);
    assert!(
        message.starts_with("kunci acquire: timeout: key \"graced\" is held by someone else")
            && message.contains(
                ". The server restarted after a crash: it counts \"graced\" as held by an \
                 unknown grant of its previous run for "
            )
            && message.ends_with(" more, unless that holder renews or releases it\n"),
        "{message}"
    );
    assert!(server.stop().success());
    let dir = TempDir::new("restored-one");
    let server = start_on(&dir, 0);
    let port = port_of(&server);
    let mut peer = server.peer();
    peer.send(&acquire(0, 30, 8, "one"));
    granted(peer.recv(), 8);
    assert!(server.stop().success());
    let server = start_on(&dir, port);
    let log = server.log.lock().unwrap().clone();
    assert!(
        log.iter()
            .any(|line| line.contains("state: restored 1 grant of the previous run (0 expired")),
        "{log:?}"
    );
}

/// Spec §7.5: after a clean restart a grant keeps its label, and `H`
/// counts `held_ms` from the original grant, not from the restart.
#[test]
fn a_clean_restart_keeps_the_label_and_the_time_held() {
    let dir = TempDir::new("held-time");
    let server = start_on(&dir, 0);
    let mut peer = server.peer();
    let before_grant = Instant::now();
    peer.send(&permits(0, 60, 1, 0, "leader@host-a", "elected"));
    let token = granted(peer.recv(), 1);
    let after_grant = Instant::now();
    std::thread::sleep(Duration::from_millis(1_500));
    let port = port_of(&server);
    assert!(server.stop().success());
    let server = start_on(&dir, port);
    let mut peer = server.peer();
    let least = after_grant.elapsed();
    let mut holders = Vec::new();
    kunci::protocol::encode_request(
        &kunci::protocol::Request::Holders {
            id: 5,
            key: "elected",
        },
        &mut holders,
    );
    peer.send(&holders);
    let answer = peer.recv();
    let most = before_grant.elapsed();
    let Response::Grant {
        id: 5,
        token: listed,
        owner: 1,
        held_ms,
        take: 0,
        label,
        ..
    } = answer
    else {
        panic!("expected the grant, got {answer:?}");
    };
    assert_eq!((listed, label.as_str()), (token, "leader@host-a"));
    // Whole ms at the stop, the write and the restart: a few ms of
    // rounding, never more.
    let least_ms = least.as_millis() as u32;
    assert!(
        held_ms + 3 >= least_ms,
        "held {held_ms} ms, at least {least:?}"
    );
    assert!(
        u128::from(held_ms) <= most.as_millis(),
        "held {held_ms} ms, at most {most:?}"
    );
    assert_eq!(
        peer.recv(),
        Response::End {
            id: 5,
            count: 1,
            next: 0
        }
    );
}

/// Unmounts a tmpfs when dropped.
struct Mounted(std::path::PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// A fresh 256 KiB tmpfs at `dir`, or `None` (a skip, or a failure under
/// CI=true) where this process may not mount one.
fn small_tmpfs(dir: &std::path::Path) -> Option<Mounted> {
    std::fs::create_dir_all(dir).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs"])
        .arg(dir)
        .status()
        .is_ok_and(|status| status.success());
    if mounted {
        return Some(Mounted(dir.to_owned()));
    }
    let ci = std::env::var("CI").unwrap_or_default();
    if !matches!(ci.as_str(), "" | "false" | "0") {
        panic!("cannot mount a tmpfs (run as root): under CI=true this test must run");
    }
    eprintln!("SKIPPED: cannot mount a tmpfs (not root)");
    None
}

/// Spec §7.6 end to end: with the state directory's filesystem full the
/// server does not exit. The answer that needed the failed write waits
/// for the disk; other peers are served, and what needs a promise the
/// file does not hold gets `B` (`E`: `B` with its token); `I` counts the
/// failures, the log says it once; once space is back the held answer
/// goes out and long leases are granted again.
#[test]
fn a_full_disk_leaves_the_server_serving_and_answering_b_until_space_is_back() {
    let base = TempDir::new("full-disk");
    let Some(mounted) = small_tmpfs(&base.join("fs")) else {
        return;
    };
    let state = mounted.0.join("state");
    let server = start(&["--state-dir".into(), state.display().to_string()]);
    let mut holder = server.peer();
    holder.send(&acquire(0, 2, 1, "short"));
    let short = granted(holder.recv(), 1);
    // The horizon is now about 7 s ahead. Fill the filesystem.
    let filler = mounted.0.join("filler");
    {
        use std::io::Write as _;
        let mut file = std::fs::File::create(&filler).unwrap();
        let block = [0u8; 4096];
        let full = loop {
            if let Err(e) = file.write_all(&block).and_then(|()| file.sync_all()) {
                break e;
            }
        };
        assert_eq!(full.raw_os_error(), Some(libc::ENOSPC), "{full}");
    }
    // A 60 s lease needs a later horizon: the write fails, and this
    // answer waits for the disk.
    let mut first = server.peer();
    first.send(&acquire(0, 60, 2, "long"));
    let deadline = Instant::now() + Duration::from_secs(10);
    let errors = loop {
        let errors: u64 = server.info()["state_errors"].parse().unwrap();
        if errors > 0 || Instant::now() > deadline {
            break errors;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(errors >= 1, "no failed write counted");
    let mut other = server.peer();
    other.send(&acquire(0, 60, 3, "other"));
    assert_eq!(other.recv(), Response::Busy { owner: 3 });
    other.send(&acquire(0, 1, 4, "brief"));
    let brief = granted(other.recv(), 4);
    assert!(brief > short);
    other.send(&crate::util::extend(60, short, "short"));
    assert_eq!(other.recv(), Response::Busy { owner: short });
    assert_eq!(query_key(&mut other, "short").0, short);
    other.send(&release(brief, "brief"));
    assert_eq!(other.recv(), Response::Released { token: brief });
    let logged = server.wait_log_line(|line| line.contains("cannot write the state file"));
    assert!(logged.contains("No space left on device"), "{logged}");
    // Space is back: within the next retry the held answer goes out, and
    // long leases are granted again.
    std::fs::remove_file(&filler).unwrap();
    let long = granted(first.recv(), 2);
    assert!(long > short);
    other.send(&acquire(0, 60, 5, "other"));
    assert!(granted(other.recv(), 5) > long);
    server.wait_log_line(|line| line.contains("the state file is written again"));
    let errors_logged = server
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|line| line.contains("cannot write the state file"))
        .count();
    assert_eq!(errors_logged, 1);
    drop(server);
}

/// An `S` frame (spec §10): `take` 0 takes every permit.
fn permits(wait_s: u8, lease_s: u8, owner: u64, take: u16, label: &str, key: &str) -> Vec<u8> {
    let mut bytes = Vec::new();
    kunci::protocol::encode_request(
        &kunci::protocol::Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key,
            limit: 65_535,
            take,
            label,
        },
        &mut bytes,
    );
    bytes
}

/// Spec §7.4 with real processes: a clean stop keeps both readers of a
/// shared lock, with their takes, and the writer still waits for both.
#[test]
fn a_clean_stop_keeps_both_readers_of_a_shared_lock() {
    let dir = TempDir::new("permits-clean");
    let server = start_on(&dir, 0);
    let mut peer = server.peer();
    peer.send(&permits(0, 30, 1, 1, "reader one", "rw"));
    let reader_1 = granted(peer.recv(), 1);
    peer.send(&permits(0, 30, 2, 1, "", "rw"));
    let reader_2 = granted(peer.recv(), 2);
    let port = port_of(&server);
    assert!(server.stop().success());

    let server = start_on(&dir, port);
    let mut peer = server.peer();
    assert_eq!(query_key(&mut peer, "rw").0, reader_1);
    // A third reader fits beside them; the writer does not.
    peer.send(&permits(0, 30, 3, 1, "", "rw"));
    let reader_3 = granted(peer.recv(), 3);
    assert!(reader_3 > reader_2);
    peer.send(&permits(0, 30, 4, 0, "", "rw"));
    assert_eq!(peer.recv(), Response::Timeout { owner: 4 });
    for token in [reader_1, reader_2, reader_3] {
        peer.send(&release(token, "rw"));
        assert_eq!(peer.recv(), Response::Released { token });
    }
    peer.send(&permits(0, 30, 5, 0, "", "rw"));
    granted(peer.recv(), 5);
}

/// Issue 19's overlap with real processes and `kill -9`: two readers hold
/// a shared lock at the crash; one releases after the restart; a writer
/// must not get the key while the other reader's lease may still run.
/// (Under §7.3 alone the release would free the key at once.)
#[test]
fn after_kill_9_a_writer_waits_for_every_reader_lease_though_one_reader_released() {
    let dir = TempDir::new("permits-kill9");
    let server = start_on(&dir, 0);
    let mut peer = server.peer();
    peer.send(&permits(0, 2, 1, 1, "", "rw"));
    let reader_1 = granted(peer.recv(), 1);
    let reader_2_granted = Instant::now();
    peer.send(&permits(0, 4, 2, 1, "", "rw"));
    granted(peer.recv(), 2);
    let port = port_of(&server);
    server.kill();

    let server = start_on(&dir, port);
    let mut peer = server.peer();
    peer.send(&release(reader_1, "rw"));
    // Spec §7.4: `R` of an old token answers `R`, and frees nothing.
    assert_eq!(peer.recv(), Response::Released { token: reader_1 });
    let (token, _, lease_ms, _) = query_key(&mut peer, "rw");
    assert_eq!(token, 0, "held by the unknown grant");
    assert!(lease_ms > 0);
    peer.send(&permits(20, 5, 3, 0, "", "rw"));
    granted(peer.recv(), 3);
    let waited = reader_2_granted.elapsed();
    assert!(
        waited >= Duration::from_secs(4),
        "the writer overlapped the second reader's lease: granted {waited:?} after it"
    );
    assert!(
        waited < Duration::from_secs(4 + 5 + 5),
        "granted {waited:?} after the last lease: past the horizon"
    );
}

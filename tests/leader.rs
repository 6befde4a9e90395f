//! Leader election as processes (spec §13.6): `kunci elect` taking over
//! when the leader's process is killed, and `kunci leader --watch`
//! following an election across a clean restart.

use std::time::{Duration, Instant};

use crate::util::{
    TempDir, TestServer, kunci, next_line, signal, spawn_kunci, stdout_lines, stdout_text,
};

/// The term in `VALUE term=TOKEN held_for=SECONDS`.
fn term_of(line: &str, value: &str) -> u64 {
    let rest = line
        .strip_prefix(&format!("{value} term="))
        .unwrap_or_else(|| panic!("{line:?} is not led by {value:?}"));
    let (term, held) = rest.split_once(" held_for=").expect("held_for");
    assert!(held.parse::<f64>().is_ok(), "{line:?}");
    term.parse().expect("a term")
}

#[test]
fn elect_takes_over_at_the_lease_end_after_the_leader_is_killed() {
    let server = TestServer::start(&[]);
    let addr = server.addr.clone();
    let none = kunci(&addr, &["leader", "svc"]);
    assert_eq!(
        (none.status.code(), stdout_text(&none)),
        (Some(1), "none\n".into())
    );
    let json = kunci(&addr, &["leader", "svc", "--json"]);
    assert_eq!(
        (json.status.code(), stdout_text(&json)),
        (Some(1), "null\n".into())
    );
    let command = "echo \"$KUNCI_TOKEN\"; exec sleep 60";
    let mut a = spawn_kunci(
        &addr,
        &[
            "elect", "svc", "host a", "--lease", "2", "--", "sh", "-c", command,
        ],
    );
    let a_lines = stdout_lines(&mut a);
    let a_term: u64 = next_line(&a_lines, Duration::from_secs(10))
        .parse()
        .unwrap();
    let mut b = spawn_kunci(
        &addr,
        &[
            "elect", "svc", "host-b", "--lease", "2", "--", "sh", "-c", command,
        ],
    );
    let b_lines = stdout_lines(&mut b);
    let shown = kunci(&addr, &["leader", "svc"]);
    assert_eq!(shown.status.code(), Some(0));
    assert_eq!(term_of(stdout_text(&shown).trim_end(), "host a"), a_term);
    let json = kunci(&addr, &["leader", "svc", "--json"]);
    let want = format!("{{\"value\": \"host a\", \"term\": \"{a_term}\", \"held_for\": ");
    assert!(
        stdout_text(&json).starts_with(&want),
        "{}",
        stdout_text(&json)
    );
    assert!(
        b_lines.recv_timeout(Duration::from_millis(500)).is_err(),
        "the standby ran while the leader led"
    );
    // The leader's host dies: nobody releases, the lease ends (2 s, renewed
    // every 2/3 s, so at least 1.3 s were left), then the standby leads.
    signal(&a, libc::SIGKILL);
    let killed = Instant::now();
    let _ = a.wait();
    let b_term: u64 = next_line(&b_lines, Duration::from_secs(10))
        .parse()
        .unwrap();
    let took = killed.elapsed();
    assert!(
        took >= Duration::from_millis(1_300),
        "took over after {took:?}"
    );
    assert!(took < Duration::from_secs(6), "took over after {took:?}");
    assert!(b_term > a_term, "term {b_term} after {a_term}");
    let shown = kunci(&addr, &["leader", "svc"]);
    assert_eq!(term_of(stdout_text(&shown).trim_end(), "host-b"), b_term);
    // The leader stopped: it resigns.
    signal(&b, libc::SIGTERM);
    let status = b.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM));
    let none = kunci(&addr, &["leader", "svc"]);
    assert_eq!(
        (none.status.code(), stdout_text(&none)),
        (Some(1), "none\n".into())
    );
    // A value over 128 bytes or with a newline is a usage error.
    let long = "v".repeat(129);
    for value in [long.as_str(), "two\nlines", ""] {
        let refused = kunci(&addr, &["elect", "svc", value, "--", "true"]);
        assert_eq!(refused.status.code(), Some(2), "{value:?}");
    }
    server.stop();
}

#[test]
fn leader_watch_follows_an_election_across_a_clean_restart() {
    let dir = TempDir::new("leader-watch");
    let socket = format!("unix:{}", dir.join("kunci.sock").display());
    let state = dir.join("state");
    std::fs::create_dir_all(&state).unwrap();
    let state = state.to_string_lossy().into_owned();
    let args = ["--listen", socket.as_str(), "--state-dir", state.as_str()];
    let server = TestServer::start(&args);
    let mut watcher = spawn_kunci(&socket, &["leader", "svc", "--watch"]);
    let changes = stdout_lines(&mut watcher);
    assert_eq!(next_line(&changes, Duration::from_secs(10)), "none");
    let granted = kunci(
        &socket,
        &["acquire", "svc", "--lease", "60", "--label", "host-a"],
    );
    assert_eq!(granted.status.code(), Some(0));
    let token: u64 = stdout_text(&granted).trim().parse().unwrap();
    let line = next_line(&changes, Duration::from_secs(5));
    assert_eq!(term_of(&line, "host-a"), token);
    // A clean restart keeps the grant: nothing changed, nothing printed.
    server.stop();
    let server = TestServer::start(&args);
    assert!(
        changes.recv_timeout(Duration::from_secs(3)).is_err(),
        "a restart that kept the leader was reported"
    );
    let released = kunci(&socket, &["release", "svc", &token.to_string()]);
    assert_eq!(released.status.code(), Some(0));
    assert_eq!(next_line(&changes, Duration::from_secs(5)), "none");
    signal(&watcher, libc::SIGINT);
    let status = watcher.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    server.stop();
}

/// Spec §13.6 (v5): during a crash grace the key is held by an earlier
/// run's grant nobody has adopted yet: `leader()` is the unknown leader
/// (not none), `observe()` starts with it, and `kunci leader` prints
/// `unknown term=0 held_for=?` (or its JSON) and exits 0. Once the holder
/// renews (adopts) and proclaims its value again, it is the leader again.
#[test]
fn during_a_crash_grace_the_leader_is_unknown_not_none() {
    use kunci::client::{Client, Config, Leader};
    use kunci::protocol::{Request, Response};

    let dir = TempDir::new("leader-grace");
    let state = dir.0.display().to_string();
    let server = TestServer::start(&["--state-dir", &state]);
    let mut peer = server.peer();
    peer.request(&Request::Acquire {
        wait_s: 0,
        lease_s: 60,
        owner: 1,
        key: "svc",
        limit: 0,
        take: 0,
        label: "host-a",
    });
    let Response::Acquired { token, .. } = peer.recv() else {
        panic!("not granted");
    };
    server.kill();

    let server = TestServer::start(&["--state-dir", &state]);
    let addr = server.addr.clone();
    let client = Client::new([addr.parse().unwrap()], Config::default()).unwrap();
    assert_eq!(client.leader("svc"), Ok(Some(Leader::UNKNOWN)));
    let first = client.observe("svc").next().expect("a first state");
    assert_eq!(first, Ok(Some(Leader::UNKNOWN)));
    let text = kunci(&addr, &["leader", "svc"]);
    assert_eq!(
        (text.status.code(), stdout_text(&text)),
        (Some(0), "unknown term=0 held_for=?\n".into())
    );
    let json = kunci(&addr, &["leader", "svc", "--json"]);
    assert_eq!(
        (json.status.code(), stdout_text(&json)),
        (
            Some(0),
            "{\"value\": null, \"term\": \"0\", \"held_for\": null}\n".into()
        )
    );
    // The holder renews (adopting its grant) and proclaims its value.
    let mut peer = server.peer();
    peer.request(&Request::Extend {
        lease_s: 60,
        token,
        key: "svc",
    });
    assert_eq!(peer.recv(), Response::Extended { token });
    client.proclaim("svc", token, "host-a").unwrap();
    let leader = client.leader("svc").unwrap().expect("a leader");
    assert_eq!(
        (leader.value.as_deref(), leader.term),
        (Some("host-a"), token)
    );
    assert_eq!(
        client.proclaim("svc", token + 1, "thief"),
        Err(kunci::client::Error::NotHeld)
    );
}

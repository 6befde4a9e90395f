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

/// A new temp dir (kept while it lives) with a unix socket's address and a
/// state directory in it, so that a server restarted with `--listen SOCKET
/// --state-dir STATE` finds its state.
fn socket_and_state(name: &str) -> (TempDir, String, String) {
    let dir = TempDir::new(name);
    let socket = format!("unix:{}", dir.join("kunci.sock").display());
    let state = dir.join("state");
    std::fs::create_dir_all(&state).unwrap();
    let state = state.to_string_lossy().into_owned();
    (dir, socket, state)
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
    let (_dir, socket, state) = socket_and_state("leader-watch");
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

/// Spec §13.4a, §13.6 (v5): a leader changes its value and keeps its
/// term — `proclaim` on a campaign's lead (Rust) and `kunci proclaim`
/// (exit 0; 6 for a token that does not hold; 2 for an empty value) —
/// and observers (`observe`, `kunci leader --watch`) report the new value
/// with the same term. A lead already lost proclaims nothing (`NotHeld`).
#[test]
fn proclaim_changes_the_value_keeps_the_term_and_observers_report_it() {
    use kunci::client::{Client, Config, Error};

    let server = TestServer::start(&[]);
    let addr = server.addr.clone();
    let client = Client::new([addr.parse().unwrap()], Config::default()).unwrap();
    let (sender, items) = std::sync::mpsc::channel();
    let follower = client.clone();
    std::thread::spawn(move || {
        for item in follower.observe("svc") {
            let item = item.map(|l| l.map(|l| (l.value.unwrap_or_default(), l.term)));
            if sender.send(item).is_err() {
                return;
            }
        }
    });
    let next = |limit| items.recv_timeout(limit).expect("an item").unwrap();
    assert_eq!(next(Duration::from_secs(5)), None);
    let mut watcher = spawn_kunci(&addr, &["leader", "svc", "--watch"]);
    let watched = stdout_lines(&mut watcher);
    assert_eq!(next_line(&watched, Duration::from_secs(10)), "none");

    let lead = client
        .campaign("svc", "10.0.0.1:5432", Duration::from_secs(30))
        .unwrap();
    let term = lead.token();
    assert_eq!(
        next(Duration::from_secs(5)),
        Some(("10.0.0.1:5432".into(), term))
    );
    assert_eq!(
        term_of(
            &next_line(&watched, Duration::from_secs(5)),
            "10.0.0.1:5432"
        ),
        term
    );
    // A proclaim that reaches the server before an observer's next `O`
    // (one round trip after its last answer) is not seen by it (spec
    // §13.4a: the watch compares tokens): both ask again first, which the
    // server's `watches` gauge shows.
    let asking = Instant::now();
    while !client.info().unwrap().contains(" watches=2 ") {
        assert!(
            asking.elapsed() < Duration::from_secs(5),
            "the observers did not ask again"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    lead.proclaim("10.0.0.2:5432").unwrap();
    assert_eq!(
        next(Duration::from_secs(5)),
        Some(("10.0.0.2:5432".into(), term))
    );
    assert_eq!(
        term_of(
            &next_line(&watched, Duration::from_secs(5)),
            "10.0.0.2:5432"
        ),
        term
    );
    let leader = client.leader("svc").unwrap().expect("a leader");
    assert_eq!(
        (leader.value.as_deref(), leader.term),
        (Some("10.0.0.2:5432"), term)
    );

    // The command line: the same grant, by its token.
    std::thread::sleep(Duration::from_millis(300));
    let proclaimed = kunci(&addr, &["proclaim", "svc", &term.to_string(), "host c"]);
    assert_eq!(
        (proclaimed.status.code(), stdout_text(&proclaimed)),
        (Some(0), "proclaimed\n".into())
    );
    assert_eq!(next(Duration::from_secs(5)), Some(("host c".into(), term)));
    assert_eq!(
        term_of(&next_line(&watched, Duration::from_secs(5)), "host c"),
        term
    );
    // Another token does not hold the key: 6, and nothing changes.
    let refused = kunci(
        &addr,
        &["proclaim", "svc", &(term + 1).to_string(), "thief"],
    );
    assert_eq!(refused.status.code(), Some(6));
    for (value, why) in [("", "empty"), ("two\nlines", "newline")] {
        let usage = kunci(&addr, &["proclaim", "svc", &term.to_string(), value]);
        assert_eq!(usage.status.code(), Some(2), "{why}");
    }
    let usage = kunci(
        &addr,
        &["proclaim", "svc", &term.to_string(), &"v".repeat(129)],
    );
    assert_eq!(usage.status.code(), Some(2));
    let usage = kunci(&addr, &["proclaim", "svc", "twelve", "v"]);
    assert_eq!(usage.status.code(), Some(2));
    assert_eq!(
        lead.proclaim(""),
        Err(Error::InvalidArgument("value is empty"))
    );
    assert!(
        items.recv_timeout(Duration::from_millis(300)).is_err(),
        "nothing changed"
    );
    assert_eq!(
        client
            .leader("svc")
            .unwrap()
            .and_then(|l| l.value)
            .as_deref(),
        Some("host c")
    );

    // A plain ticket proclaims too, and knows its label.
    let options = kunci::client::AcquireOptions::new().label("first");
    let mut ticket = client
        .acquire_with("plain", Duration::ZERO, Duration::from_secs(30), options)
        .unwrap();
    assert_eq!(ticket.label(), "first");
    ticket.proclaim("second").unwrap();
    assert_eq!(ticket.label(), "second");
    let leader = client.leader("plain").unwrap().expect("a holder");
    assert_eq!(
        (leader.value.as_deref(), leader.term),
        (Some("second"), ticket.token())
    );
    client.release("plain", ticket.token()).unwrap();
    assert_eq!(ticket.proclaim("third"), Err(Error::NotHeld));
    assert!(!ticket.is_valid());
    assert_eq!(ticket.label(), "second");
    let _ = ticket.into_token();

    // The lead is lost (released behind its back): a proclaim says so,
    // reports the loss once, and the resign after it is quiet.
    client.release("svc", term).unwrap();
    assert_eq!(next(Duration::from_secs(5)), None);
    assert_eq!(lead.proclaim("too late"), Err(Error::NotHeld));
    assert_eq!(lead.lost(), Some(kunci::client::Loss::NotHeld));
    assert_eq!(lead.proclaim("later still"), Err(Error::NotHeld));
    assert_eq!(lead.release(), Ok(()));
    signal(&watcher, libc::SIGINT);
    assert_eq!(watcher.wait().unwrap().code(), Some(0));
    server.stop();
}

/// Spec §7.5 (v5): a server restarted after a crash adopts a held grant
/// when its holder renews, without its label; a campaign's keep-alive
/// then reads the key and proclaims its value again at once, so that the
/// leader is known by its value again — the latest proclaimed one — with
/// the same term.
#[test]
fn a_campaign_proclaims_its_value_again_after_its_grant_was_adopted() {
    use kunci::client::{Client, Config};

    let (_dir, socket, state) = socket_and_state("leader-adopt");
    let args = ["--listen", socket.as_str(), "--state-dir", state.as_str()];
    let server = TestServer::start(&args);
    let client = Client::new([socket.parse().unwrap()], Config::default()).unwrap();
    let lead = client
        .campaign("svc", "host a", Duration::from_secs(6))
        .unwrap();
    lead.proclaim("host b").unwrap();
    let term = lead.token();
    server.kill();
    let restarted = Instant::now();
    let server = TestServer::start(&args);
    // The grace: someone leads, unknown who, until the holder renews.
    let mut seen = Vec::new();
    let leader = loop {
        let leader = client.leader("svc").unwrap().expect("a leader");
        if leader
            .value
            .as_deref()
            .is_some_and(|value| !value.is_empty())
        {
            break leader;
        }
        seen.push(leader.value.clone());
        assert!(
            restarted.elapsed() < Duration::from_secs(6),
            "the value was not proclaimed again: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        (leader.value.as_deref(), leader.term),
        (Some("host b"), term)
    );
    assert!(lead.lost().is_none() && lead.is_valid());
    lead.release().unwrap();
    assert_eq!(client.leader("svc").unwrap(), None);
    server.stop();
}

/// Spec §13.6 (v5): a bounded campaign. `campaign_within` ends `Timeout`
/// when the wait runs out (not before), and leads when the key is free
/// or freed in time; `kunci elect --wait S` exits 1 as `kunci run` does
/// (`-E N` and `-q` as run's), and its messages start `kunci elect:`.
/// `kunci leader` points to `--json` on stderr for a value with spaces
/// or an empty one, and says nothing for others.
#[test]
fn a_bounded_campaign_ends_timeout_and_elect_wait_exits_1() {
    use kunci::client::{AcquireOptions, Client, Config, Error};

    let server = TestServer::start(&[]);
    let addr = server.addr.clone();
    let client = Client::new([addr.parse().unwrap()], Config::default()).unwrap();
    let lease = Duration::from_secs(30);
    let lead = client
        .campaign_within("svc", "host a", lease, Duration::ZERO)
        .unwrap();
    let started = Instant::now();
    let refused = client.campaign_within("svc", "host b", lease, Duration::from_millis(1500));
    let waited = started.elapsed();
    assert_eq!(refused.err(), Some(Error::Timeout));
    assert!(
        (Duration::from_millis(1500)..Duration::from_secs(4)).contains(&waited),
        "{waited:?}"
    );
    assert_eq!(
        client.query("svc").unwrap().waiters,
        0,
        "the place is given up"
    );
    // Freed within the wait: it leads.
    let releaser = {
        let client = client.clone();
        let term = lead.token();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            client.release("svc", term).unwrap();
        })
    };
    let next = client
        .campaign_within("svc", "host b", lease, Duration::from_secs(5))
        .unwrap();
    releaser.join().unwrap();
    assert!(next.token() > lead.token());
    assert_eq!(lead.release(), Ok(()), "resigning a lost lead is quiet");
    assert_eq!(
        client
            .campaign_within("svc", "", lease, Duration::ZERO)
            .err(),
        Some(Error::InvalidArgument("value is empty"))
    );

    // The command line: held by `next`.
    let stderr =
        |output: &std::process::Output| String::from_utf8_lossy(&output.stderr).into_owned();
    let started = Instant::now();
    let timed_out = kunci(
        &addr,
        &["elect", "svc", "host c", "--wait", "1", "--", "true"],
    );
    let waited = started.elapsed();
    assert_eq!(timed_out.status.code(), Some(1));
    assert!(
        (Duration::from_secs(1)..Duration::from_secs(5)).contains(&waited),
        "{waited:?}"
    );
    assert!(
        stderr(&timed_out).starts_with("kunci elect: timeout: "),
        "{}",
        stderr(&timed_out)
    );
    let quiet = kunci(
        &addr,
        &[
            "elect", "svc", "host c", "-w", "0", "-q", "-E", "9", "--", "true",
        ],
    );
    assert_eq!(
        (quiet.status.code(), stderr(&quiet)),
        (Some(9), String::new())
    );
    let usage = kunci(
        &addr,
        &["elect", "svc", "host c", "--lease", "x", "--", "true"],
    );
    assert_eq!(usage.status.code(), Some(2));
    assert!(
        stderr(&usage).starts_with("kunci elect: "),
        "{}",
        stderr(&usage)
    );
    // With a wait long enough it leads and runs the command.
    let releaser = {
        let client = client.clone();
        let term = next.token();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            client.release("svc", term).unwrap();
        })
    };
    let ran = kunci(
        &addr,
        &[
            "elect", "svc", "host c", "--wait", "10", "--", "sh", "-c", "echo led",
        ],
    );
    releaser.join().unwrap();
    assert_eq!(
        (ran.status.code(), stdout_text(&ran)),
        (Some(0), "led\n".into())
    );

    // `kunci leader`: a hint on stderr for values the line cannot carry.
    for (value, hinted) in [("host-a:5432", false), ("host a", true), ("", true)] {
        let options = AcquireOptions::new().label(value);
        let held = client
            .acquire_with("hint", Duration::ZERO, lease, options)
            .unwrap();
        let shown = kunci(&addr, &["leader", "hint"]);
        assert_eq!(shown.status.code(), Some(0));
        assert_eq!(
            stderr(&shown).contains("use --json"),
            hinted,
            "{value:?}: {}",
            stderr(&shown)
        );
        let json = kunci(&addr, &["leader", "hint", "--json"]);
        assert_eq!(stderr(&json), "", "{value:?}");
        held.release().unwrap();
    }
    server.stop();
}

/// An observer that followed a leader through a crash sees its grant
/// adopted with no value yet (spec §7.5) and does not report that; the
/// holder's proclaim can reach the server before the observer asks again
/// (here: in the same write as the adopting renewal), which wakes no
/// watch. The observer then looks again each second instead of holding
/// for 255 s, and reports the proclaimed value with the same term.
#[test]
fn an_observer_finds_a_value_proclaimed_right_after_an_adoption() {
    use kunci::client::{Client, Config};
    use kunci::protocol::{Request, Response};

    let (_dir, socket, state) = socket_and_state("leader-adopt-observe");
    let args = ["--listen", socket.as_str(), "--state-dir", state.as_str()];
    let server = TestServer::start(&args);
    let mut peer = crate::util::Peer::connect(&socket);
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
    let client = Client::new([socket.parse().unwrap()], Config::default()).unwrap();
    let (sender, items) = std::sync::mpsc::channel();
    let follower = client.clone();
    std::thread::spawn(move || {
        for item in follower.observe("svc") {
            let item = item.map(|l| l.map(|l| (l.value.unwrap_or_default(), l.term)));
            if sender.send(item).is_err() {
                return;
            }
        }
    });
    let next = |limit| items.recv_timeout(limit).expect("an item").unwrap();
    assert_eq!(next(Duration::from_secs(5)), Some(("host-a".into(), token)));
    server.kill();
    let server = TestServer::start(&args);
    // Let the observer find the grace (a leader kept: nothing reported).
    std::thread::sleep(Duration::from_millis(1500));
    let mut peer = crate::util::Peer::connect(&socket);
    let mut bytes = Vec::new();
    kunci::protocol::encode_request(
        &Request::Extend {
            lease_s: 60,
            token,
            key: "svc",
        },
        &mut bytes,
    );
    kunci::protocol::encode_request(
        &Request::Proclaim {
            token,
            key: "svc",
            label: "host-b",
        },
        &mut bytes,
    );
    peer.send(&bytes);
    assert_eq!(peer.recv(), Response::Extended { token });
    let started = Instant::now();
    assert_eq!(next(Duration::from_secs(5)), Some(("host-b".into(), token)));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    server.stop();
}

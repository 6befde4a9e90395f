//! Secrets and scopes on a real `kunci serve --auth` (spec §12): the file,
//! `kunci secret`, failures counted and logged without the secret, and the
//! start-up warning.

use std::process::Command;
use std::time::{Duration, Instant};

use kunci::core::access::hash_hex;
use kunci::protocol::{ErrorCode, Response};

use crate::access::{EVERYTHING, LOCKER, auth_file, authenticate};
use crate::metrics::{assert_lines, scrape, server_with_metrics};
use crate::util::{Peer, TempDir, TestServer, acquire, granted, kunci_bin, query};

/// The `--auth` file of [`auth_file`] in a fresh directory.
pub fn auth_dir(name: &str) -> (TempDir, String) {
    auth_dir_with(name, &auth_file())
}

/// The `--auth` file `text` in a fresh directory.
fn auth_dir_with(name: &str, text: &str) -> (TempDir, String) {
    let dir = TempDir::new(name);
    let path = dir.join("auth");
    std::fs::write(&path, text).unwrap();
    let path = path.to_str().unwrap().to_owned();
    (dir, path)
}

/// A peer of `server` authenticated with `secret`, which `U` names `name`.
fn session(server: &TestServer, secret: &[u8], name: &str) -> Peer {
    let mut peer = server.peer();
    peer.send(&authenticate(secret));
    assert_eq!(
        peer.recv(),
        Response::Authenticated {
            name: name.to_owned()
        }
    );
    peer
}

fn waits_for_log(server: &TestServer, wanted: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(line) = server.log.lock().unwrap().iter().find(|l| wanted(l)) {
            return line.clone();
        }
        assert!(
            Instant::now() < deadline,
            "{:?}",
            server.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn failures_are_counted_and_logged_with_the_peer_but_never_the_secret() {
    let (_dir, path) = auth_dir("auth-failures");
    let (server, metrics) = server_with_metrics(&["--auth", &path]);
    let wrong = b"wrong-secret-that-is-long-enough-to-hash";
    let mut peer = server.peer();
    let mut burst = authenticate(wrong);
    burst.extend(acquire(0, 30, 1, "app/a"));
    peer.send(&burst);
    assert_eq!(peer.recv(), ErrorCode::NotAuthenticated.response(0));
    peer.expect_closed();
    let mut early = server.peer();
    early.send(&query("app/a"));
    assert_eq!(early.recv(), ErrorCode::NotAuthenticated.response(0));
    early.expect_closed();

    let line = waits_for_log(&server, |l| l.contains("authentication failed"));
    assert!(
        line.contains("WARN") && line.contains("peer 127.0.0.1"),
        "{line}"
    );
    let mut root = session(&server, EVERYTHING, "root");
    // Nothing behind the failed U ran.
    root.send(&query("app/a"));
    assert_eq!(
        root.recv(),
        Response::Query {
            token: 0,
            owner: 0,
            lease_ms: 0,
            waiters: 0
        }
    );
    root.send(b"I\n");
    let Response::Info(text) = root.recv() else {
        panic!()
    };
    let info = crate::util::parse_info(&text);
    assert_eq!(info["auth_failures"], "2");
    assert_eq!(info["grants"], "0");
    let body = scrape(&metrics);
    assert_lines(
        &body,
        &[
            "# TYPE kunci_auth_failures_total counter",
            "kunci_auth_failures_total 2",
            "kunci_errors_total{code=\"12\"} 2",
        ],
    );
    if let Some((ok, said)) = crate::metrics::promtool_check(&body) {
        assert!(ok && said.trim().is_empty(), "promtool:\n{said}");
    }
    let log = server.log.lock().unwrap().join("\n");
    for secret in [&wrong[..], EVERYTHING, LOCKER] {
        let secret = std::str::from_utf8(secret).unwrap();
        assert!(!log.contains(secret), "secret in the log:\n{log}");
        assert!(!body.contains(secret), "secret in the metrics:\n{body}");
    }
}

#[test]
fn a_bad_auth_file_stops_the_start_with_its_line_number() {
    let dir = TempDir::new("auth-bad-line");
    let path = dir.join("auth");
    let good = auth_file();
    let lines = good.lines().count();
    std::fs::write(&path, format!("{good}broken {} lock:a*\n", "ab".repeat(32))).unwrap();
    let started = Instant::now();
    let output = Command::new(kunci_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--no-state-dir",
            "--auth",
        ])
        .arg(&path)
        .output()
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("line {}: scope \"lock:a*\"", lines + 1)),
        "{stderr}"
    );
    let missing = Command::new(kunci_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--no-state-dir",
            "--auth",
        ])
        .arg(dir.join("none"))
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1));
}

#[test]
fn a_secret_from_kunci_secret_is_accepted() {
    let output = Command::new(kunci_bin())
        .args(["secret", "ci", "lock:ci/", "info"])
        .output()
        .unwrap();
    assert!(output.status.success());
    let stdout = String::from_utf8(output.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    let secret = lines[0];
    assert_eq!(secret.len(), 64);
    assert!(secret.bytes().all(|b| b.is_ascii_hexdigit()));
    assert!(lines[1].starts_with("ci ") && lines[1].ends_with(" lock:ci/ info"));
    assert!(!lines[1].contains(secret));
    let (_dir, path) = auth_dir_with("auth-kunci-secret", &format!("{}\n", lines[1]));
    let server = TestServer::start(&["--auth", &path]);
    let mut peer = session(&server, secret.as_bytes(), "ci");
    peer.send(&acquire(0, 30, 1, "ci/x"));
    granted(peer.recv(), 1);
    peer.send(&acquire(0, 30, 2, "prod/x"));
    assert_eq!(peer.recv(), ErrorCode::NotPermitted.response(2));

    // Two secrets are never the same; a bad scope is a usage error.
    let again = Command::new(kunci_bin())
        .args(["secret", "ci", "info"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&again.stdout).contains(secret));
    let quota = Command::new(kunci_bin())
        .args(["secret", "ci", "info", "max-keys=5"])
        .output()
        .unwrap();
    assert!(quota.status.success());
    let quota = String::from_utf8(quota.stdout).unwrap();
    assert!(quota.ends_with(" info max-keys=5\n"), "{quota}");
    for bad in [
        &["secret", "ci"][..],
        &["secret", "ci", "lock:"],
        &["secret"],
        &["secret", "a b", "info"],
        &["secret", "ci", "info", "max-keys=x"],
    ] {
        let output = Command::new(kunci_bin()).args(bad).output().unwrap();
        assert_eq!(output.status.code(), Some(2), "{bad:?}");
        assert!(output.stdout.is_empty());
    }
}

#[test]
fn a_listener_open_to_anyone_is_warned_about_at_start() {
    let warning = "nothing checks who connects";
    let open = TestServer::start(&["--listen", "0.0.0.0:0", "--listen", "127.0.0.1:0"]);
    let line = waits_for_log(&open, |l| l.contains(warning));
    assert!(line.contains("WARN") && line.contains("0.0.0.0:"), "{line}");
    let (_dir, path) = auth_dir("auth-no-warning");
    for args in [
        &["--listen", "127.0.0.1:0"][..],
        &["--listen", "0.0.0.0:0", "--auth", &path],
        &["--listen", "0.0.0.0:0", "--allow", "127.0.0.0/8"],
    ] {
        let server = TestServer::start(args);
        // The warning would come right after the start-up line.
        let mut peer = server.peer();
        peer.send(&crate::util::ping(1));
        let _ = peer.try_recv();
        std::thread::sleep(Duration::from_millis(50));
        let log = server.log.lock().unwrap().join("\n");
        assert!(!log.contains(warning), "{args:?}:\n{log}");
    }
}

#[test]
fn a_key_quota_busies_its_identity_while_another_still_acquires() {
    let text = format!(
        "locker {} lock:app/ max-keys=1\nroot {} lock:* info\n",
        hash_hex(LOCKER),
        hash_hex(EVERYTHING)
    );
    let (_dir, path) = auth_dir_with("auth-key-quota", &text);
    let server = TestServer::start(&["--auth", &path]);
    let mut locker = session(&server, LOCKER, "locker");
    let mut root = session(&server, EVERYTHING, "root");
    locker.send(&acquire(0, 30, 1, "app/a"));
    granted(locker.recv(), 1);
    locker.send(&acquire(5, 30, 2, "app/b"));
    assert_eq!(locker.recv(), Response::Busy { owner: 2 });
    root.send(&acquire(0, 30, 3, "app/b"));
    granted(root.recv(), 3);
}

#[test]
fn a_grant_quota_file_starts_and_busies_the_third_grant_or_wait() {
    let text = format!(
        "locker {} lock:app/ max-keys=10 max-grants=2\nroot {} lock:* info\n",
        hash_hex(LOCKER),
        hash_hex(EVERYTHING)
    );
    let (_dir, path) = auth_dir_with("auth-grant-quota", &text);
    let server = TestServer::start(&["--auth", &path]);
    let mut locker = session(&server, LOCKER, "locker");
    let mut root = session(&server, EVERYTHING, "root");
    root.send(&acquire(0, 30, 1, "app/held"));
    granted(root.recv(), 1);
    locker.send(&acquire(0, 30, 2, "app/a"));
    granted(locker.recv(), 2);
    // A queued waiter is the second; the third is `B` at once.
    locker.send(&acquire(30, 30, 3, "app/held"));
    locker.send(&acquire(30, 30, 4, "app/b"));
    assert_eq!(locker.recv(), Response::Busy { owner: 4 });
    root.send(&acquire(0, 30, 5, "app/b"));
    granted(root.recv(), 5);
}

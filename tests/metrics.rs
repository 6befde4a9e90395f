//! The metrics endpoint: the core's finer counters and wait histogram, and
//! (with a real server) a scrape over a socket, checked by `promtool`.

use kunci::core::Stats;
use kunci::metrics::{Snapshot, render};
use kunci::protocol::ErrorCode;

use crate::util::fake::{Fake, MS, S};

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
    fake.core.disconnect(2);
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
        "kunci_keys 1",
        "kunci_connections 2",
        "kunci_acquires_total{result=\"acquired\"} 1",
        "kunci_releases_total{result=\"released\"} 0",
        "kunci_releases_total{result=\"not_held\"} 2",
        "kunci_renewals_total{result=\"extended\"} 1",
        "kunci_renewals_total{result=\"not_held\"} 1",
        "kunci_errors_total{code=\"3\"} 1",
        "kunci_errors_total{code=\"7\"} 1",
        "kunci_connections_accepted_total 2",
    ] {
        assert!(text.lines().any(|l| l == line), "{line:?} missing:\n{text}");
    }
}

/// `promtool check metrics` on `exposition`: `None` when promtool is not
/// installed, else its verdict (success, and what it printed).
pub fn promtool_check(exposition: &str) -> Option<(bool, String)> {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let mut child = match Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
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
        None => eprintln!("skipped: promtool is not installed (Debian package prometheus)"),
        Some((ok, said)) => {
            assert!(ok, "promtool check metrics failed:\n{said}\n{text}");
            // Lint warnings are printed even when it exits 0.
            assert_eq!(said.trim(), "", "promtool complains:\n{said}");
        }
    }
}

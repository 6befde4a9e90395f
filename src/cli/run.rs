//! `kunci run KEY -- CMD [ARGS]…`: run a command while holding a lock.
//!
//! The lock is acquired first; the command runs in its own process group
//! with `KUNCI_KEY` and `KUNCI_TOKEN` set; the lease is renewed every
//! lease/3 by a helper thread; SIGINT, SIGTERM and SIGHUP are forwarded to
//! the group. When the command ends the lock is released and `kunci` exits
//! with the command's status. If the lock is lost — a renewal answered `N`,
//! or the ticket's `valid_until` passed without a successful renewal — the
//! group gets SIGTERM, then SIGKILL after `--kill-after`, and `kunci` exits
//! 6: the command must not go on believing it holds the lock. If `kunci`
//! itself dies, the command gets SIGTERM (the lease is no longer renewed).

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::client::{self as common, Accepts, Parsed};
use super::exit;
use crate::client::{Client, Error, Ticket};

const HELP: &str = "\
kunci run — run a command while holding a lock

Usage: kunci run KEY [--wait S] [--lease S] [--kill-after S] [--server ADDR]... -- CMD [ARGS]...

Acquires KEY, runs CMD in its own process group with KUNCI_KEY and
KUNCI_TOKEN (the fencing token) set, renews the lease every lease/3, and
forwards SIGINT, SIGTERM and SIGHUP to CMD's group. When CMD ends the lock
is released and kunci exits with CMD's status (128+N if it died of signal
N, 127 if it could not be started). If the lock is lost (a renewal finds it
gone, or the lease runs out unrenewed), CMD's group gets SIGTERM, then
SIGKILL after --kill-after, and kunci exits 6. An acquire that fails exits
as `kunci acquire` does (1 timeout, 3 busy, 4 unavailable, 5 indeterminate).

Options:
  --wait S        how long to wait for the key, in seconds, decimals allowed,
                  at most 255 (default 0: one immediate attempt)
  --lease S       the lease, whole seconds 1..=255 (default 30)
  --kill-after S  how long after SIGTERM a lost lock's command gets SIGKILL
                  (default 5)
";

/// Exit status when the command cannot be started (as a shell does).
const NOT_STARTED: u8 = 127;

/// The process group the forwarded signals go to, once the command runs.
static CHILD_GROUP: AtomicI32 = AtomicI32::new(0);
/// A forwarded signal that arrived before the command was started.
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);

const FORWARDED: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

enum Event {
    Exited(std::io::Result<ExitStatus>),
    Renewed(Instant),
    RenewFailed(Error),
}

pub fn main(arguments: Vec<OsString>) -> u8 {
    let accepts = Accepts {
        wait: true,
        lease: true,
        kill_after: true,
        positionals: &["KEY"],
        command: true,
    };
    let options = match common::parse(arguments, accepts) {
        Ok(Parsed::Run(options)) => options,
        Ok(Parsed::Help) => {
            println!("{}", common::with_server_help(HELP));
            return exit::DONE;
        }
        Err(message) => {
            eprintln!("kunci run: {message}\n(see kunci run --help)");
            return exit::USAGE;
        }
    };
    common::init_logging();
    let client = match common::client(options.servers.clone()) {
        Ok(client) => client,
        Err(message) => {
            eprintln!("kunci run: {message}");
            return exit::UNAVAILABLE;
        }
    };
    let key = &options.positionals[0];
    let ticket = match client.acquire(key, options.wait, options.lease) {
        Ok(ticket) => ticket,
        Err(error) => return common::fail("run", error, &options.servers),
    };
    if let Err(error) = forward_signals() {
        eprintln!("kunci run: cannot handle signals: {error}");
        release(ticket);
        return exit::USAGE;
    }
    let mut command = Command::new(&options.command[0]);
    command
        .args(&options.command[1..])
        .env("KUNCI_KEY", key)
        .env("KUNCI_TOKEN", ticket.token().to_string())
        .process_group(0);
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: between fork and exec the closure only makes
    // async-signal-safe calls (prctl, getppid, kill).
    unsafe {
        command.pre_exec(move || {
            // If kunci dies, nobody renews the lease: stop the command too.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            if libc::getppid() != parent {
                libc::kill(libc::getpid(), libc::SIGTERM);
            }
            Ok(())
        });
    }
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(error) => {
            eprintln!("kunci run: cannot start {:?}: {error}", options.command[0]);
            release(ticket);
            return NOT_STARTED;
        }
    };
    let group = child.id() as i32;
    CHILD_GROUP.store(group, Ordering::SeqCst);
    let pending = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
    if pending != 0 {
        signal_group(group, pending);
    }

    let (events, inbox) = mpsc::channel();
    let exited = events.clone();
    std::thread::spawn(move || {
        let _ = exited.send(Event::Exited(child.wait()));
    });
    let (stop_renewing, stopped) = mpsc::channel::<()>();
    spawn_renewer(&client, &ticket, options.lease, events, stopped);

    let mut valid_until = ticket.valid_until();
    let lost = loop {
        let now = Instant::now();
        if now >= valid_until {
            break "the lease ran out without a successful renewal";
        }
        match inbox.recv_timeout(valid_until - now) {
            Ok(Event::Exited(status)) => {
                drop(stop_renewing);
                return finish(ticket, status);
            }
            Ok(Event::Renewed(until)) => valid_until = valid_until.max(until),
            Ok(Event::RenewFailed(Error::NotHeld)) => break "a renewal found it no longer held",
            Ok(Event::RenewFailed(error)) => log::warn!("renewal failed: {error}"),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                break "the command can no longer be watched";
            }
        }
    };
    drop(stop_renewing);
    eprintln!("kunci run: lock lost: {lost}; stopping the command");
    signal_group(group, libc::SIGTERM);
    let grace_end = Instant::now() + options.kill_after;
    loop {
        let left = grace_end.saturating_duration_since(Instant::now());
        match inbox.recv_timeout(left) {
            Ok(Event::Exited(_)) => break,
            Ok(_) => {}
            Err(mpsc::RecvTimeoutError::Timeout) => {
                eprintln!("kunci run: the command did not stop; killing it");
                signal_group(group, libc::SIGKILL);
                while let Ok(event) = inbox.recv() {
                    if matches!(event, Event::Exited(_)) {
                        break;
                    }
                }
                break;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    // The grant is gone or unknowable: keep the ticket from releasing in
    // the background as the process exits; the lease reclaims it if needed.
    let _ = ticket.into_token();
    exit::NOT_HELD
}

/// Renews every lease/3 (counted from the start of the previous renewal)
/// until `stopped` says so, reporting each result.
fn spawn_renewer(
    client: &Client,
    ticket: &Ticket,
    lease: Duration,
    events: mpsc::Sender<Event>,
    stopped: mpsc::Receiver<()>,
) {
    let client = client.clone();
    let key = ticket.key().to_owned();
    let token = ticket.token();
    let period = lease / 3;
    std::thread::spawn(move || {
        let mut next = Instant::now() + period;
        loop {
            let wait = next.saturating_duration_since(Instant::now());
            if !matches!(
                stopped.recv_timeout(wait),
                Err(mpsc::RecvTimeoutError::Timeout)
            ) {
                return;
            }
            let started = Instant::now();
            let event = match client.renew(&key, token, lease) {
                Ok(until) => Event::Renewed(until),
                Err(error) => Event::RenewFailed(error),
            };
            let not_held = matches!(event, Event::RenewFailed(Error::NotHeld));
            if events.send(event).is_err() || not_held {
                return;
            }
            next = started + period;
        }
    });
}

/// The command ended: release the lock and exit with its status.
fn finish(ticket: Ticket, status: std::io::Result<ExitStatus>) -> u8 {
    release(ticket);
    match status {
        Ok(status) => exit_status(status),
        Err(error) => {
            eprintln!("kunci run: cannot wait for the command: {error}");
            NOT_STARTED
        }
    }
}

fn release(ticket: Ticket) {
    match ticket.release() {
        Ok(()) => {}
        Err(Error::NotHeld) => {
            eprintln!("kunci run: warning: the lease had already run out when the command ended")
        }
        Err(error) => eprintln!("kunci run: warning: release failed: {error}"),
    }
}

/// The command's status as an exit code: its own, or 128+N for signal N.
fn exit_status(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => 128u8.wrapping_add(signal as u8),
        (None, None) => 1,
    }
}

/// Installs handlers that pass SIGINT, SIGTERM and SIGHUP on to the
/// command's process group (or keep one for when it starts).
fn forward_signals() -> std::io::Result<()> {
    for signal in FORWARDED {
        // SAFETY: the handler only does async-signal-safe work: atomic
        // loads and stores, and kill(2).
        unsafe {
            signal_hook::low_level::register(signal, move || {
                let group = CHILD_GROUP.load(Ordering::SeqCst);
                if group > 0 {
                    libc::kill(-group, signal);
                } else {
                    PENDING_SIGNAL.store(signal, Ordering::SeqCst);
                }
            })?;
        }
    }
    Ok(())
}

fn signal_group(group: i32, signal: i32) {
    // SAFETY: kill(2) on the process group of our own child.
    unsafe {
        libc::kill(-group, signal);
    }
}

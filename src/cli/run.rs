//! `kunci run KEY -- CMD [ARGS]…`: run a command while holding a lock.
//!
//! The lock is acquired first, then kept alive by the client's I/O thread
//! ([`Ticket::keep_alive_fresh_with`](crate::client::Ticket::keep_alive_fresh_with),
//! which first renews a grant that arrived late), which reports a loss on
//! this command's event channel. CMD runs in its own process group with
//! `KUNCI_KEY` and `KUNCI_TOKEN` set; SIGINT, SIGTERM and SIGHUP are
//! forwarded to the group. When CMD ends, whatever it left running in its
//! group is stopped, the lock is released, and `kunci` exits with CMD's
//! status. If the lock is lost the group gets SIGTERM, then SIGKILL after
//! `--kill-after` or [`KILL_LEAD`] before the last confirmed `valid_until`,
//! whichever comes first, and `kunci` exits 6: the command must not go on
//! believing it holds the lock. While renewals go unanswered the SIGTERM
//! comes before the lock can be lost: `min(--kill-after, lease / 4)` before
//! `valid_until` if no renewal has moved it by then (spec §9), so that the
//! command can stop while the lock still holds.
//!
//! Two things make that hold in a terminal and when `kunci` is killed:
//!
//! - When stdin is a terminal and `kunci` is in its foreground process
//!   group, CMD's group becomes the foreground group while CMD runs (the
//!   child claims it itself, before `exec`, so that it never reads the
//!   terminal from the background), and `kunci`'s group gets it back after.
//!   When CMD is stopped by the terminal (^Z, or a read from the
//!   background), `kunci` takes the terminal back and stops its own group,
//!   so that the shell sees the job stopped; when continued in the
//!   foreground, it gives CMD the terminal and continues it.
//! - A watchdog, forked before anything else while `kunci` has one thread,
//!   reads a pipe whose write end only `kunci` (and CMD until its `exec`)
//!   holds. CMD's child writes its process group id and the lock's
//!   `valid_until` into the pipe before `exec`, so the watchdog knows both
//!   before CMD runs; `kunci` then writes each later `valid_until` a
//!   renewal confirms. When `kunci` dies, even by SIGKILL, the pipe reaches
//!   end-of-file and the watchdog sends SIGTERM to the group, then SIGKILL
//!   after `--kill-after` or [`KILL_LEAD`] before `valid_until`, whichever
//!   comes first; if that moment comes with no later `valid_until`
//!   written, it does both at once: nothing CMD started outlives the lock. `kunci` disarms it when it has
//!   stopped the group itself.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::os::fd::{AsFd, AsRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::process::{Pid, Signal};

use super::client::{self as common, Accepts, Parsed};
use super::exit;
use crate::client::{Error, KeptLease, Loss};
use crate::mailbox;

const HELP: &str = "\
kunci run — run a command while holding a lock

Usage: kunci run KEY [-w|--wait S|inf] [-n] [--lease S] [--kill-after S]
                 [-E N] [-q] [--limit N [--take K] | --shared | --exclusive]
                 [--label TEXT | --label-args] [--server ADDR]... -- CMD [ARGS]...

KEY comes before `--`; everything after `--` is the command.

Acquires KEY, runs CMD in its own process group with KUNCI_KEY and
KUNCI_TOKEN (the fencing token) set and KUNCI_SECRET removed, renews the lease every lease/3, and
forwards SIGINT, SIGTERM and SIGHUP to CMD's group. In a terminal, CMD's
group is the foreground group while it runs, so CMD can read the terminal.
When CMD ends, whatever it left running in its group is stopped, the lock
is released and kunci exits with CMD's status (128+N if it died of signal
N, 126 if it cannot be executed, 127 if it is not found). If the lock is
lost (a renewal finds it gone, or the lease runs out unrenewed), CMD's
group gets SIGTERM, then SIGKILL after --kill-after or when the lease
runs out, whichever comes first, and kunci exits 6. While renewals go
unanswered, the SIGTERM comes min(--kill-after, lease/4) before the lease
runs out, so that CMD can stop while the lock still holds; a renewal
answered after it does not undo it. If kunci itself dies,
even by SIGKILL, a watchdog does the same to CMD's group: nothing CMD
started outlives the lock. An acquire that fails exits as `kunci acquire`
does (1 timeout, 3 busy, 4 unavailable, 5 indeterminate).

Options:
  -w, --wait S    how long to wait for the key, in seconds, at most 255
                  (default 0: one immediate attempt, as flock -n; unlike
                  flock, kunci does not wait unless told); decimals are
                  sent rounded up to whole seconds, so 0.5 may wait 1 s;
                  `inf` waits until acquired, queueing again for 255 s
                  each time a wait runs out (the place in the queue is not
                  kept), and through a server restart or outage
  -n              do not wait (--wait 0, the default), as flock -n
  --lease S       the lease, whole seconds 1..=255 (default 30)
  --label-args    label the grant with CMD's arguments too (they may hold
                  secrets, and `kunci who` shows labels to every reader)
  --kill-after S  how long after SIGTERM CMD's group gets SIGKILL
                  (default 5)
  -E, --conflict-exit-code N
                  the exit status when the key stayed held (default 1)
  -q, --quiet     no message when the key stayed held
";

/// Exit status when the command is not found (as a shell does).
const NOT_FOUND: u8 = 127;
/// Exit status when the command exists but cannot be executed.
const NOT_EXECUTABLE: u8 = 126;

/// How often a group that is being stopped is checked for survivors.
const POLL: Duration = Duration::from_millis(10);

/// How long before `valid_until` the command's group gets its SIGKILL when
/// the lease runs out unrenewed: room for a busy machine to schedule the
/// signal before the server, whose lease ends at least the drift margin
/// after `valid_until`, can grant the key to someone else.
const KILL_LEAD: Duration = Duration::from_millis(100);

/// The latest moment the command may run under a lease valid until
/// `valid_until`.
fn kill_deadline(valid_until: Instant) -> Instant {
    valid_until.checked_sub(KILL_LEAD).unwrap_or(valid_until)
}

/// How long before `valid_until` the command gets its SIGTERM while
/// renewals go unanswered (spec §9): `min(--kill-after, lease / 4)`, so
/// that it can stop while the lock still holds.
fn term_lead(kill_after: Duration, lease: Duration) -> Duration {
    kill_after.min(lease / 4)
}

/// The latest moment the command gets its SIGTERM under a lease valid
/// until `valid_until` that no renewal has moved: `lead` before it, and
/// never after [`kill_deadline`].
fn term_deadline(valid_until: Instant, lead: Duration) -> Instant {
    valid_until
        .checked_sub(lead)
        .unwrap_or(valid_until)
        .min(kill_deadline(valid_until))
}

/// The process group the forwarded signals go to, once the command runs.
static CHILD_GROUP: AtomicI32 = AtomicI32::new(0);
/// A forwarded signal that arrived before the command was started.
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);

const FORWARDED: [Signal; 3] = [Signal::INT, Signal::TERM, Signal::HUP];

/// Why the command is stopped before it ends on its own.
enum Stop {
    Lost(Loss),
    /// No renewal moved `valid_until` by its SIGTERM deadline
    /// ([`term_deadline`]); the lease runs out this much later.
    Expiring(Duration),
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stop::Lost(loss) => write!(f, "{loss}"),
            Stop::Expiring(left) => write!(
                f,
                "no renewal was answered and the lease runs out in {} ms",
                left.as_millis()
            ),
        }
    }
}

enum Event {
    Exited(ExitStatus),
    /// The command was stopped (^Z in its terminal).
    Stopped,
    Lost(Loss),
}

pub fn main(arguments: Vec<OsString>) -> u8 {
    run(arguments, false)
}

/// The command's name in its messages: `run`, or `elect` (spec §13.6:
/// `kunci elect`'s messages start `kunci elect:`).
static COMMAND: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

fn command_name() -> &'static str {
    COMMAND.get().copied().unwrap_or("run")
}

/// `kunci elect`: `kunci run` whose acquire is a campaign's (on etcd its
/// entry stores its grant time, which `kunci leader` shows as held_for).
pub fn campaign(arguments: Vec<OsString>) -> u8 {
    run(arguments, true)
}

fn run(arguments: Vec<OsString>, campaign: bool) -> u8 {
    let _ = COMMAND.set(if campaign { "elect" } else { "run" });
    let name = command_name();
    let accepts = Accepts {
        wait: true,
        lease: true,
        kill_after: true,
        conflict: true,
        permits: true,
        json: false,
        positionals: &["KEY"],
        optional: 0,
        command: true,
    };
    let mut options = match common::parse(arguments, accepts) {
        Ok(Parsed::Run(options)) => options,
        Ok(Parsed::Help) => {
            println!("{}", common::with_server_help(HELP));
            return exit::DONE;
        }
        Err(message) => {
            eprintln!("kunci {name}: {message}\n(see kunci {name} --help)");
            return exit::USAGE;
        }
    };
    if campaign {
        options.acquire = options.acquire.for_campaign();
    }
    common::init_logging();
    // First, while this process has one thread and no sockets.
    let watchdog = match Watchdog::start(options.kill_after) {
        Ok(watchdog) => watchdog,
        Err(error) => {
            eprintln!("kunci {name}: cannot start the watchdog process: {error}");
            return exit::USAGE;
        }
    };
    // Orphans of CMD's group become our children, so that they can be
    // reaped and a stopped group is seen empty. (Any pid sets it; the
    // kernel reads the argument as a flag.)
    let _ = rustix::process::set_child_subreaper(Some(Pid::INIT));
    let client = match common::client(
        options.servers.clone(),
        options.secret.clone(),
        &options.tls,
    ) {
        Ok(client) => client,
        Err(message) => {
            eprintln!("kunci {name}: {message}");
            return exit::UNAVAILABLE;
        }
    };
    let key = &options.positionals[0];
    let attempt = common::Attempt {
        key: Some(key),
        wait: Some(options.wait),
        token: None,
        permits: options.acquire.get_permits().key_limit().is_some(),
        connect_failure: None,
    };
    let deadline = common::call_deadline(&options);
    let ticket = match common::acquire(&client, key, &options) {
        Ok(ticket) => ticket,
        Err(Error::Timeout) => {
            if !options.quiet {
                let why = common::message(name, &Error::Timeout, &options.servers, &attempt);
                let grace = common::grace_note(&client, key, deadline);
                eprintln!("kunci {name}: timeout: {why}{grace}");
            }
            return options.conflict_exit_code;
        }
        Err(error) => {
            let failure = client.last_connect_failure();
            let attempt = common::Attempt {
                connect_failure: failure.as_deref(),
                ..attempt
            };
            return common::report(name, error, &options.servers, &attempt);
        }
    };
    let token = ticket.token();
    let (events, inbox) = mailbox::channel();
    let lost = events.clone();
    // A grant that arrived after a wait is renewed first (spec §8 rule 10):
    // CMD never starts under a lease that is already spent.
    let kept = match ticket.keep_alive_fresh_with(move |loss| {
        let _ = lost.send(Event::Lost(loss));
    }) {
        Ok(kept) => kept,
        Err(Error::NotHeld) => {
            eprintln!(
                "kunci {name}: lock lost: {key:?} was granted after the wait, but its lease \
                 ran out before it could be renewed; the command was not started"
            );
            watchdog.disarm();
            return exit::NOT_HELD;
        }
        Err(error) => {
            watchdog.disarm();
            return common::report(name, error, &options.servers, &attempt);
        }
    };
    if let Err(error) = forward_signals() {
        eprintln!("kunci {name}: cannot handle signals: {error}");
        release(kept);
        watchdog.disarm();
        return exit::USAGE;
    }
    let mut terminal = Terminal::claim();
    let mut command = Command::new(&options.command[0]);
    command
        .args(&options.command[1..])
        // The secret is kunci's, not CMD's: a command that needs one is
        // given its own (spec §12.5). The environment is given whole
        // without it rather than with `env_remove`, whose map removal
        // costs the binary 4 KB (docs/BENCHMARKS.md, "Binary size").
        .env_clear()
        .envs(std::env::vars_os().filter(|(name, _)| name != common::SECRET_ENV))
        .env("KUNCI_KEY", key)
        .env("KUNCI_TOKEN", token.to_string())
        .process_group(0);
    let watchdog_fd = watchdog.fd();
    let take_terminal = terminal.is_some();
    let mut confirmed = kept.valid_until();
    let lead = term_lead(options.kill_after, kept.lease());
    let first_deadline = watchdog.ns(kill_deadline(confirmed));
    // SAFETY: between fork and exec the closure only makes
    // async-signal-safe calls, all system calls (getpid, write, tcsetpgrp,
    // signal), and allocates nothing; `watchdog_fd` is the pipe's write
    // end, open until `watchdog` is dropped after the command has ended.
    unsafe {
        command.pre_exec(move || {
            let group = rustix::process::getpid();
            // Tell the watchdog which group to stop, and by when. The pipe
            // is close-on-exec: CMD itself does not keep it open.
            let record = watchdog_record(GROUP, group.as_raw_pid(), first_deadline);
            let written = libc::write(watchdog_fd, record.as_ptr().cast(), record.len());
            if written != record.len() as isize {
                return Err(std::io::Error::last_os_error());
            }
            if take_terminal {
                // SIGTTOU is ignored (inherited from kunci), so a background
                // group may take the terminal; CMD gets the default back.
                let _ = rustix::termios::tcsetpgrp(rustix::stdio::stdin(), group);
                set_disposition(Signal::TTOU, Disposition::DEFAULT);
            }
            Ok(())
        });
    }
    let child = match command.spawn() {
        Ok(child) => child,
        Err(error) => {
            if let Some(terminal) = terminal {
                terminal.restore(None);
            }
            eprintln!(
                "kunci {name}: cannot start {:?}: {error}",
                options.command[0]
            );
            watchdog.disarm();
            release(kept);
            // As a shell does: 127 when there is no such command, 126 when
            // it exists but cannot be executed.
            return if error.kind() == std::io::ErrorKind::NotFound {
                NOT_FOUND
            } else {
                NOT_EXECUTABLE
            };
        }
    };
    let group = Pid::from_child(&child);
    if let Some(terminal) = &terminal {
        terminal.give_to(group);
    }
    CHILD_GROUP.store(group.as_raw_pid(), Ordering::SeqCst);
    let pending = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
    if let Some(signal) = Signal::from_named_raw(pending) {
        signal_group(group, signal);
    }
    spawn_reaper(group, events);

    let outcome = loop {
        match inbox.recv_timeout(POLL) {
            Ok(Event::Exited(status)) => break Ok(status),
            Ok(Event::Lost(loss)) => break Err(Stop::Lost(loss)),
            Ok(Event::Stopped) if stdin_is_terminal() => {
                terminal = suspend_with(terminal, group);
            }
            // Stopped by someone else's SIGSTOP: theirs to continue.
            Ok(Event::Stopped) => {}
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            // The reaper never ends, so this cannot happen; if it did, the
            // command could no longer be watched.
            Err(mpsc::RecvTimeoutError::Disconnected) => break Err(Stop::Lost(Loss::Expired)),
        }
        // Each renewal moves the watchdog's deadline with it.
        let valid_until = kept.valid_until();
        if valid_until > confirmed {
            confirmed = valid_until;
            watchdog.extend(valid_until);
        }
        // Renewals went unanswered for so long that the command must get
        // its SIGTERM now, while the lock still holds (spec §9). A renewal
        // answered later does not undo it.
        let now = Instant::now();
        if now >= term_deadline(confirmed, lead) {
            break Err(Stop::Expiring(confirmed.saturating_duration_since(now)));
        }
    };
    // A command that ended just as the lease ran out (the watchdog acts at
    // the same deadline) ends as a lost lock too: it may not have finished
    // its work under the lock.
    let (outcome, reaped) = match outcome {
        Ok(status) => match kept.lost() {
            Some(loss) => (Err(Stop::Lost(loss)), true),
            None if Instant::now() >= kill_deadline(kept.valid_until()) => {
                (Err(Stop::Lost(Loss::Expired)), true)
            }
            None => (Ok(status), true),
        },
        Err(stop) => (Err(stop), false),
    };
    match outcome {
        Ok(status) => {
            if let Some(terminal) = terminal {
                terminal.restore(Some(group));
            }
            // Nothing CMD started outlives the lock.
            if group_alive(group) {
                terminate(group);
                let kill_at =
                    (Instant::now() + options.kill_after).min(kill_deadline(kept.valid_until()));
                stop_group(group, kill_at, None);
            }
            watchdog.disarm();
            release(kept);
            exit_status(status)
        }
        Err(stop) => {
            eprintln!("kunci {name}: lock lost: {stop}; stopping the command");
            terminate(group);
            // SIGKILL never later than the `valid_until` known at the
            // SIGTERM: after it, someone else may hold the lock. A renewal
            // answered since does not give the command more time.
            let kill_at = (Instant::now() + options.kill_after).min(kill_deadline(confirmed));
            stop_group(group, kill_at, (!reaped).then_some(&inbox));
            if let Some(terminal) = terminal {
                terminal.restore(Some(group));
            }
            watchdog.disarm();
            // Lost: releasing sends nothing. Stopped before the lease ran
            // out: the drop releases it in the background, if a renewal
            // got through after all.
            drop(kept);
            exit::NOT_HELD
        }
    }
}

/// Waits until `group` is empty, sending SIGKILL at `grace_end` if it is
/// not. With `inbox`, the command itself has not been reaped yet: wait for
/// its exit there.
fn stop_group(group: Pid, grace_end: Instant, inbox: Option<&mailbox::Receiver<Event>>) {
    let name = command_name();
    let mut killed = false;
    // Without a grace (the lease has run out) SIGKILL is no news.
    let has_grace = grace_end > Instant::now();
    if let Some(inbox) = inbox {
        loop {
            let left = grace_end.saturating_duration_since(Instant::now());
            match inbox.recv_timeout(left) {
                Ok(Event::Exited(_)) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Ok(Event::Lost(_) | Event::Stopped) => {}
                Err(mpsc::RecvTimeoutError::Timeout) if !killed => {
                    if has_grace {
                        eprintln!("kunci {name}: the command did not stop; killing it");
                    }
                    signal_group(group, Signal::KILL);
                    killed = true;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => std::thread::sleep(POLL),
            }
        }
    }
    // The reaper thread reaps what is left of the group as it exits.
    while group_alive(group) {
        if !killed && Instant::now() >= grace_end {
            signal_group(group, Signal::KILL);
            killed = true;
        }
        std::thread::sleep(POLL);
    }
}

/// Reaps every child of this process (the command, its orphans, the
/// watchdog) and reports the command's exit, and its stops.
fn spawn_reaper(command: Pid, events: mailbox::Sender<Event>) {
    std::thread::spawn(move || {
        loop {
            match rustix::process::wait(rustix::process::WaitOptions::UNTRACED) {
                Ok(Some((pid, status))) if pid == command => {
                    let event = if status.stopped() {
                        Event::Stopped
                    } else {
                        Event::Exited(ExitStatus::from_raw(status.as_raw()))
                    };
                    let _ = events.send(event);
                }
                Ok(_) | Err(Errno::INTR) => {}
                // No children now; orphans may still be reparented.
                Err(_) => std::thread::sleep(POLL),
            }
        }
    });
}

/// Whether any process of `group` is still alive (zombies are reaped by
/// [`spawn_reaper`], so they do not count for long).
fn group_alive(group: Pid) -> bool {
    rustix::process::test_kill_process_group(group) != Err(Errno::SRCH)
}

fn release(kept: KeptLease) {
    let name = command_name();
    match kept.release() {
        Ok(()) => {}
        Err(Error::NotHeld) => {
            eprintln!("kunci {name}: warning: the lock was no longer held when the command ended")
        }
        Err(error) => eprintln!("kunci {name}: warning: release failed: {error}"),
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
        // loads and stores, and kill(2) (a system call; nothing allocates
        // or takes a lock).
        unsafe {
            signal_hook::low_level::register(signal.as_raw(), move || {
                match Pid::from_raw(CHILD_GROUP.load(Ordering::SeqCst)) {
                    Some(group) => {
                        let _ = rustix::process::kill_process_group(group, signal);
                    }
                    None => PENDING_SIGNAL.store(signal.as_raw(), Ordering::SeqCst),
                }
            })?;
        }
    }
    Ok(())
}

/// SIGTERM to the group, then SIGCONT so that a stopped member acts on it.
fn terminate(group: Pid) {
    signal_group(group, Signal::TERM);
    signal_group(group, Signal::CONT);
}

/// `signal` to the process group of our own child (gone already: nothing
/// to do).
fn signal_group(group: Pid, signal: Signal) {
    let _ = rustix::process::kill_process_group(group, signal);
}

/// What a signal does on arrival: [`Disposition::IGNORE`],
/// [`Disposition::DEFAULT`], or one [`set_disposition`] returned.
#[derive(Clone, Copy)]
struct Disposition(libc::sighandler_t);

impl Disposition {
    const IGNORE: Disposition = Disposition(libc::SIG_IGN);
    const DEFAULT: Disposition = Disposition(libc::SIG_DFL);
}

/// Makes `signal` do `to` on arrival and returns what it did before.
/// Async-signal-safe (it is called between fork and exec).
fn set_disposition(signal: Signal, to: Disposition) -> Disposition {
    // SAFETY: no function becomes a handler: `to` is SIG_IGN, SIG_DFL or
    // what signal(2) returned for the same signal, and the signals set
    // here (SIGTTOU, and the watchdog's before any handler exists) have
    // no handler in kunci: only SIG_IGN or SIG_DFL.
    Disposition(unsafe { libc::signal(signal.as_raw(), to.0) })
}

/// Whether this process's group is the foreground group of the terminal
/// on stdin.
fn in_foreground() -> bool {
    rustix::termios::tcgetpgrp(rustix::stdio::stdin()).ok() == Some(rustix::process::getpgrp())
}

/// Makes this process's group the foreground group of the terminal on
/// stdin.
fn take_foreground() {
    let _ = rustix::termios::tcsetpgrp(rustix::stdio::stdin(), rustix::process::getpgrp());
}

/// The controlling terminal, while CMD's group is its foreground group.
struct Terminal {
    /// SIGTTOU's disposition before kunci ignored it.
    old_ttou: Disposition,
}

impl Terminal {
    /// Takes charge of the terminal if stdin is one and this process is in
    /// its foreground group; ignores SIGTTOU meanwhile, so that this
    /// process can hand the terminal back from the background.
    fn claim() -> Option<Terminal> {
        if !stdin_is_terminal() || !in_foreground() {
            return None;
        }
        let old_ttou = set_disposition(Signal::TTOU, Disposition::IGNORE);
        Some(Terminal { old_ttou })
    }

    /// Makes `group` the foreground group (the child did so already; doing
    /// it here too, as shells do, leaves no window either way).
    fn give_to(&self, group: Pid) {
        let _ = rustix::termios::tcsetpgrp(rustix::stdio::stdin(), group);
    }

    /// Gives the terminal back to kunci's group if CMD's group (`group`;
    /// `None`: none started) still has it, and restores SIGTTOU.
    fn restore(self, group: Option<Pid>) {
        if group.is_none() || rustix::termios::tcgetpgrp(rustix::stdio::stdin()).ok() == group {
            take_foreground();
        }
        set_disposition(Signal::TTOU, self.old_ttou);
    }
}

fn stdin_is_terminal() -> bool {
    rustix::stdio::stdin().is_terminal()
}

/// CMD was stopped by its terminal (^Z, or a read from the background):
/// take the terminal back if CMD had it, and stop kunci's own group, so
/// that the shell sees the job stopped. When the shell continues the job,
/// give CMD the terminal if the job is now in the foreground, and continue
/// CMD's group. While kunci is stopped nothing renews the lease: a stop
/// longer than the lease loses the lock, which kunci reports once it runs
/// again. (An orphaned group, with no job-control shell, cannot be stopped
/// by SIGTSTP: then CMD is simply continued.)
fn suspend_with(held: Option<Terminal>, group: Pid) -> Option<Terminal> {
    if held.is_some() {
        take_foreground();
    }
    let _ = rustix::process::kill_current_process_group(Signal::TSTP);
    // Continued: in the foreground (`fg`) or not (`bg`).
    let terminal = match held {
        Some(terminal) if in_foreground() => Some(terminal),
        Some(terminal) => {
            terminal.restore(Some(group));
            None
        }
        None => Terminal::claim(),
    };
    if let Some(terminal) = &terminal {
        terminal.give_to(group);
    }
    signal_group(group, Signal::CONT);
    terminal
}

/// A helper process that stops CMD's group if kunci dies (module docs).
struct Watchdog {
    /// The write end of the pipe the watchdog reads; only this process
    /// holds it (close-on-exec).
    pipe: OwnedFd,
    /// The instant the deadlines are counted from (read before the fork,
    /// so both processes hold it).
    start: Instant,
}

/// The watchdog's messages are records of [`RECORD`] bytes: a tag, a
/// process group (native-endian i32) and a deadline (native-endian u64,
/// nanoseconds after the watchdog's `start` on the monotonic clock
/// `Instant` reads). Each is one `write` of fewer than `PIPE_BUF` bytes,
/// so it arrives whole.
const RECORD: usize = 13;
/// CMD's group and the lock's `valid_until` (written by CMD's child).
const GROUP: u8 = b'G';
/// A later `valid_until` a renewal confirmed.
const DEADLINE: u8 = b'V';
/// kunci has dealt with CMD's group itself: exit quietly.
const DISARM: u8 = b'D';

fn watchdog_record(tag: u8, group: libc::pid_t, deadline_ns: u64) -> [u8; RECORD] {
    let mut record = [0u8; RECORD];
    record[0] = tag;
    record[1..5].copy_from_slice(&group.to_ne_bytes());
    record[5..].copy_from_slice(&deadline_ns.to_ne_bytes());
    record
}

/// `at` in nanoseconds after `start` (0 if before it).
fn nanos_since(start: Instant, at: Instant) -> u64 {
    at.saturating_duration_since(start)
        .as_nanos()
        .min(u128::from(u64::MAX)) as u64
}

impl Watchdog {
    fn start(kill_after: Duration) -> std::io::Result<Watchdog> {
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        let start = Instant::now();
        // SAFETY: this process has one thread here (no client, no signal
        // handlers yet), so the child may run ordinary code: no lock is
        // held by a thread that the fork leaves behind.
        match unsafe { libc::fork() } {
            -1 => Err(std::io::Error::last_os_error()),
            0 => {
                drop(write);
                watch(read, kill_after, start)
            }
            _ => Ok(Watchdog { pipe: write, start }),
        }
    }

    fn fd(&self) -> RawFd {
        self.pipe.as_raw_fd()
    }

    /// `at` on the watchdog's clock.
    fn ns(&self, at: Instant) -> u64 {
        nanos_since(self.start, at)
    }

    /// A renewal confirmed the lock until `valid_until`.
    fn extend(&self, valid_until: Instant) {
        let deadline = self.ns(kill_deadline(valid_until));
        self.send(watchdog_record(DEADLINE, 0, deadline));
    }

    /// kunci has dealt with CMD's group itself: the watchdog exits quietly.
    fn disarm(self) {
        self.send(watchdog_record(DISARM, 0, 0));
    }

    fn send(&self, record: [u8; RECORD]) {
        // A watchdog that is gone (it acted at a deadline) makes it fail
        // with EPIPE: nothing left to tell.
        let _ = rustix::io::write(&self.pipe, &record);
    }
}

/// The watchdog's life: learn the group and its deadline, follow the
/// deadlines kunci writes, and stop the group when kunci goes or the
/// deadline passes. Never returns.
fn watch(pipe: OwnedFd, kill_after: Duration, start: Instant) -> ! {
    // Its own group, so that signals meant for kunci's group (a
    // terminal's ^C) do not reach it; and deaf to the usual stop
    // signals, so that it outlives kunci: the pipe tells it when to act.
    let _ = rustix::process::setpgid(None, None);
    for signal in [
        Signal::INT,
        Signal::TERM,
        Signal::HUP,
        Signal::QUIT,
        Signal::TSTP,
        Signal::TTIN,
        Signal::TTOU,
        Signal::PIPE,
    ] {
        set_disposition(signal, Disposition::IGNORE);
    }
    // Hold no terminal and no pipe of kunci's caller open.
    if let Ok(null) = rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDWR,
        rustix::fs::Mode::empty(),
    ) {
        let _ = rustix::stdio::dup2_stdin(&null);
        let _ = rustix::stdio::dup2_stdout(&null);
        let _ = rustix::stdio::dup2_stderr(&null);
        if null.as_raw_fd() <= 2 {
            // It is one of 0, 1 and 2 now: keep it open.
            let _ = null.into_raw_fd();
        }
    }
    let now_ns = || nanos_since(start, Instant::now());
    let kill_after_ns = kill_after.as_nanos().min(u128::from(u64::MAX)) as u64;
    let mut group: Option<Pid> = None;
    let mut deadline: Option<u64> = None;
    loop {
        if let Some(deadline) = deadline {
            let now = now_ns();
            if now >= deadline {
                // The lease ran out with no later `valid_until` written:
                // someone else may hold the lock now.
                stop_group_at(group, now, start);
            }
            if !wait_readable(&pipe, deadline - now) {
                continue;
            }
        }
        let mut record = [0u8; RECORD];
        if !read_exact(&pipe, &mut record) {
            // End of file: kunci is gone.
            let Some(group) = group else {
                exit_now();
            };
            let kill_at = now_ns()
                .saturating_add(kill_after_ns)
                .min(deadline.unwrap_or(u64::MAX));
            stop_group_at(Some(group), kill_at, start);
        }
        let mut group_bytes = [0u8; 4];
        group_bytes.copy_from_slice(&record[1..5]);
        let mut deadline_bytes = [0u8; 8];
        deadline_bytes.copy_from_slice(&record[5..]);
        let at = u64::from_ne_bytes(deadline_bytes);
        match record[0] {
            GROUP => {
                group = Pid::from_raw(i32::from_ne_bytes(group_bytes));
                deadline = Some(at);
            }
            DEADLINE => deadline = Some(deadline.map_or(at, |known| known.max(at))),
            _ => exit_now(),
        }
    }
}

/// Leaves the watchdog process at once, with status 0: no destructors,
/// no atexit handlers, no flushing of buffers the fork copied from kunci.
fn exit_now() -> ! {
    // SAFETY: _exit ends the process; it touches no memory of ours, and
    // this (forked, single-threaded) process holds nothing that must be
    // cleaned up.
    unsafe { libc::_exit(0) }
}

/// SIGTERM to `group`, then SIGKILL at `kill_at` (ns on the watchdog's
/// clock) if any of it is left; then the watchdog exits.
fn stop_group_at(group: Option<Pid>, kill_at: u64, start: Instant) -> ! {
    if let Some(group) = group {
        signal_group(group, Signal::TERM);
        signal_group(group, Signal::CONT);
        loop {
            if rustix::process::test_kill_process_group(group).is_err() {
                break;
            }
            let now = nanos_since(start, Instant::now());
            if now >= kill_at {
                signal_group(group, Signal::KILL);
                break;
            }
            std::thread::sleep(POLL.min(Duration::from_nanos(kill_at - now)));
        }
    }
    exit_now()
}

/// Waits up to `limit_ns` for `pipe` to be readable (or at end of file):
/// `true` if it is, `false` when the time is up.
fn wait_readable(pipe: &OwnedFd, limit_ns: u64) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut poll = [PollFd::new(pipe, PollFlags::IN)];
    let limit = Timespec {
        tv_sec: (limit_ns / 1_000_000_000) as i64,
        tv_nsec: (limit_ns % 1_000_000_000) as i64,
    };
    // An interrupted wait is looked at again by the caller.
    matches!(rustix::event::poll(&mut poll, Some(&limit)), Ok(ready) if ready > 0)
}

/// Reads exactly `buf.len()` bytes; `false` at end of file or on an error.
fn read_exact(fd: impl AsFd, buf: &mut [u8]) -> bool {
    let mut done = 0;
    while done < buf.len() {
        match rustix::io::read(fd.as_fd(), &mut buf[done..]) {
            Ok(0) => return false,
            Ok(n) => done += n,
            Err(Errno::INTR) => {}
            Err(_) => return false,
        }
    }
    true
}

//! The client side of the `kunci` binary: exit codes, output, `kunci run`.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use kunci::client::{Client, Config};
use kunci::protocol::Response;

use crate::util::proxy::{Faults, Proxy};
use crate::util::{TempDir, TestServer, kunci, kunci_bin, kunci_command, require_tool};

const MS: Duration = Duration::from_millis(1);
const S: Duration = Duration::from_secs(1);
const LATE: Duration = Duration::from_millis(500);

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout)
        .trim_end()
        .to_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn code(output: &Output) -> i32 {
    output.status.code().expect("exited, not killed")
}

fn direct(server: &TestServer) -> Client {
    Client::new([server.addr.parse().unwrap()], Config::default()).unwrap()
}

/// Waits (bounded) for a file the child writes.
fn wait_for_file(path: &Path) -> String {
    let deadline = Instant::now() + 10 * S;
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && text.ends_with('\n')
        {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(5 * MS);
    }
}

/// A shell script that writes `started` once it runs, then waits; on
/// SIGTERM it writes `got` and runs `on_term`.
fn waiting_script(dir: &TempDir, on_term: &str) -> String {
    format!(
        "trap 'echo term > {got}; {on_term}' TERM; echo started > {started}; \
         while :; do sleep 0.05; done",
        got = dir.join("got").display(),
        started = dir.join("started").display()
    )
}

fn wait_exit(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("kunci did not exit within {limit:?}");
        }
        std::thread::sleep(5 * MS);
    }
}

#[test]
fn client_commands_print_one_line_and_exit_with_their_outcome() {
    let server = TestServer::start(&["--max-keys", "2"]);
    let addr = server.addr.as_str();
    let acquired = kunci(addr, &["acquire", "cli", "--lease", "30"]);
    assert_eq!(code(&acquired), 0, "{}", stderr(&acquired));
    let token: u64 = stdout(&acquired).parse().expect("the token alone");
    // The lock outlives the command.
    let query = kunci(addr, &["query", "cli"]);
    let line = stdout(&query);
    assert!(
        line.starts_with(&format!("held token={token} owner=")),
        "{line}"
    );
    assert!(
        line.contains(" lease_ms=") && line.ends_with(" waiters=0 grants=1"),
        "{line}"
    );

    let timeout = kunci(addr, &["acquire", "cli", "--wait", "0.2"]);
    assert_eq!(code(&timeout), 1);
    assert_eq!(stdout(&timeout), "");
    assert!(stderr(&timeout).contains("timeout"), "{}", stderr(&timeout));

    let renewed = kunci(addr, &["renew", "cli", &token.to_string(), "--lease", "60"]);
    assert_eq!(code(&renewed), 0, "{}", stderr(&renewed));
    assert_eq!(code(&kunci(addr, &["renew", "cli", "1"])), 6);
    assert_eq!(code(&kunci(addr, &["release", "cli", "1"])), 6);
    assert_eq!(
        code(&kunci(addr, &["release", "cli", &token.to_string()])),
        0
    );
    let released_again = kunci(addr, &["release", "cli", &token.to_string()]);
    assert_eq!(code(&released_again), 6);
    assert!(stderr(&released_again).contains("not held"));
    assert_eq!(stdout(&kunci(addr, &["query", "cli"])), "free");

    // Busy: two keys are the server's limit.
    let a = kunci(addr, &["acquire", "busy-a"]);
    let b = kunci(addr, &["acquire", "busy-b"]);
    assert_eq!((code(&a), code(&b)), (0, 0));
    let busy = kunci(addr, &["acquire", "busy-c"]);
    assert_eq!(code(&busy), 3);
    assert!(stderr(&busy).contains("busy"));

    let info = stdout(&kunci(addr, &["info"]));
    assert!(
        info.starts_with("version=") && info.contains(" grants=3 "),
        "{info}"
    );
    assert!(!info.contains('\n'));
    let ping = kunci(addr, &["ping"]);
    assert_eq!(code(&ping), 0);
    assert!(stdout(&ping).ends_with(" ms"), "{}", stdout(&ping));

    // --server overrides KUNCI_SERVER; several are accepted.
    let ping = kunci(
        "127.0.0.1:1",
        &["ping", "--server", addr, "--server", "unix:/nonexistent"],
    );
    assert_eq!(code(&ping), 0, "{}", stderr(&ping));
}

#[test]
fn usage_errors_and_invalid_arguments_exit_2_before_anything_is_sent() {
    let proxy = Proxy::start("127.0.0.1:1");
    let addr = proxy.addr.as_str();
    for args in [
        &["acquire"][..],
        &["acquire", "k", "--wait"],
        &["acquire", "k", "--wait", "x"],
        &["acquire", "k", "--wait", "255.5"],
        &["acquire", "k", "--lease", "0"],
        &["acquire", "k", "--lease", "256"],
        &["acquire", "k", "--lease", "1.5"],
        &["acquire", "k", "--bogus"],
        &["acquire", "k", "extra"],
        &["acquire", ""],
        &["release", "k"],
        &["release", "k", "notanumber"],
        &["renew", "k", "1", "--lease", "0"],
        &["query"],
        &["info", "extra"],
        &["ping", "--server", "nowhere"],
        &["run", "k"],
        &["run", "k", "--kill-after", "x", "--", "true"],
        &["run", "k", "-E", "x", "--", "true"],
        &["run", "k", "--conflict-exit-code", "256", "--", "true"],
        &["run", "k", "--wait", "infinity", "--", "true"],
        &["acquire", "k", "-q"],
        &["acquire", "k", "-E", "75"],
        &["run", "--", "true"],
        &["run", "--wait", "1", "--", "echo", "hi"],
        &[
            "acquire",
            "k",
            "--server",
            "etcd://127.0.0.1:1",
            "--server",
            addr,
        ],
        &["top", "--server", "etcd://127.0.0.1:1"],
    ] {
        let output = kunci(addr, args);
        assert_eq!(code(&output), 2, "{args:?}: {}", stderr(&output));
        assert!(!stderr(&output).is_empty());
    }
    assert_eq!(proxy.accepted(), 0);
    for command in [
        "acquire", "release", "renew", "query", "info", "ping", "run",
    ] {
        let help = kunci(addr, &[command, "--help"]);
        assert_eq!(code(&help), 0);
        assert!(
            stdout(&help).contains(&format!("kunci {command}")),
            "{command}"
        );
        assert!(stdout(&help).contains("--server"), "{command}");
    }
}

#[test]
fn unavailable_exits_4_and_indeterminate_exits_5() {
    let server = TestServer::start(&[]);
    let refusing = Proxy::start_refusing(&server.addr, None);
    let swallowing = Proxy::start(&server.addr);
    swallowing.set_faults(Faults {
        swallow_answers: true,
        ..Faults::default()
    });
    let started = Instant::now();
    let unavailable = kunci_command(&refusing.addr, &["acquire", "k"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let indeterminate = kunci_command(&swallowing.addr, &["acquire", "k"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let unavailable = unavailable.wait_with_output().unwrap();
    let indeterminate = indeterminate.wait_with_output().unwrap();
    assert!(started.elapsed() >= 5 * S);
    assert_eq!(code(&unavailable), 4);
    assert!(stderr(&unavailable).contains("unavailable"));
    assert_eq!(code(&indeterminate), 5);
    assert_eq!(stdout(&indeterminate), "");
    assert!(stderr(&indeterminate).contains("indeterminate"));
    assert_eq!(refusing.accepted(), 0);
}

#[test]
fn run_passes_the_lock_to_the_command_and_its_status_back() {
    let server = TestServer::start(&[]);
    let output = kunci(
        &server.addr,
        &[
            "run",
            "run-env",
            "--",
            "sh",
            "-c",
            "echo \"$KUNCI_KEY $KUNCI_TOKEN\"; exit 7",
        ],
    );
    assert_eq!(code(&output), 7, "{}", stderr(&output));
    let line = stdout(&output);
    let (key, token) = line.split_once(' ').unwrap();
    assert_eq!(key, "run-env");
    assert!(token.parse::<u64>().unwrap() > 0);
    assert_eq!(stderr(&output), "");
    // Released when the command ended.
    assert!(direct(&server).query("run-env").unwrap().is_free());

    let killed = kunci(
        &server.addr,
        &["run", "run-env", "--", "sh", "-c", "kill -9 $$"],
    );
    assert_eq!(code(&killed), 128 + 9);

    let missing = kunci(
        &server.addr,
        &["run", "run-env", "--", "/nonexistent/command"],
    );
    assert_eq!(code(&missing), 127);
    assert!(stderr(&missing).contains("cannot start"));
    assert!(direct(&server).query("run-env").unwrap().is_free());
    // As a shell: a file that exists but cannot be executed is 126.
    let dir = TempDir::new("run-not-executable");
    let plain_file = dir.join("plain");
    std::fs::write(&plain_file, "echo hi\n").unwrap();
    let plain_file = plain_file.display().to_string();
    let not_executable = kunci(&server.addr, &["run", "run-env", "--", &plain_file]);
    assert_eq!(code(&not_executable), 126, "{}", stderr(&not_executable));
    assert!(direct(&server).query("run-env").unwrap().is_free());

    // A held key: the acquire's outcome is the exit code.
    let holder = direct(&server)
        .acquire("run-env", Duration::ZERO, 30 * S)
        .unwrap();
    let busy = kunci(&server.addr, &["run", "run-env", "--", "true"]);
    assert_eq!(code(&busy), 1);
    drop(holder);
}

#[test]
fn run_renews_the_lease_while_the_command_runs() {
    let server = TestServer::start(&[]);
    // The command itself checks, after 1.5 leases, that its lock is held.
    let script = format!(
        "sleep 1.5; {} query \"$KUNCI_KEY\"; echo \"token=$KUNCI_TOKEN\"; sleep 1",
        kunci_bin()
    );
    let started = Instant::now();
    let output = kunci(
        &server.addr,
        &["run", "renewed", "--lease", "1", "--", "sh", "-c", &script],
    );
    assert!(started.elapsed() >= 2500 * MS);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert_eq!(stderr(&output), "", "the final release found the lock");
    let lines = stdout(&output);
    let (held, token) = lines.split_once('\n').unwrap();
    let token = token.strip_prefix("token=").unwrap();
    assert!(held.starts_with(&format!("held token={token} ")), "{lines}");
    let info = server.info();
    assert_eq!(info["expired"], "0");
    assert_eq!(info["released"], "1");
    let extended: u32 = info["extended"].parse().unwrap();
    assert!(
        (6..=9).contains(&extended),
        "renewed every lease/3: {extended}"
    );
}

#[test]
fn run_forwards_sigterm_to_the_command() {
    let server = TestServer::start(&[]);
    let dir = TempDir::new("run-sigterm");
    let started_file = dir.join("started");
    let script = waiting_script(&dir, "exit 9");
    let mut child = kunci_command(&server.addr, &["run", "sigterm", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    wait_for_file(&started_file);
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = wait_exit(&mut child, 10 * S);
    assert_eq!(status.code(), Some(9));
    assert_eq!(wait_for_file(&dir.join("got")), "term\n");
    assert!(direct(&server).query("sigterm").unwrap().is_free());
}

#[test]
fn run_stops_the_command_when_the_server_restarts_under_it() {
    let first = TestServer::start(&[]);
    let proxy = Proxy::start(&first.addr);
    let dir = TempDir::new("run-restart");
    let started_file = dir.join("started");
    let script = waiting_script(&dir, "exit 0");
    let mut child = kunci_command(
        &proxy.addr,
        &["run", "restart", "--lease", "2", "--", "sh", "-c", &script],
    )
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for_file(&started_file);
    first.kill();
    let second = TestServer::start(&[]);
    proxy.set_upstream(&second.addr);
    let restarted = Instant::now();
    let status = wait_exit(&mut child, 10 * S);
    let elapsed = restarted.elapsed();
    assert_eq!(status.code(), Some(6));
    assert!(elapsed < 2 * S + LATE, "{elapsed:?}");
    assert_eq!(wait_for_file(&dir.join("got")), "term\n");
    let mut message = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut message).unwrap();
    assert!(message.contains("lock lost"), "{message}");
}

#[test]
fn run_kills_a_command_that_ignores_sigterm_after_kill_after() {
    let server = TestServer::start(&[]);
    let dir = TempDir::new("run-kill");
    let started_file = dir.join("started");
    let script = format!(
        "trap '' TERM; echo $KUNCI_TOKEN > {started}; while :; do sleep 0.05; done",
        started = started_file.display()
    );
    let mut child = kunci_command(
        &server.addr,
        &[
            "run",
            "kill",
            "--lease",
            "3",
            "--kill-after",
            "0.5",
            "--",
            "sh",
            "-c",
            &script,
        ],
    )
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let token: u64 = wait_for_file(&started_file).trim().parse().unwrap();
    // Someone takes the lock away: the next renewal finds it gone.
    direct(&server).release("kill", token).unwrap();
    let released = Instant::now();
    let status = wait_exit(&mut child, 10 * S);
    let elapsed = released.elapsed();
    assert_eq!(status.code(), Some(6));
    assert!(elapsed >= 500 * MS, "{elapsed:?}: SIGKILL came early");
    assert!(elapsed < S + 500 * MS + LATE, "{elapsed:?}");
}

#[test]
fn run_stops_the_command_if_kunci_itself_dies() {
    let server = TestServer::start(&[]);
    let dir = TempDir::new("run-parent-dies");
    let started_file = dir.join("started");
    let script = waiting_script(&dir, "exit 0");
    let mut child = kunci_command(
        &server.addr,
        &["run", "orphaned", "--", "sh", "-c", &script],
    )
    .spawn()
    .unwrap();
    wait_for_file(&started_file);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(wait_for_file(&dir.join("got")), "term\n");
}

/// Whether process `pid` is gone: no longer in /proc, or a zombie waiting
/// for a parent that does not reap it.
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

/// The process ids, one a line, that a command wrote to `path`.
fn read_pids(path: &Path, count: usize) -> Vec<u32> {
    let deadline = Instant::now() + 10 * S;
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let pids: Vec<u32> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        if pids.len() == count && text.ends_with('\n') {
            return pids;
        }
        assert!(Instant::now() < deadline, "{}: {text:?}", path.display());
        std::thread::sleep(5 * MS);
    }
}

#[test]
fn run_gives_an_interactive_command_the_terminal_and_takes_it_back() {
    if !require_tool("script", "bsdutils") {
        return;
    }
    let server = TestServer::start(&[]);
    let bin = kunci_bin();
    // Two runs in one terminal session: the second can read the terminal
    // only if the first gave the foreground back to the shell's group.
    let session = format!(
        "{bin} run k -- sh -c 'read x; echo got \\$x'; \
         {bin} run k -- sh -c 'read y; echo got \\$y'"
    );
    let pipeline =
        format!("(sleep 2; echo hello; sleep 1; echo again) | script -qfc \"{session}\" /dev/null");
    let started = Instant::now();
    let mut child = Command::new("sh")
        .args(["-c", &pipeline])
        .env("KUNCI_SERVER", &server.addr)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_exit(&mut child, 20 * S);
    let elapsed = started.elapsed();
    let mut output = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut output).unwrap();
    assert!(status.success(), "{status:?}: {output:?}");
    assert!(elapsed >= 3 * S, "{elapsed:?}");
    let got: Vec<&str> = output
        .lines()
        .map(|line| line.trim_end_matches('\r'))
        .filter(|line| line.starts_with("got "))
        .collect();
    assert_eq!(got, ["got hello", "got again"], "{output:?}");
    assert!(direct(&server).query("k").unwrap().is_free());
}

#[test]
fn run_killed_by_sigkill_leaves_nothing_of_the_command_behind() {
    let server = TestServer::start(&[]);
    let dir = TempDir::new("run-sigkill");
    let pid_file = dir.join("pids");
    // Two grandchildren: one that stops at SIGTERM, one that ignores it
    // (so only the SIGKILL after --kill-after can stop it, and its shell).
    let script = format!(
        "sleep 1000 & echo $! > {pids}; trap '' TERM; sleep 1000 & echo $! >> {pids}; wait",
        pids = pid_file.display()
    );
    let mut child = kunci_command(
        &server.addr,
        &[
            "run",
            "sigkill",
            "--kill-after",
            "1",
            "--",
            "sh",
            "-c",
            &script,
        ],
    )
    .spawn()
    .unwrap();
    let pids = read_pids(&pid_file, 2);
    // Measured before the kill: the watchdog's grace cannot start earlier.
    let killed = Instant::now();
    child.kill().unwrap();
    child.wait().unwrap();
    let deadline = killed + 5 * S;
    while !process_gone(pids[0]) {
        assert!(Instant::now() < deadline, "the SIGTERM never came");
        std::thread::sleep(5 * MS);
    }
    assert!(
        killed.elapsed() < S,
        "SIGTERM came late: {:?}",
        killed.elapsed()
    );
    // The one that ignores SIGTERM lives until --kill-after has passed.
    std::thread::sleep((900 * MS).saturating_sub(killed.elapsed()));
    assert!(!process_gone(pids[1]), "SIGKILL came before --kill-after");
    while !process_gone(pids[1]) {
        assert!(Instant::now() < deadline, "the SIGKILL never came");
        std::thread::sleep(5 * MS);
    }
    let elapsed = killed.elapsed();
    assert!(elapsed >= S && elapsed < S + LATE, "{elapsed:?}");
}

#[test]
fn run_stops_what_the_command_left_running_before_it_releases() {
    let server = TestServer::start(&[]);
    let dir = TempDir::new("run-leftover");
    let pid_file = dir.join("pids");
    let script = format!("sleep 1000 & echo $! > {}", pid_file.display());
    let started = Instant::now();
    let output = kunci(
        &server.addr,
        &["run", "leftover", "--", "sh", "-c", &script],
    );
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(started.elapsed() < 2 * S, "{:?}", started.elapsed());
    let pids = read_pids(&pid_file, 1);
    assert!(process_gone(pids[0]));
    assert!(direct(&server).query("leftover").unwrap().is_free());

    // One that ignores SIGTERM is killed after --kill-after.
    let script = format!(
        "trap '' TERM; sleep 1000 & echo $! > {}",
        pid_file.display()
    );
    let started = Instant::now();
    let output = kunci(
        &server.addr,
        &[
            "run",
            "leftover",
            "--kill-after",
            "0.5",
            "--",
            "sh",
            "-c",
            &script,
        ],
    );
    let elapsed = started.elapsed();
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(
        elapsed >= 500 * MS && elapsed < 500 * MS + 2 * LATE,
        "{elapsed:?}"
    );
    assert!(process_gone(read_pids(&pid_file, 1)[0]));
}

#[test]
fn run_for_cron_exits_with_the_conflict_code_and_says_nothing() {
    let server = TestServer::start(&[]);
    let dir = TempDir::new("run-cron");
    let ran = dir.join("ran");
    let touch = format!("touch {}", ran.display());
    let holder = direct(&server)
        .acquire("nightly", Duration::ZERO, 30 * S)
        .unwrap();
    let quiet = kunci(
        &server.addr,
        &[
            "run", "nightly", "--wait", "0", "-E", "75", "-q", "--", "sh", "-c", &touch,
        ],
    );
    assert_eq!(code(&quiet), 75);
    assert_eq!(stderr(&quiet), "");
    assert_eq!(stdout(&quiet), "");
    let long = kunci(
        &server.addr,
        &[
            "run",
            "nightly",
            "--conflict-exit-code",
            "75",
            "--quiet",
            "--",
            "sh",
            "-c",
            &touch,
        ],
    );
    assert_eq!((code(&long), stderr(&long).as_str()), (75, ""));
    // Without -q the timeout is reported; without -E it exits 1.
    let told = kunci(&server.addr, &["run", "nightly", "-E", "75", "--", "true"]);
    assert_eq!(code(&told), 75);
    assert!(stderr(&told).contains("timeout"), "{}", stderr(&told));
    let plain = kunci(&server.addr, &["run", "nightly", "-q", "--", "true"]);
    assert_eq!((code(&plain), stderr(&plain).as_str()), (1, ""));
    assert!(!ran.exists(), "the command ran without the lock");
    // Other failures keep their own codes and messages: busy is 3.
    drop(holder);
    let busy_server = TestServer::start(&["--max-keys", "1"]);
    let _other = direct(&busy_server)
        .acquire("other", Duration::ZERO, 30 * S)
        .unwrap();
    let busy = kunci(
        &busy_server.addr,
        &["run", "nightly", "-E", "75", "-q", "--", "true"],
    );
    assert_eq!(code(&busy), 3);
    assert!(stderr(&busy).contains("busy"), "{}", stderr(&busy));
}

/// Waits (bounded) until `key` has `count` waiters.
fn until_waiters(client: &Client, key: &str, count: u32) {
    let deadline = Instant::now() + 10 * S;
    while client.query(key).unwrap().waiters < count {
        assert!(Instant::now() < deadline, "never {count} waiters on {key}");
        std::thread::sleep(5 * MS);
    }
}

#[test]
fn waiting_forever_queues_with_the_longest_wire_wait() {
    let server = TestServer::start(&[]);
    let proxy = Proxy::start(&server.addr);
    let client = direct(&server);
    let holder = client.acquire("forever", Duration::ZERO, 30 * S).unwrap();
    let started = Instant::now();
    let run = kunci_command(
        &proxy.addr,
        &["run", "forever", "--wait", "inf", "--", "true"],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    until_waiters(&client, "forever", 1);
    let acquire = kunci_command(
        &proxy.addr,
        &["acquire", "forever", "--wait", "inf", "--lease", "1"],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    until_waiters(&client, "forever", 2);
    std::thread::sleep(S.saturating_sub(started.elapsed()));
    holder.release().unwrap();
    // The run is first in the queue, then the acquire.
    let run = run.wait_with_output().unwrap();
    let acquire = acquire.wait_with_output().unwrap();
    assert!(started.elapsed() >= S);
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    assert_eq!(stderr(&run), "");
    assert_eq!(code(&acquire), 0, "{}", stderr(&acquire));
    assert!(
        stdout(&acquire).parse::<u64>().is_ok(),
        "{}",
        stdout(&acquire)
    );
    let waits: Vec<u8> = proxy
        .frames()
        .iter()
        // `run` labels its request, so it goes as `S`; `acquire` as `A`.
        .filter(|f| f.op == b'A' || f.op == b'S')
        .map(|f| f.wait_s)
        .collect();
    // Each first tries with a wait of 0 (it ends by 5 s even where no
    // server answers), then queues with the longest wire wait.
    assert_eq!(waits, [0, 255, 0, 255]);
}

#[test]
fn run_renews_at_once_a_lock_granted_after_waiting_longer_than_its_lease() {
    let server = TestServer::start(&[]);
    let proxy = Proxy::start(&server.addr);
    let client = direct(&server);
    let holder = client.acquire("late", Duration::ZERO, 30 * S).unwrap();
    let run = kunci_command(
        &proxy.addr,
        &[
            "run",
            "late",
            "--wait",
            "5",
            "--lease",
            "1",
            "--",
            "sh",
            "-c",
            "sleep 0.5",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    until_waiters(&client, "late", 1);
    // Granted 1.5 s after it was sent: the ticket's own bound has passed.
    std::thread::sleep(1500 * MS);
    holder.release().unwrap();
    let released = Instant::now();
    let run = run.wait_with_output().unwrap();
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    assert_eq!(stderr(&run), "");
    let frames = proxy.frames();
    let granted = frames.iter().position(|f| f.op == b'E').expect("a renewal");
    assert!(frames[granted].at - released < LATE, "renewed at once");
    assert!(client.query("late").unwrap().is_free());
}

#[test]
fn run_warns_when_only_the_final_release_finds_the_lock_gone() {
    let server = TestServer::start(&[]);
    let script = format!(
        "{} release \"$KUNCI_KEY\" \"$KUNCI_TOKEN\" >/dev/null; exit 3",
        kunci_bin()
    );
    let output = kunci(&server.addr, &["run", "gone", "--", "sh", "-c", &script]);
    assert_eq!(code(&output), 3);
    assert!(
        stderr(&output).contains("warning: the lock was no longer held"),
        "{}",
        stderr(&output)
    );
}

/// The state letter and process group of `pid`, from /proc.
fn state_and_group(pid: u32) -> (char, i32) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let mut fields = stat
        .rsplit_once(") ")
        .map(|(_, rest)| rest)
        .unwrap_or_default()
        .split(' ');
    let state = fields.next().and_then(|s| s.chars().next()).unwrap_or('?');
    let group = fields.nth(1).and_then(|g| g.parse().ok()).unwrap_or(0);
    (state, group)
}

fn until_state(pid: u32, wanted: impl Fn(char) -> bool, what: &str) {
    let deadline = Instant::now() + 5 * S;
    while !wanted(state_and_group(pid).0) {
        assert!(
            Instant::now() < deadline,
            "{pid} never {what}: {:?}",
            state_and_group(pid)
        );
        std::thread::sleep(5 * MS);
    }
}

#[test]
fn run_suspended_from_the_terminal_stops_as_a_job_and_resumes() {
    if !require_tool("script", "bsdutils") {
        return;
    }
    let server = TestServer::start(&[]);
    let dir = TempDir::new("run-suspend");
    let pid_file = dir.join("pids");
    // A shell with job control (`sh -m`), as in a terminal: kunci runs as
    // its own job; once the job stops, the shell reads a line, then `fg`.
    let session = format!(
        "sh -m -c '{} run suspend -- sh -c \"echo \\$\\$ > {pids}; echo \\$PPID >> {pids}; \
         read x; echo got \\$x\"; read go; fg'",
        kunci_bin(),
        pids = pid_file.display()
    );
    let mut script = Command::new("script")
        .args(["-qfc", &session, "/dev/null"])
        .env("KUNCI_SERVER", &server.addr)
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pids = read_pids(&pid_file, 2);
    let (cmd, kunci) = (pids[0], pids[1]);
    let mut input = script.stdin.take().unwrap();
    // ^Z: the terminal stops CMD's group; kunci stops its own in turn,
    // as a job that a shell would see stopped.
    std::io::Write::write_all(&mut input, b"\x1a").unwrap();
    until_state(cmd, |s| s == 'T', "stopped");
    until_state(kunci, |s| s == 'T', "stopped");
    // The shell has the terminal again; `fg` continues kunci's group, and
    // kunci gives CMD the terminal back and continues it.
    std::io::Write::write_all(&mut input, b"go\n").unwrap();
    until_state(kunci, |s| s != 'T', "continued");
    until_state(cmd, |s| s != 'T', "continued");
    std::io::Write::write_all(&mut input, b"hello\n").unwrap();
    let status = wait_exit(&mut script, 10 * S);
    let mut output = String::new();
    std::io::Read::read_to_string(&mut script.stdout.take().unwrap(), &mut output).unwrap();
    assert!(status.success(), "{status:?}: {output:?}");
    assert!(output.contains("got hello"), "{output:?}");
    assert!(direct(&server).query("suspend").unwrap().is_free());
}

#[test]
fn run_exits_6_when_the_lease_runs_out_without_an_answered_renewal() {
    let server = TestServer::start(&[]);
    let proxy = Proxy::start(&server.addr);
    let dir = TempDir::new("run-unanswered");
    let script = waiting_script(&dir, "exit 0");
    let spawned = Instant::now();
    let mut child = kunci_command(
        &proxy.addr,
        &[
            "run",
            "unanswered",
            "--lease",
            "2",
            "--",
            "sh",
            "-c",
            &script,
        ],
    )
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for_file(&dir.join("started"));
    // Renewals reach the server; their answers never come back.
    proxy.set_faults(Faults {
        swallow_answers: true,
        ..Faults::default()
    });
    let status = wait_exit(&mut child, 10 * S);
    let elapsed = spawned.elapsed();
    assert_eq!(status.code(), Some(6));
    // Not before min(--kill-after, lease/4) = 0.5 s ahead of valid_until
    // (when the group gets SIGTERM and the command exits): the acquire was
    // sent after the spawn, and valid_until is its send instant + 2 s −
    // 14 ms.
    assert!(elapsed >= 2 * S - 14 * MS - 500 * MS, "{elapsed:?}");
    assert!(elapsed < 2 * S + 2 * LATE, "{elapsed:?}");
    assert!(
        dir.join("got").exists(),
        "the command's TERM trap never ran"
    );
    let mut message = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut message).unwrap();
    assert!(
        message.contains("lock lost: no renewal was answered and the lease runs out in"),
        "{message}"
    );
}

#[test]
fn run_started_in_the_background_reads_the_terminal_once_brought_to_the_foreground() {
    if !require_tool("script", "bsdutils") {
        return;
    }
    let server = TestServer::start(&[]);
    // CMD reads the terminal from a background job and is stopped; kunci
    // stops with it, and `fg` resumes both, CMD holding the terminal.
    let session = format!(
        "sh -m -c '{} run background -- sh -c \"read x; echo got \\$x\" & sleep 1; fg'",
        kunci_bin()
    );
    let mut script = Command::new("script")
        .args(["-qfc", &session, "/dev/null"])
        .env("KUNCI_SERVER", &server.addr)
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = script.stdin.take().unwrap();
    std::thread::sleep(2 * S);
    std::io::Write::write_all(&mut input, b"hello\n").unwrap();
    let status = wait_exit(&mut script, 10 * S);
    let mut output = String::new();
    std::io::Read::read_to_string(&mut script.stdout.take().unwrap(), &mut output).unwrap();
    assert!(status.success(), "{status:?}: {output:?}");
    assert!(output.contains("got hello"), "{output:?}");
    assert!(direct(&server).query("background").unwrap().is_free());
}

/// Issue 18 defect 5: the KEY comes before `--`; nothing after `--` is
/// taken for it, and nothing is sent.
#[test]
fn run_takes_the_key_only_before_the_double_dash() {
    let proxy = Proxy::start("127.0.0.1:1");
    for args in [
        &["run", "--server", proxy.addr.as_str(), "--", "echo", "hi"][..],
        &["run", "--", "true"],
    ] {
        let output = kunci(&proxy.addr, args);
        assert_eq!(code(&output), 2, "{args:?}");
        assert_eq!(
            stderr(&output),
            "kunci run: missing KEY: it comes before `--`\n(see kunci run --help)\n",
            "{args:?}"
        );
    }
    assert_eq!(proxy.accepted(), 0);
}

/// Issue 18 defect 6: `etcd://` mixed with kunci servers is a usage error,
/// and `kunci top` says it has nothing to show on etcd.
#[test]
fn etcd_mixed_with_kunci_servers_and_top_on_etcd_are_usage_errors() {
    let mixed = kunci(
        "127.0.0.1:1",
        &[
            "acquire",
            "k",
            "--server",
            "etcd://127.0.0.1:1",
            "--server",
            "127.0.0.1:1",
        ],
    );
    assert_eq!(code(&mixed), 2);
    assert_eq!(
        stderr(&mixed),
        "kunci acquire: etcd:// cannot be mixed with kunci server addresses: name one \
         service, either kunci servers or one etcd cluster\n(see kunci acquire --help)\n"
    );
    let mixed_env = kunci("127.0.0.1:1,etcd://127.0.0.1:1", &["query", "k"]);
    assert_eq!(code(&mixed_env), 2, "{}", stderr(&mixed_env));
    let top = kunci("etcd://127.0.0.1:1", &["top", "--count", "1"]);
    assert_eq!(code(&top), 2);
    assert_eq!(stdout(&top), "");
    assert!(
        stderr(&top).starts_with("kunci top: not supported on etcd://"),
        "{}",
        stderr(&top)
    );
}

/// Issue 18 defect 2 (spec §9): when kunci dies by SIGKILL, CMD's group
/// gets SIGKILL at the lock's `valid_until` at the latest, even with a
/// longer `--kill-after`: the key is never granted to another client
/// while the command still runs. And not before `valid_until`.
#[test]
fn run_killed_by_sigkill_stops_the_command_by_the_end_of_its_lease() {
    let server = TestServer::start(&[]);
    let dir = TempDir::new("run-sigkill-lease");
    let pid_file = dir.join("pids");
    let script = format!(
        "trap '' TERM; echo $$ > {pids}; while :; do sleep 0.05; done",
        pids = pid_file.display()
    );
    let spawned = Instant::now();
    let mut child = kunci_command(
        &server.addr,
        &[
            "run",
            "short",
            "--lease",
            "3",
            "--kill-after",
            "30",
            "--",
            "sh",
            "-c",
            &script,
        ],
    )
    .spawn()
    .unwrap();
    let pid = read_pids(&pid_file, 1)[0];
    child.kill().unwrap();
    child.wait().unwrap();
    let watcher = std::thread::spawn(move || {
        let deadline = Instant::now() + 10 * S;
        while !process_gone(pid) && Instant::now() < deadline {
            std::thread::sleep(MS);
        }
        spawned.elapsed()
    });
    // The server takes the key back at the end of the lease and grants it.
    let ticket = direct(&server).acquire("short", 10 * S, 5 * S).unwrap();
    let granted = spawned.elapsed();
    assert!(
        process_gone(pid),
        "the command still ran when the key was granted to another client ({granted:?})"
    );
    let gone = watcher.join().unwrap();
    // valid_until = the acquire's send instant (after the spawn) + 3 s
    // − the 16 ms drift margin; the SIGKILL comes 100 ms before it.
    assert!(
        gone >= 3 * S - 16 * MS - 100 * MS,
        "SIGKILL before valid_until: {gone:?}"
    );
    assert!(gone <= granted, "{gone:?} {granted:?}");
    assert!(granted < 3 * S + 2 * LATE, "{granted:?}");
    ticket.release().unwrap();
}

/// Issue 18 defect 2 (spec §9): when the lease runs out unrenewed, the
/// command that ignores SIGTERM gets SIGKILL at once — never later than
/// the last `valid_until` — not after `--kill-after`.
#[test]
fn run_kills_at_valid_until_when_the_lease_runs_out_whatever_kill_after_says() {
    let server = TestServer::start(&[]);
    let proxy = Proxy::start(&server.addr);
    let dir = TempDir::new("run-unanswered-kill");
    let started_file = dir.join("started");
    let script = format!(
        "trap '' TERM; echo started > {started}; while :; do sleep 0.05; done",
        started = started_file.display()
    );
    let spawned = Instant::now();
    let mut child = kunci_command(
        &proxy.addr,
        &[
            "run",
            "unanswered-kill",
            "--lease",
            "2",
            "--kill-after",
            "30",
            "--",
            "sh",
            "-c",
            &script,
        ],
    )
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_for_file(&started_file);
    proxy.set_faults(Faults {
        swallow_answers: true,
        ..Faults::default()
    });
    let status = wait_exit(&mut child, 10 * S);
    let elapsed = spawned.elapsed();
    assert_eq!(status.code(), Some(6));
    // The group is killed 100 ms before valid_until (send instant + 2 s
    // − 14 ms), not after --kill-after.
    assert!(elapsed >= 2 * S - 14 * MS - 100 * MS, "{elapsed:?}");
    assert!(elapsed < 2 * S + 2 * LATE, "{elapsed:?}");
}

/// Runs `kunci run --lease 4` (so SIGTERM comes min(5 s, 4 s / 4) = 1 s
/// before `valid_until`) with a command that records its SIGTERM and goes
/// on; once it runs, the proxy applies `faults` to the renewals. Returns
/// when the SIGTERM was seen and when kunci exited (both after the spawn),
/// kunci's exit status and its stderr.
fn run_with_renewals(faults: Faults) -> (Option<Duration>, Duration, i32, String, Vec<Response>) {
    let server = TestServer::start(&[]);
    let proxy = Proxy::start(&server.addr);
    let dir = TempDir::new("run-term-lead");
    let script = waiting_script(&dir, ":");
    let spawned = Instant::now();
    let mut child = kunci_command(
        &proxy.addr,
        &[
            "run",
            "term-lead",
            "--lease",
            "4",
            "--",
            "sh",
            "-c",
            &script,
        ],
    )
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for_file(&dir.join("started"));
    proxy.set_faults(faults);
    let got = dir.join("got");
    let mut term = None;
    let status = loop {
        if term.is_none() && got.exists() {
            term = Some(spawned.elapsed());
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if spawned.elapsed() > 12 * S {
            let _ = child.kill();
            panic!("kunci did not exit within 12 s");
        }
        std::thread::sleep(2 * MS);
    };
    let exited = spawned.elapsed();
    if term.is_none() && got.exists() {
        term = Some(exited);
    }
    let mut message = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut message).unwrap();
    let code = status.code().expect("kunci exited");
    (term, exited, code, message, proxy.answers())
}

/// Issue 25 defect 3 (spec §9): while renewals go unanswered, CMD gets
/// SIGTERM `min(--kill-after, lease/4)` before `valid_until` — early
/// enough to run its trap while the lock still holds — then SIGKILL by
/// `valid_until`, and kunci exits 6.
#[test]
fn run_sends_sigterm_a_quarter_lease_before_valid_until_when_renewals_go_unanswered() {
    let (term, exited, code, message, _) = run_with_renewals(Faults {
        swallow_answers: true,
        ..Faults::default()
    });
    assert_eq!(code, 6, "{message}");
    // valid_until = the acquire's send instant (after the spawn) + 4 s −
    // the 18 ms drift margin: SIGTERM 1 s before it, SIGKILL 100 ms before.
    let term = term.expect("the command's TERM trap never ran");
    assert!(term >= 4 * S - 18 * MS - S, "SIGTERM early: {term:?}");
    assert!(term < 3 * S + LATE, "SIGTERM late: {term:?}");
    assert!(
        exited >= 4 * S - 18 * MS - 100 * MS,
        "SIGKILL early: {exited:?}"
    );
    assert!(exited < 4 * S + LATE, "{exited:?}");
    assert!(
        message
            .contains("kunci run: lock lost: no renewal was answered and the lease runs out in ")
            && message.contains(" ms; stopping the command"),
        "{message}"
    );
}

/// Issue 25 defect 3: a renewal answered after that SIGTERM does not undo
/// it: the command is already stopping, gets SIGKILL by the `valid_until`
/// known at the SIGTERM, and kunci exits 6.
#[test]
fn run_does_not_take_back_a_sigterm_when_a_late_renewal_is_answered() {
    // The first renewal, sent lease/3 after the acquire, is answered 2.2 s
    // later: after the SIGTERM (~3 s), before valid_until (~4 s).
    let (term, exited, code, message, answers) = run_with_renewals(Faults {
        answer_delay: 2_200 * MS,
        ..Faults::default()
    });
    assert_eq!(code, 6, "{message}");
    let term = term.expect("the command's TERM trap never ran");
    assert!(term >= 4 * S - 18 * MS - S, "SIGTERM early: {term:?}");
    assert!(term < 3 * S + LATE, "SIGTERM late: {term:?}");
    assert!(
        exited >= 4 * S - 18 * MS - 100 * MS,
        "SIGKILL early: {exited:?}"
    );
    assert!(exited < 4 * S + LATE, "{exited:?}");
    assert!(
        answers
            .iter()
            .any(|answer| matches!(answer, Response::Extended { .. })),
        "no renewal was answered: {answers:?}"
    );
}

/// Issue 25 defect 4 (spec §8 rule 12): the `Q` that `kunci acquire`
/// sends after a `T` to explain a crash grace is bounded by the acquire's
/// own deadline `D` = start + wait + 5 s, and left out when it cannot
/// finish: on a link that delivers answers 3 s late, `--wait 1` ends by
/// 6 s, not at 7 s when the `Q`'s answer arrives.
#[test]
fn acquire_after_a_timeout_ends_by_its_deadline_on_a_slow_link() {
    let server = TestServer::start(&[]);
    let holder = direct(&server);
    let ticket = holder.acquire("slow-link", S, 30 * S).unwrap();
    let proxy = Proxy::start(&server.addr);
    proxy.set_faults(Faults {
        answer_delay: 3 * S,
        ..Faults::default()
    });
    let spawned = Instant::now();
    let output = kunci(&proxy.addr, &["acquire", "slow-link", "--wait", "1"]);
    let elapsed = spawned.elapsed();
    assert_eq!(code(&output), 1, "{}", stderr(&output));
    assert!(
        stderr(&output).starts_with("kunci acquire: timeout: "),
        "{}",
        stderr(&output)
    );
    // The `T` comes 1 s after the request, 3 s late.
    assert!(elapsed >= 4 * S, "{elapsed:?}");
    assert!(elapsed < 6 * S + LATE, "past D = 6 s: {elapsed:?}");
    // The follow-up `Q` was sent, and its answer never awaited.
    assert!(proxy.frames().iter().any(|frame| frame.op == b'Q'));
    ticket.release().unwrap();
}

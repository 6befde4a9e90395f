//! What an operator and a user see: help texts, failure messages, `kunci
//! top`, log lines, systemd readiness and the shipped unit file.

use std::os::unix::net::UnixDatagram;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::util::{TestServer, kunci_bin, require_tool};

/// Runs `kunci ARGS` with `KUNCI_SERVER` unset unless `env` sets it.
fn kunci(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(kunci_bin());
    command
        .args(args)
        .env_remove("KUNCI_SERVER")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("run kunci")
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("UTF-8 stdout")
}

fn stderr(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).expect("UTF-8 stderr")
}

// Not `\`-continued: that would strip the first line's indent.
const SERVER_LINES: &str = "  --server ADDR   a server address: HOST:PORT, tls://HOST:PORT (TLS,
                  checking the certificate against HOST) or unix:PATH;
                  repeat, or separate with commas, for several addresses
                  of the same service (default: $KUNCI_SERVER, the same
                  way, else 127.0.0.1:5862); etcd://HOST:PORT[,HOST:PORT]...
                  takes the locks on an etcd cluster instead (docs/ETCD.md),
                  and with ?layout=etcd at its end shares exclusive locks
                  and elections with etcdctl lock/elect and Go's
                  concurrency package
  --secret-file FILE
                  the secret for a server with --auth (one trailing
                  newline is ignored); default: $KUNCI_SECRET, else none.
                  It is sent only over tls://, a unix socket or to a
                  loopback address (127.0.0.0/8, ::1, localhost)
  --insecure-plaintext-secret
                  send the secret in clear to other addresses too (also
                  $KUNCI_ALLOW_PLAINTEXT_SECRET=1); anyone on the path
                  can read it
  --tls-ca FILE   trust this CA (PEM) for tls:// (default: $KUNCI_TLS_CA,
                  else the system's trust store)
  --tls-cert FILE a client certificate (PEM) for tls://, with --tls-key
  --tls-key FILE  its private key (PEM)
  -h, --help      show this help
";

#[test]
fn every_client_command_help_ends_with_the_indented_server_lines() {
    for command in ["acquire", "release", "renew", "query", "info", "ping"] {
        let output = kunci(&[command, "--help"], &[]);
        assert_eq!(output.status.code(), Some(0), "{command}");
        let text = stdout(&output);
        assert!(
            text.ends_with(&format!("\n{SERVER_LINES}")),
            "{command}:\n{text}"
        );
        assert!(text.starts_with(&format!("kunci {command} — ")), "{text}");
    }
    let top = stdout(&kunci(&["top", "--help"], &[]));
    assert!(top.ends_with(SERVER_LINES), "{top}");
}

#[test]
fn help_command_prints_that_commands_help() {
    for command in [
        "serve", "acquire", "release", "renew", "query", "info", "ping", "top", "bench", "run",
        "secret",
    ] {
        let by_help = kunci(&["help", command], &[]);
        let by_flag = kunci(&[command, "--help"], &[]);
        assert_eq!(by_help.status.code(), Some(0), "help {command}");
        assert_eq!(stdout(&by_help), stdout(&by_flag), "help {command}");
        assert!(!stdout(&by_help).contains("Exit status of client commands"));
    }
    let unknown = kunci(&["help", "frobnicate"], &[]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(
        stderr(&unknown).starts_with("kunci help: there is no command \"frobnicate\"\n"),
        "{}",
        stderr(&unknown)
    );
}

#[test]
fn top_level_help_names_version_server_variable_and_exit_codes() {
    let output = kunci(&["help"], &[]);
    assert_eq!(output.status.code(), Some(0));
    let text = stdout(&output);
    for needle in [
        "  kunci --version                           print the version\n",
        "  kunci top [--interval S]                  watch the server's counters\n",
        "service), else to the addresses in $KUNCI_SERVER, else to 127.0.0.1:5862.\n",
        "--insecure-plaintext-secret (or $KUNCI_ALLOW_PLAINTEXT_SECRET=1).\n",
        "Client commands talk to --server ADDR (HOST:PORT, tls://HOST:PORT or\n",
        "Exit status of client commands:\n  0 done            1 timeout (the key is held by another)   2 usage error\n  3 busy (no room on the server, or it is shutting down)\n  4 unavailable (nothing was done)   5 indeterminate (no answer in time)\n  6 not held / lock lost   7 permission denied (secret or scopes)\n",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
    assert_eq!(stdout(&kunci(&["--help"], &[])), text);
    let version = kunci(&["--version"], &[]);
    assert_eq!(
        stdout(&version),
        format!("kunci {}\n", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn a_held_key_with_wait_0_says_someone_else_holds_it() {
    let server = TestServer::start(&[]);
    let addr = server.addr.as_str();
    let held = kunci(&["acquire", "job", "--server", addr], &[]);
    assert_eq!(held.status.code(), Some(0), "{}", stderr(&held));

    let output = kunci(&["acquire", "job", "--server", addr], &[]);
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(
        stderr(&output),
        "kunci acquire: timeout: key \"job\" is held by someone else; nothing was acquired \
         (--wait 0 tries once; --wait S waits up to S seconds)\n"
    );
    assert_eq!(stdout(&output), "");

    let output = kunci(&["acquire", "job", "--wait", "0.2", "--server", addr], &[]);
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(
        stderr(&output),
        "kunci acquire: timeout: key \"job\" stayed held by someone else for the whole wait \
         (0.2 s, sent as 1 s: the server counts whole seconds); nothing was acquired\n"
    );
    let output = kunci(&["acquire", "job", "--wait", "1", "--server", addr], &[]);
    assert_eq!(
        stderr(&output),
        "kunci acquire: timeout: key \"job\" stayed held by someone else for the whole wait \
         (1 s); nothing was acquired\n"
    );

    // `kunci run` says the same, names the key, and exits with its
    // conflict code.
    let output = kunci(&["run", "job", "--server", addr, "--", "true"], &[]);
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(
        stderr(&output),
        "kunci run: timeout: key \"job\" is held by someone else; nothing was acquired \
         (--wait 0 tries once; --wait S waits up to S seconds)\n"
    );
}

#[test]
fn busy_not_held_and_unavailable_say_what_happened_and_what_to_do() {
    let server = TestServer::start(&["--max-keys", "1"]);
    let addr = server.addr.as_str();
    assert_eq!(
        kunci(&["acquire", "a", "--server", addr], &[])
            .status
            .code(),
        Some(0)
    );
    let busy = kunci(&["acquire", "b", "--server", addr], &[]);
    assert_eq!(busy.status.code(), Some(3));
    assert_eq!(
        stderr(&busy),
        "kunci acquire: busy: the server turned the request away: it is at a capacity limit \
         (--max-keys, --max-waiters, --max-waiters-per-key, --max-waits-per-conn) or \
         shutting down; nothing was acquired or queued. Try again later\n"
    );
    let not_held = kunci(&["release", "a", "12", "--server", addr], &[]);
    assert_eq!(not_held.status.code(), Some(6));
    assert_eq!(
        stderr(&not_held),
        "kunci release: not held: token 12 does not hold key \"a\" (its lease ran out, it was \
         released, or it never held it); nothing changed\n"
    );
    // A wrong token is no lost lock: the same message as for release.
    let not_held = kunci(&["renew", "a", "12", "--server", addr], &[]);
    assert_eq!(not_held.status.code(), Some(6));
    assert_eq!(
        stderr(&not_held),
        "kunci renew: not held: token 12 does not hold key \"a\" (its lease ran out, it was \
         released, or it never held it); nothing changed\n"
    );

    // Nothing listens on the port of a server that has stopped.
    let gone = server.addr.clone();
    server.stop();
    let started = Instant::now();
    let ping = kunci(&["ping"], &[("KUNCI_SERVER", &gone)]);
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(ping.status.code(), Some(4));
    assert_eq!(
        stderr(&ping),
        format!(
            "kunci ping: unavailable: no server took the request (tried {gone}) (the last \
             attempt: {gone}: Connection refused (os error 111)); nothing was sent, so \
             nothing changed. Check that kunci serve runs there and lets this host in \
             (--allow, --max-connections); RUST_LOG=debug shows each attempt\n"
        )
    );
    assert!(!stderr(&ping).contains("lock"));
}

#[test]
fn bench_takes_its_server_from_kunci_server() {
    let server = TestServer::start(&[]);
    let output = kunci(
        &[
            "bench",
            "pairs",
            "--connections",
            "2",
            "--duration",
            "0.3",
            "--warmup",
            "0",
            "--json",
        ],
        &[("KUNCI_SERVER", &format!("{},127.0.0.1:1", server.addr))],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json = stdout(&output);
    assert!(
        json.contains(&format!("\"server\":\"{}\"", server.addr)),
        "{json}"
    );
}

#[test]
fn top_prints_a_header_then_gauges_and_rates_per_interval() {
    let server = TestServer::start(&[]);
    let addr = server.addr.as_str();
    assert_eq!(
        kunci(&["acquire", "k", "--server", addr], &[])
            .status
            .code(),
        Some(0)
    );
    let started = Instant::now();
    let output = kunci(
        &["top", "--interval", "0.2", "--count", "3", "--server", addr],
        &[],
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let text = stdout(&output);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert_eq!(
        lines[0],
        "       held       keys    waiters      conns   grants/s timeouts/s     busy/s  expired/s   errors/s"
    );
    let columns =
        |line: &str| -> Vec<String> { line.split_ascii_whitespace().map(str::to_owned).collect() };
    // held 1, keys 1, no waiters, this one connection; nothing happening.
    assert_eq!(
        columns(lines[1]),
        ["1", "1", "0", "1", "-", "-", "-", "-", "-"]
    );
    for line in &lines[2..] {
        assert_eq!(
            columns(line),
            ["1", "1", "0", "1", "0.0", "0.0", "0.0", "0.0", "0.0"]
        );
    }
    let bad = kunci(&["top", "--interval", "0"], &[]);
    assert_eq!(bad.status.code(), Some(2));
    assert_eq!(
        stderr(&bad),
        "kunci top: --interval: at least 0.01 seconds\n(see kunci top --help)\n"
    );
}

/// A pipe (read end, write end), both close-on-exec.
fn pipe() -> (std::fs::File, std::fs::File) {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into `fds`, which we then
    // own exactly once each.
    unsafe {
        assert_eq!(libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC), 0, "pipe2");
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    }
}

/// The server's start-up line (the harness may record it just after it
/// reports the start).
fn first_log_line(server: &TestServer) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(line) = server.log.lock().expect("log").first() {
            return line.clone();
        }
        assert!(Instant::now() < deadline, "no log line");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether `line` starts with an RFC 3339 UTC timestamp with milliseconds.
fn has_timestamp(line: &str) -> bool {
    let bytes = line.as_bytes();
    bytes.len() > 24
        && bytes[..24].iter().enumerate().all(|(i, b)| match i {
            4 | 7 => *b == b'-',
            10 => *b == b'T',
            13 | 16 => *b == b':',
            19 => *b == b'.',
            23 => *b == b'Z',
            _ => b.is_ascii_digit(),
        })
        && bytes[24] == b' '
}

#[test]
fn server_logs_carry_utc_timestamps_unless_stderr_is_the_journal() {
    let server = TestServer::start(&[]);
    let line = first_log_line(&server);
    assert!(has_timestamp(&line), "{line}");
    assert!(
        line[24..].starts_with(&format!(
            " INFO  kunci {} listening on ",
            env!("CARGO_PKG_VERSION")
        )),
        "{line}"
    );
    server.stop();

    // A JOURNAL_STREAM that names another stream (inherited, then stderr
    // redirected) keeps the timestamps.
    let server = TestServer::start_with(&[], |command| {
        command.env("JOURNAL_STREAM", "1:1");
    });
    let line = first_log_line(&server);
    assert!(has_timestamp(&line), "{line}");
    server.stop();

    // stderr really is the stream JOURNAL_STREAM names: no timestamp, a
    // syslog priority instead.
    let (reader, writer) = pipe();
    let stat = writer.metadata().expect("stat pipe");
    let journal_stream = {
        use std::os::unix::fs::MetadataExt;
        format!("{}:{}", stat.dev(), stat.ino())
    };
    let mut child = Command::new(kunci_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--no-state-dir"])
        .env("JOURNAL_STREAM", &journal_stream)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(writer)
        .spawn()
        .expect("spawn kunci serve");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(reader));
    let first = lines.next().expect("a line").expect("UTF-8");
    // SAFETY: kill(2) with our own child's pid.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let _ = child.wait();
    assert!(
        first.starts_with(&format!(
            "<6>kunci {} listening on 127.0.0.1:",
            env!("CARGO_PKG_VERSION")
        )),
        "{first}"
    );
}

#[test]
fn serve_tells_systemd_it_is_ready_once_listening() {
    let dir = std::env::temp_dir().join(format!("kunci-notify-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let socket_path = dir.join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).expect("bind notify socket");
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let server = TestServer::start_with(&[], |command| {
        command.env("NOTIFY_SOCKET", &socket_path);
    });
    let mut message = [0u8; 256];
    let length = socket.recv(&mut message).expect("a readiness datagram");
    assert_eq!(&message[..length], b"READY=1\n");
    // Ready means listening: a client is answered at once.
    assert_eq!(
        kunci(&["ping", "--server", &server.addr], &[])
            .status
            .code(),
        Some(0)
    );
    server.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// The shipped unit file.
fn unit_text() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/contrib/systemd/kunci.service");
    std::fs::read_to_string(path).expect("contrib/systemd/kunci.service")
}

/// The unit's `ExecStart=` command line, continuation lines joined.
fn exec_start(unit: &str) -> Vec<String> {
    let joined = unit.replace("\\\n", " ");
    let line = joined
        .lines()
        .find_map(|line| line.strip_prefix("ExecStart="))
        .expect("an ExecStart= line");
    line.split_ascii_whitespace().map(str::to_owned).collect()
}

#[test]
fn the_unit_file_has_what_the_documentation_promises() {
    let unit = unit_text();
    for line in [
        "Documentation=file:/usr/share/doc/kunci/OPERATIONS.md",
        "Type=notify",
        "StateDirectory=kunci",
        "RuntimeDirectory=kunci",
        "User=kunci",
        "Group=kunci",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "KillSignal=SIGTERM",
    ] {
        assert!(unit.lines().any(|l| l == line), "{line:?} missing");
    }
    assert!(!unit.lines().any(|l| l.starts_with("ExecReload=")));
    // Loopback and a unix socket need no network: the unit does not wait
    // for one (its comment says when to add it).
    assert!(
        !unit
            .lines()
            .any(|l| l.contains("network-online") && !l.starts_with('#'))
    );
    let command = exec_start(&unit);
    assert_eq!(command[..2], ["/usr/bin/kunci", "serve"]);
    for flag in [
        "unix:/run/kunci/kunci.sock",
        "--state-dir",
        "/var/lib/kunci",
    ] {
        assert!(command.iter().any(|a| a == flag), "{flag} in {command:?}");
    }
}

#[test]
fn the_units_command_line_starts_a_server() {
    // The same flags, with the directories systemd would create made here.
    let dir = std::env::temp_dir().join(format!("kunci-unit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("run")).expect("runtime dir");
    std::fs::create_dir_all(dir.join("state")).expect("state dir");
    let run = dir.join("run");
    let state = dir.join("state");
    let arguments: Vec<String> = exec_start(&unit_text())[2..]
        .iter()
        .map(|argument| {
            argument
                .replace("/run/kunci", &run.to_string_lossy())
                .replace("/var/lib/kunci", &state.to_string_lossy())
                .replace("127.0.0.1:5862", "127.0.0.1:0")
        })
        .collect();
    let arguments: Vec<&str> = arguments.iter().map(String::as_str).collect();
    let server = TestServer::start(&arguments);
    let socket = format!("unix:{}/kunci.sock", run.display());
    assert_eq!(server.addresses[1], socket);
    let ping = kunci(&["ping", "--server", &socket], &[]);
    assert_eq!(ping.status.code(), Some(0), "{}", stderr(&ping));
    assert!(state.join("kunci.state").exists());
    server.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_unit_file_passes_systemd_analyze_verify() {
    if !require_tool("systemd-analyze", "systemd") {
        return;
    }
    // verify checks that ExecStart's binary exists: point it at this build.
    let dir = std::env::temp_dir().join(format!("kunci-verify-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let unit = dir.join("kunci.service");
    std::fs::write(&unit, unit_text().replace("/usr/bin/kunci", kunci_bin())).expect("write unit");
    let output = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit)
        .stdin(Stdio::null())
        .output()
        .expect("run systemd-analyze");
    let complaints = String::from_utf8_lossy(&output.stderr).into_owned()
        + &String::from_utf8_lossy(&output.stdout);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(output.status.success(), "{complaints}");
    // Unknown keys and bad values are only warnings: there must be none.
    assert!(
        !complaints.contains("kunci.service"),
        "systemd-analyze verify complains:\n{complaints}"
    );
}

#[test]
fn a_refused_client_speaks_in_kunci_lines_not_logger_lines() {
    let server = TestServer::start(&["--allow", "10.0.0.0/8"]);
    let output = kunci(&["acquire", "k", "--server", &server.addr], &[]);
    // Refused at accept (`X 9`): nothing was executed, so never exit 0.
    assert_ne!(output.status.code(), Some(0));
    let text = stderr(&output);
    assert!(!text.is_empty());
    for line in text.lines() {
        assert!(line.starts_with("kunci"), "{line:?} in:\n{text}");
    }
}

/// Issue 18 "Messages and docs": a usage error is one line that names the
/// part that is wrong, then one hint line; nothing dumps the whole help.
#[test]
fn usage_errors_are_one_line_naming_what_is_wrong_and_one_hint() {
    let cases: [(&[&str], &str); 14] = [
        (
            &["serve", "--allow", "10.0.0.0/33"],
            "kunci serve: --allow: invalid network \"10.0.0.0/33\": prefix length \"33\" is \
             not a number 0..=32\n(see kunci serve --help)\n",
        ),
        (
            &["serve", "--listen", "nohost"],
            "kunci serve: invalid address \"nohost\": no port (expected HOST:PORT, \
             tls://HOST:PORT or unix:PATH)\n(see kunci serve --help)\n",
        ),
        (
            &["acquire", "k", "--server", "db:99999"],
            "kunci acquire: invalid address \"db:99999\": port \"99999\" is not a number \
             0..=65535 (expected HOST:PORT, unix:PATH, tls://HOST:PORT or etcd://HOST:PORT[,...])\n\
             (see kunci acquire --help)\n",
        ),
        (
            &["run", "k", "-E", "300", "--", "true"],
            "kunci run: --conflict-exit-code: 300 is out of range 0..=255\n\
             (see kunci run --help)\n",
        ),
        (
            &["serve", "--max-waiters", "many"],
            "kunci serve: --max-waiters: invalid value \"many\" (a whole number \
             0..=18446744073709551615)\n(see kunci serve --help)\n",
        ),
        (
            &["frobnicate"],
            "kunci: there is no command \"frobnicate\"\n(see kunci help)\n",
        ),
        (
            &["help", "frobnicate"],
            "kunci help: there is no command \"frobnicate\"\n(see kunci help)\n",
        ),
        (
            &["aquire", "k"],
            "kunci: there is no command \"aquire\"; did you mean acquire?\n(see kunci help)\n",
        ),
        (
            &["help", "relase"],
            "kunci help: there is no command \"relase\"; did you mean release?\n\
             (see kunci help)\n",
        ),
        (
            &["secret", "bad name", "info"],
            "kunci secret: name \"bad name\" has a space: a name is one word of printable \
             ASCII, without blanks (such as \"bad-name\")\n(see kunci secret --help)\n",
        ),
        (
            &["acquire", "k", "--wait", "5m"],
            "kunci acquire: --wait: \"5m\" has a unit; it takes seconds: --wait 300\n\
             (see kunci acquire --help)\n",
        ),
        (
            &["run", "k", "--lease", "30s", "--", "true"],
            "kunci run: --lease: \"30s\" has a unit; it takes seconds: --lease 30\n\
             (see kunci run --help)\n",
        ),
        (
            &["bench", "--bogus"],
            "kunci bench: invalid option '--bogus'\n(see kunci bench --help)\n",
        ),
        (
            &["top", "--server", "etcd://127.0.0.1:1"],
            "kunci top: not supported on etcd://: the counters are a kunci server's \
             (etcd's own are in its /metrics)\n(see kunci top --help)\n",
        ),
    ];
    for (args, expected) in cases {
        let output = kunci(args, &[]);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert_eq!(stderr(&output), expected, "{args:?}");
        assert_eq!(stdout(&output), "", "{args:?}");
    }
    // `kunci help help` is the overview; `kunci help bench` has a title.
    let help = kunci(&["help", "help"], &[]);
    assert_eq!(help.status.code(), Some(0));
    assert_eq!(stdout(&help), stdout(&kunci(&["help"], &[])));
    let bench = stdout(&kunci(&["help", "bench"], &[]));
    assert!(bench.starts_with("kunci bench — "), "{bench}");
    // A state directory that is a file says so.
    let not_a_dir = kunci(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            "/etc/passwd",
        ],
        &[],
    );
    assert_eq!(not_a_dir.status.code(), Some(1));
    assert!(
        stderr(&not_a_dir).ends_with(
            "ERROR cannot start: state dir /etc/passwd: not a directory (--state-dir \
             names a directory, created if missing)\n"
        ),
        "{}",
        stderr(&not_a_dir)
    );
}

/// Issue 18: an unreachable etcd member is not a kunci server to check.
#[test]
fn an_unreachable_etcd_member_is_named_as_etcd() {
    let output = kunci(&["query", "k", "--server", "etcd://127.0.0.1:1"], &[]);
    assert_eq!(output.status.code(), Some(4));
    let text = stderr(&output);
    assert!(
        text.starts_with(
            "kunci query: unavailable: no etcd member took the request (tried \
             etcd://127.0.0.1:1); nothing changed. Check that etcd runs there"
        ),
        "{text}"
    );
    assert!(!text.contains("kunci serve"), "{text}");
}

/// Issue 18: the start-up line names `--state-dir`, `--allow` and
/// `--metrics` (a unix socket as one), and a `RUST_LOG` that does not
/// parse is reported instead of silencing the log.
#[test]
fn the_start_up_line_names_every_option_that_shapes_the_server() {
    let dir = crate::util::TempDir::new("start-up-line");
    let state = dir.join("state").display().to_string();
    let metrics = format!("unix:{}", dir.join("metrics.sock").display());
    let server = TestServer::start_with(
        &[
            "--state-dir",
            &state,
            "--allow",
            "127.0.0.0/8",
            "--allow",
            "::1",
            "--metrics",
            &metrics,
        ],
        |command| {
            command.env("RUST_LOG", "infoo");
        },
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    let log = loop {
        let log = server.log.lock().expect("log").clone();
        if log.iter().any(|line| line.contains("listening on")) {
            break log;
        }
        assert!(Instant::now() < deadline, "{log:?}");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(
        log[0].ends_with(
            "WARN  RUST_LOG=\"infoo\": \"infoo\" is neither a level (off, error, warn, info, \
             debug, trace) nor MODULE=LEVEL; logging at info instead"
        ),
        "{log:?}"
    );
    let line = log
        .iter()
        .find(|line| line.contains("listening on"))
        .unwrap();
    let sock = dir.join("metrics.sock").display().to_string();
    assert!(
        line.ends_with(&format!(
            "; state dir {state}; allow 127.0.0.0/8 ::1/128; metrics at unix:{sock} \
             (HTTP: curl --unix-socket {sock} http://localhost/metrics)"
        )),
        "{line}"
    );
}

/// Issue 18: hitting a limit is logged at `warn`, once per limit per
/// minute, naming the flag to change.
#[test]
fn a_limit_hit_is_logged_once_per_limit_per_minute() {
    let server = TestServer::start(&["--max-keys", "1"]);
    let mut peer = server.peer();
    peer.send(&crate::util::acquire(0, 30, 1, "only"));
    crate::util::granted(peer.recv(), 1);
    for owner in 2..6 {
        peer.send(&crate::util::acquire(
            0,
            30,
            owner,
            &format!("more-{owner}"),
        ));
        assert_eq!(peer.recv(), kunci::protocol::Response::Busy { owner });
    }
    let limit_lines = || {
        let log = server.log.lock().expect("log").clone();
        log.into_iter()
            .filter(|line| line.contains("limit reached"))
            .collect::<Vec<_>>()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while limit_lines().is_empty() {
        assert!(Instant::now() < deadline, "no limit line");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Time for any more lines to be written.
    std::thread::sleep(Duration::from_millis(200));
    let lines = limit_lines();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].ends_with(
            " WARN  limit reached: --max-keys (1 key in the table): 1 request answered busy \
             (B); not logged again for this limit within a minute"
        ),
        "{lines:?}"
    );
}

/// The text of a file of the repository.
fn repo_file(path: &str) -> String {
    let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

#[test]
fn the_operations_guide_gives_the_units_stop_timeout_and_network_rule() {
    let unit = unit_text();
    let timeout = unit
        .lines()
        .find(|l| l.starts_with("TimeoutStopSec="))
        .expect("TimeoutStopSec= in the unit");
    let guide = repo_file("docs/OPERATIONS.md");
    let mut mentions = 0;
    for (at, _) in guide.match_indices("TimeoutStopSec=") {
        let said: String = guide[at..]
            .chars()
            .take_while(|c| !c.is_whitespace() && *c != '`')
            .collect();
        assert_eq!(said, timeout, "docs/OPERATIONS.md disagrees with the unit");
        mentions += 1;
    }
    assert!(mentions >= 1);
    // Where the docs install to /usr/local, they say sudo.
    for line in guide.lines().filter(|l| l.contains(" /usr/local/")) {
        let command = line.trim_start_matches(['`', ' ']);
        if command.starts_with("install ") || command.starts_with("mv ") {
            panic!("an install into /usr/local without sudo: {line}");
        }
    }
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces
/// as hyphens.
fn heading_anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The lines of a markdown file outside its fenced code blocks.
fn prose_lines(text: &str) -> Vec<&str> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            lines.push(line);
        }
    }
    lines
}

#[test]
fn every_link_between_the_docs_resolves() {
    let mut files = vec![
        "README.md".to_owned(),
        "clients/python/README.md".to_owned(),
    ];
    let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    for entry in std::fs::read_dir(&docs).expect("docs/") {
        let name = entry.expect("docs/ entry").file_name();
        let name = name.to_string_lossy();
        if name.ends_with(".md") {
            files.push(format!("docs/{name}"));
        }
    }
    let mut checked = 0;
    for file in &files {
        let text = repo_file(file);
        let dir = std::path::Path::new(file).parent().expect("a directory");
        for line in prose_lines(&text) {
            for (at, _) in line.match_indices("](") {
                let rest = &line[at + 2..];
                let Some(end) = rest.find(')') else { continue };
                let target = &rest[..end];
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
                let linked = if path.is_empty() {
                    file.clone()
                } else {
                    dir.join(path).to_string_lossy().into_owned()
                };
                let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(&linked);
                assert!(full.exists(), "{file}: link to {target}: no such file");
                if !anchor.is_empty() {
                    let headings = repo_file(&linked);
                    let found = prose_lines(&headings).iter().any(|l| {
                        l.starts_with('#') && heading_anchor(l.trim_start_matches('#')) == anchor
                    });
                    assert!(found, "{file}: link to {target}: no such heading");
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 20, "only {checked} links found");
}

//! Issue 25, at the edges of a process and a network: what the `kunci`
//! binary prints and how it exits when a secret would go out in clear,
//! when an address can never work or is no kunci server, when a script
//! reads its JSON, and what `kunci run` hands its command.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::util::TempDir;
use crate::util::{TestServer, kunci_bin};

/// A secret a server without `--auth` answers with `U` and no name.
const SECRET: &str = "0123456789abcdef0123456789abcdef";

/// Runs `kunci ARGS` with a clean environment for kunci's variables, plus
/// `env`.
fn kunci(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(kunci_bin());
    command
        .args(args)
        .env_remove("KUNCI_SERVER")
        .env_remove("KUNCI_SECRET")
        .env_remove("KUNCI_ALLOW_PLAINTEXT_SECRET")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("run kunci")
}

/// As [`kunci`], killed after `limit`: a command that never ends fails
/// its test instead of hanging it.
fn kunci_within(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(kunci_bin())
        .args(args)
        .env_remove("KUNCI_SERVER")
        .env_remove("KUNCI_SECRET")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kunci");
    let give_up = Instant::now() + limit;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() >= give_up {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// The server's log once it has a line with `needle`, or after 2 s: the
/// warnings come after the start-up line the server is started on.
fn log_with(server: &TestServer, needle: &str) -> String {
    let give_up = Instant::now() + Duration::from_secs(2);
    loop {
        let log = server.log.lock().unwrap().join("\n");
        if log.contains(needle) || Instant::now() >= give_up {
            return log;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("UTF-8 stdout")
}

fn stderr(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).expect("UTF-8 stderr")
}

/// A TCP listener on loopback that records whatever a client sends.
fn fake_listener() -> (String, std::sync::mpsc::Receiver<Vec<u8>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (caught, seen) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            stream
                .set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            let mut bytes = vec![0; 512];
            let n = stream.read(&mut bytes).unwrap_or(0);
            bytes.truncate(n);
            let _ = caught.send(bytes);
        }
    });
    // 0.0.0.0 reaches this host's listeners, but it is not a loopback
    // address: the client cannot know that a secret sent there stays here.
    (format!("0.0.0.0:{port}"), seen)
}

/// Defect 2: a secret goes only over TLS, to loopback or a unix socket.
/// Elsewhere the CLI refuses before connecting (exit 2), naming the
/// opt-in; with it, the request goes through.
#[test]
fn a_secret_is_not_sent_in_clear_beyond_this_host_without_the_opt_in() {
    let (address, seen) = fake_listener();
    let started = Instant::now();
    let output = kunci(&["info", "--server", &address], &[("KUNCI_SECRET", SECRET)]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(started.elapsed() < Duration::from_secs(2));
    let text = stderr(&output);
    assert!(
        text.contains("--insecure-plaintext-secret")
            && text.contains("KUNCI_ALLOW_PLAINTEXT_SECRET=1"),
        "{text}"
    );
    assert!(
        seen.recv_timeout(Duration::from_millis(300)).is_err(),
        "the secret went out"
    );

    // The opt-in, as a flag and from the environment, against a server.
    let server = TestServer::start(&[]);
    let port = server.addr.rsplit_once(':').unwrap().1;
    let anywhere = format!("0.0.0.0:{port}");
    let output = kunci(
        &["ping", "--insecure-plaintext-secret", "--server", &anywhere],
        &[("KUNCI_SECRET", SECRET)],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let output = kunci(
        &["ping", "--server", &anywhere],
        &[
            ("KUNCI_SECRET", SECRET),
            ("KUNCI_ALLOW_PLAINTEXT_SECRET", "1"),
        ],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    // Loopback by address or by the name `localhost` needs no opt-in.
    for loopback in [server.addr.clone(), format!("localhost:{port}")] {
        let output = kunci(
            &["ping", "--server", &loopback],
            &[("KUNCI_SECRET", SECRET)],
        );
        assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    }
}

/// Defect 2, in the library: `InvalidArgument` before connecting, and the
/// builder option lets it through.
#[test]
fn the_client_library_refuses_a_plaintext_secret_before_connecting() {
    use kunci::client::{Client, Config, Error, Secret};
    let (address, seen) = fake_listener();
    let config = Config {
        secret: Some(Secret::new(SECRET)),
        ..Config::default()
    };
    let client = Client::new([address.parse().unwrap()], config.clone()).unwrap();
    let started = Instant::now();
    match client.ping() {
        Err(Error::InvalidArgument(why)) => {
            assert!(why.contains("allow_plaintext_secret"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(1));
    assert!(seen.recv_timeout(Duration::from_millis(300)).is_err());
    let allowed = config.allow_plaintext_secret(true);
    let client = Client::new([address.parse().unwrap()], allowed).unwrap();
    let _ = client.ping();
    let bytes = seen.recv_timeout(Duration::from_secs(3)).expect("sent");
    assert!(bytes.starts_with(b"U"), "{bytes:?}");
}

/// Defect 2, the server side: `--auth` on a plaintext listener that is
/// neither loopback nor unix warns at start.
#[test]
fn the_server_warns_about_auth_on_a_plaintext_listener_beyond_this_host() {
    let dir = TempDir::new("auth-clear");
    let file = dir.join("auth");
    let line = stdout(&kunci(&["secret", "ci", "lock:*"], &[]));
    std::fs::write(&file, line.lines().nth(1).unwrap()).unwrap();
    let path = file.to_str().unwrap();
    let server = TestServer::start(&["--listen", "0.0.0.0:0", "--auth", path]);
    let log = log_with(&server, "in clear");
    assert!(
        log.contains("WARN") && log.contains("secrets cross the network in clear"),
        "{log}"
    );
    drop(server);
    let quiet = TestServer::start(&["--auth", path]);
    let log = log_with(&quiet, "in clear");
    assert!(!log.contains("in clear"), "{log}");
}

/// Smaller: an empty `--auth` file lets nobody in; the server says so.
#[test]
fn an_empty_auth_file_warns_at_start() {
    let dir = TempDir::new("auth-empty");
    let file = dir.join("auth");
    std::fs::write(&file, "# nobody yet\n").unwrap();
    let server = TestServer::start(&["--auth", file.to_str().unwrap()]);
    let log = log_with(&server, "no identities");
    assert!(
        log.contains("WARN") && log.contains("no identities"),
        "{log}"
    );
}

/// Defect 8: `kunci secret` refuses a scope the server's parser would
/// refuse, and every line it prints parses with that parser.
#[test]
fn kunci_secret_prints_only_lines_the_server_can_read() {
    for scopes in [
        &["lock:ci/ with space"][..],
        &["lock:a\tb"],
        &["read:x\u{a0}"],
    ] {
        let mut args = vec!["secret", "ci"];
        args.extend_from_slice(scopes);
        let output = kunci(&args, &[]);
        assert_eq!(output.status.code(), Some(2), "{scopes:?}: {output:?}");
        args[1] = "#ci";
        args[2] = "lock:ci/";
        let output = kunci(&args, &[]);
        assert_eq!(output.status.code(), Some(2), "{scopes:?}: {output:?}");
        assert!(stdout(&output).is_empty(), "{scopes:?}");
        assert!(stderr(&output).starts_with("kunci secret: "), "{output:?}");
    }
    let output = kunci(&["secret", "ci", "lock:ci/", "read:*", "info"], &[]);
    assert_eq!(output.status.code(), Some(0));
    let line = stdout(&output).lines().nth(1).unwrap().to_owned();
    kunci::core::access::AccessList::parse(&line).expect("the server reads it");
}

/// Defect 9: `kunci run` does not hand its secret to CMD, and its default
/// label names the program without its arguments (`--label-args` adds
/// them).
#[test]
fn kunci_run_keeps_its_secret_and_cmds_arguments_to_itself() {
    let server = TestServer::start(&[]);
    let script = format!(
        "echo \"secret=${{KUNCI_SECRET:-none}}\"; {} who \"$KUNCI_KEY\" --server {} --json",
        kunci_bin(),
        server.addr
    );
    let output = kunci(
        &[
            "run",
            "k9",
            "--server",
            &server.addr,
            "--",
            "sh",
            "-c",
            &script,
            "hunter2",
        ],
        &[("KUNCI_SECRET", SECRET)],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let text = stdout(&output);
    assert!(text.starts_with("secret=none\n"), "{text}");
    assert!(text.contains(" sh\""), "{text}");
    assert!(!text.contains("hunter2") && !text.contains("-c"), "{text}");
    let output = kunci(
        &[
            "run",
            "k9",
            "--label-args",
            "--server",
            &server.addr,
            "--",
            "sh",
            "-c",
            &script,
            "hunter2",
        ],
        &[],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(stdout(&output).contains(" sh -c "), "{}", stdout(&output));
}

/// Smaller: flock's `-w S` and `-n` on `kunci run`.
#[test]
fn kunci_run_takes_flocks_short_wait_options() {
    let server = TestServer::start(&[]);
    let held = kunci(&["acquire", "kf", "--server", &server.addr], &[]);
    assert_eq!(held.status.code(), Some(0));
    let started = Instant::now();
    let output = kunci(
        &[
            "run",
            "-w",
            "1",
            "kf",
            "--server",
            &server.addr,
            "--",
            "true",
        ],
        &[],
    );
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(started.elapsed() >= Duration::from_secs(1));
    let output = kunci(
        &["run", "-n", "kf", "--server", &server.addr, "--", "true"],
        &[],
    );
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let output = kunci(
        &["run", "-n", "free", "--server", &server.addr, "--", "true"],
        &[],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
}

/// Defect 7: 64-bit numbers are strings in `--json` (jq reads them as
/// doubles otherwise), and a cut listing says how much is left out.
#[test]
fn json_carries_tokens_and_owners_as_strings() {
    let server = TestServer::start(&[]);
    let token = stdout(&kunci(&["acquire", "j", "--server", &server.addr], &[]));
    let token = token.trim();
    let json = stdout(&kunci(
        &["who", "j", "--json", "--server", &server.addr],
        &[],
    ));
    assert!(json.contains(&format!("\"token\":\"{token}\"")), "{json}");
    assert!(json.contains("\"owner\":\""), "{json}");
    assert!(json.contains("\"left_out\":0"), "{json}");
}

/// Smaller: `kunci query` says how many grants a key has.
#[test]
fn query_counts_the_grants() {
    let server = TestServer::start(&[]);
    for _ in 0..3 {
        let output = kunci(&["acquire", "q", "--shared", "--server", &server.addr], &[]);
        assert_eq!(output.status.code(), Some(0));
    }
    let text = stdout(&kunci(&["query", "q", "--server", &server.addr], &[]));
    assert!(
        text.starts_with("held token=") && text.ends_with(" grants=3\n"),
        "{text}"
    );
}

/// Smaller: `kunci help top` lists only options `top` takes.
#[test]
fn help_top_lists_only_its_own_options() {
    let help = stdout(&kunci(&["help", "top"], &[]));
    for option in ["--limit", "--label", "--shared", "--wait"] {
        assert!(!help.contains(option), "{option}: {help}");
    }
    assert!(
        help.contains("--interval") && help.contains("--server"),
        "{help}"
    );
}

/// Smaller: a wrong token on `renew` is "not held", not a lost lock.
#[test]
fn renew_with_a_wrong_token_says_not_held() {
    let server = TestServer::start(&[]);
    let output = kunci(&["renew", "r", "12345", "--server", &server.addr], &[]);
    assert_eq!(output.status.code(), Some(6));
    let text = stderr(&output);
    assert!(text.starts_with("kunci renew: not held: "), "{text}");
    assert!(!text.contains("lost"), "{text}");
}

/// Smaller: a semaphore timeout behind a FIFO queue does not blame a
/// holder of the whole key.
#[test]
fn a_semaphore_timeout_says_no_permit_was_free_for_it() {
    let server = TestServer::start(&[]);
    let output = kunci(
        &["acquire", "s", "--limit", "2", "--server", &server.addr],
        &[],
    );
    assert_eq!(output.status.code(), Some(0));
    let output = kunci(
        &[
            "acquire",
            "s",
            "--limit",
            "2",
            "--take",
            "2",
            "--server",
            &server.addr,
        ],
        &[],
    );
    assert_eq!(output.status.code(), Some(1));
    let text = stderr(&output);
    assert!(!text.contains("held by someone else"), "{text}");
    assert!(text.contains("permits"), "{text}");
}

/// Smaller: `who` shows times in one unit.
#[test]
fn who_shows_times_in_seconds_only() {
    let server = TestServer::start(&[]);
    let output = kunci(
        &["acquire", "w", "--lease", "200", "--server", &server.addr],
        &[],
    );
    assert_eq!(output.status.code(), Some(0));
    let text = stdout(&kunci(&["who", "w", "--server", &server.addr], &[]));
    let row = text.lines().nth(2).unwrap();
    assert!(
        row.contains(" 200.000 s ") || row.contains(" 199.9"),
        "{text}"
    );
    assert!(!row.contains('m'), "{text}");
}

/// Defect 6: an address that can never work is a usage error at once,
/// and a comma list means in `--server` what it means in KUNCI_SERVER.
#[test]
fn addresses_that_cannot_work_are_usage_errors() {
    for bad in ["http://127.0.0.1:1", "redis://h:6379"] {
        let started = Instant::now();
        let output = kunci(&["ping", "--server", bad], &[]);
        assert_eq!(output.status.code(), Some(2), "{bad}: {output:?}");
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(stderr(&output).contains("scheme"), "{}", stderr(&output));
    }
    let server = TestServer::start(&[]);
    let list = format!("127.0.0.1:1,{}", server.addr);
    let output = kunci(&["ping", "--server", &list], &[]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
}

/// Defect 5: a peer that speaks something else ends at once, naming it;
/// a TLS port addressed without tls:// says to use it.
#[test]
fn a_peer_that_is_no_kunci_server_ends_at_once() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let _ = stream.write_all(b"-ERR unknown command 'U'\r\n");
        }
    });
    let started = Instant::now();
    let output = kunci_within(
        &["acquire", "k", "--wait", "inf", "--server", &address],
        Duration::from_secs(5),
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(output.status.code(), Some(4), "{output:?}");
    assert!(
        stderr(&output).contains("not a kunci server"),
        "{}",
        stderr(&output)
    );
}

/// Smaller: `--listen` without a port names what a server listens on, and
/// not etcd://.
#[test]
fn a_bad_listen_address_does_not_suggest_etcd() {
    let output = kunci(&["serve", "--listen", "127.0.0.1"], &[]);
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(
        stderr(&output),
        "kunci serve: invalid address \"127.0.0.1\": no port (expected HOST:PORT, \
         tls://HOST:PORT or unix:PATH)\n(see kunci serve --help)\n"
    );
}

/// Defect 6: a connection failure names its last cause: refused, or a
/// name that does not resolve.
#[test]
fn an_unreachable_server_names_the_last_cause() {
    // A port nothing listens on: bound, then let go of.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let address = format!("127.0.0.1:{port}");
    let output = kunci(&["ping", "--server", &address], &[]);
    assert_eq!(output.status.code(), Some(4));
    let text = stderr(&output);
    assert!(
        text.contains(&format!("(the last attempt: {address}: Connection refused")),
        "{text}"
    );
    let output = kunci(&["ping", "--server", "nosuchhost.invalid:1"], &[]);
    assert_eq!(output.status.code(), Some(4));
    let text = stderr(&output);
    assert!(
        text.contains("(the last attempt: nosuchhost.invalid:1: "),
        "{text}"
    );
}

/// A child's stderr lines as they come, each with when it came.
fn stderr_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<(Instant, String)> {
    use std::io::BufRead;
    let stderr = child.stderr.take().expect("piped stderr");
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if sender.send((Instant::now(), line)).is_err() {
                return;
            }
        }
    });
    receiver
}

/// Issue 40: `--wait inf` where no server ever answers keeps waiting, but
/// says so on stderr once 10 s have passed (never earlier), with the
/// address and the last cause; a name that does not resolve gets its own
/// line. `kunci run` and `kunci elect` alike (both wait forever), side by
/// side. (The later words, at doubling gaps, are `Silence`'s unit test.)
#[test]
fn waiting_forever_for_a_server_that_never_answers_says_so_after_10_s() {
    let dir = TempDir::new("never-answers");
    let socket = dir.0.join("nobody.sock");
    let at_socket = format!("unix:{}", socket.display());
    let spawn = |args: &[&str]| {
        Command::new(kunci_bin())
            .args(args)
            .env_remove("KUNCI_SERVER")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run kunci")
    };
    let started = Instant::now();
    let mut run = spawn(&[
        "run", "job", "--wait", "inf", "--server", &at_socket, "--", "true",
    ]);
    let mut elect = spawn(&[
        "elect",
        "chief",
        "me",
        "--server",
        "nosuchhost.invalid:5862",
        "--",
        "true",
    ]);
    let run_lines = stderr_lines(&mut run);
    let elect_lines = stderr_lines(&mut elect);
    let first_word = |lines: &std::sync::mpsc::Receiver<(Instant, String)>| {
        let (at, line) = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("a word within 30 s");
        (at.duration_since(started), line)
    };
    let (after, line) = first_word(&run_lines);
    assert!(after >= Duration::from_secs(10), "{after:?}: {line}");
    assert_eq!(
        line,
        format!(
            "kunci: warning: waiting for \"job\" (--wait inf): no server has answered for \
             10 s (the last attempt: {at_socket}: No such file or directory (os error 2)); \
             still trying"
        )
    );
    let (after, line) = first_word(&elect_lines);
    assert!(after >= Duration::from_secs(10), "{after:?}: {line}");
    assert!(
        line.starts_with(
            "kunci: warning: waiting for \"chief\" (--wait inf): the host name does not \
             resolve: nosuchhost.invalid:5862: "
        ) && line.ends_with(". Check the address (--server, KUNCI_SERVER); still trying"),
        "{line}"
    );
    let (_, line) = first_word(&elect_lines);
    assert!(
        line.starts_with(
            "kunci: warning: waiting for \"chief\" (--wait inf): no server has answered for \
             10 s (the last attempt: nosuchhost.invalid:5862: "
        ),
        "{line}"
    );
    // Still waiting: neither has ended.
    for child in [&mut run, &mut elect] {
        assert!(child.try_wait().unwrap().is_none());
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

/// Issue 40: a refused connection at the only address is said at once,
/// not after the request's 5 s deadline (`--wait inf` aside: it waits).
#[test]
fn a_refusal_at_the_only_address_is_reported_at_once() {
    let dir = TempDir::new("refused");
    let at_socket = format!("unix:{}", dir.0.join("nobody.sock").display());
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let at_port = format!("127.0.0.1:{port}");
    for (address, cause) in [
        (&at_socket, "No such file or directory (os error 2)"),
        (&at_port, "Connection refused (os error 111)"),
    ] {
        for args in [
            &["ping", "--server", address][..],
            &["acquire", "k", "--wait", "30", "--server", address][..],
        ] {
            let started = Instant::now();
            let output = kunci(args, &[]);
            let took = started.elapsed();
            assert_eq!(output.status.code(), Some(4), "{args:?}");
            assert!(took < Duration::from_secs(4), "{args:?}: {took:?}");
            assert!(
                stderr(&output).contains(&format!("(the last attempt: {address}: {cause})")),
                "{}",
                stderr(&output)
            );
        }
    }
}

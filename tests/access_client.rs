//! The official client and the CLI against `kunci serve --auth` (spec §8
//! rule 12, §9, §12.5): the secret goes first on every session, and a
//! refusal is `PermissionDenied` at once, exit code 7.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kunci::client::{Client, Config, Denied, Error, Secret};

use crate::access::{EVERYTHING, INFO, LOCKER, READER};
use crate::access_server::auth_dir;
use crate::util::{TestServer, kunci_bin};

/// Far below the 5 s transport deadline that a retried request would run
/// into.
const AT_ONCE: Duration = Duration::from_secs(2);

fn client(server: &TestServer, secret: Option<&[u8]>) -> Client {
    let config = Config {
        secret: secret.map(Secret::new),
        ..Config::default()
    };
    // The same server twice: a refused secret is not tried on another
    // address either.
    let address = server.addr.parse().unwrap();
    Client::new([address, server.addr.parse().unwrap()], config).unwrap()
}

#[test]
fn a_refused_secret_is_permission_denied_at_once() {
    let (_dir, path) = auth_dir("auth-client-x12");
    let server = TestServer::start(&["--auth", &path]);
    let wrong = b"0123456789abcdef0123456789abcdef";
    for secret in [None, Some(&wrong[..])] {
        let client = client(&server, secret);
        let started = Instant::now();
        let result = client.acquire("app/a", Duration::from_secs(3), Duration::from_secs(30));
        assert_eq!(
            result.unwrap_err(),
            Error::PermissionDenied(Denied::NotAuthenticated)
        );
        assert!(started.elapsed() < AT_ONCE, "{:?}", started.elapsed());
        let started = Instant::now();
        assert_eq!(
            client.ping().unwrap_err(),
            Error::PermissionDenied(Denied::NotAuthenticated)
        );
        assert!(started.elapsed() < AT_ONCE);
    }
    let root = client(&server, Some(EVERYTHING));
    assert!(root.query("app/a").unwrap().is_free());
}

#[test]
fn scopes_outside_the_secret_are_permission_denied_and_the_rest_works() {
    let (_dir, path) = auth_dir("auth-client-x13");
    let server = TestServer::start(&["--auth", &path]);
    let locker = client(&server, Some(LOCKER));
    let started = Instant::now();
    let not_permitted = Err(Error::PermissionDenied(Denied::NotPermitted));
    assert_eq!(
        locker
            .acquire("other", Duration::from_secs(3), Duration::from_secs(30))
            .map(|_| ()),
        not_permitted
    );
    assert_eq!(locker.info().map(drop), not_permitted);
    assert!(started.elapsed() < AT_ONCE);
    let ticket = locker
        .acquire("app/a", Duration::ZERO, Duration::from_secs(30))
        .unwrap();
    locker.ping().unwrap();
    let reader = client(&server, Some(READER));
    assert_eq!(reader.query("app/a").unwrap().token, ticket.token());
    assert_eq!(reader.release("app/a", ticket.token()), not_permitted);
    let keys: Vec<String> = reader.keys("").map(|key| key.unwrap().key).collect();
    assert_eq!(keys, ["app/a"]);
    ticket.release().unwrap();
    let short = client(&server, Some(&LOCKER[..31]));
    assert!(matches!(short.ping(), Err(Error::InvalidArgument(_))));
}

fn kunci(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(kunci_bin());
    command
        .args(args)
        .env_remove("KUNCI_SECRET")
        .env_remove("KUNCI_SERVER");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().unwrap()
}

#[test]
fn client_commands_take_a_secret_and_exit_7_when_refused() {
    let (dir, path) = auth_dir("auth-cli");
    let server = TestServer::start(&["--auth", &path]);
    let locker_file = dir.join("locker");
    std::fs::write(&locker_file, [LOCKER, b"\n"].concat()).unwrap();
    let locker_file = locker_file.to_str().unwrap();
    let server_arg = ["--server", &server.addr];
    let with = |args: &[&str], env: &[(&str, &str)]| {
        // After the command's name: `run` takes everything after `--`.
        let mut all = vec![args[0]];
        all.extend_from_slice(&server_arg);
        all.extend_from_slice(&args[1..]);
        kunci(&all, env)
    };
    let started = Instant::now();
    let refused = with(&["acquire", "app/a"], &[]);
    assert_eq!(refused.status.code(), Some(7), "{refused:?}");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("permission denied"), "{stderr}");
    assert!(started.elapsed() < AT_ONCE);

    let taken = with(&["acquire", "app/a", "--secret-file", locker_file], &[]);
    assert_eq!(taken.status.code(), Some(0), "{taken:?}");
    let token = String::from_utf8(taken.stdout).unwrap().trim().to_owned();
    // --secret-file wins over KUNCI_SECRET.
    let wrong = "wrong-secret-wrong-secret-wrong-secret";
    let released = with(
        &["release", "app/a", &token, "--secret-file", locker_file],
        &[("KUNCI_SECRET", wrong)],
    );
    assert_eq!(released.status.code(), Some(0), "{released:?}");
    let reader = std::str::from_utf8(READER).unwrap();
    let info = std::str::from_utf8(INFO).unwrap();
    let cases: [(&[&str], &str, i32); 9] = [
        (&["acquire", "app/b"], wrong, 7),
        (&["acquire", "app/b"], reader, 7),
        (&["query", "app/b"], reader, 0),
        (&["info"], reader, 7),
        (&["info"], info, 0),
        (&["who", "app/b"], info, 7),
        (&["list"], reader, 0),
        (&["ping"], "short", 2),
        (&["run", "app/b", "--", "touch", "ran"], reader, 7),
    ];
    for (args, secret, code) in cases {
        let output = with(args, &[("KUNCI_SECRET", secret)]);
        assert_eq!(output.status.code(), Some(code), "{args:?}: {output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains(secret) || secret == "short", "{stderr}");
    }
    assert!(!std::path::Path::new("ran").exists());
    let top = with(&["top", "--count", "1"], &[("KUNCI_SECRET", info)]);
    assert_eq!(top.status.code(), Some(0), "{top:?}");
    let missing = with(&["ping", "--secret-file", "/nonexistent/secret"], &[]);
    assert_eq!(missing.status.code(), Some(2));
}

#[test]
fn bench_sends_the_secret_on_every_connection() {
    let (_dir, path) = auth_dir("auth-bench");
    let server = TestServer::start(&["--auth", &path]);
    let root = std::str::from_utf8(EVERYTHING).unwrap();
    let args = [
        "bench",
        "pairs",
        "--server",
        &server.addr,
        "--connections",
        "3",
        "--duration",
        "0.3",
        "--warmup",
        "0",
    ];
    let output = kunci(&args, &[("KUNCI_SECRET", root)]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(!text.contains("X 12"), "{text}");
    let info = server.info_with(EVERYTHING);
    assert_eq!(info["auth_failures"], "0");
    assert_ne!(info["grants"], "0");
}

//! Permits and labels (spec §10, §11) as the official client and the CLI
//! put them on the wire, and the outcomes they make of the answers —
//! against a scripted server, so that every answer can be chosen.

use std::process::Output;
use std::time::Duration;

use kunci::client::{AcquireOptions, Client, Config, Error, Permits};
use kunci::protocol::{Request, Response};

use crate::util::scripted::Scripted;
use crate::util::{decoded, kunci, kunci_command};

const S: Duration = Duration::from_secs(1);

/// Grants every acquire (token 500 + its take) and releases every release.
fn granting() -> Scripted {
    Scripted::start(|request| match *request {
        Request::Acquire { owner, take, .. } => vec![Response::Acquired {
            owner,
            token: 500 + u64::from(take),
        }],
        Request::Release { token, .. } => vec![Response::Released { token }],
        _ => vec![],
    })
}

/// Answers every acquire with `X 10` naming limit 3.
fn mismatching() -> Scripted {
    Scripted::start(|request| match *request {
        Request::Acquire { owner, .. } => vec![Response::limit_mismatch(owner, 3)],
        _ => vec![],
    })
}

fn client(server: &Scripted) -> Client {
    Client::new([server.addr.parse().unwrap()], Config::default()).unwrap()
}

#[test]
fn a_plain_lock_goes_as_a_and_permits_or_a_label_as_s() {
    let server = granting();
    let client = client(&server);
    let cases: [(AcquireOptions, u8, u16, u16, &str); 6] = [
        (AcquireOptions::new(), b'A', 0, 0, ""),
        (Permits::exclusive().into(), b'A', 0, 0, ""),
        (
            AcquireOptions::new().label("ci job 7"),
            b'S',
            0,
            0,
            "ci job 7",
        ),
        (Permits::shared().into(), b'S', 65535, 1, ""),
        (
            AcquireOptions::new()
                .permits(Permits::limit(3).take(2))
                .label("é"),
            b'S',
            3,
            2,
            "é",
        ),
        (Permits::limit(5).take(0).into(), b'S', 5, 0, ""),
    ];
    for (options, op, limit, take, label) in cases.clone() {
        let permits = options.get_permits();
        let ticket = client.acquire_with("k", 2 * S, 30 * S, options).unwrap();
        assert_eq!(ticket.permits(), permits);
        assert_eq!(ticket.token(), 500 + u64::from(take));
        let frames = server.frames();
        let frame = frames.last().unwrap();
        assert_eq!(frame[0], op, "{permits}");
        let Request::Acquire {
            wait_s,
            lease_s,
            key,
            limit: sent_limit,
            take: sent_take,
            label: sent_label,
            ..
        } = decoded(frame)
        else {
            panic!("{frame:?}");
        };
        assert_eq!(
            (wait_s, lease_s, key, sent_limit, sent_take, sent_label),
            (2, 30, "k", limit, take, label)
        );
        ticket.release().unwrap();
    }
    // `acquire` is exclusive without a label: byte for byte the `A` of old.
    let ticket = client.acquire("k", Duration::ZERO, 30 * S).unwrap();
    let frames = server.frames();
    let frame = frames.last().unwrap();
    let owner = u64::from_be_bytes(frame[3..11].try_into().unwrap());
    assert_eq!(*frame, crate::util::acquire(0, 30, owner, "k"));
    assert_eq!(ticket.permits(), Permits::exclusive());
    ticket.release().unwrap();
}

#[test]
fn invalid_permits_or_labels_are_invalid_arguments_and_nothing_is_sent() {
    let server = granting();
    let client = client(&server);
    let cases: [(AcquireOptions, &str); 6] = [
        (
            Permits::limit(0).into(),
            "a count of permits to take needs a limit",
        ),
        (
            Permits::exclusive().take(1).into(),
            "a count of permits to take needs a limit",
        ),
        (
            Permits::limit(3).take(4).into(),
            "cannot take more permits than the limit",
        ),
        (
            Permits::limit(1).take(65535).into(),
            "cannot take more permits than the limit",
        ),
        (
            AcquireOptions::new().label("l".repeat(129)),
            "label is longer than 128 bytes",
        ),
        (
            AcquireOptions::new().label("two\nlines"),
            "label contains a newline",
        ),
    ];
    for (options, why) in cases {
        assert_eq!(
            client.acquire_with("k", S, 30 * S, options).unwrap_err(),
            Error::InvalidArgument(why)
        );
    }
    // The limit of the label is in bytes: 64 two-byte characters fit.
    client
        .acquire_with("k", S, 30 * S, AcquireOptions::new().label("é".repeat(64)))
        .unwrap()
        .release()
        .unwrap();
    let frames = server.frames();
    assert_eq!(frames.len(), 2, "only the valid acquire and its release");
    assert_eq!(frames[0][0], b'S');
}

#[test]
fn x10_is_a_definitive_limit_mismatch_naming_the_keys_limit() {
    let server = mismatching();
    let client = client(&server);
    let error = client
        .acquire_with("k", S, 30 * S, Permits::limit(4))
        .unwrap_err();
    assert_eq!(error, Error::LimitMismatch { key_limit: Some(3) });
    assert_eq!(
        error.to_string(),
        "limit mismatch: the key has a limit of 3 permits; nothing was acquired"
    );
    // One request, never sent again.
    assert_eq!(server.frames().len(), 1);
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn cli_permit_options_reach_the_wire() {
    let server = granting();
    for (args, op, limit, take) in [
        (&[][..], b'A', 0, 0),
        (&["--exclusive"], b'A', 0, 0),
        (&["--shared"], b'S', 65535, 1),
        (&["--limit", "3"], b'S', 3, 1),
        (&["--limit", "3", "--take", "2"], b'S', 3, 2),
        (&["--limit", "4", "--exclusive"], b'S', 4, 0),
    ] {
        let mut full = vec!["acquire", "k"];
        full.extend_from_slice(args);
        let output = kunci(&server.addr, &full);
        assert_eq!(
            output.status.code(),
            Some(0),
            "{args:?}: {}",
            stderr(&output)
        );
        assert_eq!(
            String::from_utf8_lossy(&output.stdout).trim(),
            (500 + take).to_string()
        );
        let frames = server.frames();
        let frame = frames.last().unwrap();
        assert_eq!(frame[0], op, "{args:?}");
        let Request::Acquire {
            limit: sent_limit,
            take: sent_take,
            label,
            ..
        } = decoded(frame)
        else {
            panic!()
        };
        assert_eq!(
            (sent_limit, sent_take, label),
            (limit, take, ""),
            "{args:?}"
        );
    }
    let output = kunci(&server.addr, &["acquire", "k", "--label", "deploy 42"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let frames = server.frames();
    let Request::Acquire { label, .. } = decoded(frames.last().unwrap()) else {
        panic!()
    };
    assert_eq!(label, "deploy 42");
}

#[test]
fn cli_contradicting_permit_options_are_usage_errors_before_any_connection() {
    let server = granting();
    let long_label = "l".repeat(129);
    for (args, message) in [
        (&["--take", "2"][..], "--take needs --limit"),
        (&["--shared", "--limit", "3"], "--shared is a lock of 65535"),
        (&["--shared", "--take", "1"], "--shared is a lock of 65535"),
        (&["--shared", "--exclusive"], "--shared and --exclusive"),
        (
            &["--limit", "3", "--take", "4"],
            "--take 4 is more than --limit 3",
        ),
        (&["--limit", "0"], "--limit: a semaphore needs at least 1"),
        (
            &["--label", &long_label],
            "--label: 129 bytes is longer than 128",
        ),
    ] {
        for command in [&["acquire", "k"][..], &["run", "k"]] {
            let mut full = command.to_vec();
            full.extend_from_slice(args);
            if command[0] == "run" {
                full.extend_from_slice(&["--", "true"]);
            }
            let output = kunci(&server.addr, &full);
            assert_eq!(output.status.code(), Some(2), "{full:?}");
            assert!(
                stderr(&output).contains(message),
                "{full:?}: {}",
                stderr(&output)
            );
        }
    }
    // Permit options belong to acquire and run only.
    let output = kunci(&server.addr, &["query", "k", "--shared"]);
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(server.accepted(), 0);
}

#[test]
fn cli_limit_mismatch_exits_2_naming_the_keys_limit() {
    let server = mismatching();
    for command in [
        &["acquire", "k", "--limit", "4"][..],
        &["run", "k", "--limit", "4", "--", "true"],
    ] {
        let output = kunci(&server.addr, command);
        assert_eq!(output.status.code(), Some(2), "{command:?}");
        let text = stderr(&output);
        assert!(
            text.starts_with(&format!(
                "kunci {}: limit mismatch: key \"k\" has a limit of 3 permits",
                command[0]
            )),
            "{text}"
        );
        assert!(text.contains("--limit 3"), "{text}");
    }
}

#[test]
fn run_labels_its_grant_with_user_host_pid_and_command() {
    let server = granting();
    let output = kunci_command(&server.addr, &["run", "k", "--", "sh", "-c", "exit 0"])
        .env("USER", "tester")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let frames = server.frames();
    let Request::Acquire { label, take, .. } = decoded(&frames[0]) else {
        panic!()
    };
    assert_eq!(take, 0);
    // kunci's own pid: not known here, so check the shape around it.
    let (head, tail) = label.split_once(" pid=").unwrap();
    assert!(
        head.starts_with("tester@") && head.len() > "tester@".len(),
        "{label}"
    );
    let (pid, command) = tail.split_once(' ').unwrap();
    assert!(pid.parse::<u32>().is_ok(), "{label}");
    // The program only: arguments may carry secrets (--label-args).
    assert_eq!(command, "sh");
    // A long command is cut to 128 bytes at a character boundary; --label
    // replaces the default.
    let long = "é".repeat(100);
    let output = kunci(
        &server.addr,
        &["run", "k", "--label-args", "--", "true", &long],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let output = kunci(&server.addr, &["run", "k", "--label", "mine", "--", "true"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let labels: Vec<String> = server
        .frames()
        .iter()
        .filter(|frame| frame[0] == b'S')
        .map(|frame| match decoded(frame) {
            Request::Acquire { label, .. } => label.to_owned(),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(labels.len(), 3);
    assert!(
        labels[1].len() <= 128 && labels[1].len() >= 127,
        "{}",
        labels[1]
    );
    assert!(labels[1].ends_with('é') && labels[1].contains(" true é"));
    assert_eq!(labels[2], "mine");
}

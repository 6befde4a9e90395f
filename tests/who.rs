//! Who holds a key and which keys exist (spec §11) as the official client
//! and the CLI ask for them and show them, and the clean-up after an
//! indeterminate acquire (spec §8 rule 11) — against a scripted server
//! that keeps a small lock table, so that every answer is known.

use std::collections::BTreeMap;
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kunci::client::{Client, Config, Error, Grant, Holders, KeySummary, Waiter};
use kunci::protocol::{Request, Response};

use crate::util::proxy::{Faults, Proxy};
use crate::util::scripted::Scripted;
use crate::util::{decoded, kunci, kunci_command};

const MS: Duration = Duration::from_millis(1);
const S: Duration = Duration::from_secs(1);

/// One grant of the scripted table.
#[derive(Clone)]
struct Held {
    token: u64,
    owner: u64,
    take: u16,
    label: String,
}

/// A lock table just big enough for these tests: every acquire is
/// granted at once (token 100, 101, …), `R` removes the grant, `H` lists
/// the grants (lease 30 s, held 1.5 s) and one waiter on `queued`, `L`
/// pages through the keys two at a time (the cursor is the index of the
/// next key).
#[derive(Default)]
struct Table {
    keys: BTreeMap<String, Vec<Held>>,
    next_token: u64,
}

fn table_server() -> (Scripted, Arc<Mutex<Table>>) {
    let table = Arc::new(Mutex::new(Table {
        next_token: 100,
        ..Table::default()
    }));
    let state = table.clone();
    let server = Scripted::start(move |request| {
        let mut table = state.lock().unwrap();
        match *request {
            Request::Acquire {
                owner,
                key,
                take,
                label,
                ..
            } => {
                let token = table.next_token;
                table.next_token += 1;
                table.keys.entry(key.into()).or_default().push(Held {
                    token,
                    owner,
                    take,
                    label: label.into(),
                });
                vec![Response::Acquired { owner, token }]
            }
            Request::Release { token, key } => {
                let grants = table.keys.entry(key.into()).or_default();
                let before = grants.len();
                grants.retain(|held| held.token != token);
                let released = grants.len() < before;
                if grants.is_empty() {
                    table.keys.remove(key);
                }
                vec![if released {
                    Response::Released { token }
                } else {
                    Response::NotHeld { token }
                }]
            }
            Request::Holders { id, key } => {
                let mut out: Vec<Response> = table
                    .keys
                    .get(key)
                    .into_iter()
                    .flatten()
                    .map(|held| Response::Grant {
                        id,
                        token: held.token,
                        owner: held.owner,
                        lease_ms: 30_000,
                        held_ms: 1_500,
                        take: held.take,
                        label: held.label.clone(),
                    })
                    .collect();
                if key == "queued" {
                    out.push(Response::Waiter {
                        id,
                        owner: 5,
                        wait_ms: 2_001,
                        take: 1,
                        label: "next in line".into(),
                    });
                }
                let count = out.len() as u32;
                out.push(Response::End { id, count, next: 0 });
                out
            }
            Request::List {
                id, cursor, prefix, ..
            } => {
                let matching: Vec<(&String, &Vec<Held>)> = table
                    .keys
                    .iter()
                    .filter(|(key, _)| key.starts_with(prefix))
                    .collect();
                let from = cursor as usize;
                let page: Vec<Response> = matching
                    .iter()
                    .skip(from)
                    .take(2)
                    .map(|(key, grants)| Response::Key {
                        id,
                        grants: grants.len() as u32,
                        waiters: 0,
                        limit: 7,
                        key: (*key).clone(),
                    })
                    .collect();
                let next = if from + 2 < matching.len() {
                    (from + 2) as u64
                } else {
                    0
                };
                let count = page.len() as u32;
                let mut out = page;
                out.push(Response::End { id, count, next });
                out
            }
            _ => vec![],
        }
    });
    (server, table)
}

fn client(addr: &str) -> Client {
    Client::new([addr.parse().unwrap()], Config::default()).unwrap()
}

#[test]
fn holders_lists_grants_and_waiters_with_their_labels_byte_exact() {
    let (server, _) = table_server();
    let client = client(&server.addr);
    let label = "ünïcødé \"label\" \\ 🔒";
    let ticket = client
        .acquire_with(
            "queued",
            Duration::ZERO,
            30 * S,
            kunci::client::AcquireOptions::new().label(label),
        )
        .unwrap();
    let holders = client.holders("queued").unwrap();
    assert_eq!(
        holders,
        Holders {
            grants: vec![Grant {
                token: ticket.token(),
                owner: holders.grants[0].owner,
                take: 0,
                lease_left: 30 * S,
                held_for: 1500 * MS,
                label: label.into(),
            }],
            waiters: vec![Waiter {
                owner: 5,
                take: 1,
                wait_left: 2001 * MS,
                label: "next in line".into(),
            }],
            left_out: 0,
        }
    );
    // The `H` frame, byte for byte: `H id key \n`, its id fresh.
    let frames = server.frames();
    let frame = frames.last().unwrap();
    let Request::Holders { id, key } = decoded(frame) else {
        panic!("{frame:?}")
    };
    assert_eq!(key, "queued");
    let mut expected = vec![b'H'];
    expected.extend_from_slice(&id.to_be_bytes());
    expected.extend_from_slice(b"queued\n");
    assert_eq!(*frame, expected);
    assert!(client.holders("nobody").unwrap().is_free());
    // Input is checked before anything is sent.
    let sent = server.frames().len();
    assert_eq!(
        client.holders(""),
        Err(Error::InvalidArgument("key is empty"))
    );
    assert_eq!(
        client.list_keys("a\nb", 0, 10),
        Err(Error::InvalidArgument("prefix contains a newline"))
    );
    assert_eq!(
        client.list_keys("", 0, 1001),
        Err(Error::InvalidArgument("count must be 1..=1000"))
    );
    assert_eq!(server.frames().len(), sent);
    ticket.release().unwrap();
}

#[test]
fn keys_follows_the_cursor_to_the_end() {
    let (server, _) = table_server();
    let client = client(&server.addr);
    let mut tickets = Vec::new();
    for key in ["jobs/a", "jobs/b", "jobs/c", "jobs/d", "jobs/e", "other"] {
        tickets.push(client.acquire(key, Duration::ZERO, 30 * S).unwrap());
    }
    let keys: Vec<KeySummary> = client.keys("jobs/").map(Result::unwrap).collect();
    let names: Vec<&str> = keys.iter().map(|key| key.key.as_str()).collect();
    assert_eq!(names, ["jobs/a", "jobs/b", "jobs/c", "jobs/d", "jobs/e"]);
    assert!(keys.iter().all(|key| key.grants == 1 && key.limit == 7));
    // Three pages: cursors 0, 2, 4, each asking for 1000 keys.
    let lists: Vec<(u64, u16, String)> = server
        .frames()
        .iter()
        .filter(|frame| frame[0] == b'L')
        .map(|frame| match decoded(frame) {
            Request::List {
                cursor,
                count,
                prefix,
                ..
            } => (cursor, count, prefix.to_owned()),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(
        lists,
        [
            (0, 1000, "jobs/".into()),
            (2, 1000, "jobs/".into()),
            (4, 1000, "jobs/".into())
        ]
    );
    assert_eq!(client.keys("").count(), 6);
    assert_eq!(client.keys("none/").count(), 0);
    // One page by hand.
    let page = client.list_keys("", 2, 5).unwrap();
    assert_eq!(page.next, 4);
    assert_eq!(page.keys[0].key, "jobs/c");
}

/// A proxy in front of `server` that drops the next answer, a client
/// through it and a client straight to the server.
fn losing_the_next_answer(server: &str) -> (Proxy, Client, Client) {
    let proxy = Proxy::start(server);
    proxy.set_faults(Faults {
        drop_answers: 1,
        ..Faults::default()
    });
    let faulty = client(&proxy.addr);
    let direct = client(server);
    (proxy, faulty, direct)
}

/// Rule 11: a grant whose answer was lost is found by `H` and released,
/// long before its lease would end.
#[test]
fn an_acquire_whose_grant_was_lost_is_cleaned_up_through_holders() {
    let (server, table) = table_server();
    // The next answer — the grant — never reaches the faulty client.
    let (proxy, faulty, direct) = losing_the_next_answer(&server.addr);
    // Another grant of the same key, which the clean-up leaves alone.
    let other = direct
        .acquire_with(
            "nightly",
            Duration::ZERO,
            60 * S,
            kunci::client::Permits::shared(),
        )
        .unwrap();
    let started = Instant::now();
    let outcome = faulty.acquire_with(
        "nightly",
        Duration::ZERO,
        60 * S,
        kunci::client::Permits::shared(),
    );
    assert_eq!(outcome.unwrap_err(), Error::Indeterminate);
    let lost = proxy
        .forwarded()
        .iter()
        .find(|frame| frame.op == b'S')
        .map(|frame| frame.id)
        .expect("the acquire reached the server");
    let deadline = Instant::now() + 2 * S;
    loop {
        let owners: Vec<u64> = table.lock().unwrap().keys["nightly"]
            .iter()
            .map(|held| held.owner)
            .collect();
        if !owners.contains(&lost) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the lost grant was not released: {owners:?}"
        );
        std::thread::sleep(5 * MS);
    }
    let elapsed = started.elapsed();
    assert!(elapsed < 6 * S + 500 * MS, "{elapsed:?}");
    // The clean-up asked `H` (its id the lost call's owner), then released
    // exactly the lost grant; the other holder keeps its grant.
    let after: Vec<(u8, u64)> = proxy
        .forwarded()
        .iter()
        .filter(|frame| frame.op != b'S')
        .map(|frame| (frame.op, frame.id))
        .collect();
    assert_eq!(after.len(), 2, "{after:?}");
    assert_eq!(after[0], (b'H', lost));
    assert_eq!(after[1].0, b'R');
    assert_ne!(after[1].1, other.token());
    let holders = direct.holders("nightly").unwrap();
    assert_eq!(holders.grants.len(), 1);
    assert_eq!(holders.grants[0].token, other.token());
    other.release().unwrap();
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("stdout is UTF-8")
}

#[test]
fn cli_who_shows_a_table_or_one_json_object() {
    let (server, _) = table_server();
    let client = client(&server.addr);
    let ticket = client
        .acquire_with(
            "queued",
            Duration::ZERO,
            30 * S,
            kunci::client::AcquireOptions::new()
                .permits(kunci::client::Permits::limit(7).take(2))
                .label("bob@h2 pid=9 \"x\"\t→"),
        )
        .unwrap();
    let owner = client.holders("queued").unwrap().grants[0].owner;
    let output = kunci(&server.addr, &["who", "queued"]);
    assert_eq!(output.status.code(), Some(0));
    let token = ticket.token();
    let token_width = token.to_string().len().max(5);
    let owner_width = owner.to_string().len().max(5);
    assert_eq!(
        stdout(&output),
        format!(
            "queued: limit 7, 1 grant, 1 waiter\n\
             {:<token_width$}  {:<owner_width$}  TAKE  LEASE LEFT  HELD FOR  LABEL\n\
             {token:<token_width$}  {owner:<owner_width$}  2     30.000 s    1.500 s   bob@h2 pid=9 \"x\"\\t→\n\
             waiting, next first:\n\
             #  OWNER  TAKE  WAIT LEFT  LABEL\n\
             1  5      1     2.001 s    next in line\n",
            "TOKEN", "OWNER"
        )
    );
    let output = kunci(&server.addr, &["who", "queued", "--json"]);
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        stdout(&output),
        format!(
            "{{\"key\":\"queued\",\"limit\":7,\"left_out\":0,\"grants\":[{{\"token\":\"{token}\",\"owner\":\"{owner}\",\
             \"lease_ms\":30000,\"held_ms\":1500,\"take\":2,\"label\":\"bob@h2 pid=9 \\\"x\\\"\\u0009→\"}}],\
             \"waiters\":[{{\"owner\":\"5\",\"wait_ms\":2001,\"take\":1,\"label\":\"next in line\"}}]}}\n"
        )
    );
    let output = kunci(&server.addr, &["who", "nobody"]);
    assert_eq!(stdout(&output), "nobody: free (no grants, no waiters)\n");
    let output = kunci(&server.addr, &["who", "nobody", "--json"]);
    assert_eq!(
        stdout(&output),
        "{\"key\":\"nobody\",\"limit\":0,\"left_out\":0,\"grants\":[],\"waiters\":[]}\n"
    );
    ticket.release().unwrap();
}

#[test]
fn cli_list_prints_one_line_per_key_across_pages() {
    let (server, _) = table_server();
    let client = client(&server.addr);
    let mut tickets = Vec::new();
    for key in ["a", "b c", "d\"é", "e", "f"] {
        tickets.push(client.acquire(key, Duration::ZERO, 30 * S).unwrap());
    }
    let output = kunci(&server.addr, &["list"]);
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        stdout(&output),
        "a  grants=1 waiters=0 limit=7\n\
         b c  grants=1 waiters=0 limit=7\n\
         d\"é  grants=1 waiters=0 limit=7\n\
         e  grants=1 waiters=0 limit=7\n\
         f  grants=1 waiters=0 limit=7\n"
    );
    let output = kunci(&server.addr, &["list", "d", "--json"]);
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        stdout(&output),
        "{\"key\":\"d\\\"é\",\"grants\":1,\"waiters\":0,\"limit\":7}\n"
    );
    let output = kunci(&server.addr, &["list", "zzz"]);
    assert_eq!(
        (output.status.code(), stdout(&output)),
        (Some(0), "".into())
    );
}

#[test]
fn cli_who_and_list_exit_codes() {
    let (server, _) = table_server();
    // Usage errors, before any connection.
    for args in [
        &["who"][..],
        &["who", "a", "b"],
        &["list", "a", "b"],
        &["who", "k", "--wait", "1"],
        &["list", "--shared"],
    ] {
        let output = kunci(&server.addr, args);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
    }
    // etcd mode answers them too (docs/ETCD.md): an etcd member that is
    // not there is unavailable, and named as etcd. And where nobody
    // listens: unavailable. Each waits for its deadline (5 s), so the four
    // run at once.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = dead.local_addr().unwrap().to_string();
    drop(dead);
    let unavailable: Vec<_> = [
        ("etcd://127.0.0.1:1", &["who", "k"][..]),
        ("etcd://127.0.0.1:1", &["list"]),
        (addr.as_str(), &["who", "k"]),
        (addr.as_str(), &["list"]),
    ]
    .into_iter()
    .map(|(server, args)| {
        let child = kunci_command(server, args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run kunci");
        (server.starts_with("etcd://"), args, child)
    })
    .collect();
    for (etcd, args, child) in unavailable {
        let output = child.wait_with_output().unwrap();
        assert_eq!(output.status.code(), Some(4), "{args:?}");
        if etcd {
            let text = String::from_utf8_lossy(&output.stderr);
            assert!(text.contains("no etcd member"), "{text}");
        }
    }
    assert_eq!(server.accepted(), 0);
}

// ------------------------------------------------- against a real server

/// Rule 11 end to end: the grant's answer is lost on the way, the call
/// ends `Indeterminate` at its deadline, and the key is free again at
/// once, not 60 s later when the lease would end.
#[test]
fn a_lost_grant_frees_the_key_long_before_its_lease_against_a_real_server() {
    let server = crate::util::TestServer::start(&[]);
    let (proxy, faulty, direct) = losing_the_next_answer(&server.addr);
    let outcome = faulty.acquire("orphan", Duration::ZERO, 60 * S);
    assert_eq!(outcome.unwrap_err(), Error::Indeterminate);
    let indeterminate_at = Instant::now();
    let granted = proxy
        .answers()
        .iter()
        .any(|answer| matches!(answer, Response::Acquired { .. }));
    assert!(!granted, "the grant was to be dropped");
    let deadline = indeterminate_at + 2 * S;
    while !direct.holders("orphan").unwrap().is_free() {
        assert!(
            Instant::now() < deadline,
            "the lost grant still holds the key"
        );
        std::thread::sleep(5 * MS);
    }
    // A new acquire gets it at once.
    direct
        .acquire("orphan", Duration::ZERO, 5 * S)
        .unwrap()
        .release()
        .unwrap();
}

#[test]
fn who_shows_run_s_default_label_and_the_queue_in_order_against_a_real_server() {
    let server = crate::util::TestServer::start(&[]);
    let mut run = kunci_command(
        &server.addr,
        &["run", "job", "--lease", "30", "--", "sleep", "30"],
    )
    .env("USER", "tester")
    .spawn()
    .unwrap();
    let direct = client(&server.addr);
    let deadline = Instant::now() + 10 * S;
    while direct.holders("job").unwrap().grants.is_empty() {
        assert!(Instant::now() < deadline, "kunci run did not take the lock");
        std::thread::sleep(10 * MS);
    }
    // Two waiters, in this order, with their labels.
    let waiters: Vec<_> = ["first ⏳", "second"]
        .into_iter()
        .enumerate()
        .map(|(index, label)| {
            let client = client(&server.addr);
            let label = label.to_owned();
            let waiting = std::thread::spawn(move || {
                client.acquire_with(
                    "job",
                    3 * S,
                    5 * S,
                    kunci::client::AcquireOptions::new().label(label),
                )
            });
            let queued = Instant::now() + 5 * S;
            loop {
                if direct.holders("job").unwrap().waiters.len() > index {
                    break;
                }
                assert!(Instant::now() < queued);
                std::thread::sleep(5 * MS);
            }
            waiting
        })
        .collect();
    let holders = direct.holders("job").unwrap();
    let [grant] = holders.grants.as_slice() else {
        panic!("{holders:?}")
    };
    let label = format!("tester@{}", grant.label.split_once('@').unwrap().1);
    assert_eq!(grant.label, label);
    assert!(
        grant.label.ends_with(&format!(" pid={} sleep", run.id())),
        "{}",
        grant.label
    );
    assert_eq!(grant.take, 0);
    assert!(
        grant.lease_left <= 30 * S && grant.lease_left > 20 * S,
        "{grant:?}"
    );
    assert!(grant.held_for < 10 * S, "{grant:?}");
    let labels: Vec<&str> = holders.waiters.iter().map(|w| w.label.as_str()).collect();
    assert_eq!(labels, ["first ⏳", "second"]);
    assert!(holders.waiters[0].wait_left <= 3 * S && holders.waiters[1].wait_left > S);
    // The CLI shows the same, as JSON.
    let output = kunci(&server.addr, &["who", "job", "--json"]);
    assert_eq!(output.status.code(), Some(0));
    let text = stdout(&output);
    assert!(
        text.starts_with(&format!(
            "{{\"key\":\"job\",\"limit\":0,\"left_out\":0,\"grants\":[{{\"token\":\"{}\",\"owner\":\"{}\",",
            grant.token, grant.owner
        )),
        "{text}"
    );
    assert!(text.contains(&format!("\"take\":0,\"label\":\"{}\"}}]", grant.label)));
    assert!(
        text.contains("\"take\":0,\"label\":\"first ⏳\"},{\"owner\":"),
        "{text}"
    );
    assert!(
        text.ends_with("\"take\":0,\"label\":\"second\"}]}\n"),
        "{text}"
    );
    let output = kunci(&server.addr, &["list", "--json"]);
    assert_eq!(
        stdout(&output),
        "{\"key\":\"job\",\"grants\":1,\"waiters\":2,\"limit\":0}\n"
    );
    // SIGTERM ends the command; kunci releases and the waiters get it.
    // SAFETY: kill(2) on a child we spawned.
    unsafe { libc::kill(run.id() as i32, libc::SIGTERM) };
    run.wait().unwrap();
    for waiting in waiters {
        let outcome = waiting.join().unwrap();
        assert!(
            matches!(outcome, Ok(_) | Err(Error::Timeout)),
            "{outcome:?}"
        );
    }
}

#[test]
fn keys_lists_every_key_across_pages_against_a_real_server() {
    let server = crate::util::TestServer::start(&[]);
    let client = client(&server.addr);
    let mut expected = std::collections::BTreeSet::new();
    let mut tickets = Vec::new();
    for n in 0..2_500 {
        let key = format!("k/{n:04}");
        tickets.push(client.acquire(&key, Duration::ZERO, 60 * S).unwrap());
        expected.insert(key);
    }
    tickets.push(client.acquire("other", Duration::ZERO, 60 * S).unwrap());
    let listed: Vec<KeySummary> = client.keys("k/").map(Result::unwrap).collect();
    let names: std::collections::BTreeSet<String> =
        listed.iter().map(|key| key.key.clone()).collect();
    assert_eq!(names, expected);
    assert!(listed.iter().all(|key| key.grants == 1 && key.waiters == 0));
    let output = kunci(&server.addr, &["list", "k/"]);
    assert_eq!(output.status.code(), Some(0));
    let lines: std::collections::BTreeSet<String> =
        stdout(&output).lines().map(str::to_owned).collect();
    let wanted: std::collections::BTreeSet<String> = expected
        .iter()
        .map(|key| format!("{key}  grants=1 waiters=0 limit=none"))
        .collect();
    assert_eq!(lines, wanted);
    assert_eq!(client.keys("").count(), 2_501);
}

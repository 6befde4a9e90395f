//! The client and the CLI on a real etcd cluster (`etcd://`, docs/ETCD.md):
//! every outcome, FIFO hand-over, leases that never end early, `kunci run`
//! loops that exclude each other, a holder that keeps its lock while the
//! leader is killed, `Indeterminate` through a silent member, and permits
//! (semaphores, shared locks) through the client and `kunci run`. The
//! permit rules themselves are tested at the recipe level
//! (src/client/etcd/cluster_tests.rs).
//!
//! Each test starts its own 3-member cluster on loopback. Without `etcd`
//! installed they fail under CI and are skipped, saying so, elsewhere
//! (`util::require_tool`).

use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kunci::client::{AcquireOptions, Client, Config, Error, Permits, Unavailable};

use crate::util::etcd::{Blackhole, Cluster};
use crate::util::{TempDir, kunci_bin, require_tool};

const MS: Duration = Duration::from_millis(1);
const S: Duration = Duration::from_secs(1);

fn kunci(server: &str, args: &[&str]) -> Output {
    Command::new(kunci_bin())
        .args(args)
        .env("KUNCI_SERVER", server)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("run kunci")
}

fn code(output: &Output) -> i32 {
    output.status.code().expect("exited, not killed")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout)
        .trim_end()
        .to_owned()
}

fn client_of(address: &str) -> Client {
    Client::new([address.parse().unwrap()], Config::default()).unwrap()
}

#[test]
fn etcd_every_outcome_of_every_call() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(3);
    let client = cluster.client();
    let lease = 10 * S;

    let ticket = client.acquire("books", Duration::ZERO, lease).unwrap();
    let token = ticket.token();
    assert!(token > 0);
    assert!(ticket.valid_until() > Instant::now() + 9 * S);
    let status = client.query("books").unwrap();
    assert_eq!(status.token, token);
    assert_ne!(status.owner, 0);
    assert!((8000..=10_000).contains(&status.lease_ms), "{status:?}");
    assert_eq!(status.waiters, 0);

    // Held: a zero wait is `Timeout` at once, a wait runs out; neither
    // leaves anything queued.
    let started = Instant::now();
    assert_eq!(
        client.acquire("books", Duration::ZERO, lease).unwrap_err(),
        Error::Timeout
    );
    assert!(started.elapsed() < S);
    let started = Instant::now();
    let waited = client.acquire("books", 600 * MS, lease).unwrap_err();
    assert_eq!(waited, Error::Timeout);
    assert!(started.elapsed() >= 600 * MS && started.elapsed() < 2 * S);
    assert_eq!(client.query("books").unwrap().waiters, 0);

    // Invalid input never reaches etcd.
    assert!(matches!(
        client.acquire("", Duration::ZERO, lease),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        client.acquire("books", Duration::ZERO, Duration::ZERO),
        Err(Error::InvalidArgument(_))
    ));

    // Renew: the same length (a keep-alive), then a new one (the entry
    // moves to a new lease); the token stays.
    client.renew("books", token, lease).unwrap();
    client.renew("books", token, 30 * S).unwrap();
    let status = client.query("books").unwrap();
    assert_eq!(status.token, token);
    assert!(status.lease_ms > 20_000, "{status:?}");
    client.renew("books", token, 5 * S).unwrap();
    assert!(client.query("books").unwrap().lease_ms <= 5000);
    assert_eq!(client.renew("books", token + 1, lease), Err(Error::NotHeld));
    assert_eq!(client.release("books", token - 1), Err(Error::NotHeld));

    // Release: exactly once.
    ticket.release().unwrap();
    assert_eq!(client.release("books", token), Err(Error::NotHeld));
    assert_eq!(client.renew("books", token, lease), Err(Error::NotHeld));
    assert!(client.query("books").unwrap().is_free());

    // Tokens are strictly increasing, across keys too.
    let a = client.acquire("books", Duration::ZERO, lease).unwrap();
    let b = client.acquire("pens", Duration::ZERO, lease).unwrap();
    assert!(token < a.token() && a.token() < b.token());
    // Key `a` and key `a/b` are different locks.
    let nested = client.acquire("books/2", Duration::ZERO, lease).unwrap();
    assert_eq!(client.query("books").unwrap().token, a.token());
    drop((a, b, nested));

    // A dropped ticket is released in the background.
    let give_up = Instant::now() + 5 * S;
    while !client.query("books").unwrap().is_free() {
        assert!(Instant::now() < give_up, "dropped ticket not released");
        std::thread::sleep(20 * MS);
    }

    assert!(client.info().unwrap().starts_with("backend=etcd version="));
    assert!(client.ping().unwrap() < S);

    // A member that refuses connections is skipped (certainly unsent);
    // with none reachable, `Unavailable` at the deadline.
    let refusing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let refused = refusing.local_addr().unwrap().to_string();
    drop(refusing);
    let detour = client_of(&format!("etcd://{refused},{}", cluster.members[1].client));
    detour
        .acquire("detour", Duration::ZERO, lease)
        .unwrap()
        .release()
        .unwrap();
    let nowhere = client_of(&format!("etcd://{refused}"));
    let started = Instant::now();
    let calls: Vec<std::thread::JoinHandle<Option<Error>>> = vec![
        std::thread::spawn({
            let nowhere = nowhere.clone();
            move || nowhere.acquire("books", Duration::ZERO, lease).err()
        }),
        std::thread::spawn({
            let nowhere = nowhere.clone();
            move || nowhere.release("books", 7).err()
        }),
        std::thread::spawn({
            let nowhere = nowhere.clone();
            move || nowhere.renew("books", 7, lease).err()
        }),
        std::thread::spawn({
            let nowhere = nowhere.clone();
            move || nowhere.query("books").err()
        }),
    ];
    for call in calls {
        assert_eq!(
            call.join().unwrap(),
            Some(Error::Unavailable(Unavailable::Unreachable))
        );
    }
    assert!(started.elapsed() >= 5 * S - 10 * MS && started.elapsed() < 6 * S);
}

#[test]
fn etcd_cli_commands_and_exit_codes() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(3);
    let server = cluster.address();

    let acquired = kunci(&server, &["acquire", "cli", "--lease", "20"]);
    assert_eq!(code(&acquired), 0);
    let token = stdout(&acquired);
    assert!(token.parse::<u64>().unwrap() > 0);
    let query = kunci(&server, &["query", "cli"]);
    assert!(
        stdout(&query).starts_with(&format!("held token={token} owner=")),
        "{}",
        stdout(&query)
    );
    assert_eq!(code(&kunci(&server, &["acquire", "cli"])), 1);
    assert_eq!(
        code(&kunci(&server, &["acquire", "cli", "--wait", "0.3"])),
        1
    );
    assert_eq!(
        code(&kunci(&server, &["renew", "cli", &token, "--lease", "20"])),
        0
    );
    assert_eq!(
        code(&kunci(&server, &["renew", "cli", "1", "--lease", "20"])),
        6
    );
    assert_eq!(
        code(&kunci(&server, &["acquire", "cli", "--lease", "0"])),
        2
    );
    // `--server` takes the same address.
    let by_flag = Command::new(kunci_bin())
        .args(["release", "cli", &token, "--server", &server])
        .env_remove("KUNCI_SERVER")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(code(&by_flag), 0, "{by_flag:?}");
    assert_eq!(code(&kunci(&server, &["release", "cli", &token])), 6);
    assert_eq!(stdout(&kunci(&server, &["query", "cli"])), "free");
    let info = kunci(&server, &["info"]);
    assert!(stdout(&info).starts_with("backend=etcd"), "{info:?}");
    assert_eq!(code(&kunci(&server, &["ping"])), 0);

    // kunci run: CMD's status; Timeout (1, or -E); a lock lost to someone
    // releasing its token (6, CMD terminated).
    assert_eq!(
        code(&kunci(&server, &["run", "job", "--", "sh", "-c", "exit 3"])),
        3
    );
    let held = kunci(&server, &["acquire", "job", "--lease", "30"]);
    let held = stdout(&held);
    assert_eq!(code(&kunci(&server, &["run", "job", "--", "true"])), 1);
    assert_eq!(
        code(&kunci(
            &server,
            &["run", "job", "-E", "7", "-q", "--", "true"]
        )),
        7
    );
    assert_eq!(code(&kunci(&server, &["release", "job", &held])), 0);
    let running = {
        let server = server.clone();
        std::thread::spawn(move || {
            kunci(
                &server,
                &["run", "job", "--lease", "3", "--", "sleep", "30"],
            )
        })
    };
    let client = cluster.client();
    let give_up = Instant::now() + 5 * S;
    let token = loop {
        let status = client.query("job").unwrap();
        if !status.is_free() {
            break status.token;
        }
        assert!(Instant::now() < give_up, "kunci run never acquired");
        std::thread::sleep(20 * MS);
    };
    client.release("job", token).unwrap();
    let taken = Instant::now();
    let lost = running.join().unwrap();
    assert_eq!(code(&lost), 6, "{lost:?}");
    assert!(taken.elapsed() < 3 * S, "{:?}", taken.elapsed());

    // The bench drives etcd:// through the client (pairs and contended).
    for workload in ["pairs", "contended"] {
        let bench = Command::new(kunci_bin())
            .args(["bench", workload, "--server", &server, "--connections", "3"])
            .args(["--duration", "1", "--warmup", "0", "--json"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(code(&bench), 0, "{bench:?}");
        let report = stdout(&bench);
        assert!(report.contains("\"errors\":0"), "{report}");
        assert!(!report.contains("\"grants\":0,"), "{report}");
    }
    let hold = kunci(&server, &["bench", "hold", "5", "--server", &server]);
    assert_eq!(code(&hold), 2, "{hold:?}");

    let refusing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let refused = format!("etcd://{}", refusing.local_addr().unwrap());
    drop(refusing);
    assert_eq!(code(&kunci(&refused, &["release", "cli", "5"])), 4);
    // etcd and kunci addresses cannot be mixed.
    let mixed = Command::new(kunci_bin())
        .args([
            "query",
            "cli",
            "--server",
            &server,
            "--server",
            "127.0.0.1:1",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_ne!(code(&mixed), 0);
}

#[test]
fn etcd_waiters_are_granted_in_fifo_order_and_leases_never_end_early() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(3);
    let client = cluster.client();
    let holder = client.acquire("queue", Duration::ZERO, 30 * S).unwrap();
    let granted = Arc::new(Mutex::new(Vec::new()));
    let waiters: Vec<_> = (0..3)
        .map(|index| {
            let (waiting, granted) = (client.clone(), granted.clone());
            let waiter = std::thread::spawn(move || {
                let ticket = waiting.acquire("queue", 20 * S, 30 * S).unwrap();
                granted.lock().unwrap().push((index, ticket.token()));
                std::thread::sleep(100 * MS);
                ticket.release().unwrap();
            });
            // Each joins the queue before the next starts.
            let give_up = Instant::now() + 5 * S;
            while client.query("queue").unwrap().waiters < index + 1 {
                assert!(Instant::now() < give_up, "waiter {index} never queued");
                std::thread::sleep(10 * MS);
            }
            waiter
        })
        .collect();
    holder.release().unwrap();
    for waiter in waiters {
        waiter.join().unwrap();
    }
    let granted = granted.lock().unwrap().clone();
    let order: Vec<u32> = granted.iter().map(|(index, _)| *index).collect();
    assert_eq!(order, [0, 1, 2]);
    assert!(
        granted.windows(2).all(|pair| pair[0].1 < pair[1].1),
        "{granted:?}"
    );

    // A lease that is not renewed ends, and never before its length: the
    // waiter gets the key no earlier than `lease` after the holder's
    // acquire was sent.
    let lease = 2 * S;
    let sent = Instant::now();
    let expiring = client.acquire("expiry", Duration::ZERO, lease).unwrap();
    let valid_until = expiring.valid_until();
    let _ = expiring.into_token();
    let next = client.acquire("expiry", 10 * S, lease).unwrap();
    let taken_over = Instant::now();
    assert!(
        taken_over - sent >= lease,
        "lease ended early: {:?}",
        taken_over - sent
    );
    assert!(valid_until <= taken_over);
    assert!(
        taken_over - sent < lease + 2 * S,
        "lease ended late: {:?}",
        taken_over - sent
    );
    next.release().unwrap();
}

#[test]
fn etcd_kunci_run_loops_exclude_each_other_with_increasing_tokens() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(3);
    let server = cluster.address();
    let dir = TempDir::new("etcd-run");
    let journal = dir.join("journal");
    let script = format!(
        "echo \"start $KUNCI_TOKEN\" >> {0}; sleep 0.05; echo \"end $KUNCI_TOKEN\" >> {0}",
        journal.display()
    );
    let loops: Vec<_> = (0..3)
        .map(|_| {
            let (server, script) = (server.clone(), script.clone());
            std::thread::spawn(move || {
                for _ in 0..4 {
                    let output = kunci(
                        &server,
                        &[
                            "run", "shared", "--wait", "30", "--lease", "5", "--", "sh", "-c",
                            &script,
                        ],
                    );
                    assert_eq!(code(&output), 0, "{output:?}");
                }
            })
        })
        .collect();
    for each in loops {
        each.join().unwrap();
    }
    let journal = std::fs::read_to_string(&journal).unwrap();
    let lines: Vec<&str> = journal.lines().collect();
    assert_eq!(lines.len(), 24, "{journal}");
    let mut last = 0u64;
    for pair in lines.chunks(2) {
        let start = pair[0].strip_prefix("start ").expect(&journal);
        let end = pair[1].strip_prefix("end ").expect(&journal);
        assert_eq!(start, end, "two holders at once:\n{journal}");
        let token: u64 = start.parse().unwrap();
        assert!(token > last, "tokens not increasing:\n{journal}");
        last = token;
    }
}

#[test]
fn etcd_kunci_run_keeps_its_lock_while_the_leader_is_killed() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let mut cluster = Cluster::start(3);
    let server = cluster.address();
    // CMD leaves a mark just before it ends: a grant to someone else that
    // returns before the mark exists was made while CMD ran.
    let dir = TempDir::new("etcd-steady");
    let ended = dir.join("ended");
    let run = {
        let server = server.clone();
        let script = format!("sleep 7 && touch {}", ended.display());
        std::thread::spawn(move || {
            kunci(
                &server,
                &["run", "steady", "--lease", "4", "--", "sh", "-c", &script],
            )
        })
    };
    let client = cluster.client();
    let give_up = Instant::now() + 5 * S;
    let token = loop {
        let status = client.query("steady").unwrap();
        if !status.is_free() {
            break status.token;
        }
        assert!(Instant::now() < give_up, "kunci run never acquired");
        std::thread::sleep(20 * MS);
    };
    std::thread::sleep(500 * MS);
    let leader = cluster.leader();
    cluster.kill(leader);
    // Until CMD ends, nobody else gets the key (answers during the
    // election may be Unavailable or Indeterminate, never a grant).
    let others = client_of(&server);
    while !run.is_finished() {
        match others.acquire("steady", Duration::ZERO, S) {
            Err(Error::Timeout | Error::Unavailable(_) | Error::Indeterminate) => {}
            // After CMD ended kunci releases, and the key may go to the
            // next one before kunci has exited.
            Ok(_) if ended.exists() => break,
            Ok(ticket) => {
                let status = others.query("steady");
                panic!(
                    "granted {} while kunci run held {token} ({status:?})",
                    ticket.token()
                );
            }
            Err(error) => panic!("unexpected {error}"),
        }
        std::thread::sleep(100 * MS);
    }
    let output = run.join().unwrap();
    assert_eq!(code(&output), 0, "{output:?}");
    let next = others.acquire("steady", 2 * S, S).unwrap();
    assert!(next.token() > token);
}

#[test]
fn etcd_indeterminate_through_a_silent_member() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(3);
    let direct = cluster.client();
    let lease = 2 * S;
    // The grant passes, the transaction that puts the entry goes silent.
    let at_put = Blackhole::start(&cluster.members[0].client, 1);
    // The holder's range passes, the guarded delete goes silent.
    let at_release = Blackhole::start(&cluster.members[1].client, 1);
    let held = direct
        .acquire("silent-release", Duration::ZERO, 10 * S)
        .unwrap();
    let token = held.into_token();
    // The holder's range passes, the keep-alive goes silent.
    let at_renew = Blackhole::start(&cluster.members[2].client, 1);
    // Silent from the first byte: even a read gets no answer.
    let at_query = Blackhole::start(&cluster.members[0].client, 0);
    let renewing = std::thread::spawn({
        let address = format!("etcd://{}", at_renew.addr);
        move || client_of(&address).renew("silent-release", token, 10 * S)
    });
    let querying = std::thread::spawn({
        let address = format!("etcd://{}", at_query.addr);
        move || client_of(&address).query("silent-release")
    });

    let acquiring = std::thread::spawn({
        let address = format!("etcd://{}", at_put.addr);
        move || {
            let started = Instant::now();
            let outcome = client_of(&address).acquire("silent-acquire", Duration::ZERO, lease);
            (outcome.map(|ticket| ticket.token()), started.elapsed())
        }
    });
    let releasing = std::thread::spawn({
        let address = format!("etcd://{}", at_release.addr);
        move || {
            let started = Instant::now();
            let outcome = client_of(&address).release("silent-release", token);
            (outcome, started.elapsed())
        }
    });
    // A silent member first in the list costs one attempt, then the
    // client leaves it: a kunci run through it keeps its lock.
    let silent_first = Blackhole::start(&cluster.members[0].client, 0);
    let around = std::thread::spawn({
        let address = format!(
            "etcd://{},{},{}",
            silent_first.addr, cluster.members[1].client, cluster.members[2].client
        );
        move || {
            kunci(
                &address,
                &["run", "around", "--lease", "3", "--", "sleep", "4"],
            )
        }
    });
    let (acquired, took) = acquiring.join().unwrap();
    assert_eq!(acquired, Err(Error::Indeterminate));
    assert!(took >= 5 * S - 10 * MS && took < 6 * S, "{took:?}");
    let (released, took) = releasing.join().unwrap();
    assert_eq!(released, Err(Error::Indeterminate));
    assert!(took >= 5 * S - 10 * MS && took < 6 * S, "{took:?}");

    assert_eq!(renewing.join().unwrap(), Err(Error::Indeterminate));
    assert_eq!(querying.join().unwrap(), Err(Error::Indeterminate));

    let around = around.join().unwrap();
    assert_eq!(code(&around), 0, "{around:?}");

    // The release never reached etcd: the grant is still there.
    assert_eq!(direct.query("silent-release").unwrap().token, token);
    direct.release("silent-release", token).unwrap();
    // Whatever the silent acquire left, its lease has run out.
    assert!(direct.query("silent-acquire").unwrap().is_free());
}

/// Waits until `key` has `count` waiters.
fn until_waiters(client: &Client, key: &str, count: u32) {
    let give_up = Instant::now() + 5 * S;
    while client.query(key).unwrap().waiters < count {
        assert!(
            Instant::now() < give_up,
            "{key}: waiter {count} never queued"
        );
        std::thread::sleep(10 * MS);
    }
}

#[test]
fn etcd_client_permits_go_through_the_etcd_recipe() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(3);
    let client = cluster.client();
    let lease = 30 * S;
    let semaphore = Permits::limit(2);
    let one = client
        .acquire_with("backups", Duration::ZERO, lease, semaphore)
        .unwrap();
    let labelled = AcquireOptions::new()
        .permits(semaphore)
        .label("db2 nightly");
    let two = client
        .acquire_with("backups", Duration::ZERO, lease, labelled)
        .unwrap();
    assert!(one.token() < two.token());
    assert_eq!(
        client
            .acquire_with("backups", Duration::ZERO, lease, semaphore)
            .unwrap_err(),
        Error::Timeout
    );
    assert_eq!(
        client
            .acquire_with("backups", 2 * S, lease, Permits::limit(3))
            .unwrap_err(),
        Error::LimitMismatch { key_limit: Some(2) }
    );
    // Invalid permits never reach etcd.
    assert!(matches!(
        client.acquire_with(
            "backups",
            Duration::ZERO,
            lease,
            Permits::exclusive().take(1)
        ),
        Err(Error::InvalidArgument(_))
    ));
    let status = client.query("backups").unwrap();
    assert_eq!((status.token, status.waiters), (one.token(), 0));
    // A waiter gets the permit the first holder frees; its ticket renews
    // and releases its own grant only.
    let waiting = {
        let client = client.clone();
        std::thread::spawn(move || client.acquire_with("backups", 10 * S, lease, semaphore))
    };
    until_waiters(&client, "backups", 1);
    one.release().unwrap();
    let mut three = waiting.join().unwrap().unwrap();
    assert!(three.token() > two.token());
    three.renew(lease).unwrap();
    three.release().unwrap();
    assert_eq!(client.query("backups").unwrap().token, two.token());
    two.release().unwrap();
    assert!(client.query("backups").unwrap().is_free());

    // Readers share; a writer queued behind them goes before a later
    // reader, with a token above the readers'.
    let reader = client
        .acquire_with("catalog", Duration::ZERO, lease, Permits::shared())
        .unwrap();
    let writer = {
        let client = client.clone();
        std::thread::spawn(move || client.acquire("catalog", 10 * S, lease))
    };
    until_waiters(&client, "catalog", 1);
    assert_eq!(
        client
            .acquire_with("catalog", Duration::ZERO, lease, Permits::shared())
            .unwrap_err(),
        Error::Timeout
    );
    let reader_token = reader.token();
    reader.release().unwrap();
    let writer = writer.join().unwrap().unwrap();
    assert!(writer.token() > reader_token);
    writer.release().unwrap();
}

#[test]
fn etcd_kunci_run_with_a_limit_of_2_from_5_shells_never_overlaps_more_than_2() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(3);
    let server = cluster.address();
    let dir = TempDir::new("etcd-run-limit");
    let journal = dir.join("journal");
    // Each run appends `+` when it starts and `-` when it ends; the
    // appends are single short writes to an O_APPEND file.
    let script = format!("echo + >> {0}; sleep 0.3; echo - >> {0}", journal.display());
    let shells: Vec<_> = (0..5)
        .map(|_| {
            let (server, script) = (server.clone(), script.clone());
            std::thread::spawn(move || {
                let args = [
                    "run", "pool", "--limit", "2", "--wait", "30", "--lease", "5", "--", "sh",
                    "-c", &script,
                ];
                let output = kunci(&server, &args);
                assert_eq!(code(&output), 0, "{output:?}");
            })
        })
        .collect();
    for shell in shells {
        shell.join().unwrap();
    }
    let journal = std::fs::read_to_string(&journal).unwrap();
    let (mut inside, mut most) = (0i32, 0i32);
    for line in journal.lines() {
        inside += if line == "+" { 1 } else { -1 };
        most = most.max(inside);
    }
    assert_eq!(journal.lines().count(), 10, "{journal}");
    assert_eq!(
        most, 2,
        "at most 2 at once, and 2 at some point:\n{journal}"
    );
    // A run naming another limit is a usage-class failure (exit 2) and
    // does not run its command.
    let held = kunci(
        &server,
        &["acquire", "pool", "--limit", "2", "--lease", "30"],
    );
    assert_eq!(code(&held), 0, "{held:?}");
    let other = kunci(&server, &["run", "pool", "--limit", "3", "--", "true"]);
    assert_eq!(code(&other), 2, "{other:?}");
    assert!(
        String::from_utf8_lossy(&other.stderr).contains("has a limit of 2 permits"),
        "{other:?}"
    );
}

#[test]
fn etcd_kunci_who_and_list_show_grants_waiters_and_every_key() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(3);
    let server = cluster.address();
    let client = cluster.client();
    let label = "nightly ü  \"x\" 1 2";
    let acquired = kunci(
        &server,
        &["acquire", "w/job", "--lease", "30", "--label", label],
    );
    assert_eq!(code(&acquired), 0, "{acquired:?}");
    let token: u64 = stdout(&acquired).parse().unwrap();
    let waiting = {
        let client = client.clone();
        std::thread::spawn(move || {
            let options = AcquireOptions::new().label("second in line");
            client.acquire_with("w/job", 4 * S, 30 * S, options)
        })
    };
    until_waiters(&client, "w/job", 1);

    // The JSON object, exactly; the lease left is etcd's whole seconds,
    // so it is taken from a look just before that saw the same.
    let mut tries = 0;
    let (holders, json) = loop {
        let before = client.holders("w/job").unwrap();
        let who = kunci(&server, &["who", "w/job", "--json"]);
        assert_eq!(code(&who), 0, "{who:?}");
        if client.holders("w/job").unwrap() == before {
            break (before, stdout(&who));
        }
        tries += 1;
        assert!(tries < 5, "the lease left never held still");
    };
    assert_eq!(holders.grants.len(), 1);
    let (grant, waiter) = (&holders.grants[0], &holders.waiters[0]);
    assert_eq!(grant.token, token);
    assert!((28_000..=30_000).contains(&grant.lease_left.as_millis()));
    assert_eq!(
        json,
        format!(
            r#"{{"key":"w/job","limit":0,"left_out":0,"grants":[{{"token":"{token}","owner":"{}","lease_ms":{},"held_ms":null,"take":0,"label":"nightly ü  \"x\" 1 2"}}],"waiters":[{{"owner":"{}","wait_ms":null,"take":0,"label":"second in line"}}]}}"#,
            grant.owner,
            grant.lease_left.as_millis(),
            waiter.owner,
        )
    );
    let table = stdout(&kunci(&server, &["who", "w/job"]));
    assert!(
        table.starts_with("w/job: limit none, 1 grant, 1 waiter\n"),
        "{table}"
    );
    assert!(table.contains(&format!("{token} ")), "{table}");
    // etcd keeps no grant time and no wait deadline: they are unknown.
    assert!(table.contains(" unknown "), "{table}");
    assert!(
        table.contains(label) && table.contains("second in line"),
        "{table}"
    );
    assert_eq!(waiting.join().unwrap().unwrap_err(), Error::Timeout);

    // `list` follows the cursor past one page of 1,000 entries.
    let keys: Vec<String> = (0..1001).map(|index| format!("many/{index:04}")).collect();
    std::thread::scope(|scope| {
        for chunk in keys.chunks(126) {
            let client = client.clone();
            scope.spawn(move || {
                for key in chunk {
                    client
                        .acquire(key, Duration::ZERO, 60 * S)
                        .unwrap()
                        .into_token();
                }
            });
        }
    });
    let listed = kunci(&server, &["list", "many/", "--json"]);
    assert_eq!(code(&listed), 0, "{listed:?}");
    let mut lines: Vec<String> = stdout(&listed).lines().map(str::to_owned).collect();
    lines.sort();
    let expected: Vec<String> = keys
        .iter()
        .map(|key| format!(r#"{{"key":"{key}","grants":1,"waiters":0,"limit":0}}"#))
        .collect();
    assert_eq!(lines, expected);
    let every = kunci(&server, &["list"]);
    assert_eq!(code(&every), 0, "{every:?}");
    let every = stdout(&every);
    assert_eq!(every.lines().count(), 1002, "{every}");
    assert!(
        every
            .lines()
            .any(|line| line == "w/job  grants=1 waiters=0 limit=none"),
        "{every}"
    );
}

/// POSTs `body` to etcd's gateway at `member` (`HOST:PORT`) and returns
/// the status line and body.
fn etcd_post(member: &str, path: &str, body: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(member).unwrap();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer}");
    answer
}

#[test]
fn etcd_with_authentication_takes_a_user_and_refuses_the_rest() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    // Tokens that expire after 1 s unused, so the client must get new ones.
    let cluster = Cluster::start_with(1, &["--auth-token-ttl", "1"]);
    let member = cluster.address().trim_start_matches("etcd://").to_owned();
    for (path, body) in [
        (
            "/v3/auth/user/add",
            r#"{"name":"root","password":"root-password"}"#,
        ),
        ("/v3/auth/user/grant", r#"{"user":"root","role":"root"}"#),
        (
            "/v3/auth/user/add",
            r#"{"name":"nobody","password":"nobody-password"}"#,
        ),
        ("/v3/auth/enable", "{}"),
    ] {
        etcd_post(&member, path, body);
    }
    let client = |credentials: Option<(&str, &str)>| {
        let config = Config {
            etcd_credentials: credentials.map(|(user, password)| kunci::client::EtcdCredentials {
                user: user.into(),
                password: password.into(),
            }),
            ..Config::default()
        };
        Client::new([cluster.address().parse().unwrap()], config).unwrap()
    };
    let lease = Duration::from_secs(30);
    let refused = [
        (None, kunci::client::Denied::NotAuthenticated),
        (
            Some(("root", "wrong")),
            kunci::client::Denied::NotAuthenticated,
        ),
        (
            Some(("nobody", "nobody-password")),
            kunci::client::Denied::NotPermitted,
        ),
    ];
    for (credentials, why) in refused {
        let started = Instant::now();
        let result = client(credentials).acquire("job", Duration::from_secs(2), lease);
        assert_eq!(
            result.map(drop),
            Err(Error::PermissionDenied(why)),
            "{credentials:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{credentials:?}"
        );
    }
    let root = client(Some(("root", "root-password")));
    let ticket = root.acquire("job", Duration::ZERO, lease).unwrap();
    // The token expires; the next calls get a new one.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(root.query("job").unwrap().token, ticket.token());
    ticket.release().unwrap();
    assert!(root.query("job").unwrap().is_free());

    let unauthenticated = kunci(&cluster.address(), &["acquire", "job"]);
    assert_eq!(code(&unauthenticated), 7);
    let mut command = Command::new(kunci_bin());
    let with_user = command
        .args(["acquire", "job", "--server", &cluster.address()])
        .env("KUNCI_ETCD_USER", "root")
        .env("KUNCI_ETCD_PASSWORD", "root-password")
        .output()
        .unwrap();
    assert_eq!(code(&with_user), 0, "{with_user:?}");
}

//! Leader election on a real etcd (spec §13.6, docs/ETCD.md "Leader
//! election on etcd"): `leader` and `observe` through the library, `O`
//! following an etcd watch rather than polling, an etcd restart under a
//! follower, and `kunci leader` / `kunci elect` as processes.
//!
//! Each test starts its own cluster on loopback. Without `etcd` installed
//! they fail under CI and are skipped, saying so, elsewhere
//! (`util::require_tool`).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use kunci::client::{AcquireOptions, Client, Config, Leader};

use crate::util::etcd::{Blackhole, Cluster};
use crate::util::{kunci, next_line, require_tool, signal, spawn_kunci, stdout_lines, stdout_text};

const MS: Duration = Duration::from_millis(1);
const S: Duration = Duration::from_secs(1);

fn client_of(address: &str) -> Client {
    Client::new([address.parse().unwrap()], Config::default()).unwrap()
}

/// The term and held_for in `VALUE term=TOKEN held_for=SECONDS`.
fn term_and_held(line: &str, value: &str) -> (u64, String) {
    let rest = line
        .strip_prefix(&format!("{value} term="))
        .unwrap_or_else(|| panic!("{line:?} is not led by {value:?}"));
    let (term, held) = rest.split_once(" held_for=").expect("held_for");
    (term.parse().expect("a term"), held.to_owned())
}

/// The items of `client.observe(name)`, as they come, from a thread.
fn follow(client: &Client, name: &str) -> mpsc::Receiver<Option<(String, u64)>> {
    let (sender, receiver) = mpsc::channel();
    let (client, name) = (client.clone(), name.to_owned());
    std::thread::spawn(move || {
        // A leader yielded again once its grant time is stamped (the same
        // value and term) is one item here.
        let mut last = None;
        for item in client.observe(&name) {
            let item = item.expect("observe yields no error here");
            let item = item.map(|l| (l.value.unwrap_or_default(), l.term));
            if last.as_ref() == Some(&item) {
                continue;
            }
            last = Some(item.clone());
            if sender.send(item).is_err() {
                return;
            }
        }
    });
    receiver
}

fn next_item(
    items: &mpsc::Receiver<Option<(String, u64)>>,
    limit: Duration,
) -> Option<(String, u64)> {
    items
        .recv_timeout(limit)
        .unwrap_or_else(|_| panic!("no item within {limit:?}"))
}

fn held_for(leader: &Leader) -> Duration {
    leader.held_for.expect("a campaign's held_for is known")
}

#[test]
fn etcd_leader_and_observe_follow_campaigns_resignations_and_a_dead_lease() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(3);
    let (client, standby) = (cluster.client(), cluster.client());
    assert_eq!(client.leader("db").unwrap(), None);
    let items = follow(&cluster.client(), "db");
    assert_eq!(next_item(&items, 5 * S), None);

    let lead = client.campaign("db", "host a:5432", 10 * S).unwrap();
    let a_term = lead.token();
    assert_eq!(
        next_item(&items, 5 * S),
        Some(("host a:5432".into(), a_term))
    );
    std::thread::sleep(1100 * MS);
    let leader = client.leader("db").unwrap().unwrap();
    assert_eq!(
        (leader.value.as_deref().unwrap_or_default(), leader.term),
        ("host a:5432", a_term)
    );
    // Wall clock, one machine: at least the time since the campaign ended.
    assert!(
        (1100 * MS..4 * S).contains(&held_for(&leader)),
        "{leader:?}"
    );

    // A second candidate queues; the follower sees nothing of it.
    let queued = std::thread::spawn(move || standby.campaign("db", "host-b", 10 * S).unwrap());
    assert!(
        items.recv_timeout(1500 * MS).is_err(),
        "a waiter is no change"
    );
    let resigned = Instant::now();
    lead.release().unwrap();
    let b_lead = queued.join().unwrap();
    let b_term = b_lead.token();
    assert!(b_term > a_term, "term {b_term} after {a_term}");
    assert_eq!(next_item(&items, 5 * S), Some(("host-b".into(), b_term)));
    assert!(resigned.elapsed() < 2 * S, "{:?}", resigned.elapsed());
    // Its grant time is the grant's, not the enqueue's (1.5 s before).
    let leader = client.leader("db").unwrap().unwrap();
    assert_eq!(
        (leader.value.as_deref().unwrap_or_default(), leader.term),
        ("host-b", b_term)
    );
    assert!(held_for(&leader) < S, "{leader:?}");
    b_lead.release().unwrap();
    assert_eq!(next_item(&items, 5 * S), None);

    // A leader nobody keeps alive ends at its lease's end, as a dead
    // host's does; a lock stores no grant time: held_for is unknown.
    let options = AcquireOptions::new().label("dead");
    let dead = client
        .acquire_with("db", Duration::ZERO, 2 * S, options)
        .unwrap();
    let dead_term = dead.token();
    std::mem::forget(dead);
    assert_eq!(next_item(&items, 5 * S), Some(("dead".into(), dead_term)));
    let leader = client.leader("db").unwrap().unwrap();
    assert_eq!(leader.held_for, None, "{leader:?}");
    let started = Instant::now();
    assert_eq!(next_item(&items, 8 * S), None);
    let ended = started.elapsed();
    assert!((1000 * MS..6 * S).contains(&ended), "ended after {ended:?}");
    assert!(items.recv_timeout(300 * MS).is_err(), "nothing spurious");
}

#[test]
fn etcd_observe_waits_on_a_watch_and_never_polls() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(1);
    let counting = Blackhole::start(&cluster.members[0].client, usize::MAX);
    let client = client_of(&format!("etcd://{}", counting.addr));
    let holder = cluster.client();
    let ticket = holder.acquire("k", Duration::ZERO, 30 * S).unwrap();
    let token = ticket.token();

    // Wait 0: one read, at once, whatever `since` is.
    let before = counting.requests();
    let state = client.observe_key("k", token, Duration::ZERO).unwrap();
    assert_eq!((state.token, state.grants, state.waiters), (token, 1, 0));
    assert_eq!(counting.requests() - before, 1);

    // Unchanged for the whole wait: answered at its end, never before,
    // with a read, a watch and a read again; the watch's connection is
    // closed when the call ends.
    let before = (counting.requests(), counting.client_closes());
    let started = Instant::now();
    let state = client.observe_key("k", token, 3 * S).unwrap();
    let took = started.elapsed();
    assert_eq!(state.token, token);
    assert!((3 * S..5 * S).contains(&took), "answered after {took:?}");
    assert_eq!(counting.requests() - before.0, 3, "polling: more than 3");
    let closed = Instant::now();
    while counting.client_closes() == before.1 {
        assert!(
            closed.elapsed() < 2 * S,
            "the watch's connection stays open"
        );
        std::thread::sleep(10 * MS);
    }

    // A different `since`: at once.
    let started = Instant::now();
    let state = client.observe_key("k", token + 1, 10 * S).unwrap();
    assert_eq!(state.token, token);
    assert!(started.elapsed() < S);

    // Held, then released: answered at the release, not before.
    let waiting = {
        let client = client.clone();
        std::thread::spawn(move || {
            let state = client.observe_key("k", token, 20 * S);
            (state, Instant::now())
        })
    };
    std::thread::sleep(1500 * MS);
    assert!(!waiting.is_finished(), "answered before the change");
    let before = counting.requests();
    std::thread::sleep(1500 * MS);
    assert_eq!(counting.requests(), before, "a waiting observe polls");
    let released = Instant::now();
    ticket.release().unwrap();
    let (state, at) = waiting.join().unwrap();
    let state = state.unwrap();
    assert_eq!((state.token, state.grants), (0, 0));
    assert!(at >= released && at - released < S, "{:?}", at - released);

    // Free, then acquired: answered with the new grant's token.
    let waiting = {
        let client = client.clone();
        std::thread::spawn(move || client.observe_key("k", 0, 20 * S))
    };
    std::thread::sleep(1 * S);
    assert!(!waiting.is_finished(), "answered before the change");
    let options = AcquireOptions::new().label("new");
    let next = holder
        .acquire_with("k", Duration::ZERO, 30 * S, options)
        .unwrap();
    let state = waiting.join().unwrap().unwrap();
    assert_eq!(
        (state.token, state.label.as_str(), state.held_ms),
        (next.token(), "new", None)
    );
    next.release().unwrap();
}

#[test]
fn etcd_observe_goes_on_quietly_across_an_etcd_restart() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let mut cluster = Cluster::start(1);
    let client = cluster.client();
    let lead = client.acquire("svc", Duration::ZERO, 30 * S).unwrap();
    let a_term = lead.token();
    let items = follow(&cluster.client(), "svc");
    assert_eq!(next_item(&items, 5 * S), Some((String::new(), a_term)));
    cluster.kill(0);
    // Longer than the longest pause between attempts.
    std::thread::sleep(2500 * MS);
    cluster.restart(0);
    std::thread::sleep(500 * MS);
    assert!(items.try_recv().is_err(), "an outage is no change");
    lead.release().unwrap();
    assert_eq!(next_item(&items, 5 * S), None);
    let next = client.campaign("svc", "b", 30 * S).unwrap();
    assert_eq!(next_item(&items, 5 * S), Some(("b".into(), next.token())));
    assert!(next.token() > a_term);
    next.release().unwrap();
    assert_eq!(next_item(&items, 5 * S), None);
}

#[test]
fn etcd_kunci_elect_takes_over_and_kunci_leader_follows() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(3);
    let addr = cluster.address();
    let none = kunci(&addr, &["leader", "svc"]);
    assert_eq!(
        (none.status.code(), stdout_text(&none)),
        (Some(1), "none\n".into())
    );
    let json = kunci(&addr, &["leader", "svc", "--json"]);
    assert_eq!(
        (json.status.code(), stdout_text(&json)),
        (Some(1), "null\n".into())
    );
    let mut watch = spawn_kunci(&addr, &["leader", "svc", "--watch"]);
    let watched = stdout_lines(&mut watch);
    assert_eq!(next_line(&watched, 5 * S), "none");

    let command = "echo \"$KUNCI_TOKEN\"; exec sleep 60";
    let elect = |value: &str| {
        spawn_kunci(
            &addr,
            &[
                "elect", "svc", value, "--lease", "2", "--", "sh", "-c", command,
            ],
        )
    };
    let mut a = elect("host a");
    let a_lines = stdout_lines(&mut a);
    let a_term: u64 = next_line(&a_lines, 10 * S).parse().unwrap();
    let (term, _) = term_and_held(&next_line(&watched, 5 * S), "host a");
    assert_eq!(term, a_term);
    let mut b = elect("host-b");
    let b_lines = stdout_lines(&mut b);
    std::thread::sleep(1100 * MS);
    let shown = kunci(&addr, &["leader", "svc"]);
    assert_eq!(shown.status.code(), Some(0));
    let (term, held) = term_and_held(stdout_text(&shown).trim_end(), "host a");
    assert_eq!(term, a_term);
    // The grant time `kunci elect` stored: at least the 1.1 s slept.
    let held: f64 = held.parse().expect("held_for is known");
    assert!((1.1..4.0).contains(&held), "{held}");
    let json = kunci(&addr, &["leader", "svc", "--json"]);
    let want = format!("{{\"value\": \"host a\", \"term\": \"{a_term}\", \"held_for\": ");
    let json = stdout_text(&json);
    assert!(json.starts_with(&want), "{json}");
    let held: f64 = json[want.len()..]
        .trim_end()
        .trim_end_matches('}')
        .parse()
        .unwrap();
    assert!(held >= 1.1, "{json}");
    assert!(
        b_lines.recv_timeout(500 * MS).is_err(),
        "the standby ran while the leader led"
    );

    // The leader's process dies: nobody releases, its lease ends (2 s,
    // renewed every 2/3 s, so at least 1.3 s were left), then the standby
    // leads and the watch shows it.
    signal(&a, libc::SIGKILL);
    let killed = Instant::now();
    let _ = a.wait();
    let b_term: u64 = next_line(&b_lines, 10 * S).parse().unwrap();
    let took = killed.elapsed();
    assert!(took >= 1300 * MS, "took over after {took:?}");
    assert!(took < 8 * S, "took over after {took:?}");
    assert!(b_term > a_term, "term {b_term} after {a_term}");
    // The watch may see the new leader before it stored its grant time
    // (one more put after its grant): held_for is then unknown, and the
    // leader is shown again once the time is there.
    let (term, held) = term_and_held(&next_line(&watched, 5 * S), "host-b");
    assert_eq!(term, b_term);
    let held = if held == "?" {
        let (term, held) = term_and_held(&next_line(&watched, 5 * S), "host-b");
        assert_eq!(term, b_term);
        held
    } else {
        held
    };
    assert!(held.parse::<f64>().unwrap() < 1.0, "{held}");
    let shown = kunci(&addr, &["leader", "svc"]);
    let (term, held) = term_and_held(stdout_text(&shown).trim_end(), "host-b");
    assert_eq!(term, b_term);
    assert!(held.parse::<f64>().unwrap() < 2.0, "{held}");

    // A leader that stops resigns; the watch says so, and ends on SIGTERM.
    signal(&b, libc::SIGTERM);
    assert_eq!(b.wait().unwrap().code(), Some(128 + libc::SIGTERM));
    assert_eq!(next_line(&watched, 5 * S), "none");
    signal(&watch, libc::SIGTERM);
    assert_eq!(watch.wait().unwrap().code(), Some(0));

    // A key held by a lock: its label leads, for an unknown time.
    let client = client_of(&addr);
    let options = AcquireOptions::new().label("by hand");
    let lock = client
        .acquire_with("svc", Duration::ZERO, 30 * S, options)
        .unwrap();
    let shown = kunci(&addr, &["leader", "svc"]);
    assert_eq!(
        (shown.status.code(), stdout_text(&shown)),
        (
            Some(0),
            format!("by hand term={} held_for=?\n", lock.token())
        )
    );
    let json = kunci(&addr, &["leader", "svc", "--json"]);
    assert_eq!(
        stdout_text(&json),
        format!(
            "{{\"value\": \"by hand\", \"term\": \"{}\", \"held_for\": null}}\n",
            lock.token()
        )
    );
    lock.release().unwrap();
}

/// Spec §13.4a, §13.6 (v5) on etcd, in both layouts: a lead's `proclaim`
/// and `kunci proclaim` put the leader's own entry (same create revision:
/// the term stays), observers report the new value with the same term, a
/// token that does not hold gets `NotHeld` (exit 6), and a lead lost
/// proclaims nothing and resigns quietly. In etcd's layout the value is
/// the new one alone, as an etcd `Election`'s `Proclaim` writes it.
#[test]
fn etcd_proclaim_keeps_the_term_in_both_layouts() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(1);
    for layout in ["", "?layout=etcd"] {
        let addr = format!("{}{layout}", cluster.address());
        let client = client_of(&addr);
        let items = follow(&client_of(&addr), "svc");
        assert_eq!(next_item(&items, 5 * S), None, "{layout}");
        let lead = client.campaign("svc", "host a", 30 * S).unwrap();
        let term = lead.token();
        assert_eq!(next_item(&items, 5 * S), Some(("host a".into(), term)));
        std::thread::sleep(300 * MS);
        lead.proclaim("host b").unwrap();
        assert_eq!(next_item(&items, 5 * S), Some(("host b".into(), term)));
        let leader = client.leader("svc").unwrap().expect("a leader");
        assert_eq!(
            (leader.value.as_deref(), leader.term),
            (Some("host b"), term)
        );
        // The entry itself: its create revision and lease are kept.
        let entry = client.holders("svc").unwrap().grants;
        assert_eq!(
            (entry.len(), entry[0].token, entry[0].label.as_str()),
            (1, term, "host b"),
            "{layout}"
        );
        std::thread::sleep(300 * MS);
        let done = kunci(&addr, &["proclaim", "svc", &term.to_string(), "host c"]);
        assert_eq!(
            (done.status.code(), stdout_text(&done)),
            (Some(0), "proclaimed\n".into()),
            "{layout}"
        );
        assert_eq!(next_item(&items, 5 * S), Some(("host c".into(), term)));
        let refused = kunci(&addr, &["proclaim", "svc", &(term + 1).to_string(), "x"]);
        assert_eq!(refused.status.code(), Some(6), "{layout}");
        // The lease is still the campaign's: renewals go on.
        std::thread::sleep(1100 * MS);
        assert!(lead.is_valid() && lead.lost().is_none(), "{layout}");
        // Lost behind its back: proclaim says so, resigning is quiet.
        client.release("svc", term).unwrap();
        assert_eq!(next_item(&items, 5 * S), None);
        assert_eq!(lead.proclaim("late"), Err(kunci::client::Error::NotHeld));
        assert_eq!(lead.release(), Ok(()), "{layout}");
    }
    // etcd's layout: the value alone, as etcdctl and Go's Election read it.
    let etcd = client_of(&format!("{}?layout=etcd", cluster.address()));
    let lead = etcd.campaign("plain", "first", 30 * S).unwrap();
    lead.proclaim("second").unwrap();
    let member = &cluster.members[0].client;
    let range = crate::util::etcd::post(
        member,
        "/v3/kv/range",
        r#"{"key":"cGxhaW4v","range_end":"cGxhaW4w"}"#,
    )
    .expect("a range answer");
    // "second" in base64.
    assert!(range.contains(r#""value":"c2Vjb25k""#), "{range}");
    lead.release().unwrap();
}

/// On etcd a campaign stamps its grant time into its entry just after
/// its grant: an observer that saw the hand-over before the stamp
/// reports the leader again, `held_for` known, once the stamp arrives
/// (the stamp is laid here by hand, so that the order is certain), and
/// `kunci leader --watch` prints the line again with it.
#[test]
fn etcd_observer_reports_held_for_once_the_grant_time_is_stamped() {
    use base64::Engine as _;
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(1);
    let addr = cluster.address();
    let client = client_of(&addr);
    let (sender, items) = mpsc::channel();
    let follower = client_of(&addr);
    std::thread::spawn(move || {
        for item in follower.observe("svc") {
            if sender.send(item.unwrap()).is_err() {
                return;
            }
        }
    });
    assert_eq!(items.recv_timeout(5 * S).unwrap(), None);
    let mut watch = spawn_kunci(&addr, &["leader", "svc", "--watch"]);
    let watched = stdout_lines(&mut watch);
    assert_eq!(next_line(&watched, 5 * S), "none");
    // A grant without a grant time, as a campaign's before its stamp.
    let options = AcquireOptions::new().label("host a");
    let lead = client
        .acquire_with("svc", Duration::ZERO, 30 * S, options)
        .unwrap();
    let first = items.recv_timeout(5 * S).unwrap().expect("a leader");
    assert_eq!(
        (first.value.as_deref(), first.term, first.held_for),
        (Some("host a"), lead.token(), None)
    );
    let (term, held) = term_and_held(&next_line(&watched, 5 * S), "host a");
    assert_eq!((term, held.as_str()), (lead.token(), "?"));
    std::thread::sleep(300 * MS);

    // The stamp: the same entry, its value with the grant time, on its
    // own lease.
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    let member = &cluster.members[0].client;
    let prefix = "kunci/3:svc/";
    let range = crate::util::etcd::post(
        member,
        "/v3/kv/range",
        &format!(
            r#"{{"key":"{}","range_end":"{}"}}"#,
            b64(prefix.as_bytes()),
            b64(b"kunci/3:svc0")
        ),
    )
    .expect("a range answer");
    let key = range
        .split(r#""key":""#)
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("the entry's name")
        .to_owned();
    let value = range
        .split(r#""value":""#)
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("the entry's value");
    let value = base64::engine::general_purpose::STANDARD
        .decode(value)
        .unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let mut stamped = value.clone();
    stamped.extend(format!("\ngranted_ms={}", now_ms - 500).bytes());
    let put = crate::util::etcd::post(
        member,
        "/v3/kv/put",
        &format!(
            r#"{{"key":"{key}","value":"{}","ignore_lease":true}}"#,
            b64(&stamped)
        ),
    )
    .expect("a put answer");
    assert!(put.contains("header"), "{put}");
    let again = items.recv_timeout(5 * S).unwrap().expect("a leader");
    assert_eq!(
        (again.value.as_deref(), again.term),
        (Some("host a"), lead.token())
    );
    let held = again.held_for.expect("held_for once stamped");
    assert!((400 * MS..3 * S).contains(&held), "{held:?}");
    let (term, held) = term_and_held(&next_line(&watched, 5 * S), "host a");
    assert_eq!(term, lead.token());
    assert!(held.parse::<f64>().unwrap() >= 0.4, "{held}");
    assert!(items.recv_timeout(300 * MS).is_err(), "once");
    lead.release().unwrap();
    assert_eq!(items.recv_timeout(5 * S).unwrap(), None);
    assert_eq!(next_line(&watched, 5 * S), "none");
    signal(&watch, libc::SIGTERM);
    assert_eq!(watch.wait().unwrap().code(), Some(0));
}

/// Spec §13.6 (v5) on etcd, both layouts: a bounded campaign ends
/// `Timeout` when its wait runs out (its entry removed: nobody waits),
/// leads when freed in time, and `kunci elect --wait S` exits 1.
#[test]
fn etcd_a_bounded_campaign_ends_timeout_in_both_layouts() {
    if !require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = Cluster::start(1);
    for layout in ["", "?layout=etcd"] {
        let addr = format!("{}{layout}", cluster.address());
        let client = client_of(&addr);
        let lead = client
            .campaign_within("svc", "host a", 30 * S, Duration::ZERO)
            .unwrap();
        let started = Instant::now();
        let refused = client.campaign_within("svc", "host b", 30 * S, 1500 * MS);
        let waited = started.elapsed();
        assert_eq!(
            refused.err(),
            Some(kunci::client::Error::Timeout),
            "{layout}"
        );
        assert!((1500 * MS..5 * S).contains(&waited), "{layout}: {waited:?}");
        assert_eq!(client.holders("svc").unwrap().waiters.len(), 0, "{layout}");
        let started = Instant::now();
        let timed_out = kunci(
            &addr,
            &["elect", "svc", "host c", "--wait", "1", "--", "true"],
        );
        assert_eq!(timed_out.status.code(), Some(1), "{layout}");
        assert!(started.elapsed() >= S, "{layout}");
        let resigned = {
            let client = client.clone();
            let term = lead.token();
            std::thread::spawn(move || {
                std::thread::sleep(500 * MS);
                client.release("svc", term).unwrap();
            })
        };
        let next = client
            .campaign_within("svc", "host b", 30 * S, 10 * S)
            .unwrap();
        resigned.join().unwrap();
        assert!(next.token() > lead.token(), "{layout}");
        // Lost behind its back: resigning is quiet, on etcd too.
        assert_eq!(lead.release(), Ok(()), "{layout}");
        next.release().unwrap();
    }
}

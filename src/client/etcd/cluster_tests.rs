//! Permits (spec §10.10) on a real 3-member etcd cluster, driven at the
//! recipe level: a semaphore never overlaps past its limit and grants in
//! FIFO order; readers share and a queued writer is never overtaken;
//! limit mismatches; `wait=0` leaves nothing behind; an expired permit
//! frees only its own take. The cluster is the integration tests' own
//! (`tests/util/etcd.rs`); a test skips, saying so, when `etcd` is not
//! installed, and fails instead under `CI=true`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::super::http::Members;
use super::{Claim, Cluster, LimitMismatch, entries, prefix, range_body};
use crate::addr::EtcdLayout;
use crate::client::vocabulary::{
    Grant, Holders, Key, KeyPage, KeyStatus, KeySummary, Outcome, Waiter,
};

#[path = "../../../tests/util/temp.rs"]
mod temp;
use temp::TempDir;

#[allow(dead_code)]
#[path = "../../../tests/util/etcd.rs"]
mod etcd;

#[allow(dead_code)]
#[path = "../../../tests/util/tool.rs"]
mod tool;

const MS: Duration = Duration::from_millis(1);
const S: Duration = Duration::from_secs(1);

const SHARED: (u16, u16) = (65535, 1);
const WRITER: (u16, u16) = (0, 0);

/// The recipe on the members of `cluster`.
fn recipe(cluster: &etcd::Cluster) -> Arc<Cluster> {
    let endpoints = cluster.members.iter().map(|m| m.client.clone()).collect();
    Arc::new(Cluster::new(Members::new(endpoints, S, None)))
}

fn key(name: &str) -> Key {
    Key::new(name).unwrap()
}

static OWNER: AtomicU64 = AtomicU64::new(1);

/// One acquire as the client would make it: a fresh owner, `wait`
/// (zero: one attempt), the operation deadline 5 s after the wait.
fn acquire(
    recipe: &Arc<Cluster>,
    name: &str,
    (limit, take): (u16, u16),
    wait: Duration,
    lease_s: u8,
) -> Result<Outcome, LimitMismatch> {
    let claim = Claim {
        limit,
        take,
        label: format!("test {name}"),
        ..Claim::default()
    };
    let wait_until = Instant::now() + wait;
    recipe.acquire(
        key(name),
        OWNER.fetch_add(1, Ordering::Relaxed),
        &claim,
        lease_s,
        (!wait.is_zero()).then_some(wait_until),
        wait_until + 5 * S,
    )
}

/// The token of an acquire that must be granted.
fn granted(outcome: Result<Outcome, LimitMismatch>) -> u64 {
    match outcome {
        Ok(Outcome::Acquired { token, .. }) => token,
        other => panic!("expected a grant, got {other:?}"),
    }
}

fn release(recipe: &Arc<Cluster>, name: &str, token: u64) {
    let outcome = recipe.release(key(name), token, Instant::now() + 5 * S);
    assert_eq!(outcome, Outcome::Released, "release {token} of {name}");
}

fn status(recipe: &Arc<Cluster>, name: &str) -> KeyStatus {
    match recipe.query(key(name), Instant::now() + 5 * S) {
        Outcome::Query(status) => status,
        other => panic!("query {name}: {other:?}"),
    }
}

/// How many entries the key has in etcd, waiting or holding.
fn entry_count(recipe: &Arc<Cluster>, name: &str) -> usize {
    let body = range_body(&prefix(key(name)), 0, "ASCEND", 0);
    let (_, value) = recipe
        .read("/v3/kv/range", &body, Instant::now() + 5 * S)
        .unwrap_or_else(|_| panic!("range of {name}"));
    entries(&value, EtcdLayout::Kunci).expect("entries").len()
}

/// Waits until `name` has `count` entries that do not hold.
fn until_queued(recipe: &Arc<Cluster>, name: &str, count: u32) {
    let give_up = Instant::now() + 5 * S;
    while status(recipe, name).waiters < count {
        assert!(
            Instant::now() < give_up,
            "{name}: waiter {count} never queued"
        );
        std::thread::sleep(10 * MS);
    }
}

/// A waiting acquire on its own thread; its token is pushed to `log`
/// with its `index` when granted.
fn waiter(
    recipe: &Arc<Cluster>,
    name: &'static str,
    permits: (u16, u16),
    index: usize,
    log: &Arc<Mutex<Vec<(usize, u64)>>>,
) -> std::thread::JoinHandle<u64> {
    let (recipe, log) = (recipe.clone(), log.clone());
    std::thread::spawn(move || {
        let token = granted(acquire(&recipe, name, permits, 20 * S, 30));
        log.lock().unwrap().push((index, token));
        token
    })
}

fn indices(log: &Mutex<Vec<(usize, u64)>>) -> Vec<usize> {
    log.lock()
        .unwrap()
        .iter()
        .map(|(index, _)| *index)
        .collect()
}

#[test]
fn etcd_semaphore_of_2_never_overlaps_more_than_2_and_grants_in_fifo_order() {
    if !tool::require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = etcd::Cluster::start(3);
    let recipe = recipe(&cluster);
    let semaphore = (2, 1);

    // Three contenders in loops: never more than two inside at once, and
    // two at once at some point (the semaphore does share).
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let loops: Vec<_> = (0..3)
        .map(|_| {
            let (recipe, inside, most) = (recipe.clone(), inside.clone(), most.clone());
            std::thread::spawn(move || {
                for _ in 0..5 {
                    let token = granted(acquire(&recipe, "sem", semaphore, 20 * S, 10));
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(60 * MS);
                    inside.fetch_sub(1, Ordering::SeqCst);
                    release(&recipe, "sem", token);
                }
            })
        })
        .collect();
    for each in loops {
        each.join().unwrap();
    }
    assert_eq!(
        most.load(Ordering::SeqCst),
        2,
        "overlap past the limit, or none"
    );
    assert_eq!(entry_count(&recipe, "sem"), 0);

    // FIFO: with both permits held, three waiters queue in order; each
    // release lets in exactly the next one, with increasing tokens.
    let first = granted(acquire(&recipe, "fifo", semaphore, Duration::ZERO, 30));
    let second = granted(acquire(&recipe, "fifo", semaphore, Duration::ZERO, 30));
    let log = Arc::new(Mutex::new(Vec::new()));
    let waiters: Vec<_> = (0..3)
        .map(|index| {
            let handle = waiter(&recipe, "fifo", semaphore, index, &log);
            until_queued(&recipe, "fifo", index as u32 + 1);
            handle
        })
        .collect();
    // Query reports the grant with the smallest token.
    let seen = status(&recipe, "fifo");
    assert_eq!((seen.token, seen.waiters), (first, 3));
    // The earlier permit goes first: the waiter must see it, though the
    // entry just before its own (the later permit) stays.
    release(&recipe, "fifo", first);
    let give_up = Instant::now() + 5 * S;
    while indices(&log).is_empty() {
        assert!(Instant::now() < give_up, "no waiter granted");
        std::thread::sleep(10 * MS);
    }
    std::thread::sleep(300 * MS);
    assert_eq!(indices(&log), [0], "one permit freed, one waiter in");
    assert_eq!(status(&recipe, "fifo").waiters, 2);
    // The waiters keep what they get: each release lets in one more.
    let mut waiters = waiters.into_iter();
    let mut tokens = vec![waiters.next().unwrap().join().unwrap()];
    release(&recipe, "fifo", second);
    tokens.push(waiters.next().unwrap().join().unwrap());
    assert_eq!(indices(&log), [0, 1]);
    assert!(first < second);
    release(&recipe, "fifo", tokens[0]);
    tokens.push(waiters.next().unwrap().join().unwrap());
    assert_eq!(indices(&log), [0, 1, 2]);
    assert!(second < tokens[0] && tokens.windows(2).all(|t| t[0] < t[1]));
    release(&recipe, "fifo", tokens[1]);
    release(&recipe, "fifo", tokens[2]);
    assert_eq!(entry_count(&recipe, "fifo"), 0);
}

#[test]
fn etcd_readers_share_and_a_queued_writer_goes_before_later_readers() {
    if !tool::require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = etcd::Cluster::start(3);
    let recipe = recipe(&cluster);
    let r1 = granted(acquire(&recipe, "rw", SHARED, Duration::ZERO, 30));
    let r2 = granted(acquire(&recipe, "rw", SHARED, Duration::ZERO, 30));
    assert!(r1 < r2);
    let log = Arc::new(Mutex::new(Vec::new()));
    let writer = waiter(&recipe, "rw", WRITER, 0, &log);
    until_queued(&recipe, "rw", 1);
    // A reader after the writer waits, though only readers hold.
    let late_reader = waiter(&recipe, "rw", SHARED, 1, &log);
    until_queued(&recipe, "rw", 2);
    assert_eq!(
        acquire(&recipe, "rw", SHARED, Duration::ZERO, 30),
        Ok(Outcome::Timeout)
    );
    let seen = status(&recipe, "rw");
    assert_eq!((seen.token, seen.waiters), (r1, 2));

    release(&recipe, "rw", r1);
    std::thread::sleep(300 * MS);
    assert!(indices(&log).is_empty(), "granted while reader {r2} holds");
    release(&recipe, "rw", r2);
    let w = writer.join().unwrap();
    assert!(w > r2, "the writer's token is above every earlier grant");
    std::thread::sleep(300 * MS);
    assert_eq!(indices(&log), [0], "no reader in with the writer");
    assert_eq!(status(&recipe, "rw").waiters, 1);
    release(&recipe, "rw", w);
    let r3 = late_reader.join().unwrap();
    assert!(r3 > w);
    // Readers share again, with the late reader holding.
    let r4 = granted(acquire(&recipe, "rw", SHARED, Duration::ZERO, 30));
    release(&recipe, "rw", r3);
    release(&recipe, "rw", r4);
    assert_eq!(entry_count(&recipe, "rw"), 0);
}

#[test]
fn etcd_a_different_limit_is_a_mismatch_and_leaves_nothing() {
    if !tool::require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = etcd::Cluster::start(3);
    let recipe = recipe(&cluster);
    let holder = granted(acquire(&recipe, "lim", (3, 3), Duration::ZERO, 30));
    // Queued behind a full semaphore with the key's limit.
    let log = Arc::new(Mutex::new(Vec::new()));
    let queued = waiter(&recipe, "lim", (3, 1), 0, &log);
    until_queued(&recipe, "lim", 1);
    for wait in [Duration::ZERO, 2 * S] {
        let started = Instant::now();
        assert_eq!(
            acquire(&recipe, "lim", (2, 1), wait, 30),
            Err(LimitMismatch { limit: 3 })
        );
        assert!(started.elapsed() < S, "a mismatch is said at once");
        assert_eq!(entry_count(&recipe, "lim"), 2, "nothing left behind");
    }
    // A writer that names another limit mismatches too; one that names
    // none never does (it only waits).
    assert_eq!(
        acquire(&recipe, "lim", (4, 0), Duration::ZERO, 30),
        Err(LimitMismatch { limit: 3 })
    );
    assert_eq!(
        acquire(&recipe, "lim", WRITER, Duration::ZERO, 30),
        Ok(Outcome::Timeout)
    );
    release(&recipe, "lim", holder);
    let token = queued.join().unwrap();
    release(&recipe, "lim", token);
    // Once the key has no entry, the next request sets a new limit.
    let again = granted(acquire(&recipe, "lim", (2, 1), Duration::ZERO, 30));
    assert_eq!(
        acquire(&recipe, "lim", (3, 1), Duration::ZERO, 30),
        Err(LimitMismatch { limit: 2 })
    );
    release(&recipe, "lim", again);
}

#[test]
fn etcd_permits_zero_wait_takes_room_or_times_out_leaving_nothing() {
    if !tool::require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = etcd::Cluster::start(3);
    let recipe = recipe(&cluster);
    let first = granted(acquire(&recipe, "room", (2, 1), Duration::ZERO, 30));
    // Room for one more: granted at once, without waiting.
    let second = granted(acquire(&recipe, "room", (2, 1), Duration::ZERO, 30));
    assert!(second > first);
    // Full: a zero wait is Timeout and puts nothing; a wait runs out and
    // removes its entry.
    let started = Instant::now();
    assert_eq!(
        acquire(&recipe, "room", (2, 1), Duration::ZERO, 30),
        Ok(Outcome::Timeout)
    );
    assert!(started.elapsed() < S);
    assert_eq!(entry_count(&recipe, "room"), 2);
    let started = Instant::now();
    assert_eq!(
        acquire(&recipe, "room", (2, 2), 600 * MS, 30),
        Ok(Outcome::Timeout)
    );
    assert!(started.elapsed() >= 600 * MS && started.elapsed() < 2 * S);
    assert_eq!(entry_count(&recipe, "room"), 2);
    // Invalid claims are refused before anything is sent.
    assert_eq!(
        acquire(&recipe, "room", (1, 2), Duration::ZERO, 30),
        Ok(Outcome::Invalid("take is more than the limit"))
    );
    // A token that only waits is not held: it cannot be released.
    let log = Arc::new(Mutex::new(Vec::new()));
    let queued = waiter(&recipe, "room", (2, 1), 0, &log);
    until_queued(&recipe, "room", 1);
    let waiting = latest_revision(&recipe, "room");
    assert_eq!(
        recipe.release(key("room"), waiting, Instant::now() + 5 * S),
        Outcome::NotHeld
    );
    release(&recipe, "room", first);
    assert_eq!(queued.join().unwrap(), waiting);
    release(&recipe, "room", second);
    release(&recipe, "room", waiting);
    assert_eq!(entry_count(&recipe, "room"), 0);
}

/// The create revision of the latest entry of `name`: the token its
/// acquire gets when granted.
fn latest_revision(recipe: &Arc<Cluster>, name: &str) -> u64 {
    let body = range_body(&prefix(key(name)), 1, "DESCEND", 0);
    let (_, value) = recipe
        .read("/v3/kv/range", &body, Instant::now() + 5 * S)
        .unwrap_or_else(|_| panic!("range of {name}"));
    let latest = entries(&value, EtcdLayout::Kunci).expect("entries");
    latest[0].create_revision as u64
}

#[test]
fn etcd_an_expired_permit_frees_only_its_own_take() {
    if !tool::require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = etcd::Cluster::start(3);
    let recipe = recipe(&cluster);
    let lease = 2 * S;
    let sent = Instant::now();
    let short = granted(acquire(&recipe, "exp", (3, 2), Duration::ZERO, 2));
    let long = granted(acquire(&recipe, "exp", (3, 1), Duration::ZERO, 30));
    // Needs 2 of 3 while 3 are taken: in when the short lease ends.
    let next = granted(acquire(&recipe, "exp", (3, 2), 10 * S, 30));
    let taken_over = Instant::now();
    assert!(
        taken_over - sent >= lease,
        "ended early: {:?}",
        taken_over - sent
    );
    assert!(
        taken_over - sent < lease + 2 * S,
        "ended late: {:?}",
        taken_over - sent
    );
    // The long permit still holds, and the key is full again.
    assert_eq!(status(&recipe, "exp").token, long);
    assert_eq!(
        acquire(&recipe, "exp", (3, 1), Duration::ZERO, 30),
        Ok(Outcome::Timeout)
    );
    assert_eq!(
        recipe.release(key("exp"), short, Instant::now() + 5 * S),
        Outcome::NotHeld
    );
    release(&recipe, "exp", long);
    release(&recipe, "exp", next);
}

/// An acquire with this exact claim: a fresh owner, returned with the
/// outcome.
fn acquire_claim(
    recipe: &Arc<Cluster>,
    name: &str,
    claim: &Claim,
    wait: Duration,
    lease_s: u8,
) -> (u64, Outcome) {
    let owner = OWNER.fetch_add(1, Ordering::Relaxed);
    let wait_until = Instant::now() + wait;
    let outcome = recipe
        .acquire(
            key(name),
            owner,
            claim,
            lease_s,
            (!wait.is_zero()).then_some(wait_until),
            wait_until + 5 * S,
        )
        .expect("no limit mismatch");
    (owner, outcome)
}

fn who(recipe: &Arc<Cluster>, name: &str) -> Holders {
    match recipe.holders(key(name), Instant::now() + 5 * S) {
        Outcome::Holders(holders) => holders,
        other => panic!("holders of {name}: {other:?}"),
    }
}

#[test]
fn etcd_who_lists_grants_in_token_order_then_waiters_in_queue_order_with_their_labels() {
    if !tool::require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = etcd::Cluster::start(3);
    let recipe = recipe(&cluster);
    let claim = |take: u16, label: &str| Claim {
        limit: 3,
        take,
        label: label.to_owned(),
        ..Claim::default()
    };
    // Labels come back byte for byte: UTF-8, runs of spaces, a trailing
    // space, digits that look like fields.
    let labels = [
        "alice@host pid=7 backup  --full ",
        "bob ütf-8 ✓ 1 2 3",
        "",
        "dave",
    ];
    let (first_owner, first) =
        acquire_claim(&recipe, "who", &claim(1, labels[0]), Duration::ZERO, 30);
    let (second_owner, second) =
        acquire_claim(&recipe, "who", &claim(2, labels[1]), Duration::ZERO, 30);
    let (Outcome::Acquired { token: first, .. }, Outcome::Acquired { token: second, .. }) =
        (&first, &second)
    else {
        panic!("both fit: {first:?} {second:?}");
    };
    let (first, second) = (*first, *second);
    // Two waiters, queued in this order: a counted one without a label,
    // then an exclusive one (`A` with a label).
    let (owners, queued): (Vec<_>, Vec<_>) = [
        (claim(1, labels[2]), 1u32),
        (
            Claim {
                limit: 0,
                take: 0,
                label: labels[3].into(),
                ..Claim::default()
            },
            2,
        ),
    ]
    .into_iter()
    .map(|(claim, position)| {
        let owner = OWNER.fetch_add(1, Ordering::Relaxed);
        let recipe_for_waiter = recipe.clone();
        let handle = std::thread::spawn(move || {
            let wait_until = Instant::now() + 3 * S;
            recipe_for_waiter.acquire(
                key("who"),
                owner,
                &claim,
                30,
                Some(wait_until),
                wait_until + 5 * S,
            )
        });
        until_queued(&recipe, "who", position);
        (owner, handle)
    })
    .unzip();

    let seen = who(&recipe, "who");
    let lease_left: Vec<_> = seen.grants.iter().map(|grant| grant.lease_left).collect();
    for left in &lease_left {
        // etcd reports whole seconds, rounded down.
        assert!((28 * S..=30 * S).contains(left), "lease left {left:?}");
        assert_eq!(left.subsec_nanos(), 0);
    }
    assert_eq!(
        seen,
        Holders {
            grants: vec![
                Grant {
                    token: first,
                    owner: first_owner,
                    take: 1,
                    lease_left: lease_left[0],
                    held_for: Duration::ZERO,
                    label: labels[0].into(),
                },
                Grant {
                    token: second,
                    owner: second_owner,
                    take: 2,
                    lease_left: lease_left[1],
                    held_for: Duration::ZERO,
                    label: labels[1].into(),
                },
            ],
            waiters: vec![
                Waiter {
                    owner: owners[0],
                    take: 1,
                    wait_left: Duration::ZERO,
                    label: String::new(),
                },
                Waiter {
                    owner: owners[1],
                    take: 0,
                    wait_left: Duration::ZERO,
                    label: labels[3].into(),
                },
            ],
            left_out: 0,
        }
    );
    for handle in queued {
        assert_eq!(handle.join().unwrap(), Ok(Outcome::Timeout));
    }
    release(&recipe, "who", first);
    release(&recipe, "who", second);
    assert_eq!(who(&recipe, "who"), Holders::default());
}

#[test]
fn etcd_who_never_lists_a_grant_whose_lease_ran_out() {
    if !tool::require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = etcd::Cluster::start(3);
    let recipe = recipe(&cluster);
    let claim = Claim {
        label: "forgotten".into(),
        ..Claim::default()
    };
    let (owner, outcome) = acquire_claim(&recipe, "expiring", &claim, Duration::ZERO, 2);
    let answered = Instant::now();
    let Outcome::Acquired { token, .. } = outcome else {
        panic!("free key: {outcome:?}");
    };
    let seen = who(&recipe, "expiring");
    assert_eq!(seen.grants.len(), 1);
    assert_eq!((seen.grants[0].token, seen.grants[0].owner), (token, owner));
    // Nobody renews it. The lease started before the answer, so from
    // `answered + 2 s` on it has run out: no look may list it as held,
    // whether or not etcd has deleted the entry yet.
    std::thread::sleep((answered + 2 * S).saturating_duration_since(Instant::now()));
    let mut looks = 0;
    while Instant::now() < answered + 4 * S {
        let seen = who(&recipe, "expiring");
        assert!(
            seen.grants.is_empty(),
            "an expired lease is listed as held: {seen:?}"
        );
        looks += 1;
    }
    assert!(looks >= 10, "only {looks} looks");
}

/// Every key of a listing that starts with `prefix`, `count` entries per
/// page, following the cursor; and how many pages it took.
fn list_all(recipe: &Arc<Cluster>, prefix_text: &str, count: u16) -> (Vec<KeySummary>, usize) {
    let prefix_key = if prefix_text.is_empty() {
        Key::EMPTY
    } else {
        key(prefix_text)
    };
    let (mut keys, mut pages, mut cursor) = (Vec::new(), 0, 0);
    loop {
        let outcome = recipe.list(prefix_key, cursor, count, Instant::now() + 5 * S);
        let Outcome::Keys(KeyPage { keys: page, next }) = outcome else {
            panic!("list {prefix_text:?} from {cursor}: {outcome:?}");
        };
        assert!(page.len() <= usize::from(count));
        keys.extend(page);
        pages += 1;
        if next == 0 {
            return (keys, pages);
        }
        assert!(pages < 1000, "the listing does not end");
        cursor = next;
    }
}

#[test]
fn etcd_list_pages_through_more_keys_than_one_page_each_once() {
    if !tool::require_tool("etcd", "etcd-server") {
        return;
    }
    let cluster = etcd::Cluster::start(3);
    let recipe = recipe(&cluster);
    // 23 plain keys under `pg/`, keys elsewhere, and one key with three
    // entries (two grants of a semaphore of 2 and a waiter), which a page
    // of fewer entries than that must not cut.
    let mut expected = Vec::new();
    for index in 0..23 {
        let name = format!("pg/{index}");
        granted(acquire(&recipe, &name, WRITER, Duration::ZERO, 30));
        expected.push(KeySummary {
            key: name,
            grants: 1,
            waiters: 0,
            limit: 0,
        });
    }
    for name in ["other/1", "pg", "p"] {
        granted(acquire(&recipe, name, WRITER, Duration::ZERO, 30));
    }
    let semaphore = (2, 1);
    granted(acquire(&recipe, "pg/sem", semaphore, Duration::ZERO, 30));
    granted(acquire(&recipe, "pg/sem", semaphore, Duration::ZERO, 30));
    let recipe_for_waiter = recipe.clone();
    let waiting =
        std::thread::spawn(move || acquire(&recipe_for_waiter, "pg/sem", semaphore, 4 * S, 30));
    until_queued(&recipe, "pg/sem", 1);
    expected.push(KeySummary {
        key: "pg/sem".into(),
        grants: 2,
        waiters: 1,
        limit: 2,
    });
    expected.sort_by(|a, b| a.key.cmp(&b.key));

    for count in [1, 7, 1000] {
        let (mut keys, pages) = list_all(&recipe, "pg/", count);
        keys.sort_by(|a, b| a.key.cmp(&b.key));
        assert_eq!(keys, expected, "count {count}");
        if count < 1000 {
            assert!(
                pages > 24 / usize::from(count),
                "count {count}: {pages} pages"
            );
        } else {
            assert_eq!(pages, 1);
        }
    }
    let (every, _) = list_all(&recipe, "", 5);
    assert_eq!(every.len(), expected.len() + 3);
    assert_eq!(
        recipe.list(Key::EMPTY, 123_456, 10, Instant::now() + 5 * S),
        Outcome::Invalid("unknown or forgotten listing cursor")
    );
    assert_eq!(waiting.join().unwrap(), Ok(Outcome::Timeout));
}

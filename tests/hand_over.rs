//! Spec §4 (v5): a hand-over to many waiters is work one event sets off,
//! bounded per turn like the rest. Issue 38, finding 3: 16 pipelined `R`
//! handing shared keys to 262,144 waiters stalled the loop ~106 ms. Here,
//! on the sans-IO core and a fake clock: the grants go out over bounded
//! turns, in queue order with increasing tokens (§10.4), none to a waiter
//! whose connection closed meanwhile, a release's own answer first (§2.3).

use std::collections::HashMap;

use kunci::core::{ConnId, Core, Limits, Micros, TURN_WORK};
use kunci::protocol::{Request, Response, SHARED_LIMIT};

use crate::util::fake::{FIRST_TOKEN, MS, S};

const KEYS: u64 = 16;
const PER_KEY: u64 = 16_384;
const WAITERS: u64 = KEYS * PER_KEY;
/// Reader connections 1..=64, 4,096 waits each (the default per-conn cap).
const READER_CONNS: u64 = 64;
/// Owners of the writer's grants; waiter `i` has owner `i + 1`.
const WRITER_OWNER: u64 = 1 << 40;

fn key(k: u64) -> String {
    format!("shared-{k:02}")
}

fn shared(core: &mut Core, conn: ConnId, owner: u64, key: &str, take: u16, wait_s: u8) {
    let request = Request::Acquire {
        wait_s,
        lease_s: 60,
        owner,
        key,
        limit: SHARED_LIMIT,
        take,
        label: "",
    };
    core.handle_request(conn, &request, 0);
}

/// A core with connections `0..conns` whose shared key "k" is held by a
/// writer (conn 0, owner 2^40, token `FIRST_TOKEN`, a 60 s lease).
fn writer_holding_k(conns: ConnId) -> Core {
    let mut core = Core::new(Limits::default(), FIRST_TOKEN);
    for conn in 0..conns {
        core.connect(conn);
    }
    shared(&mut core, 0, 1 << 40, "k", 0, 0);
    core
}

/// In a new turn, the writer of [`writer_holding_k`] releases "k" at `at`.
fn writer_releases_k(core: &mut Core, at: Micros) {
    core.begin_turn();
    let release = Request::Release {
        token: FIRST_TOKEN,
        key: "k",
    };
    core.handle_request(0, &release, at);
}

/// Queues `n` readers of "k" (owners 1..=n, on connections 1..=4 in turn),
/// each waiting `wait_s` from 0.
fn readers_of_k(core: &mut Core, n: u64, wait_s: u8) {
    for i in 0..n {
        shared(core, 1 + (i % 4) as ConnId, i + 1, "k", 1, wait_s);
    }
}

/// The connection of waiter `i`: waiter 0 is the writer's own (conn 0), so
/// that its release answers first on a connection it also hands a grant to.
fn conn_of(i: u64) -> ConnId {
    if i == 0 {
        0
    } else {
        1 + (i % READER_CONNS) as ConnId
    }
}

/// A core whose 16 shared keys are each held by the writer (conn 0,
/// exclusive) with 16,384 readers queued behind it.
fn sixteen_held_keys_with_262144_waiters() -> Core {
    let mut core = Core::new(Limits::default(), FIRST_TOKEN);
    for conn in 0..=READER_CONNS as ConnId + 1 {
        core.connect(conn);
    }
    for k in 0..KEYS {
        shared(&mut core, 0, WRITER_OWNER + k, &key(k), 0, 0);
    }
    for i in 0..WAITERS {
        shared(&mut core, conn_of(i), i + 1, &key(i / PER_KEY), 1, 60);
    }
    let out: Vec<_> = core.drain_outbox().collect();
    assert_eq!(out.len(), KEYS as usize, "{:?}", &out[KEYS as usize..]);
    assert_eq!(core.waiter_count(), WAITERS as usize);
    core
}

fn release(core: &mut Core, k: u64) {
    let request = Request::Release {
        token: FIRST_TOKEN + k,
        key: &key(k),
    };
    core.handle_request(0, &request, MS);
}

/// Grants seen so far: owner → (token, connection), and the order checks.
#[derive(Default)]
struct Grants {
    by_owner: HashMap<u64, (u64, ConnId)>,
    last_token: u64,
    /// Per key, the last owner granted (queue order).
    last_owner: HashMap<u64, u64>,
}

impl Grants {
    /// Takes one turn's output; returns how many grants it held.
    fn take(&mut self, out: &[(ConnId, Response)]) -> usize {
        let mut count = 0;
        for (conn, response) in out {
            let &Response::Acquired { owner, token } = response else {
                continue;
            };
            count += 1;
            let i = owner - 1;
            assert_eq!(*conn, conn_of(i), "owner {owner} granted on another conn");
            assert!(
                token > self.last_token,
                "token {token} after {}",
                self.last_token
            );
            self.last_token = token;
            let k = i / PER_KEY;
            let last = self.last_owner.insert(k, owner).unwrap_or(0);
            assert!(owner > last, "key {k}: owner {owner} granted after {last}");
            assert!(self.by_owner.insert(owner, (token, *conn)).is_none());
        }
        count
    }
}

#[test]
fn sixteen_releases_hand_262144_waiters_their_grants_over_bounded_turns() {
    let mut core = sixteen_held_keys_with_262144_waiters();
    let budget = TURN_WORK as usize;
    let mut grants = Grants::default();

    core.begin_turn();
    for k in 0..KEYS {
        release(&mut core, k);
    }
    let first: Vec<_> = core.drain_outbox().collect();
    // Every R answered, in request order, the first before the grant it
    // made on its own connection (§2.3).
    let released: Vec<usize> = (0..KEYS)
        .map(|k| {
            let answer = (
                0,
                Response::Released {
                    token: FIRST_TOKEN + k,
                },
            );
            first
                .iter()
                .position(|out| *out == answer)
                .expect("R answered")
        })
        .collect();
    assert!(released.windows(2).all(|w| w[0] < w[1]), "{released:?}");
    let own_grant = first
        .iter()
        .position(|out| matches!(out, (0, Response::Acquired { owner: 1, .. })))
        .expect("waiter 0 granted in the first turn");
    assert!(released[0] < own_grant);
    // The first key's scan spent the turn; every other R made one grant,
    // so that its key's current token is set (§13.1).
    let made = grants.take(&first);
    assert_eq!(made, budget + KEYS as usize - 1);
    assert_eq!(core.hand_overs_pending(), KEYS as usize);
    core.check_invariants();

    // Connection 64 goes away before its waiters' turn: none of them is
    // granted later, and its leaving grants nothing out of turn.
    let closed: ConnId = READER_CONNS as ConnId;
    core.disconnect(closed, MS);
    assert_eq!(core.drain_outbox().count(), 0);
    core.check_invariants();
    let closed_waiters = (0..WAITERS)
        .filter(|&i| conn_of(i) == closed && !grants.by_owner.contains_key(&(i + 1)))
        .count();
    assert!(closed_waiters > 4_000, "{closed_waiters}");

    let mut turns = 1;
    while core.poll_timeout() == Some(0) {
        core.begin_turn();
        core.handle_timeout(2 * MS);
        let out: Vec<_> = core.drain_outbox().collect();
        let made = grants.take(&out);
        assert_eq!(made, out.len(), "only grants go out");
        assert!(
            out.iter().all(|(conn, _)| *conn != closed),
            "a waiter of the closed connection was granted"
        );
        assert!(made > 0 && made <= budget, "turn {turns}: {made} grants");
        if turns % 8 == 0 {
            core.check_invariants();
        }
        turns += 1;
        assert!(turns < 200, "the hand-over never ends");
    }
    core.check_invariants();
    let expected = WAITERS as usize - closed_waiters;
    assert_eq!(grants.by_owner.len(), expected);
    assert_eq!(
        turns,
        (expected - (budget + KEYS as usize - 1)).div_ceil(budget) + 1
    );
    assert_eq!(core.waiter_count(), 0);
    assert_eq!(core.grants_held(), expected);
    assert_eq!(core.hand_overs_pending(), 0);
    // Nothing is left to do before the leases' end.
    assert!(core.poll_timeout().is_some_and(|next| next > 2 * MS));
}

/// A request on a key still handing on joins the tail (strict FIFO,
/// §10.4): `wait=0` gets `T`, a waiting one is granted after every waiter
/// that was there, with a larger token.
#[test]
fn a_request_on_a_key_still_handing_on_waits_its_turn() {
    let mut core = writer_holding_k(6);
    let n = 3 * u64::from(TURN_WORK);
    readers_of_k(&mut core, n, 60);
    core.drain_outbox().for_each(drop);
    writer_releases_k(&mut core, MS);
    assert_eq!(core.drain_outbox().count(), 1 + TURN_WORK as usize);
    shared(&mut core, 5, 7_000_000, "k", 1, 0);
    shared(&mut core, 5, 7_000_001, "k", 1, 60);
    assert_eq!(
        core.drain_outbox().collect::<Vec<_>>(),
        vec![(5, Response::Timeout { owner: 7_000_000 })]
    );
    let mut last = (0, 0);
    let mut late = None;
    while core.poll_timeout() == Some(0) {
        core.begin_turn();
        core.handle_timeout(MS);
        for (conn, response) in core.drain_outbox() {
            let Response::Acquired { owner, token } = response else {
                panic!("{response:?}");
            };
            assert!(owner > last.0 && token > last.1);
            last = (owner, token);
            if conn == 5 {
                late = Some(owner);
            }
        }
        core.check_invariants();
    }
    assert_eq!(late, Some(7_000_001), "the late reader was not granted");
    assert_eq!(core.grants_held() as u64, n + 1);
}

/// The same bound holds for a hand-over set off by a lease's end (a timer,
/// not a request): the writer's lease ends and its readers are granted
/// over bounded turns, none before the lease's end.
#[test]
fn an_expiry_handing_a_key_to_many_waiters_goes_on_over_bounded_turns() {
    let mut core = Core::new(Limits::default(), FIRST_TOKEN);
    for conn in 0..5 {
        core.connect(conn);
    }
    let request = Request::Acquire {
        wait_s: 0,
        lease_s: 1,
        owner: 1 << 40,
        key: "k",
        limit: SHARED_LIMIT,
        take: 0,
        label: "",
    };
    core.handle_request(0, &request, 0);
    let n = 4 * u64::from(TURN_WORK);
    readers_of_k(&mut core, n, 60);
    core.drain_outbox().for_each(drop);
    core.begin_turn();
    core.handle_timeout(S - 1);
    assert_eq!(
        core.drain_outbox().count(),
        0,
        "granted before the lease's end"
    );
    let mut turns = 0;
    let mut granted = 0;
    loop {
        core.begin_turn();
        core.handle_timeout(S);
        let made = core.drain_outbox().count();
        assert!(made <= TURN_WORK as usize, "{made}");
        granted += made;
        turns += 1;
        if core.poll_timeout() != Some(0) {
            break;
        }
    }
    assert_eq!(granted as u64, n);
    assert_eq!(turns, n.div_ceil(u64::from(TURN_WORK)) as usize + 1);
    core.check_invariants();
}

/// A waiter whose deadline passes while its key is still handing on gets
/// `T`, never a grant after its deadline (§3): the turns that go on with
/// the hand-over past its deadline's tick answer it `T`, as its timer
/// would.
#[test]
fn a_waiter_whose_deadline_passes_mid_hand_over_gets_t_not_a_late_grant() {
    let mut core = writer_holding_k(5);
    // Every reader waits 1 s from 0: deadline S.
    let n = 3 * u64::from(TURN_WORK);
    readers_of_k(&mut core, n, 1);
    core.drain_outbox().for_each(drop);
    writer_releases_k(&mut core, S - MS);
    assert_eq!(core.drain_outbox().count(), 1 + TURN_WORK as usize);
    core.check_invariants();
    let (mut timeouts, mut turns) = (0, 0);
    let late = S + MS;
    while core.poll_timeout().is_some_and(|due| due <= late) {
        core.begin_turn();
        core.handle_timeout(late);
        for (_, response) in core.drain_outbox() {
            match response {
                Response::Timeout { .. } => timeouts += 1,
                other => panic!("after the readers' deadline: {other:?}"),
            }
        }
        core.check_invariants();
        turns += 1;
        assert!(turns < 10, "never done");
    }
    assert_eq!(timeouts, n - u64::from(TURN_WORK));
    assert_eq!(core.waiter_count(), 0);
}

/// The timers due meanwhile fire before a hand-over goes on (spec §4, v5:
/// a lease ends within 10 ms of its deadline): another key's lease ends in
/// the first turn at its deadline, not after the whole hand-over.
#[test]
fn another_keys_lease_ends_on_time_while_a_hand_over_goes_on() {
    let mut core = writer_holding_k(5);
    let other = Request::Acquire {
        wait_s: 0,
        lease_s: 1,
        owner: 1 << 41,
        key: "other",
        limit: 0,
        take: 0,
        label: "",
    };
    core.handle_request(0, &other, 0);
    let n = 4 * u64::from(TURN_WORK);
    readers_of_k(&mut core, n, 60);
    core.drain_outbox().for_each(drop);
    writer_releases_k(&mut core, S - MS);
    core.drain_outbox().for_each(drop);
    assert_eq!(core.hand_overs_pending(), 1);
    core.begin_turn();
    core.handle_timeout(S);
    core.drain_outbox().for_each(drop);
    assert_eq!(core.hand_overs_pending(), 1, "the hand-over goes on");
    core.handle_request(0, &Request::Query { key: "other" }, S);
    assert_eq!(
        core.drain_outbox().collect::<Vec<_>>(),
        vec![(
            0,
            Response::Query {
                token: 0,
                owner: 0,
                lease_ms: 0,
                waiters: 0
            }
        )],
        "the lease of \"other\" did not end at its deadline"
    );
    core.check_invariants();
}

/// A scan with the turn's work spent goes on past waiters answered `B`
/// (spec §7.6, a state file that cannot be written) until it has granted
/// one: a key is never left handing on with no grant at all (token 0, not
/// held, its fitting waiters kept waiting).
#[test]
fn a_scan_past_its_work_that_only_answered_b_still_grants_one() {
    use kunci::core::restart::Promise;
    let mut core = writer_holding_k(5);
    shared(&mut core, 0, 1 << 41, "k2", 0, 0);
    let n = 2 * u64::from(TURN_WORK);
    readers_of_k(&mut core, n, 60);
    // Behind k2's writer: a reader whose lease the file does not promise,
    // then one whose lease it does.
    shared(&mut core, 1, 1 << 42, "k2", 1, 60);
    let reader = Request::Acquire {
        wait_s: 60,
        lease_s: 1,
        owner: 1 << 43,
        key: "k2",
        limit: SHARED_LIMIT,
        take: 1,
        label: "",
    };
    core.handle_request(2, &reader, 0);
    core.drain_outbox().for_each(drop);
    core.set_ceiling(Some(Promise {
        token_high_water: u64::MAX - 1,
        horizon: 10 * S,
        counted_grants: true,
        macs_until: 0,
    }));
    // The first release spends the turn's work...
    writer_releases_k(&mut core, MS);
    core.drain_outbox().for_each(drop);
    // ...then the second answers its head `B` and grants the next.
    let release = Request::Release {
        token: FIRST_TOKEN + 1,
        key: "k2",
    };
    core.handle_request(0, &release, MS);
    let out: Vec<_> = core.drain_outbox().collect();
    assert_eq!(
        out[..2],
        [
            (
                0,
                Response::Released {
                    token: FIRST_TOKEN + 1
                }
            ),
            (1, Response::Busy { owner: 1 << 42 }),
        ]
    );
    assert!(
        matches!(out[2..], [(2, Response::Acquired { owner, .. })] if owner == 1 << 43),
        "{out:?}"
    );
    core.check_invariants();
}

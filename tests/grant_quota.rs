//! `max-grants=N` of the `--auth` file (issue 27) in the sans-IO core on a
//! fake clock: an identity's grants plus queued waiters, charged when its
//! `A`/`S` makes one, carried from a waiter into its grant, and returned on
//! every way a grant or waiter ends. The core's invariants (every charge of
//! a live grant or waiter, each count its charges and within its quota)
//! run after every step.

use kunci::core::access::{AccessList, Identity, hash_hex};
use kunci::core::{ConnId, Core, EarlierGrant, Limits, Micros, Output};
use kunci::protocol::{Request, Response};

use crate::util::fake::{FIRST_TOKEN, MS, S};

/// Identity 0: `tenant`, `lock:t/ max-grants=2`.
const TENANT: u32 = 0;
/// Identity 1: `root`, every key, no quota.
const ROOT: u32 = 1;

struct Quota {
    core: Core,
    identities: Vec<Identity>,
    now: Micros,
}

impl Quota {
    /// A core with connections 0..4 open; `max_grants` is `--max-grants`.
    fn new(max_grants: usize) -> Quota {
        let text = format!(
            "tenant {} lock:t/ max-grants=2\nroot {} lock:* info\n",
            hash_hex(b"tenant-secret-0123456789abcdef-0123"),
            hash_hex(b"root-secret-0123456789abcdef-012345"),
        );
        let list = AccessList::parse(&text).unwrap();
        let identities = (0..2).map(|i| list.identity(i).unwrap().clone()).collect();
        let limits = Limits {
            max_grants,
            ..Limits::default()
        };
        let mut core = Core::new(limits, FIRST_TOKEN);
        for conn in 0..4 {
            core.connect(conn);
        }
        Quota {
            core,
            identities,
            now: 0,
        }
    }

    fn request(&mut self, conn: ConnId, who: u32, request: &Request<'_>) -> Vec<Output> {
        let identity = &self.identities[who as usize];
        self.core
            .handle_request_as(conn, request, who, identity, self.now);
        self.core.check_invariants();
        self.core.drain_outbox().collect()
    }

    /// An `S` (`limit` 0: an `A`).
    #[allow(clippy::too_many_arguments)]
    fn ask(
        &mut self,
        conn: ConnId,
        who: u32,
        key: &str,
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        limit: u16,
        take: u16,
    ) -> Vec<Output> {
        let request = Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key,
            limit,
            take,
            label: "",
        };
        self.request(conn, who, &request)
    }

    fn acquire(
        &mut self,
        conn: ConnId,
        who: u32,
        key: &str,
        wait_s: u8,
        owner: u64,
    ) -> Vec<Output> {
        self.ask(conn, who, key, wait_s, 30, owner, 0, 0)
    }

    fn release(&mut self, conn: ConnId, who: u32, key: &str, token: u64) -> Vec<Output> {
        self.request(conn, who, &Request::Release { token, key })
    }

    fn run_until(&mut self, now: Micros) -> Vec<Output> {
        self.now = now;
        self.core.handle_timeout(now);
        self.core.check_invariants();
        self.core.drain_outbox().collect()
    }

    fn charged(&self) -> u32 {
        self.core.grants_charged(TENANT)
    }
}

fn acquired(conn: ConnId, owner: u64, token: u64) -> Vec<Output> {
    vec![(conn, Response::Acquired { owner, token })]
}

fn busy(conn: ConnId, owner: u64) -> Vec<Output> {
    vec![(conn, Response::Busy { owner })]
}

fn released(conn: ConnId, token: u64) -> Vec<Output> {
    vec![(conn, Response::Released { token })]
}

const T: u64 = FIRST_TOKEN;

#[test]
fn grants_at_once_are_charged_and_the_third_gets_b() {
    let mut q = Quota::new(Limits::default().max_grants);
    assert_eq!(q.acquire(0, TENANT, "t/1", 0, 1), acquired(0, 1, T));
    assert_eq!(q.charged(), 1);
    assert_eq!(q.acquire(0, TENANT, "t/2", 5, 2), acquired(0, 2, T + 1));
    assert_eq!(q.charged(), 2);
    // Over the quota: `B` at once, whether it would be granted or queue;
    // nothing is made (the key is not even in the table).
    assert_eq!(q.acquire(0, TENANT, "t/3", 0, 3), busy(0, 3));
    assert_eq!(q.acquire(1, TENANT, "t/3", 9, 4), busy(1, 4));
    assert_eq!(q.core.keys(), 2);
    assert_eq!(q.core.waiter_count(), 0);
    assert_eq!(q.charged(), 2);
    assert_eq!(
        q.acquire(0, ROOT, "t/3", 0, 5),
        acquired(0, 5, T + 2),
        "another identity is not affected"
    );
    assert_eq!(q.core.grants_charged(ROOT), 0);
    // A release returns a grant; then one more fits.
    assert_eq!(q.release(0, TENANT, "t/1", T), released(0, T));
    assert_eq!(q.charged(), 1);
    assert_eq!(q.acquire(0, TENANT, "t/4", 0, 6), acquired(0, 6, T + 3));
    assert_eq!(q.charged(), 2);
}

#[test]
fn a_full_quota_still_answers_t_where_nothing_would_be_made() {
    let mut q = Quota::new(Limits::default().max_grants);
    assert_eq!(q.acquire(0, ROOT, "t/held", 0, 1), acquired(0, 1, T));
    q.acquire(0, TENANT, "t/1", 0, 2);
    q.acquire(0, TENANT, "t/2", 0, 3);
    // wait 0 on a held key: `T`, as without a quota (it would queue
    // nothing); with a wait it would queue: `B`.
    assert_eq!(
        q.acquire(0, TENANT, "t/held", 0, 4),
        vec![(0, Response::Timeout { owner: 4 })]
    );
    assert_eq!(q.acquire(0, TENANT, "t/held", 3, 5), busy(0, 5));
}

#[test]
fn a_waiter_is_charged_and_its_charge_follows_it_into_the_grant() {
    let mut q = Quota::new(Limits::default().max_grants);
    assert_eq!(q.acquire(0, ROOT, "t/1", 0, 1), acquired(0, 1, T));
    assert_eq!(q.acquire(1, TENANT, "t/1", 5, 2), vec![]);
    assert_eq!(q.charged(), 1, "a queued waiter counts");
    assert_eq!(q.acquire(1, TENANT, "t/2", 0, 3), acquired(1, 3, T + 1));
    assert_eq!(q.charged(), 2);
    assert_eq!(q.acquire(1, TENANT, "t/3", 0, 4), busy(1, 4));
    // Root's release hands `t/1` to the tenant's waiter: still two.
    q.now = 10 * MS;
    assert_eq!(
        q.release(0, ROOT, "t/1", T),
        vec![
            (0, Response::Released { token: T }),
            (
                1,
                Response::Acquired {
                    owner: 2,
                    token: T + 2
                }
            )
        ]
    );
    assert_eq!(q.charged(), 2);
    assert_eq!(q.acquire(1, TENANT, "t/3", 0, 5), busy(1, 5));
    // The handed-over grant is the tenant's: its release returns it.
    assert_eq!(q.release(1, TENANT, "t/1", T + 2), released(1, T + 2));
    assert_eq!(q.charged(), 1);
    // The other way round: the tenant's grant handed to root's waiter
    // leaves the tenant's count and charges root nothing.
    assert_eq!(q.acquire(2, ROOT, "t/2", 5, 6), vec![]);
    assert_eq!(
        q.release(1, TENANT, "t/2", T + 1),
        vec![
            (1, Response::Released { token: T + 1 }),
            (
                2,
                Response::Acquired {
                    owner: 6,
                    token: T + 3
                }
            )
        ]
    );
    assert_eq!(q.charged(), 0);
    assert_eq!(q.core.grants_charged(ROOT), 0);
}

#[test]
fn a_wait_that_times_out_returns_its_charge_at_its_deadline() {
    let mut q = Quota::new(Limits::default().max_grants);
    q.acquire(0, ROOT, "t/1", 0, 1);
    q.now = 3 * MS;
    assert_eq!(q.acquire(1, TENANT, "t/1", 2, 2), vec![]);
    assert_eq!(q.acquire(1, TENANT, "t/1", 2, 3), vec![]);
    assert_eq!(q.charged(), 2);
    assert_eq!(q.acquire(1, TENANT, "t/2", 0, 4), busy(1, 4));
    assert_eq!(q.run_until(2 * S + 3 * MS - 1), vec![]);
    assert_eq!(q.charged(), 2);
    let mut out = q.run_until(2 * S + 3 * MS);
    out.sort_by_key(|(_, response)| format!("{response:?}"));
    assert_eq!(
        out,
        vec![
            (1, Response::Timeout { owner: 2 }),
            (1, Response::Timeout { owner: 3 })
        ]
    );
    assert_eq!(q.charged(), 0);
    assert_eq!(q.acquire(1, TENANT, "t/2", 0, 5), acquired(1, 5, T + 1));
}

#[test]
fn a_closed_connection_returns_its_waiters_but_its_grants_stay_charged_until_they_expire() {
    let mut q = Quota::new(Limits::default().max_grants);
    q.acquire(0, ROOT, "t/1", 0, 1);
    assert_eq!(
        q.ask(1, TENANT, "t/2", 0, 1, 2, 0, 0),
        acquired(1, 2, T + 1)
    );
    assert_eq!(q.acquire(1, TENANT, "t/1", 9, 3), vec![]);
    assert_eq!(q.charged(), 2);
    q.now = 5 * MS;
    q.core.disconnect(1, q.now);
    q.core.check_invariants();
    // The waiter went with its connection; the grant outlives it (spec §1).
    assert_eq!(q.charged(), 1);
    assert_eq!(q.acquire(2, TENANT, "t/3", 0, 4), acquired(2, 4, T + 2));
    assert_eq!(q.acquire(2, TENANT, "t/4", 0, 5), busy(2, 5));
    // The orphaned grant's 1 s lease ends: its charge comes back.
    assert_eq!(q.run_until(S - 1), vec![]);
    assert_eq!(q.charged(), 2);
    assert_eq!(q.run_until(S), vec![]);
    assert_eq!(q.charged(), 1);
    assert_eq!(q.acquire(2, TENANT, "t/4", 0, 6), acquired(2, 6, T + 3));
}

#[test]
fn an_expiry_that_hands_over_moves_the_charge_to_the_waiter() {
    let mut q = Quota::new(Limits::default().max_grants);
    // The tenant's own waiter behind its own grant: two charges, and the
    // expiry hands one to the other: one charge left.
    assert_eq!(q.ask(0, TENANT, "t/1", 0, 1, 1, 0, 0), acquired(0, 1, T));
    assert_eq!(q.acquire(1, TENANT, "t/1", 5, 2), vec![]);
    assert_eq!(q.charged(), 2);
    assert_eq!(q.run_until(S), acquired(1, 2, T + 1));
    assert_eq!(q.charged(), 1);
    assert_eq!(q.acquire(1, TENANT, "t/2", 0, 3), acquired(1, 3, T + 2));
    assert_eq!(q.acquire(1, TENANT, "t/3", 0, 4), busy(1, 4));
}

#[test]
fn permit_grants_are_each_charged_and_a_scan_carries_the_waiters_charge() {
    let mut q = Quota::new(Limits::default().max_grants);
    // limit 3: two counted grants of the tenant, then a third is over its
    // quota although a permit is free.
    assert_eq!(q.ask(0, TENANT, "t/p", 0, 30, 1, 3, 1), acquired(0, 1, T));
    assert_eq!(
        q.ask(0, TENANT, "t/p", 0, 30, 2, 3, 1),
        acquired(0, 2, T + 1)
    );
    assert_eq!(q.charged(), 2);
    assert_eq!(q.ask(0, TENANT, "t/p", 0, 30, 3, 3, 1), busy(0, 3));
    assert_eq!(q.ask(1, ROOT, "t/p", 0, 30, 4, 3, 1), acquired(1, 4, T + 2));
    // One released: room for a waiter behind the full key.
    assert_eq!(q.release(0, TENANT, "t/p", T), released(0, T));
    assert_eq!(q.charged(), 1);
    assert_eq!(q.ask(1, ROOT, "t/p", 0, 30, 5, 3, 1), acquired(1, 5, T + 3));
    assert_eq!(q.ask(0, TENANT, "t/p", 9, 30, 6, 3, 2), vec![]);
    assert_eq!(q.charged(), 2);
    assert_eq!(q.ask(0, TENANT, "t/q", 0, 30, 7, 3, 1), busy(0, 7));
    // Root's two releases let the head waiter fit: granted by the scan,
    // still charged once.
    assert_eq!(q.release(1, ROOT, "t/p", T + 2), released(1, T + 2));
    assert_eq!(q.charged(), 2);
    assert_eq!(
        q.release(1, ROOT, "t/p", T + 3),
        vec![
            (1, Response::Released { token: T + 3 }),
            (
                0,
                Response::Acquired {
                    owner: 6,
                    token: T + 4
                }
            )
        ]
    );
    assert_eq!(q.charged(), 2);
    assert_eq!(q.ask(0, TENANT, "t/q", 0, 30, 8, 3, 1), busy(0, 8));
    // Their leases end (30 s): both charges come back.
    assert_eq!(q.run_until(30 * S), vec![]);
    assert_eq!(q.charged(), 0);
    assert_eq!(q.core.grants_held(), 0);
}

#[test]
fn an_inline_grant_keeps_its_charge_when_its_key_gets_a_limit() {
    let mut q = Quota::new(Limits::default().max_grants);
    assert_eq!(q.acquire(0, TENANT, "t/x", 0, 1), acquired(0, 1, T));
    // Root's `S` names a limit: the tenant's grant moves out of line (an
    // exclusive permit grant) and root queues behind it.
    assert_eq!(q.ask(1, ROOT, "t/x", 5, 30, 2, 2, 1), vec![]);
    assert_eq!(q.charged(), 1);
    assert_eq!(
        q.release(0, TENANT, "t/x", T),
        vec![
            (0, Response::Released { token: T }),
            (
                1,
                Response::Acquired {
                    owner: 2,
                    token: T + 1
                }
            )
        ]
    );
    assert_eq!(q.charged(), 0);
}

#[test]
fn a_clean_stop_returns_the_waiters_charges() {
    let mut q = Quota::new(Limits::default().max_grants);
    q.acquire(0, ROOT, "t/1", 0, 1);
    assert_eq!(q.acquire(1, TENANT, "t/1", 9, 2), vec![]);
    assert_eq!(q.acquire(1, TENANT, "t/2", 0, 3), acquired(1, 3, T + 1));
    assert_eq!(q.charged(), 2);
    q.core.shut_down(q.now);
    q.core.check_invariants();
    let out: Vec<Output> = q.core.drain_outbox().collect();
    assert!(out.contains(&(1, Response::Busy { owner: 2 })), "{out:?}");
    // The grant is what a clean stop saves; the waiter is gone.
    assert_eq!(q.charged(), 1);
}

#[test]
fn the_quota_and_max_grants_bound_together() {
    // `--max-grants` 3: root's two leave room for one; the tenant's
    // quota of two does not lift the server's bound.
    let mut q = Quota::new(3);
    q.acquire(0, ROOT, "a", 0, 1);
    q.acquire(0, ROOT, "b", 0, 2);
    assert_eq!(q.acquire(1, TENANT, "t/1", 0, 3), acquired(1, 3, T + 2));
    assert_eq!(q.acquire(1, TENANT, "t/2", 0, 4), busy(1, 4));
    assert_eq!(q.charged(), 1);
    assert_eq!(q.release(0, ROOT, "a", T), released(0, T));
    assert_eq!(q.acquire(1, TENANT, "t/2", 0, 5), acquired(1, 5, T + 3));
    assert_eq!(q.charged(), 2);
}

#[test]
fn grants_restored_from_an_earlier_run_are_charged_to_nobody() {
    let mut q = Quota::new(Limits::default().max_grants);
    for (key, token, take, limit) in [("t/old", 7, 0, 0), ("t/sem", 8, 1, 3)] {
        let earlier = EarlierGrant {
            key,
            token,
            owner: 1,
            deadline: 10 * S,
            take,
            limit,
            label: "",
            granted_at: 0,
        };
        q.core.restore_grant(&earlier).unwrap();
    }
    q.core.check_invariants();
    assert_eq!(q.charged(), 0);
    // The tenant's own two: a waiter behind a restored grant, a grant.
    assert_eq!(q.acquire(1, TENANT, "t/old", 9, 1), vec![]);
    assert_eq!(q.acquire(1, TENANT, "t/1", 0, 2), acquired(1, 2, T));
    assert_eq!(q.ask(1, TENANT, "t/sem", 0, 30, 3, 3, 1), busy(1, 3));
    // The restored grants end: nobody gets anything back, and the waiter
    // handed the key stays charged once.
    assert_eq!(
        q.release(0, TENANT, "t/old", 7),
        vec![
            (0, Response::Released { token: 7 }),
            (
                1,
                Response::Acquired {
                    owner: 1,
                    token: T + 1
                }
            )
        ]
    );
    assert_eq!(q.release(0, TENANT, "t/sem", 8), released(0, 8));
    assert_eq!(q.charged(), 2);
}

/// A core in a crash grace (spec §7.3 v5) with identity 0 `small`
/// (`lock:* max-keys=1 max-grants=1`) and identity 1 `root` (no quota),
/// connections 0..3 open; the earlier run's tokens are
/// [`old`](crate::util::fake::old)'s.
fn in_grace(counted: bool) -> Quota {
    let text = format!(
        "small {} lock:* max-keys=1 max-grants=1\nroot {} lock:* info\n",
        hash_hex(b"small-secret-0123456789abcdef-01234"),
        hash_hex(b"root-secret-0123456789abcdef-012345"),
    );
    let list = AccessList::parse(&text).unwrap();
    let identities = (0..2).map(|i| list.identity(i).unwrap().clone()).collect();
    let mut fake = crate::util::fake::Fake::with_conns(3);
    fake.crash_grace(30 * S);
    fake.core.set_grace_counted(counted);
    Quota {
        core: fake.core,
        identities,
        now: S,
    }
}

fn extend(q: &mut Quota, conn: ConnId, who: u32, key: &str, token: u64) -> Vec<Output> {
    let request = Request::Extend {
        lease_s: 30,
        token,
        key,
    };
    q.request(conn, who, &request)
}

#[test]
fn an_identity_that_adopted_its_grant_gets_b_for_the_next() {
    use crate::util::fake::old;
    for counted in [false, true] {
        let mut q = in_grace(counted);
        let db = old("db", 3);
        assert_eq!(
            extend(&mut q, 0, 0, "db", db),
            vec![(0, Response::Extended { token: db })]
        );
        assert_eq!(q.core.grants_charged(0), 1);
        assert_eq!(q.core.keys_charged(0), 1);
        // Its next adoption, of a genuine token: `B` with the token, and
        // that key stays the unknown grant's.
        let queue = old("queue", 4);
        assert_eq!(extend(&mut q, 0, 0, "queue", queue), busy(0, queue));
        assert_eq!(q.core.keys(), 1);
        // Another identity adopts within the server's limits.
        assert_eq!(
            extend(&mut q, 1, 1, "queue", queue),
            vec![(1, Response::Extended { token: queue })]
        );
        // After the grace its next `A` gets `B` as well: the adopted
        // grant (to 31 s) is its one.
        q.run_until(30 * S);
        assert_eq!(q.acquire(0, 0, "fresh", 0, 5), busy(0, 5));
        // The adopted grant ends: its identity gets its grant back.
        assert_eq!(q.release(0, 0, "db", db), released(0, db));
        assert_eq!(q.core.grants_charged(0), 0);
        assert_eq!(q.acquire(0, 0, "fresh", 0, 6), acquired(0, 6, T));
    }
}

#[test]
fn a_max_keys_1_identity_adopts_one_key_not_two_thousand() {
    use crate::util::fake::old;
    let mut q = in_grace(false);
    let mut adopted = 0;
    for i in 0..2_000u64 {
        let key = format!("made-up/{i}");
        // Genuine tokens of those keys, as if the identity had them.
        let token = old(&key, 1 + i);
        match extend(&mut q, 0, 0, &key, token).as_slice() {
            [(0, Response::Extended { .. })] => adopted += 1,
            [(0, Response::Busy { owner })] if *owner == token => {}
            other => panic!("{key}: {other:?}"),
        }
    }
    assert_eq!(adopted, 1);
    assert_eq!(q.core.keys(), 1);
    assert_eq!(q.core.grants_held(), 1);
}

//! The sans-IO core on a fake clock: every cell of the request × key-status
//! matrix (spec §5), deadlines to the microsecond, limits, tokens, `Q`, `I`,
//! shutdown and the restart grace; then random sequences against the
//! reference model.

use std::collections::HashSet;

use kunci::core::EarlierGrant;
use kunci::core::restart::{CleanStop, Durability};
use kunci::core::{Core, Limits, Output, RestoreError};
use kunci::protocol::{ErrorCode, Request, RequestError, Response};
use kunci::server::state::{self, Clocks, Recorded, SavedGrant};
use proptest::prelude::*;

use kunci::core::token_binding::step_at_or_above;

use crate::util::fake::{FIRST_TOKEN, Fake, MS, S, binding, old, tick_of};
use crate::util::model::{Model, same_as_multiset, same_in_order};
use crate::util::plain_acquire;

fn acquired(owner: u64, token: u64) -> Response {
    Response::Acquired { owner, token }
}

fn timeout(owner: u64) -> Response {
    Response::Timeout { owner }
}

fn busy(owner: u64) -> Response {
    Response::Busy { owner }
}

fn released(token: u64) -> Response {
    Response::Released { token }
}

fn extended(token: u64) -> Response {
    Response::Extended { token }
}

fn not_held(token: u64) -> Response {
    Response::NotHeld { token }
}

fn limits(max_keys: usize, max_waiters: usize, per_key: u32, per_conn: u32) -> Limits {
    Limits {
        max_keys,
        max_waiters,
        max_waiters_per_key: per_key,
        max_waits_per_conn: per_conn,
        ..Limits::default()
    }
}

// ---- F: the key is free ----------------------------------------------------

#[test]
fn free_key_acquire_with_wait_0_or_more_is_granted_at_once() {
    let mut fake = Fake::with_conns(3);
    fake.set_now(5 * S);
    assert_eq!(
        fake.acquire(1, "a", 0, 30, 11),
        vec![(1, acquired(11, FIRST_TOKEN))]
    );
    assert_eq!(
        fake.acquire(2, "b", 200, 7, 12),
        vec![(2, acquired(12, FIRST_TOKEN + 1))]
    );
    assert_eq!(fake.query("a"), (FIRST_TOKEN, 11, 30_000, 0));
    assert_eq!(fake.query("b"), (FIRST_TOKEN + 1, 12, 7_000, 0));
    assert_eq!(fake.core.keys(), 2);
    assert_eq!(fake.core.waiter_count(), 0);
}

#[test]
fn free_key_at_the_key_limit_is_busy_for_wait_0_and_wait_n() {
    let mut fake = Fake::new(limits(2, 10, 10, 10), 3);
    fake.grant(1, "a", 30, 1);
    fake.grant(1, "b", 30, 2);
    assert_eq!(fake.acquire(2, "c", 0, 30, 3), vec![(2, busy(3))]);
    assert_eq!(fake.acquire(2, "c", 9, 30, 4), vec![(2, busy(4))]);
    assert_eq!(fake.query("c"), (0, 0, 0, 0));
    // The key limit does not stop waiting on a key that is already there.
    assert_eq!(fake.acquire(2, "a", 0, 30, 5), vec![(2, timeout(5))]);
    fake.enqueue(2, "a", 9, 30, 6);
    assert_eq!(fake.core.keys(), 2);
    assert_eq!(fake.core.stats().busy, 2);
    // B is definitive: nothing was granted, so the next token is unused.
    assert_eq!(fake.core.next_token(), FIRST_TOKEN + 2);
}

#[test]
fn free_key_release_and_extend_are_not_held_and_create_nothing() {
    let mut fake = Fake::with_conns(2);
    for token in [0, 1, FIRST_TOKEN, u64::MAX] {
        assert_eq!(fake.release(1, "a", token), vec![(1, not_held(token))]);
        assert_eq!(fake.extend(1, "a", 10, token), vec![(1, not_held(token))]);
    }
    assert_eq!(fake.core.keys(), 0);
    assert_eq!(fake.core.stats().not_held, 8);
    assert_eq!(fake.core.poll_timeout(), None);
}

#[test]
fn free_key_query_is_all_zero() {
    let mut fake = Fake::with_conns(1);
    assert_eq!(fake.query("nobody"), (0, 0, 0, 0));
    assert_eq!(fake.core.keys(), 0);
}

// ---- H: held, no waiters -----------------------------------------------------

#[test]
fn held_key_acquire_wait_0_times_out_at_once_and_changes_nothing() {
    let mut fake = Fake::with_conns(3);
    let token = fake.grant(1, "a", 30, 1);
    assert_eq!(fake.acquire(2, "a", 0, 30, 2), vec![(2, timeout(2))]);
    // Not re-entrant: the holder's own connection and owner get T too.
    assert_eq!(fake.acquire(1, "a", 0, 30, 1), vec![(1, timeout(1))]);
    assert_eq!(fake.query("a"), (token, 1, 30_000, 0));
    assert_eq!(fake.core.stats().timeouts, 2);
    assert_eq!(fake.core.waiter_count(), 0);
}

#[test]
fn held_key_acquire_with_wait_queues_without_an_answer() {
    let mut fake = Fake::with_conns(3);
    let token = fake.grant(1, "a", 30, 1);
    fake.enqueue(2, "a", 5, 30, 2);
    assert_eq!(fake.query("a"), (token, 1, 30_000, 1));
    // The same owner again is a new, independent attempt.
    fake.enqueue(1, "a", 5, 30, 1);
    assert_eq!(fake.query("a"), (token, 1, 30_000, 2));
    assert_eq!(fake.core.waiter_count(), 2);
}

#[test]
fn release_by_the_holder_frees_the_key_and_removes_it() {
    let mut fake = Fake::with_conns(3);
    let token = fake.grant(1, "a", 30, 1);
    // Any connection may release: grants are not tied to connections.
    assert_eq!(fake.release(2, "a", token), vec![(2, released(token))]);
    assert_eq!(fake.core.keys(), 0);
    assert_eq!(fake.query("a"), (0, 0, 0, 0));
    assert_eq!(fake.core.poll_timeout(), None);
    assert_eq!(fake.release(1, "a", token), vec![(1, not_held(token))]);
    assert_eq!(fake.core.stats().released, 1);
}

#[test]
fn release_or_extend_with_a_wrong_token_is_not_held_and_changes_nothing() {
    let mut fake = Fake::with_conns(3);
    let old = fake.grant(1, "a", 30, 1);
    assert_eq!(fake.release(1, "a", old), vec![(1, released(old))]);
    let other = fake.grant(1, "b", 30, 2);
    fake.set_now(2 * S);
    let token = fake.grant(1, "a", 30, 3);
    fake.enqueue(2, "a", 100, 30, 4);
    for wrong in [0, old, other, token + 1, u64::MAX] {
        assert_eq!(fake.release(2, "a", wrong), vec![(2, not_held(wrong))]);
        assert_eq!(fake.extend(2, "a", 200, wrong), vec![(2, not_held(wrong))]);
    }
    assert_eq!(fake.query("a"), (token, 3, 30_000, 1));
    // The lease was not touched: it still runs out 30 s after the grant.
    assert_eq!(fake.run_until(32 * S - 1), vec![]);
    assert_eq!(fake.run_until(32 * S), vec![(2, acquired(4, token + 1))]);
}

#[test]
fn extend_by_the_holder_resets_the_lease_from_now() {
    let mut fake = Fake::with_conns(2);
    let token = fake.grant(1, "a", 10, 1);
    fake.set_now(8 * S + 250);
    // A shorter lease is allowed: lease := now + lease.
    assert_eq!(fake.extend(1, "a", 3, token), vec![(1, extended(token))]);
    assert_eq!(fake.query("a"), (token, 1, 3_000, 0));
    let deadline = 11 * S + 250;
    assert_eq!(fake.run_until(deadline - 1), vec![]);
    assert_eq!(fake.query("a").0, token);
    // The deadline rounds up to the next 1 ms tick.
    assert_eq!(fake.run_until(tick_of(deadline) * MS - 1), vec![]);
    assert_eq!(fake.query("a").0, token);
    assert_eq!(fake.run_until(tick_of(deadline) * MS), vec![]);
    assert_eq!(fake.query("a"), (0, 0, 0, 0));
    assert_eq!(fake.core.stats().extended, 1);
    assert_eq!(fake.core.stats().expired, 1);
}

#[test]
fn lease_expiry_on_a_held_key_frees_it_exactly_at_the_deadline_tick() {
    let mut fake = Fake::with_conns(2);
    fake.set_now(1_234_567);
    let token = fake.grant(1, "a", 2, 1);
    let deadline = 3_234_567;
    assert!(fake.core.poll_timeout() <= Some(3_235_000));
    assert_eq!(fake.run_until(deadline - 1), vec![]);
    assert_eq!(fake.query("a").0, token);
    assert_eq!(fake.run_until(deadline), vec![]);
    // Past the deadline but before its tick: still held, with 0 ms left.
    assert_eq!(fake.run_until(3_234_999), vec![]);
    assert_eq!(fake.query("a"), (token, 1, 0, 0));
    assert_eq!(fake.core.stats().expired, 0);
    // The old holder gets no message.
    assert_eq!(fake.run_until(3_235_000), vec![]);
    assert_eq!(fake.query("a"), (0, 0, 0, 0));
    assert_eq!(fake.core.keys(), 0);
    assert_eq!(fake.core.stats().expired, 1);
    assert_eq!(fake.core.poll_timeout(), None);
    assert_eq!(fake.release(1, "a", token), vec![(1, not_held(token))]);
}

#[test]
fn holder_connection_closing_changes_nothing() {
    let mut fake = Fake::with_conns(3);
    let token = fake.grant(1, "a", 5, 1);
    fake.enqueue(2, "a", 100, 5, 2);
    fake.core.disconnect(1, fake.now);
    assert_eq!(fake.drain(), vec![]);
    assert_eq!(fake.query("a"), (token, 1, 5_000, 1));
    // The lease still runs out on time and the key goes to the waiter.
    assert_eq!(fake.run_until(5 * S - 1), vec![]);
    assert_eq!(fake.run_until(5 * S), vec![(2, acquired(2, token + 1))]);
    // And a grant whose connection is gone is still released by token.
    let token_b = fake.grant(2, "b", 5, 3);
    fake.core.disconnect(2, fake.now);
    assert_eq!(fake.release(0, "b", token_b), vec![(0, released(token_b))]);
}

// ---- HW: held with waiters --------------------------------------------------

#[test]
fn held_key_with_waiters_acquire_wait_0_times_out_and_wait_n_queues_at_the_tail() {
    let mut fake = Fake::with_conns(4);
    let token = fake.grant(1, "a", 30, 1);
    fake.enqueue(2, "a", 50, 30, 2);
    assert_eq!(fake.acquire(3, "a", 0, 30, 3), vec![(3, timeout(3))]);
    fake.enqueue(3, "a", 50, 30, 4);
    fake.enqueue(1, "a", 50, 30, 5);
    assert_eq!(fake.query("a"), (token, 1, 30_000, 3));
    // The tail: released three times, in arrival order.
    assert_eq!(
        fake.release(1, "a", token),
        vec![(1, released(token)), (2, acquired(2, token + 1))]
    );
    assert_eq!(
        fake.release(2, "a", token + 1),
        vec![(2, released(token + 1)), (3, acquired(4, token + 2))]
    );
    assert_eq!(fake.query("a"), (token + 2, 4, 30_000, 1));
    assert_eq!(
        fake.release(3, "a", token + 2),
        vec![(3, released(token + 2)), (1, acquired(5, token + 3))]
    );
    assert_eq!(fake.query("a"), (token + 3, 5, 30_000, 0));
}

#[test]
fn release_hands_over_with_a_fresh_lease_from_the_release() {
    let mut fake = Fake::with_conns(3);
    let token = fake.grant(1, "a", 30, 1);
    fake.enqueue(2, "a", 100, 4, 2);
    fake.set_now(10 * S);
    assert_eq!(
        fake.release(1, "a", token),
        vec![(1, released(token)), (2, acquired(2, token + 1))]
    );
    assert_eq!(fake.query("a"), (token + 1, 2, 4_000, 0));
    // The waiter's own deadline no longer applies: it holds the key now.
    assert_eq!(fake.run_until(14 * S - 1), vec![]);
    assert_eq!(fake.query("a").0, token + 1);
    assert_eq!(fake.run_until(14 * S), vec![]);
    assert_eq!(fake.query("a"), (0, 0, 0, 0));
    assert_eq!(fake.run_until(200 * S), vec![]);
}

#[test]
fn extend_with_waiters_resets_the_lease_and_delays_the_hand_over() {
    let mut fake = Fake::with_conns(3);
    let token = fake.grant(1, "a", 5, 1);
    fake.enqueue(2, "a", 60, 5, 2);
    fake.set_now(4 * S);
    assert_eq!(fake.extend(1, "a", 5, token), vec![(1, extended(token))]);
    assert_eq!(fake.query("a"), (token, 1, 5_000, 1));
    assert_eq!(fake.run_until(5 * S), vec![]);
    assert_eq!(fake.run_until(9 * S - 1), vec![]);
    assert_eq!(fake.run_until(9 * S), vec![(2, acquired(2, token + 1))]);
}

#[test]
fn lease_expiry_with_waiters_grants_the_head_at_the_deadline_tick() {
    let mut fake = Fake::with_conns(4);
    fake.set_now(700);
    let token = fake.grant(1, "a", 3, 1);
    fake.enqueue(2, "a", 200, 7, 2);
    fake.enqueue(3, "a", 200, 7, 3);
    // Deadline 3_000_700 µs, tick 3001.
    assert_eq!(fake.run_until(3_000_700), vec![]);
    assert_eq!(fake.run_until(3_000_999), vec![]);
    assert_eq!(fake.run_until(3_001_000), vec![(2, acquired(2, token + 1))]);
    assert_eq!(fake.query("a"), (token + 1, 2, 7_000, 1));
    assert_eq!(fake.core.stats().expired, 1);
    // The new lease starts at the hand-over.
    assert_eq!(fake.run_until(10_001_000 - 1), vec![]);
    assert_eq!(
        fake.run_until(10_001_000),
        vec![(3, acquired(3, token + 2))]
    );
    assert_eq!(fake.run_until(17_001_000), vec![]);
    assert_eq!(fake.core.keys(), 0);
}

#[test]
fn waiter_deadline_answers_timeout_exactly_at_its_tick_and_leaves_the_queue() {
    let mut fake = Fake::with_conns(4);
    let token = fake.grant(1, "a", 100, 1);
    fake.set_now(500_001);
    fake.enqueue(2, "a", 3, 30, 2);
    fake.set_now(600_000);
    fake.enqueue(3, "a", 3, 30, 3);
    // Deadline 3_500_001 µs: tick 3501, so 3_501_000 µs.
    assert!(fake.core.poll_timeout() <= Some(3_501_000));
    assert_eq!(fake.run_until(3_500_000), vec![]);
    assert_eq!(fake.run_until(3_500_001), vec![]);
    assert_eq!(fake.run_until(3_500_999), vec![]);
    assert_eq!(fake.query("a").3, 2);
    assert_eq!(fake.run_until(3_501_000), vec![(2, timeout(2))]);
    assert_eq!(fake.query("a"), (token, 1, 96_499, 1));
    // An aligned deadline fires at exactly that microsecond.
    assert_eq!(fake.run_until(3_600_000 - 1), vec![]);
    assert_eq!(fake.run_until(3_600_000), vec![(3, timeout(3))]);
    assert_eq!(fake.query("a"), (token, 1, 96_400, 0));
    // The key is still held, so it stays in the table.
    assert_eq!(fake.core.keys(), 1);
    assert_eq!(fake.core.stats().timeouts, 2);
}

#[test]
fn the_next_waiter_after_a_timed_out_head_gets_the_key() {
    let mut fake = Fake::with_conns(4);
    let token = fake.grant(1, "a", 100, 1);
    fake.enqueue(2, "a", 1, 30, 2);
    fake.enqueue(3, "a", 50, 30, 3);
    assert_eq!(fake.run_until(S), vec![(2, timeout(2))]);
    assert_eq!(
        fake.release(1, "a", token),
        vec![(1, released(token)), (3, acquired(3, token + 1))]
    );
}

#[test]
fn waiter_connection_closing_removes_its_waiters_silently() {
    let mut fake = Fake::with_conns(4);
    let token_a = fake.grant(1, "a", 10, 1);
    let token_b = fake.grant(1, "b", 10, 2);
    fake.enqueue(2, "a", 100, 30, 3);
    fake.enqueue(3, "a", 100, 30, 4);
    fake.enqueue(2, "a", 100, 30, 5);
    fake.enqueue(2, "b", 100, 30, 6);
    assert_eq!(fake.core.waiter_count(), 4);
    fake.core.disconnect(2, fake.now);
    assert_eq!(fake.drain(), vec![]);
    assert_eq!(fake.core.waiter_count(), 1);
    assert_eq!(fake.query("a"), (token_a, 1, 10_000, 1));
    assert_eq!(fake.query("b"), (token_b, 2, 10_000, 0));
    assert_eq!(
        fake.release(1, "a", token_a),
        vec![(1, released(token_a)), (3, acquired(4, token_b + 1))]
    );
    // Nothing is ever sent to the closed connection.
    let out = fake.run_until(300 * S);
    assert!(out.iter().all(|(conn, _)| *conn != 2), "{out:?}");
    assert_eq!(fake.core.keys(), 0);
    assert_eq!(fake.core.connections(), 3);
}

#[test]
fn hand_over_is_fifo_across_connections_timeouts_and_closes() {
    let mut fake = Fake::with_conns(5);
    let mut token = fake.grant(0, "k", 100, 100);
    // Owners 1..=8 from connections 1..=4 in turn; owner 3 times out and
    // connection 4 (owners 4 and 8) closes.
    for owner in 1..=8u64 {
        let wait = if owner == 3 { 2 } else { 200 };
        fake.enqueue((owner as u32 - 1) % 4 + 1, "k", wait, 100, owner);
    }
    assert_eq!(fake.run_until(2 * S), vec![(3, timeout(3))]);
    fake.core.disconnect(4, fake.now);
    let mut order = Vec::new();
    for _ in 0..5 {
        let out = fake.release(0, "k", token);
        let [(0, r), (_, Response::Acquired { owner, token: next })] = out.as_slice() else {
            panic!("{out:?}");
        };
        assert_eq!(*r, released(token));
        assert_eq!(*next, token + 1);
        order.push(*owner);
        token = *next;
    }
    assert_eq!(order, vec![1, 2, 5, 6, 7]);
    assert_eq!(fake.release(0, "k", token), vec![(0, released(token))]);
    assert_eq!(fake.core.keys(), 0);
}

#[test]
fn release_answer_comes_before_the_hand_over_on_the_same_connection() {
    let mut fake = Fake::with_conns(2);
    let token = fake.grant(1, "a", 30, 1);
    fake.enqueue(1, "a", 10, 30, 2);
    assert_eq!(
        fake.release(1, "a", token),
        vec![(1, released(token)), (1, acquired(2, token + 1))]
    );
}

// ---- limits -------------------------------------------------------------------

#[test]
fn each_waiter_limit_answers_busy_and_changes_nothing() {
    // max_waiters: 2 in total across keys.
    let mut fake = Fake::new(limits(10, 2, 10, 10), 4);
    fake.grant(0, "a", 30, 1);
    fake.grant(0, "b", 30, 2);
    fake.enqueue(1, "a", 5, 30, 3);
    fake.enqueue(2, "b", 5, 30, 4);
    assert_eq!(fake.acquire(3, "a", 5, 30, 5), vec![(3, busy(5))]);
    assert_eq!(fake.acquire(3, "b", 5, 30, 6), vec![(3, busy(6))]);
    // Free keys are still granted, and wait=0 on a held key is T, not B.
    assert_eq!(
        fake.acquire(3, "c", 5, 30, 7),
        vec![(3, acquired(7, FIRST_TOKEN + 2))]
    );
    assert_eq!(fake.acquire(3, "a", 0, 30, 8), vec![(3, timeout(8))]);
    assert_eq!((fake.query("a").3, fake.query("b").3), (1, 1));
    // When a waiter leaves, there is room again.
    let mut out = fake.run_until(5 * S);
    out.sort_by_key(|(conn, _)| *conn);
    assert_eq!(out, vec![(1, timeout(3)), (2, timeout(4))]);
    fake.enqueue(3, "a", 5, 30, 9);

    // max_waiters_per_key: 2 on one key, others unaffected.
    let mut fake = Fake::new(limits(10, 10, 2, 10), 4);
    fake.grant(0, "a", 30, 1);
    fake.grant(0, "b", 30, 2);
    fake.enqueue(1, "a", 5, 30, 3);
    fake.enqueue(2, "a", 5, 30, 4);
    assert_eq!(fake.acquire(3, "a", 5, 30, 5), vec![(3, busy(5))]);
    fake.enqueue(3, "b", 5, 30, 6);
    assert_eq!(fake.query("a").3, 2);

    // max_waits_per_conn: 2 from one connection, others unaffected.
    let mut fake = Fake::new(limits(10, 10, 10, 2), 4);
    fake.grant(0, "a", 30, 1);
    fake.grant(0, "b", 30, 2);
    fake.enqueue(1, "a", 5, 30, 3);
    fake.enqueue(1, "b", 5, 30, 4);
    assert_eq!(fake.acquire(1, "a", 5, 30, 5), vec![(1, busy(5))]);
    fake.enqueue(2, "a", 5, 30, 6);
    // Closing the connection gives its allowance back to a new one there.
    fake.core.disconnect(1, fake.now);
    fake.core.connect(1);
    fake.enqueue(1, "a", 5, 30, 7);
    fake.enqueue(1, "a", 5, 30, 8);
    assert_eq!(fake.acquire(1, "b", 5, 30, 9), vec![(1, busy(9))]);
    assert_eq!(fake.core.stats().busy, 2);
}

#[test]
fn with_every_waiter_limit_at_zero_wait_0_is_never_busy() {
    let mut fake = Fake::new(limits(1, 0, 0, 0), 3);
    assert_eq!(
        fake.acquire(1, "a", 0, 30, 1),
        vec![(1, acquired(1, FIRST_TOKEN))]
    );
    assert_eq!(fake.acquire(2, "a", 0, 30, 2), vec![(2, timeout(2))]);
    assert_eq!(fake.acquire(2, "a", 1, 30, 3), vec![(2, busy(3))]);
    // Only the key limit makes wait=0 busy.
    assert_eq!(fake.acquire(2, "b", 0, 30, 4), vec![(2, busy(4))]);
    assert_eq!(fake.core.waiter_count(), 0);
}

// ---- tokens, table, timers ------------------------------------------------------

#[test]
fn tokens_strictly_increase_across_keys_and_hand_overs_and_are_never_0() {
    let mut fake = Fake {
        core: Core::new(Limits::default(), 0),
        now: 0,
    };
    for conn in 0..3 {
        fake.core.connect(conn);
    }
    let first = fake.grant(1, "a", 1, 1);
    assert_eq!(first, 1);
    let mut seen = vec![first];
    seen.push(fake.grant(1, "b", 1, 2));
    fake.enqueue(2, "a", 100, 1, 3);
    fake.enqueue(2, "b", 100, 1, 4);
    // Both leases expire at once: two hand-overs in one call.
    for (_, response) in fake.run_until(S) {
        let Response::Acquired { token, .. } = response else {
            panic!("{response:?}");
        };
        seen.push(token);
    }
    seen.push(fake.grant(1, "c", 1, 5));
    let again = fake.release(1, "c", *seen.last().unwrap());
    assert_eq!(again.len(), 1);
    seen.push(fake.grant(1, "c", 1, 6));
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted, (1..=6).collect::<Vec<u64>>(), "{seen:?}");
    assert_eq!(seen[..2], [1, 2]);
    assert_eq!(seen[4..], [5, 6]);
    assert_eq!(fake.core.next_token(), 7);
}

#[test]
fn when_the_token_space_runs_out_acquires_are_busy_and_tokens_never_wrap() {
    let mut fake = Fake {
        core: Core::new(Limits::default(), u64::MAX - 2),
        now: 0,
    };
    for conn in 0..3 {
        fake.core.connect(conn);
    }
    assert_eq!(fake.grant(1, "a", 5, 1), u64::MAX - 2);
    fake.enqueue(2, "a", 100, 5, 2);
    fake.enqueue(2, "a", 100, 5, 3);
    assert_eq!(
        fake.release(1, "a", u64::MAX - 2),
        vec![(1, released(u64::MAX - 2)), (2, acquired(2, u64::MAX - 1))]
    );
    assert_eq!(fake.core.next_token(), u64::MAX);
    assert_eq!(fake.acquire(1, "b", 0, 5, 4), vec![(1, busy(4))]);
    // The last waiter cannot be granted either: B, and the key goes.
    assert_eq!(fake.run_until(5 * S), vec![(2, busy(3))]);
    assert_eq!(fake.core.keys(), 0);
    assert_eq!(fake.core.waiter_count(), 0);
    fake.core.check_invariants();
}

#[test]
fn a_key_with_no_holder_and_no_waiters_leaves_the_table() {
    let mut fake = Fake::with_conns(3);
    assert_eq!(fake.core.keys(), 0);
    let a = fake.grant(1, "a", 10, 1);
    let long_key = "long-".repeat(40);
    let b = fake.grant(1, &long_key, 10, 2);
    assert_eq!(fake.core.keys(), 2);
    fake.enqueue(2, "a", 1, 10, 3);
    assert_eq!(fake.run_until(S), vec![(2, timeout(3))]);
    // A held key whose waiters left stays.
    assert_eq!(fake.core.keys(), 2);
    assert_eq!(fake.release(1, "a", a), vec![(1, released(a))]);
    assert_eq!(fake.core.keys(), 1);
    assert_eq!(fake.run_until(10 * S), vec![]);
    assert_eq!(fake.core.keys(), 0);
    assert_eq!(fake.release(1, &long_key, b), vec![(1, not_held(b))]);
    assert_eq!(fake.core.poll_timeout(), None);
    // The table works as before after it emptied.
    let c = fake.grant(1, &long_key, 10, 4);
    assert_eq!(fake.query(&long_key), (c, 4, 10_000, 0));
}

#[test]
fn thousands_of_keys_and_waiters_come_and_go_and_the_table_empties() {
    let mut fake = Fake::with_conns(64);
    let keys: Vec<String> = (0..6_000)
        .map(|i| {
            if i % 4 == 0 {
                format!("a-long-key-beyond-the-inline-bytes/{i}")
            } else {
                format!("k{i}")
            }
        })
        .collect();
    for round in 0..2 {
        let mut tokens = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            tokens.push(fake.grant((i % 64) as u32, key, 200, i as u64));
        }
        // 5000 waiters: more than the node storage keeps when it empties.
        for i in 0..5_000u64 {
            fake.enqueue((i % 63 + 1) as u32, &keys[i as usize], 100, 50, 10_000 + i);
        }
        assert_eq!((fake.core.keys(), fake.core.waiter_count()), (6_000, 5_000));
        fake.core.check_invariants();
        // Release every other key (handing it to its waiter), close one
        // connection, then let the rest time out and run out.
        for (i, key) in keys.iter().enumerate().step_by(2) {
            let out = fake.release(0, key, tokens[i]);
            assert_eq!(out[0], (0, released(tokens[i])));
            assert_eq!(out.len(), if i < 5_000 { 2 } else { 1 });
        }
        fake.core.disconnect(5, fake.now);
        fake.core.check_invariants();
        let start = fake.now;
        let out = fake.run_until(start + 100 * S);
        assert!(
            out.iter()
                .all(|(_, r)| matches!(r, Response::Timeout { .. }))
        );
        assert_eq!(fake.core.waiter_count(), 0);
        fake.core.check_invariants();
        assert_eq!(fake.run_until(start + 300 * S), vec![]);
        assert_eq!(
            (fake.core.keys(), fake.core.poll_timeout()),
            (0, None),
            "round {round}"
        );
        fake.core.check_invariants();
        fake.core.connect(5);
    }
}

/// Regression: after an idle spell of more than 2³¹ ms (≈ 24.9 days) with
/// no timer armed, the shell has no reason to call `handle_timeout`, so the
/// wheel still stood where it was; a lease armed then (relative to that
/// stale position, modulo 2³² ticks) was misread and ran out at once.
#[test]
fn lease_armed_after_a_long_idle_spell_does_not_expire_early() {
    for idle_days in [1, 24, 25, 30, 50, 200] {
        let mut fake = Fake::with_conns(2);
        fake.grant(1, "a", 1, 1);
        assert_eq!(fake.run_until(S), vec![]);
        assert_eq!(fake.core.poll_timeout(), None);
        // The next request arrives after the idle spell; the shell handles
        // it before it calls handle_timeout.
        let back = S + idle_days * 86_400 * S;
        fake.set_now(back);
        let token = fake.grant(1, "b", 30, 2);
        fake.enqueue(1, "b", 10, 30, 3);
        assert!(fake.core.poll_timeout() <= Some(back + 10 * S));
        assert_eq!(fake.run_until(back), vec![], "{idle_days} days");
        assert_eq!(fake.query("b"), (token, 2, 30_000, 1), "{idle_days} days");
        assert_eq!(fake.run_until(back + 10 * S - 1), vec![]);
        assert_eq!(fake.run_until(back + 10 * S), vec![(1, timeout(3))]);
        assert_eq!(fake.run_until(back + 30 * S - 1), vec![]);
        assert_eq!(fake.query("b").0, token);
        assert_eq!(fake.run_until(back + 30 * S), vec![]);
        assert_eq!(fake.core.keys(), 0, "{idle_days} days");
    }
}

#[test]
fn poll_timeout_is_none_when_idle_and_never_later_than_the_earliest_deadline() {
    let mut fake = Fake::with_conns(3);
    assert_eq!(fake.core.poll_timeout(), None);
    // Leases and waits with deadlines spread over every wheel level.
    let mut deadlines = Vec::new();
    let mut owner = 0;
    for (i, lease_s) in [2u8, 3, 70, 255, 5].into_iter().enumerate() {
        assert_eq!(fake.run_until(i as u64 * 100_003), vec![]);
        owner += 1;
        fake.grant(1, &format!("k{i}"), lease_s, owner);
        deadlines.push((tick_of(fake.now + u64::from(lease_s) * S), None));
        for wait_s in [1u8, 64, 200] {
            owner += 1;
            fake.enqueue(2, &format!("k{i}"), wait_s, lease_s, owner);
            if wait_s == 1 {
                deadlines.push((tick_of(fake.now + S), Some(owner)));
            }
        }
    }
    let mut wakeups = 0;
    let mut timeouts = Vec::new();
    while let Some(at) = fake.core.poll_timeout() {
        wakeups += 1;
        assert!(wakeups < 2_000, "livelock");
        assert!(at >= fake.now, "wake-up {at} before now {}", fake.now);
        if let Some(earliest) = deadlines.iter().map(|(tick, _)| tick * MS).min() {
            assert!(at <= earliest, "wake-up {at} after the deadline {earliest}");
        }
        for (conn, response) in fake.run_until(at) {
            if let Response::Timeout { owner } = response {
                assert_eq!(conn, 2);
                timeouts.push((owner, at));
            }
        }
        deadlines.retain(|(tick, _)| tick * MS > at);
        fake.core.check_invariants();
    }
    // Each one-second wait timed out exactly at its tick.
    for (owner, at) in &timeouts {
        if let Some(expected) = [2u64, 6, 10, 14, 18].iter().position(|o| o == owner) {
            assert_eq!(
                *at,
                tick_of(expected as u64 * 100_003 + S) * MS,
                "owner {owner}"
            );
        }
    }
    assert_eq!(fake.core.keys(), 0);
    assert_eq!(fake.core.waiter_count(), 0);
    assert!(wakeups < 400, "{wakeups} wake-ups");
}

// ---- Q and I ----------------------------------------------------------------------

#[test]
fn query_lease_ms_is_the_time_left_rounded_up() {
    let mut fake = Fake::with_conns(2);
    let token = fake.grant(1, "a", 30, 9);
    assert_eq!(fake.query("a"), (token, 9, 30_000, 0));
    fake.set_now(1_000);
    assert_eq!(fake.query("a").2, 29_999);
    fake.set_now(29_000_000);
    assert_eq!(fake.query("a").2, 1_000);
    // 1.001 ms left: the deadline is only known to the tick, and Q never
    // shows more than the lease could have left.
    fake.set_now(29_998_999);
    assert_eq!(fake.query("a").2, 1);
    fake.set_now(29_999_001);
    assert_eq!(fake.query("a").2, 0);
    // An unaligned grant: 400 µs + 1 s, with exactly 1 s left at once.
    let mut fake = Fake::with_conns(2);
    fake.set_now(400);
    fake.grant(1, "b", 1, 1);
    assert_eq!(fake.query("b").2, 1_000);
    fake.set_now(500_400);
    assert_eq!(fake.query("b").2, 500);
    // The core keeps only the deadline's tick, so it cannot always round
    // the exact time left up; it never shows more, and at most 1 ms less.
    for grant_at in [0, 1, 499, 999, 1_000, 123_456_789] {
        for lease_s in [1u8, 30, 255] {
            let mut fake = Fake::with_conns(2);
            fake.set_now(grant_at);
            fake.grant(1, "c", lease_s, 1);
            let deadline = grant_at + u64::from(lease_s) * S;
            for after in [0, 1, 999, 1_000, 1_001, 500_000, S - 1] {
                fake.set_now(grant_at + after);
                let exact = (deadline - fake.now).div_ceil(MS) as u32;
                let shown = fake.query("c").2;
                assert!(
                    shown <= exact && shown + 1 >= exact,
                    "grant at {grant_at} for {lease_s} s, Q at {}: {shown} ms, exactly {exact}",
                    fake.now
                );
            }
        }
    }
}

#[test]
fn info_names_every_counter_with_its_value() {
    let mut fake = Fake::with_conns(4);
    let a = fake.grant(1, "a", 10, 1);
    fake.grant(1, "b", 10, 2);
    fake.enqueue(2, "a", 100, 10, 3);
    fake.enqueue(3, "a", 1, 10, 4);
    assert_eq!(fake.acquire(2, "a", 0, 10, 5), vec![(2, timeout(5))]);
    assert_eq!(fake.release(1, "b", 77), vec![(1, not_held(77))]);
    assert_eq!(fake.extend(1, "a", 20, a), vec![(1, extended(a))]);
    assert_eq!(fake.run_until(S), vec![(3, timeout(4))]);
    assert_eq!(fake.run_until(10 * S), vec![]);
    assert_eq!(
        fake.release(1, "a", a),
        vec![(1, released(a)), (2, acquired(3, a + 2))]
    );
    fake.core.handle_invalid(
        3,
        RequestError {
            code: ErrorCode::EmptyKey,
            id: 0,
        },
    );
    fake.drain();
    fake.core.disconnect(3, fake.now);
    let mut small = Fake::new(limits(0, 0, 0, 0), 1);
    assert_eq!(small.acquire(0, "z", 0, 1, 1), vec![(0, busy(1))]);
    assert_eq!(small.info()["busy"], "1");
    fake.set_now(12_345_678);
    let info = fake.info();
    let expected = [
        ("version", env!("CARGO_PKG_VERSION").to_owned()),
        ("uptime_s", "12".to_owned()),
        ("connections", "3".to_owned()),
        ("keys", "1".to_owned()),
        ("held", "1".to_owned()),
        ("waiters", "0".to_owned()),
        ("grants", "3".to_owned()),
        ("timeouts", "2".to_owned()),
        ("busy", "0".to_owned()),
        ("expired", "1".to_owned()),
        ("released", "1".to_owned()),
        ("extended", "1".to_owned()),
        ("not_held", "1".to_owned()),
        ("errors", "1".to_owned()),
        ("next_token", (a + 3).to_string()),
    ];
    for (name, value) in expected {
        assert_eq!(info.get(name), Some(&value), "{name} in {info:?}");
    }
}

#[test]
fn invalid_requests_are_answered_with_x_and_their_id_and_ping_echoes() {
    let mut fake = Fake::with_conns(2);
    fake.core.handle_invalid(
        1,
        RequestError {
            code: ErrorCode::ZeroLease,
            id: 0x0a0a,
        },
    );
    assert_eq!(
        fake.drain(),
        vec![(
            1,
            Response::Error {
                code: 5,
                id: 0x0a0a,
                text: ErrorCode::ZeroLease.text().into()
            }
        )]
    );
    assert_eq!(fake.core.stats().errors, 1);
    assert_eq!(fake.core.keys(), 0);
    assert_eq!(
        fake.request(1, &Request::Ping { nonce: u64::MAX }),
        vec![(1, Response::Pong { nonce: u64::MAX })]
    );
}

// ---- shutdown and the restart grace --------------------------------------------

#[test]
fn shutdown_answers_every_waiter_busy_then_every_connection_x_8() {
    let mut fake = Fake::with_conns(4);
    let a = fake.grant(1, "a", 30, 1);
    fake.grant(1, "b", 30, 2);
    fake.enqueue(2, "a", 100, 30, 3);
    fake.enqueue(3, "a", 100, 30, 4);
    fake.enqueue(2, "b", 100, 30, 5);
    fake.core.disconnect(0, fake.now);
    fake.core.shut_down(fake.now);
    let out = fake.drain();
    let (busy_part, errors) = out.split_at(3);
    let mut waiters: Vec<Output> = busy_part.to_vec();
    waiters.sort_by_key(|(conn, response)| (*conn, format!("{response:?}")));
    assert_eq!(waiters, vec![(2, busy(3)), (2, busy(5)), (3, busy(4))]);
    let x8 = Response::Error {
        code: 8,
        id: 0,
        text: ErrorCode::ShuttingDown.text().into(),
    };
    assert_eq!(errors, [(1, x8.clone()), (2, x8.clone()), (3, x8)]);
    assert_eq!(fake.core.waiter_count(), 0);
    assert_eq!(fake.core.stats().busy, 3);
    // Grants are untouched by the shutdown itself.
    assert_eq!(fake.core.keys(), 2);
    assert_eq!(fake.release(1, "a", a), vec![(1, released(a))]);
}

#[test]
fn shutdown_during_the_grace_answers_its_waiters_busy_and_empties_the_table() {
    let mut fake = Fake::with_conns(3);
    fake.crash_grace(30 * S);
    fake.enqueue(1, "a", 100, 30, 1);
    fake.enqueue(2, "a", 100, 30, 2);
    fake.enqueue(2, "b", 100, 30, 3);
    fake.core.shut_down(fake.now);
    let mut out = fake.drain();
    out.truncate(3);
    out.sort_by_key(|(conn, response)| (*conn, format!("{response:?}")));
    assert_eq!(out, vec![(1, busy(1)), (2, busy(2)), (2, busy(3))]);
    assert_eq!((fake.core.keys(), fake.core.poll_timeout()), (0, None));
    fake.core.check_invariants();
}

#[test]
fn grace_wait_0_times_out_and_waits_are_granted_after_the_horizon() {
    let mut fake = Fake::with_conns(4);
    let horizon = 10 * S + 500;
    fake.crash_grace(horizon);
    fake.set_now(S);
    assert_eq!(fake.acquire(1, "a", 0, 30, 1), vec![(1, timeout(1))]);
    assert_eq!(fake.core.keys(), 0);
    // Deadline 6 s: before the horizon, so it times out.
    fake.enqueue(1, "a", 5, 30, 2);
    // Deadlines after the horizon: granted at the horizon, in FIFO order.
    fake.enqueue(2, "a", 60, 30, 3);
    fake.enqueue(3, "a", 60, 7, 4);
    fake.enqueue(3, "b", 60, 30, 5);
    assert_eq!(fake.core.keys(), 2);
    assert_eq!(fake.core.waiter_count(), 4);
    let info = fake.info();
    assert_eq!((info["keys"].as_str(), info["held"].as_str()), ("2", "0"));
    assert_eq!(fake.run_until(6 * S), vec![(1, timeout(2))]);
    assert_eq!(fake.run_until(tick_of(horizon) * MS - 1), vec![]);
    // The two keys' hand-overs share a tick: either may take the lower token.
    let mut grants: Vec<(u32, u64, u64)> = fake
        .run_until(tick_of(horizon) * MS)
        .into_iter()
        .map(|(conn, response)| match response {
            Response::Acquired { owner, token } => (conn, owner, token),
            other => panic!("{other:?}"),
        })
        .collect();
    grants.sort();
    assert_eq!(
        (grants[0].0, grants[0].1, grants[1].0, grants[1].1),
        (2, 3, 3, 5)
    );
    let mut tokens = [grants[0].2, grants[1].2];
    tokens.sort();
    assert_eq!(tokens, [FIRST_TOKEN, FIRST_TOKEN + 1]);
    assert_eq!(fake.core.stats().expired, 0);
    let a = fake.query("a").0;
    assert_eq!(fake.query("a").3, 1);
    assert_eq!(
        fake.release(2, "a", a),
        vec![(2, released(a)), (3, acquired(4, FIRST_TOKEN + 2))]
    );
    let info = fake.info();
    assert_eq!((info["keys"].as_str(), info["held"].as_str()), ("2", "2"));
    // After the horizon, new keys are granted at once.
    assert_eq!(
        fake.acquire(1, "c", 0, 30, 6),
        vec![(1, acquired(6, FIRST_TOKEN + 3))]
    );
}

#[test]
fn grace_query_shows_token_0_and_the_time_left_to_the_horizon() {
    let mut fake = Fake::with_conns(3);
    fake.crash_grace(10 * S);
    fake.set_now(2 * S + 300);
    assert_eq!(fake.query("a"), (0, 0, 8_000, 0));
    fake.enqueue(1, "a", 100, 30, 1);
    assert_eq!(fake.query("a").3, 1);
    // Token 0 never matches the unknown holder.
    assert_eq!(fake.release(2, "a", 0), vec![(2, not_held(0))]);
    assert_eq!(fake.extend(2, "a", 5, 0), vec![(2, not_held(0))]);
    assert_eq!(fake.release(2, "b", 0), vec![(2, not_held(0))]);
    assert_eq!(fake.query("a").3, 1);
    // When the last waiter leaves, the key counts as not in the table.
    fake.core.disconnect(1, fake.now);
    assert_eq!(fake.core.keys(), 0);
    assert_eq!(fake.query("a"), (0, 0, 8_000, 0));
    assert_eq!(fake.core.poll_timeout(), None);
    fake.set_now(10 * S);
    assert_eq!(fake.query("a"), (0, 0, 0, 0));
    assert_eq!(
        fake.acquire(2, "a", 0, 30, 2),
        vec![(2, acquired(2, FIRST_TOKEN))]
    );
}

/// Regression: `Q` during the grace showed 1 ms less time to the horizon
/// once a wait queued on the key (the key's entry rounded the horizon like
/// a lease deadline) than before.
#[test]
fn grace_query_time_left_does_not_drop_when_a_waiter_queues() {
    for horizon in [10 * S, 10 * S + 1, 10 * S + 999] {
        let mut fake = Fake::with_conns(2);
        fake.crash_grace(horizon);
        fake.set_now(2 * S + 300);
        let before = fake.query("a");
        fake.enqueue(1, "a", 100, 30, 1);
        let (token, owner, lease_ms, waiters) = fake.query("a");
        assert_eq!(
            (token, owner, lease_ms, waiters),
            (0, 0, before.2, 1),
            "horizon {horizon}"
        );
        assert_eq!(lease_ms as u64, (horizon - fake.now).div_ceil(MS));
    }
}

#[test]
fn grace_limits_still_apply() {
    let mut fake = Fake::new(limits(1, 10, 10, 10), 3);
    fake.crash_grace(10 * S);
    fake.enqueue(1, "a", 100, 30, 1);
    // A new key during the grace needs a table entry: the key limit counts.
    assert_eq!(fake.acquire(1, "b", 100, 30, 2), vec![(1, busy(2))]);
    // wait=0 is never queued, so it is T even at the key limit.
    assert_eq!(fake.acquire(1, "b", 0, 30, 3), vec![(1, timeout(3))]);
    fake.enqueue(2, "a", 100, 30, 4);
    assert_eq!(fake.query("a"), (0, 0, 10_000, 2));
}

// ---- restarts: restored grants, adoption, the horizon (spec §7) ---------------

/// A token the previous run issued: below this run's first.
const EARLIER: u64 = FIRST_TOKEN - 500;

fn boot(boot_ms: u64, wall_ms: u64) -> Clocks {
    Clocks {
        boot_id: b"boot-a".to_vec(),
        boot_ms,
        wall_ms,
    }
}

/// A clean stop written at boot time 1,000 ms listing `grants` as (key,
/// token, owner, lease ms left), restored into a fresh core `downtime_ms`
/// later by the server's own policy (`Restart::resume`).
fn restart_after_clean_stop(grants: &[(&str, u64, u64, u32)], downtime_ms: u64) -> Fake {
    let mut recorded = Recorded::new(true, boot(1_000, 50_000_000), FIRST_TOKEN, 0);
    recorded.set_grants(
        grants
            .iter()
            .map(|&(key, token, owner, left_ms)| SavedGrant {
                key,
                token,
                owner,
                left_ms,
                take: 0,
                limit: 0,
                label: "",
                held_ms: 0,
            }),
    );
    // The wall clock stepped back an hour meanwhile: it must not matter.
    let restart = recorded.restart_at(&boot(1_000 + downtime_ms, 50_000_000 - 3_600_000));
    assert_eq!(restart.grace, std::time::Duration::ZERO);
    let mut fake = Fake::with_conns(4);
    restart.resume(&mut fake.core, recorded.grants()).unwrap();
    fake.core.check_invariants();
    fake
}

/// 30 s left at the stop, 10 s down: 20 s less the 1 ms the whole-ms clock
/// readings cost.
#[test]
fn restored_grant_keeps_token_owner_and_its_deadline_less_the_downtime() {
    let mut fake = restart_after_clean_stop(&[("a", EARLIER, 7, 30_000)], 10_000);
    assert_eq!(fake.query("a"), (EARLIER, 7, 19_999, 0));
    assert_eq!(fake.acquire(1, "a", 0, 30, 1), vec![(1, timeout(1))]);
    fake.enqueue(1, "a", 60, 30, 2);
    // R/E/Q act on it as before the restart: wrong tokens are N.
    assert_eq!(
        fake.extend(2, "a", 5, EARLIER + 1),
        vec![(2, not_held(EARLIER + 1))]
    );
    assert_eq!(fake.run_until(19_999 * MS - 1), vec![]);
    assert_eq!(
        fake.run_until(19_999 * MS),
        vec![(1, acquired(2, FIRST_TOKEN))]
    );
    assert_eq!(fake.core.stats().expired, 1);
    fake.core.check_invariants();

    let mut fake = restart_after_clean_stop(&[("a", EARLIER, 7, 30_000)], 10_000);
    fake.set_now(3 * S);
    assert_eq!(
        fake.extend(2, "a", 5, EARLIER),
        vec![(2, extended(EARLIER))]
    );
    assert_eq!(fake.query("a"), (EARLIER, 7, 5_000, 0));
    assert_eq!(fake.release(2, "a", EARLIER), vec![(2, released(EARLIER))]);
    assert_eq!(fake.core.keys(), 0);
    assert_eq!(
        fake.acquire(1, "a", 0, 30, 3),
        vec![(1, acquired(3, FIRST_TOKEN))]
    );
}

#[test]
fn restored_grant_that_expired_during_the_downtime_is_free_and_others_are_free_at_once() {
    let mut fake = restart_after_clean_stop(
        &[("gone", EARLIER, 7, 5_000), ("kept", EARLIER + 1, 8, 5_002)],
        5_000,
    );
    assert_eq!(fake.core.keys(), 1);
    assert_eq!(fake.query("gone"), (0, 0, 0, 0));
    assert_eq!(fake.query("kept"), (EARLIER + 1, 8, 1, 0));
    assert_eq!(
        fake.acquire(1, "gone", 0, 30, 1),
        vec![(1, acquired(1, FIRST_TOKEN))]
    );
    assert_eq!(
        fake.acquire(1, "never-held", 0, 30, 2),
        vec![(1, acquired(2, FIRST_TOKEN + 1))]
    );
    // The old token of the expired grant is not adopted: no grace runs.
    assert_eq!(
        fake.extend(2, "gone", 5, EARLIER),
        vec![(2, not_held(EARLIER))]
    );
}

fn earlier(key: &str, token: u64, take: u16, limit: u16) -> EarlierGrant<'_> {
    EarlierGrant {
        key,
        token,
        owner: 1,
        deadline: S,
        take,
        limit,
        label: "",
        granted_at: 0,
    }
}

#[test]
fn a_restored_grant_is_refused_when_its_token_is_not_an_earlier_runs_or_its_key_repeats() {
    let mut fake = Fake::with_conns(1);
    for token in [0, FIRST_TOKEN, FIRST_TOKEN + 1] {
        assert_eq!(
            fake.core.restore_grant(&earlier("a", token, 0, 0)),
            Err(RestoreError::TokenNotFromEarlierRun)
        );
    }
    fake.core.restore_grant(&earlier("a", 1, 0, 0)).unwrap();
    assert_eq!(
        fake.core.restore_grant(&earlier("a", 2, 0, 0)),
        Err(RestoreError::DuplicateKey)
    );
    // Permits: the limit must agree, tokens come in order, and what is
    // restored must fit (spec §10.3) as it did when it was granted.
    fake.core.restore_grant(&earlier("s", 10, 1, 3)).unwrap();
    for (token, take, limit, error) in [
        (11, 1, 4, RestoreError::DuplicateKey),
        (9, 1, 3, RestoreError::DuplicateKey),
        (10, 1, 3, RestoreError::DuplicateKey),
        (11, 3, 3, RestoreError::DoesNotFit),
        (11, 0, 3, RestoreError::DoesNotFit),
        (11, 1, 0, RestoreError::DoesNotFit),
        (11, 4, 3, RestoreError::DoesNotFit),
        (11, 1, 1, RestoreError::DuplicateKey),
    ] {
        assert_eq!(
            fake.core.restore_grant(&earlier("s", token, take, limit)),
            Err(error),
            "token {token} take {take} limit {limit}"
        );
    }
    assert_eq!(
        fake.core.restore_grant(&earlier("a", 12, 1, 3)),
        Err(RestoreError::DuplicateKey)
    );
    fake.core.restore_grant(&earlier("s", 11, 2, 3)).unwrap();
    assert_eq!(fake.core.grants_held(), 3);
    fake.core.check_invariants();
}

/// Spec §7.4: a clean stop keeps every grant with its take, its label and
/// its key's limit, and the next run restores them all: the fit rule and
/// `R`/`E`/`Q` go on as before the restart.
#[test]
fn a_clean_stop_keeps_every_permit_with_its_take_label_and_limit() {
    let mut fake = Fake::with_conns(2);
    let first = fake.permits(0, "sem", 0, 30, 1, 3, 1, "backup@a pid=1");
    let [(_, Response::Acquired { token: r1, .. })] = first[..] else {
        panic!("{first:?}")
    };
    let r2 = fake.grant_permits(0, "sem", 60, 2, 3, 2);
    let w = fake.grant_permits(0, "excl", 20, 3, 5, 0);
    let plain = fake.grant(0, "plain", 10, 4);
    fake.set_now(4 * S);
    fake.core.shut_down(fake.now);
    fake.drain();
    let stop = CleanStop::of(&fake.core, fake.now);
    assert_eq!(stop.count, 4);
    assert!(!stop.counted_grants, "no grace left to flag");
    let mut recorded = Recorded::new(true, boot(1_000, 50_000_000), FIRST_TOKEN + 100, 0);
    recorded.set_grants(stop.grants());
    let mut saved: Vec<_> = recorded
        .grants()
        .map(|g| (g.key, g.token, g.owner, g.left_ms, g.take, g.limit, g.label))
        .collect();
    saved.sort();
    assert_eq!(
        saved,
        vec![
            ("excl", w, 3, 16_000, 0, 5, ""),
            ("plain", plain, 4, 6_000, 0, 0, ""),
            ("sem", r1, 1, 26_000, 1, 3, "backup@a pid=1"),
            ("sem", r2, 2, 56_000, 2, 3, ""),
        ]
    );
    // Restored 1 s later (boot-time clock) into the next run.
    let restart = recorded.restart_at(&boot(2_000, 1));
    let mut next = Fake::new(Limits::default(), 2);
    next.core = Core::new(Limits::default(), FIRST_TOKEN + 100);
    next.core.connect(0);
    next.core.connect(1);
    assert_eq!(restart.resume(&mut next.core, recorded.grants()), Ok(4));
    next.core.check_invariants();
    assert_eq!(next.core.grants_held(), 4);
    assert!(next.core.counted_grants(), "restored counted grants");
    // The smallest token shows; 3 of 3 permits are taken.
    assert_eq!(next.query("sem"), (r1, 1, 24_999, 0));
    assert_eq!(
        next.permits(1, "sem", 0, 30, 9, 3, 1, ""),
        vec![(1, timeout(9))]
    );
    assert_eq!(
        next.permits(1, "sem", 0, 30, 9, 4, 1, ""),
        vec![(
            1,
            Response::Error {
                code: ErrorCode::LimitMismatch as u8,
                id: 9,
                text: "limit mismatch: key limit 3".into(),
            }
        )]
    );
    assert_eq!(next.release(1, "sem", r1), vec![(1, released(r1))]);
    let r3 = next.grant_permits(1, "sem", 30, 10, 3, 1);
    assert_eq!(r3, FIRST_TOKEN + 100);
    assert_eq!(next.extend(1, "sem", 30, r2), vec![(1, extended(r2))]);
    assert_eq!(
        next.permits(1, "excl", 0, 30, 11, 5, 1, ""),
        vec![(1, timeout(11))]
    );
    assert_eq!(next.query("excl"), (w, 3, 14_999, 0));
    // The restored leases run out when they would have.
    next.run_until(15 * S);
    let r4 = next.grant_permits(1, "excl", 30, 12, 5, 5);
    assert!(r4 > r3);
    next.core.check_invariants();
}

/// The overlap of issue 19, exactly: two readers hold a shared lock when
/// the server crashes; one of them renews and then releases; a writer must
/// not get the key while the other reader's lease may still run. The
/// flag that says so is durable before the first reader's grant is
/// answered.
#[test]
fn after_a_crash_two_readers_one_releases_and_the_writer_waits_for_the_other_lease() {
    let mut fake = Fake::with_conns(3);
    // As with a state directory: tokens bound to their keys.
    fake.core.bind_tokens(binding(), FIRST_TOKEN);
    assert!(fake.core.binds_tokens());
    let mut durability = Durability::new();
    durability.persisted(durability.needed(&fake.core).unwrap());
    let reader_1 = fake.grant_permits(0, "rw", 10, 1, 65_535, 1);
    // The answer above may leave only after a promise with the flag.
    let promise = durability
        .needed(&fake.core)
        .expect("a promise before the answer");
    assert!(promise.counted_grants);
    durability.persisted(promise);
    fake.set_now(S);
    let reader_2 = fake.grant_permits(1, "rw", 30, 2, 65_535, 1);
    if let Some(promise) = durability.needed(&fake.core) {
        durability.persisted(promise);
    }
    let on_disk = durability.on_disk().unwrap();
    // The horizon covers the second reader's lease (to 31 s).
    assert!(on_disk.horizon >= 31 * S && on_disk.horizon <= 36 * S);
    // kill -9 at 2 s; the next run starts at once.
    let crash = 2 * S;
    let recorded = Recorded::running(&boot(1_000, 50_000_000), on_disk, crash);
    let restart = recorded.restart_at(&boot(1_000 + 2_000, 50_000_000 + 2_000));
    assert!(restart.counted_grants);
    let mut next = Fake::new(Limits::default(), 3);
    next.core = Core::new(Limits::default(), on_disk.token_high_water);
    next.core.bind_tokens(binding(), on_disk.token_high_water);
    for conn in 0..3 {
        next.core.connect(conn);
    }
    assert_eq!(restart.macs_until, on_disk.token_high_water - 1);
    restart.resume(&mut next.core, recorded.grants()).unwrap();
    // The first reader renews, then releases: neither frees the key. Its
    // renewal adopts its token beside the unknown grant (spec §7.4).
    next.set_now(S);
    assert_eq!(
        next.extend(0, "rw", 10, reader_1),
        vec![(0, extended(reader_1))]
    );
    assert_eq!(next.query("rw").0, reader_1);
    assert_eq!(
        next.release(0, "rw", reader_1),
        vec![(0, released(reader_1))]
    );
    // The writer asks; it must wait until the second reader's lease
    // (29 s from the restart) can no longer run.
    next.enqueue_permits(2, "rw", 60, 30, 3, 65_535, 0);
    assert_eq!(
        next.permits(2, "rw", 0, 30, 4, 65_535, 0, ""),
        vec![(2, timeout(4))]
    );
    let reader_2_end = 31 * S - crash;
    assert_eq!(next.run_until(reader_2_end), vec![]);
    assert_eq!(next.query("rw").0, 0, "held by the unknown grant");
    // At the horizon the writer gets it.
    let horizon = next.core.grace_until();
    assert!(horizon >= reader_2_end);
    assert_eq!(next.run_until(horizon - 1), vec![]);
    let out = next.run_until(horizon);
    assert!(
        matches!(out[..], [(2, Response::Acquired { owner: 3, .. })]),
        "{out:?}"
    );
    assert!(reader_2 > reader_1);
    next.core.check_invariants();
}

#[test]
fn adoption_by_extend_during_the_grace_makes_the_token_the_holder_again() {
    let mut fake = Fake::with_conns(3);
    fake.crash_grace(10 * S);
    fake.set_now(2 * S);
    assert_eq!(
        fake.extend(1, "a", 30, old("a", 10)),
        vec![(1, extended(old("a", 10)))]
    );
    // Owner 0, the new lease from now; Q shows the token.
    assert_eq!(fake.query("a"), (old("a", 10), 0, 30_000, 0));
    assert_eq!(fake.acquire(2, "a", 0, 30, 1), vec![(2, timeout(1))]);
    // From now on it is an ordinary grant: another earlier token is N.
    assert_eq!(
        fake.extend(2, "a", 5, old("a", 9)),
        vec![(2, not_held(old("a", 9)))]
    );
    assert_eq!(
        fake.extend(1, "a", 20, old("a", 10)),
        vec![(1, extended(old("a", 10)))]
    );
    let info = fake.info();
    assert_eq!((info["keys"].as_str(), info["held"].as_str()), ("1", "1"));
    // The horizon passes; the adopted lease goes on to its own deadline.
    fake.enqueue(2, "a", 60, 30, 2);
    assert_eq!(fake.run_until(22 * S - 1), vec![]);
    assert_eq!(fake.run_until(22 * S), vec![(2, acquired(2, FIRST_TOKEN))]);
    fake.core.check_invariants();

    // A key waited on during the grace (an entry held by the unknown
    // grant) is adopted the same way; its waiter stays queued behind.
    let mut fake = Fake::with_conns(3);
    fake.crash_grace(10 * S);
    fake.enqueue(2, "b", 60, 30, 3);
    fake.set_now(S);
    assert_eq!(
        fake.extend(1, "b", 15, old("b", 10)),
        vec![(1, extended(old("b", 10)))]
    );
    assert_eq!(fake.query("b"), (old("b", 10), 0, 15_000, 1));
    assert_eq!(fake.run_until(16 * S - 1), vec![]);
    assert_eq!(fake.run_until(16 * S), vec![(2, acquired(3, FIRST_TOKEN))]);
    assert_eq!(fake.core.stats().expired, 1);
    fake.core.check_invariants();
}

#[test]
fn adoption_by_release_frees_the_key_and_hands_it_to_the_head_waiter() {
    let mut fake = Fake::with_conns(4);
    fake.crash_grace(10 * S);
    fake.enqueue(2, "a", 60, 30, 1);
    fake.enqueue(3, "a", 60, 30, 2);
    fake.set_now(S);
    assert_eq!(
        fake.release(1, "a", old("a", 10)),
        vec![(1, released(old("a", 10))), (2, acquired(1, FIRST_TOKEN))]
    );
    assert_eq!(fake.query("a"), (FIRST_TOKEN, 1, 30_000, 1));
    fake.core.check_invariants();

    // Without waiters the key is simply free, for the rest of the grace
    // too — also after a grant of this run on it ends.
    assert_eq!(
        fake.release(1, "b", old("b", 10)),
        vec![(1, released(old("b", 10)))]
    );
    assert_eq!(fake.query("b"), (0, 0, 0, 0));
    assert_eq!(fake.query("c"), (0, 0, 9_000, 0));
    let token = fake.grant(1, "b", 1, 3);
    assert_eq!(fake.release(1, "b", token), vec![(1, released(token))]);
    fake.grant(1, "b", 1, 4);
    assert_eq!(fake.run_until(3 * S).len(), 0);
    assert_eq!(fake.core.stats().expired, 1);
    assert_eq!(fake.query("b"), (0, 0, 0, 0));
    // A freed key is no longer held by the unknown grant: nothing to adopt.
    assert_eq!(
        fake.extend(1, "b", 5, old("b", 10)),
        vec![(1, not_held(old("b", 10)))]
    );
    assert_eq!(
        fake.release(1, "b", old("b", 10)),
        vec![(1, not_held(old("b", 10)))]
    );
    fake.core.check_invariants();
}

/// Spec §7.4: after a run that made a counted grant no adoption may free a
/// key before the horizon. An earlier run's `E` adds its token as an
/// adopted grant (several on one key), `R` of an adopted or old token
/// answers `R`; the unknown grant holds the key until the horizon, and
/// then each remaining adopted grant holds it as if exclusive.
#[test]
fn after_a_run_with_counted_grants_adopted_grants_hold_their_key_past_the_horizon() {
    let mut fake = Fake::with_conns(4);
    fake.crash_grace(10 * S);
    fake.core.set_grace_counted(true);
    assert!(fake.core.counted_grants());
    fake.set_now(S);
    // Two old tokens of one key are both adopted, in any order.
    assert_eq!(
        fake.extend(1, "rw", 5, old("rw", 11)),
        vec![(1, extended(old("rw", 11)))]
    );
    assert_eq!(
        fake.extend(1, "rw", 20, old("rw", 10)),
        vec![(1, extended(old("rw", 10)))]
    );
    assert_eq!(fake.query("rw"), (old("rw", 10), 0, 20_000, 0));
    fake.core.check_invariants();
    // A writer and a reader wait; nothing is granted at once.
    fake.enqueue_permits(2, "rw", 60, 30, 2, 65_535, 0);
    fake.enqueue_permits(3, "rw", 60, 30, 3, 65_535, 1);
    assert_eq!(
        fake.permits(0, "rw", 0, 30, 4, 65_535, 1, ""),
        vec![(0, timeout(4))]
    );
    assert_eq!(
        holders(&mut fake, 9, "rw"),
        vec![
            grant_frame(0, 0, 9_000, 0, 0, ""),
            grant_frame(old("rw", 10), 0, 20_000, 0, 0, ""),
            grant_frame(old("rw", 11), 0, 5_000, 0, 0, ""),
            waiter_frame(2, 60_000, 0, ""),
            waiter_frame(3, 60_000, 1, ""),
            end_frame(5, 0)
        ]
    );
    // `R` of an adopted token, and of an old token never adopted, answer
    // `R`; neither frees the key.
    assert_eq!(
        fake.release(1, "rw", old("rw", 11)),
        vec![(1, released(old("rw", 11)))]
    );
    assert_eq!(
        fake.release(1, "rw", old("rw", 12)),
        vec![(1, released(old("rw", 12)))]
    );
    assert_eq!(
        fake.release(1, "untracked", old("untracked", 13)),
        vec![(1, released(old("untracked", 13)))]
    );
    assert_eq!(fake.query("rw"), (old("rw", 10), 0, 20_000, 2));
    assert_eq!(fake.query("untracked"), (0, 0, 9_000, 0));
    // A key whose only adopted grant was released stays held too.
    assert_eq!(
        fake.extend(1, "gone", 5, old("gone", 14)),
        vec![(1, extended(old("gone", 14)))]
    );
    assert_eq!(
        fake.release(1, "gone", old("gone", 14)),
        vec![(1, released(old("gone", 14)))]
    );
    assert_eq!(fake.query("gone"), (0, 0, 9_000, 0));
    assert_eq!(fake.acquire(0, "gone", 0, 30, 5), vec![(0, timeout(5))]);
    fake.core.check_invariants();
    // The horizon passes; the adopted grant still holds "rw".
    assert_eq!(fake.run_until(10 * S), vec![]);
    assert_eq!(fake.query("rw"), (old("rw", 10), 0, 11_000, 2));
    assert_eq!(
        holders(&mut fake, 9, "rw"),
        vec![
            grant_frame(old("rw", 10), 0, 11_000, 9_000, 0, ""),
            waiter_frame(2, 51_000, 0, ""),
            waiter_frame(3, 51_000, 1, ""),
            end_frame(3, 0)
        ]
    );
    // After the horizon an old token not adopted is not held.
    assert_eq!(
        fake.extend(1, "rw", 5, old("rw", 12)),
        vec![(1, not_held(old("rw", 12)))]
    );
    assert_eq!(
        fake.release(1, "rw", old("rw", 12)),
        vec![(1, not_held(old("rw", 12)))]
    );
    assert_eq!(
        fake.acquire(0, "untracked", 0, 30, 6),
        vec![(0, acquired(6, FIRST_TOKEN))]
    );
    fake.core.check_invariants();
    // The writer gets "rw" only when the adopted lease runs out.
    assert_eq!(fake.run_until(21 * S - 1), vec![]);
    assert_eq!(
        fake.run_until(21 * S),
        vec![(2, acquired(2, FIRST_TOKEN + 1))]
    );
    fake.core.check_invariants();
}

/// Spec §7.4 on a key a waiter queued on before the adoption: after the
/// horizon the waiter gets it as soon as the adopted grant is released.
#[test]
fn after_a_run_with_counted_grants_a_waiter_gets_the_key_when_the_adopted_grant_is_released() {
    let mut fake = Fake::with_conns(3);
    fake.crash_grace(10 * S);
    fake.core.set_grace_counted(true);
    fake.enqueue(2, "waited", 60, 30, 1);
    fake.set_now(S);
    assert_eq!(
        fake.extend(1, "waited", 30, old("waited", 10)),
        vec![(1, extended(old("waited", 10)))]
    );
    assert_eq!(fake.query("waited"), (old("waited", 10), 0, 30_000, 1));
    assert_eq!(fake.run_until(10 * S), vec![]);
    fake.core.check_invariants();
    fake.set_now(12 * S);
    assert_eq!(
        fake.release(1, "waited", old("waited", 10)),
        vec![
            (1, released(old("waited", 10))),
            (2, acquired(1, FIRST_TOKEN))
        ]
    );
    fake.core.check_invariants();
}

/// Issue 25 defect 11 (spec §10.2): on a key held by an adopted grant
/// after a run with counted grants, whose limit is none, a request that
/// names a limit and ends at once with `T` or `B` sets nothing; one that
/// queues sets it.
#[test]
fn a_limit_named_by_a_request_that_ends_at_once_during_the_grace_is_not_set() {
    for max_waiters in [0, 10] {
        let limits = Limits {
            max_waiters,
            ..Limits::default()
        };
        let mut fake = Fake::new(limits, 3);
        fake.crash_grace(10 * S);
        fake.core.set_grace_counted(true);
        fake.set_now(S);
        assert_eq!(
            fake.extend(1, "k", 120, old("k", 10)),
            vec![(1, extended(old("k", 10)))]
        );
        // `T` at once; then `B` from a full waiter table.
        assert_eq!(
            fake.permits(2, "k", 0, 30, 2, 7, 1, ""),
            vec![(2, timeout(2))]
        );
        assert_eq!(
            fake.permits(2, "k", 5, 30, 3, 7, 1, ""),
            if max_waiters == 0 {
                vec![(2, busy(3))]
            } else {
                vec![]
            }
        );
        fake.core.check_invariants();
        if max_waiters == 0 {
            // Neither set the limit 7: another limit is no mismatch.
            assert_eq!(
                fake.permits(2, "k", 0, 30, 4, 9, 1, ""),
                vec![(2, timeout(4))]
            );
        } else {
            // The request that queued set it.
            assert_eq!(
                fake.permits(2, "k", 0, 30, 4, 9, 1, ""),
                vec![(2, Response::limit_mismatch(4, 7))]
            );
        }
        fake.core.check_invariants();
    }
}

/// The server's clean stop (spec §7.2): every connection shut down and
/// answered, then the grants saved.
fn stop_cleanly(state: &mut state::StateDir, fake: &mut Fake) {
    fake.core.shut_down(fake.now);
    fake.drain();
    state
        .save_clean_stop(&CleanStop::of(&fake.core, fake.now))
        .unwrap();
}

/// The next run's core on `dir` (tokens from `FIRST_TOKEN + 1_000`, one
/// connection), after it resumed what the state file holds.
fn resumed(dir: &std::path::Path) -> Core {
    let mut state = state::StateDir::open(dir).unwrap();
    let mut next = Core::new(Limits::default(), FIRST_TOKEN + 1_000);
    next.connect(0);
    state.resume(&mut next).unwrap();
    next.check_invariants();
    next
}

/// Spec §7.4: adopted grants a clean stop saves (several exclusive ones on
/// one key, owner 0) come back as they were, and still hold their key as
/// if exclusive.
#[test]
fn a_clean_stop_saves_and_restores_several_adopted_grants_of_one_key() {
    let dir = crate::util::TempDir::new("adopted");
    let mut fake = Fake::with_conns(2);
    {
        let mut state = state::StateDir::open(&dir.0).unwrap();
        state.resume(&mut fake.core).unwrap();
        fake.crash_grace(5 * S);
        fake.core.set_grace_counted(true);
        fake.set_now(S);
        for token in [old("rw", 11), old("rw", 10)] {
            assert_eq!(fake.extend(1, "rw", 60, token), vec![(1, extended(token))]);
        }
        fake.run_until(6 * S);
        stop_cleanly(&mut state, &mut fake);
    }
    let mut next = Fake {
        core: resumed(&dir.0),
        now: 0,
    };
    let tokens: Vec<(u64, u64, u16)> = next
        .core
        .grants()
        .map(|grant| (grant.token, grant.owner, grant.take))
        .collect();
    assert_eq!(tokens, vec![(old("rw", 10), 0, 0), (old("rw", 11), 0, 0)]);
    assert_eq!(
        next.permits(0, "rw", 0, 30, 4, 65_535, 1, ""),
        vec![(0, timeout(4))]
    );
    assert_eq!(
        next.release(0, "rw", old("rw", 10)),
        vec![(0, released(old("rw", 10)))]
    );
    assert_eq!(next.acquire(0, "rw", 0, 30, 5), vec![(0, timeout(5))]);
    next.core.check_invariants();
}

/// A clean stop during a grace after a run with counted grants, with
/// adopted grants (two on a key a waiting request gave a limit): the next
/// run restores them and, while the inherited grace runs, keeps their keys
/// held by the unknown grant even after they are released, for holders
/// that did not adopt theirs yet (spec §7.4).
#[test]
fn adopted_grants_restored_within_the_grace_keep_their_key_held_until_the_horizon() {
    let dir = crate::util::TempDir::new("adopted-grace");
    let mut fake = Fake::with_conns(2);
    {
        let mut state = state::StateDir::open(&dir.0).unwrap();
        state.resume(&mut fake.core).unwrap();
        fake.crash_grace(60 * S);
        fake.core.set_grace_counted(true);
        fake.set_now(S);
        for (key, token) in [
            ("rw", old("rw", 11)),
            ("rw", old("rw", 10)),
            ("one", old("one", 12)),
        ] {
            assert_eq!(fake.extend(1, key, 60, token), vec![(1, extended(token))]);
        }
        fake.enqueue_permits(0, "rw", 60, 30, 3, 65_535, 1);
        stop_cleanly(&mut state, &mut fake);
    }
    let mut next = Fake {
        core: resumed(&dir.0),
        now: 0,
    };
    assert!(next.core.counted_grants() && next.core.grace_until() > 50 * S);
    for (key, token) in [
        ("rw", old("rw", 10)),
        ("rw", old("rw", 11)),
        ("one", old("one", 12)),
    ] {
        assert_eq!(next.release(0, key, token), vec![(0, released(token))]);
    }
    for key in ["rw", "one"] {
        assert_eq!(next.query(key).0, 0, "{key} held by the unknown grant");
        assert_eq!(next.acquire(0, key, 0, 30, 5), vec![(0, timeout(5))]);
    }
    next.core.check_invariants();
}

/// The flag travels through the file: a crash of a run whose grace may
/// hide counted grants leaves a file that says so, and the next run keeps
/// the horizon for every key; a run without it keeps §7.3's adoption.
#[test]
fn the_counted_grants_flag_survives_a_crash_and_governs_the_next_grace() {
    for counted in [false, true] {
        let dir = crate::util::TempDir::new("counted");
        {
            let mut state = state::StateDir::open(&dir.0).unwrap();
            let mut fake = Fake::with_conns(1);
            state.resume(&mut fake.core).unwrap();
            fake.crash_grace(60 * S);
            fake.core.set_grace_counted(counted);
            let promise = Durability::new().needed(&fake.core).unwrap();
            assert_eq!(promise.counted_grants, counted);
            state.write_running(promise, 0).unwrap();
            // Crash: nothing more is written.
        }
        let mut state = state::StateDir::open(&dir.0).unwrap();
        let mut next = Fake::new(Limits::default(), 1);
        state.resume(&mut next.core).unwrap();
        assert_eq!(next.core.counted_grants(), counted);
        // Bound with the directory's secret, as that run would have.
        let earlier = state.binding().token(b"k", 10);
        assert_eq!(
            next.extend(0, "k", 5, earlier),
            vec![(0, extended(earlier))]
        );
        assert_eq!(next.release(0, "k", earlier), vec![(0, released(earlier))]);
        // Under §7.4 the key stays held by the unknown grant; under §7.3
        // the release freed it.
        let token_0_lease = next.query("k").2;
        assert_eq!(token_0_lease > 0, counted, "counted {counted}");
        assert!(next.core.grace_until() > 50 * S);
    }
}

#[test]
fn during_the_grace_a_token_not_below_the_first_or_token_0_is_still_not_held() {
    let mut fake = Fake::with_conns(2);
    fake.crash_grace(10 * S);
    fake.enqueue(1, "waited", 60, 30, 1);
    for key in ["waited", "untracked"] {
        for token in [0, FIRST_TOKEN, FIRST_TOKEN + 7, u64::MAX] {
            assert_eq!(fake.release(2, key, token), vec![(2, not_held(token))]);
            assert_eq!(fake.extend(2, key, 5, token), vec![(2, not_held(token))]);
        }
    }
    assert_eq!(fake.query("waited"), (0, 0, 10_000, 1));
    assert_eq!(fake.query("untracked"), (0, 0, 10_000, 0));
    // After the grace an earlier token adopts nothing.
    fake.run_until(10 * S);
    assert_eq!(
        fake.extend(2, "untracked", 5, old("untracked", 10)),
        vec![(2, not_held(old("untracked", 10)))]
    );
    assert_eq!(
        fake.release(2, "untracked", old("untracked", 10)),
        vec![(2, not_held(old("untracked", 10)))]
    );
    assert_eq!(fake.core.stats().not_held, 18);
    fake.core.check_invariants();
}

/// Issue 25 defect 10 (spec §7.2): the horizon comes down as long leases
/// end — to 5 s past the latest lease still running (its deadline rounded
/// up to 100 ms), never below it — when that gains more than 1 s, and at
/// most once per 5 s; grants raise it again before they are answered.
#[test]
fn the_horizon_comes_down_as_long_leases_end_and_never_below_a_running_one() {
    let mut fake = Fake::with_conns(2);
    let mut durability = Durability::new();
    let persist = |durability: &mut Durability, fake: &mut Fake| {
        durability.plan(&mut fake.core, fake.now);
        if let Some(promise) = durability.needed(&fake.core) {
            durability.persisted(promise);
        }
        durability.on_disk().unwrap().horizon
    };
    assert_eq!(persist(&mut durability, &mut fake), 0);
    fake.set_now(S);
    let long = fake.grant(1, "long", 30, 1);
    assert_eq!(persist(&mut durability, &mut fake), 36 * S);
    fake.set_now(2 * S);
    assert_eq!(fake.release(1, "long", long), vec![(1, released(long))]);
    let short = fake.grant(1, "short", 2, 2);
    // The 2 s lease runs to 4 s: its bucket ends at 4.1 s.
    assert_eq!(persist(&mut durability, &mut fake), 9_100 * MS);
    assert_eq!(durability.lowered_at(), Some(2 * S));
    assert_eq!(durability.poll_timeout(&fake.core), None);
    // A longer grant raises it before it is answered.
    fake.set_now(2_500 * MS);
    let middle = fake.grant(1, "middle", 10, 3);
    assert_eq!(persist(&mut durability, &mut fake), 17_500 * MS);
    // Released at once: the next lowering waits until 5 s after the last.
    fake.set_now(3 * S);
    assert_eq!(
        fake.release(1, "middle", middle),
        vec![(1, released(middle))]
    );
    assert_eq!(persist(&mut durability, &mut fake), 17_500 * MS);
    assert_eq!(durability.poll_timeout(&fake.core), Some(7 * S));
    assert_eq!(fake.run_until(4 * S), vec![]);
    assert_eq!(persist(&mut durability, &mut fake), 17_500 * MS);
    // At 7 s the short lease has run out: nothing is running.
    assert_eq!(fake.run_until(7 * S), vec![]);
    assert_eq!(persist(&mut durability, &mut fake), 0);
    assert_eq!(durability.lowered_at(), Some(7 * S));
    let _ = short;
    // A gain of at most 1 s is not worth a write.
    fake.set_now(20 * S);
    fake.grant(1, "a", 10, 4);
    let b = fake.grant(1, "b", 10, 5);
    assert_eq!(persist(&mut durability, &mut fake), 35 * S);
    fake.set_now(20_500 * MS);
    let c = fake.grant(1, "c", 10, 6);
    assert_eq!(persist(&mut durability, &mut fake), 35 * S);
    assert_eq!(fake.release(1, "c", c), vec![(1, released(c))]);
    assert_eq!(fake.release(1, "b", b), vec![(1, released(b))]);
    assert_eq!(persist(&mut durability, &mut fake), 35 * S);
    assert_eq!(durability.lowered_at(), Some(7 * S));
    fake.core.check_invariants();
}

#[test]
fn adoption_is_charged_like_a_grant_and_b_when_the_limits_are_full() {
    let mut fake = Fake::new(limits(2, 10, 10, 10), 2);
    fake.crash_grace(10 * S);
    // A waiter of this run takes one key of two...
    fake.enqueue(1, "w", 60, 30, 1);
    // ...an earlier holder adopts its key, the second; one more finds no
    // room: `B` with its token, and the key stays the unknown grant's.
    assert_eq!(
        fake.extend(1, "a", 30, old("a", 10)),
        vec![(1, extended(old("a", 10)))]
    );
    assert_eq!(
        fake.extend(1, "b", 30, old("b", 11)),
        vec![(1, busy(old("b", 11)))]
    );
    assert_eq!(fake.query("b"), (0, 0, 10_000, 0));
    assert_eq!(fake.core.keys(), 2);
    // The waited-on key adds no key: it is adopted within the limit.
    assert_eq!(
        fake.extend(1, "w", 30, old("w", 12)),
        vec![(1, extended(old("w", 12)))]
    );
    fake.core.check_invariants();
}

/// The state file written while running, read back: the horizon it
/// promises, in µs of the core's clock.
fn horizon_on_disk(dir: &std::path::Path, anchor: &Clocks) -> u64 {
    let bytes = std::fs::read(dir.join(state::STATE_FILE)).unwrap();
    let recorded = state::parse(&bytes, anchor).unwrap();
    (recorded.written.boot_ms - anchor.boot_ms + recorded.horizon_ms) * MS
}

#[test]
fn the_horizon_on_disk_covers_every_lease_and_runs_at_most_5_s_past_the_latest() {
    let dir = crate::util::TempDir::new("horizon");
    let mut state = state::StateDir::open(&dir.0).unwrap();
    let mut fake = Fake::with_conns(2);
    state.resume(&mut fake.core).unwrap();
    let anchor = boot(7_000, 50_000);
    state.anchor(anchor.clone());
    let mut durability = Durability::new();
    let mut token = 0;
    // A minute of grants and renewals every 100 ms with mixed leases.
    for step in 1..=600u64 {
        fake.run_until(step * 100 * MS);
        let lease = [1, 2, 10, 30][step as usize % 4];
        if step % 7 == 0 && token != 0 {
            fake.extend(1, "k", lease, token);
        } else {
            fake.release(1, "k", token);
            token = fake.grant(1, "k", lease, step);
        }
        // The shell makes the endpoint's promise durable before any
        // answer leaves (the real policy, as `Endpoint::poll_persist`).
        if let Some(promise) = durability.needed(&fake.core) {
            state.write_running(promise, fake.now).unwrap();
            durability.persisted(promise);
        }
        let latest = fake.core.lease_deadline_max();
        let horizon = horizon_on_disk(&dir.0, &anchor);
        assert!(
            horizon >= latest,
            "step {step}: horizon {horizon} < lease {latest}"
        );
        assert!(
            horizon <= latest + 5 * S + MS,
            "step {step}: horizon {horizon} more than 5 s past {latest}"
        );
    }
    // The write rate: each write moves the horizon at least 5 s on, and
    // the horizon ends within 30 s (the longest lease) + 5 s of the last
    // step at 60 s: at most (60 + 35) / 5 writes, plus the first.
    assert!(
        state.writes <= 1 + 95 / 5,
        "{} writes in a minute",
        state.writes
    );
}

#[test]
fn a_clean_stop_saved_and_resumed_restores_every_grant_and_the_remaining_grace() {
    let dir = crate::util::TempDir::new("resume");
    let mut fake = Fake::with_conns(2);
    {
        let mut state = state::StateDir::open(&dir.0).unwrap();
        state.resume(&mut fake.core).unwrap();
        fake.crash_grace(30 * S);
        fake.set_now(S);
        // Adopted keys during the grace: one expires, two are released
        // by their earlier holders and granted anew, one runs out now.
        fake.extend(1, "adopted", 10, old("adopted", 10));
        fake.run_until(20 * S);
        let long_key = "é/long-key-beyond-the-inline-bytes";
        for (key, token) in [("a", 1), (long_key, 2), ("expires-now", 3)] {
            fake.release(1, key, old(key, 10 - token));
        }
        let a = fake.grant(1, "a", 30, 1);
        let b = fake.grant(1, long_key, 255, 2);
        fake.grant(1, "expires-now", 1, 3);
        fake.run_until(21 * S);
        stop_cleanly(&mut state, &mut fake);
        assert_eq!((a, b), (FIRST_TOKEN, FIRST_TOKEN + 1));
    }
    let next = resumed(&dir.0);
    let mut grants: Vec<(String, u64, u64)> = next
        .grants()
        .map(|grant| (grant.key.to_owned(), grant.token, grant.owner))
        .collect();
    grants.sort();
    assert_eq!(
        grants,
        vec![
            ("a".to_owned(), FIRST_TOKEN, 1),
            (
                "é/long-key-beyond-the-inline-bytes".to_owned(),
                FIRST_TOKEN + 1,
                2
            ),
        ]
    );
    // Lease left: 29 s and 254 s less the (real, short) time since the save.
    for grant in next.grants() {
        let left = if grant.owner == 1 { 29 * S } else { 254 * S };
        assert!(
            grant.deadline <= left && grant.deadline > left - 2 * S,
            "{grant:?}"
        );
    }
    // The grace of the stopped run goes on: 9 s were left of it.
    assert!(next.grace_until() <= 9 * S + MS && next.grace_until() > 7 * S);
    // The next run binds its tokens: a multiple of 2^16 at or above.
    assert_eq!(next.next_token(), step_at_or_above(FIRST_TOKEN + 1_000));
}

// ---- random sequences against the reference model --------------------------------

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        conn: u32,
        key: u8,
        wait_s: u8,
        lease_s: u8,
    },
    /// `which` picks the holder's token, a stale one, 0 or a random one.
    Release {
        conn: u32,
        key: u8,
        which: u8,
    },
    Extend {
        conn: u32,
        key: u8,
        lease_s: u8,
        which: u8,
    },
    Query {
        conn: u32,
        key: u8,
    },
    Info {
        conn: u32,
    },
    Reconnect {
        conn: u32,
    },
    Invalid {
        conn: u32,
        code: u8,
    },
    /// Moves the clock: `how` picks the next wake-up, just before it, a few
    /// ms, or seconds; `late` fires everything in one late call instead of
    /// tick by tick.
    Advance {
        how: u8,
        micros: u64,
        late: bool,
    },
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let conn = 0..3u32;
    let key = 0..3u8;
    prop_oneof![
        4 => (conn.clone(), key.clone(), prop_oneof![Just(0u8), 1..4u8, Just(255)], 1..4u8)
            .prop_map(|(conn, key, wait_s, lease_s)| Op::Acquire { conn, key, wait_s, lease_s }),
        2 => (conn.clone(), key.clone(), 0..4u8)
            .prop_map(|(conn, key, which)| Op::Release { conn, key, which }),
        1 => (conn.clone(), key.clone(), 1..4u8, 0..4u8)
            .prop_map(|(conn, key, lease_s, which)| Op::Extend { conn, key, lease_s, which }),
        1 => (conn.clone(), key.clone()).prop_map(|(conn, key)| Op::Query { conn, key }),
        1 => conn.clone().prop_map(|conn| Op::Info { conn }),
        1 => conn.clone().prop_map(|conn| Op::Reconnect { conn }),
        1 => (conn, 3..7u8).prop_map(|(conn, code)| Op::Invalid { conn, code }),
        4 => (0..4u8, 0..4_000_000u64, prop::bool::weighted(0.2))
            .prop_map(|(how, micros, late)| Op::Advance { how, micros, late }),
    ]
}

struct Pair {
    fake: Fake,
    model: Model,
    next_owner: u64,
    stale_token: u64,
}

impl Pair {
    fn check(&mut self, what: &str) -> Result<(), TestCaseError> {
        self.fake.core.check_invariants();
        let core = &self.fake.core;
        let model = &self.model;
        prop_assert_eq!(core.keys(), model.keys.len(), "keys after {}", what);
        prop_assert_eq!(
            core.waiter_count(),
            model.waiters(),
            "waiters after {}",
            what
        );
        prop_assert_eq!(
            core.next_token(),
            model.next_token,
            "next token after {}",
            what
        );
        prop_assert_eq!(core.connections(), model.conns.len());
        match (core.poll_timeout(), model.earliest_tick()) {
            (None, None) => {}
            (Some(at), Some(tick)) => {
                prop_assert!(at <= tick * MS, "wake-up {} after {}", at, tick)
            }
            (got, want) => prop_assert!(
                false,
                "poll_timeout {:?}, model's earliest tick {:?}",
                got,
                want
            ),
        }
        Ok(())
    }

    fn request(&mut self, conn: u32, request: &Request<'_>) -> Result<(), TestCaseError> {
        let now = self.fake.now;
        let core = self.fake.request(conn, request);
        let model = self.model.request(conn, request, now);
        same_in_order(&core, &model).map_err(TestCaseError::fail)?;
        self.check(&format!("{request:?} from {conn} at {now}"))
    }

    fn fire(&mut self, now: u64) -> Result<(), TestCaseError> {
        let core = self.fake.run_until(now);
        let model = self
            .model
            .timeout(now, &core)
            .map_err(TestCaseError::fail)?;
        same_as_multiset(&core, &model).map_err(TestCaseError::fail)?;
        self.check(&format!("firing at {now}"))
    }

    fn token(&mut self, key: &str, which: u8, random: u64) -> u64 {
        match (which, self.model.holder_token(key)) {
            (0, Some(token)) => token,
            (1, _) => self.stale_token,
            (2, _) => 0,
            _ => FIRST_TOKEN + random % 64,
        }
    }

    fn run(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let keys = ["a", "b", "a-key-longer-than-the-inline-nineteen-bytes"];
        match *op {
            Op::Acquire {
                conn,
                key,
                wait_s,
                lease_s,
            } => {
                self.next_owner += 1;
                let owner = self.next_owner;
                self.request(
                    conn,
                    &plain_acquire(wait_s, lease_s, owner, keys[key as usize]),
                )
            }
            Op::Release { conn, key, which } => {
                let key = keys[key as usize];
                let token = self.token(key, which, self.next_owner);
                if let Some(held) = self.model.holder_token(key) {
                    self.stale_token = held;
                }
                self.request(conn, &Request::Release { token, key })
            }
            Op::Extend {
                conn,
                key,
                lease_s,
                which,
            } => {
                let key = keys[key as usize];
                let token = self.token(key, which, self.next_owner);
                self.request(
                    conn,
                    &Request::Extend {
                        lease_s,
                        token,
                        key,
                    },
                )
            }
            Op::Query { conn, key } => self.request(
                conn,
                &Request::Query {
                    key: keys[key as usize],
                },
            ),
            Op::Info { conn } => self.request(conn, &Request::Info),
            Op::Reconnect { conn } => {
                self.fake.core.disconnect(conn, self.fake.now);
                self.model.disconnect(conn);
                prop_assert_eq!(self.fake.drain(), vec![]);
                self.fake.core.connect(conn);
                self.model.connect(conn);
                self.check("reconnect")
            }
            Op::Invalid { conn, code } => {
                let error = RequestError {
                    code: ErrorCode::from_u8(code).unwrap(),
                    id: self.next_owner,
                };
                self.fake.core.handle_invalid(conn, error);
                let core = self.fake.drain();
                same_in_order(&core, &self.model.invalid(conn, error))
                    .map_err(TestCaseError::fail)?;
                self.check("invalid request")
            }
            Op::Advance { how, micros, late } => {
                let now = self.fake.now;
                let next = self.fake.core.poll_timeout().unwrap_or(now + micros);
                let target = match how {
                    0 => next.max(now),
                    1 => next.saturating_sub(1).max(now),
                    2 => now + micros % 3_000,
                    _ => now + micros * 40,
                };
                if late {
                    return self.fire(target);
                }
                // Tick by tick, at each wake-up, as the shell would.
                let mut wakeups = 0;
                while let Some(at) = self.fake.core.poll_timeout().filter(|&at| at <= target) {
                    wakeups += 1;
                    prop_assert!(wakeups < 10_000, "livelock");
                    self.fire(at.max(self.fake.now))?;
                }
                self.fire(target)
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_match_the_reference_model(
        ops in prop::collection::vec(op_strategy(), 1..200),
        small in prop::bool::ANY,
        grace in prop_oneof![Just(0u64), 1..20 * S],
    ) {
        let limits = if small { limits(2, 3, 2, 2) } else { Limits::default() };
        let mut pair = Pair {
            fake: Fake::new(limits, 3),
            model: Model::new(limits, FIRST_TOKEN),
            next_owner: 0,
            stale_token: 0,
        };
        pair.fake.crash_grace(grace);
        pair.model.grace_until = grace;
        for conn in 0..3 {
            pair.model.connect(conn);
        }
        for op in &ops {
            pair.run(op)?;
        }
        // Let everything run out.
        pair.run(&Op::Advance { how: 3, micros: 3_000_000, late: false })?;
        pair.run(&Op::Advance { how: 3, micros: 3_000_000, late: true })?;
        prop_assert_eq!(pair.fake.core.keys(), 0);
        prop_assert_eq!(pair.fake.core.poll_timeout(), None);
    }
}

// ---- permits: semaphores and shared locks (spec §10) ---------------------------

fn mismatch(owner: u64, key_limit: u16) -> Response {
    Response::limit_mismatch(owner, key_limit)
}

fn grants_held(fake: &mut Fake) -> String {
    fake.info()["grants_held"].clone()
}

#[test]
fn counted_grants_that_fit_are_granted_at_once_and_one_that_does_not_waits_or_times_out() {
    let mut fake = Fake::with_conns(4);
    let first = fake.grant_permits(1, "sem", 30, 11, 3, 1);
    let second = fake.grant_permits(2, "sem", 20, 12, 3, 1);
    assert_eq!(second, first + 1);
    // 2 of 3 taken: a take of 2 does not fit; wait 0 times out at once.
    assert_eq!(
        fake.permits(3, "sem", 0, 30, 13, 3, 2, ""),
        vec![(3, timeout(13))]
    );
    fake.enqueue_permits(3, "sem", 9, 30, 14, 3, 2);
    // Q shows the grant with the smallest token; waiters counts the queue.
    assert_eq!(fake.query("sem"), (first, 11, 30_000, 1));
    assert_eq!(fake.core.held(), 1);
    assert_eq!(grants_held(&mut fake), "2");
    // Releasing one grant frees its permit: 1 + 2 fit now.
    assert_eq!(
        fake.release(1, "sem", first),
        vec![(1, released(first)), (3, acquired(14, second + 1))]
    );
    assert_eq!(fake.query("sem"), (second, 12, 20_000, 0));
    assert_eq!(grants_held(&mut fake), "2");
    fake.core.check_invariants();
}

#[test]
fn an_exclusive_request_waits_behind_counted_grants_and_nobody_overtakes_it() {
    let mut fake = Fake::with_conns(5);
    let reader = fake.grant_permits(1, "rw", 30, 1, 65535, 1);
    // The writer (take 0, all permits) does not fit while a reader holds.
    assert_eq!(
        fake.permits(2, "rw", 0, 30, 2, 65535, 0, ""),
        vec![(2, timeout(2))]
    );
    fake.enqueue_permits(2, "rw", 9, 30, 3, 65535, 0);
    // A reader after the writer would fit, but the queue is not empty.
    assert_eq!(
        fake.permits(3, "rw", 0, 30, 4, 65535, 1, ""),
        vec![(3, timeout(4))]
    );
    fake.enqueue_permits(3, "rw", 9, 30, 5, 65535, 1);
    // A plain `A` (no limit: never a mismatch) is exclusive and queues too.
    fake.enqueue(4, "rw", 9, 30, 6);
    assert_eq!(fake.query("rw"), (reader, 1, 30_000, 3));
    // The reader leaves: the writer alone; the reader behind it waits.
    assert_eq!(
        fake.release(1, "rw", reader),
        vec![(1, released(reader)), (2, acquired(3, reader + 1))]
    );
    assert_eq!(fake.query("rw"), (reader + 1, 3, 30_000, 2));
    // The writer leaves: the reader, then the `A` behind it does not fit.
    assert_eq!(
        fake.release(2, "rw", reader + 1),
        vec![(2, released(reader + 1)), (3, acquired(5, reader + 2))]
    );
    assert_eq!(
        fake.release(3, "rw", reader + 2),
        vec![(3, released(reader + 2)), (4, acquired(6, reader + 3))]
    );
    fake.core.check_invariants();
}

#[test]
fn a_small_take_behind_a_head_that_does_not_fit_waits_even_when_permits_are_free() {
    let mut fake = Fake::with_conns(4);
    let small = fake.grant_permits(1, "sem", 30, 1, 4, 1);
    // The head wants 4 of 4 (3 are free): it does not fit...
    fake.enqueue_permits(2, "sem", 9, 30, 2, 4, 4);
    // ...so a take of 1, which would fit, waits behind it.
    fake.enqueue_permits(3, "sem", 9, 30, 3, 4, 1);
    assert_eq!(fake.query("sem"), (small, 1, 30_000, 2));
    assert_eq!(fake.core.grants_held(), 1);
    // When the head times out, the scan goes on to the next, which fits.
    assert_eq!(
        fake.run_until(9 * S),
        vec![(2, timeout(2)), (3, acquired(3, small + 1))]
    );
    fake.core.check_invariants();
}

#[test]
fn one_release_grants_every_waiter_that_fits_in_queue_order_with_increasing_tokens() {
    let mut fake = Fake::with_conns(6);
    // An exclusive grant that names the limit (sets it like any other).
    let writer = fake.grant_permits(0, "sem", 30, 100, 3, 0);
    for (conn, owner) in [(1, 101), (2, 102), (3, 103)] {
        fake.enqueue_permits(conn, "sem", 9, 30, owner, 3, 1);
    }
    fake.enqueue_permits(4, "sem", 9, 30, 104, 3, 1);
    fake.set_now(2 * S);
    assert_eq!(
        fake.release(0, "sem", writer),
        vec![
            (0, released(writer)),
            (1, acquired(101, writer + 1)),
            (2, acquired(102, writer + 2)),
            (3, acquired(103, writer + 3)),
        ]
    );
    // The fourth did not fit and stopped the scan.
    assert_eq!(fake.query("sem"), (writer + 1, 101, 30_000, 1));
    assert_eq!(fake.core.grants_held(), 3);
    assert_eq!(fake.core.stats().grants, 4);
    fake.core.check_invariants();
}

#[test]
fn expiry_of_one_of_several_grants_frees_only_its_permits() {
    let mut fake = Fake::with_conns(4);
    let short = fake.grant_permits(1, "sem", 10, 1, 2, 1);
    let long = fake.grant_permits(2, "sem", 20, 2, 2, 1);
    fake.enqueue_permits(3, "sem", 30, 5, 3, 2, 1);
    fake.enqueue_permits(3, "sem", 30, 5, 4, 2, 1);
    assert_eq!(fake.run_until(10 * S - 1), vec![]);
    assert_eq!(fake.run_until(10 * S), vec![(3, acquired(3, long + 1))]);
    assert_eq!(fake.core.stats().expired, 1);
    // The other grant still holds with its own lease and token.
    assert_eq!(fake.query("sem"), (long, 2, 10_000, 1));
    assert_eq!(fake.extend(1, "sem", 10, short), vec![(1, not_held(short))]);
    assert_eq!(fake.extend(2, "sem", 30, long), vec![(2, extended(long))]);
    assert_eq!(fake.query("sem"), (long, 2, 30_000, 1));
    // The next expiry is the hand-over grant's (5 s lease from 10 s).
    assert_eq!(fake.run_until(15 * S), vec![(3, acquired(4, long + 2))]);
    fake.core.check_invariants();
}

#[test]
fn release_and_extend_act_on_the_exact_token_of_any_grant() {
    let mut fake = Fake::with_conns(2);
    let tokens: Vec<u64> = (0..3)
        .map(|owner| fake.grant_permits(1, "sem", 30, owner, 5, 1))
        .collect();
    fake.set_now(S);
    assert_eq!(
        fake.extend(1, "sem", 60, tokens[1]),
        vec![(1, extended(tokens[1]))]
    );
    for wrong in [0, tokens[2] + 1, u64::MAX] {
        assert_eq!(fake.release(1, "sem", wrong), vec![(1, not_held(wrong))]);
    }
    assert_eq!(
        fake.release(1, "sem", tokens[0]),
        vec![(1, released(tokens[0]))]
    );
    assert_eq!(
        fake.release(1, "sem", tokens[0]),
        vec![(1, not_held(tokens[0]))]
    );
    // The smallest live token is now the renewed one.
    assert_eq!(fake.query("sem"), (tokens[1], 1, 60_000, 0));
    assert_eq!(fake.run_until(31 * S), vec![]);
    assert_eq!(fake.query("sem"), (tokens[1], 1, 30_000, 0));
    assert_eq!(fake.core.grants_held(), 1);
    fake.core.check_invariants();
}

#[test]
fn a_different_limit_gets_x_10_naming_the_keys_limit_and_changes_nothing() {
    let mut fake = Fake::with_conns(3);
    let token = fake.grant_permits(1, "sem", 30, 1, 3, 1);
    let before = fake.core.next_token();
    for (wait_s, take) in [(0, 1), (9, 1), (9, 0), (0, 4)] {
        assert_eq!(
            fake.permits(2, "sem", wait_s, 30, 7, 4, take, "x"),
            vec![(2, mismatch(7, 3))]
        );
    }
    match &mismatch(7, 3) {
        Response::Error { code, id, text } => {
            assert_eq!((*code, *id), (ErrorCode::LimitMismatch as u8, 7));
            assert_eq!(text, "limit mismatch: key limit 3");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fake.core.next_token(), before);
    assert_eq!(fake.query("sem"), (token, 1, 30_000, 0));
    assert_eq!(fake.core.stats().errors, 4);
    assert_eq!(fake.core.waiter_count(), 0);
    // Limit 0 never mismatches: take 0 without a limit is exclusive.
    assert_eq!(
        fake.permits(2, "sem", 0, 30, 8, 0, 0, ""),
        vec![(2, timeout(8))]
    );
    fake.core.check_invariants();
}

#[test]
fn a_queued_request_sets_the_limit_and_it_goes_when_the_key_leaves_the_table() {
    let mut fake = Fake::with_conns(3);
    let plain = fake.grant(1, "k", 30, 1);
    // The key has no limit; this request queues and sets it to 2.
    fake.enqueue_permits(2, "k", 9, 30, 2, 2, 1);
    assert_eq!(
        fake.permits(2, "k", 9, 30, 3, 5, 1, ""),
        vec![(2, mismatch(3, 2))]
    );
    // The plain grant still holds with its token, owner and lease.
    assert_eq!(fake.query("k"), (plain, 1, 30_000, 1));
    assert_eq!(fake.extend(1, "k", 40, plain), vec![(1, extended(plain))]);
    assert_eq!(
        fake.release(1, "k", plain),
        vec![(1, released(plain)), (2, acquired(2, plain + 1))]
    );
    assert_eq!(
        fake.release(2, "k", plain + 1),
        vec![(2, released(plain + 1))]
    );
    assert_eq!(fake.core.keys(), 0);
    // Gone with the key: any limit is the first again.
    let again = fake.grant_permits(1, "k", 30, 4, 5, 5);
    assert_eq!(again, plain + 2);
    fake.core.check_invariants();
}

#[test]
fn a_request_that_ends_with_t_or_b_sets_no_limit() {
    let mut fake = Fake::new(limits(10, 10, 0, 10), 3);
    let plain = fake.grant(1, "k", 30, 1);
    assert_eq!(
        fake.permits(2, "k", 0, 30, 2, 2, 1, ""),
        vec![(2, timeout(2))]
    );
    // No room on the key's queue: B, and no limit either.
    assert_eq!(fake.permits(2, "k", 9, 30, 3, 3, 1, ""), vec![(2, busy(3))]);
    assert_eq!(
        fake.permits(2, "k", 0, 30, 4, 4, 1, ""),
        vec![(2, timeout(4))]
    );
    // The key never got a limit: the plain grant frees it, and a new
    // grant may name any limit.
    assert_eq!(fake.release(1, "k", plain), vec![(1, released(plain))]);
    assert_eq!(fake.core.keys(), 0);
    fake.grant_permits(1, "k", 30, 5, 9, 1);
    fake.core.check_invariants();
}

#[test]
fn max_grants_counts_grants_and_waiters_and_answers_busy_at_once() {
    let mut fake = Fake::new(
        Limits {
            max_grants: 3,
            ..Limits::default()
        },
        3,
    );
    let first = fake.grant_permits(1, "sem", 30, 1, 5, 1);
    fake.grant_permits(1, "sem", 30, 2, 5, 1);
    fake.enqueue_permits(2, "sem", 9, 30, 3, 5, 5);
    // 2 grants + 1 waiter: a grant or a waiter more would pass it.
    assert_eq!(
        fake.permits(2, "sem", 9, 30, 4, 5, 1, ""),
        vec![(2, busy(4))]
    );
    assert_eq!(fake.acquire(2, "other", 0, 30, 5), vec![(2, busy(5))]);
    assert_eq!(fake.acquire(2, "sem", 9, 30, 6), vec![(2, busy(6))]);
    assert_eq!(fake.core.next_token(), first + 2);
    assert_eq!(fake.core.stats().busy, 3);
    // A grant leaving makes room for one.
    assert_eq!(fake.release(1, "sem", first), vec![(1, released(first))]);
    assert_eq!(fake.grant(2, "other", 30, 7), first + 2);
    fake.core.check_invariants();
}

#[test]
fn the_head_waiter_leaving_lets_the_ones_behind_it_in() {
    let mut fake = Fake::with_conns(4);
    let held = fake.grant_permits(1, "sem", 30, 1, 3, 2);
    fake.enqueue_permits(2, "sem", 9, 30, 2, 3, 2);
    fake.enqueue_permits(3, "sem", 9, 30, 3, 3, 1);
    fake.enqueue_permits(3, "sem", 9, 30, 4, 3, 1);
    fake.set_now(S);
    // The head's connection closes: the next fits (2 + 1), the one after
    // it does not (2 + 1 + 1).
    fake.core.disconnect(2, fake.now);
    assert_eq!(fake.drain(), vec![(3, acquired(3, held + 1))]);
    assert_eq!(fake.query("sem"), (held, 1, 29_000, 1));
    fake.core.check_invariants();
}

#[test]
fn labels_travel_with_waiters_and_grants_and_change_no_answer() {
    let mut fake = Fake::with_conns(3);
    let label = "alice@host pid=42 backup.sh";
    assert_eq!(
        fake.permits(1, "sem", 0, 30, 1, 2, 2, label),
        vec![(1, acquired(1, FIRST_TOKEN))]
    );
    assert_eq!(fake.permits(2, "sem", 9, 30, 2, 2, 1, label), vec![]);
    assert_eq!(
        fake.permits(2, "x", 9, 30, 3, 0, 0, label),
        vec![(2, acquired(3, FIRST_TOKEN + 1))]
    );
    fake.core.check_invariants();
    assert_eq!(
        fake.release(1, "sem", FIRST_TOKEN),
        vec![
            (1, released(FIRST_TOKEN)),
            (2, acquired(2, FIRST_TOKEN + 2))
        ]
    );
    fake.run_until(40 * S);
    assert_eq!(fake.core.keys(), 0);
    fake.core.check_invariants();
}

#[test]
fn info_reports_grants_held_of_every_kind() {
    let mut fake = Fake::with_conns(2);
    assert_eq!(grants_held(&mut fake), "0");
    fake.grant(1, "plain", 30, 1);
    fake.grant_permits(1, "shared", 30, 2, 65535, 1);
    fake.grant_permits(1, "shared", 30, 3, 65535, 1);
    fake.grant_permits(1, "shared", 30, 4, 65535, 1);
    fake.enqueue_permits(1, "shared", 60, 30, 5, 65535, 0);
    let info = fake.info();
    assert_eq!(info["grants_held"], "4");
    assert_eq!(info["held"], "2");
    assert_eq!(info["keys"], "2");
    assert_eq!(info["waiters"], "1");
    assert_eq!(info["grants"], "4");
    fake.run_until(30 * S);
    assert_eq!(grants_held(&mut fake), "1");
    fake.run_until(60 * S);
    assert_eq!(grants_held(&mut fake), "0");
    fake.core.check_invariants();
}

// ---- `H` and `L` (spec §11) ----

/// The frames answering `H id key` on connection 0 (all must go there).
fn holders(fake: &mut Fake, id: u64, key: &str) -> Vec<Response> {
    fake.request(0, &Request::Holders { id, key })
        .into_iter()
        .map(|(conn, frame)| {
            assert_eq!(conn, 0, "{frame:?} went elsewhere");
            frame
        })
        .collect()
}

fn grant_frame(
    token: u64,
    owner: u64,
    lease_ms: u32,
    held_ms: u32,
    take: u16,
    label: &str,
) -> Response {
    Response::Grant {
        id: 9,
        token,
        owner,
        lease_ms,
        held_ms,
        take,
        label: label.into(),
    }
}

fn waiter_frame(owner: u64, wait_ms: u32, take: u16, label: &str) -> Response {
    Response::Waiter {
        id: 9,
        owner,
        wait_ms,
        take,
        label: label.into(),
    }
}

fn end_frame(count: u32, next: u64) -> Response {
    Response::End { id: 9, count, next }
}

#[test]
fn holders_lists_grants_in_token_order_then_waiters_in_queue_order_with_their_times() {
    let mut fake = Fake::with_conns(4);
    assert_eq!(holders(&mut fake, 9, "none"), vec![end_frame(0, 0)]);
    fake.set_now(S);
    let out = fake.permits(1, "shared", 0, 30, 21, 10, 1, "alice");
    assert_eq!(out, vec![(1, acquired(21, FIRST_TOKEN))]);
    fake.set_now(S + 300);
    let plain = fake.grant(1, "plain", 30, 11);
    fake.set_now(2 * S);
    let out = fake.permits(2, "shared", 0, 20, 22, 10, 2, "bob é ✓");
    assert_eq!(out, vec![(2, acquired(22, plain + 1))]);
    fake.set_now(3 * S);
    assert_eq!(
        fake.permits(3, "shared", 10, 30, 23, 10, 0, "carol"),
        vec![]
    );
    assert_eq!(fake.permits(3, "plain", 20, 30, 31, 0, 0, "dave"), vec![]);
    fake.set_now(3 * S + 1);
    fake.enqueue_permits(2, "shared", 100, 30, 24, 10, 3);
    fake.set_now(4 * S);
    assert_eq!(
        fake.extend(1, "plain", 10, plain),
        vec![(1, extended(plain))]
    );
    fake.set_now(5 * S + 500 * MS);
    assert_eq!(
        holders(&mut fake, 9, "shared"),
        vec![
            grant_frame(FIRST_TOKEN, 21, 25_500, 4_500, 1, "alice"),
            grant_frame(plain + 1, 22, 16_500, 3_500, 2, "bob é ✓"),
            waiter_frame(23, 7_500, 0, "carol"),
            // 103.000001 s − 5.5 s, rounded up.
            waiter_frame(24, 97_501, 3, ""),
            end_frame(4, 0),
        ]
    );
    // Held since the grant, not since the renewal at 4 s; 4,499.7 ms
    // rounded down.
    assert_eq!(
        holders(&mut fake, 9, "plain"),
        vec![
            grant_frame(plain, 11, 8_500, 4_499, 0, ""),
            waiter_frame(31, 17_500, 0, "dave"),
            end_frame(2, 0),
        ]
    );
    // A key that gets a limit keeps its grant's moment.
    assert_eq!(
        fake.permits(2, "plain", 0, 5, 32, 4, 1, ""),
        vec![(2, timeout(32))]
    );
    assert_eq!(fake.permits(2, "plain", 10, 5, 33, 4, 1, ""), vec![]);
    let frames = holders(&mut fake, 9, "plain");
    assert_eq!(frames[0], grant_frame(plain, 11, 8_500, 4_499, 0, ""));
    assert_eq!(frames.len(), 4);
    fake.core.check_invariants();
}

#[test]
fn holders_never_lists_a_lease_that_ran_out_even_before_its_timer_fired() {
    let mut fake = Fake::with_conns(3);
    fake.set_now(700);
    let token = fake.grant(1, "a", 3, 1);
    fake.grant(1, "b", 3, 2);
    fake.enqueue(2, "b", 100, 7, 3);
    // The deadline 3.0007 s is kept as tick 3001: the lease may have run
    // out from 3.000001 s on (the earliest deadline of that tick), so
    // `H` shows it until 3 s with 1 ms left (held 2,999.3 ms, rounded
    // down)...
    fake.set_now(3 * S);
    assert_eq!(
        holders(&mut fake, 9, "a"),
        vec![grant_frame(token, 1, 1, 2_999, 0, ""), end_frame(1, 0)]
    );
    // ...and never after, although its timer fires only at tick 3001.
    fake.set_now(3 * S + 1);
    assert_eq!(holders(&mut fake, 9, "a"), vec![end_frame(0, 0)]);
    assert_eq!(fake.query("a"), (token, 1, 0, 0));
    // From tick 3001 on the key is gone, even before any
    // `handle_timeout`: `H` fires what is due first, so "b" goes to its
    // waiter (its `A` on connection 2 before the answer).
    fake.set_now(3_001_000);
    let out = fake.request(0, &Request::Holders { id: 9, key: "a" });
    assert_eq!(out, vec![(2, acquired(3, token + 2)), (0, end_frame(0, 0))]);
    assert_eq!(
        holders(&mut fake, 9, "b"),
        vec![grant_frame(token + 2, 3, 7_000, 0, 0, ""), end_frame(1, 0)]
    );
    assert_eq!(fake.core.stats().expired, 2);
    fake.core.check_invariants();
}

#[test]
fn holders_sends_at_most_1000_grants_and_1000_waiters_and_counts_the_rest() {
    let limits = Limits {
        max_waits_per_conn: 2_000,
        ..Limits::default()
    };
    let mut fake = Fake::new(limits, 2);
    for owner in 0..1_005 {
        fake.grant_permits(1, "k", 30, owner, 65535, 1);
    }
    fake.enqueue_permits(1, "k", 60, 30, 5_000, 65535, 0);
    for owner in 0..1_002 {
        fake.enqueue_permits(1, "k", 60, 30, 6_000 + owner, 65535, 1);
    }
    let frames = holders(&mut fake, 9, "k");
    assert_eq!(frames.len(), 2_001);
    assert_eq!(frames[2_000], end_frame(2_000, 8));
    let tokens: Vec<u64> = frames[..1_000]
        .iter()
        .map(|frame| match frame {
            Response::Grant { token, .. } => *token,
            other => panic!("not a grant: {other:?}"),
        })
        .collect();
    assert_eq!(
        tokens,
        (FIRST_TOKEN..FIRST_TOKEN + 1_000).collect::<Vec<_>>()
    );
    assert_eq!(frames[1_000], waiter_frame(5_000, 60_000, 0, ""));
    assert_eq!(frames[1_999], waiter_frame(6_998, 60_000, 1, ""));
}

/// Spec §7.6, with a fake clock: while the state file cannot be written
/// the core grants only what the file promises — a token below its
/// high-water mark, a lease within its horizon, a counted grant only if
/// it allows them — and answers `B` to the rest (an `E`: `B` with its
/// token); everything else is served; without the ceiling all is as before.
#[test]
fn under_a_ceiling_what_the_state_file_does_not_promise_gets_b_and_the_rest_is_served() {
    use kunci::core::restart::Promise;
    let mut fake = Fake::with_conns(2);
    fake.core.set_ceiling(Some(Promise {
        token_high_water: FIRST_TOKEN + 2,
        horizon: 10 * S,
        counted_grants: false,
        macs_until: 0,
    }));
    // A lease within the horizon is granted; one past it is not.
    let a = fake.grant(0, "a", 10, 1);
    assert_eq!(fake.acquire(0, "b", 0, 11, 2), vec![(0, busy(2))]);
    // Renewals: within the horizon `E`, past it `B` with the token.
    fake.set_now(S);
    assert_eq!(fake.extend(0, "a", 9, a), vec![(0, extended(a))]);
    assert_eq!(fake.extend(0, "a", 10, a), vec![(0, busy(a))]);
    assert_eq!(fake.query("a").0, a);
    // A counted permit: the file does not allow one.
    assert_eq!(
        fake.permits(0, "sem", 0, 5, 3, 2, 1, ""),
        vec![(0, busy(3))]
    );
    // Held keys still answer `T`; waiters queue and are handed the key
    // only within the promise: the first waiter's lease would pass the
    // horizon at the hand-over (`B`), the second's fits.
    assert_eq!(fake.acquire(1, "a", 0, 1, 4), vec![(1, timeout(4))]);
    fake.enqueue(1, "a", 30, 5, 5);
    fake.enqueue(1, "a", 30, 1, 6);
    fake.set_now(8 * S + 500 * MS);
    let b = FIRST_TOKEN + 1;
    assert_eq!(
        fake.release(0, "a", a),
        vec![
            (0, Response::Released { token: a }),
            (1, busy(5)),
            (1, acquired(6, b))
        ]
    );
    // The high-water mark: token FIRST_TOKEN + 2 is not promised.
    assert_eq!(fake.acquire(0, "c", 0, 1, 7), vec![(0, busy(7))]);
    // The disk is back.
    fake.core.set_ceiling(None);
    assert_eq!(
        fake.acquire(0, "c", 0, 60, 8),
        vec![(0, acquired(8, b + 1))]
    );
    fake.core.check_invariants();
}

/// Spec §7.5: a grant restored after a clean stop keeps its label and
/// its grant time: `H` counts `held_ms` from the original grant (the time
/// held at the stop plus the downtime, given to `restore_grant`), and
/// `grants()` reports it again for the next stop.
#[test]
fn a_restored_grant_keeps_its_label_and_counts_its_time_held_from_the_original_grant() {
    let mut fake = Fake::with_conns(1);
    let restored = [
        ("plain", 7, 0, 0, "leader@a", 90_000u64),
        ("shared", 8, 1, 3, "reader@b", 4_000_000),
    ];
    for (key, token, take, limit, label, held_ms) in restored {
        let earlier = EarlierGrant {
            label,
            granted_at: 0u64.wrapping_sub(held_ms * MS),
            deadline: 10 * S,
            ..earlier(key, token, take, limit)
        };
        fake.core.restore_grant(&earlier).unwrap();
    }
    fake.core.check_invariants();
    fake.set_now(2 * S + 500 * MS);
    fake.core.handle_timeout(fake.now);
    let frames = holders(&mut fake, 9, "plain");
    assert_eq!(
        frames[0],
        grant_frame(7, 1, 7_500, 92_500, 0, "leader@a"),
        "{frames:?}"
    );
    let frames = holders(&mut fake, 9, "shared");
    assert_eq!(
        frames[0],
        grant_frame(8, 1, 7_500, 4_002_500, 1, "reader@b")
    );
    let listed: Vec<(&str, u64, &str)> = fake
        .core
        .grants()
        .map(|grant| {
            let held_ms = fake.now.wrapping_sub(grant.granted_at) / MS;
            (grant.key, held_ms, grant.label)
        })
        .collect();
    assert_eq!(
        listed,
        [
            ("plain", 92_500, "leader@a"),
            ("shared", 4_002_500, "reader@b")
        ]
    );
}

#[test]
fn holders_shows_the_unknown_grant_of_the_grace_as_token_0_and_adopted_grants_with_owner_0() {
    let mut fake = Fake::with_conns(3);
    fake.crash_grace(10 * S);
    fake.set_now(2 * S + 300);
    let unknown = grant_frame(0, 0, 8_000, 0, 0, "");
    assert_eq!(
        holders(&mut fake, 9, "a"),
        vec![unknown.clone(), end_frame(1, 0)]
    );
    fake.enqueue(1, "a", 100, 30, 1);
    assert_eq!(
        holders(&mut fake, 9, "a"),
        vec![
            unknown.clone(),
            waiter_frame(1, 100_000, 0, ""),
            end_frame(2, 0)
        ]
    );
    // A permit key during the grace: the unknown grant, then the waiter.
    fake.enqueue_permits(2, "p", 100, 30, 2, 5, 1);
    assert_eq!(
        holders(&mut fake, 9, "p"),
        vec![unknown, waiter_frame(2, 100_000, 1, ""), end_frame(2, 0)]
    );
    // Adoption (spec §7.3) of an earlier run's token: owner 0, held since.
    let earlier = old("b", 7);
    assert_eq!(
        fake.extend(2, "b", 5, earlier),
        vec![(2, extended(earlier))]
    );
    fake.set_now(3 * S + 300);
    assert_eq!(
        holders(&mut fake, 9, "b"),
        // 1,000 ms rounded down from the millisecond after the adoption.
        vec![grant_frame(earlier, 0, 4_000, 999, 0, ""), end_frame(1, 0)]
    );
    // After the horizon the waiter holds "a".
    fake.set_now(10 * S);
    let out = fake.request(0, &Request::Holders { id: 9, key: "a" });
    assert_eq!(out[0], (1, acquired(1, FIRST_TOKEN)));
    assert_eq!(out[1], (2, acquired(2, FIRST_TOKEN + 1)));
    assert_eq!(out[2], (0, grant_frame(FIRST_TOKEN, 1, 30_000, 0, 0, "")));
    fake.core.check_invariants();
}

/// Every `K` of one full listing with `prefix`, following the cursor from
/// 0 with pages of `count`; `between` runs after each page.
fn list_all(
    fake: &mut Fake,
    prefix: &str,
    count: u16,
    mut between: impl FnMut(&mut Fake),
) -> Vec<(String, u32, u32, u16)> {
    let mut keys = Vec::new();
    let mut cursor = 0;
    loop {
        let frames = fake.request(
            0,
            &Request::List {
                id: 5,
                cursor,
                count,
                prefix,
            },
        );
        let (last, page) = frames.split_last().expect("an answer");
        let Response::End {
            id: 5,
            count: sent,
            next,
        } = last.1
        else {
            panic!("the page does not end with Z: {last:?}");
        };
        assert_eq!(page.len(), sent as usize);
        assert!(page.len() <= usize::from(count));
        for (conn, frame) in page {
            assert_eq!(*conn, 0);
            let Response::Key {
                id: 5,
                grants,
                waiters,
                limit,
                key,
            } = frame
            else {
                panic!("not a K: {frame:?}");
            };
            assert!(key.starts_with(prefix));
            keys.push((key.clone(), *grants, *waiters, *limit));
        }
        if next == 0 {
            return keys;
        }
        cursor = next;
        between(fake);
    }
}

#[test]
fn list_pages_through_the_keys_with_a_prefix_and_their_counts() {
    let mut fake = Fake::with_conns(3);
    assert_eq!(list_all(&mut fake, "", 10, |_| {}), vec![]);
    fake.grant(1, "job/a", 30, 1);
    fake.enqueue(2, "job/a", 10, 30, 2);
    fake.grant_permits(1, "job/b", 30, 3, 4, 1);
    fake.grant_permits(1, "job/b", 30, 4, 4, 2);
    fake.grant(1, "other", 30, 5);
    for i in 0..50 {
        fake.grant(1, &format!("job/n{i:02}"), 30, 100 + i);
    }
    let mut keys = list_all(&mut fake, "job/", 7, |_| {});
    keys.sort();
    assert_eq!(keys.len(), 52);
    assert_eq!(keys[0], ("job/a".to_string(), 1, 1, 0));
    assert_eq!(keys[1], ("job/b".to_string(), 2, 0, 4));
    assert_eq!(keys[2], ("job/n00".to_string(), 1, 0, 0));
    assert_eq!(list_all(&mut fake, "", 1_000, |_| {}).len(), 53);
    // A stale cursor past the table ends the listing.
    let out = fake.request(
        0,
        &Request::List {
            id: 5,
            cursor: 1 << 40,
            count: 3,
            prefix: "",
        },
    );
    assert_eq!(
        out,
        vec![(
            0,
            Response::End {
                id: 5,
                count: 0,
                next: 0
            }
        )]
    );
}

#[test]
fn one_list_examines_at_most_16_slots_per_frame_it_may_send() {
    let mut fake = Fake::with_conns(2);
    for i in 0..100 {
        fake.grant(1, &format!("x{i}"), 30, i);
    }
    fake.grant(1, "wanted", 30, 1_000);
    // 101 slots; with count 2 one page examines 32 of them.
    let out = fake.request(
        0,
        &Request::List {
            id: 5,
            cursor: 0,
            count: 2,
            prefix: "wanted",
        },
    );
    assert_eq!(
        out,
        vec![(
            0,
            Response::End {
                id: 5,
                count: 0,
                next: 32
            }
        )]
    );
    let keys = list_all(&mut fake, "wanted", 2, |_| {});
    assert_eq!(keys, vec![("wanted".to_string(), 1, 0, 0)]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3, ..ProptestConfig::default() })]

    /// 100,000 keys; between pages the table grows (new keys, so the index
    /// doubles and the entries move to a larger array) and shrinks (keys
    /// released, their slots reused by new keys): every key in the table
    /// throughout is listed.
    #[test]
    fn a_listing_returns_every_key_present_throughout_while_the_table_changes(
        seed in any::<u64>(),
        count in 1u16..=1_000,
    ) {
        let limits = Limits { max_keys: 1 << 22, max_grants: 1 << 23, ..Limits::default() };
        let mut fake = Fake::new(limits, 2);
        let mut churn: Vec<(String, u64)> = Vec::new();
        let mut stay = Vec::new();
        for i in 0..100_000u64 {
            let key = format!("k/{i}");
            let token = fake.grant(1, &key, 255, i);
            if i % 2 == 0 { stay.push(key) } else { churn.push((key, token)) }
        }
        fake.grant(1, "elsewhere", 255, 0);
        let mut rng = seed;
        let mut next_key = 0u64;
        let keys = list_all(&mut fake, "k/", count, |fake| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let removals = (rng >> 33) as usize % (usize::from(count) * 2 + 1);
            for _ in 0..removals.min(churn.len()) {
                let at = (rng >> 20) as usize % churn.len();
                let (key, token) = churn.swap_remove(at);
                assert_eq!(fake.release(1, &key, token), vec![(1, released(token))]);
            }
            for _ in 0..(rng >> 45) as usize % (usize::from(count) * 3 + 1) {
                let key = format!("k/new{next_key}");
                let token = fake.grant(1, &key, 255, next_key);
                churn.push((key, token));
                next_key += 1;
            }
        });
        let listed: HashSet<String> = keys.into_iter().map(|(key, ..)| key).collect();
        for key in &stay {
            prop_assert!(listed.contains(key), "{key} was not listed");
        }
        prop_assert!(!listed.contains("elsewhere"));
    }
}

/// The bytes `frames` take on the wire.
fn wire_bytes(frames: &[Response]) -> usize {
    let mut out = Vec::new();
    for frame in frames {
        kunci::protocol::encode_response(frame, &mut out);
    }
    out.len()
}

/// Issue 27, finding 4: one `H` answer was 1,000 labelled `G` frames
/// (164 KB) on top of a full output buffer. Now its frames stop at
/// `ANSWER_BYTES_MAX` and the `Z` counts the rest as left out.
#[test]
fn holders_of_labelled_grants_stays_within_the_answer_bound_and_counts_the_rest() {
    let mut fake = Fake::with_conns(2);
    let label = "l".repeat(128);
    for owner in 0..1_000 {
        let out = fake.permits(1, "k", 0, 30, owner, 65535, 1, &label);
        assert_eq!(out.len(), 1, "{out:?}");
    }
    let frames = holders(&mut fake, 9, "k");
    let Some(&Response::End { count, next, .. }) = frames.last() else {
        panic!("no Z: {:?}", frames.last());
    };
    let grants = frames.len() - 1;
    assert_eq!(count as usize, grants);
    assert_eq!(count as u64 + next, 1_000);
    // 164 B a frame: as many as fit in 64 KiB, no fewer.
    assert_eq!(grants, kunci::core::ANSWER_BYTES_MAX / 164);
    assert!(wire_bytes(&frames[..grants]) <= kunci::core::ANSWER_BYTES_MAX);
}

/// Issue 27, finding 4: one `L` page of 1,000 keys of 255 bytes was
/// 275 KB. Now a page ends at `ANSWER_BYTES_MAX`, and following the
/// cursor still returns every key exactly once.
#[test]
fn a_list_page_stays_within_the_answer_bound_and_the_cursor_goes_on_from_there() {
    let mut fake = Fake::with_conns(2);
    let mut keys = HashSet::new();
    for n in 0..1_000 {
        let key = format!("{n:0>255}");
        fake.grant(1, &key, 30, 1);
        keys.insert(key);
    }
    let mut seen = HashSet::new();
    let mut cursor = 0;
    let mut pages = 0;
    loop {
        let out = fake.request(
            0,
            &Request::List {
                id: 9,
                cursor,
                count: 1_000,
                prefix: "",
            },
        );
        let frames: Vec<Response> = out.into_iter().map(|(_, frame)| frame).collect();
        assert!(wire_bytes(&frames[..frames.len() - 1]) <= kunci::core::ANSWER_BYTES_MAX);
        for frame in &frames {
            if let Response::Key { key, .. } = frame {
                assert!(seen.insert(key.clone()), "{key} twice");
            }
        }
        pages += 1;
        match frames.last() {
            Some(&Response::End { next: 0, .. }) => break,
            Some(&Response::End { next, .. }) => cursor = next,
            other => panic!("no Z: {other:?}"),
        }
        assert!(pages < 10);
    }
    assert_eq!(seen, keys);
    // 275 B a frame: 238 keys a page.
    assert_eq!(pages, 5);
}

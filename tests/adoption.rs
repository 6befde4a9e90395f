//! Adoption bound to the key (spec §7.3 v5), on the sans-IO core with a
//! fake clock: during a crash grace an `E`/`R` adopts only a token the
//! previous run bound to that key, none above its last grant, with 16
//! refused tries per adopter per grace.

use std::net::{IpAddr, Ipv4Addr};

use kunci::core::restart::{CleanStop, Durability};
use kunci::core::token_binding::{MAC_AHEAD_MAX, STEP, TokenBinding};
use kunci::core::{Adopter, Core, Limits};
use kunci::protocol::{Request, Response};

use crate::util::fake::{FIRST_TOKEN, Fake, S, binding, old};

fn extended(token: u64) -> Response {
    Response::Extended { token }
}

fn released(token: u64) -> Response {
    Response::Released { token }
}

fn not_held(token: u64) -> Response {
    Response::NotHeld { token }
}

/// A core in a crash grace of 10 s whose previous run bound its tokens
/// up to `old(_, 100)`, at 1 s into the grace.
fn grace(conns: u32) -> Fake {
    let mut fake = Fake::with_conns(conns);
    fake.crash_grace(10 * S);
    fake.core.set_adoptable_until(old("db", 100) | (STEP - 1));
    fake.set_now(S);
    fake
}

fn peer(last: u8) -> Adopter {
    Adopter::Peer(IpAddr::V4(Ipv4Addr::new(192, 0, 2, last)))
}

#[test]
fn only_a_token_bound_to_the_key_adopts_it() {
    for counted in [false, true] {
        let mut fake = grace(2);
        fake.core.set_grace_counted(counted);
        let holder = old("db", 7);
        let made_up = [
            old("other", 7), // a token of another key
            1,               // token 1
            holder - 1,      // the holder's neighbours
            holder + 1,
            old("db", 101),  // bound to the key, above the last grant
            old("db", 5000), // far above it
        ];
        for token in made_up {
            assert_eq!(fake.extend(1, "db", 30, token), vec![(1, not_held(token))]);
            assert_eq!(fake.release(1, "db", token), vec![(1, not_held(token))]);
        }
        // Nothing changed: the unknown grant still holds the key.
        assert_eq!(fake.query("db"), (0, 0, 9_000, 0));
        assert_eq!(fake.core.keys(), 0);
        assert_eq!(fake.acquire(0, "db", 0, 30, 1), vec![(0, timeout(1))]);
        // The holder (another adopter: 12 refusals were this one's)
        // adopts it.
        fake.core.set_adopter(0, peer(1));
        assert_eq!(
            fake.extend(0, "db", 30, holder),
            vec![(0, extended(holder))]
        );
        assert_eq!(fake.query("db").0, holder);
        fake.core.check_invariants();
    }
}

fn timeout(owner: u64) -> Response {
    Response::Timeout { owner }
}

#[test]
fn two_thousand_forged_tries_adopt_nothing_and_add_no_key() {
    let mut fake = grace(2);
    let keys_before = fake.core.keys();
    let mut forged = 0u64;
    for i in 0..2_000u64 {
        let key = format!("k{}", i % 50);
        // Tokens bound to other keys, and their neighbours.
        let token = old(&format!("x{i}"), 1 + i % 90) ^ (i & 1);
        let out = if i % 2 == 0 {
            fake.extend(1, &key, 30, token)
        } else {
            fake.release(1, &key, token)
        };
        assert_eq!(out, vec![(1, not_held(token))], "try {i}");
        forged += 1;
    }
    assert_eq!(forged, 2_000);
    assert_eq!(fake.core.keys(), keys_before);
    assert_eq!(fake.core.grants_held(), 0);
    // After 16 refusals this adopter's tries are not even checked: its
    // genuine token is refused too.
    let genuine = old("k3", 3);
    assert_eq!(
        fake.extend(1, "k3", 30, genuine),
        vec![(1, not_held(genuine))]
    );
    // Another adopter's is not.
    fake.core.set_adopter(0, peer(9));
    assert_eq!(
        fake.extend(0, "k3", 30, genuine),
        vec![(0, extended(genuine))]
    );
    fake.core.check_invariants();
}

#[test]
fn sixteen_refused_tries_per_adopter_per_grace() {
    let mut fake = grace(4);
    fake.core.set_adopter(0, peer(1));
    fake.core.set_adopter(1, peer(1));
    fake.core.set_adopter(2, peer(2));
    fake.core.set_adopter(3, Adopter::Identity(0));
    // 15 refusals over two connections of one address: the 16th try may
    // still adopt.
    for i in 0..15 {
        let token = old("a", 3) + 1 + i;
        assert_eq!(
            fake.extend(i as u32 % 2, "a", 30, token),
            vec![(i as u32 % 2, not_held(token))]
        );
    }
    let a = old("a", 3);
    assert_eq!(fake.extend(1, "a", 30, a), vec![(1, extended(a))]);
    // One more refusal makes 16: then the address's genuine tries fail.
    let b = old("b", 4);
    assert_eq!(fake.extend(0, "b", 30, b + 1), vec![(0, not_held(b + 1))]);
    for conn in [0, 1] {
        assert_eq!(fake.extend(conn, "b", 30, b), vec![(conn, not_held(b))]);
        assert_eq!(fake.release(conn, "b", b), vec![(conn, not_held(b))]);
    }
    // Another address and an identity count on their own.
    assert_eq!(fake.release(2, "b", b), vec![(2, released(b))]);
    let c = old("c", 5);
    assert_eq!(fake.extend(3, "c", 30, c), vec![(3, extended(c))]);
    // The counts go with the grace: afterwards nothing is adopted anyway.
    fake.run_until(10 * S);
    assert_eq!(fake.query("b"), (0, 0, 0, 0));
    fake.core.check_invariants();
}

#[test]
fn without_a_secret_or_after_a_file_without_macs_nothing_is_adopted() {
    // A core never told a secret (a server without a state directory).
    let mut fake = Fake::with_conns(1);
    fake.core.set_grace_until(10 * S);
    let token = old("db", 1);
    assert_eq!(fake.extend(0, "db", 30, token), vec![(0, not_held(token))]);
    // A secret, but a state file of format 1 to 4 (macs_until 0).
    let mut fake = Fake::with_conns(1);
    fake.crash_grace(10 * S);
    fake.core.set_adoptable_until(0);
    assert_eq!(fake.extend(0, "db", 30, token), vec![(0, not_held(token))]);
    assert_eq!(fake.core.keys(), 0);
}

/// A run that binds its tokens, crashes, and the next run on the same
/// secret: its holders adopt with their own tokens, nobody with another's.
#[test]
fn a_bound_run_s_holders_adopt_after_a_crash_and_only_on_their_keys() {
    let mut fake = Fake::with_conns(2);
    fake.core.bind_tokens(binding(), FIRST_TOKEN);
    assert!(fake.core.binds_tokens());
    let mut durability = Durability::new();
    let db = fake.grant(0, "db", 30, 1);
    let queue = fake.grant(0, "queue", 30, 2);
    // Strictly increasing, 2^16 apart at the counter, the MAC below.
    assert_eq!(db >> 16, FIRST_TOKEN >> 16);
    assert_eq!(queue >> 16, (FIRST_TOKEN >> 16) + 1);
    assert!(binding().verify(b"db", db) && binding().verify(b"queue", queue));
    let promise = durability.needed(&fake.core).unwrap();
    assert_eq!(promise.macs_until, promise.token_high_water - 1);
    assert_eq!(
        promise.token_high_water,
        fake.core.next_token() + (1 << 26) * STEP
    );
    durability.persisted(promise);
    // kill -9; the next run starts above the high-water mark.
    let mut next = Fake {
        core: Core::new(Limits::default(), promise.token_high_water),
        now: 0,
    };
    next.core.bind_tokens(binding(), promise.token_high_water);
    next.core.connect(0);
    next.core.set_adoptable_until(promise.macs_until);
    next.core.set_grace_until(30 * S);
    assert_eq!(next.extend(0, "db", 30, queue), vec![(0, not_held(queue))]);
    assert_eq!(next.extend(0, "db", 30, db), vec![(0, extended(db))]);
    assert_eq!(next.release(0, "queue", queue), vec![(0, released(queue))]);
    next.core.check_invariants();
}

#[test]
fn tokens_far_ahead_of_the_clock_go_plus_1_without_a_mac_and_the_file_says_so() {
    let mut fake = Fake::with_conns(1);
    fake.core.bind_tokens(binding(), FIRST_TOKEN);
    let bound = fake.grant(0, "a", 30, 1);
    assert!(!fake.core.watch_token_clock(FIRST_TOKEN));
    assert!(
        !fake
            .core
            .watch_token_clock(FIRST_TOKEN + STEP - MAC_AHEAD_MAX)
    );
    // The clock is far behind: the next grants go +1.
    assert!(fake.core.watch_token_clock(FIRST_TOKEN - MAC_AHEAD_MAX));
    assert!(!fake.core.binds_tokens());
    let from = fake.core.next_token();
    assert_eq!(fake.grant(0, "b", 30, 2), from);
    assert_eq!(fake.grant(0, "c", 30, 3), from + 1);
    assert!(bound < from);
    // The state file records the last token that may be bound: the
    // next run adopts nothing above it.
    let promise = Durability::new().needed(&fake.core).unwrap();
    assert_eq!(promise.macs_until, from - 1);
    assert_eq!(CleanStop::of(&fake.core, 0).macs_until, from - 1);
    // Started that far ahead, a run binds nothing at all.
    let mut ahead = Core::new(Limits::default(), FIRST_TOKEN);
    ahead.bind_tokens(binding(), FIRST_TOKEN - MAC_AHEAD_MAX - 1);
    assert!(!ahead.binds_tokens());
    assert_eq!(ahead.next_token(), FIRST_TOKEN);
}

#[test]
fn another_secret_adopts_nothing() {
    let mut fake = grace(1);
    let stranger = TokenBinding::new(b"not-the-secret!!").token(b"db", 7);
    assert_eq!(
        fake.extend(0, "db", 30, stranger),
        vec![(0, not_held(stranger))]
    );
    assert_eq!(fake.request(0, &Request::Query { key: "db" }).len(), 1);
    assert_eq!(fake.core.keys(), 0);
}

/// The endpoint names the adopter: a TCP peer by its address (an
/// IPv4-mapped IPv6 one as IPv4), every Unix peer as one.
#[test]
fn refused_tries_count_per_peer_address_through_the_endpoint() {
    use std::net::Ipv6Addr;

    use kunci::protocol::{encode_request, encode_response};

    let mut wire = crate::util::wire::Wire::new();
    {
        let core = wire.endpoint.core_mut();
        core.bind_tokens(binding(), 0);
        core.set_adoptable_until(FIRST_TOKEN - 1);
        core.set_grace_until(10 * S);
    }
    let a = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
    let a_mapped = IpAddr::V6(Ipv4Addr::new(192, 0, 2, 1).to_ipv6_mapped());
    let b = IpAddr::V6(Ipv6Addr::LOCALHOST);
    for (id, peer) in [
        (0, Some(a)),
        (1, Some(a_mapped)),
        (2, Some(b)),
        (3, None),
        (4, None),
    ] {
        wire.endpoint.accept(id, peer, 0);
    }
    let extend = |key: &str, token: u64| {
        let mut bytes = Vec::new();
        let request = Request::Extend {
            lease_s: 30,
            token,
            key,
        };
        encode_request(&request, &mut bytes);
        bytes
    };
    let answer = |response: Response| {
        let mut bytes = Vec::new();
        encode_response(&response, &mut bytes);
        bytes
    };
    // 16 refusals from address a (over its two connections), and from the
    // Unix peers.
    for i in 0..16u64 {
        let forged = old("k", 1) + 1 + i;
        for id in [(i % 2) as u32, 3] {
            assert_eq!(
                wire.exchange(id, &extend("k", forged)),
                answer(not_held(forged))
            );
        }
    }
    let genuine = old("k", 1);
    for id in [0, 1, 4] {
        assert_eq!(
            wire.exchange(id, &extend("k", genuine)),
            answer(not_held(genuine)),
            "connection {id}"
        );
    }
    assert_eq!(
        wire.exchange(2, &extend("k", genuine)),
        answer(extended(genuine))
    );
}

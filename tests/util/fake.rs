//! The sans-IO core on a fake clock: every call says what time it is, and
//! returns the responses the call produced.

use std::collections::BTreeMap;

use kunci::core::token_binding::TokenBinding;
use kunci::core::{ConnId, Core, Limits, Micros, Output};
use kunci::protocol::{Request, Response};

use super::plain_acquire;

pub const MS: Micros = 1_000;
pub const S: Micros = 1_000_000;

/// The first token the tests' cores hand out: far enough above 0 that an
/// earlier run's tokens bound to their keys (see [`old`]) lie below it,
/// and a multiple of 2^16 (a state directory's binding keeps it).
pub const FIRST_TOKEN: u64 = (1 << 52) + (1 << 16);

/// The secret the earlier run of a test's crash grace bound its tokens
/// with (spec §7.3 v5).
pub const SECRET: [u8; 16] = *b"kunci-test-adopt";

pub fn binding() -> TokenBinding {
    TokenBinding::new(&SECRET)
}

/// The token of the earlier run's grant number `n` (≥ 1), on `key`: what
/// its holder adopts with during the grace. A larger `n`, a larger token.
pub fn old(key: &str, n: u64) -> u64 {
    binding().token(key.as_bytes(), n)
}

/// The tick at or after `at` (deadlines round up to a 1 ms tick).
pub fn tick_of(at: Micros) -> u64 {
    at.div_ceil(MS)
}

pub struct Fake {
    pub core: Core,
    pub now: Micros,
}

impl Fake {
    /// A core with `limits`, connections `0..conns` open, at time 0.
    pub fn new(limits: Limits, conns: ConnId) -> Fake {
        let mut core = Core::new(limits, FIRST_TOKEN);
        for conn in 0..conns {
            core.connect(conn);
        }
        Fake { core, now: 0 }
    }

    pub fn with_conns(conns: ConnId) -> Fake {
        Fake::new(Limits::default(), conns)
    }

    /// The grace after a crash of an earlier run (spec §7.2–3) until
    /// `until`: that run bound its tokens with [`SECRET`], all below this
    /// run's first. This run's tokens still go +1 (its first token is far
    /// above a clock at 0, spec §7.6's fallback).
    pub fn crash_grace(&mut self, until: Micros) {
        self.core.bind_tokens(binding(), 0);
        assert!(!self.core.binds_tokens());
        self.core.set_adoptable_until(FIRST_TOKEN - 1);
        self.core.set_grace_until(until);
    }

    /// Moves the clock to `now` without firing anything.
    pub fn set_now(&mut self, now: Micros) {
        assert!(
            now >= self.now,
            "the fake clock goes back from {} to {now}",
            self.now
        );
        self.now = now;
    }

    /// Moves the clock to `now` and fires what is due.
    /// Fires what is due at `now`, in as many turns as the core's budget
    /// per turn takes (as the shell comes back at once while
    /// `poll_timeout` is due).
    pub fn run_until(&mut self, now: Micros) -> Vec<Output> {
        self.set_now(now);
        loop {
            self.core.handle_timeout(now);
            if self.core.poll_timeout().is_none_or(|due| due > now) {
                break;
            }
        }
        self.drain()
    }

    pub fn drain(&mut self) -> Vec<Output> {
        self.core.drain_outbox().collect()
    }

    pub fn request(&mut self, conn: ConnId, request: &Request<'_>) -> Vec<Output> {
        self.core.handle_request(conn, request, self.now);
        self.drain()
    }

    pub fn acquire(
        &mut self,
        conn: ConnId,
        key: &str,
        wait_s: u8,
        lease_s: u8,
        owner: u64,
    ) -> Vec<Output> {
        self.request(conn, &plain_acquire(wait_s, lease_s, owner, key))
    }

    /// An acquire that must be granted at once; returns its token.
    pub fn grant(&mut self, conn: ConnId, key: &str, lease_s: u8, owner: u64) -> u64 {
        match self.acquire(conn, key, 0, lease_s, owner).as_slice() {
            [(to, Response::Acquired { owner: got, token })] if *to == conn && *got == owner => {
                *token
            }
            other => panic!("acquire of {key:?} not granted at once: {other:?}"),
        }
    }

    /// An `S` (spec §10): `limit` 0 names none, `take` 0 takes all.
    #[allow(clippy::too_many_arguments)]
    pub fn permits(
        &mut self,
        conn: ConnId,
        key: &str,
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        limit: u16,
        take: u16,
        label: &str,
    ) -> Vec<Output> {
        self.request(
            conn,
            &Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
                limit,
                take,
                label,
            },
        )
    }

    /// An `S` that must be granted at once; returns its token.
    pub fn grant_permits(
        &mut self,
        conn: ConnId,
        key: &str,
        lease_s: u8,
        owner: u64,
        limit: u16,
        take: u16,
    ) -> u64 {
        match self
            .permits(conn, key, 0, lease_s, owner, limit, take, "")
            .as_slice()
        {
            [(to, Response::Acquired { owner: got, token })] if *to == conn && *got == owner => {
                *token
            }
            other => panic!("S {limit}/{take} on {key:?} not granted at once: {other:?}"),
        }
    }

    /// An `S` that must be queued (no answer yet).
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue_permits(
        &mut self,
        conn: ConnId,
        key: &str,
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        limit: u16,
        take: u16,
    ) {
        let out = self.permits(conn, key, wait_s, lease_s, owner, limit, take, "");
        assert_eq!(
            out,
            vec![],
            "S {limit}/{take} on {key:?} by {owner} was not queued"
        );
    }

    /// An acquire that must be queued (no answer yet).
    pub fn enqueue(&mut self, conn: ConnId, key: &str, wait_s: u8, lease_s: u8, owner: u64) {
        let out = self.acquire(conn, key, wait_s, lease_s, owner);
        assert_eq!(
            out,
            vec![],
            "acquire of {key:?} by owner {owner} was not queued"
        );
    }

    pub fn release(&mut self, conn: ConnId, key: &str, token: u64) -> Vec<Output> {
        self.request(conn, &Request::Release { token, key })
    }

    pub fn extend(&mut self, conn: ConnId, key: &str, lease_s: u8, token: u64) -> Vec<Output> {
        self.request(
            conn,
            &Request::Extend {
                lease_s,
                token,
                key,
            },
        )
    }

    /// The `Q` answer for `key`, as (token, owner, lease_ms, waiters).
    pub fn query(&mut self, key: &str) -> (u64, u64, u32, u32) {
        match self.request(0, &Request::Query { key }).as_slice() {
            [
                (
                    0,
                    Response::Query {
                        token,
                        owner,
                        lease_ms,
                        waiters,
                    },
                ),
            ] => (*token, *owner, *lease_ms, *waiters),
            other => panic!("query of {key:?}: {other:?}"),
        }
    }

    /// The `I` answer parsed into its `name=value` pairs.
    pub fn info(&mut self) -> BTreeMap<String, String> {
        match self.request(0, &Request::Info).as_slice() {
            [(0, Response::Info(text))] => parse_info(text),
            other => panic!("info: {other:?}"),
        }
    }
}

/// Splits an `I` text into its pairs, checking the format on the way:
/// ASCII `name=value` separated by single spaces, no name twice.
pub fn parse_info(text: &str) -> BTreeMap<String, String> {
    assert!(text.is_ascii() && !text.contains('\n'), "{text:?}");
    let mut pairs = BTreeMap::new();
    for pair in text.split(' ') {
        let (name, value) = pair
            .split_once('=')
            .unwrap_or_else(|| panic!("{pair:?} in {text:?}"));
        assert!(
            !name.is_empty() && !value.is_empty(),
            "{pair:?} in {text:?}"
        );
        assert!(
            pairs.insert(name.to_owned(), value.to_owned()).is_none(),
            "{name} twice in {text:?}"
        );
    }
    pairs
}

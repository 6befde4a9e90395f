//! Following a key and leader election (spec §13): one `O` as
//! [`Client::observe_key`], and on top of it [`Client::leader`],
//! [`Client::observe`] and [`Client::campaign`]. An election keeps no
//! state of its own on the server: the leader is the holder of an
//! exclusive key, its value the grant's label, its term the grant's token.

use std::time::{Duration, Instant};

use super::ticket::campaign_value;
use super::vocabulary::{
    Error, Key, KeyState, Op, Outcome, Seen, TRANSPORT_DEADLINE, WAIT_MAX, outcome_error,
};
use super::{AcquireOptions, Client, KeptLease};

/// Who leads an election (spec §13.6). During a crash grace (the key
/// held by an earlier run's grant nobody has adopted yet) someone may
/// lead, but who is unknown: then `value` is `None`, `term` 0 and
/// `held_for` `None` ([`is_unknown`](Self::is_unknown)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leader {
    /// The value the leader campaigned with (or last proclaimed); `None`
    /// for the unknown leader of a crash grace.
    pub value: Option<String>,
    /// Its term: the grant's token, a fencing token for what it writes;
    /// 0 for the unknown leader.
    pub term: u64,
    /// How long it has led; `None` when unknown (on etcd, a leader that
    /// did not store its grant time: one that took the key without
    /// campaigning, docs/ETCD.md).
    pub held_for: Option<Duration>,
}

impl Leader {
    /// The leader a state shows, if any: the key's current grant, or the
    /// unknown leader when a crash grace holds the key (spec §7.2, §13.2:
    /// token 0 with a grant).
    fn of(state: KeyState) -> Option<Leader> {
        if state.token == 0 {
            return (state.grants > 0).then_some(Leader::UNKNOWN);
        }
        Some(Leader {
            value: Some(state.label),
            term: state.token,
            held_for: state.held_ms.map(|ms| Duration::from_millis(u64::from(ms))),
        })
    }

    /// The leader of a crash grace: someone may lead, nobody knows who.
    pub const UNKNOWN: Leader = Leader {
        value: None,
        term: 0,
        held_for: None,
    };

    /// Whether this is the unknown leader of a crash grace.
    pub fn is_unknown(&self) -> bool {
        self.term == 0
    }
}

/// The longest pause between two attempts of [`Observe`] after a failure
/// (each pause is taken ±25 %, `jitter.rs`).
const PAUSE_MAX: Duration = Duration::from_secs(2);
/// The first such pause; it doubles up to [`PAUSE_MAX`].
const PAUSE_FIRST: Duration = Duration::from_millis(100);

impl Client {
    /// One `O` on `key` (spec §13.1): the key's state at once when its
    /// token is not `since` (or `wait` is zero), else when the token
    /// changes or `wait` (at most 255 s, sent rounded up to whole
    /// seconds) has passed, then unchanged. It returns by
    /// `start + wait + 5 s`; nothing changes on the server, so asking
    /// again is always safe. A server with no room for one more watch
    /// answers [`Error::Busy`].
    pub fn observe_key(&self, key: &str, since: u64, wait: Duration) -> Result<KeyState, Error> {
        self.observe_seen(key, since, wait, None)
    }

    /// [`observe_key`](Self::observe_key) that, on etcd, also ends when
    /// the key's state no longer shows what `seen` says was reported.
    fn observe_seen(
        &self,
        key: &str,
        since: u64,
        wait: Duration,
        seen: Option<Seen>,
    ) -> Result<KeyState, Error> {
        let key = Key::new(key).map_err(Error::InvalidArgument)?;
        if wait > WAIT_MAX {
            return Err(Error::InvalidArgument("wait is longer than 255 s"));
        }
        let wait_s = wait.as_secs() as u8 + u8::from(wait.subsec_nanos() != 0);
        let op = Op::Observe {
            id: self.fresh_owner(),
            since,
            wait_s,
            seen,
        };
        let deadline = Instant::now() + wait + TRANSPORT_DEADLINE;
        match self.call(op, key, deadline) {
            Outcome::Observed(state) => Ok(state),
            outcome => Err(outcome_error(outcome)),
        }
    }

    /// Who leads the election `name` now (one `O` with wait 0), or `None`
    /// while nobody does.
    pub fn leader(&self, name: &str) -> Result<Option<Leader>, Error> {
        self.observe_key(name, 0, Duration::ZERO).map(Leader::of)
    }

    /// Follows the election `name` (spec §13.6): an iterator that yields
    /// the current leader (or `None`) first, then one item per change of
    /// leader. Across restarts and outages it asks again quietly, with a
    /// pause that doubles up to 2 s, and yields a state only when it
    /// differs from the last one yielded; a change shorter than one round
    /// trip may be missed, and terms only ever increase. A new value of
    /// the same term (a proclaim) is a change, and so is a time in office
    /// that becomes known (on etcd, where a campaign stamps its grant time
    /// just after its grant: the leader is yielded again with `held_for`).
    /// Pauses are taken ±25 %. A crash grace is not
    /// "nobody leads": an observer that was following a leader keeps it
    /// (the grant adopted with the same term is no change, nor is its
    /// value empty until the holder proclaims it again), and one with
    /// nothing yielded yet yields [`Leader::UNKNOWN`]. It yields an
    /// error only for [`Error::InvalidArgument`] or
    /// [`Error::PermissionDenied`], and ends after it.
    ///
    /// ```no_run
    /// # use kunci::client::{Client, Config};
    /// # let client = Client::new(["127.0.0.1:5862".parse()?], Config::default())?;
    /// for leader in client.observe("db-primary") {
    ///     match leader? {
    ///         Some(leader) if leader.is_unknown() => println!("unknown leader (crash grace)"),
    ///         Some(leader) => println!("{:?} leads, term {}", leader.value, leader.term),
    ///         None => println!("nobody leads"),
    ///     }
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn observe(&self, name: &str) -> Observe {
        Observe {
            client: self.clone(),
            name: name.to_owned(),
            since: None,
            seen: None,
            reported: None,
            unproclaimed: false,
            ended: false,
        }
    }

    /// Campaigns in the election `name` with `value` (1..=128 bytes, no
    /// newline): an exclusive acquire of `name` labelled `value`, waiting
    /// as long as it takes ([`acquire_forever`](Self::acquire_forever)),
    /// kept alive in the background. It returns once this candidate
    /// leads; the lease's token is its term. Releasing the lease resigns;
    /// a candidate whose process dies loses the lead at its lease's end.
    ///
    /// The lead's [`proclaim`](KeptLease::proclaim) changes the value and
    /// keeps the term; its [`release`](KeptLease::release) after a loss
    /// resigns quietly (`Ok`), as etcd's `Resign`; its
    /// [`wait_lost`](KeptLease::wait_lost) blocks until the lead is lost.
    /// After a restarted server adopted the grant (spec §7.5) the value is
    /// proclaimed again at once.
    pub fn campaign(&self, name: &str, value: &str, lease: Duration) -> Result<KeptLease, Error> {
        campaign_value(value)?;
        let options = AcquireOptions::new().label(value).for_campaign();
        Ok(self
            .acquire_forever(name, lease, options)?
            .keep_alive_fresh()?
            .for_campaign())
    }

    /// [`campaign`](Self::campaign) bounded by `wait` (at most 255 s, as
    /// an acquire's, spec §13.6 `wait=`): one wait in the queue, which
    /// ends [`Error::Timeout`] if this candidate does not lead by then
    /// (its place in the queue is given up). Like an acquire it returns
    /// by `start + wait + 5 s`, and a server that cannot be reached is
    /// [`Error::Unavailable`] rather than waited through; for longer
    /// waits, call it again (or use [`campaign`](Self::campaign)).
    pub fn campaign_within(
        &self,
        name: &str,
        value: &str,
        lease: Duration,
        wait: Duration,
    ) -> Result<KeptLease, Error> {
        campaign_value(value)?;
        let options = AcquireOptions::new().label(value).for_campaign();
        Ok(self
            .acquire_with(name, wait, lease, options)?
            .keep_alive_fresh()?
            .for_campaign())
    }
}

/// The changes of leader of one election: see [`Client::observe`].
#[derive(Debug)]
pub struct Observe {
    client: Client,
    name: String,
    /// The token of the last answer, `None` before the first.
    since: Option<u64>,
    /// What the last answer showed besides its token (etcd answers a
    /// change of it at once).
    seen: Option<Seen>,
    /// The last state yielded (value, term, and whether the time in
    /// office was known), `None` before the first.
    reported: Option<Option<Shown>>,
    /// The last answer was the followed leader's grant adopted after a
    /// crash, its value not yet proclaimed again.
    unproclaimed: bool,
    ended: bool,
}

/// What [`Observe`] reports a change of: the value, the term, and whether
/// the time in office is known (on etcd a campaign stamps its grant time
/// into its entry just after the grant; an observer that saw the
/// hand-over first reports the leader again once it is there).
type Shown = (Option<String>, u64, bool);

impl Iterator for Observe {
    type Item = Result<Option<Leader>, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.ended {
            return None;
        }
        let mut pause = PAUSE_FIRST;
        loop {
            let (since, wait) = match self.since {
                None => (0, Duration::ZERO),
                // An adopted grant's value is due at once (its holder
                // proclaims it right after its renewal), but a `C` that
                // reaches the server before this `O` wakes no watch:
                // look again each second until it is there.
                Some(since) if self.unproclaimed => (since, Duration::from_secs(1)),
                Some(since) => (since, WAIT_MAX),
            };
            match self.client.observe_seen(&self.name, since, wait, self.seen) {
                Ok(state) => {
                    pause = PAUSE_FIRST;
                    self.since = Some(state.token);
                    self.seen = Some(Seen::of(&state));
                    let leader = Leader::of(state);
                    let shown = leader
                        .as_ref()
                        .map(|l| (l.value.clone(), l.term, l.held_for.is_some()));
                    let last_term = self
                        .reported
                        .as_ref()
                        .and_then(|last| last.as_ref().map(|(_, term, _)| *term));
                    let older = matches!((&shown, last_term), (Some((_, term, _)), Some(last)) if *term < last);
                    // An adopted grant has no label until its holder
                    // proclaims it again (spec §7.5); a campaign's value
                    // is never empty, so an empty one of the same term is
                    // the leader not yet restored, not a new value.
                    let unproclaimed = matches!(
                        (&shown, last_term),
                        (Some((Some(value), term, _)), Some(last)) if value.is_empty() && *term == last
                    );
                    self.unproclaimed = unproclaimed;
                    if self.reported.as_ref() != Some(&shown) && !older && !unproclaimed {
                        self.reported = Some(shown);
                        return Some(Ok(leader));
                    }
                }
                Err(error @ (Error::InvalidArgument(_) | Error::PermissionDenied(_))) => {
                    self.ended = true;
                    return Some(Err(error));
                }
                Err(error) => {
                    log::debug!(
                        "{}: {error}; asking again in {} s",
                        self.name,
                        crate::decimal::seconds_shortest(pause)
                    );
                    super::jitter::sleep(pause);
                    pause = (pause * 2).min(PAUSE_MAX);
                }
            }
        }
    }
}

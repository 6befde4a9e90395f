//! Managed leases (spec §8 rule 10) with no IO and no clock.
//!
//! [`KeepAlives`] decides when each kept ticket is renewed and when it is
//! lost; `KeptLeases` (`backend.rs`) shows its [`Step`]s to the holders and
//! turns the rest into tasks each backend performs its own way (an `E`
//! request on the kunci engine, an etcd renewal), feeds their outcomes back
//! with [`KeepAlives::handle_outcome`], and calls
//! [`KeepAlives::handle_timeout`] when [`KeepAlives::poll_timeout`] says
//! so. Every call takes `now`, so tests drive it on a fake clock.
//!
//! The rules: a lease is renewed with its own lease every lease/3, counted
//! from the start of the previous renewal (from the acquire's send instant
//! for the first one). At most one renewal of a lease is in flight. A
//! renewal answered `E` moves `valid_until` forward from that `E`'s send
//! instant; one answered `N` loses the lock at once; one that ends any
//! other way (`Unavailable`, `Indeterminate`) changes nothing and is
//! retried after [`RETRY_PAUSE`] while `valid_until` is ahead. The lock is
//! lost the moment `valid_until` passes without a successful renewal, even
//! with a renewal in flight; if that renewal is answered `E` later, nobody
//! holds the grant any more, so it is released in the background.
//!
//! A renewal that succeeds after one that reached no verdict, or after a
//! connection of the client ended since the last success, may have been
//! an adoption by a server restarted after a crash (spec §7.3), which
//! keeps the grant without its label (§7.5): a lease with a label then
//! asks for [`Step::CheckLabel`], a read of the key and a proclaim of the
//! label if the read shows it gone.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use super::permits::Label;
use super::vocabulary::{Key, Outcome, valid_until};

/// Identifies one kept lease within a client.
pub(crate) type KeepId = u64;

/// How long after a renewal that did not reach a verdict (`Unavailable`,
/// `Indeterminate`) the next one is sent. Short, because time is running
/// out; not zero, so that a server that closes every connection at once
/// is not hammered.
pub(crate) const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Why a kept lock was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loss {
    /// A renewal was answered `N`: the token is no longer the key's active
    /// grant (its lease ran out on the server, or someone released it).
    NotHeld,
    /// `valid_until` passed without a successful renewal (the server did
    /// not answer in time, or could not be reached): the server may have
    /// given the key to someone else.
    Expired,
}

impl fmt::Display for Loss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Loss::NotHeld => f.write_str("a renewal found the lock no longer held"),
            Loss::Expired => f.write_str("the lease ran out without a successful renewal"),
        }
    }
}

/// What the kept leases need done (see `KeptLeases` in `backend.rs`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Step {
    /// Send `E` for this lease now (deadline as for any renew: now + 5 s)
    /// and report its outcome with [`KeepAlives::handle_outcome`].
    Renew {
        id: KeepId,
        key: Key,
        token: u64,
        lease_s: u8,
    },
    /// A renewal succeeded: the lease is now valid until this instant.
    Renewed { id: KeepId, valid_until: Instant },
    /// The lock is lost; renewal has stopped and the lease is forgotten.
    Lost { id: KeepId, loss: Loss },
    /// A grant nobody holds any more (a renewal answered after the loss):
    /// release it in the background.
    Release { key: Key, token: u64 },
    /// A renewal succeeded through an outage or a reconnect: read the key
    /// and, if grant `token` is its current one with another label,
    /// proclaim `label` again (nobody waits for the outcome; a loss is the
    /// renewals' to find).
    CheckLabel { key: Key, token: u64, label: Label },
}

/// A lease to keep: granted (or last renewed) by a request handed to the
/// socket at `set_at`, valid until `valid_until`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grant {
    pub key: Key,
    pub token: u64,
    pub lease: Duration,
    pub set_at: Instant,
    pub valid_until: Instant,
    /// The grant's label (empty: nothing to proclaim again).
    pub label: Label,
}

struct Kept {
    key: Key,
    token: u64,
    lease: Duration,
    valid_until: Instant,
    next_renewal: Instant,
    /// When the renewal in flight was started.
    renewing: Option<Instant>,
    /// The instant this lease is filed under in `wakes`.
    wake: Instant,
    label: Label,
    /// A renewal reached no verdict since the last success.
    outage: bool,
    /// The client's count of ended connections at the last success.
    connections: u64,
}

impl Kept {
    fn due(&self) -> Instant {
        match self.renewing {
            Some(_) => self.valid_until,
            None => self.next_renewal.min(self.valid_until),
        }
    }
}

/// The kept leases of one client (see the module docs).
#[derive(Default)]
pub(crate) struct KeepAlives {
    kept: HashMap<KeepId, Kept>,
    wakes: BTreeSet<(Instant, KeepId)>,
    /// Leases lost with a renewal in flight: (key, token) to release if it
    /// is answered `E` after all.
    lost_renewing: HashMap<KeepId, (Key, u64)>,
    steps: VecDeque<Step>,
    /// How many connections of the client have ended (the backend says;
    /// etcd, which adopts nothing, leaves it 0).
    connections: u64,
}

impl KeepAlives {
    /// Starts keeping a lease.
    pub(crate) fn insert(&mut self, id: KeepId, grant: Grant, now: Instant) {
        let Grant {
            key,
            token,
            lease,
            set_at,
            valid_until,
            label,
        } = grant;
        if now >= valid_until {
            self.steps.push_back(Step::Lost {
                id,
                loss: Loss::Expired,
            });
            return;
        }
        let kept = Kept {
            key,
            token,
            lease,
            valid_until,
            next_renewal: set_at + lease / 3,
            renewing: None,
            wake: now,
            label,
            outage: false,
            connections: self.connections,
        };
        self.file(id, kept);
        self.handle_timeout(now);
    }

    /// Stops keeping a lease (it is being released); any outcome of a
    /// renewal in flight is ignored.
    pub(crate) fn remove(&mut self, id: KeepId) {
        if let Some(kept) = self.kept.remove(&id) {
            self.wakes.remove(&(kept.wake, id));
        }
        self.lost_renewing.remove(&id);
    }

    /// The holder proclaimed a new label: it is the one to restore.
    pub(crate) fn relabel(&mut self, id: KeepId, label: Label) {
        if let Some(kept) = self.kept.get_mut(&id) {
            kept.label = label;
        }
    }

    /// The client's count of ended connections is now `count`.
    pub(crate) fn set_connections(&mut self, count: u64) {
        self.connections = count;
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.kept.is_empty() && self.lost_renewing.is_empty()
    }

    pub(crate) fn poll_step(&mut self) -> Option<Step> {
        self.steps.pop_front()
    }

    /// The next instant [`KeepAlives::handle_timeout`] has work to do.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.wakes.first().map(|&(at, _)| at)
    }

    /// Starts the renewals that are due and loses the leases whose
    /// `valid_until` has passed.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        while let Some(&(at, id)) = self.wakes.first() {
            if at > now {
                break;
            }
            self.wakes.pop_first();
            let Some(mut kept) = self.kept.remove(&id) else {
                continue;
            };
            if now >= kept.valid_until {
                if kept.renewing.is_some() {
                    self.lost_renewing.insert(id, (kept.key, kept.token));
                }
                self.steps.push_back(Step::Lost {
                    id,
                    loss: Loss::Expired,
                });
                continue;
            }
            if kept.renewing.is_none() && now >= kept.next_renewal {
                kept.renewing = Some(now);
                self.steps.push_back(Step::Renew {
                    id,
                    key: kept.key,
                    token: kept.token,
                    // The lease was checked to be 1..=255 whole seconds
                    // when the ticket was made.
                    lease_s: kept.lease.as_secs().clamp(1, 255) as u8,
                });
            }
            self.file(id, kept);
        }
    }

    /// The outcome of the renewal [`Step::Renew`] asked for.
    pub(crate) fn handle_outcome(&mut self, id: KeepId, outcome: Outcome, now: Instant) {
        if let Some((key, token)) = self.lost_renewing.remove(&id) {
            if matches!(outcome, Outcome::Extended { .. }) {
                self.steps.push_back(Step::Release { key, token });
            }
            return;
        }
        let Some(mut kept) = self.kept.remove(&id) else {
            return;
        };
        self.wakes.remove(&(kept.wake, id));
        if now >= kept.valid_until {
            // The loss was due before this answer was seen: it stands, and
            // a grant renewed after all is given back.
            self.steps.push_back(Step::Lost {
                id,
                loss: Loss::Expired,
            });
            if matches!(outcome, Outcome::Extended { .. }) {
                self.steps.push_back(Step::Release {
                    key: kept.key,
                    token: kept.token,
                });
            }
            return;
        }
        let Some(started) = kept.renewing.take() else {
            // No renewal was asked for: not ours. Keep the lease as it was.
            self.file(id, kept);
            return;
        };
        match outcome {
            Outcome::Extended { sent_at } => {
                kept.valid_until = kept.valid_until.max(valid_until(sent_at, kept.lease));
                kept.next_renewal = started + kept.lease / 3;
                self.steps.push_back(Step::Renewed {
                    id,
                    valid_until: kept.valid_until,
                });
                let through = kept.outage || kept.connections != self.connections;
                kept.outage = false;
                kept.connections = self.connections;
                if through && !kept.label.as_str().is_empty() {
                    self.steps.push_back(Step::CheckLabel {
                        key: kept.key,
                        token: kept.token,
                        label: kept.label,
                    });
                }
            }
            Outcome::NotHeld => {
                self.steps.push_back(Step::Lost {
                    id,
                    loss: Loss::NotHeld,
                });
                return;
            }
            // No verdict: the lease is as it was; try again soon.
            _ => {
                kept.next_renewal = now + RETRY_PAUSE;
                kept.outage = true;
            }
        }
        self.file(id, kept);
        self.handle_timeout(now);
    }

    fn file(&mut self, id: KeepId, mut kept: Kept) {
        kept.wake = kept.due();
        self.wakes.insert((kept.wake, id));
        self.kept.insert(id, kept);
    }
}

#[cfg(test)]
mod tests {
    //! The keep-alive rules on a fake clock.

    use super::*;
    use crate::client::vocabulary::{Unavailable, drift_margin};

    const MS: Duration = Duration::from_millis(1);
    const S: Duration = Duration::from_secs(1);
    const NS: Duration = Duration::from_nanos(1);

    struct Clock {
        start: Instant,
    }

    impl Clock {
        fn at(&self, offset: Duration) -> Instant {
            self.start + offset
        }
    }

    fn key() -> Key {
        Key::new("kept").unwrap()
    }

    fn grant(token: u64, lease: Duration, set_at: Instant) -> Grant {
        Grant {
            key: key(),
            token,
            lease,
            set_at,
            valid_until: valid_until(set_at, lease),
            label: Label::new("host-a").unwrap(),
        }
    }

    /// A lease of `lease` whose acquire was handed to the socket at 0.
    fn kept(lease: Duration) -> (KeepAlives, Clock, Instant) {
        let clock = Clock {
            start: Instant::now(),
        };
        let mut keep = KeepAlives::default();
        let valid_until = valid_until(clock.at(Duration::ZERO), lease);
        keep.insert(7, grant(42, lease, clock.at(Duration::ZERO)), clock.at(MS));
        assert!(steps(&mut keep).is_empty());
        (keep, clock, valid_until)
    }

    fn steps(keep: &mut KeepAlives) -> Vec<String> {
        std::iter::from_fn(|| keep.poll_step())
            .map(|step| match step {
                Step::Renew {
                    id,
                    token,
                    lease_s,
                    key,
                } => format!("renew {id} {} {token} {lease_s}", key.as_str()),
                Step::Renewed { id, valid_until } => format!("renewed {id} {valid_until:?}"),
                Step::Lost { id, loss } => format!("lost {id} {loss:?}"),
                Step::Release { key, token } => format!("release {} {token}", key.as_str()),
                Step::CheckLabel { key, token, label } => {
                    format!("check {} {token} {}", key.as_str(), label.as_str())
                }
            })
            .collect()
    }

    #[test]
    fn renews_every_third_of_the_lease_counted_from_the_previous_start() {
        let lease = 30 * S;
        let (mut keep, clock, _) = kept(lease);
        assert_eq!(keep.poll_timeout(), Some(clock.at(10 * S)));
        keep.handle_timeout(clock.at(10 * S) - NS);
        assert!(steps(&mut keep).is_empty(), "never early");
        keep.handle_timeout(clock.at(10 * S));
        assert_eq!(steps(&mut keep), ["renew 7 kept 42 30"]);
        // One renewal in flight at a time: the next wake is the expiry.
        let first_expiry = valid_until(clock.at(Duration::ZERO), lease);
        assert_eq!(keep.poll_timeout(), Some(first_expiry));
        keep.handle_timeout(clock.at(15 * S));
        assert!(steps(&mut keep).is_empty());

        let sent_at = clock.at(10 * S + 2 * MS);
        keep.handle_outcome(7, Outcome::Extended { sent_at }, clock.at(10 * S + 50 * MS));
        let renewed = sent_at + lease - drift_margin(lease);
        assert_eq!(steps(&mut keep), [format!("renewed 7 {renewed:?}")]);
        assert_eq!(keep.poll_timeout(), Some(clock.at(20 * S)));
        keep.handle_timeout(clock.at(20 * S));
        assert_eq!(steps(&mut keep), ["renew 7 kept 42 30"]);
    }

    #[test]
    fn not_held_is_a_loss_at_once_and_renewal_stops() {
        let (mut keep, clock, _) = kept(30 * S);
        keep.handle_timeout(clock.at(10 * S));
        assert_eq!(steps(&mut keep).len(), 1);
        keep.handle_outcome(7, Outcome::NotHeld, clock.at(10 * S + MS));
        assert_eq!(steps(&mut keep), ["lost 7 NotHeld"]);
        assert_eq!(keep.poll_timeout(), None);
        keep.handle_timeout(clock.at(100 * S));
        assert!(steps(&mut keep).is_empty());
        assert!(keep.is_empty());
    }

    #[test]
    fn a_renewal_without_verdict_is_retried_after_the_pause_while_time_is_left() {
        let lease = 3 * S;
        let (mut keep, clock, valid_until) = kept(lease);
        keep.handle_timeout(clock.at(S));
        assert_eq!(steps(&mut keep), ["renew 7 kept 42 3"]);
        for (round, outcome) in [
            Outcome::Indeterminate,
            Outcome::Unavailable(Unavailable::Unreachable),
        ]
        .into_iter()
        .enumerate()
        {
            let failed = clock.at(S + 500 * MS * (round as u32 + 1));
            keep.handle_outcome(7, outcome, failed);
            assert!(steps(&mut keep).is_empty(), "no verdict, no loss");
            assert_eq!(keep.poll_timeout(), Some(failed + RETRY_PAUSE));
            keep.handle_timeout(failed + RETRY_PAUSE - NS);
            assert!(steps(&mut keep).is_empty());
            keep.handle_timeout(failed + RETRY_PAUSE);
            assert_eq!(steps(&mut keep), ["renew 7 kept 42 3"]);
        }
        // The expiry is not moved by renewals that reached no verdict.
        assert_eq!(keep.poll_timeout(), Some(valid_until));
    }

    #[test]
    fn the_lease_is_lost_when_valid_until_passes_even_with_a_renewal_in_flight() {
        let lease = 3 * S;
        let (mut keep, clock, valid_until) = kept(lease);
        keep.handle_timeout(clock.at(S));
        assert_eq!(steps(&mut keep).len(), 1);
        keep.handle_timeout(valid_until - NS);
        assert!(steps(&mut keep).is_empty());
        keep.handle_timeout(valid_until);
        assert_eq!(steps(&mut keep), ["lost 7 Expired"]);
        assert_eq!(keep.poll_timeout(), None);
        // The renewal is answered after all: nobody holds that grant now.
        keep.handle_outcome(
            7,
            Outcome::Extended {
                sent_at: clock.at(S),
            },
            valid_until + S,
        );
        assert_eq!(steps(&mut keep), ["release kept 42"]);
        assert!(keep.is_empty());
    }

    #[test]
    fn a_late_renewal_that_reached_no_verdict_releases_nothing() {
        let (mut keep, clock, valid_until) = kept(3 * S);
        keep.handle_timeout(clock.at(S));
        keep.handle_timeout(valid_until);
        assert_eq!(steps(&mut keep), ["renew 7 kept 42 3", "lost 7 Expired"]);
        keep.handle_outcome(7, Outcome::Indeterminate, valid_until + S);
        assert!(steps(&mut keep).is_empty());
        assert!(keep.is_empty());
    }

    #[test]
    fn an_answer_first_seen_after_valid_until_does_not_undo_the_loss() {
        let (mut keep, clock, valid_until) = kept(3 * S);
        keep.handle_timeout(clock.at(S));
        assert_eq!(steps(&mut keep).len(), 1);
        // The answer and the expiry are noticed in the same turn, the
        // answer first.
        keep.handle_outcome(
            7,
            Outcome::Extended {
                sent_at: clock.at(S),
            },
            valid_until,
        );
        assert_eq!(steps(&mut keep), ["lost 7 Expired", "release kept 42"]);
        assert!(keep.is_empty());
    }

    #[test]
    fn a_removed_lease_ignores_its_renewal_and_stops() {
        let (mut keep, clock, _) = kept(30 * S);
        keep.handle_timeout(clock.at(10 * S));
        assert_eq!(steps(&mut keep).len(), 1);
        keep.remove(7);
        keep.handle_outcome(
            7,
            Outcome::Extended {
                sent_at: clock.at(10 * S),
            },
            clock.at(11 * S),
        );
        keep.handle_timeout(clock.at(100 * S));
        assert!(steps(&mut keep).is_empty());
        assert_eq!(keep.poll_timeout(), None);
        assert!(keep.is_empty());
    }

    #[test]
    fn a_renewal_through_an_outage_or_a_reconnect_checks_the_label_once() {
        let lease = 30 * S;
        let (mut keep, clock, _) = kept(lease);
        // A plain renewal: nothing to check.
        keep.handle_timeout(clock.at(10 * S));
        assert_eq!(steps(&mut keep), ["renew 7 kept 42 30"]);
        let sent_at = clock.at(10 * S);
        keep.handle_outcome(7, Outcome::Extended { sent_at }, clock.at(10 * S + MS));
        assert_eq!(steps(&mut keep).len(), 1, "renewed only");
        // A renewal that reached no verdict, then one that succeeded.
        keep.handle_timeout(clock.at(20 * S));
        assert_eq!(steps(&mut keep).len(), 1);
        keep.handle_outcome(7, Outcome::Indeterminate, clock.at(21 * S));
        keep.handle_timeout(clock.at(21 * S) + RETRY_PAUSE);
        assert_eq!(steps(&mut keep), ["renew 7 kept 42 30"]);
        let sent_at = clock.at(21 * S) + RETRY_PAUSE;
        keep.handle_outcome(7, Outcome::Extended { sent_at }, sent_at + MS);
        let renewed = format!("renewed 7 {:?}", valid_until(sent_at, lease));
        assert_eq!(steps(&mut keep), [renewed, "check kept 42 host-a".into()]);
        // A connection ended meanwhile (a restart within lease/3), and the
        // holder proclaimed a new value: that one is checked, once.
        keep.relabel(7, Label::new("host-b").unwrap());
        keep.set_connections(1);
        let due = sent_at + lease / 3;
        keep.handle_timeout(due);
        assert_eq!(steps(&mut keep).len(), 1);
        keep.handle_outcome(7, Outcome::Extended { sent_at: due }, due + MS);
        assert_eq!(steps(&mut keep)[1], "check kept 42 host-b");
        keep.handle_timeout(due + lease / 3);
        assert_eq!(steps(&mut keep).len(), 1);
        let sent_at = due + lease / 3;
        keep.handle_outcome(7, Outcome::Extended { sent_at }, sent_at + MS);
        assert_eq!(steps(&mut keep).len(), 1, "no reconnect since: no check");
    }

    #[test]
    fn a_lease_kept_late_renews_at_once_and_an_expired_one_is_lost_at_once() {
        let clock = Clock {
            start: Instant::now(),
        };
        let lease = 3 * S;
        let valid_until = valid_until(clock.at(Duration::ZERO), lease);
        let mut keep = KeepAlives::default();
        keep.insert(
            1,
            grant(5, lease, clock.at(Duration::ZERO)),
            clock.at(2 * S),
        );
        assert_eq!(steps(&mut keep), ["renew 1 kept 5 3"]);
        keep.insert(2, grant(6, lease, clock.at(Duration::ZERO)), valid_until);
        assert_eq!(steps(&mut keep), ["lost 2 Expired"]);
    }
}

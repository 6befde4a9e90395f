//! The engine's self-check, run by the client tests after every step: what
//! the module docs of `engine.rs` promise about where a request lives,
//! written out so that a bug fails here rather than in a later, unrelated
//! outcome (a request answered twice, or never; a stale id in a queue that
//! a newer request inherits with its slab slot).

use std::collections::HashMap;

use super::{Authentication, Engine, Gathered, Link, Op, Place, ReqId, SessionId};

/// Where an id is listed: the structures a request can be in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Listed {
    Unassigned,
    Queue(SessionId),
    Batch(SessionId),
    Others(SessionId),
}

impl<R> Engine<R> {
    /// Checks the bookkeeping: every request has exactly the one home its
    /// place names (the unassigned queue, one session's queue or batch, or
    /// sent on one session: counted among its acquires, or listed once
    /// among its others) and nothing lists a request that is gone; every
    /// acquire is found by its owner and the owners map holds nothing
    /// else; every request is armed at its deadline's tick unless it was
    /// set aside for [`expire`](Self::expire); a session that is not up
    /// holds nothing; batches, write offsets and answers being gathered
    /// agree with the requests. `Err` says the first thing found wrong.
    pub(crate) fn invariants(&self) -> Result<(), String> {
        let sessions = self.sessions.len();
        if sessions != self.not_allowed_at.len() * self.per_server {
            return Err(format!(
                "{sessions} sessions for {} addresses × {}",
                self.not_allowed_at.len(),
                self.per_server
            ));
        }
        if self.rotation >= sessions {
            return Err(format!("rotation {} of {sessions} sessions", self.rotation));
        }
        // Every listing of every id, to compare with the request's place.
        let mut listed: HashMap<ReqId, Vec<Listed>> = HashMap::new();
        for &id in &self.unassigned {
            listed.entry(id).or_default().push(Listed::Unassigned);
        }
        for (s, session) in self.sessions.iter().enumerate() {
            for &id in &session.queue {
                listed.entry(id).or_default().push(Listed::Queue(s));
            }
            for &(id, _) in &session.batch {
                listed.entry(id).or_default().push(Listed::Batch(s));
            }
            for &id in &session.others {
                listed.entry(id).or_default().push(Listed::Others(s));
            }
        }
        if let Some((id, homes)) = listed
            .iter()
            .find(|(id, _)| !self.requests.slab.contains(**id))
        {
            return Err(format!("request {id} is gone but listed in {homes:?}"));
        }
        let mut acquires = 0;
        let mut armed = 0;
        let mut acquires_sent = vec![0; sessions];
        for (id, req) in &self.requests.slab {
            let homes = listed.get(&id).map_or(&[][..], Vec::as_slice);
            let is_acquire = matches!(req.op, Op::Acquire { .. });
            let expected = match req.place {
                Place::Unassigned => Some(Listed::Unassigned),
                Place::Queued(s) => Some(Listed::Queue(s)),
                Place::Batch(s) => Some(Listed::Batch(s)),
                Place::Sent(_) if is_acquire => None,
                Place::Sent(s) => Some(Listed::Others(s)),
            };
            if homes != expected.as_slice() {
                return Err(format!(
                    "request {id} ({:?}) at {:?} is listed in {homes:?}",
                    req.op, req.place
                ));
            }
            if let Place::Queued(s) | Place::Batch(s) | Place::Sent(s) = req.place {
                match self.sessions.get(s) {
                    None => return Err(format!("request {id} on session {s} of {sessions}")),
                    Some(session) if session.link != Link::Up => {
                        return Err(format!(
                            "request {id} at {:?} on a session that is {:?}",
                            req.place, session.link
                        ));
                    }
                    Some(_) => {}
                }
            }
            if let Place::Sent(s) = req.place {
                if req.sent_at.is_none() {
                    return Err(format!(
                        "request {id} sent on session {s} with no send time"
                    ));
                }
                if is_acquire {
                    acquires_sent[s] += 1;
                }
            }
            if let Op::Acquire { owner, .. } = req.op {
                acquires += 1;
                if self.owners.get(&owner) != Some(&id) {
                    return Err(format!(
                        "acquire {id} by owner {owner}: the owners map says {:?}",
                        self.owners.get(&owner)
                    ));
                }
            }
            let gathering_fits = matches!(
                (&req.gathered, req.op, req.place),
                (Gathered::Nothing, _, _)
                    | (Gathered::Holders(_), Op::Holders { .. }, Place::Sent(_))
                    | (Gathered::Keys(_), Op::List { .. }, Place::Sent(_))
            );
            if !gathering_fits {
                return Err(format!(
                    "request {id} ({:?}) at {:?} gathers frames of another answer",
                    req.op, req.place
                ));
            }
            if req.timer.is_armed() {
                armed += 1;
                let tick = self.wheel.deadline_of(&req.timer);
                let due = self.tick_at_or_after(req.deadline);
                if tick != due {
                    return Err(format!(
                        "request {id}: armed for tick {tick}, its deadline is at tick {due}"
                    ));
                }
            } else if !self.expired.contains(&id) {
                return Err(format!(
                    "request {id} at {:?}: no timer, and not set aside at its deadline",
                    req.place
                ));
            }
        }
        if self.owners.len() != acquires {
            return Err(format!(
                "{} owners mapped for {acquires} acquires",
                self.owners.len()
            ));
        }
        if self.wheel.len() != armed {
            return Err(format!(
                "{} timers in the wheel for {armed} armed requests",
                self.wheel.len()
            ));
        }
        if self.expired.is_empty()
            && let Some(s) = self.sessions.iter().position(|session| session.expiring)
        {
            return Err(format!("session {s} expiring with nothing set aside"));
        }
        let usable = self
            .sessions
            .iter()
            .position(|session| session.link == Link::Up && !session.expiring);
        if let (false, Some(s)) = (self.unassigned.is_empty(), usable) {
            return Err(format!(
                "{} requests unassigned while session {s} could take them",
                self.unassigned.len()
            ));
        }
        for (s, session) in self.sessions.iter().enumerate() {
            if session.acquires != acquires_sent[s] {
                return Err(format!(
                    "session {s} counts {} acquires sent, {} are",
                    session.acquires, acquires_sent[s]
                ));
            }
            if self.secret.is_none() && session.authentication != Authentication::Done {
                return Err(format!(
                    "session {s}: authentication {:?} with no secret",
                    session.authentication
                ));
            }
            if session.link != Link::Up {
                let holds = !session.queue.is_empty()
                    || !session.batch.is_empty()
                    || !session.others.is_empty()
                    || !session.out.is_empty()
                    || !session.input.is_empty()
                    || session.heard_from
                    || session.authentication != Authentication::Done;
                if holds {
                    return Err(format!(
                        "session {s} is {:?} and still holds requests, bytes or state",
                        session.link
                    ));
                }
            }
            if session.out_sent > session.out.len() {
                return Err(format!(
                    "session {s}: {} of {} bytes written",
                    session.out_sent,
                    session.out.len()
                ));
            }
            if !session.batch.is_empty() {
                if session.batch_at.is_none() || session.out_sent != 0 {
                    return Err(format!(
                        "session {s}: a batch with no encoding time or partly written"
                    ));
                }
                let mut start = session.batch_lead;
                for &(id, end) in &session.batch {
                    if end <= start || end > session.out.len() {
                        return Err(format!(
                            "session {s}: the frame of request {id} ends at {end}, after {start}, \
                             in {} bytes",
                            session.out.len()
                        ));
                    }
                    start = end;
                }
            }
        }
        Ok(())
    }

    /// [`invariants`](Self::invariants), as an assertion.
    #[track_caller]
    pub(crate) fn check_invariants(&self) {
        if let Err(problem) = self.invariants() {
            panic!("client engine invariant: {problem}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::super::{Engine, Key, Op, Submission};
    use crate::client::permits::{Label, Permits};
    use crate::client::vocabulary::TRANSPORT_DEADLINE;
    use crate::timer_wheel::TimerId;

    /// An engine with one session up, an acquire sent on it, a ping queued
    /// behind it and a release waiting: every kind of home in use.
    fn busy_engine() -> (Engine<u32>, Instant) {
        let now = Instant::now();
        let mut engine = Engine::new(1, 1, Duration::from_secs(1), now);
        let submit = |engine: &mut Engine<u32>, op, call| {
            let submission = Submission {
                op,
                key: Key::new("k").unwrap(),
                deadline: now + TRANSPORT_DEADLINE,
                reply: Some(call),
            };
            engine.submit(submission, now);
        };
        let acquire = Op::Acquire {
            owner: 7,
            lease_s: 5,
            wait_until: None,
            permits: Permits::exclusive(),
            label: Label::new("").unwrap(),
            campaign: false,
        };
        submit(&mut engine, acquire, 0);
        engine.connected(0, now);
        let written = engine.poll_transmit(0, now).map(<[u8]>::len).unwrap();
        engine.transmitted(0, written);
        submit(&mut engine, Op::Ping { nonce: 3 }, 1);
        engine.check_invariants();
        (engine, now)
    }

    #[test]
    fn a_consistent_engine_passes() {
        let (mut engine, now) = busy_engine();
        let written = engine.poll_transmit(0, now).map(<[u8]>::len).unwrap();
        // Mid-batch (encoded, not yet reported) is a consistent state too.
        engine.check_invariants();
        engine.transmitted(0, written);
        engine.check_invariants();
        engine.session_closed(0, now);
        engine.check_invariants();
    }

    /// Each deliberate break of the bookkeeping is caught, and named.
    #[test]
    fn every_broken_bookkeeping_is_caught() {
        type Break = fn(&mut Engine<u32>);
        let breaks: [(&str, Break); 8] = [
            ("listed in", |engine| engine.unassigned.push_back(0)),
            ("is gone but listed", |engine| {
                engine.sessions[0].queue.push_back(9)
            }),
            ("acquires sent", |engine| engine.sessions[0].acquires += 1),
            ("owners map", |engine| {
                engine.owners.insert(7, 1);
            }),
            ("owners mapped", |engine| {
                engine.owners.insert(8, 0);
            }),
            ("no timer", |engine| {
                engine.wheel.cancel(&mut engine.requests, 1 as TimerId)
            }),
            ("armed for tick", |engine| {
                let tick = engine.wheel.deadline_of(&engine.requests.slab[1].timer);
                engine
                    .wheel
                    .arm(&mut engine.requests, 1 as TimerId, tick + 1);
            }),
            ("no send time", |engine| {
                engine.requests.slab[0].sent_at = None
            }),
        ];
        for (named, break_it) in breaks {
            let (mut engine, _) = busy_engine();
            break_it(&mut engine);
            let problem = engine.invariants().expect_err(named);
            assert!(problem.contains(named), "{named:?} not in {problem:?}");
        }
    }
}

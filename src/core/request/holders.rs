//! `H` (spec §11.2): the grants of one key in token order, then its
//! waiters in queue order, then `Z`. Bounded: at most [`FRAMES_MAX`] of
//! each, and at most [`ANSWER_BYTES_MAX`] of frames in all (spec §4).

use super::{ANSWER_BYTES_MAX, GRANT_FRAME_FIXED, WAITER_FRAME_FIXED};
use crate::core::labels::LabelOf;
use crate::core::permits::PERMITS;
use crate::core::waiters::held_ms;
use crate::core::{ConnId, Core, Micros, millis_left};
use crate::protocol::Response;

/// At most this many `G` and this many `W` frames answer one `H`.
pub const FRAMES_MAX: usize = 1_000;

impl Core {
    pub(in crate::core) fn holders(&mut self, conn: ConnId, id: u64, key: &str, now: Micros) {
        // A lease that has run out by `now` ends now, before it could be
        // listed as held: fire whatever is due (grants to waiters, `T`s),
        // exactly as the shell's next timeout would.
        self.handle_timeout(now);
        self.stats.holders += 1;
        let mut grants: Vec<Response> = Vec::new();
        let mut waiters: Vec<Response> = Vec::new();
        let mut left_out = 0u64;
        // The bytes of the frames so far (an upper bound), and the grants
        // and waiters walked: the request's cost.
        let mut bytes = 0usize;
        let mut walked = 0u64;
        let unknown = Response::Grant {
            id,
            token: 0,
            owner: 0,
            lease_ms: millis_left(self.grace_until, now),
            held_ms: 0,
            take: 0,
            label: String::new(),
        };
        match self.table.find(key, self.table.hash(key)) {
            None => {
                if self.held_by_unknown_grant(key, now) {
                    grants.push(unknown);
                }
            }
            Some(entry) => {
                let held = *self.table.get(entry);
                if held.token == PERMITS {
                    let permits = self.permit_key(entry);
                    if permits.unknown {
                        grants.push(unknown);
                    }
                    for &grant in &permits.grants {
                        walked += 1;
                        let node = self.grants.get(grant);
                        let lease_ms = millis_left(self.lease_deadline(&node.lease), now);
                        if lease_ms == 0 {
                            // It may have run out (see below).
                            continue;
                        }
                        let label = self.labels.get(LabelOf::Grant(grant));
                        let size = GRANT_FRAME_FIXED + label.len();
                        if grants.len() == FRAMES_MAX || bytes + size > ANSWER_BYTES_MAX {
                            left_out += 1;
                            continue;
                        }
                        bytes += size;
                        let held_us = now.wrapping_sub(node.granted_at);
                        grants.push(Response::Grant {
                            id,
                            token: node.token,
                            owner: node.owner,
                            lease_ms,
                            held_ms: u32::try_from(held_us / 1_000).unwrap_or(u32::MAX),
                            take: node.take,
                            label: label.to_owned(),
                        });
                    }
                } else if held.token == 0 {
                    grants.push(unknown);
                } else {
                    // The lease deadline is kept as its tick: from the
                    // earliest instant that rounds to it, the lease may
                    // have run out, and a grant that may have run out is
                    // never listed as held.
                    let lease_ms = millis_left(self.lease_deadline(&{ held.lease }), now);
                    grants.extend((lease_ms > 0).then(|| Response::Grant {
                        id,
                        token: held.token,
                        owner: held.owner,
                        lease_ms,
                        held_ms: held_ms(self.waiters.grant_time(held.waiters), now),
                        take: 0,
                        label: self.labels.get(LabelOf::Entry(entry)).to_owned(),
                    }));
                }
                for waiter in self.waiters.queue(held.waiters) {
                    walked += 1;
                    let label = self.labels.get(LabelOf::Waiter(waiter));
                    let size = WAITER_FRAME_FIXED + label.len();
                    if waiters.len() == FRAMES_MAX || bytes + size > ANSWER_BYTES_MAX {
                        left_out += 1;
                        continue;
                    }
                    bytes += size;
                    let node = self.waiters.get(waiter);
                    waiters.push(Response::Waiter {
                        id,
                        owner: node.owner,
                        wait_ms: millis_left(self.lease_deadline(&node.timer), now),
                        take: node.take,
                        label: label.to_owned(),
                    });
                }
            }
        }
        self.work += walked;
        let count = (grants.len() + waiters.len()) as u32;
        self.outbox
            .extend(grants.into_iter().map(|frame| (conn, frame)));
        self.outbox
            .extend(waiters.into_iter().map(|frame| (conn, frame)));
        self.outbox.push((
            conn,
            Response::End {
                id,
                count,
                next: left_out,
            },
        ));
    }
}

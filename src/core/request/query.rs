//! `Q` (spec §2.2, §5, §10.7): who holds a key, for how long, how many
//! wait. On a key with several grants, the one with the smallest token.

use crate::core::permits::PERMITS;
use crate::core::timer_wheel::{MICROS_PER_TICK, TimerLinks, tick_start};
use crate::core::{ConnId, Core, Micros, millis_left};
use crate::protocol::Response;

impl Core {
    pub(in crate::core) fn query(&mut self, conn: ConnId, key: &str, now: Micros) {
        let response = match self.table.find(key, self.table.hash(key)) {
            Some(index) => {
                let entry = self.table.get(index);
                let waiters = self.waiters.queue_len(entry.waiters);
                // (token, owner, lease) of the grant to show; token 0 for
                // the unknown grant, whose lease ends at the horizon.
                let shown = if entry.token == PERMITS {
                    let permits = self.permit_key(index);
                    permits.grants.front().map(|&grant| {
                        let grant = self.grants.get(grant);
                        (grant.token, grant.owner, grant.lease)
                    })
                } else {
                    (entry.token != 0).then_some((entry.token, entry.owner, entry.lease))
                };
                let (token, owner, lease_ms) = match shown {
                    Some((token, owner, lease)) => {
                        (token, owner, millis_left(self.lease_deadline(&lease), now))
                    }
                    None => (0, 0, millis_left(self.grace_until, now)),
                };
                Response::Query {
                    token,
                    owner,
                    lease_ms,
                    waiters,
                }
            }
            None if self.held_by_unknown_grant(key, now) => Response::Query {
                token: 0,
                owner: 0,
                lease_ms: millis_left(self.grace_until, now),
                waiters: 0,
            },
            None => Response::Query {
                token: 0,
                owner: 0,
                lease_ms: 0,
                waiters: 0,
            },
        };
        self.outbox.push((conn, response));
    }

    /// The tick rounded the true deadline up by less than one tick: the
    /// earliest deadline that rounds to it, so a fresh grant never shows
    /// more than its lease.
    fn lease_deadline(&self, lease: &TimerLinks) -> Micros {
        tick_start(self.wheel.deadline_of(lease)).saturating_sub(MICROS_PER_TICK - 1)
    }
}

//! `Q` (spec §2.2, §5): who holds a key, for how long, how many wait.

use crate::core::{ConnId, Core, Micros, millis_left};
use crate::protocol::Response;
use crate::timer_wheel::{MICROS_PER_TICK, tick_start};

impl Core {
    pub(in crate::core) fn query(&mut self, conn: ConnId, key: &str, now: Micros) {
        let response = match self.table.find(key, self.table.hash(key)) {
            Some(entry) => {
                let entry = self.table.get(entry);
                // The tick rounded the true deadline up by less than one
                // tick: report the earliest deadline that rounds to it, so
                // a fresh grant never shows more than its lease. An unknown
                // holder's lease ends exactly at the horizon.
                let deadline = if entry.token == 0 {
                    self.grace_until
                } else {
                    tick_start(self.wheel.deadline_of(&entry.lease))
                        .saturating_sub(MICROS_PER_TICK - 1)
                };
                Response::Query {
                    token: entry.token,
                    owner: entry.owner,
                    lease_ms: millis_left(deadline, now),
                    waiters: self.waiters.queue_len(entry.waiters),
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
}

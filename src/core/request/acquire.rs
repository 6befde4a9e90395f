//! `A` (spec §3, §4, §5): grant at once, time out, queue, or `B`.

use crate::core::lock_table::NIL;
use crate::core::{ConnId, Core, MICROS_PER_S, Micros, TimerNodes, WAITER_TIMER, enqueued_at};
use crate::timer_wheel::tick_at_or_after;

impl Core {
    pub(in crate::core) fn acquire(
        &mut self,
        conn: ConnId,
        key: &str,
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        now: Micros,
    ) {
        let hash = self.table.hash(key);
        let entry = match self.table.find(key, hash) {
            Some(_) if wait_s == 0 => return self.timeout(conn, owner),
            Some(entry) => {
                if !self.can_queue(conn, self.table.get(entry).waiters) {
                    return self.busy(conn, owner);
                }
                entry
            }
            None if !self.held_by_unknown_grant(key, now) => {
                if self.next_token == u64::MAX {
                    return self.busy(conn, owner);
                }
                let Some(entry) = self.insert_key(key, hash, 0, owner) else {
                    return self.busy(conn, owner);
                };
                return self.grant(entry, conn, owner, lease_s, now);
            }
            None if wait_s == 0 => return self.timeout(conn, owner),
            None => {
                // The key may still be leased by the previous run: queue
                // behind an unknown holder whose lease ends at the horizon.
                if !self.can_queue(conn, NIL) {
                    return self.busy(conn, owner);
                }
                let Some(entry) = self.insert_key(key, hash, 0, 0) else {
                    return self.busy(conn, owner);
                };
                self.unknown_holders += 1;
                self.arm_lease_at(entry, self.grace_until);
                entry
            }
        };
        let waiter = {
            let queue = &mut self.table.get_mut(entry).waiters;
            let conn_list = &mut self.conns[conn as usize].waiters;
            self.waiters
                .push_back(queue, conn_list, conn, entry, owner, lease_s)
        };
        self.waiters.get_mut(waiter).enqueued_at = enqueued_at(now);
        let deadline = now + u64::from(wait_s) * MICROS_PER_S;
        let mut nodes = TimerNodes {
            table: &mut self.table,
            waiters: &mut self.waiters,
        };
        self.wheel.arm(
            &mut nodes,
            waiter | WAITER_TIMER,
            tick_at_or_after(deadline),
        );
    }

    /// Whether one more waiter fits: in total, on the queue with head
    /// `queue_head`, and on `conn`.
    pub(in crate::core) fn can_queue(&self, conn: ConnId, queue_head: u32) -> bool {
        let Some(state) = self.conns.get(conn as usize).filter(|state| state.open) else {
            return false;
        };
        self.waiters.len() < self.limits.max_waiters
            && self.waiters.queue_len(queue_head) < self.limits.max_waiters_per_key
            && state.waiters.len < self.limits.max_waits_per_conn
    }

    pub(in crate::core) fn insert_key(
        &mut self,
        key: &str,
        hash: u64,
        token: u64,
        owner: u64,
    ) -> Option<u32> {
        if self.table.len() >= self.limits.max_keys {
            return None;
        }
        self.table.insert(key, hash, token, owner)
    }
}

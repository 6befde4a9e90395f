//! `A` and `S` (spec §3, §4, §5, §10): grant at once, time out, queue, `B`,
//! or `X 10`. `A` is `S` with limit 0, take 0 and no label (§10.1).

use crate::core::labels::{self, LabelOf};
use crate::core::permits::PERMITS;
use crate::core::waiters::Queue;
use crate::core::{ConnId, Core, MICROS_PER_S, Micros, TimerNodes, WAITER_TIMER, enqueued_at};
use crate::protocol::{ErrorCode, Response};
use crate::timer_wheel::tick_at_or_after;

/// An acquire as the core evaluates it.
#[derive(Clone, Copy, Debug)]
pub(in crate::core) struct Ask<'a> {
    pub key: &'a str,
    pub wait_s: u8,
    pub lease_s: u8,
    pub owner: u64,
    /// The limit it names; 0 names none.
    pub limit: u16,
    /// Permits it takes; 0 = all (exclusive).
    pub take: u16,
    pub label: &'a str,
}

impl Core {
    pub(in crate::core) fn acquire(&mut self, conn: ConnId, ask: &Ask<'_>, now: Micros) {
        let (key, owner) = (ask.key, ask.owner);
        let hash = self.table.hash(key);
        let entry = match self.table.find(key, hash) {
            Some(entry) if self.table.get(entry).token == PERMITS => {
                return self.acquire_permits(conn, entry, ask, now);
            }
            // Held by its one exclusive grant (or the unknown grant): the
            // request cannot fit, whatever it asks.
            Some(_) if ask.wait_s == 0 => return self.timeout(conn, owner),
            Some(entry) => {
                if !self.can_queue(conn, self.table.get(entry).waiters) {
                    return self.busy(conn, owner);
                }
                if ask.limit != 0 {
                    // The first request that names a limit sets it, also
                    // when it only queues (spec §10.2).
                    self.set_limit(entry, ask.limit, now);
                }
                entry
            }
            None if !self.held_by_unknown_grant(key, now) => {
                let counted = ask.limit != 0 && ask.take != 0;
                if !self.may_issue(ask.lease_s, counted, now) || !self.can_grant() {
                    return self.busy(conn, owner);
                }
                let Some(entry) = self.insert_key(key, hash, 0, owner) else {
                    return self.busy(conn, owner);
                };
                if ask.limit != 0 {
                    self.new_permit_key(entry, ask.limit);
                    let label = labels::owned(ask.label);
                    self.grant_permits(entry, conn, owner, ask.take, ask.lease_s, label, now);
                    return;
                }
                let label = labels::owned(ask.label);
                return self.grant(entry, conn, owner, ask.lease_s, label, now);
            }
            None if ask.wait_s == 0 => return self.timeout(conn, owner),
            None => {
                // The key may still be leased by the previous run: queue
                // behind an unknown holder whose lease ends at the horizon.
                if !self.can_queue(conn, Queue::empty(0)) {
                    return self.busy(conn, owner);
                }
                let Some(entry) = self.insert_key(key, hash, 0, 0) else {
                    return self.busy(conn, owner);
                };
                self.unknown_holders += 1;
                self.arm_lease_at(entry, self.grace_until);
                if ask.limit != 0 {
                    self.set_limit(entry, ask.limit, now);
                }
                entry
            }
        };
        self.enqueue(conn, entry, ask, now);
    }

    /// An acquire on a key with a limit (spec §10.2–4).
    fn acquire_permits(&mut self, conn: ConnId, entry: u32, ask: &Ask<'_>, now: Micros) {
        // A key held by adopted grants (spec §7.4) has no limit until a
        // request names one, and only a request that is granted or queued
        // sets it: one that ends at once with `T` or `B` sets nothing
        // (§10.2).
        let names_first = ask.limit != 0 && self.permit_key(entry).limit == 0;
        if names_first {
            self.permit_key_mut(entry).limit = ask.limit;
        }
        let permits = self.permit_key(entry);
        if ask.limit != 0 && ask.limit != permits.limit {
            let limit = permits.limit;
            self.stats.count_error(ErrorCode::LimitMismatch);
            self.outbox
                .push((conn, Response::limit_mismatch(ask.owner, limit)));
            return;
        }
        let queue = self.table.get(entry).waiters;
        // Ends at once: `B` (true) or `T` (false).
        let busy = if queue.is_empty() && permits.fits(ask.take) {
            if self.may_issue(ask.lease_s, ask.take != 0, now) && self.can_grant() {
                let label = labels::owned(ask.label);
                self.grant_permits(entry, conn, ask.owner, ask.take, ask.lease_s, label, now);
                return;
            }
            true
        } else if ask.wait_s == 0 {
            false
        } else if self.can_queue(conn, queue) {
            return self.enqueue(conn, entry, ask, now);
        } else {
            true
        };
        if names_first {
            self.permit_key_mut(entry).limit = 0;
        }
        if busy {
            self.busy(conn, ask.owner)
        } else {
            self.timeout(conn, ask.owner)
        }
    }

    /// Queues `ask` at the tail of `entry`'s queue, its deadline armed.
    fn enqueue(&mut self, conn: ConnId, entry: u32, ask: &Ask<'_>, now: Micros) {
        let waiter = {
            let queue = &mut self.table.get_mut(entry).waiters;
            let conn_list = &mut self.conns[conn as usize].waiters;
            self.waiters.push_back(
                queue,
                conn_list,
                conn,
                entry,
                ask.owner,
                ask.lease_s,
                ask.take,
            )
        };
        self.waiters.get_mut(waiter).enqueued_at = enqueued_at(now);
        self.labels.set(LabelOf::Waiter(waiter), ask.label);
        let deadline = now + u64::from(ask.wait_s) * MICROS_PER_S;
        let mut nodes = TimerNodes {
            table: &mut self.table,
            waiters: &mut self.waiters,
            grants: &mut self.grants,
            leases: &mut self.leases,
        };
        self.wheel.arm(
            &mut nodes,
            waiter | WAITER_TIMER,
            tick_at_or_after(deadline),
        );
    }

    /// Whether one more waiter fits: in total, on `queue`, on `conn`, and
    /// within `--max-grants`.
    pub(in crate::core) fn can_queue(&self, conn: ConnId, queue: Queue) -> bool {
        let Some(state) = self.conns.get(conn as usize).filter(|state| state.open) else {
            return false;
        };
        // Watches have limits of their own (spec §13.3, v5).
        self.waiters.len() < self.limits.max_waiters
            && self.waiters.queue_len(queue) < self.limits.max_waiters_per_key
            && state.waiters.len < self.limits.max_waits_per_conn
            && self.can_grant()
    }

    /// Whether one more grant or waiter stays within `--max-grants` (spec
    /// §10.8) and, for an `A`/`S` of an identity with `max-grants=`, within
    /// its quota (see `Core::grant_cap`). A hand-over turns a waiter into a
    /// grant, so it never passes.
    #[inline]
    pub(in crate::core) fn can_grant(&self) -> bool {
        self.grants_held + self.waiters.len() < self.grant_cap
    }

    pub(in crate::core) fn insert_key(
        &mut self,
        key: &str,
        hash: u64,
        token: u64,
        owner: u64,
    ) -> Option<u32> {
        if self.table.len() >= self.limits.max_keys || !self.quotas.key_fits() {
            return None;
        }
        let entry = self.table.insert(key, hash, token, owner)?;
        self.quotas.charge_key(entry);
        Some(entry)
    }
}

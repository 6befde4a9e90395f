//! Keys with a limit of permits (spec §10): semaphores and shared locks.
//!
//! A key without a limit is held by at most one grant, which lives inline
//! in its lock-table entry (the `A` path: one 52-byte entry, nothing
//! else). The first request that names a limit turns the entry into a
//! *permit key*: its `token` becomes [`PERMITS`] and its `owner` the index
//! of a [`PermitKey`] here, and every grant of the key — the one it had,
//! and every later one, exclusive or counted — is a [`Grant`] node of its
//! own, with its own lease timer. A permit key keeps its grants' indices in
//! token order (which is grant order), so `Q` finds the smallest token at
//! the front, `R`/`E` find a token by binary search, and a listing of the
//! key's grants in token order, with the time each was granted, needs
//! nothing more. The limit stays until the key leaves the table.

use std::collections::VecDeque;

use super::labels::{self, LabelOf};
use super::memory::NIL;
use super::waiters::held_ms;
use super::{ConnId, Core, EarlierGrant, GRANT_TIMER, MICROS_PER_S, Micros};
use crate::protocol::Response;
use crate::timer_wheel::{TimerLinks, tick_at_or_after, tick_reached};

/// The `token` of a lock-table entry that is a permit key. No grant ever
/// gets it: the core answers `B` rather than issue token `u64::MAX`.
pub const PERMITS: u64 = u64::MAX;

/// The permit state of one key with a limit.
#[derive(Debug, Default)]
pub struct PermitKey {
    /// The key's grants (indices into [`Grants`]) in token order.
    pub grants: VecDeque<u32>,
    /// The key's limit, 1..=65535; 0 for a key made a permit key by an
    /// adoption (spec §7.4) until a request names one.
    pub limit: u16,
    /// Permits taken by its counted grants (≤ `limit`).
    pub used: u16,
    /// How many of its grants are exclusive (`take` 0): at most one of
    /// this run, or any number of adopted ones (spec §7.4), each of which
    /// counts as exclusive because its take is unknown.
    pub exclusive: u32,
    /// Held by the unknown grant of an earlier run until the horizon
    /// (spec §7.2; the entry's own lease timer runs to it). Nothing fits
    /// meanwhile, and the key then has no grant of this run, only adopted
    /// ones (§7.4).
    pub unknown: bool,
    /// Its queue's head fits but waits for a later turn: the scan that
    /// hands it on spent the turn's work (spec §4, v5), and the key is in
    /// the core's `handing` queue.
    pub handing: bool,
}

impl PermitKey {
    pub fn new(limit: u16) -> PermitKey {
        PermitKey {
            limit,
            ..PermitKey::default()
        }
    }

    /// Spec §10.3: an exclusive request fits when the key has no grant at
    /// all; a counted one when no grant is exclusive and the takes of the
    /// grants plus its own are within the limit.
    pub fn fits(&self, take: u16) -> bool {
        if self.unknown {
            return false;
        }
        if take == 0 {
            self.grants.is_empty()
        } else {
            self.exclusive == 0 && u32::from(self.used) + u32::from(take) <= u32::from(self.limit)
        }
    }

    /// Whether a scan of this key goes on in a later turn while it has a
    /// grant (its current token is set).
    pub fn handing_on(&self) -> bool {
        self.handing && !self.grants.is_empty()
    }

    /// Counts a new grant of `take` permits at the back (the largest token).
    pub fn add(&mut self, grant: u32, take: u16) {
        self.grants.push_back(grant);
        if take == 0 {
            self.exclusive += 1;
        } else {
            self.used += take;
        }
    }

    /// Forgets grant `grant` (token `token`, `take` permits).
    pub fn remove(&mut self, grants: &Grants, grant: u32, token: u64, take: u16) {
        if let Some(position) = self.position(grants, token) {
            debug_assert_eq!(self.grants[position], grant);
            self.grants.remove(position);
        }
        if take == 0 {
            self.exclusive -= 1;
        } else {
            self.used -= take;
        }
    }

    /// Adds adopted grant `grant` (an earlier run's `token`, spec §7.4) in
    /// token order: adopted tokens come in any order. It counts as
    /// exclusive.
    pub fn adopt(&mut self, grants: &Grants, grant: u32, token: u64) {
        let position = self
            .grants
            .partition_point(|&other| grants.get(other).token < token);
        self.grants.insert(position, grant);
        self.exclusive += 1;
    }

    /// Where the grant with `token` is in [`grants`](Self::grants).
    pub fn position(&self, grants: &Grants, token: u64) -> Option<usize> {
        self.grants
            .binary_search_by_key(&token, |&grant| grants.get(grant).token)
            .ok()
    }
}

/// One grant of a permit key.
#[derive(Clone, Copy, Debug)]
pub struct Grant {
    pub token: u64,
    /// The owner of the request that was granted.
    pub owner: u64,
    /// When it was granted (for listing how long it has been held): a
    /// grant restored from an earlier run was granted before this run's
    /// instant 0, so this wraps; the time held is `now.wrapping_sub(it)`.
    pub granted_at: Micros,
    /// The lease-expiry timer.
    pub lease: TimerLinks,
    /// The lock-table entry of its key. On a free node, the next free one.
    pub entry: u32,
    /// Permits it holds; 0 = all (exclusive).
    pub take: u16,
}

/// Node storage for the grants of permit keys, reused through a free list
/// so that a grant's index is stable while it lives (its timer id).
#[derive(Debug)]
pub struct Grants {
    nodes: Vec<Grant>,
    free_head: u32,
    len: usize,
}

impl Default for Grants {
    fn default() -> Self {
        Grants {
            nodes: Vec::new(),
            free_head: NIL,
            len: 0,
        }
    }
}

impl Grants {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, index: u32) -> &Grant {
        &self.nodes[index as usize]
    }

    pub fn get_mut(&mut self, index: u32) -> &mut Grant {
        &mut self.nodes[index as usize]
    }

    pub fn insert(&mut self, grant: Grant) -> u32 {
        self.len += 1;
        match self.nodes.get_mut(self.free_head as usize) {
            Some(free) => {
                let index = self.free_head;
                self.free_head = free.entry;
                *free = grant;
                index
            }
            None => {
                self.nodes.push(grant);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Frees node `index`; the caller has disarmed its timer.
    pub fn remove(&mut self, index: u32) {
        debug_assert!(!self.nodes[index as usize].lease.is_armed());
        self.nodes[index as usize].entry = self.free_head;
        self.free_head = index;
        self.len -= 1;
        if self.len == 0 && self.nodes.capacity() > 4096 {
            self.nodes = Vec::new();
            self.free_head = NIL;
        }
    }
}

impl Core {
    /// The permit state of `entry`, a permit key.
    pub(super) fn permit_key(&self, entry: u32) -> &PermitKey {
        &self.permit_keys[self.table.get(entry).owner as usize]
    }

    pub(super) fn permit_key_mut(&mut self, entry: u32) -> &mut PermitKey {
        let index = self.table.get(entry).owner as usize;
        &mut self.permit_keys[index]
    }

    /// Gives `entry` (a key without a limit, held by its one exclusive
    /// grant or by the unknown grant) the limit `limit` (spec §10.2): its
    /// grant, if any, moves out of line with its token, owner, lease and
    /// label, as an exclusive grant. The unknown grant's horizon stays on
    /// the entry's own timer.
    pub(super) fn set_limit(&mut self, entry: u32, limit: u16, now: Micros) {
        let held = *self.table.get(entry);
        debug_assert_ne!({ held.token }, PERMITS);
        let mut permits = PermitKey::new(limit);
        if held.token == 0 {
            permits.unknown = true;
        }
        let index = self.permit_keys.insert(permits) as u64;
        if held.token != 0 {
            let deadline = self.wheel.deadline_of(&{ held.lease });
            self.cancel_lease(entry);
            let grant = self.grants.insert(Grant {
                token: held.token,
                owner: held.owner,
                // The inline grant's moment, to the millisecond.
                granted_at: now.wrapping_sub(
                    u64::from(held_ms(self.waiters.grant_time(held.waiters), now)) * 1_000,
                ),
                lease: TimerLinks::UNARMED,
                entry,
                take: 0,
            });
            let label = self.labels.take(LabelOf::Entry(entry));
            self.labels.put(LabelOf::Grant(grant), label);
            let charged = self.quotas.uncharge_grant(LabelOf::Entry(entry));
            self.quotas.recharge(LabelOf::Grant(grant), charged);
            self.permit_keys[index as usize].add(grant, 0);
            self.arm_grant_tick(grant, deadline);
        }
        let entry = self.table.get_mut(entry);
        entry.token = PERMITS;
        entry.owner = index;
    }

    /// Makes `entry`, just inserted for a request that names `limit` and
    /// fits, a permit key with no grant yet.
    pub(super) fn new_permit_key(&mut self, entry: u32, limit: u16) {
        let index = self.permit_keys.insert(PermitKey::new(limit)) as u64;
        let entry = self.table.get_mut(entry);
        entry.token = PERMITS;
        entry.owner = index;
    }

    /// Grants `take` permits of `entry` (a permit key they fit) to `owner`
    /// on `conn`: a new grant with the next token, whose index it returns.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn grant_permits(
        &mut self,
        entry: u32,
        conn: ConnId,
        owner: u64,
        take: u16,
        lease_s: u8,
        label: Option<Box<str>>,
        now: Micros,
    ) -> u32 {
        let token = self.take_token(entry);
        let grant = self.grants.insert(Grant {
            token,
            owner,
            granted_at: now,
            lease: TimerLinks::UNARMED,
            entry,
            take,
        });
        self.permit_key_mut(entry).add(grant, take);
        self.labels.put(LabelOf::Grant(grant), label);
        self.arm_grant_lease_at(grant, now + u64::from(lease_s) * MICROS_PER_S);
        // Recorded durably before this grant's answer leaves (spec §7.4).
        self.counted_grants_made |= take != 0;
        self.grants_held += 1;
        self.stats.grants += 1;
        self.outbox
            .push((conn, Response::Acquired { owner, token }));
        grant
    }

    /// Adds `token`, an earlier run's, to permit key `entry` (held by the
    /// unknown grant) as an adopted grant (spec §7.4): owner 0, take 0, its
    /// lease to `deadline`.
    pub(super) fn adopt_grant(
        &mut self,
        entry: u32,
        token: u64,
        deadline: Micros,
        now: Micros,
    ) -> u32 {
        let grant = self.grants.insert(Grant {
            token,
            owner: 0,
            granted_at: now,
            lease: TimerLinks::UNARMED,
            entry,
            take: 0,
        });
        let index = self.table.get(entry).owner as usize;
        self.permit_keys[index].adopt(&self.grants, grant, token);
        self.arm_grant_lease_at(grant, deadline);
        self.grants_held += 1;
        grant
    }

    /// Adds a grant of an earlier run to permit key `entry` (spec §7.4),
    /// after the ones it has (the caller checked the token order and the
    /// fit), with its lease to `deadline` (its own, at least 1).
    pub(super) fn restore_permits(&mut self, entry: u32, earlier: &EarlierGrant<'_>) {
        let take = earlier.take;
        let grant = self.grants.insert(Grant {
            token: earlier.token,
            owner: earlier.owner,
            // Before this run's instant 0, wrapping (see the field).
            granted_at: earlier.granted_at,
            lease: TimerLinks::UNARMED,
            entry,
            take,
        });
        self.permit_key_mut(entry).add(grant, take);
        self.labels
            .put(LabelOf::Grant(grant), labels::owned(earlier.label));
        let deadline = earlier.deadline.max(1);
        self.arm_grant_lease_at(grant, deadline);
    }

    /// Arms (or re-arms) `grant`'s lease to end at `deadline`.
    pub(super) fn arm_grant_lease_at(&mut self, grant: u32, deadline: Micros) {
        self.lease_deadline_max = self.lease_deadline_max.max(deadline);
        self.arm_grant_tick(grant, tick_at_or_after(deadline));
    }

    fn arm_grant_tick(&mut self, grant: u32, tick: u64) {
        let (wheel, mut nodes) = self.timers();
        wheel.arm(&mut nodes, grant | GRANT_TIMER, tick);
    }

    /// Ends `grant` of `entry` (released or expired): its permits are
    /// free. The caller then lets the queue move with
    /// [`scan_permits`](Self::scan_permits).
    pub(super) fn end_grant(&mut self, entry: u32, grant: u32) {
        {
            let (wheel, mut nodes) = self.timers();
            wheel.cancel(&mut nodes, grant | GRANT_TIMER);
        }
        let Grant { token, take, .. } = *self.grants.get(grant);
        let index = self.table.get(entry).owner as usize;
        self.permit_keys[index].remove(&self.grants, grant, token, take);
        self.labels.take(LabelOf::Grant(grant));
        self.quotas.uncharge_grant(LabelOf::Grant(grant));
        self.grants.remove(grant);
        self.grants_held -= 1;
    }

    /// Spec §10.4: grants the head waiter if it fits, then the next, and so
    /// on; a head that does not fit stops the scan, so nobody overtakes.
    /// Grants made here get increasing tokens in queue order. A key left
    /// with no grant and no waiter leaves the table (and its limit with
    /// it).
    ///
    /// Each waiter answered costs one unit of the turn's work: past it the
    /// key waits in `handing` for the next turns (spec §4, v5), after the
    /// first waiter at least, so that the event that freed the permits
    /// has answered its watches with the new grant (§13.1) and every scan
    /// makes progress — unless the key is already handing on with a grant
    /// (a connection that leaves with thousands of waiters must not grant
    /// one per waiter). A waiter that leaves meanwhile (its deadline, its
    /// connection) leaves the queue, so it is never granted.
    pub(super) fn scan_permits(&mut self, entry: u32, now: Micros) {
        // A key still handing on from an earlier turn may hold waiters
        // whose deadline passed meanwhile, their timers not fired yet.
        let overdue = if self.permit_key(entry).handing {
            tick_reached(now)
        } else {
            0
        };
        self.scan_permits_overdue(entry, now, overdue);
    }

    /// [`scan_permits`](Self::scan_permits), where a waiter whose deadline
    /// tick is before `overdue` leaves with `T`, as its timer would have
    /// it, never granted after its deadline (spec §3).
    fn scan_permits_overdue(&mut self, entry: u32, now: Micros, overdue: u64) {
        let mut answered = false;
        loop {
            let Some(head) = self.table.get(entry).waiters.head() else {
                self.done_handing(entry);
                return self.drop_if_idle(entry, now);
            };
            let (conn, owner, lease_s, take) = {
                let waiter = self.waiters.get(head);
                (waiter.conn, waiter.owner, waiter.lease_s, waiter.take)
            };
            if !self.permit_key(entry).fits(take) {
                return self.done_handing(entry);
            }
            if self.turn_work == 0 && (answered || self.permit_key(entry).handing_on()) {
                return self.hand_on_later(entry);
            }
            self.turn_work = self.turn_work.saturating_sub(1);
            if overdue != 0 && self.wheel.deadline_of(&self.waiters.get(head).timer) < overdue {
                self.observe_wait(head, now);
                self.unlink_waiter(head);
                self.timeout(conn, owner);
                continue;
            }
            self.observe_wait(head, now);
            let charged = self.quotas.uncharge_grant(LabelOf::Waiter(head));
            let (_, label) = self.unlink_waiter(head);
            if !self.may_issue(lease_s, take != 0, now) {
                self.busy(conn, owner);
                continue;
            }
            // A grant made: the key's token is set (a `B` sets none).
            answered = true;
            let grant = self.grant_permits(entry, conn, owner, take, lease_s, label, now);
            // The waiter's charge follows it into its grant.
            self.quotas.recharge(LabelOf::Grant(grant), charged);
        }
    }

    /// The scan of `entry` ended: its head does not fit, or nobody waits.
    #[inline(always)]
    fn done_handing(&mut self, entry: u32) {
        let permits = self.permit_key_mut(entry);
        if permits.handing {
            permits.handing = false;
        }
    }

    /// The turn's work is spent and `entry`'s head still fits: the scan
    /// goes on in a later turn (see [`continue_hand_overs`]
    /// (Self::continue_hand_overs)).
    #[cold]
    #[inline(never)]
    fn hand_on_later(&mut self, entry: u32) {
        let permits = self.permit_key_mut(entry);
        if !permits.handing {
            permits.handing = true;
            self.handing.push_back(entry);
        }
    }

    /// Goes on with the scans that an earlier turn's work could not
    /// finish, oldest first, while this turn's work lasts; a key not
    /// finished goes to the back. The watches of a key whose token this
    /// changes (a scan that only answered `B` before) are answered.
    #[cold]
    #[inline(never)]
    pub(super) fn continue_hand_overs(&mut self, now: Micros) {
        while self.turn_work > 0 {
            let Some(entry) = self.handing.pop_front() else {
                return;
            };
            // The key may have left the table meanwhile (every waiter
            // gone, no grant), its entry even reused by another key.
            let live = self.table.is_live(entry)
                && self.table.get(entry).token == PERMITS
                && self.permit_key(entry).handing;
            if !live {
                continue;
            }
            self.permit_key_mut(entry).handing = false;
            let watched = self.watched_entry(entry);
            self.scan_permits_overdue(entry, now, tick_reached(now));
            if let Some(slot) = watched {
                self.wake_watch_slot(slot, now);
            }
        }
    }

    /// At a shutdown (no waiter is left): no scan goes on.
    pub(super) fn forget_hand_overs(&mut self) {
        for entry in std::mem::take(&mut self.handing) {
            if self.table.is_live(entry) && self.table.get(entry).token == PERMITS {
                self.permit_key_mut(entry).handing = false;
            }
        }
    }

    /// Keys whose hand-over goes on in a later turn.
    pub fn hand_overs_pending(&self) -> usize {
        self.handing.len()
    }

    /// Removes permit key `entry` if it has no grant and no waiter: freed
    /// (remembered free while the grace runs) or, if the unknown grant
    /// holds it, dropped as a key nobody waits on (it means the same as a
    /// key not in the table).
    pub(super) fn drop_if_idle(&mut self, entry: u32, now: Micros) {
        let held = self.table.get(entry);
        let index = held.owner as usize;
        if !held.waiters.is_empty() || !self.permit_keys[index].grants.is_empty() {
            return;
        }
        if self.permit_keys[index].unknown {
            self.cancel_lease(entry);
            self.unknown_holders -= 1;
        } else {
            self.note_freed_in_grace(entry, now);
        }
        self.permit_keys.remove(index);
        self.remove_key(entry);
    }

    /// The unknown grant of permit key `entry` reached the horizon.
    pub(super) fn unknown_permits_ended(&mut self, entry: u32, now: Micros) {
        self.permit_key_mut(entry).unknown = false;
        self.unknown_holders -= 1;
        self.scan_permits(entry, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_node_stays_48_bytes() {
        assert_eq!(std::mem::size_of::<Grant>(), 48);
    }

    #[test]
    fn fit_rule() {
        let mut key = PermitKey::new(3);
        assert!(key.fits(0) && key.fits(3));
        key.add(0, 2);
        assert!(!key.fits(0) && key.fits(1) && !key.fits(2));
        key.add(1, 1);
        assert!(!key.fits(1));
        let mut exclusive = PermitKey::new(3);
        exclusive.add(0, 0);
        assert!(!exclusive.fits(1) && !exclusive.fits(0));
        let unknown = PermitKey {
            unknown: true,
            ..PermitKey::new(3)
        };
        assert!(!unknown.fits(1) && !unknown.fits(0));
    }
}

//! `O` (spec §13): the key's current token, at once when it differs from
//! `since`, else held as a watch until it changes or `wait` ends. A watch
//! is not a waiter: it never touches the lock table.

use crate::core::labels::LabelOf;
use crate::core::permits::PERMITS;
use crate::core::waiters::held_ms;
use crate::core::{ConnId, Core, MICROS_PER_S, Micros, Waking, WatchTimers, millis_left};
use crate::protocol::{ErrorCode, Response};
use crate::timer_wheel::{tick_at_or_after, tick_reached};

/// What a `V` says of a key, without its id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::core) struct KeyState {
    pub token: u64,
    lease_ms: u32,
    held_ms: u32,
    grants: u16,
    waiters: u32,
    label: String,
}

impl KeyState {
    fn response(self, id: u64) -> Response {
        Response::KeyState {
            id,
            token: self.token,
            lease_ms: self.lease_ms,
            held_ms: self.held_ms,
            grants: self.grants,
            waiters: self.waiters,
            label: self.label,
        }
    }
}

impl Core {
    #[inline(never)]
    pub(in crate::core) fn observe(
        &mut self,
        conn: ConnId,
        wait_s: u8,
        id: u64,
        since: u64,
        key: &str,
        now: Micros,
    ) {
        let state = self.key_state(key, now);
        if state.token != since || wait_s == 0 {
            self.outbox.push((conn, state.response(id)));
            return;
        }
        // Watches have limits of their own, apart from the waits' (spec
        // §13.3): no number of them turns a waiting `A`/`S` away.
        if self.watches.len() >= self.limits.max_watches
            || self.watches.of_conn(conn) >= self.limits.max_watches_per_conn as usize
            || !self.quotas.watch_fits()
        {
            self.send_error(conn, ErrorCode::TooManyWatches, id);
            return;
        }
        // Every watch of a key waits on the same token (the key's current
        // one); a record left behind on another is answered first.
        if let Some(slot) = self.watches.find(key)
            && self.watches.key(slot).since != since
        {
            self.wake_watch_slot(slot, now);
        }
        let watch = self.watches.insert(conn, id, key, since);
        self.quotas.charge_watch(watch);
        let deadline = now + u64::from(wait_s) * MICROS_PER_S;
        if self.watch_wheel.is_empty() {
            // Nothing polls an empty wheel: bring it up to `now` first (as
            // `handle_request` does for the other wheel).
            self.watch_wheel.catch_up_idle(tick_reached(now));
        }
        self.watch_wheel.arm(
            &mut WatchTimers(&mut self.watches),
            watch,
            tick_at_or_after(deadline),
        );
    }

    /// The key's state as `V` shows it (spec §13.2): the grant with the
    /// smallest token, or during a crash grace what `Q` shows.
    pub(in crate::core) fn key_state(&self, key: &str, now: Micros) -> KeyState {
        let free = KeyState {
            token: 0,
            lease_ms: 0,
            held_ms: 0,
            grants: 0,
            waiters: 0,
            label: String::new(),
        };
        let unknown = |waiters: u32| KeyState {
            lease_ms: millis_left(self.grace_until, now),
            grants: 1,
            waiters,
            ..free.clone()
        };
        let Some(entry) = self.table.find(key, self.table.hash(key)) else {
            return if self.held_by_unknown_grant(key, now) {
                unknown(0)
            } else {
                free
            };
        };
        let held = *self.table.get(entry);
        let waiters = self.waiters.queue_len(held.waiters);
        if held.token == PERMITS {
            let permits = self.permit_key(entry);
            let count = permits.grants.len() + usize::from(permits.unknown);
            let Some(&grant) = permits.grants.front() else {
                return unknown(waiters);
            };
            let node = self.grants.get(grant);
            KeyState {
                token: node.token,
                lease_ms: millis_left(self.lease_deadline(&node.lease), now),
                held_ms: u32::try_from(now.wrapping_sub(node.granted_at) / 1_000)
                    .unwrap_or(u32::MAX),
                grants: u16::try_from(count).unwrap_or(u16::MAX),
                waiters,
                label: self.labels.get(LabelOf::Grant(grant)).to_owned(),
            }
        } else if held.token == 0 {
            unknown(waiters)
        } else {
            KeyState {
                token: held.token,
                lease_ms: millis_left(self.lease_deadline(&{ held.lease }), now),
                held_ms: held_ms(self.waiters.grant_time(held.waiters), now),
                grants: 1,
                waiters,
                label: self.labels.get(LabelOf::Entry(entry)).to_owned(),
            }
        }
    }

    /// The record of `key`'s watches, if any: taken before an event that
    /// may change the key's token (or drop its entry), and given to
    /// [`wake_watch_slot`](Self::wake_watch_slot) after it.
    #[inline(always)]
    pub(in crate::core) fn watched(&self, key: &str) -> Option<u32> {
        if self.watches.is_empty() {
            return None;
        }
        self.watches.find(key)
    }

    /// As [`watched`](Self::watched), for a lock-table entry.
    #[inline(always)]
    pub(in crate::core) fn watched_entry(&self, entry: u32) -> Option<u32> {
        if self.watches.is_empty() {
            return None;
        }
        self.watches.find(self.table.key(entry))
    }

    /// After an event on `key`: answers its watches if its token changed.
    /// Costs one branch while nobody watches anything.
    #[inline(always)]
    pub(in crate::core) fn wake_watches(&mut self, key: &str, now: Micros) {
        if let Some(slot) = self.watched(key) {
            self.wake_watch_slot(slot, now);
        }
    }

    /// Answers every watch of the record `slot` if its key's token is no
    /// longer the one they wait on: the record leaves the index (a new `O`
    /// on the key starts a new one) and its watches are answered with the
    /// state of this moment, within this turn's work and the rest in the
    /// next turns (spec §4, v5).
    #[inline(never)]
    pub(in crate::core) fn wake_watch_slot(&mut self, slot: u32, now: Micros) {
        if !self.watches.key_is_live(slot) {
            return;
        }
        let record = self.watches.key(slot);
        let state = self.key_state(&record.key, now);
        if state.token == record.since {
            return;
        }
        self.answer_record(slot, state);
    }

    /// Takes the record `slot` out of the index and answers its watches
    /// with `state`, within this turn's work and the rest in the next turns.
    fn answer_record(&mut self, slot: u32, state: KeyState) {
        let generation = self.watches.key(slot).generation;
        self.watches.detach(slot);
        self.waking.push_back(Waking {
            slot,
            generation,
            state,
        });
        self.answer_waking();
    }

    /// Answers the watches of detached records, oldest first, while this
    /// turn's work lasts.
    pub(in crate::core) fn answer_waking(&mut self) {
        while self.turn_work > 0 {
            let Some(front) = self.waking.front() else {
                return;
            };
            match self.watches.first_of(front.slot, front.generation) {
                Some(watch) => {
                    let state = front.state.clone();
                    self.turn_work -= 1;
                    self.answer_watch(watch, state);
                }
                None => {
                    self.waking.pop_front();
                }
            }
        }
        // Records answered in full leave no entry behind.
        while self.waking.front().is_some_and(|front| {
            self.watches
                .first_of(front.slot, front.generation)
                .is_none()
        }) {
            self.waking.pop_front();
        }
    }

    /// Whether watches wait to be answered in a later turn.
    pub fn has_waking(&self) -> bool {
        !self.waking.is_empty()
    }

    /// After a `C` changed the label of `key`'s grant `token`: if that
    /// grant is the key's current one, every watch of the key is answered
    /// with the same token and the new label (spec §13.4a); a watcher that
    /// asks again with the same `since` is held as before.
    #[cold]
    #[inline(never)]
    pub(in crate::core) fn wake_watches_on_label(&mut self, key: &str, token: u64, now: Micros) {
        let Some(slot) = self.watched(key) else {
            return;
        };
        if !self.watches.key_is_live(slot) {
            return;
        }
        let state = self.key_state(&self.watches.key(slot).key, now);
        if state.token != token {
            return;
        }
        self.answer_record(slot, state);
    }

    /// A watch's `wait` ended: it is answered with the unchanged state.
    pub(in crate::core) fn watch_deadline(&mut self, watch: u32, now: Micros) {
        let slot = self.watches.get(watch).key;
        let state = self.key_state(&self.watches.key(slot).key, now);
        self.answer_watch(watch, state);
    }

    /// Answers one watch with `state` and forgets it.
    fn answer_watch(&mut self, watch: u32, state: KeyState) {
        let node = self.drop_watch(watch);
        self.outbox.push((node.conn, state.response(node.id)));
    }

    /// Forgets a watch without an answer (its connection closed).
    pub(in crate::core) fn drop_watch(&mut self, watch: u32) -> crate::core::watches::Watch {
        self.watch_wheel
            .cancel(&mut WatchTimers(&mut self.watches), watch);
        self.quotas.uncharge_watch(watch);
        self.watches.remove(watch)
    }

    /// A clean stop (spec §13.3): every watch of `conn` is answered with
    /// its key's state at this moment.
    pub(in crate::core) fn answer_watches_of(&mut self, conn: ConnId, now: Micros) {
        for watch in self.watches.conn_list(conn).to_vec() {
            let slot = self.watches.get(watch).key;
            let state = self.key_state(&self.watches.key(slot).key, now);
            self.answer_watch(watch, state);
        }
    }

    /// `conn` closed: its watches end without a trace.
    pub(in crate::core) fn drop_watches_of(&mut self, conn: ConnId) {
        for watch in self.watches.conn_list(conn).to_vec() {
            self.drop_watch(watch);
        }
    }
}

//! A hashed hierarchical timer wheel (after Varghese & Lauck, and the shape
//! of tokio's) with 1 ms ticks and intrusive links.
//!
//! The wheel owns no timer nodes: each timed object (a lock's lease, a
//! waiter's deadline, a connection's read timeout) embeds a [`TimerLinks`]
//! and the wheel reaches it through [`TimerStore`]. Arming, cancelling and
//! firing are O(1) and allocate nothing, which keeps a million armed leases
//! at 12 bytes each.
//!
//! Four levels of 64 slots cover 64⁴ ms ≈ 4.6 h; the top level acts as a
//! ring, so any deadline less than that far ahead is exact. kunci's timers
//! are at most ~256 s ahead. A timer fires at the first poll whose tick is
//! at or after its deadline tick, and deadlines are rounded *up* to a tick,
//! so a timer never fires early. A cancelled timer is unlinked at once: it
//! never causes a wake-up.

/// Microseconds per tick. Every conversion between the clock (µs) and
/// ticks goes through the three functions below, so the rounding is
/// decided once.
pub const MICROS_PER_TICK: u64 = 1_000;

/// The tick a deadline at `at` µs fires on: rounded *up*, so a timer never
/// fires before its deadline.
pub fn tick_at_or_after(at: u64) -> u64 {
    at.div_ceil(MICROS_PER_TICK)
}

/// The tick the clock at `now` µs has reached: rounded down, so a poll
/// never fires a timer whose tick has not begun.
pub fn tick_reached(now: u64) -> u64 {
    now / MICROS_PER_TICK
}

/// The instant (µs) at which `tick` begins.
pub fn tick_start(tick: u64) -> u64 {
    tick * MICROS_PER_TICK
}

/// Identifies a timed object to its [`TimerStore`]. Values from
/// [`SLOT_BASE`] up are reserved for the wheel.
pub type TimerId = u32;

const LEVELS: usize = 4;
const SLOT_BITS: u32 = 6;
const SLOTS: usize = 1 << SLOT_BITS;
/// Slot numbers 0..256 are the level slots; 256 is the "already due" list.
const DUE_SLOT: u32 = (LEVELS * SLOTS) as u32;
/// A node whose `prev` is `SLOT_BASE + n` is the head of slot list `n`.
const SLOT_BASE: u32 = u32::MAX - 1024;
/// `prev` of a node that is not in the wheel.
const UNARMED: u32 = u32::MAX;
/// The end of a list.
const NIL: u32 = u32::MAX;
/// Ticks the wheel can look ahead: one turn of the top level.
const HORIZON_TICKS: u64 = 1 << (SLOT_BITS as usize * LEVELS);

/// The largest id a store may use.
pub const TIMER_ID_MAX: TimerId = SLOT_BASE - 1;

/// The links a timed object embeds. Its deadline tick is kept modulo 2³²
/// (the wheel reconstructs it from its own position, since every armed
/// deadline is less than [`HORIZON_TICKS`] away).
#[derive(Clone, Copy, Debug)]
pub struct TimerLinks {
    deadline: u32,
    prev: u32,
    next: u32,
}

impl Default for TimerLinks {
    fn default() -> Self {
        TimerLinks::UNARMED
    }
}

impl TimerLinks {
    pub const UNARMED: TimerLinks = TimerLinks {
        deadline: 0,
        prev: UNARMED,
        next: NIL,
    };

    pub fn is_armed(&self) -> bool {
        self.prev != UNARMED
    }
}

/// Where the wheel finds the links of a timer id.
pub trait TimerStore {
    fn links(&mut self, id: TimerId) -> &mut TimerLinks;

    /// Timer `id` was armed to fire at tick `deadline`.
    #[inline(always)]
    fn armed(&mut self, _id: TimerId, _deadline: u64) {}

    /// Timer `id`, armed for tick `deadline`, left the wheel: cancelled,
    /// moved (re-armed) or fired. Every [`armed`](Self::armed) is matched
    /// by exactly one of these, with the same deadline.
    #[inline(always)]
    fn disarmed(&mut self, _id: TimerId, _deadline: u64) {}
}

/// The wheel: slot-list heads and occupancy bitmaps, nothing per timer.
#[derive(Debug)]
pub struct TimerWheel {
    /// The tick the wheel has advanced to; nothing due at or before it is
    /// left in a level slot.
    elapsed: u64,
    heads: [u32; LEVELS * SLOTS + 1],
    occupied: [u64; LEVELS],
    armed: usize,
}

impl Default for TimerWheel {
    fn default() -> Self {
        Self::new()
    }
}

impl TimerWheel {
    pub fn new() -> TimerWheel {
        TimerWheel {
            elapsed: 0,
            heads: [NIL; LEVELS * SLOTS + 1],
            occupied: [0; LEVELS],
            armed: 0,
        }
    }

    /// How many timers are armed.
    pub fn len(&self) -> usize {
        self.armed
    }

    pub fn is_empty(&self) -> bool {
        self.armed == 0
    }

    /// The tick the wheel has advanced to.
    pub fn elapsed(&self) -> u64 {
        self.elapsed
    }

    /// The deadline tick of an armed timer.
    pub fn deadline_of(&self, links: &TimerLinks) -> u64 {
        self.unwrap_tick(links.deadline)
    }

    fn unwrap_tick(&self, wrapped: u32) -> u64 {
        let delta = wrapped.wrapping_sub(self.elapsed as u32) as i32;
        self.elapsed.saturating_add_signed(delta as i64)
    }

    /// Arms `id` to fire at `deadline` (a tick). Re-arming an armed timer
    /// moves it. A deadline at or before the wheel's position fires at the
    /// next poll. Deadlines must be less than 2³¹ ticks (≈ 24 days) ahead.
    pub fn arm(&mut self, store: &mut impl TimerStore, id: TimerId, deadline: u64) {
        debug_assert!(id <= TIMER_ID_MAX);
        debug_assert!(deadline < self.elapsed + (1 << 31));
        self.cancel(store, id);
        store.links(id).deadline = deadline as u32;
        let slot = self.slot_for(deadline);
        self.push(store, slot, id);
        self.armed += 1;
        store.armed(id, deadline);
    }

    /// Disarms `id` if it is armed.
    pub fn cancel(&mut self, store: &mut impl TimerStore, id: TimerId) {
        let links = *store.links(id);
        if !links.is_armed() {
            return;
        }
        if links.next != NIL {
            store.links(links.next).prev = links.prev;
        }
        if links.prev >= SLOT_BASE {
            let slot = (links.prev - SLOT_BASE) as usize;
            self.heads[slot] = links.next;
            if links.next == NIL && slot < DUE_SLOT as usize {
                self.occupied[slot / SLOTS] &= !(1 << (slot % SLOTS));
            }
        } else {
            store.links(links.prev).next = links.next;
        }
        *store.links(id) = TimerLinks::UNARMED;
        self.armed -= 1;
        store.disarmed(id, self.unwrap_tick(links.deadline));
    }

    /// The earliest tick at which [`poll`](Self::poll) may return a timer,
    /// or `None` when nothing is armed. Exact for level 0; for higher
    /// levels it is the tick at which that slot's timers move down (a
    /// wake-up that fires nothing, at most once per level and slot).
    pub fn next_tick(&self) -> Option<u64> {
        self.next_expiration().map(|(_, tick)| tick)
    }

    /// Brings an empty wheel up to `now` (a tick): what [`poll`](Self::poll)
    /// does when nothing is armed, without its call on the request path.
    #[inline]
    pub fn catch_up_idle(&mut self, now: u64) {
        debug_assert_eq!(self.armed, 0, "catch_up_idle on a wheel with timers");
        self.elapsed = self.elapsed.max(now);
    }

    /// Returns one timer due at or before `now` (a tick) and disarms it, or
    /// `None` when none is due; the wheel then stands at `now`. Call until
    /// `None`.
    pub fn poll(&mut self, store: &mut impl TimerStore, now: u64) -> Option<TimerId> {
        if self.armed == 0 {
            // Nothing can fire: only catch up (what the loop below would
            // do after scanning every empty level), which the request path
            // does before each acquire on an idle wheel.
            self.elapsed = self.elapsed.max(now);
            return None;
        }
        loop {
            let due = self.heads[DUE_SLOT as usize];
            if due != NIL {
                self.cancel(store, due);
                return Some(due);
            }
            match self.next_expiration() {
                Some((slot, tick)) if tick <= now => {
                    self.elapsed = tick;
                    self.cascade(store, slot);
                }
                _ => {
                    self.elapsed = self.elapsed.max(now);
                    return None;
                }
            }
        }
    }

    /// The next slot to process and the tick it starts at. A lower level's
    /// occupied slot always starts before any slot of a higher level, so
    /// the first occupied level decides.
    fn next_expiration(&self) -> Option<(u32, u64)> {
        if self.heads[DUE_SLOT as usize] != NIL {
            return Some((DUE_SLOT, self.elapsed));
        }
        (0..LEVELS).find_map(|level| {
            let occupied = self.occupied[level];
            if occupied == 0 {
                return None;
            }
            let current = self.slot_index(level, self.elapsed);
            let rotated = occupied.rotate_right(current as u32);
            let slot = (current + rotated.trailing_zeros() as usize) % SLOTS;
            Some(((level * SLOTS + slot) as u32, self.slot_start(level, slot)))
        })
    }

    /// Moves every timer of a slot that starts at `elapsed` to where it
    /// belongs now: the due list or a lower level (or, for a deadline past
    /// the horizon, a later turn of the top level).
    fn cascade(&mut self, store: &mut impl TimerStore, slot: u32) {
        let mut id = self.heads[slot as usize];
        self.heads[slot as usize] = NIL;
        self.occupied[slot as usize / SLOTS] &= !(1 << (slot as usize % SLOTS));
        while id != NIL {
            let links = *store.links(id);
            let target = self.slot_for(self.unwrap_tick(links.deadline));
            self.push(store, target, id);
            id = links.next;
        }
    }

    fn slot_index(&self, level: usize, tick: u64) -> usize {
        ((tick >> (SLOT_BITS as usize * level)) as usize) & (SLOTS - 1)
    }

    /// The slot list a deadline belongs in, given the wheel's position: the
    /// level is the highest 6-bit digit in which deadline and `elapsed`
    /// differ, the slot that digit of the deadline.
    fn slot_for(&self, deadline: u64) -> u32 {
        if deadline <= self.elapsed {
            return DUE_SLOT;
        }
        let differing = ((self.elapsed ^ deadline) | (SLOTS as u64 - 1)).min(HORIZON_TICKS - 1);
        let highest_bit = 63 - differing.leading_zeros() as usize;
        let level = highest_bit / SLOT_BITS as usize;
        (level * SLOTS + self.slot_index(level, deadline)) as u32
    }

    /// The tick at which slot `slot` of `level` next starts. Every occupied
    /// slot starts after `elapsed`; one that seems not to is a top-level
    /// slot of the next turn.
    fn slot_start(&self, level: usize, slot: usize) -> u64 {
        let slot_ticks = 1u64 << (SLOT_BITS as usize * level);
        let level_ticks = slot_ticks << SLOT_BITS;
        let start = (self.elapsed & !(level_ticks - 1)) + slot as u64 * slot_ticks;
        if start <= self.elapsed {
            start + level_ticks
        } else {
            start
        }
    }

    #[inline(always)]
    fn push(&mut self, store: &mut impl TimerStore, slot: u32, id: TimerId) {
        let head = self.heads[slot as usize];
        if head != NIL {
            store.links(head).prev = id;
        }
        let links = store.links(id);
        links.prev = SLOT_BASE + slot;
        links.next = head;
        self.heads[slot as usize] = id;
        if slot < DUE_SLOT {
            self.occupied[slot as usize / SLOTS] |= 1 << (slot as usize % SLOTS);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nodes(Vec<TimerLinks>);

    impl TimerStore for Nodes {
        fn links(&mut self, id: TimerId) -> &mut TimerLinks {
            &mut self.0[id as usize]
        }
    }

    fn fire_all(wheel: &mut TimerWheel, nodes: &mut Nodes, now: u64) -> Vec<TimerId> {
        let mut fired = Vec::new();
        while let Some(id) = wheel.poll(nodes, now) {
            fired.push(id);
        }
        fired.sort();
        fired
    }

    #[test]
    fn fires_exactly_at_deadline_never_before() {
        for deadline in [
            1u64, 63, 64, 65, 4095, 4096, 4097, 100_000, 262_143, 262_144, 300_000,
        ] {
            let mut nodes = Nodes(vec![TimerLinks::UNARMED; 1]);
            let mut wheel = TimerWheel::new();
            wheel.arm(&mut nodes, 0, deadline);
            // Step one tick at a time around the deadline, jumping before it.
            let mut now = 0;
            while now < deadline - 1 {
                now = (now + 997).min(deadline - 1);
                assert!(
                    fire_all(&mut wheel, &mut nodes, now).is_empty(),
                    "early at {now} for {deadline}"
                );
            }
            assert_eq!(
                fire_all(&mut wheel, &mut nodes, deadline),
                vec![0],
                "deadline {deadline}"
            );
            assert!(wheel.is_empty());
            assert_eq!(wheel.next_tick(), None);
        }
    }

    #[test]
    fn next_tick_is_never_after_the_earliest_deadline() {
        let mut nodes = Nodes(vec![TimerLinks::UNARMED; 3]);
        let mut wheel = TimerWheel::new();
        wheel.arm(&mut nodes, 0, 5000);
        wheel.arm(&mut nodes, 1, 70);
        wheel.arm(&mut nodes, 2, 200_000);
        let mut fired = Vec::new();
        let mut wakeups = 0;
        while let Some(tick) = wheel.next_tick() {
            wakeups += 1;
            for id in fire_all(&mut wheel, &mut nodes, tick) {
                fired.push((id, tick));
            }
        }
        assert_eq!(fired, vec![(1, 70), (0, 5000), (2, 200_000)]);
        assert!(wakeups < 12, "{wakeups} wake-ups");
    }

    #[test]
    fn cancel_unlinks_and_costs_no_wakeup() {
        let mut nodes = Nodes(vec![TimerLinks::UNARMED; 3]);
        let mut wheel = TimerWheel::new();
        wheel.arm(&mut nodes, 0, 100);
        wheel.arm(&mut nodes, 1, 100);
        wheel.arm(&mut nodes, 2, 100);
        wheel.cancel(&mut nodes, 1);
        wheel.cancel(&mut nodes, 1);
        assert_eq!(wheel.len(), 2);
        assert_eq!(fire_all(&mut wheel, &mut nodes, 100), vec![0, 2]);
        wheel.arm(&mut nodes, 0, 150);
        wheel.cancel(&mut nodes, 0);
        assert_eq!(wheel.next_tick(), None);
    }

    #[test]
    fn wrapping_deadlines_across_the_u32_boundary() {
        let mut nodes = Nodes(vec![TimerLinks::UNARMED; 1]);
        let mut wheel = TimerWheel::new();
        let start = u32::MAX as u64 - 10;
        assert!(fire_all(&mut wheel, &mut nodes, start).is_empty());
        wheel.arm(&mut nodes, 0, start + 255_000);
        assert_eq!(wheel.deadline_of(&nodes.0[0]), start + 255_000);
        assert!(fire_all(&mut wheel, &mut nodes, start + 254_999).is_empty());
        assert_eq!(fire_all(&mut wheel, &mut nodes, start + 255_000), vec![0]);
    }

    #[test]
    fn past_deadline_fires_at_next_poll() {
        let mut nodes = Nodes(vec![TimerLinks::UNARMED; 1]);
        let mut wheel = TimerWheel::new();
        fire_all(&mut wheel, &mut nodes, 1000);
        wheel.arm(&mut nodes, 0, 10);
        assert_eq!(wheel.next_tick(), Some(1000));
        assert_eq!(fire_all(&mut wheel, &mut nodes, 1000), vec![0]);
    }
}

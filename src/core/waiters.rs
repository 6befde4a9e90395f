//! Queued acquires: one node per waiter, threaded on two intrusive lists —
//! its key's FIFO queue (circular, so the tail is `head.queue_prev`) and
//! its connection's list (so closing a connection finds its waiters
//! without a scan). Every operation is O(1) and allocates nothing once the
//! node storage has grown.

use super::memory::NIL;
use crate::timer_wheel::TimerLinks;

/// A key's waiter queue as its lock-table entry keeps it, in one `u32`:
/// the head waiter's index, or — while nobody waits — the moment the
/// key's inline grant was made (see [`grant_time_ms`]), tagged by the top
/// bit. While the queue is not empty that moment lives in the head node
/// instead (see [`Waiter::queue_end`]). So an entry keeps the grant's
/// start for `H` at no cost in bytes (docs/DESIGN.md, "Time held").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct Queue(u32);

const EMPTY_TAG: u32 = 1 << 31;

impl Queue {
    /// An empty queue on a key granted at `grant_time` ([`grant_time_ms`]).
    pub const fn empty(grant_time: u32) -> Queue {
        Queue(EMPTY_TAG | grant_time)
    }

    /// The head waiter, if anyone waits.
    pub fn head(self) -> Option<u32> {
        (self.0 & EMPTY_TAG == 0).then_some(self.0)
    }

    pub fn is_empty(self) -> bool {
        self.0 & EMPTY_TAG != 0
    }

    /// A free lock-table entry keeps the next free entry here instead.
    pub(super) const fn free_link(next: u32) -> Queue {
        Queue(next)
    }

    pub(super) fn as_free_link(self) -> u32 {
        self.0
    }
}

/// A grant instant as a [`Queue`] keeps it: milliseconds since the core's
/// epoch, rounded *up*, modulo 2³¹.
pub fn grant_time_ms(at: u64) -> u32 {
    at.div_ceil(1_000) as u32 & !EMPTY_TAG
}

/// The grant time ([`grant_time_ms`]) of a grant held `held_ms` at the
/// core's instant 0: a restored grant (spec §7.5), modulo 2³¹ like any.
pub fn grant_time_before_start(held_ms: u32) -> u32 {
    0u32.wrapping_sub(held_ms) & !EMPTY_TAG
}

/// Whole milliseconds from `grant_time` ([`grant_time_ms`]) to `now`,
/// rounded down: the clock rounded down minus the grant rounded up never
/// exceeds the true time, and is at most one short of it. Within the same
/// millisecond that difference is −1, which wraps to 2³¹ − 1 and means 0.
/// Exact for any grant held less than 2³¹ − 1 ms (24.8 days).
pub fn held_ms(grant_time: u32, now: u64) -> u32 {
    let held = ((now / 1_000) as u32).wrapping_sub(grant_time) & !EMPTY_TAG;
    if held == !EMPTY_TAG { 0 } else { held }
}

/// A queued acquire.
#[derive(Clone, Debug)]
pub struct Waiter {
    pub owner: u64,
    /// The wait-deadline timer.
    pub timer: TimerLinks,
    /// The connection the acquire came from.
    pub conn: u32,
    /// The lock-table entry the waiter queues on.
    pub lock: u32,
    queue_prev: u32,
    queue_next: u32,
    conn_prev: u32,
    conn_next: u32,
    /// When it joined the queue (see `core::enqueued_at`), for the
    /// wait-time histogram.
    pub enqueued_at: u32,
    /// What the queue keeps at its ends: in the head node the key's grant
    /// time ([`Queue`]); in the tail node of a queue of two or more, the
    /// queue's length (a queue of one has length 1). Unused elsewhere.
    queue_end: u32,
    pub lease_s: u8,
    /// Permits asked for (spec §10); 0 = all (exclusive).
    pub take: u16,
}

/// Node storage for all waiters.
#[derive(Default)]
pub struct Waiters {
    nodes: Vec<Waiter>,
    free_head: u32,
    len: usize,
}

/// The waiter list of one connection.
#[derive(Clone, Copy, Debug)]
pub struct ConnWaiters {
    pub head: u32,
    pub len: u32,
}

impl Default for ConnWaiters {
    fn default() -> Self {
        ConnWaiters { head: NIL, len: 0 }
    }
}

impl Waiters {
    pub fn new() -> Waiters {
        Waiters {
            nodes: Vec::new(),
            free_head: NIL,
            len: 0,
        }
    }

    /// How many waiters are queued in all.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, index: u32) -> &Waiter {
        &self.nodes[index as usize]
    }

    pub fn get_mut(&mut self, index: u32) -> &mut Waiter {
        &mut self.nodes[index as usize]
    }

    /// The length of `queue`.
    pub fn queue_len(&self, queue: Queue) -> u32 {
        match queue.head() {
            None => 0,
            Some(head) => {
                let tail = self.nodes[head as usize].queue_prev;
                if tail == head {
                    1
                } else {
                    self.nodes[tail as usize].queue_end
                }
            }
        }
    }

    /// When the grant of `queue`'s key was made ([`grant_time_ms`]).
    pub fn grant_time(&self, queue: Queue) -> u32 {
        match queue.head() {
            None => queue.0 & !EMPTY_TAG,
            Some(head) => self.nodes[head as usize].queue_end,
        }
    }

    /// Records that the grant of `queue`'s key was made at `grant_time`
    /// ([`grant_time_ms`]).
    pub fn set_grant_time(&mut self, queue: &mut Queue, grant_time: u32) {
        match queue.head() {
            None => *queue = Queue::empty(grant_time),
            Some(head) => self.nodes[head as usize].queue_end = grant_time,
        }
    }

    /// Appends a waiter at the tail of `queue` and at the head of its
    /// connection's list.
    #[allow(clippy::too_many_arguments)]
    pub fn push_back(
        &mut self,
        queue: &mut Queue,
        conn_list: &mut ConnWaiters,
        conn: u32,
        lock: u32,
        owner: u64,
        lease_s: u8,
        take: u16,
    ) -> u32 {
        let node = Waiter {
            owner,
            timer: TimerLinks::UNARMED,
            conn,
            lock,
            queue_prev: NIL,
            queue_next: NIL,
            conn_prev: NIL,
            conn_next: conn_list.head,
            enqueued_at: 0,
            queue_end: 0,
            lease_s,
            take,
        };
        let index = if self.free_head != NIL {
            let index = self.free_head;
            self.free_head = self.nodes[index as usize].queue_next;
            self.nodes[index as usize] = node;
            index
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        };
        if let Some(head) = queue.head() {
            let len = self.queue_len(*queue);
            let tail = self.nodes[head as usize].queue_prev;
            self.nodes[index as usize].queue_prev = tail;
            self.nodes[index as usize].queue_next = head;
            self.nodes[tail as usize].queue_next = index;
            self.nodes[head as usize].queue_prev = index;
            self.nodes[index as usize].queue_end = len + 1;
        } else {
            let node = &mut self.nodes[index as usize];
            node.queue_prev = index;
            node.queue_next = index;
            node.queue_end = queue.0 & !EMPTY_TAG;
            *queue = Queue(index);
        }
        if conn_list.head != NIL {
            self.nodes[conn_list.head as usize].conn_prev = index;
        }
        conn_list.head = index;
        conn_list.len += 1;
        self.len += 1;
        index
    }

    /// Unlinks waiter `index` from `queue` and from its connection's
    /// list, and frees the node. The caller has disarmed its timer.
    pub fn remove(&mut self, index: u32, queue: &mut Queue, conn_list: &mut ConnWaiters) {
        let node = self.nodes[index as usize].clone();
        debug_assert!(!node.timer.is_armed());
        match queue.head() {
            Some(head) if node.queue_next != index => {
                let len = self.queue_len(*queue);
                let grant_time = self.nodes[head as usize].queue_end;
                let tail = self.nodes[head as usize].queue_prev;
                self.nodes[node.queue_prev as usize].queue_next = node.queue_next;
                self.nodes[node.queue_next as usize].queue_prev = node.queue_prev;
                let head = if head == index { node.queue_next } else { head };
                let tail = if tail == index { node.queue_prev } else { tail };
                // The tail first: in a queue left with one node it is the
                // head, which keeps the grant time.
                self.nodes[tail as usize].queue_end = len - 1;
                self.nodes[head as usize].queue_end = grant_time;
                *queue = Queue(head);
            }
            // The only waiter.
            _ => *queue = Queue::empty(node.queue_end),
        }
        if node.conn_prev != NIL {
            self.nodes[node.conn_prev as usize].conn_next = node.conn_next;
        } else {
            conn_list.head = node.conn_next;
        }
        if node.conn_next != NIL {
            self.nodes[node.conn_next as usize].conn_prev = node.conn_prev;
        }
        conn_list.len -= 1;
        let freed = &mut self.nodes[index as usize];
        freed.queue_next = self.free_head;
        freed.queue_prev = NIL;
        self.free_head = index;
        self.len -= 1;
        if self.len == 0 && self.nodes.capacity() > 4096 {
            self.nodes = Vec::new();
            self.free_head = NIL;
        }
    }

    /// The waiter after `index` in its connection's list.
    pub fn next_of_conn(&self, index: u32) -> u32 {
        self.nodes[index as usize].conn_next
    }

    /// The waiters of one queue, head first.
    pub fn queue(&self, queue: Queue) -> impl Iterator<Item = u32> + '_ {
        let mut at = queue.0;
        let mut remaining = self.queue_len(queue);
        std::iter::from_fn(move || {
            if remaining == 0 {
                return None;
            }
            remaining -= 1;
            let index = at;
            at = self.nodes[index as usize].queue_next;
            Some(index)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiter_stays_56_bytes() {
        // The enqueue instant, the take and the key's grant time live in
        // what was padding.
        assert_eq!(std::mem::size_of::<Waiter>(), 56);
    }

    #[test]
    fn fifo_with_removal_from_middle_and_head() {
        let mut waiters = Waiters::new();
        let mut queue = Queue::empty(1234);
        let mut conn_a = ConnWaiters::default();
        let mut conn_b = ConnWaiters::default();
        let w: Vec<u32> = (0..5)
            .map(|i| {
                let conn = if i % 2 == 0 { &mut conn_a } else { &mut conn_b };
                waiters.push_back(&mut queue, conn, (i % 2) as u32, 0, i, 1, 0)
            })
            .collect();
        assert_eq!(waiters.queue(queue).collect::<Vec<_>>(), w);
        assert_eq!(waiters.queue_len(queue), 5);
        waiters.remove(w[2], &mut queue, &mut conn_a);
        waiters.remove(w[0], &mut queue, &mut conn_a);
        assert_eq!(
            waiters.queue(queue).collect::<Vec<_>>(),
            vec![w[1], w[3], w[4]]
        );
        assert_eq!(waiters.queue_len(queue), 3);
        assert_eq!(conn_a.len, 1);
        assert_eq!(conn_a.head, w[4]);
        let reused = waiters.push_back(&mut queue, &mut conn_a, 0, 0, 9, 1, 0);
        assert!(reused == w[0] || reused == w[2]);
        assert_eq!(
            waiters.queue(queue).collect::<Vec<_>>(),
            vec![w[1], w[3], w[4], reused]
        );
        for index in [w[1], w[3]] {
            waiters.remove(index, &mut queue, &mut conn_b);
        }
        for index in [w[4], reused] {
            waiters.remove(index, &mut queue, &mut conn_a);
        }
        assert_eq!(queue, Queue::empty(1234));
        assert!(waiters.is_empty());
        assert_eq!(
            (conn_a.head, conn_a.len, conn_b.head, conn_b.len),
            (NIL, 0, NIL, 0)
        );
    }

    #[test]
    fn the_grant_time_follows_the_head_and_returns_to_the_entry() {
        let mut waiters = Waiters::new();
        let mut conn = ConnWaiters::default();
        let mut queue = Queue::empty(grant_time_ms(5_000));
        assert_eq!(waiters.grant_time(queue), 5);
        let first = waiters.push_back(&mut queue, &mut conn, 0, 0, 1, 1, 0);
        let second = waiters.push_back(&mut queue, &mut conn, 0, 0, 2, 1, 0);
        assert_eq!(queue.head(), Some(first));
        assert_eq!(waiters.grant_time(queue), 5);
        // A hand-over: the new grant's time is set, then its waiter leaves.
        waiters.set_grant_time(&mut queue, grant_time_ms(9_000_001));
        waiters.remove(first, &mut queue, &mut conn);
        assert_eq!(queue.head(), Some(second));
        assert_eq!(waiters.grant_time(queue), 9_001);
        waiters.remove(second, &mut queue, &mut conn);
        assert_eq!(queue, Queue::empty(9_001));
        assert!(queue.is_empty() && queue.head().is_none());
    }

    #[test]
    fn held_ms_rounds_down_and_wraps_at_2_31_ms() {
        let granted = grant_time_ms(1_500); // rounded up to 2 ms
        assert_eq!(held_ms(granted, 1_999), 0);
        assert_eq!(held_ms(granted, 2_000), 0);
        assert_eq!(held_ms(granted, 3_999), 1);
        let day = 86_400_000_000;
        assert_eq!(held_ms(granted, 1_500 + 24 * day), 24 * 86_400_000 - 1);
        // Past 2³¹ ms the stored time has wrapped: exact only below it.
        let wrapped = 1_500 + (1u64 << 31) * 1_000 + 7_000;
        assert_eq!(held_ms(granted, wrapped), 6);
        assert!(grant_time_ms(u64::MAX / 2) & EMPTY_TAG == 0);
    }

    #[test]
    fn length_and_grant_time_stay_right_under_any_removal_order() {
        // A model (a Vec per queue) against the node storage, over many
        // pseudo-random pushes, removals anywhere and grant-time changes.
        let mut waiters = Waiters::new();
        let mut conn = ConnWaiters::default();
        let mut queues = [Queue::empty(0), Queue::empty(1), Queue::empty(2)];
        let mut model: [(Vec<u32>, u32); 3] = [(vec![], 0), (vec![], 1), (vec![], 2)];
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        for step in 0..20_000u32 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let which = (seed % 3) as usize;
            let (members, time) = &mut model[which];
            match (seed >> 8) % 5 {
                0 | 1 => {
                    let index = waiters.push_back(&mut queues[which], &mut conn, 0, 0, 0, 1, 0);
                    members.push(index);
                }
                2 | 3 if !members.is_empty() => {
                    let at = (seed >> 16) as usize % members.len();
                    let index = members.remove(at);
                    waiters.remove(index, &mut queues[which], &mut conn);
                }
                _ => {
                    *time = step & 0x7fff_ffff;
                    waiters.set_grant_time(&mut queues[which], *time);
                }
            }
            for (queue, (members, time)) in queues.iter().zip(&model) {
                assert_eq!(waiters.queue(*queue).collect::<Vec<_>>(), *members);
                assert_eq!(waiters.queue_len(*queue) as usize, members.len());
                assert_eq!(waiters.grant_time(*queue), *time);
                assert_eq!(queue.is_empty(), members.is_empty());
            }
        }
    }
}

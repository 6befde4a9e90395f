//! Queued acquires: one node per waiter, threaded on two intrusive lists —
//! its key's FIFO queue (circular, so the tail is `head.queue_prev`) and
//! its connection's list (so closing a connection finds its waiters
//! without a scan). Every operation is O(1) and allocates nothing once the
//! node storage has grown.

use super::lock_table::NIL;
use super::timer_wheel::TimerLinks;

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
    /// The queue's length; kept up to date on the head node only.
    queue_len: u32,
    /// When it joined the queue (see `core::enqueued_at`), for the
    /// wait-time histogram.
    pub enqueued_at: u32,
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

    /// The length of the queue whose head is `head`.
    pub fn queue_len(&self, head: u32) -> u32 {
        if head == NIL {
            0
        } else {
            self.nodes[head as usize].queue_len
        }
    }

    /// Appends a waiter at the tail of the queue `queue` (a head index) and
    /// at the head of its connection's list.
    #[allow(clippy::too_many_arguments)]
    pub fn push_back(
        &mut self,
        queue: &mut u32,
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
            queue_len: 0,
            enqueued_at: 0,
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
        if *queue == NIL {
            let node = &mut self.nodes[index as usize];
            node.queue_prev = index;
            node.queue_next = index;
            node.queue_len = 1;
            *queue = index;
        } else {
            let head = *queue;
            let tail = self.nodes[head as usize].queue_prev;
            self.nodes[index as usize].queue_prev = tail;
            self.nodes[index as usize].queue_next = head;
            self.nodes[tail as usize].queue_next = index;
            self.nodes[head as usize].queue_prev = index;
            self.nodes[head as usize].queue_len += 1;
        }
        if conn_list.head != NIL {
            self.nodes[conn_list.head as usize].conn_prev = index;
        }
        conn_list.head = index;
        conn_list.len += 1;
        self.len += 1;
        index
    }

    /// Unlinks waiter `index` from its queue (`queue` is that queue's head)
    /// and from its connection's list, and frees the node. The caller has
    /// disarmed its timer.
    pub fn remove(&mut self, index: u32, queue: &mut u32, conn_list: &mut ConnWaiters) {
        let node = self.nodes[index as usize].clone();
        debug_assert!(!node.timer.is_armed());
        if node.queue_next == index {
            *queue = NIL;
        } else {
            self.nodes[node.queue_prev as usize].queue_next = node.queue_next;
            self.nodes[node.queue_next as usize].queue_prev = node.queue_prev;
            if *queue == index {
                *queue = node.queue_next;
                self.nodes[node.queue_next as usize].queue_len = node.queue_len - 1;
            } else {
                self.nodes[*queue as usize].queue_len -= 1;
            }
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
    pub fn queue(&self, head: u32) -> impl Iterator<Item = u32> + '_ {
        let mut at = head;
        let mut remaining = self.queue_len(head);
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
        // The enqueue instant and the take live in what was padding.
        assert_eq!(std::mem::size_of::<Waiter>(), 56);
    }

    #[test]
    fn fifo_with_removal_from_middle_and_head() {
        let mut waiters = Waiters::new();
        let mut queue = NIL;
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
        assert_eq!(queue, NIL);
        assert!(waiters.is_empty());
        assert_eq!(
            (conn_a.head, conn_a.len, conn_b.head, conn_b.len),
            (NIL, 0, NIL, 0)
        );
    }
}

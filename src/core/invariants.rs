//! The core's self-check, run by tests and simulations after every step.

use super::Core;
use super::lock_table::NIL;

impl Core {
    /// Asserts the consistency of every internal structure: each key found
    /// by its own name and leased, each queue and connection list linked and
    /// counted right, every waiter armed and on an open connection, every
    /// armed timer accounted for. A bug then fails here rather than in a
    /// later, unrelated answer; simulations call it after every step.
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let mut entries = 0;
        let mut unknown = 0;
        let mut queued = 0;
        for entry in self.table.live_indices() {
            entries += 1;
            let held = self.table.get(entry);
            let key = self.table.key(entry);
            assert_eq!(
                self.table.find(key, self.table.hash(key)),
                Some(entry),
                "key {key:?} not found by name"
            );
            assert!(held.lease.is_armed(), "key {key:?} has no lease timer");
            if held.token == 0 {
                unknown += 1;
                assert_ne!(
                    held.waiters, NIL,
                    "key {key:?} held by an unknown grant and waited on by nobody"
                );
            } else {
                assert!(
                    held.token < self.next_token,
                    "key {key:?} has token {} ≥ next {}",
                    { held.token },
                    self.next_token
                );
            }
            let mut length = 0;
            for waiter in self.waiters.queue(held.waiters) {
                length += 1;
                let node = self.waiters.get(waiter);
                assert_eq!(
                    node.lock, entry,
                    "waiter {waiter} of key {key:?} points elsewhere"
                );
                assert!(
                    node.timer.is_armed(),
                    "waiter {waiter} of key {key:?} has no deadline timer"
                );
                assert!(
                    self.conns[node.conn as usize].open,
                    "waiter {waiter} on a closed connection"
                );
            }
            assert_eq!(
                length,
                self.waiters.queue_len(held.waiters),
                "queue length of key {key:?}"
            );
            queued += length as usize;
        }
        assert_eq!(entries, self.table.len(), "live entries vs table length");
        assert_eq!(unknown, self.unknown_holders, "unknown holders");
        assert_eq!(queued, self.waiters.len(), "queued waiters vs waiter count");
        let mut open = 0;
        let mut listed = 0;
        for (conn, state) in self.conns.iter().enumerate() {
            open += usize::from(state.open);
            let mut length = 0;
            let mut waiter = state.waiters.head;
            while waiter != NIL {
                length += 1;
                assert_eq!(
                    self.waiters.get(waiter).conn as usize,
                    conn,
                    "waiter {waiter} on the wrong connection list"
                );
                assert!(
                    length <= self.waiters.len(),
                    "connection {conn}'s waiter list loops"
                );
                waiter = self.waiters.next_of_conn(waiter);
            }
            assert_eq!(
                length as u32, state.waiters.len,
                "waiter count of connection {conn}"
            );
            assert!(
                state.open || length == 0,
                "closed connection {conn} still has waiters"
            );
            listed += length;
        }
        assert_eq!(open, self.connections, "open connections");
        assert_eq!(listed, self.waiters.len(), "waiters on connection lists");
        assert_eq!(
            self.wheel.len(),
            entries + queued,
            "armed timers vs leases and waiters"
        );
    }
}

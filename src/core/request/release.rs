//! `R` (spec §5): release the exact token, hand the key on.

use crate::core::{ConnId, Core, Micros};
use crate::protocol::Response;

impl Core {
    pub(in crate::core) fn release(&mut self, conn: ConnId, key: &str, token: u64, now: Micros) {
        let entry = match self.active_grant(key, token) {
            Some(entry) => entry,
            // Not this run's grant: maybe an earlier run's (spec §7.3),
            // which answered already unless a key is left to hand on.
            None => match self.release_earlier_token(conn, key, token, now) {
                Some(entry) => entry,
                None => return,
            },
        };
        self.cancel_lease(entry);
        self.stats.released += 1;
        self.outbox.push((conn, Response::Released { token }));
        self.hand_over(entry, now);
    }
}

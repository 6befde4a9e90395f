//! `R` (spec §5, §10.5): release the exact token; the key goes on to its
//! waiters.

use crate::core::{ConnId, Core, Held, Micros};
use crate::protocol::Response;

impl Core {
    pub(in crate::core) fn release(&mut self, conn: ConnId, key: &str, token: u64, now: Micros) {
        let entry = match self.find_grant(key, token) {
            Some(Held::Inline(entry)) => entry,
            Some(Held::Listed { entry, grant }) => {
                // Only this grant's permits are freed.
                self.end_grant(entry, grant);
                self.stats.released += 1;
                self.outbox.push((conn, Response::Released { token }));
                return self.scan_permits(entry, now);
            }
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

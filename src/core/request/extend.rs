//! `E` (spec §5): a new lease for the exact token.

use crate::core::{ConnId, Core, MICROS_PER_S, Micros};
use crate::protocol::Response;

impl Core {
    pub(in crate::core) fn extend(
        &mut self,
        conn: ConnId,
        key: &str,
        token: u64,
        lease_s: u8,
        now: Micros,
    ) {
        let entry = match self.active_grant(key, token) {
            Some(entry) => entry,
            // Not this run's grant: maybe an earlier run's (spec §7.3),
            // which answered `N` already unless it was adopted.
            None => match self.adopt_earlier_token(conn, key, token, now) {
                Some(entry) => entry,
                None => return,
            },
        };
        self.arm_lease_at(entry, now + u64::from(lease_s) * MICROS_PER_S);
        self.stats.extended += 1;
        self.outbox.push((conn, Response::Extended { token }));
    }
}

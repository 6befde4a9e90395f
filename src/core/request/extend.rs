//! `E` (spec §5, §10.5): a new lease for the exact token.

use crate::core::{ConnId, Core, Held, MICROS_PER_S, Micros};
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
        let deadline = now + u64::from(lease_s) * MICROS_PER_S;
        if self
            .ceiling
            .is_some_and(|ceiling| deadline > ceiling.horizon)
        {
            // Spec §7.6: a lease the state file cannot promise. `B`, with
            // the token `E` is answered by; nothing changed.
            self.stats.busy += 1;
            self.outbox.push((conn, Response::Busy { owner: token }));
            return;
        }
        match self.find_grant(key, token) {
            Some(Held::Inline(entry)) => self.arm_lease_at(entry, deadline),
            Some(Held::Listed { grant, .. }) => self.arm_grant_lease_at(grant, deadline),
            // Not this run's grant: maybe an earlier run's (spec §7.3),
            // which answered already unless it was adopted inline.
            None => match self.adopt_earlier_token(conn, key, token, deadline, now) {
                Some(entry) => {
                    // Held (as far as `H` shows) since its adoption.
                    self.set_grant_time(entry, now);
                    self.arm_lease_at(entry, deadline)
                }
                None => return,
            },
        }
        self.stats.extended += 1;
        self.outbox.push((conn, Response::Extended { token }));
    }
}

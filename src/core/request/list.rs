//! `L` (spec §11.3): one page of the keys in the table, walked in entry
//! order with the next entry index as the cursor. docs/DESIGN.md ("Listing
//! keys") has the argument that every key in the table throughout a
//! listing is returned.

use crate::core::access::Scopes;
use crate::core::permits::PERMITS;
use crate::core::{ConnId, Core, Micros};
use crate::protocol::Response;

use super::{ANSWER_BYTES_MAX, KEY_FRAME_FIXED};

/// One `L` examines at most this many entry slots per frame it may send.
pub const SLOTS_PER_FRAME: usize = 16;

impl Core {
    /// With `within`, keys outside those scopes are skipped like keys
    /// outside `prefix`: they count as examined, so the cursor means the
    /// same with and without them.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::core) fn list(
        &mut self,
        conn: ConnId,
        id: u64,
        cursor: u64,
        count: u16,
        prefix: &str,
        within: Option<&Scopes>,
        now: Micros,
    ) {
        // Leases that ran out by `now` end first, so the counts are live.
        self.handle_timeout(now);
        self.stats.lists += 1;
        let slots = self.table.slots();
        let budget = SLOTS_PER_FRAME * usize::from(count);
        // A cursor past the slots (stale: the table emptied, which frees
        // its storage) ends the listing.
        let mut at = usize::try_from(cursor).unwrap_or(usize::MAX);
        let mut examined = 0;
        let mut sent = 0u32;
        let mut bytes = 0usize;
        while at < slots && examined < budget && sent < u32::from(count) {
            let entry = at as u32;
            examined += 1;
            if !self.table.is_live(entry) {
                at += 1;
                continue;
            }
            let key = self.table.key(entry);
            if !key.starts_with(prefix) || within.is_some_and(|scopes| !scopes.lists(key)) {
                at += 1;
                continue;
            }
            let size = KEY_FRAME_FIXED + key.len();
            if bytes + size > ANSWER_BYTES_MAX {
                // The page is full (spec §4): the next one starts at this
                // key. At least one frame was sent, so the cursor moved.
                break;
            }
            bytes += size;
            at += 1;
            let held = self.table.get(entry);
            let (grants, limit) = if held.token == PERMITS {
                let permits = self.permit_key(entry);
                let grants = permits.grants.len() + usize::from(permits.unknown);
                (u32::try_from(grants).unwrap_or(u32::MAX), permits.limit)
            } else {
                // One grant: this run's, or the unknown one (token 0).
                (1, 0)
            };
            let frame = Response::Key {
                id,
                grants,
                waiters: self.waiters.queue_len(held.waiters),
                limit,
                key: key.to_owned(),
            };
            self.outbox.push((conn, frame));
            sent += 1;
        }
        self.work += examined as u64;
        // `at` ≥ 1 whenever a frame was sent or a slot passed over, so a
        // continuing cursor is never 0, which means "done".
        let next = if at < slots { at as u64 } else { 0 };
        self.outbox.push((
            conn,
            Response::End {
                id,
                count: sent,
                next,
            },
        ));
    }
}

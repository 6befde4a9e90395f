//! `C` (spec §13.4a): the label of the exact grant `token` of a key
//! becomes the proclaimed one. Nothing else changes: not the lease, not
//! the grant time, not the queue. A leader changes its value this way
//! without losing its term, and a holder whose grant was adopted after a
//! crash restores its label (§7.5).

use crate::core::labels::LabelOf;
use crate::core::{ConnId, Core, Held, Micros};
use crate::protocol::Response;

impl Core {
    pub(in crate::core) fn proclaim(
        &mut self,
        conn: ConnId,
        key: &str,
        token: u64,
        label: &str,
        now: Micros,
    ) {
        let of = match self.find_grant(key, token) {
            Some(Held::Inline(entry)) => LabelOf::Entry(entry),
            Some(Held::Listed { grant, .. }) => LabelOf::Grant(grant),
            // Not a grant of this key (an earlier run's token included:
            // a `C` adopts nothing).
            None => {
                self.stats.proclaim_not_held += 1;
                return self.not_held(conn, token);
            }
        };
        let changed = self.labels.get(of) != label;
        if changed {
            self.labels.take(of);
            self.labels.set(of, label);
        }
        self.stats.proclaimed += 1;
        self.outbox.push((conn, Response::Proclaimed { token }));
        if changed {
            self.wake_watches_on_label(key, token, now);
        }
    }
}

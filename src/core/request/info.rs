//! `I` (spec §2.2, §10.9): the server's counters as one text line.

use std::fmt::Write as _;

use crate::core::{Core, MICROS_PER_S, Micros};

impl Core {
    /// The `I` line: `name=value` pairs separated by single spaces.
    pub fn info_text(&self, now: Micros) -> String {
        let s = &self.stats;
        let mut text = String::with_capacity(320);
        let _ = write!(
            text,
            "version={} uptime_s={} connections={} keys={} held={} waiters={} \
             grants={} timeouts={} busy={} expired={} released={} extended={} \
             not_held={} errors={} refused={} grants_held={} next_token={} auth_failures={} watches={} state_errors={}",
            env!("CARGO_PKG_VERSION"),
            now / MICROS_PER_S,
            self.connections,
            self.table.len(),
            self.held(),
            self.waiters.len(),
            s.grants,
            s.timeouts,
            s.busy,
            s.expired,
            s.released,
            s.extended,
            s.not_held,
            s.errors,
            s.refused,
            self.grants_held,
            self.next_token,
            s.auth_failures,
            self.watches.len(),
            s.state_errors,
        );
        text
    }
}

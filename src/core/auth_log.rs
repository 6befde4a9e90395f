//! Which `authentication failed` lines to write (spec §12.2), bounded in
//! memory and in lines however many peer addresses fail: each peer gets at
//! most one line per [`AUTH_FAILURE_LOG_EVERY_US`], at most
//! [`LINES_PER_INTERVAL`] peers get one per interval, and every failure
//! past those is counted in an overflow bucket, written as one line per
//! interval with its count. The `auth_failures` counter stays exact. No IO:
//! the endpoint writes the lines this returns.

use std::collections::HashMap;
use std::net::IpAddr;

use crate::core::Micros;

/// At most one line per peer address per this long; the next line says
/// how many were not logged.
pub const AUTH_FAILURE_LOG_EVERY_US: Micros = 60_000_000;

/// Peers logged one by one per interval; failures of further peers go to
/// the overflow bucket.
pub const LINES_PER_INTERVAL: usize = 64;

/// Peers remembered at most (each logged within the last interval).
const PEERS_MAX: usize = 1024;

#[derive(Debug, Default)]
pub struct AuthFailureLog {
    /// When each peer was last logged, and how many of its failures came
    /// since.
    peers: HashMap<Option<IpAddr>, (Micros, u64)>,
    /// The interval under way: its start, and the per-peer lines written
    /// in it.
    interval_start: Micros,
    lines: usize,
    /// Failures not logged by peer since the last overflow line, and when
    /// that line was written.
    overflow: u64,
    overflow_logged_at: Option<Micros>,
}

impl AuthFailureLog {
    /// A connection from `peer` failed to authenticate at `now`: the lines
    /// to write (none, one, or an overflow line and one).
    pub fn record(&mut self, peer: Option<IpAddr>, now: Micros) -> Vec<String> {
        let mut out = Vec::new();
        if now >= self.interval_start + AUTH_FAILURE_LOG_EVERY_US {
            self.interval_start = now;
            self.lines = 0;
            // A quiet peer is forgotten; one with failures not yet logged
            // is kept for the count its next line gives.
            self.peers.retain(|_, &mut (logged_at, since)| {
                since > 0 || now < logged_at + AUTH_FAILURE_LOG_EVERY_US
            });
        }
        let name = match peer {
            Some(ip) => format!("peer {ip}"),
            None => "peer on a unix socket".to_owned(),
        };
        if let Some((logged_at, since)) = self.peers.get_mut(&peer) {
            if now < *logged_at + AUTH_FAILURE_LOG_EVERY_US {
                *since += 1;
                return out;
            }
            let unlogged = std::mem::take(since);
            *logged_at = now;
            out.push(format!(
                "authentication failed: {name}; connection closed; \
                 {unlogged} more from this peer since the last line were not logged"
            ));
            return out;
        }
        if self.lines >= LINES_PER_INTERVAL || self.peers.len() >= PEERS_MAX {
            self.overflow += 1;
            if self
                .overflow_logged_at
                .is_none_or(|at| now >= at + AUTH_FAILURE_LOG_EVERY_US)
            {
                out.push(format!(
                    "authentication failed: {} from other peers, each not logged \
                     (more than {LINES_PER_INTERVAL} peers failed within a minute); \
                     the next such line comes at most a minute from now",
                    std::mem::take(&mut self.overflow)
                ));
                self.overflow_logged_at = Some(now);
            }
            return out;
        }
        self.lines += 1;
        self.peers.insert(peer, (now, 0));
        out.push(format!(
            "authentication failed: {name}; connection closed \
             (the next failure from this peer within a minute is not logged)"
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loopback(n: u32) -> Option<IpAddr> {
        Some(IpAddr::V4(std::net::Ipv4Addr::from(0x7f00_0000 | n)))
    }

    #[test]
    fn twenty_thousand_distinct_peers_write_at_most_100_lines() {
        let mut log = AuthFailureLog::default();
        let mut lines = Vec::new();
        for n in 0..20_000 {
            lines.extend(log.record(loopback(n + 1), 1_000_000 + u64::from(n) * 35));
        }
        assert!(lines.len() <= 100, "{} lines", lines.len());
        assert_eq!(lines.len(), LINES_PER_INTERVAL + 1);
        assert!(lines[LINES_PER_INTERVAL].contains(": 1 from other peers"));
        assert!(log.peers.len() <= LINES_PER_INTERVAL);
        // A minute later the bucket's count comes in one line.
        let later = 2_000_000 + AUTH_FAILURE_LOG_EVERY_US;
        let next = log.record(loopback(30_000), later);
        assert_eq!(next.len(), 1);
        assert!(next[0].contains("peer 127.0.117.48"), "{next:?}");
        let mut bucket = Vec::new();
        for n in 0..LINES_PER_INTERVAL as u32 {
            bucket.extend(log.record(loopback(40_000 + n), later + 1));
        }
        assert_eq!(bucket.len(), LINES_PER_INTERVAL - 1 + 1);
        assert!(
            bucket[LINES_PER_INTERVAL - 1].contains(&format!(
                ": {} from other peers",
                20_000 - LINES_PER_INTERVAL
            )),
            "{bucket:?}"
        );
    }

    #[test]
    fn one_peer_gets_one_line_per_interval_with_the_count_since() {
        let mut log = AuthFailureLog::default();
        let peer = loopback(1);
        assert_eq!(log.record(peer, 0).len(), 1);
        for at in 1..50 {
            assert_eq!(log.record(peer, at), Vec::<String>::new());
        }
        let line = log.record(peer, AUTH_FAILURE_LOG_EVERY_US);
        assert_eq!(line.len(), 1);
        assert!(line[0].contains("; 49 more from this peer"), "{line:?}");
    }
}

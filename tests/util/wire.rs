//! The sans-IO endpoint on a fake clock, driven as the shell drives it:
//! bytes in, bytes out, timers fired at exactly the instant asked.

use kunci::core::endpoint::{Action, Endpoint};
use kunci::core::{ConnId, Core, Limits, Micros};

use super::fake::FIRST_TOKEN;

pub struct Wire {
    pub endpoint: Endpoint,
    pub now: Micros,
}

impl Wire {
    pub fn new() -> Wire {
        Wire::with(Limits::default())
    }

    pub fn with(limits: Limits) -> Wire {
        Wire {
            endpoint: Endpoint::new(Core::new(limits, FIRST_TOKEN), Vec::new()),
            now: 0,
        }
    }

    pub fn connect(&mut self, id: ConnId) {
        self.endpoint.accept(id, None, self.now);
    }

    pub fn send(&mut self, id: ConnId, bytes: &[u8]) {
        self.endpoint.handle_read(id, bytes, self.now);
        self.endpoint.check_invariants();
    }

    /// Moves the clock to `now` and fires what is due.
    pub fn at(&mut self, now: Micros) {
        assert!(now >= self.now);
        self.now = now;
        // As the shell: again at once while the core has work due (its
        // budget per turn may leave some).
        loop {
            self.endpoint.handle_timeout(now);
            self.endpoint.check_invariants();
            if self
                .endpoint
                .core()
                .poll_timeout()
                .is_none_or(|due| due > now)
            {
                break;
            }
        }
    }

    /// Everything `id` has to send, the socket taking it all.
    pub fn recv(&mut self, id: ConnId) -> Vec<u8> {
        let mut all = Vec::new();
        while let Some(bytes) = self.endpoint.transmit(id) {
            all.extend_from_slice(bytes);
            let n = bytes.len();
            self.endpoint.handle_written(id, n, self.now);
        }
        self.endpoint.check_invariants();
        all
    }

    pub fn exchange(&mut self, id: ConnId, bytes: &[u8]) -> Vec<u8> {
        self.send(id, bytes);
        self.recv(id)
    }

    pub fn actions(&mut self) -> Vec<(ConnId, Action)> {
        std::iter::from_fn(|| self.endpoint.poll_action()).collect()
    }
}

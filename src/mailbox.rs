//! A channel for the few values handed between threads off the request
//! path (`kunci run`'s events, `kunci leader --watch`'s changes, the etcd
//! client's notes to its keep-alive thread): a queue under a mutex, with
//! the semantics of `std::sync::mpsc::channel` that kunci uses (sends fail
//! once the receiver is gone; receives fail once every sender is gone and
//! the queue is empty). std's channel carries three implementations into
//! every element type it is used with (~13 KB each); this one is a few
//! hundred bytes (docs/BENCHMARKS.md, "Binary size").

use std::collections::VecDeque;
use std::sync::mpsc::{RecvError, RecvTimeoutError, SendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

struct State<T> {
    queue: VecDeque<T>,
    senders: usize,
    receiver: bool,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The sending side; clone it for more senders.
pub struct Sender<T>(Arc<Shared<T>>);

/// The receiving side.
pub struct Receiver<T>(Arc<Shared<T>>);

/// A new channel, unbounded.
pub fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            queue: VecDeque::new(),
            senders: 1,
            receiver: true,
        }),
        ready: Condvar::new(),
    });
    (Sender(shared.clone()), Receiver(shared))
}

impl<T> Sender<T> {
    /// Queues `value`, or gives it back when the receiver is gone.
    pub fn send(&self, value: T) -> Result<(), SendError<T>> {
        let mut state = self.0.lock();
        if !state.receiver {
            return Err(SendError(value));
        }
        state.queue.push_back(value);
        drop(state);
        self.0.ready.notify_one();
        Ok(())
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        self.0.lock().senders += 1;
        Sender(self.0.clone())
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.senders -= 1;
        if state.senders == 0 {
            drop(state);
            self.0.ready.notify_one();
        }
    }
}

impl<T> Receiver<T> {
    /// The next value, waiting for it; an error once it can never come.
    pub fn recv(&self) -> Result<T, RecvError> {
        let mut state = self.0.lock();
        loop {
            if let Some(value) = state.queue.pop_front() {
                return Ok(value);
            }
            if state.senders == 0 {
                return Err(RecvError);
            }
            state = self
                .0
                .ready
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The next value, waiting at most `timeout` for it.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<T, RecvTimeoutError> {
        let deadline = Instant::now().checked_add(timeout);
        let mut state = self.0.lock();
        loop {
            if let Some(value) = state.queue.pop_front() {
                return Ok(value);
            }
            if state.senders == 0 {
                return Err(RecvTimeoutError::Disconnected);
            }
            let left = match deadline {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => Duration::MAX,
            };
            if left.is_zero() {
                return Err(RecvTimeoutError::Timeout);
            }
            state = self
                .0
                .ready
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.receiver = false;
        // Values nobody will receive are dropped now, as std's are.
        let queued = std::mem::take(&mut state.queue);
        drop(state);
        drop(queued);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_arrive_in_order_and_the_ends_are_seen() {
        let (sender, receiver) = channel();
        let second = sender.clone();
        sender.send(1).unwrap();
        second.send(2).unwrap();
        assert_eq!(receiver.recv(), Ok(1));
        assert_eq!(receiver.recv_timeout(Duration::from_millis(1)), Ok(2));
        let start = Instant::now();
        assert_eq!(
            receiver.recv_timeout(Duration::from_millis(20)),
            Err(RecvTimeoutError::Timeout)
        );
        assert!(start.elapsed() >= Duration::from_millis(20));
        let thread = std::thread::spawn(move || second.send(3));
        assert_eq!(receiver.recv(), Ok(3));
        thread.join().unwrap().unwrap();
        drop(sender);
        assert_eq!(
            receiver.recv_timeout(Duration::from_secs(5)),
            Err(RecvTimeoutError::Disconnected)
        );
        assert_eq!(receiver.recv(), Err(RecvError));
        let (sender, receiver) = channel();
        drop(receiver);
        assert_eq!(sender.send(4), Err(SendError(4)));
    }
}

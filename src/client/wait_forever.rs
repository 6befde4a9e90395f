//! Waiting as long as it takes (spec §9 `--wait inf`): a policy over
//! single acquires of at most 255 s each, which also waits through a
//! server's restart or an outage. `kunci run --wait inf`, `kunci elect`
//! and [`Client::campaign`](super::Client::campaign) use it.

use std::time::{Duration, Instant};

use super::vocabulary::{Error, Unavailable, WAIT_MAX};
use super::{AcquireOptions, Client, Ticket};

impl Client {
    /// Takes the lock on `key` with a lease of `lease`, waiting as long as
    /// it takes (spec §9 `--wait inf`): each wire wait of 255 s that runs
    /// out queues again at the tail; a server that is shutting down or
    /// cannot be reached is asked again after a pause that doubles up to
    /// 2 s; after [`Error::Indeterminate`] the call's own grant, if the
    /// server has one, is released first (spec §8 rule 11). It ends only
    /// with a grant or an error that waiting cannot cure: an invalid
    /// argument, a capacity limit ([`Error::Busy`]), a refusal, a server
    /// that is not trusted. While no server answers it logs a warning
    /// after 10 s, then at doubling gaps (the command line's stderr), with
    /// the address and the last cause.
    pub fn acquire_forever(
        &self,
        key: &str,
        lease: Duration,
        options: impl Into<AcquireOptions>,
    ) -> Result<Ticket, Error> {
        acquire_until_granted(self, key, lease, &options.into(), WAIT_MAX)
    }
}

/// The longest pause between two attempts of `--wait inf` after a restart
/// or an outage (spec §9); each pause is taken ±25 % (`jitter.rs`).
const RETRY_PAUSE_MAX: Duration = Duration::from_secs(2);
/// The first such pause; it doubles up to [`RETRY_PAUSE_MAX`].
const RETRY_PAUSE_FIRST: Duration = Duration::from_millis(100);
/// How long after a `Busy` an `X 8` from the same server may still arrive:
/// a shutting-down server sends the two back to back.
const SHUTDOWN_NOTICE_WAIT: Duration = Duration::from_millis(200);

/// How long a wait forever hears from no server before it says so.
const SILENCE_FIRST_WORD: Duration = Duration::from_secs(10);
/// The longest gap between two such words; the gaps double up to it.
const SILENCE_WORD_GAP_MAX: Duration = Duration::from_secs(3600);

/// When a wait forever says that no server answers it (a cron job with a
/// mistyped address must not wait in silence): a warning in the log
/// (`kunci: warning: …` on the command line's stderr) once no server has
/// answered for 10 s, then after 20 s, 40 s, … of silence, the gaps
/// doubling up to an hour. Any answer ends the silence. Sans-IO: the
/// caller gives `now`.
#[derive(Debug)]
pub(crate) struct Silence {
    /// When the silence began: the wait's start, or the latest answer.
    since: Instant,
    /// How long after `since` the next word is due.
    next: Duration,
}

impl Silence {
    pub(crate) fn new(now: Instant) -> Silence {
        Silence {
            since: now,
            next: SILENCE_FIRST_WORD,
        }
    }

    /// A server answered at `now`.
    pub(crate) fn heard(&mut self, now: Instant) {
        *self = Silence::new(now);
    }

    /// An attempt found no server at `now`. The lines to log if a word is
    /// due: one per address whose name does not resolve (`unresolved`,
    /// each `address: why`), then one with the latest connection failure
    /// (`address: why`, if any).
    pub(crate) fn unheard(
        &mut self,
        now: Instant,
        key: &str,
        last_failure: Option<&str>,
        unresolved: &[String],
    ) -> Vec<String> {
        let silent = now.saturating_duration_since(self.since);
        if silent < self.next {
            return Vec::new();
        }
        let said = self.next;
        while self.next <= silent {
            self.next += self.next.min(SILENCE_WORD_GAP_MAX);
        }
        let mut lines: Vec<String> = unresolved
            .iter()
            .map(|name| {
                format!(
                    "waiting for {key:?} (--wait inf): the host name does not resolve: \
                     {name}. Check the address (--server, KUNCI_SERVER); still trying"
                )
            })
            .collect();
        let last = last_failure.map_or_else(
            || "no connection attempt failed, but nothing was answered".to_owned(),
            |why| format!("the last attempt: {why}"),
        );
        lines.push(format!(
            "waiting for {key:?} (--wait inf): no server has answered for {} s ({last}); \
             still trying",
            crate::decimal::seconds_shortest(said)
        ));
        lines
    }
}

/// Logs the word [`Silence::unheard`] has due, if any.
fn say_unheard(silence: &mut Silence, client: &Client, key: &str) {
    let failure = client.last_connect_failure();
    for line in silence.unheard(
        Instant::now(),
        key,
        failure.as_deref(),
        &client.unresolved_names(),
    ) {
        log::warn!("{line}");
    }
}

/// Acquires `key`, waiting `slice` at a time until it is granted (spec §9
/// `--wait inf`). Each attempt is a new request at the tail of the queue:
/// the place is not kept across attempts. `Timeout` queues again at once;
/// `Busy` from a server that is shutting down (its `X 8` follows the `B`)
/// and `Unavailable` are tried again after a pause that doubles up to 2 s;
/// after `Indeterminate` the call's own grant, if the server has one, is
/// released first (rule 11), then the key is asked for again. Every other
/// outcome, a `Busy` at a capacity limit included, ends the wait.
///
/// The first attempt, and each after one that reached no server, has a
/// wait of 0 (it ends by 5 s even when no server answers; one of a whole
/// slice would stay silent for 255 s + 5 s); once a server has answered,
/// attempts wait a whole slice. A wait of 0 takes no place in the queue,
/// so none is lost. While no server answers, the [`Silence`] rule says so
/// in the log.
pub(crate) fn acquire_until_granted(
    client: &Client,
    key: &str,
    lease: Duration,
    acquire: &AcquireOptions,
    slice: Duration,
) -> Result<Ticket, Error> {
    let mut pause = RETRY_PAUSE_FIRST;
    let mut silence = Silence::new(Instant::now());
    // Whether a server answered the latest attempt.
    let mut answering = false;
    loop {
        let owner = client.fresh_owner();
        let notices = client.shutdown_notices();
        let wait = if answering { slice } else { Duration::ZERO };
        match client.acquire_as(owner, key, wait, lease, acquire.clone()) {
            Err(Error::Timeout) => {
                log::debug!(
                    "{key}: still held after {} s; queueing again",
                    crate::decimal::seconds_shortest(wait)
                );
                silence.heard(Instant::now());
                answering = true;
                pause = RETRY_PAUSE_FIRST;
                continue;
            }
            Err(Error::Busy) if !server_shut_down(client, notices) => return Err(Error::Busy),
            Err(Error::Busy) => {
                log::debug!("{key}: the server is shutting down; asking again");
                silence.heard(Instant::now());
                answering = false;
            }
            // A certificate problem does not go away by waiting, nor does a
            // peer that speaks another protocol.
            Err(Error::Unavailable(
                why @ (Unavailable::Untrusted(_) | Unavailable::WrongProtocol(_)),
            )) => {
                return Err(Error::Unavailable(why));
            }
            Err(Error::Unavailable(why)) => {
                log::debug!("{key}: unavailable ({why:?}); asking again");
                answering = false;
                say_unheard(&mut silence, client, key);
            }
            Err(Error::Indeterminate) => {
                log::debug!("{key}: no answer in time; releasing this call's grant if any");
                say_unheard(&mut silence, client, key);
                release_own_grant(client, key, owner, &mut silence);
                answering = false;
            }
            outcome => return outcome,
        }
        super::jitter::sleep(pause);
        pause = (pause * 2).min(RETRY_PAUSE_MAX);
    }
}

/// Whether a server said it is shutting down since the count was
/// `notices`, waiting a moment for the `X 8` that follows a `B`.
fn server_shut_down(client: &Client, notices: u64) -> bool {
    let give_up = std::time::Instant::now() + SHUTDOWN_NOTICE_WAIT;
    loop {
        if client.shutdown_notices() != notices {
            return true;
        }
        if std::time::Instant::now() >= give_up {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Spec §8 rule 11: after an `Indeterminate` acquire, makes sure the call
/// holds nothing: ask for the key's holders (`H`) and release every grant
/// of the call's `owner`. Asks until the server answers (quietly, with the
/// same capped pauses, saying so as [`Silence`] has it), so that the next
/// attempt never queues behind its own lost grant.
fn release_own_grant(client: &Client, key: &str, owner: u64, silence: &mut Silence) {
    let mut pause = RETRY_PAUSE_FIRST;
    loop {
        match client.holders(key) {
            Ok(holders) => {
                silence.heard(Instant::now());
                let mut released = true;
                for grant in holders
                    .grants
                    .iter()
                    .filter(|g| g.owner == owner && g.token != 0)
                {
                    match client.release(key, grant.token) {
                        Ok(()) | Err(Error::NotHeld) => {}
                        Err(error) => {
                            log::debug!("{key}: releasing our grant: {error}");
                            released = false;
                        }
                    }
                }
                if released {
                    return;
                }
            }
            Err(Error::InvalidArgument(_)) => return,
            Err(error) => {
                log::debug!("{key}: asking who holds it: {error}");
                say_unheard(silence, client, key);
            }
        }
        super::jitter::sleep(pause);
        pause = (pause * 2).min(RETRY_PAUSE_MAX);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
    use std::time::Instant;

    use super::*;
    use crate::addr::Address;
    use crate::client::Config;
    use crate::server::{Config as ServerConfig, Server};

    #[test]
    fn waiting_forever_queues_again_each_time_a_wait_runs_out() {
        let listen = vec!["127.0.0.1:0".parse().unwrap()];
        let server = Server::bind(ServerConfig {
            listen,
            ..Default::default()
        })
        .unwrap();
        let address = server.addresses()[0].clone();
        let stop = server.shutdown_handle();
        let running = std::thread::spawn(move || server.run());
        let client = Client::new([address], Config::default()).unwrap();
        let holder = client
            .acquire("forever", Duration::ZERO, Duration::from_secs(30))
            .unwrap();
        let started = Instant::now();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2500));
            holder.release().unwrap();
        });
        // A one-second slice stands in for 255 s: the first attempt, with
        // a wait of 0 (no server has answered yet), and two waits run out
        // (three `T`); the next attempt is granted when the holder lets go.
        let ticket = acquire_until_granted(
            &client,
            "forever",
            Duration::from_secs(5),
            &AcquireOptions::new(),
            Duration::from_secs(1),
        )
        .unwrap();
        let waited = started.elapsed();
        releaser.join().unwrap();
        assert!(waited >= Duration::from_millis(2500), "{waited:?}");
        assert!(waited < Duration::from_secs(4), "{waited:?}");
        let info = client.info().unwrap();
        for counter in ["timeouts=3", "grants=2", "released=1"] {
            assert!(
                info.split(' ').any(|pair| pair == counter),
                "{counter}: {info}"
            );
        }
        ticket.release().unwrap();
        // Other outcomes end the wait at once.
        assert_eq!(
            acquire_until_granted(
                &client,
                "",
                Duration::from_secs(5),
                &AcquireOptions::new(),
                Duration::from_secs(1)
            )
            .unwrap_err(),
            Error::InvalidArgument("key is empty")
        );
        stop.shut_down();
        running.join().unwrap().unwrap();
    }

    /// A server on a free loopback port, running on its own thread.
    fn start_server(
        listen: &str,
    ) -> (
        Address,
        crate::server::ShutdownHandle,
        std::thread::JoinHandle<std::io::Result<()>>,
    ) {
        let server = Server::bind(ServerConfig {
            listen: vec![listen.parse().unwrap()],
            ..Default::default()
        })
        .unwrap();
        let address = server.addresses()[0].clone();
        let stop = server.shutdown_handle();
        (address, stop, std::thread::spawn(move || server.run()))
    }

    /// A TCP relay to `upstream`: requests pass, answers are dropped while
    /// `swallow` is set. Returns its address.
    fn relay(upstream: String, swallow: Arc<AtomicBool>) -> Address {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = std::net::TcpStream::connect(&upstream) else {
                    continue;
                };
                let (mut from_client, mut to_server) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || std::io::copy(&mut from_client, &mut to_server));
                let (mut from_server, mut to_client) = (server, client);
                let swallow = swallow.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    loop {
                        match std::io::Read::read(&mut from_server, &mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(_) if swallow.load(AtomicOrdering::SeqCst) => {}
                            Ok(n) => {
                                if std::io::Write::write_all(&mut to_client, &buf[..n]).is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        address.parse().unwrap()
    }

    /// Spec §9 `--wait inf`, rule 11: after an `Indeterminate` acquire the
    /// call's own grant is found with `Q` and released, then the key is
    /// asked for again. Without the clean-up the next attempt would queue
    /// behind that grant for its whole 30 s lease.
    #[test]
    fn waiting_forever_releases_its_own_unseen_grant_after_indeterminate() {
        let (address, stop, running) = start_server("127.0.0.1:0");
        let swallow = Arc::new(AtomicBool::new(true));
        let relayed = relay(address.to_string(), swallow.clone());
        let client = Client::new([relayed], Config::default()).unwrap();
        let started = Instant::now();
        let unswallow = {
            let swallow = swallow.clone();
            std::thread::spawn(move || {
                // Before the first attempt's deadline (a wait of 0, the
                // first attempt's, + 5 s): its answer is gone by then,
                // later ones pass.
                std::thread::sleep(Duration::from_millis(4500));
                swallow.store(false, AtomicOrdering::SeqCst);
            })
        };
        let ticket = acquire_until_granted(
            &client,
            "unseen",
            Duration::from_secs(30),
            &AcquireOptions::new(),
            Duration::from_secs(1),
        )
        .unwrap();
        let waited = started.elapsed();
        unswallow.join().unwrap();
        assert!(waited >= Duration::from_secs(5), "{waited:?}");
        assert!(waited < Duration::from_secs(8), "{waited:?}");
        let info = client.info().unwrap();
        for counter in ["grants=2", "released=1", "timeouts=0"] {
            assert!(
                info.split(' ').any(|pair| pair == counter),
                "{counter}: {info}"
            );
        }
        ticket.release().unwrap();
        stop.shut_down();
        running.join().unwrap().unwrap();
    }

    const S: Duration = Duration::from_secs(1);
    const MS: Duration = Duration::from_millis(1);

    /// A wait forever that hears from no server says so 10 s into the
    /// silence, then at 20 s, 40 s, 80 s, …: the gaps double up to an
    /// hour. An answer starts the count again.
    #[test]
    fn silence_is_said_after_10_s_then_at_doubling_gaps() {
        let start = Instant::now();
        let mut silence = Silence::new(start);
        let failure = Some("127.0.0.1:9: Connection refused (os error 111)");
        let said = "waiting for \"job\" (--wait inf): no server has answered for 10 s (the \
                    last attempt: 127.0.0.1:9: Connection refused (os error 111)); still trying";
        assert_eq!(
            silence.unheard(start + 10 * S - MS, "job", failure, &[]),
            [] as [String; 0]
        );
        assert_eq!(silence.unheard(start + 10 * S, "job", failure, &[]), [said]);
        assert!(
            silence
                .unheard(start + 12 * S, "job", failure, &[])
                .is_empty()
        );
        assert!(
            silence
                .unheard(start + 20 * S - MS, "job", failure, &[])
                .is_empty()
        );
        let second = silence.unheard(start + 20 * S, "job", failure, &[]);
        assert_eq!(second.len(), 1);
        assert!(second[0].contains(" for 20 s "), "{second:?}");
        assert!(
            silence
                .unheard(start + 39 * S, "job", failure, &[])
                .is_empty()
        );
        let third = silence.unheard(start + 41 * S, "job", None, &[]);
        assert_eq!(
            third,
            [
                "waiting for \"job\" (--wait inf): no server has answered for 40 s (no \
              connection attempt failed, but nothing was answered); still trying"
            ]
        );
        // A long attempt in between: one word, and the next is the doubling
        // after it (not one per missed step).
        assert_eq!(silence.unheard(start + 700 * S, "job", None, &[]).len(), 1);
        assert!(
            silence
                .unheard(start + 1279 * S, "job", None, &[])
                .is_empty()
        );
        assert_eq!(silence.unheard(start + 1280 * S, "job", None, &[]).len(), 1);
        // The gaps double up to an hour, then stay an hour.
        let mut silence = Silence::new(start);
        let mut due = 10 * S;
        assert_eq!(silence.unheard(start + due, "job", None, &[]).len(), 1);
        for gap in [10, 20, 40, 80, 160, 320, 640, 1280, 2560, 3600, 3600, 3600] {
            due += gap * S;
            assert!(
                silence
                    .unheard(start + due - MS, "job", None, &[])
                    .is_empty()
            );
            let word = silence.unheard(start + due, "job", None, &[]);
            assert!(
                word[0].contains(&format!(" for {} s ", due.as_secs())),
                "{word:?}"
            );
        }
        // An answer ends the silence: 10 s from it again.
        silence.heard(start + 30_000 * S);
        assert!(
            silence
                .unheard(start + 30_009 * S, "job", None, &[])
                .is_empty()
        );
        assert_eq!(
            silence.unheard(start + 30_010 * S, "job", None, &[]).len(),
            1
        );
    }

    /// A host name that does not resolve gets its own line, before the
    /// one with the last connection failure.
    #[test]
    fn a_name_that_does_not_resolve_is_said_on_its_own_line() {
        let start = Instant::now();
        let mut silence = Silence::new(start);
        let why = "nosuchhost.invalid:5862: failed to lookup address information: \
                   Name or service not known";
        assert_eq!(
            silence.unheard(start + 10 * S, "job", Some(why), &[why.to_owned()]),
            [
                format!(
                    "waiting for \"job\" (--wait inf): the host name does not resolve: {why}. \
                     Check the address (--server, KUNCI_SERVER); still trying"
                ),
                format!(
                    "waiting for \"job\" (--wait inf): no server has answered for 10 s (the \
                     last attempt: {why}); still trying"
                ),
            ]
        );
    }

    /// Spec §9 `--wait inf`: `Unavailable` (no server at the address yet)
    /// is tried again after a pause, until the server is there.
    #[test]
    fn waiting_forever_waits_through_an_outage() {
        // A unix socket path that nothing listens on yet: unlike a TCP port
        // let go of for later, no other test can take it meanwhile.
        let dir = std::env::temp_dir().join(format!("kunci-outage-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kunci.sock");
        let _ = std::fs::remove_file(&path);
        let listen = format!("unix:{}", path.display());
        let client = Client::new([listen.parse().unwrap()], Config::default()).unwrap();
        let started = Instant::now();
        let later = std::thread::spawn(move || {
            // Past the first attempt's deadline (wait 0 + 5 s).
            std::thread::sleep(Duration::from_millis(6000));
            start_server(&listen)
        });
        let ticket = acquire_until_granted(
            &client,
            "outage",
            Duration::from_secs(5),
            &AcquireOptions::new(),
            Duration::ZERO,
        )
        .unwrap();
        let waited = started.elapsed();
        let (_, stop, running) = later.join().unwrap();
        assert!(waited >= Duration::from_secs(6), "{waited:?}");
        assert!(waited < Duration::from_secs(9), "{waited:?}");
        ticket.release().unwrap();
        stop.shut_down();
        running.join().unwrap().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
